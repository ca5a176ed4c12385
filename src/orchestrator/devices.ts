// The block devices a VM starts on, from blockd: the node's one tools disk and a rootfs over a
// layer stack with a fresh upper (from blockd's pool, prepared ahead for a template's stack).
import { mkdirSync } from "node:fs";
import { join } from "node:path";
import type { DriveSpec } from "../vmm/types.ts";
import { OrchestratorError } from "./errors.ts";
import type { ResumeDevice } from "./ledger.ts";
import type { NodeState } from "./node_state.ts";
import type { SandboxRecord, VolumeMount } from "./store.ts";
import { isRemoteLayer, type TemplateLayer, type VmCheckpoint } from "./templates.ts";

/** The node's one tools disk device (a reference taken once; every VM opens the same file). */
export function toolsDisk(node: NodeState): Promise<{ id: string; path: string }> {
  node.tools ??= node.blockd.call<{ id: string; path: string }>("createReadOnly", { lowers: [node.guest.toolsLayer] }).then((d) => {
    node.toolsId = d.id;
    return d;
  }, (e) => {
    node.tools = undefined;
    throw e;
  });
  return node.tools;
}

/**
 * The tools disk and a rootfs with a fresh upper (`held`: one already acquired, a resume's);
 * the rootfs id is pushed to `taken` once made.
 */
export async function drives(node: NodeState, taken: string[], layers: TemplateLayer[], upperDir: string, diskSizeMB: number, held?: ResumeDevice): Promise<{ drives: DriveSpec[] }> {
  const tools = await toolsDisk(node);
  const rootfs = held ?? (await acquireRootfs(node, layers, upperDir, diskSizeMB));
  if (!held) taken.push(rootfs.id);
  return { drives: [{ path: tools.path, readOnly: true }, { path: rootfs.path }] };
}

/** Volumes one sandbox mounts: /dev/vdc on (virtio-blk letters after the tools disk and the rootfs). */
export const VOLUME_MOUNTS_MAX = 8;

/**
 * The sandbox's volumes as drives after its rootfs, held for it, and the kernel command line that
 * mounts them in the guest (`aenv.vol=<device>:<path>`, guest/init/run).
 */
export async function volumeDrives(node: NodeState, sandboxId: string, mounts: VolumeMount[]): Promise<{ drives: DriveSpec[]; cmdline: string }> {
  if (!mounts.length) return { drives: [], cmdline: "" };
  if (mounts.length > VOLUME_MOUNTS_MAX) throw new OrchestratorError(400, `at most ${VOLUME_MOUNTS_MAX} volumes per sandbox`);
  const volumes = node.opts.volumes;
  if (!volumes) throw new OrchestratorError(400, "this node serves no volumes");
  const drives: DriveSpec[] = [];
  const args: string[] = [];
  for (const [i, m] of mounts.entries()) {
    const v = await volumes.attach(m.name, sandboxId);
    drives.push({ path: v.devicePath });
    args.push(`aenv.vol=/dev/vd${String.fromCharCode(0x63 + i)}:${m.path}`);
  }
  return { drives, cmdline: args.join(" ") };
}

/**
 * A fork's children or a snapshot's sandboxes would be second writers of the volumes the source
 * mounts (ext4 has one writer): refused with 409 while it mounts any.
 */
export function refuseWithVolumes(rec: SandboxRecord, op: "fork" | "snapshot" | "move"): void {
  if (rec.volumeMounts?.length) throw new OrchestratorError(409, `sandbox ${rec.id} mounts volumes (${rec.volumeMounts.map((m) => m.name).join(", ")}): a ${op} would make a second writer of them; kill it or create a sandbox without volumes`);
}

/** From blockd's pool: for a prepared stack, a device with the lowers already open. */
export async function acquireRootfs(node: NodeState, layers: TemplateLayer[], upperDir: string, diskSizeMB: number): Promise<{ id: string; path: string }> {
  mkdirSync(join(upperDir, ".."), { recursive: true });
  return node.blockd.call("acquire", { lowers: await lowers(node, layers), upperDir, size: diskSizeMB * 1024 * 1024 });
}

/** A stack as blockd's lowers: files as they are, remote layers as the node hands them over now. */
function lowers(node: NodeState, layers: TemplateLayer[]): Promise<TemplateLayer[]> {
  const view = node.opts.remoteLayer;
  if (!view || !layers.some(isRemoteLayer)) return Promise.resolve(layers);
  return Promise.all(layers.map((l) => (isRemoteLayer(l) ? view(l) : l)));
}

/**
 * Asks blockd to keep rootfs devices ready for a checkpoint's stack (count 0 retires them), for
 * `acquires` acquires of it if given (a fork's children). Best effort: without them, creates
 * take the plain acquire path.
 */
export function prepareDevices(node: NodeState, cp: VmCheckpoint, diskSizeMB: number, count = node.opts.preparedDevices ?? 2, acquires?: number): Promise<void> {
  // Its memory device too: kept open while devices are kept ready for the stack.
  if (cp.memLayers?.length) {
    if (count > 0) node.memDevices.pin(cp.memLayers);
    else node.memDevices.unpin(cp.memLayers);
  }
  const failed = (e: unknown) => console.error(`orchestrator: prepare devices for ${cp.dir}: ${(e as Error).message}`);
  // Resolves once the call is sent (a later call for the same stack then lands after it).
  return lowers(node, cp.layers).then((lowers) => {
    node.blockd.call("prepare", { lowers, size: diskSizeMB * 1024 * 1024, count, acquires }).catch(failed);
  }).catch(failed);
}

/** At node start: devices ready for every template that has a checkpoint. */
export function warmUp(node: NodeState): void {
  for (const t of node.templates.list("template")) if (t.checkpoint) prepareDevices(node, t.checkpoint, t.diskSizeMB);
}
