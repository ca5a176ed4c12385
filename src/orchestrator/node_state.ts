// What every step of the orchestrator shares (start.ts, boot.ts, pause_resume.ts, fork.ts,
// checkpoint.ts, snapshots.ts, recovery.ts, reaper.ts, ledger.ts): the node's parts, its settings,
// its maps of what runs and what is in flight, and the one-operation-per-sandbox rule.
import { mkdirSync } from "node:fs";
import { join } from "node:path";
import type { BlockdClient } from "../blockdev/client.ts";
import type { Egress, Slot, SlotPool } from "../network/index.ts";
import type { SnapshotStore } from "../snapshot/index.ts";
import type { Vmm, VmmDriver } from "../vmm/types.ts";
import type { BootHeld } from "./boot.ts";
import { ENVD_PORT } from "./envd.ts";
import { notFound, OrchestratorError } from "./errors.ts";
import type { SandboxRuntime } from "./ledger.ts";
import { MemoryDevices } from "./memory_devices.ts";
import { OrphanSweep } from "./orphans.ts";
import type { SandboxMetric } from "./reaper.ts";
import { StartTraces } from "./start_traces.ts";
import type { SandboxRecord, SandboxStore } from "./store.ts";
import type { RemoteLayer, TemplateStore, VmCheckpoint } from "./templates.ts";
import { TimingLog } from "./timings.ts";

export interface GuestArtifacts {
  kernel: string;
  initrd?: string;
  /** The tools disk (init, envd) as one sealed layer: /dev/vda of every VM, shared read-only. */
  toolsLayer: string;
  /** Kernel command line of a cold boot (the guest address is the same in every slot). */
  cmdline: (slot: Slot) => string;
}

export interface OrchestratorOptions {
  home: string;
  /** VM run directories (sockets, logs, a cold boot's RAM): tmpfs is right. */
  runRoot: string;
  defaultTimeoutS: number;
  maxSandboxes: number;
  /** Free space creates and forks leave on home's filesystem (disk_reserve_mb; default DEFAULT_DISK_RESERVE_BYTES); below it: 507. */
  diskReserveBytes?: number;
  /** A template whose disk is larger is not created (max_disk_size_mb); unset: no bound. */
  maxDiskSizeMB?: number;
  /** A cold boot or restore until envd answers (TCG boots take seconds). */
  envdReadyTimeoutMs?: number;
  /** Children of one fork started at once. */
  forkParallelism?: number;
  /**
   * Host memory pressure: below this % of MemTotal available, running sandboxes' balloons take back
   * half their memory (deflate-on-oom gives it back to a guest that needs it); from twice that
   * available, they return it. 0: never (default 10).
   */
  balloonPressurePct?: number;
  /** Memory layers a sandbox stacks before a pause writes one fresh base instead (default MEMORY_LAYERS_MAX). */
  memoryLayersMax?: number;
  /** Memory layers compressed as ZFiles with this algorithm; none: plain layers. */
  memoryZfile?: "zstd" | "lz4";
  /** Rootfs devices blockd keeps ready per template stack (its lowers open, a fresh upper). */
  preparedDevices?: number;
  /** Where snapshots are kept so they outlive this node's checkpoints (local dir, shared FS, S3). */
  snapshots?: SnapshotStore;
  /** Sandbox egress policies (without it a sandbox's slot lets nothing out). */
  egress?: Egress;
  /** PEM of the node's egress CA: every guest trusts it from its /init on (TLS-terminating header rules). */
  caBundle?: string;
  /** A remote layer as blockd gets it at each use (the node's block cache, its registry auth file); none: as recorded. */
  remoteLayer?: (l: RemoteLayer) => Promise<RemoteLayer>;
  /** How long after envd answered a checkpoint's first start goes on recording its prefetch traces (default TRACE_WINDOW_MS). */
  traceWindowMs?: number;
  /** How long a blockd device stays unheld before the reaper gives it back as an orphan (default ORPHAN_GRACE_MS). */
  orphanGraceMs?: number;
  /**
   * Resume anywhere (a cluster with a shared snapshot store): told of each pause once the sandbox
   * is paused, and asked before each resume, which fails with its error (the sandbox stays paused)
   * when another node may take the sandbox.
   */
  moves?: { paused(id: string): void; resuming(id: string): Promise<void> };
  /** Volumes sandboxes mount (none: a create with volumeMounts gets 400). */
  volumes?: VolumeDevices;
}

/** Volumes as sandboxes mount them: one sandbox holds a volume's device at a time. */
export interface VolumeDevices {
  /** Volume `name` held for sandbox `sandboxId` (the same device again for its holder): its device opened if closed; 404 unknown, 409 held by another. */
  attach(name: string, sandboxId: string): Promise<{ volumeID: string; devicePath: string }>;
  /** Every volume sandbox `sandboxId` holds goes back (written ones sealed); idempotent. */
  detach(sandboxId: string): Promise<void>;
  /** Open volume devices: blockd device id → who holds it (the device report). */
  holders(): Map<string, string>;
}

/** A sandbox's VM that this process drives, and the slot it runs in. */
export interface Live {
  vm: Vmm;
  slot: Slot;
}

export class NodeState {
  /** Running VMs by sandbox. */
  readonly live = new Map<string, Live>();
  /** One operation in flight per sandbox; others on it join or wait for it. */
  readonly inflight = new Map<string, { op: string; done: Promise<unknown> }>();
  /**
   * Work left for after an operation's answer, by sandbox: the sandbox's next operation that takes
   * resources (resume, kill) waits for it, as they reuse its run directory.
   */
  readonly cleanups = new Map<string, Promise<void>>();
  /** The tools disk: one read-only device for every VM of this node, made on first use (devices.ts). */
  tools: Promise<{ id: string; path: string }> | undefined;
  toolsId: string | undefined;
  /** One checkpointing boot (or snapshot fetch) per template at a time. */
  readonly preparing = new Map<string, Promise<VmCheckpoint>>();
  /** Checkpoints of template builds not yet published: kept from collectCheckpoints. */
  readonly buildCheckpoints = new Set<string>();
  /** The checkpoint collection running now, and whether it must go round once more. */
  collecting: Promise<string[]> | undefined;
  collectAgain = false;
  readonly envdTimeoutMs: number;
  reaper: Timer | undefined;
  /** When the reaper last compared blockd's devices with what the node holds. */
  sweptAt = 0;
  closed = false;
  readonly goneListeners: ((id: string) => void)[] = [];
  /** Told when a sandbox's row is deleted: it no longer exists on this node (a cluster unbinds it). */
  readonly removedListeners: ((id: string) => void)[] = [];
  /** Phase timings of recent operations (create, resume, pause, fork, snapshot). */
  readonly timings = new TimingLog();
  /** Metric samples by sandbox, at most METRICS_KEPT each; a sandbox's go when it is killed or lost. */
  readonly samples = new Map<string, SandboxMetric[]>();
  /** Creates (POST /sandboxes, fork children) since this process started: succeeded, failed. */
  readonly creates = { successes: 0, fails: 0 };
  readonly memDevices: MemoryDevices;
  readonly traces: StartTraces;
  /** Runtimes of starts in flight (create, resume, fork child) before the store has them all: their devices are held. */
  readonly starting = new Map<string, SandboxRuntime>();
  /** Cold boots in flight (a template's checkpointing boot, a build VM): what each holds. */
  readonly boots = new Map<string, BootHeld>();
  /** Paused sandboxes whose row names a ResumeDevice, oldest first (RESUME_READY_MAX, past it while resumes take theirs). */
  readonly resumeReady = new Set<string>();
  /** Sandboxes whose balloon holds memory back: inflated under pressure, deflated when it passes. */
  readonly ballooned = new Set<string>();
  readonly orphans = new OrphanSweep();

  constructor(
    readonly store: SandboxStore,
    readonly templates: TemplateStore,
    readonly blockd: BlockdClient,
    readonly slots: SlotPool,
    readonly driver: VmmDriver,
    readonly guest: GuestArtifacts,
    readonly opts: OrchestratorOptions,
    /** A start trace was written to `path` (snapshots.ts traceKept). */
    onTraceKept: (path: string) => void,
  ) {
    this.envdTimeoutMs = opts.envdReadyTimeoutMs ?? 120_000;
    this.memDevices = new MemoryDevices(blockd);
    this.traces = new StartTraces(blockd, opts.traceWindowMs, onTraceKept);
    for (const d of ["sandboxes", "checkpoints"]) mkdirSync(join(opts.home, d), { recursive: true });
    mkdirSync(opts.runRoot, { recursive: true });
  }

  /** The sandbox's row; 404 when it is unknown or being killed. */
  sandbox(id: string): SandboxRecord {
    const r = this.store.get(id);
    if (!r || r.state === "killing") throw notFound(id);
    return r;
  }

  /** Where the node reaches a running sandbox's envd. */
  envdUrl(id: string): string | undefined {
    const l = this.live.get(id);
    return l ? `http://${l.slot.nsIp}:${ENVD_PORT}` : undefined;
  }

  removed(id: string): void {
    for (const cb of this.removedListeners) cb(id);
  }

  /** The proxy's listeners are told that the sandbox's VM goes away. */
  gone(id: string): void {
    for (const cb of this.goneListeners) cb(id);
  }

  /**
   * Runs `fn` as the one operation in flight on `id`. A second request for the same operation
   * joins it; a request for another one gets 409 (kill waits for it instead).
   */
  track<T>(id: string, op: string, fn: () => Promise<T>): Promise<T> {
    const cur = this.inflight.get(id);
    if (cur) {
      if (cur.op === op) return cur.done as Promise<T>;
      throw new OrchestratorError(409, `sandbox ${id} is busy: ${cur.op} in progress`);
    }
    const done = fn().finally(() => this.inflight.delete(id));
    this.inflight.set(id, { op, done });
    return done;
  }

  /** Resolves once no operation is in flight on `id`. */
  async settled(id: string): Promise<void> {
    for (let cur = this.inflight.get(id); cur; cur = this.inflight.get(id)) await cur.done.catch(() => {});
  }

  /**
   * Work an operation leaves for after its answer (giving back what it no longer needs); its
   * failure is logged. `settledCleanups` waits for all of it (tests, shutdown).
   */
  afterReply(id: string, op: string, work: () => Promise<void>): void {
    const p = (this.cleanups.get(id) ?? Promise.resolve())
      .then(work)
      .catch((e) => console.error(`orchestrator: after ${op} of ${id}: ${(e as Error).message}`))
      .finally(() => { if (this.cleanups.get(id) === p) this.cleanups.delete(id); });
    this.cleanups.set(id, p);
  }

  /** Resolves once the work operations left for after their answers has ended. */
  async settledCleanups(): Promise<void> {
    while (this.cleanups.size) await Promise.all([...this.cleanups.values()]);
  }
}
