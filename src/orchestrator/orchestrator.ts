// The orchestrator: sandboxes from templates, their lifecycle (docs/node.md's state machine) and what
// each one holds (a network slot, blockd devices, a VMM process, checkpoint directories).
// Every operation either completes or gives back what it took; state changes are
// compare-and-set in the SandboxStore; concurrent requests on one sandbox join the operation
// in flight. It never reads or writes a layer's bytes: blockd does, by RPC.
// This class is the facade: its queries, and one method per operation, each in the file that owns
// that step (start.ts, boot.ts, pause_resume.ts, fork.ts, checkpoint.ts, snapshots.ts, kill.ts,
// recovery.ts, reaper.ts); what a sandbox holds and its teardown are ledger.ts's.
import { existsSync } from "node:fs";
import type { BlockdClient } from "../blockdev/client.ts";
import type { SlotPool } from "../network/index.ts";
import type { VmmDriver } from "../vmm/types.ts";
import * as boot from "./boot.ts";
import type { BuildVm, VmSize } from "./boot.ts";
import * as checkpoints from "./checkpoint.ts";
import * as devices from "./devices.ts";
import * as egress from "./egress.ts";
import { ENVD_PORT } from "./envd.ts";
import { notFound, type OrchestratorError } from "./errors.ts";
import * as forks from "./fork.ts";
import * as kills from "./kill.ts";
import * as moves from "./moves.ts";
import * as ledger from "./ledger.ts";
import { NodeState, type GuestArtifacts, type OrchestratorOptions } from "./node_state.ts";
import type { ListedDevice } from "./orphans.ts";
import * as pauseResume from "./pause_resume.ts";
import { VOLUME_MOUNTS_MAX } from "./devices.ts";
import * as reaper from "./reaper.ts";
import { METRICS_INTERVAL_MS, type SandboxMetric } from "./reaper.ts";
import * as recovery from "./recovery.ts";
import * as snapshots from "./snapshots.ts";
import * as start from "./start.ts";
import type { CreateOptions } from "./start.ts";
import { publicState, type SandboxRecord, type SandboxState, type SandboxStore } from "./store.ts";
import type { TemplateLayer, TemplateRecord, TemplateStore, VmCheckpoint } from "./templates.ts";
import type { TimingLog } from "./timings.ts";

export { type BuildVm, type VmSize } from "./boot.ts";
export { MEMORY_LAYERS_MAX } from "./checkpoint.ts";
export { egressPolicyOf } from "./egress.ts";
export { OrchestratorError } from "./errors.ts";
export { FORK_PREPARED_MAX } from "./fork.ts";
export { type ResumeDevice, type SandboxRuntime } from "./ledger.ts";
export { type GuestArtifacts, type OrchestratorOptions } from "./node_state.ts";
export { RESUME_READY_MAX } from "./pause_resume.ts";
export { METRICS_INTERVAL_MS, ORPHAN_SWEEP_INTERVAL_MS, type SandboxMetric } from "./reaper.ts";
export { type CreateOptions } from "./start.ts";

/** Bounds of the API's inputs that reach the orchestrator (extensionParamsBytes: customExtensionParams as JSON). */
export const LIMITS = { metadataPairs: 64, envVars: 256, keyBytes: 256, valueBytes: 8192, timeoutS: 86_400 * 30, forkCount: 100, extensionParamsBytes: 16_384, volumeMounts: VOLUME_MOUNTS_MAX };

export class Orchestrator {
  private readonly node: NodeState;
  /** Phase timings of recent operations (create, resume, pause, fork, snapshot). */
  readonly timings: TimingLog;
  /** Creates (POST /sandboxes, fork children) since this process started: succeeded, failed. */
  readonly creates: { successes: number; fails: number };

  constructor(
    readonly store: SandboxStore,
    readonly templates: TemplateStore,
    blockd: BlockdClient,
    slots: SlotPool,
    driver: VmmDriver,
    guest: GuestArtifacts,
    opts: OrchestratorOptions,
  ) {
    this.node = new NodeState(store, templates, blockd, slots, driver, guest, opts, (path) => snapshots.traceKept(this.node, path));
    this.timings = this.node.timings;
    this.creates = this.node.creates;
  }

  // ─── queries ───────────────────────────────────────────────────────────────

  /** Ids of the blockd devices the node holds open as memory devices (templates', warm ones, in use). */
  memoryDeviceIds(): Set<string> {
    return this.node.memDevices.ids();
  }

  /** The memory stacks kept open whatever uses them (templates', a fork's while its children start). */
  pinnedMemoryStacks(): string[][] {
    return this.node.memDevices.pinnedStacks();
  }

  /** `cb(id)` runs when a sandbox's VM goes away (kill, pause, failure): the proxy cuts its streams. */
  onGone(cb: (id: string) => void): void {
    this.node.goneListeners.push(cb);
  }

  /** `cb(id)` runs when a sandbox no longer exists here (killed, timed out, failed): its row is gone. */
  onRemoved(cb: (id: string) => void): void {
    this.node.removedListeners.push(cb);
  }

  get(id: string): SandboxRecord {
    return this.node.sandbox(id);
  }

  envdUrl(id: string): string | undefined {
    return this.node.envdUrl(id);
  }

  /** Where the node reaches guest port `port` of a running sandbox. */
  target(id: string, port: number): { host: string; port: number } | undefined {
    const l = this.node.live.get(id);
    const r = this.store.get(id);
    if (!l || !r || r.state !== "running") return undefined;
    return { host: l.slot.nsIp, port };
  }

  /**
   * The kept samples of the sandbox with `timestampUnix` in [startS, endS] (unix seconds, either
   * open), oldest first; one is taken now when the newest is older than METRICS_INTERVAL_MS.
   */
  async metrics(id: string, startS?: number, endS?: number): Promise<SandboxMetric[]> {
    const newest = this.node.samples.get(id)?.at(-1);
    if (!newest || Date.now() - newest.timestampUnix * 1000 >= METRICS_INTERVAL_MS) await reaper.sample(this.node, id);
    return (this.node.samples.get(id) ?? []).filter((s) => (startS === undefined || s.timestampUnix >= startS) && (endS === undefined || s.timestampUnix <= endS));
  }

  /** The guest console's last lines (at most 64 KiB of them), as E2B log entries. */
  async logs(id: string): Promise<{ timestamp: string; line: string }[]> {
    const l = this.node.live.get(id);
    if (!l || !existsSync(l.vm.consoleLog)) return [];
    await l.vm.syncConsole().catch(() => {}); // what the console ring holds now, drained into the file
    const f = Bun.file(l.vm.consoleLog);
    const text = await f.slice(Math.max(0, f.size - 65536)).text();
    const ts = new Date().toISOString();
    return text.split("\n").filter((line) => line.trim() !== "").map((line) => ({ timestamp: ts, line }));
  }

  runningCount(): number {
    return this.node.live.size;
  }

  describe(r: SandboxRecord): { state: "running" | "paused"; internal: SandboxState } {
    return { state: publicState(r.state), internal: r.state };
  }

  /** Each blockd device the node holds, with who holds it (ledger.ts). */
  deviceHolders(list: ListedDevice[]): Map<string, string> {
    return ledger.deviceHolders(this.node, list);
  }

  /** blockd's devices, each with its holder; "orphan" for one nobody holds. */
  devicesReport(): Promise<{ id: string; kind: string; acquired: boolean; readOnly: boolean; holder: string }[]> {
    return ledger.devicesReport(this.node);
  }

  /** Devices given back by the orphan sweep since this process started (aenv_orphans_reclaimed_total). */
  get orphansReclaimed(): number {
    return this.node.orphans.reclaimed;
  }

  // ─── sandboxes ─────────────────────────────────────────────────────────────

  /** A new sandbox from a template or snapshot (start.ts). */
  create(o: CreateOptions): Promise<SandboxRecord> {
    return start.create(this.node, o);
  }

  /** A running sandbox into a checkpoint on disk; `memory: false`: its disk only (pause_resume.ts). */
  pause(id: string, o: { memory?: boolean } = {}): Promise<void> {
    return pauseResume.pause(this.node, id, o);
  }

  /** A running sandbox's TTL extended, a paused one resumed; `memory: false`: booted on its disk (pause_resume.ts). */
  connect(id: string, timeoutS: number, o: { extendOnly?: boolean; memory?: boolean } = {}): Promise<{ rec: SandboxRecord; resumed: boolean }> {
    return pauseResume.connect(this.node, id, timeoutS, o);
  }

  /** Everything the sandbox holds given back, its row deleted (kill.ts). */
  kill(id: string): Promise<void> {
    return kills.kill(this.node, id);
  }

  /** `count` children of a running sandbox from one checkpoint (fork.ts). */
  fork(id: string, count: number, timeoutS: number | undefined): Promise<({ rec: SandboxRecord } | { error: OrchestratorError })[]> {
    return forks.fork(this.node, id, count, timeoutS);
  }

  /** A running sandbox's checkpoint kept as a snapshot template (snapshots.ts). */
  snapshot(id: string, name: string | undefined): Promise<TemplateRecord> {
    return snapshots.snapshot(this.node, id, name);
  }

  /** PUT /sandboxes/{id}/network (egress.ts). */
  updateNetwork(id: string, body: Record<string, unknown>): Promise<void> {
    return egress.updateNetwork(this.node, id, body);
  }

  setTimeout(id: string, timeoutS: number): SandboxRecord {
    this.get(id);
    const r = this.store.setEndAt(id, Date.now() + timeoutS * 1000, false);
    if (!r) throw notFound(id);
    return r;
  }

  // ─── templates ─────────────────────────────────────────────────────────────

  /** The template booted once and checkpointed (boot.ts). */
  prepareTemplate(tpl: TemplateRecord): Promise<VmCheckpoint> {
    return boot.prepareTemplate(this.node, tpl);
  }

  /** A VM for a template build (boot.ts). */
  startBuildVm(layers: TemplateLayer[], size: VmSize, pulledTrace?: Uint8Array): Promise<BuildVm> {
    return boot.startBuildVm(this.node, layers, size, pulledTrace);
  }

  /** A build checkpoint that will not be published: its directory goes. */
  discardBuildCheckpoint(dir: string): void {
    boot.discardBuildCheckpoint(this.node, dir);
  }

  /** A finished build becomes the template (boot.ts). */
  publishTemplate(t: TemplateRecord): void {
    boot.publishTemplate(this.node, t);
  }

  /** At node start: devices ready for every template that has a checkpoint. */
  warmUp(): void {
    devices.warmUp(this.node);
  }

  /** At node start: snapshots in the store this node has no record of become snapshot templates. */
  /** Paused sandbox `id` into the snapshot store, for another node to take (moves.ts). */
  exportPaused(id: string): Promise<void> {
    return moves.exportPaused(this.node, id);
  }

  /** Paused sandbox `id` taken from the snapshot store as one of this node's (moves.ts). */
  adoptPaused(id: string): Promise<SandboxRecord> {
    return moves.adoptPaused(this.node, id);
  }

  /** This node's paused copy of a sandbox another node took goes (moves.ts). */
  dropMoved(id: string): Promise<boolean> {
    return moves.dropMoved(this.node, id);
  }

  /** The snapshot store's export of `id` goes. */
  forgetExport(id: string): Promise<void> {
    return moves.forgetExport(this.node, id);
  }

  importSnapshots(): Promise<string[]> {
    return snapshots.importSnapshots(this.node);
  }

  deleteTemplate(ref: string): Promise<boolean> {
    return snapshots.deleteTemplate(this.node, ref);
  }

  /** Removes checkpoint directories no sandbox and no template refers to any more (checkpoint.ts). */
  collectCheckpoints(): Promise<string[]> {
    return checkpoints.collectCheckpoints(this.node);
  }

  /** Resolves once the work operations left for after their answers has ended. */
  settledCleanups(): Promise<void> {
    return this.node.settledCleanups();
  }

  // ─── restart and reaper ────────────────────────────────────────────────────

  /** Slots that sandboxes may still use after a node restart (recovery.ts). */
  static slotsInUse(store: SandboxStore): string[] {
    return recovery.slotsInUse(store);
  }

  /** After a node restart: running sandboxes' VMs adopted, half-done operations settled (recovery.ts). */
  recover(): Promise<{ adopted: string[]; lost: string[]; paused: string[] }> {
    return recovery.recover(this.node);
  }

  /** Expiry, metrics, balloons and the orphan sweep every `intervalMs` (reaper.ts). */
  startReaper(intervalMs: number): void {
    reaper.startReaper(this.node, intervalMs);
  }

  /** Gives back blockd devices nobody holds for `graceMs` (reaper.ts); returns their ids. */
  reclaimOrphans(graceMs?: number): Promise<string[]> {
    return reaper.reclaimOrphans(this.node, graceMs);
  }

  /** Stops the reaper; sandboxes keep running (blockd and the VMMs outlive the node). */
  close(): void {
    reaper.close(this.node);
  }

  /** Test and shutdown helper: kill every sandbox. */
  killAll(): Promise<void> {
    return reaper.killAll(this.node);
  }
}
