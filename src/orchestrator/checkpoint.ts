// Checkpoints of a running VM (pause, fork, snapshot) into $AENV_HOME/checkpoints: its device
// state, its memory as layers, its rootfs upper sealed into a layer; and their collection once no
// sandbox and no template refers to them.
import { mkdir, readdir, rm } from "node:fs/promises";
import { join } from "node:path";
import { writeSnapshot, type SnapshotInfo, type Vmm } from "../vmm/types.ts";
import { OrchestratorError } from "./errors.ts";
import { randomId } from "./ids.ts";
import { checkpointsInUse, type SandboxRuntime } from "./ledger.ts";
import type { NodeState } from "./node_state.ts";
import type { VmCheckpoint } from "./templates.ts";
import { PhaseClock } from "./timings.ts";

/** Memory layers a sandbox stacks before its next pause compacts them into one, by default (AgentENV: 32). */
export const MEMORY_LAYERS_MAX = 32;

/**
 * Pauses the VM, writes its device state and memory into a new checkpoint directory and seals the
 * rootfs upper into a layer there (the device carries on over a fresh upper). `resumable`: the
 * VM may run again (memory copied), else the checkpoint takes its memory over. `stop` (a pause):
 * the VMM is stopped once its state is written. The rootfs is restacked while the VMM works
 * (QEMU: from its pause on, which drains and flushes every disk; otherwise once the snapshot
 * has flushed them), so the restack costs only what outlasts the VMM. `onSealed`: the new
 * stack, as soon as its layer is sealed (a fork prepares its children's devices meanwhile).
 */
export async function checkpoint(node: NodeState, id: string, vm: Vmm, rt: SandboxRuntime, o: { resumable: boolean; stop?: () => Promise<void>; onSealed?: (cp: VmCheckpoint) => void }, clock = new PhaseClock()): Promise<VmCheckpoint> {
  const envdToken = node.store.get(id)?.envdAccessToken ?? null;
  const dir = join(node.opts.home, "checkpoints", `${id}-${randomId(8)}`);
  const layer = join(dir, "rootfs.layer");
  const cp: VmCheckpoint = { dir, layers: [...rt.layers, layer], envdToken };
  let sealed = false;
  try {
    clock.lap("record");
    // QEMU's stop (vm_stop) drains and flushes the disks: nothing reaches the rootfs after it.
    const early = vm.kind === "qemu";
    if (early) {
      await vm.pause();
      await mkdir(dir, { recursive: true });
    }
    const restack = () => {
      // The restack ends a recording on the device: it is written first, as far as it got.
      if (rt.rootfsDevice) node.traces.endOn(rt.rootfsDevice);
      return node.blockd.call("restack", { id: rt.rootfsDevice, layerPath: layer }).then(() => {
        sealed = true;
        o.onSealed?.(cp);
      });
    };
    const sealing = early ? restack() : undefined;
    const snap = vm.snapshot(dir, { resumable: o.resumable });
    const vmm = snap.then(async (info) => {
      clock.lap("vmm");
      // The dirty pages are read from the VMM process: before it stops or runs on.
      cp.memLayers = await memoryLayers(node, info, rt.memLayers);
      clock.lap("memory");
      if (o.stop) await o.stop();
      clock.lap("vmm");
    });
    const [ran, restacked] = await Promise.allSettled([vmm, sealing ?? snap.then(restack)]);
    if (restacked.status === "rejected") throw restacked.reason;
    if (ran.status === "rejected") throw ran.reason;
    clock.lap("restack");
    return cp;
  } catch (e) {
    if (!sealed) await rm(dir, { recursive: true, force: true });
    else for (const f of await readdir(dir).catch(() => [] as string[])) if (f !== "rootfs.layer") await rm(join(dir, f), { recursive: true, force: true });
    throw e;
  } finally {
    if (sealed) keepSealed(node, id, rt, cp);
  }
}

/** A sealed layer is a lower of the rootfs from then on, checkpoint or not: the sandbox keeps it. */
function keepSealed(node: NodeState, id: string, rt: SandboxRuntime, cp: VmCheckpoint): void {
  rt.layers = cp.layers;
  rt.checkpoints = [...rt.checkpoints, cp.dir];
  node.store.setRuntime(id, rt);
}

/**
 * A filesystem-only checkpoint (E2B `pause({memory: false})`): the guest's file systems synced
 * (`sync`, best effort: ext4's journal covers a guest that does not answer), the VM stopped and its
 * rootfs upper sealed into a layer. No device state, no memory: its start boots (cp.boot).
 */
export async function diskCheckpoint(node: NodeState, id: string, rt: SandboxRuntime, o: { sync: () => Promise<void>; stop: () => Promise<void> }, clock = new PhaseClock()): Promise<VmCheckpoint> {
  const dir = join(node.opts.home, "checkpoints", `${id}-${randomId(8)}`);
  const layer = join(dir, "rootfs.layer");
  const cp: VmCheckpoint = { dir, layers: [...rt.layers, layer], envdToken: null, boot: true };
  await o.sync().catch((e) => console.error(`orchestrator: sync in ${id} before its filesystem-only pause: ${(e as Error).message}`));
  clock.lap("sync");
  await o.stop();
  clock.lap("vmm");
  let sealed = false;
  try {
    await mkdir(dir, { recursive: true });
    if (rt.rootfsDevice) node.traces.endOn(rt.rootfsDevice);
    await node.blockd.call("restack", { id: rt.rootfsDevice, layerPath: layer });
    sealed = true;
    clock.lap("restack");
    return cp;
  } catch (e) {
    if (!sealed) await rm(dir, { recursive: true, force: true });
    throw e;
  } finally {
    if (sealed) keepSealed(node, id, rt, cp);
  }
}

/**
 * A snapshot's memory as layers (docs/vmm.md, "Memory layers"): its delta (the pages dirtied
 * since the VM's memory image) stacked on `below`, a fresh base layer past memoryLayersMax,
 * or its whole memory file as a base layer (the file then goes). Undefined: none of these.
 */
export async function memoryLayers(node: NodeState, snap: SnapshotInfo, below: string[] | undefined): Promise<string[] | undefined> {
  const out = join(snap.dir, "mem.layer");
  const d = snap.delta;
  if (d) {
    if (!below?.length) throw new OrchestratorError(500, `${snap.dir}: a memory delta with no memory layers below it`);
    let pagesFile = d.pagesFile;
    const compact = compactsMemory(node, below);
    if (compact) {
      // Compaction: every page of the guest into one base layer (its cost is the guest's size, once in memoryLayersMax pauses).
      pagesFile = join(snap.dir, "mem.all");
      await Bun.write(pagesFile, new Uint32Array([0, d.size / d.pageSize]));
    }
    await node.blockd.call("memoryLayer", { out, size: d.size, from: { pid: d.pid, address: d.address, pagesFile }, zfile: node.opts.memoryZfile });
    await rm(d.pagesFile, { force: true });
    if (compact) await rm(pagesFile, { force: true });
    return compact ? [out] : [...below, out];
  }
  if (!snap.memPath) return undefined;
  await node.blockd.call("memoryLayer", { out, size: snap.spec.memMiB * 1024 * 1024, from: { file: snap.memPath }, zfile: node.opts.memoryZfile });
  await rm(snap.memPath, { force: true });
  await writeSnapshot({ ...snap, memPath: undefined, memoryImage: true });
  return [out];
}

/** A memory delta over `below` is written as one fresh base instead (memoryLayersMax). */
export function compactsMemory(node: NodeState, below: string[]): boolean {
  return below.length >= (node.opts.memoryLayersMax ?? MEMORY_LAYERS_MAX);
}

/**
 * Removes checkpoint directories no sandbox and no template refers to any more. Runs one at a
 * time: a call while one runs makes that one go round again, and both resolve when it ends.
 */
export function collectCheckpoints(node: NodeState): Promise<string[]> {
  if (node.collecting) {
    node.collectAgain = true;
    return node.collecting;
  }
  const run = async (): Promise<string[]> => {
    const removed: string[] = [];
    do {
      node.collectAgain = false;
      removed.push(...(await collectCheckpointsOnce(node)));
    } while (node.collectAgain);
    return removed;
  };
  node.collecting = run().finally(() => { node.collecting = undefined; });
  return node.collecting;
}

async function collectCheckpointsOnce(node: NodeState): Promise<string[]> {
  const root = join(node.opts.home, "checkpoints");
  const names = await readdir(root).catch(() => [] as string[]);
  // What is in use is read after the listing: a checkpoint recorded meanwhile is kept.
  const used = checkpointsInUse(node);
  for (const l of node.templates.layersInUse()) if (!l.startsWith("remote:")) used.add(join(l, ".."));
  for (const t of [...node.templates.list("template"), ...node.templates.list("snapshot")]) if (t.checkpoint) used.add(t.checkpoint.dir);
  for (const p of node.preparing.keys()) used.add(join(root, `template-${p}`));
  for (const d of node.buildCheckpoints) used.add(d);
  const removed: string[] = [];
  for (const name of names) {
    const dir = join(root, name);
    if (used.has(dir) || inflightCheckpoint(node, dir)) continue;
    await rm(dir, { recursive: true, force: true });
    removed.push(dir);
  }
  return removed;
}

/** Starts a collection after an operation; its failure is logged, never the operation's. */
export function collectCheckpointsLater(node: NodeState): void {
  collectCheckpoints(node).catch((e) => console.error(`orchestrator: collecting checkpoints: ${(e as Error).message}`));
}

/** A checkpoint being written right now belongs to a sandbox with an operation in flight. */
function inflightCheckpoint(node: NodeState, dir: string): boolean {
  const name = dir.slice(dir.lastIndexOf("/") + 1);
  for (const id of node.inflight.keys()) if (name.startsWith(`${id}-`)) return true;
  return false;
}
