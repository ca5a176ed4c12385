// The sandbox ledger: what a sandbox holds (docs/node.md, Lifecycle), derived from its row's
// SandboxRuntime and the node's maps, and the one teardown that gives it back. The leak report
// (deviceHolders) names devices from the same list, so it and the teardown never disagree.
import { rm } from "node:fs/promises";
import { join } from "node:path";
import type { Slot } from "../network/index.ts";
import type { Vmm } from "../vmm/types.ts";
import { OrchestratorError } from "./errors.ts";
import type { NodeState } from "./node_state.ts";
import { type ListedDevice, ownedByBlockd } from "./orphans.ts";
import type { SandboxState } from "./store.ts";
import { localLayers, type TemplateLayer, type VmCheckpoint } from "./templates.ts";

/** What the store keeps of a sandbox's parts, to find them again (and to give them back). */
export interface SandboxRuntime {
  slot: Slot | null;
  /** Unused: the tools disk is one device per node, held by the orchestrator (kept for old rows). */
  toolsDevice: string | null;
  rootfsDevice: string | null;
  upperDir: string | null;
  /** Rootfs lowers, lowest first. */
  layers: TemplateLayer[];
  vmPid: number | null;
  runDir: string | null;
  /** Set while paused: the checkpoint a resume restores. */
  paused: VmCheckpoint | null;
  /** Checkpoints whose files this sandbox still uses (its lowers, or the memory it was restored from). */
  checkpoints: string[];
  /** Memory layers the VM runs on, lowest first (absent in old rows). */
  memLayers?: string[];
  /** The blockd read-only device over memLayers that the VMM maps, while it runs. */
  memDevice?: string | null;
  /** Set while paused (the last RESUME_READY_MAX to pause): its resume's rootfs device, acquired at the pause. */
  resumeDevice?: ResumeDevice | null;
}

/** A rootfs device over a paused sandbox's stack with a fresh upper, held for its resume (no blockd call then). */
export interface ResumeDevice {
  id: string;
  path: string;
  upperDir: string;
}

/** One thing a sandbox holds, in the order teardown gives them back: its VM's parts (VM_PARTS), then what lasts until it goes. */
export type Holding =
  /** Its VMM: the one this process drives, else the one recorded in its run directory. */
  | { what: "vmm"; vm: Vmm | undefined; runDir: string | null }
  /** Its rootfs device (its start traces end on it first). */
  | { what: "rootfs"; device: string }
  /** Its VM's use of a memory device (MemoryDevices counts the users of the node's shared devices). */
  | { what: "memory device use" }
  /** Its network slot, with its egress policy. */
  | { what: "slot"; slot: Slot }
  | { what: "run dir"; dir: string }
  | { what: "upper"; dir: string }
  /** A memory device kept warm for its resume (MemoryDevices, by holder). */
  | { what: "warm memory device" }
  /** The rootfs device held for its resume, if its row names one (and its place among RESUME_READY_MAX). */
  | { what: "resume device"; device: ResumeDevice | null }
  | { what: "metric samples" }
  /** The volumes it mounts (held from its first start until it goes; a pause keeps them). */
  | { what: "volumes" }
  /** $AENV_HOME/sandboxes/<id>: its uppers. */
  | { what: "sandbox dir"; dir: string }
  /** Its row, which names the checkpoints it uses: they go at the next collectCheckpoints once it is deleted. */
  | { what: "row"; checkpoints: string[] };

/** Its VM's parts: what a teardown that keeps it paused gives back, and a pause too (but the VMM, which its checkpoint stopped). */
const VM_PARTS = new Set<Holding["what"]>(["vmm", "rootfs", "memory device use", "slot", "run dir", "upper"]);

/** The checkpoint directories whose files a VM started from `cp` uses: its own, its lowers', its memory layers'. */
export function checkpointDirs(cp: VmCheckpoint): string[] {
  return [...new Set([cp.dir, ...localLayers(cp.layers).map((l) => join(l, "..")), ...(cp.memLayers ?? []).map((l) => join(l, ".."))])];
}

/** The sandbox's runtime record; a 500 when it has none. */
export function runtimeOf(node: NodeState, id: string): SandboxRuntime {
  const r = node.store.get(id);
  if (!r?.runtime) throw new OrchestratorError(500, `sandbox ${id} has no runtime record`);
  return r.runtime as SandboxRuntime;
}

/** Everything sandbox `id` holds, from its runtime record `rt` (its row's, or a start's) and the node's maps. */
export function holdings(node: NodeState, id: string, rt: SandboxRuntime | null | undefined): Holding[] {
  const live = node.live.get(id);
  const out: Holding[] = [];
  if (live || rt?.runDir) out.push({ what: "vmm", vm: live?.vm, runDir: rt?.runDir ?? null });
  if (rt?.rootfsDevice) out.push({ what: "rootfs", device: rt.rootfsDevice });
  out.push({ what: "memory device use" });
  if (rt?.slot) out.push({ what: "slot", slot: rt.slot });
  if (rt?.runDir) out.push({ what: "run dir", dir: rt.runDir });
  if (rt?.upperDir) out.push({ what: "upper", dir: rt.upperDir });
  out.push(
    { what: "warm memory device" },
    { what: "resume device", device: rt?.resumeDevice ?? null },
    { what: "metric samples" },
    { what: "volumes" },
    { what: "sandbox dir", dir: join(node.opts.home, "sandboxes", id) },
    { what: "row", checkpoints: rt?.checkpoints ?? [] },
  );
  return out;
}

/**
 * Gives back everything a sandbox holds, whatever state it is in, its row last; idempotent.
 * `keepPaused`: only its VM's parts (a resume that failed, or one a restart interrupted): it stays paused.
 */
export async function teardown(node: NodeState, id: string, o: { keepPaused?: boolean } = {}): Promise<void> {
  node.gone(id);
  await node.cleanups.get(id);
  const rt = node.store.get(id)?.runtime as SandboxRuntime | null | undefined;
  const all = holdings(node, id, rt);
  await giveBack(node, id, o.keepPaused ? all.filter((h) => VM_PARTS.has(h.what)) : all);
}

/** A pause's cleanup: what its VM held (`rt`: its runtime before the pause) goes back; the VMM is stopped already. */
export async function giveBackVm(node: NodeState, id: string, rt: SandboxRuntime): Promise<void> {
  await giveBack(node, id, holdings(node, id, rt).filter((h) => VM_PARTS.has(h.what) && h.what !== "vmm"));
}

async function giveBack(node: NodeState, id: string, list: Holding[]): Promise<void> {
  for (const h of list) {
    switch (h.what) {
      case "vmm":
        if (h.vm) {
          await h.vm.stop().catch(() => {});
          node.live.delete(id);
        } else if (h.runDir) {
          // A VM this process does not hold (started before a restart): stopped only if it is still
          // the one recorded in its run directory (pids are reused).
          await node.driver.adopt(h.runDir).then((vm) => vm.stop()).catch(() => {});
        }
        break;
      case "rootfs":
        await giveBackRootfs(node, h.device);
        break;
      case "memory device use":
        node.memDevices.release(id);
        break;
      case "slot":
        await node.opts.egress?.clear(h.slot).catch((e) => console.error(`orchestrator: clearing the egress policy of ${h.slot.netns}: ${(e as Error).message}`));
        await node.slots.release(h.slot).catch(() => {});
        break;
      case "run dir":
      case "upper":
      case "sandbox dir":
        await rm(h.dir, { recursive: true, force: true });
        break;
      case "warm memory device":
        node.memDevices.forget(id);
        break;
      case "resume device":
        await dropResumeDevice(node, id);
        break;
      case "metric samples":
        node.samples.delete(id);
        break;
      case "volumes":
        await node.opts.volumes?.detach(id).catch((e) => console.error(`orchestrator: the volumes of ${id}: ${(e as Error).message}`));
        break;
      case "row":
        node.store.delete(id);
        node.removed(id);
        break;
    }
  }
}

/** Checkpoint directories some sandbox's row names (its `row` holding): collectCheckpoints keeps them. */
export function checkpointsInUse(node: NodeState): Set<string> {
  const used = new Set<string>();
  for (const r of node.store.all()) {
    for (const h of holdings(node, r.id, r.runtime as SandboxRuntime | null)) if (h.what === "row") for (const c of h.checkpoints) used.add(c);
  }
  return used;
}

/** A rootfs device goes back to blockd's pool; recordings of its start traces end first. */
export async function giveBackRootfs(node: NodeState, device: string | null | undefined): Promise<void> {
  if (!device) return;
  node.traces.endOn(device);
  await node.blockd.call("release", { id: device }).catch((e) => console.error(`orchestrator: release ${device}: ${(e as Error).message}`));
}

/** Paused sandbox `id` gives back its ResumeDevice: its row stops naming it first. */
export async function dropResumeDevice(node: NodeState, id: string): Promise<void> {
  node.resumeReady.delete(id);
  const rt = node.store.get(id)?.runtime as SandboxRuntime | null | undefined;
  const d = rt?.resumeDevice;
  if (!d) return;
  node.store.setRuntime(id, { ...rt, resumeDevice: null });
  await giveBackRootfs(node, d.id);
  await rm(d.upperDir, { recursive: true, force: true });
}

/** Each blockd device the node holds, with who holds it (the leak report of GET /nodes/{id}). */
export function deviceHolders(node: NodeState, devices: ListedDevice[]): Map<string, string> {
  const out = new Map<string, string>([...node.memDevices.holders(), ...(node.opts.volumes?.holders() ?? [])]);
  const name = (id: string | null | undefined, why: string) => id && out.set(id, why);
  name(node.toolsId, "the tools disk");
  const sandbox = (id: string, state: SandboxState | "starting", rt: SandboxRuntime | null) => {
    for (const h of holdings(node, id, rt)) {
      if (h.what === "rootfs") name(h.device, `sandbox ${id} (${state}): rootfs`);
      if (h.what === "resume device") name(h.device?.id, `sandbox ${id} (${state}): rootfs held for its resume`);
    }
  };
  for (const r of node.store.all()) sandbox(r.id, r.state, r.runtime as SandboxRuntime | null);
  for (const [id, rt] of node.starting) sandbox(id, "starting", rt);
  for (const [id, held] of node.boots) for (const d of held.devices) name(d, `${id.startsWith("bld") ? "build VM" : "template boot"} ${id}: rootfs`);
  for (const d of devices) {
    const blockd = ownedByBlockd(d);
    if (blockd && !out.has(d.id)) out.set(d.id, blockd);
    // The tools disk: one shared read-only device (by its layer: a restarted node's is the same device).
    else if (d.kind === "ro" && d.config?.lowers?.length === 1 && layerFile(d.config.lowers[0]) === node.guest.toolsLayer) out.set(d.id, "the tools disk");
  }
  return out;
}

/** A lower's file as blockd lists it (`{file}`; a plain path in older tables). */
function layerFile(l: unknown): unknown {
  return typeof l === "string" ? l : (l as { file?: unknown } | null)?.file;
}

/** blockd's devices, each with its holder; "orphan" for one nobody holds (given back by the reaper's next sweep). */
export async function devicesReport(node: NodeState): Promise<{ id: string; kind: string; acquired: boolean; readOnly: boolean; holder: string }[]> {
  const devices = await node.blockd.call<ListedDevice[]>("list");
  const holders = deviceHolders(node, devices);
  return devices.map((d) => ({ id: d.id, kind: d.kind, acquired: d.acquired ?? false, readOnly: d.readOnly, holder: holders.get(d.id) ?? "orphan" }));
}
