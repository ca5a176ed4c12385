// Snapshots: a running sandbox's checkpoint kept as a template of kind "snapshot", put into the
// snapshot store (docs/snapshots.md), fetched back into a checkpoint of this node on first use,
// imported at node start when another node took it.
import { mkdirSync } from "node:fs";
import { link, rm } from "node:fs/promises";
import { basename, dirname, join } from "node:path";
import type { Json } from "../snapshot/index.ts";
import { confineSnapshot } from "../vmm/snapshot_paths.ts";
import { readSnapshot, writeSnapshot, type SnapshotInfo } from "../vmm/types.ts";
import { checkpoint, collectCheckpointsLater } from "./checkpoint.ts";
import { prepareDevices, refuseWithVolumes } from "./devices.ts";
import { asOrchestratorError, OrchestratorError } from "./errors.ts";
import { randomId } from "./ids.ts";
import { runtimeOf } from "./ledger.ts";
import type { NodeState } from "./node_state.ts";
import { MEMORY_TRACE, ROOTFS_TRACE } from "./start_traces.ts";
import { isRemoteLayer, type RemoteLayer, type TemplateRecord, type VmCheckpoint } from "./templates.ts";
import { VOLUME_LAYER_STORE_PREFIX } from "./volume_shared.ts";

/** What a stored snapshot's record carries besides its files (`vmstate`, `mem`, `layer-<i>`). */
export interface StoredSnapshotMeta {
  vm: SnapshotInfo;
  layers: number;
  /** Memory layers (`mem-layer-<i>` files), lowest first; 0 or absent: memory in `mem`. */
  memLayers?: number;
  envdToken: string | null;
  alias: string | null;
  names: string[];
  cpuCount: number;
  memoryMB: number;
  diskSizeMB: number;
  envdVersion: string;
  sourceSandboxId: string | null;
  createdAt: number;
  /** Layers left in a registry, by position (no `layer-<i>` file for them). */
  remote?: Record<string, RemoteLayer>;
}

/** A hard link when src and dst share a filesystem, else a copy that keeps holes. */
async function linkOrCopy(src: string, dst: string): Promise<void> {
  try {
    await link(src, dst);
  } catch {
    const p = Bun.spawn(["cp", "--sparse=always", "--reflink=auto", src, dst], { stdout: "ignore", stderr: "pipe" });
    const [err, code] = await Promise.all([new Response(p.stderr).text(), p.exited]);
    if (code !== 0) throw new OrchestratorError(500, `copying ${src}: ${err.trim()}`);
  }
}

/** A named snapshot of a running sandbox: a template of kind "snapshot"; the sandbox keeps running. */
export async function snapshot(node: NodeState, id: string, name: string | undefined): Promise<TemplateRecord> {
  const src = node.sandbox(id);
  if (src.state !== "running" || node.inflight.has(id)) throw new OrchestratorError(409, `sandbox ${id} is ${src.state}, not running`);
  refuseWithVolumes(src, "snapshot");
  if (name !== undefined && node.templates.resolve(name)) throw new OrchestratorError(409, `a template or snapshot named '${name}' exists`);
  if (!node.store.transition(id, ["running"], "snapshotting")) throw new OrchestratorError(409, `sandbox ${id} is busy`);
  const cp = await node.track(id, "snapshot", async () => {
    const rt = runtimeOf(node, id);
    const live = node.live.get(id);
    try {
      if (!live) throw new OrchestratorError(500, `sandbox ${id} has no VM`);
      return await checkpoint(node, id, live.vm, rt, { resumable: true });
    } finally {
      await live?.vm.resume().catch(() => {});
      node.store.transition(id, ["snapshotting"], "running", { runtime: rt });
    }
  });
  const snapId = randomId();
  const alias = name ?? null;
  const t: TemplateRecord = {
    id: snapId, alias, kind: "snapshot", names: [`${alias ?? snapId}:default`], cpuCount: src.cpuCount,
    memoryMB: src.memoryMB, diskSizeMB: src.diskSizeMB, layers: cp.layers, checkpoint: cp, sourceSandboxId: id,
    envdVersion: src.envdVersion, createdAt: Date.now(), config: node.templates.resolve(src.templateId)?.config ?? null,
  };
  try {
    node.templates.insert(t);
  } catch (e) {
    collectCheckpointsLater(node);
    throw new OrchestratorError(409, (e as Error).message);
  }
  if (node.opts.snapshots) {
    try {
      await storeSnapshot(node, t, cp);
    } catch (e) {
      node.templates.delete(t.id);
      collectCheckpointsLater(node);
      throw asOrchestratorError(e, `storing snapshot ${t.id}`);
    }
  }
  return t;
}

/**
 * A start trace written into a snapshot's checkpoint goes to the snapshot store beside it, so a
 * cold node's first start from the snapshot replays it (best effort: a failure is logged).
 */
export function traceKept(node: NodeState, path: string): void {
  const store = node.opts.snapshots;
  if (!store) return;
  const dir = dirname(path);
  const snap = node.templates.list("snapshot").find((t) => t.checkpoint?.dir === dir);
  if (!snap) return;
  store.attach(snap.id, basename(path), path).catch((e) => console.error(`orchestrator: attaching ${basename(path)} to snapshot ${snap.id}: ${(e as Error).message}`));
}

/** A checkpoint's files as the snapshot store takes them (layers shared by content), and the part of its record they make. */
export async function checkpointFiles(cp: VmCheckpoint): Promise<{ files: { name: string; path: string; shared?: boolean }[]; meta: Pick<StoredSnapshotMeta, "vm" | "layers" | "memLayers" | "envdToken" | "remote"> }> {
  const vm = await readSnapshot(cp.dir);
  const files = [{ name: "vmstate", path: vm.statePath }, ...(vm.memPath ? [{ name: "mem", path: vm.memPath }] : []),
    ...cp.layers.flatMap((path, i) => (typeof path === "string" ? [{ name: `layer-${i}`, path, shared: true }] : [])),
    ...(cp.memLayers ?? []).map((path, i) => ({ name: `mem-layer-${i}`, path, shared: true }))];
  // A remote layer stays where it is (its registry): the record names it instead of a file.
  const remote = Object.fromEntries(cp.layers.flatMap((l, i) => (isRemoteLayer(l) ? [[String(i), l]] : [])));
  return { files, meta: { vm, layers: cp.layers.length, memLayers: cp.memLayers?.length ?? 0, envdToken: cp.envdToken, ...(Object.keys(remote).length ? { remote } : {}) } };
}

/** The snapshot's files and record into the snapshot store (layers stored once by content). */
async function storeSnapshot(node: NodeState, t: TemplateRecord, cp: VmCheckpoint): Promise<void> {
  const { files, meta: part } = await checkpointFiles(cp);
  const meta: StoredSnapshotMeta = {
    ...part, alias: t.alias, names: t.names, cpuCount: t.cpuCount,
    memoryMB: t.memoryMB, diskSizeMB: t.diskSizeMB, envdVersion: t.envdVersion, sourceSandboxId: t.sourceSandboxId, createdAt: t.createdAt,
  };
  await node.opts.snapshots!.put(t.id, files, meta as unknown as Json);
}

/**
 * A stored checkpoint (`storeId`) fetched (S3) or found (a directory) and linked into `dir`, a
 * checkpoint directory of this node, with its start traces; its record's paths confined to `dir`
 * and the node's guest files, its counts to the files the store gave.
 */
export async function fetchCheckpoint(node: NodeState, storeId: string, dir: string): Promise<{ cp: VmCheckpoint; meta: StoredSnapshotMeta }> {
  const store = node.opts.snapshots!;
  const got = await store.get(storeId);
  const meta = got.meta as unknown as StoredSnapshotMeta;
  for (const [name, path] of Object.entries(got.paths)) await linkOrCopy(path, join(dir, name));
  // Start traces the store has for it (recorded where the snapshot was first started): replayed at this node's starts.
  for (const name of [ROOTFS_TRACE, MEMORY_TRACE]) {
    await store.attachment(storeId, name, join(dir, name)).catch((e) => console.error(`orchestrator: ${name} of ${storeId}: ${(e as Error).message}`));
  }
  // A stored snapshot may come from another node: its paths must lie in this checkpoint and the node's guest files.
  const vm: SnapshotInfo = confineSnapshot({ ...meta.vm, dir, statePath: join(dir, "vmstate"), memPath: got.paths.mem ? join(dir, "mem") : undefined }, {
    checkpointDir: dir, bootDirs: [dirname(node.guest.kernel), ...(node.guest.initrd ? [dirname(node.guest.initrd)] : [])],
  });
  await writeSnapshot(vm);
  // Its record's counts name files the store gave (or remote layers), never more.
  const layerCount = storedCount(meta.layers, "layers", (i) => !!meta.remote?.[String(i)] || `layer-${i}` in got.paths, storeId);
  const memCount = storedCount(meta.memLayers ?? 0, "memLayers", (i) => `mem-layer-${i}` in got.paths, storeId);
  const memLayers = Array.from({ length: memCount }, (_, i) => join(dir, `mem-layer-${i}`));
  const cp: VmCheckpoint = {
    dir, layers: Array.from({ length: layerCount }, (_, i) => meta.remote?.[String(i)] ?? join(dir, `layer-${i}`)), envdToken: meta.envdToken,
    ...(memLayers.length ? { memLayers } : {}),
  };
  return { cp, meta };
}

/**
 * A snapshot known from the store but with no checkpoint on this node: its files are fetched
 * (S3) or found (a directory), linked into a checkpoint directory of this node, and recorded.
 */
export async function materializeSnapshot(node: NodeState, t: TemplateRecord): Promise<VmCheckpoint> {
  const store = node.opts.snapshots;
  if (!store) throw new OrchestratorError(500, `snapshot ${t.id} has no checkpoint on this node and no snapshot store is configured`);
  const running = node.preparing.get(t.id);
  if (running) return running;
  const p = (async () => {
    const dir = join(node.opts.home, "checkpoints", `snapshot-${t.id}`);
    await rm(dir, { recursive: true, force: true });
    mkdirSync(dir, { recursive: true });
    try {
      const { cp } = await fetchCheckpoint(node, t.id, dir);
      node.templates.setCheckpoint(t.id, cp);
      return cp;
    } catch (e) {
      await rm(dir, { recursive: true, force: true });
      throw e;
    }
  })().finally(() => node.preparing.delete(t.id));
  node.preparing.set(t.id, p);
  return p;
}

/**
 * At node start: snapshots in the store that this node has no record of (taken by another node
 * on a shared store, or before this node's state was lost) become snapshot templates; their
 * files are fetched on first use.
 */
export async function importSnapshots(node: NodeState): Promise<string[]> {
  const store = node.opts.snapshots;
  if (!store) return [];
  const added: string[] = [];
  for (const id of await store.list()) {
    // A paused sandbox on its way between nodes (moves.ts) or a volume's layer (volume_shared.ts) is no snapshot.
    if (id.startsWith("paused.") || id.startsWith(VOLUME_LAYER_STORE_PREFIX) || node.templates.resolve(id)) continue;
    try {
      const meta = (await store.get(id)).meta as unknown as StoredSnapshotMeta;
      node.templates.insert({
        id, alias: meta.alias, kind: "snapshot", names: meta.names, cpuCount: meta.cpuCount, memoryMB: meta.memoryMB,
        diskSizeMB: meta.diskSizeMB, layers: [], checkpoint: null, sourceSandboxId: meta.sourceSandboxId,
        envdVersion: meta.envdVersion, createdAt: meta.createdAt,
      });
      added.push(id);
    } catch (e) {
      console.error(`orchestrator: snapshot ${id} in the store cannot be imported: ${(e as Error).message}`);
    }
  }
  return added;
}

/** A template or snapshot goes (a snapshot from the store too); its checkpoint goes once nothing uses it. */
export async function deleteTemplate(node: NodeState, ref: string): Promise<boolean> {
  const t = node.templates.resolve(ref);
  if (!t) return false;
  if (t.checkpoint && t.kind === "template") prepareDevices(node, t.checkpoint, t.diskSizeMB, 0);
  if (t.kind === "snapshot" && node.opts.snapshots) await node.opts.snapshots.delete(t.id);
  node.templates.delete(t.id);
  collectCheckpointsLater(node);
  return true;
}

/** A count from a stored snapshot's record: a whole number whose every index `has` a file (a record from a shared store is input). */
export function storedCount(n: unknown, what: string, has: (i: number) => boolean, id: string): number {
  if (!Number.isSafeInteger(n) || (n as number) < 0 || (n as number) > STORED_LAYERS_MAX) throw new OrchestratorError(500, `snapshot ${id}: its record's ${what} (${String(n)}) is not a count of 0..${STORED_LAYERS_MAX}`);
  for (let i = 0; i < (n as number); i++) if (!has(i)) throw new OrchestratorError(500, `snapshot ${id}: its record names ${what} ${i}, which the store does not hold`);
  return n as number;
}

/** Layers a stored snapshot may name, at most (a stack past this is no snapshot of ours). */
const STORED_LAYERS_MAX = 4096;
