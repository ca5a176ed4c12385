// Cold boots: a template's one checkpointing boot (creates restore its checkpoint instead), and
// the VMs of template builds. Each records what it holds in a BootHeld as it takes it, and
// giveBackBoot gives all of it back.
import { mkdirSync } from "node:fs";
import { rm } from "node:fs/promises";
import { join } from "node:path";
import type { Slot } from "../network/index.ts";
import type { Vmm } from "../vmm/types.ts";
import { collectCheckpointsLater, memoryLayers } from "./checkpoint.ts";
import { drives, prepareDevices } from "./devices.ts";
import { ENVD_PORT, waitEnvdReady } from "./envd.ts";
import { asOrchestratorError, OrchestratorError } from "./errors.ts";
import { randomId } from "./ids.ts";
import { giveBackRootfs } from "./ledger.ts";
import type { NodeState } from "./node_state.ts";
import { BOOT_TRACE, beginBootTrace, endBootTrace } from "./start_traces.ts";
import { isRemoteLayer, type TemplateLayer, type TemplateRecord, type VmCheckpoint } from "./templates.ts";

export interface VmSize {
  cpuCount: number;
  memoryMB: number;
  diskSizeMB: number;
}

/** What a cold boot has taken so far (given back by giveBackBoot). */
export interface BootHeld {
  slot?: Slot;
  vm?: Vmm;
  /** The rootfs device, once acquired. */
  devices: string[];
  /** The rootfs device's recording of the boot, by its number (start_traces.ts BOOT_TRACE), written at the checkpoint. */
  tracing?: number;
}

/** A template build's VM (Orchestrator.startBuildVm). Its envd has no token: only the node reaches it. */
export interface BuildVm {
  readonly envdUrl: string;
  alive(): boolean;
  /** Pauses the VM, seals its rootfs upper into `layerPath` (the disk carries on over a fresh upper), resumes. */
  seal(layerPath: string): Promise<void>;
  /** Memory and device state plus the sealed upper into a new checkpoint for `templateId`, over `stack`; the VM is left stopped-in-place. */
  checkpoint(templateId: string, stack: TemplateLayer[]): Promise<VmCheckpoint>;
  /** Stops the VM and gives back its slot and device; idempotent. */
  stop(): Promise<void>;
}

/**
 * The template booted once and checkpointed: creates restore this instead of booting. One boot
 * per template at a time; the others wait for it.
 */
export function prepareTemplate(node: NodeState, tpl: TemplateRecord): Promise<VmCheckpoint> {
  const running = node.preparing.get(tpl.id);
  if (running) return running;
  const p = (async () => {
    const id = `tpl${randomId(12)}`;
    const cpDir = join(node.opts.home, "checkpoints", `template-${tpl.id}`);
    await rm(cpDir, { recursive: true, force: true });
    mkdirSync(cpDir, { recursive: true });
    const held: BootHeld = { devices: [] };
    try {
      const vm = await coldBoot(node, id, tpl.layers, tpl, held);
      const snap = await vm.snapshot(cpDir, { resumable: false });
      if (held.tracing !== undefined) await endBootTrace(node.blockd, held.devices[0]!, held.tracing, join(cpDir, BOOT_TRACE));
      const layer = join(cpDir, "rootfs.layer");
      await node.blockd.call("restack", { id: held.devices[0], layerPath: layer });
      const cp: VmCheckpoint = { dir: cpDir, layers: [...tpl.layers, layer], envdToken: null, memLayers: await memoryLayers(node, snap, undefined) };
      node.templates.setCheckpoint(tpl.id, cp);
      if (tpl.kind === "template") prepareDevices(node, cp, tpl.diskSizeMB);
      return cp;
    } catch (e) {
      await rm(cpDir, { recursive: true, force: true });
      throw e;
    } finally {
      await giveBackBoot(node, id, held);
      node.preparing.delete(tpl.id);
    }
  })();
  node.preparing.set(tpl.id, p);
  return p;
}

/**
 * A VM cold-booted from `layers` (tools disk, rootfs with a fresh upper, a slot) until envd
 * answers; what it took is recorded in `held` as it is taken, for giveBackBoot.
 */
async function coldBoot(node: NodeState, id: string, layers: TemplateLayer[], size: VmSize, held: BootHeld, pulledTrace?: Uint8Array): Promise<Vmm> {
  node.boots.set(id, held);
  held.slot = await node.slots.acquire();
  const slot = held.slot;
  const upperDir = join(node.opts.home, "sandboxes", id, "upper");
  const { drives: driveSpecs } = await drives(node, held.devices, layers, upperDir, size.diskSizeMB);
  // Its boot is recorded (the template's boot trace); a pulled image's trace is replayed where a layer is remote.
  let replay: string | undefined;
  if (pulledTrace && layers.some(isRemoteLayer)) {
    replay = join(node.opts.home, "sandboxes", id, "pulled.trace");
    await Bun.write(replay, pulledTrace).catch((e) => {
      console.error(`orchestrator: writing ${replay}: ${(e as Error).message}`);
      replay = undefined;
    });
  }
  held.tracing = await beginBootTrace(node.blockd, held.devices[0]!, replay);
  const vm = await node.driver.boot({
    id, runDir: join(node.opts.runRoot, id), kernel: node.guest.kernel, initrd: node.guest.initrd,
    cmdline: node.guest.cmdline(slot), vcpus: size.cpuCount, memMiB: size.memoryMB, drives: driveSpecs,
    net: { tap: slot.tap, mac: slot.guestMac }, netnsPath: slot.netnsPath,
    // Free page reporting returns what the guest frees; the node inflates it under host pressure.
    balloon: true,
  });
  held.vm = vm;
  await waitEnvdReady(`http://${slot.nsIp}:${ENVD_PORT}`, node.envdTimeoutMs, () => vm.state !== "stopped");
  return vm;
}

/** Stops a cold-booted VM and gives back its device, slot and directories; idempotent. */
async function giveBackBoot(node: NodeState, id: string, held: BootHeld): Promise<void> {
  await held.vm?.stop().catch(() => {});
  held.vm = undefined;
  await giveBackRootfs(node, held.devices.shift());
  await rm(join(node.opts.home, "sandboxes", id), { recursive: true, force: true });
  await rm(join(node.opts.runRoot, id), { recursive: true, force: true });
  if (held.slot) await node.slots.release(held.slot).catch(() => {});
  held.slot = undefined;
  node.boots.delete(id);
}

/**
 * A VM for a template build, cold-booted from a clean layer stack (a restore would bring back a
 * page cache that does not match layers added by cached steps). The builder runs steps through
 * its envd, seals the rootfs upper after each step and checkpoints it when ready. `pulledTrace`:
 * the pulled image's boot trace, replayed on the rootfs before the VM starts (remote layers only).
 */
export async function startBuildVm(node: NodeState, layers: TemplateLayer[], size: VmSize, pulledTrace?: Uint8Array): Promise<BuildVm> {
  if (node.closed) throw new OrchestratorError(503, "the node is shutting down");
  const id = `bld${randomId(12)}`;
  const held: BootHeld = { devices: [] };
  let vm: Vmm;
  try {
    vm = await coldBoot(node, id, layers, size, held, pulledTrace);
  } catch (e) {
    await giveBackBoot(node, id, held);
    throw asOrchestratorError(e, "booting the build VM");
  }
  const device = held.devices[0]!;
  return {
    envdUrl: `http://${held.slot!.nsIp}:${ENVD_PORT}`,
    alive: () => vm.state !== "stopped",
    seal: async (layerPath) => {
      await vm.pause();
      try {
        await node.blockd.call("restack", { id: device, layerPath });
      } finally {
        await vm.resume();
      }
    },
    checkpoint: async (templateId, stack) => {
      const dir = join(node.opts.home, "checkpoints", `template-${templateId}-${randomId(8)}`);
      node.buildCheckpoints.add(dir);
      try {
        const snap = await vm.snapshot(dir, { resumable: false });
        if (held.tracing !== undefined) await endBootTrace(node.blockd, device, held.tracing, join(dir, BOOT_TRACE));
        const layer = join(dir, "rootfs.layer");
        await node.blockd.call("restack", { id: device, layerPath: layer });
        return { dir, layers: [...stack, layer], envdToken: null, memLayers: await memoryLayers(node, snap, undefined) };
      } catch (e) {
        discardBuildCheckpoint(node, dir);
        throw e;
      }
    },
    stop: () => giveBackBoot(node, id, held),
  };
}

/** A build checkpoint that will not be published: its directory goes. */
export function discardBuildCheckpoint(node: NodeState, dir: string): void {
  node.buildCheckpoints.delete(dir);
  rm(dir, { recursive: true, force: true }).catch((e) => console.error(`orchestrator: removing ${dir}: ${(e as Error).message}`));
}

/**
 * A finished build becomes the template (a new one, or in place of its previous build: sandboxes
 * of the old build keep its checkpoint until they go). Devices are prepared for the new stack.
 */
export function publishTemplate(node: NodeState, t: TemplateRecord): void {
  const old = node.templates.list("template").find((x) => x.id === t.id);
  node.templates.upsert(t);
  if (t.checkpoint) node.buildCheckpoints.delete(t.checkpoint.dir);
  if (old?.checkpoint && old.checkpoint.dir !== t.checkpoint?.dir) prepareDevices(node, old.checkpoint, old.diskSizeMB, 0);
  if (t.checkpoint) prepareDevices(node, t.checkpoint, t.diskSizeMB);
  collectCheckpointsLater(node);
}
