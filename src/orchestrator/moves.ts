// A paused sandbox moving between nodes (docs/cluster.md, Resume anywhere): its node puts the
// paused checkpoint and its record into the shared snapshot store (`paused.<id>`, files by
// content, so layers already there are not sent again); another node takes it from there as a
// paused sandbox of its own, with the same ID, tokens and settings, and resumes it as it resumes
// any; the node it left drops its copy.
import { mkdirSync } from "node:fs";
import { rm } from "node:fs/promises";
import { join } from "node:path";
import type { Json } from "../snapshot/index.ts";
import { asOrchestratorError, OrchestratorError } from "./errors.ts";
import { randomId } from "./ids.ts";
import { runtimeOf, teardown, type SandboxRuntime } from "./ledger.ts";
import type { NodeState } from "./node_state.ts";
import { refuseWithVolumes } from "./devices.ts";
import { checkpointFiles, fetchCheckpoint, type StoredSnapshotMeta } from "./snapshots.ts";
import type { SandboxRecord } from "./store.ts";

/** The store ID of a paused sandbox's export (no snapshot ID has a '.'). */
export const movedId = (id: string) => `paused.${id}`;
export const isMovedId = (storeId: string) => storeId.startsWith("paused.");

interface MovedMeta extends StoredSnapshotMeta {
  /** The sandbox's record without its runtime (the taking node makes its own). */
  sandbox: Omit<SandboxRecord, "runtime">;
}

/**
 * Puts paused sandbox `id` into the snapshot store; resolves when it is complete there. A
 * sandbox that is not paused, or resumed meanwhile, is a 409.
 */
export async function exportPaused(node: NodeState, id: string): Promise<void> {
  const store = node.opts.snapshots;
  if (!store) throw new OrchestratorError(500, "no snapshot store is configured: a paused sandbox cannot leave this node");
  await node.cleanups.get(id);
  const rec = node.sandbox(id);
  const rt = rec.runtime as SandboxRuntime | null;
  const cp = rt?.paused;
  if (rec.state !== "paused" || !cp) throw new OrchestratorError(409, `sandbox ${id} is ${rec.state}, not paused`);
  refuseWithVolumes(rec, "move");
  if (cp.boot) throw new OrchestratorError(409, `sandbox ${id} was paused without its memory: it resumes on its node only`);
  const { files, meta } = await checkpointFiles(cp);
  const { runtime: _, ...sandbox } = rec;
  const moved: MovedMeta = {
    ...meta, alias: null, names: [], cpuCount: rec.cpuCount, memoryMB: rec.memoryMB, diskSizeMB: rec.diskSizeMB,
    envdVersion: rec.envdVersion, sourceSandboxId: id, createdAt: Date.now(), sandbox,
  };
  await store.delete(movedId(id)).catch(() => false); // a previous pause's export
  await store.put(movedId(id), files, moved as unknown as Json);
}

/**
 * Takes paused sandbox `id` from the snapshot store as a paused sandbox of this node. 409 when
 * this node holds a sandbox of that ID; 429 when it is full; 404 when the store has no export.
 */
export async function adoptPaused(node: NodeState, id: string): Promise<SandboxRecord> {
  const store = node.opts.snapshots;
  if (!store) throw new OrchestratorError(500, "no snapshot store is configured: this node cannot take a paused sandbox");
  if (node.store.get(id)) throw new OrchestratorError(409, `sandbox ${id} is on this node already`);
  if (node.store.count() >= node.opts.maxSandboxes) throw new OrchestratorError(429, `this node holds its maximum of ${node.opts.maxSandboxes} sandboxes`);
  if (!(await store.exists(movedId(id)))) throw new OrchestratorError(404, `sandbox ${id} was not put into the snapshot store (paused on a node without resume anywhere?)`);
  const dir = join(node.opts.home, "checkpoints", `moved-${id}-${randomId(6)}`);
  mkdirSync(dir, { recursive: true });
  try {
    const { cp, meta } = await fetchCheckpoint(node, movedId(id), dir);
    const s = (meta as MovedMeta).sandbox;
    if (!s || s.id !== id) throw new OrchestratorError(500, `the store's export of ${id} names another sandbox`);
    const runtime: SandboxRuntime = {
      slot: null, toolsDevice: null, rootfsDevice: null, upperDir: null, layers: cp.layers, vmPid: null, runDir: null,
      paused: cp, checkpoints: [dir], memLayers: cp.memLayers, memDevice: null,
    };
    // startedAt is unique on a node: the original one, else the next free.
    const startedAt = node.store.list({ limit: 1, startedAfter: s.startedAt, order: "asc" }).items[0]?.startedAt === s.startedAt ? node.store.nextStartedAt() : s.startedAt;
    const rec: SandboxRecord = { ...s, startedAt, state: "paused", runtime };
    node.store.insert(rec);
    return rec;
  } catch (e) {
    await rm(dir, { recursive: true, force: true });
    throw asOrchestratorError(e, `taking sandbox ${id} from the snapshot store`);
  }
}

/** The export of `id` goes from the store (its new node resumed it, or it was killed). */
export async function forgetExport(node: NodeState, id: string): Promise<void> {
  await node.opts.snapshots?.delete(movedId(id)).catch(() => false);
}

/** This node's copy of a sandbox another node took: given back whole (never one that runs here). */
export async function dropMoved(node: NodeState, id: string): Promise<boolean> {
  const rec = node.store.get(id);
  if (!rec || rec.state !== "paused") return false;
  runtimeOf(node, id);
  await teardown(node, id);
  return true;
}
