// The orchestrator: sandboxes from templates, their lifecycle (docs/node.md's state machine) and what
// each one holds (a network slot, blockd devices, a VMM process, checkpoint directories).
// Every operation either completes or gives back what it took; state changes are
// compare-and-set in the SandboxStore; concurrent requests on one sandbox join the operation
// in flight. It never reads or writes a layer's bytes: blockd does, by RPC.
import { existsSync, mkdirSync } from "node:fs";
import { basename, dirname, join } from "node:path";
import type { BlockdClient } from "../blockdev/client.ts";
import { PolicyError, parseEgressPolicy, parseInboundPolicy, type Egress, type EgressPolicy, type Slot, type SlotPool } from "../network/index.ts";
import { readSnapshot, writeSnapshot, type DriveSpec, type SnapshotInfo, type Vmm, type VmmDriver } from "../vmm/types.ts";
import type { Json, SnapshotStore } from "../snapshot/index.ts";
import { link, mkdir, open as openAsync, readdir, rm } from "node:fs/promises";
import { posixFadvise, POSIX_FADV_DONTNEED } from "../../ffi/libc.ts";
import { ENVD_PORT, ENVD_VERSION, initEnvd, waitEnvdReady } from "./envd.ts";
import { type AheadDevice, MemoryDevices } from "./memory_devices.ts";
import { SandboxStore, publicState, type SandboxRecord, type SandboxState } from "./store.ts";
import { TemplateStore, isRemoteLayer, localLayers, type RemoteLayer, type TemplateLayer, type TemplateRecord, type VmCheckpoint } from "./templates.ts";
import { PhaseClock, TimingLog } from "./timings.ts";
import { BOOT_TRACE, MEMORY_TRACE, ROOTFS_TRACE, StartTraces, beginBootTrace, endBootTrace } from "./start_traces.ts";

/** An orchestrator failure with the HTTP status the API answers it with. */
export class OrchestratorError extends Error {
  constructor(readonly status: number, message: string) {
    super(message);
    this.name = "OrchestratorError";
  }
}
const notFound = (id: string) => new OrchestratorError(404, `sandbox ${id} not found`);

/** A failure of a part (blockd, VMM, envd) as a 500 that says what failed and why. */
function asOrchestratorError(e: unknown, what: string): OrchestratorError {
  if (e instanceof OrchestratorError) return e;
  return new OrchestratorError(500, `${what}: ${(e as Error).message ?? String(e)}`);
}

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
}

/** The fields of `network` that PUT /sandboxes/{id}/network replaces; the others (inbound) stay. */
const EGRESS_FIELDS = ["allowOut", "denyOut", "rules", "egressProxy", "httpsPorts"] as const;

/** A sandbox's egress policy from its request fields (inbound ones checked too); a malformed one is a 400 naming the field. */
export function egressPolicyOf(allowInternetAccess: unknown, network: unknown): EgressPolicy {
  try {
    parseInboundPolicy(network);
    return parseEgressPolicy(allowInternetAccess, network);
  } catch (e) {
    if (e instanceof PolicyError) throw new OrchestratorError(400, e.message);
    throw e;
  }
}

/** What a stored snapshot's record carries besides its files (`vmstate`, `mem`, `layer-<i>`). */
interface StoredSnapshotMeta {
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

/** A device as blockd's `list` describes it (the fields recover reads). */
interface ListedDevice {
  id: string;
  kind: string;
  path: string;
  readOnly: boolean;
  acquired?: boolean;
  refs: number;
  config?: { lowers?: unknown[]; upper?: { data?: string } };
}

/** A rootfs device over a paused sandbox's stack with a fresh upper, held for its resume (no blockd call then). */
export interface ResumeDevice {
  id: string;
  path: string;
  upperDir: string;
}

export interface CreateOptions {
  templateId: string;
  timeoutS?: number;
  metadata?: Record<string, string>;
  envVars?: Record<string, string>;
  autoPause?: boolean;
  autoResume?: boolean;
  allowInternetAccess?: boolean | null;
  network?: unknown;
  customExtensionParams?: Record<string, unknown>;
}

/** Memory layers a sandbox stacks before its next pause compacts them into one, by default (AgentENV: 32). */
export const MEMORY_LAYERS_MAX = 32;

/** Devices prepared ahead for a fork's children, at most (blockd's bound per stack). */
export const FORK_PREPARED_MAX = 16;
/** The most recently paused sandboxes that hold their resume's rootfs device (ResumeDevice; ~8.5 MiB of blockd's memory each). */
export const RESUME_READY_MAX = 4;

/** Bounds of the API's inputs that reach the orchestrator (extensionParamsBytes: customExtensionParams as JSON). */
export const LIMITS = { metadataPairs: 64, envVars: 256, keyBytes: 256, valueBytes: 8192, timeoutS: 86_400 * 30, forkCount: 100, extensionParamsBytes: 16_384 };

/** E2B's SandboxMetric: one sample of the guest's envd. */
export interface SandboxMetric {
  timestamp: string;
  timestampUnix: number;
  cpuCount: number;
  cpuUsedPct: number;
  memUsed: number;
  memTotal: number;
  memCache: number;
  diskUsed: number;
  diskTotal: number;
}

/** A running sandbox is sampled every 5 s; the last 360 samples (30 min) of each are kept. */
export const METRICS_INTERVAL_MS = 5000;
const METRICS_KEPT = 360;

interface Live {
  vm: Vmm;
  slot: Slot;
}

export interface VmSize {
  cpuCount: number;
  memoryMB: number;
  diskSizeMB: number;
}

/** What a cold boot has taken so far (given back by giveBackBoot). */
interface BootHeld {
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

function randomId(len = 20): string {
  const alphabet = "abcdefghijklmnopqrstuvwxyz0123456789";
  const bytes = crypto.getRandomValues(new Uint8Array(len));
  let s = "";
  for (const b of bytes) s += alphabet[b % 36];
  return s;
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

/** The checkpoint directories whose files a VM started from `cp` uses: its own, its lowers', its memory layers'. */
function checkpointDirs(cp: VmCheckpoint): string[] {
  return [...new Set([cp.dir, ...localLayers(cp.layers).map((l) => join(l, "..")), ...(cp.memLayers ?? []).map((l) => join(l, ".."))])];
}

/** Writes a file's dirty pages (off the event loop) and drops its cached ones; a missing file is fine. */
async function dropCache(path: string): Promise<void> {
  if (!existsSync(path)) return;
  const fh = await openAsync(path, "r");
  try {
    await fh.datasync();
    posixFadvise(fh.fd, 0, 0, POSIX_FADV_DONTNEED, path);
  } finally {
    await fh.close();
  }
}

function token(): string {
  return Buffer.from(crypto.getRandomValues(new Uint8Array(24))).toString("hex");
}

export class Orchestrator {
  private readonly live = new Map<string, Live>();
  /** One operation in flight per sandbox; others on it join or wait for it. */
  private readonly inflight = new Map<string, { op: string; done: Promise<unknown> }>();
  /** The tools disk: one read-only device for every VM of this node, made on first use. */
  private tools: Promise<{ id: string; path: string }> | undefined;
  /** One checkpointing boot per template at a time. */
  private readonly preparing = new Map<string, Promise<VmCheckpoint>>();
  /** Checkpoints of template builds not yet published: kept from collectCheckpoints. */
  private readonly buildCheckpoints = new Set<string>();
  /** The checkpoint collection running now, and whether it must go round once more. */
  private collecting: Promise<string[]> | undefined;
  private collectAgain = false;
  /**
   * Work left for after an operation's answer, by sandbox: the sandbox's next operation that takes
   * resources (resume, kill) waits for it, as they reuse its run directory.
   */
  private readonly cleanups = new Map<string, Promise<void>>();
  private readonly envdTimeoutMs: number;
  private reaper: Timer | undefined;
  private readonly goneListeners: ((id: string) => void)[] = [];
  /** Phase timings of recent operations (create, resume, pause, fork, snapshot). */
  readonly timings = new TimingLog();
  /** Metric samples by sandbox, at most METRICS_KEPT each; a sandbox's go when it is killed or lost. */
  private readonly samples = new Map<string, SandboxMetric[]>();
  /** Creates (POST /sandboxes, fork children) since this process started: succeeded, failed. */
  readonly creates = { successes: 0, fails: 0 };
  private closed = false;
  private readonly memDevices: MemoryDevices;
  private readonly traces: StartTraces;

  constructor(
    readonly store: SandboxStore,
    readonly templates: TemplateStore,
    private readonly blockd: BlockdClient,
    private readonly slots: SlotPool,
    private readonly driver: VmmDriver,
    private readonly guest: GuestArtifacts,
    private readonly opts: OrchestratorOptions,
  ) {
    this.envdTimeoutMs = opts.envdReadyTimeoutMs ?? 120_000;
    this.memDevices = new MemoryDevices(blockd);
    this.traces = new StartTraces(blockd, opts.traceWindowMs, (path) => this.traceKept(path));
    for (const d of ["sandboxes", "checkpoints"]) mkdirSync(join(opts.home, d), { recursive: true });
    mkdirSync(opts.runRoot, { recursive: true });
  }

  /** Ids of the blockd devices the node holds open as memory devices (templates', warm ones, in use). */
  memoryDeviceIds(): Set<string> {
    return this.memDevices.ids();
  }

  /** The memory stacks kept open whatever uses them (templates', a fork's while its children start). */
  pinnedMemoryStacks(): string[][] {
    return this.memDevices.pinnedStacks();
  }

  /** `cb(id)` runs when a sandbox's VM goes away (kill, pause, failure): the proxy cuts its streams. */
  onGone(cb: (id: string) => void): void {
    this.goneListeners.push(cb);
  }

  // ─── queries ───────────────────────────────────────────────────────────────

  get(id: string): SandboxRecord {
    const r = this.store.get(id);
    if (!r || r.state === "killing") throw notFound(id);
    return r;
  }

  envdUrl(id: string): string | undefined {
    const l = this.live.get(id);
    return l ? `http://${l.slot.nsIp}:${ENVD_PORT}` : undefined;
  }

  /** Where the node reaches guest port `port` of a running sandbox. */
  target(id: string, port: number): { host: string; port: number } | undefined {
    const l = this.live.get(id);
    const r = this.store.get(id);
    if (!l || !r || r.state !== "running") return undefined;
    return { host: l.slot.nsIp, port };
  }

  /**
   * The kept samples of the sandbox with `timestampUnix` in [startS, endS] (unix seconds, either
   * open), oldest first; one is taken now when the newest is older than METRICS_INTERVAL_MS.
   */
  async metrics(id: string, startS?: number, endS?: number): Promise<SandboxMetric[]> {
    const newest = this.samples.get(id)?.at(-1);
    if (!newest || Date.now() - newest.timestampUnix * 1000 >= METRICS_INTERVAL_MS) await this.sample(id);
    return (this.samples.get(id) ?? []).filter((s) => (startS === undefined || s.timestampUnix >= startS) && (endS === undefined || s.timestampUnix <= endS));
  }

  /** One sample from the guest's envd into the sandbox's ring (none while it is paused or gone). */
  private async sample(id: string): Promise<void> {
    const url = this.envdUrl(id);
    const rec = this.store.get(id);
    if (!url || !rec) return;
    let m: Record<string, number>;
    try {
      const r = await fetch(`${url}/metrics`, { headers: { "x-access-token": rec.envdAccessToken }, signal: AbortSignal.timeout(5000) });
      if (!r.ok) return;
      m = (await r.json()) as Record<string, number>;
    } catch {
      return;
    }
    if (!this.live.has(id)) return; // went away while asked: no ring for it again
    const ts = (m.ts ?? Math.floor(Date.now() / 1000)) * 1000;
    const s: SandboxMetric = {
      timestamp: new Date(ts).toISOString(), timestampUnix: Math.floor(ts / 1000), cpuCount: m.cpu_count ?? rec.cpuCount,
      cpuUsedPct: m.cpu_used_pct ?? 0, memUsed: m.mem_used ?? 0, memTotal: m.mem_total ?? 0, memCache: m.mem_cache ?? 0,
      diskUsed: m.disk_used ?? 0, diskTotal: m.disk_total ?? 0,
    };
    const ring = this.samples.get(id) ?? [];
    // One sample per second at most: a second one in the same second replaces it.
    if (ring.at(-1)?.timestampUnix === s.timestampUnix) ring.pop();
    ring.push(s);
    if (ring.length > METRICS_KEPT) ring.shift();
    this.samples.set(id, ring);
  }

  /** A sample of every running sandbox with no operation in flight (the reaper's tick, every METRICS_INTERVAL_MS). */
  private async sampleAll(): Promise<void> {
    await Promise.all([...this.live.keys()].filter((id) => !this.inflight.has(id)).map((id) => this.sample(id)));
  }

  /** The guest console's last lines (at most 64 KiB of them), as E2B log entries. */
  async logs(id: string): Promise<{ timestamp: string; line: string }[]> {
    const l = this.live.get(id);
    if (!l || !existsSync(l.vm.consoleLog)) return [];
    const f = Bun.file(l.vm.consoleLog);
    const text = await f.slice(Math.max(0, f.size - 65536)).text();
    const ts = new Date().toISOString();
    return text.split("\n").filter((line) => line.trim() !== "").map((line) => ({ timestamp: ts, line }));
  }

  runningCount(): number {
    return this.live.size;
  }

  // ─── create ────────────────────────────────────────────────────────────────

  async create(o: CreateOptions): Promise<SandboxRecord> {
    if (this.closed) throw new OrchestratorError(503, "the node is shutting down");
    const tpl = this.templates.resolve(o.templateId);
    if (!tpl) throw new OrchestratorError(404, `template '${o.templateId}' not found`);
    if (this.store.count() >= this.opts.maxSandboxes)
      throw new OrchestratorError(429, `this node holds its maximum of ${this.opts.maxSandboxes} sandboxes`);
    egressPolicyOf(o.allowInternetAccess, o.network);
    const now = Date.now();
    const startedAt = this.store.nextStartedAt(now);
    const rec: SandboxRecord = {
      id: randomId(),
      state: "creating",
      templateId: tpl.id,
      alias: tpl.alias,
      metadata: o.metadata ?? {},
      envVars: o.envVars ?? {},
      startedAt,
      endAt: startedAt + (o.timeoutS ?? this.opts.defaultTimeoutS) * 1000,
      cpuCount: tpl.cpuCount,
      memoryMB: tpl.memoryMB,
      diskSizeMB: tpl.diskSizeMB,
      envdVersion: ENVD_VERSION,
      envdAccessToken: token(),
      // E2B: a sandbox closed to public traffic wants this token on every non-envd port.
      trafficAccessToken: (o.network as { allowPublicTraffic?: unknown } | undefined)?.allowPublicTraffic === false ? token() : null,
      autoPause: o.autoPause ?? false,
      autoResume: o.autoResume ?? false,
      allowInternetAccess: o.allowInternetAccess ?? null,
      network: o.network ?? null,
      runtime: null,
      customExtensionParams: o.customExtensionParams ?? {},
    };
    this.store.insert(rec);
    return this.track(rec.id, "create", async () => {
      try {
        const clock = new PhaseClock();
        const cp = tpl.checkpoint ?? (tpl.kind === "snapshot" ? await this.materializeSnapshot(tpl) : await this.prepareTemplate(tpl));
        clock.lap("template");
        const runtime = await this.startFrom(rec, cp, clock, { traced: true });
        const done = this.store.transition(rec.id, ["creating"], "running", { runtime, endAt: Date.now() + (o.timeoutS ?? this.opts.defaultTimeoutS) * 1000 });
        if (!done) throw new OrchestratorError(409, `sandbox ${rec.id} changed state while it was created`);
        clock.lap("record");
        this.timings.add("create", rec.id, clock);
        this.creates.successes++;
        return done;
      } catch (e) {
        this.creates.fails++;
        await this.teardown(rec.id);
        this.store.delete(rec.id);
        throw asOrchestratorError(e, `create from template '${tpl.alias ?? tpl.id}' failed`);
      }
    });
  }

  /**
   * The template booted once and checkpointed: creates restore this instead of booting. One boot
   * per template at a time; the others wait for it.
   */
  prepareTemplate(tpl: TemplateRecord): Promise<VmCheckpoint> {
    const running = this.preparing.get(tpl.id);
    if (running) return running;
    const p = (async () => {
      const id = `tpl${randomId(12)}`;
      const cpDir = join(this.opts.home, "checkpoints", `template-${tpl.id}`);
      await rm(cpDir, { recursive: true, force: true });
      mkdirSync(cpDir, { recursive: true });
      const held: BootHeld = { devices: [] };
      try {
        const vm = await this.coldBoot(id, tpl.layers, tpl, held);
        const snap = await vm.snapshot(cpDir, { resumable: false });
        if (held.tracing !== undefined) await endBootTrace(this.blockd, held.devices[0]!, held.tracing, join(cpDir, BOOT_TRACE));
        const layer = join(cpDir, "rootfs.layer");
        await this.blockd.call("restack", { id: held.devices[0], layerPath: layer });
        const cp: VmCheckpoint = { dir: cpDir, layers: [...tpl.layers, layer], envdToken: null, memLayers: await this.memoryLayers(snap, undefined) };
        this.templates.setCheckpoint(tpl.id, cp);
        if (tpl.kind === "template") this.prepareDevices(cp, tpl.diskSizeMB);
        return cp;
      } catch (e) {
        await rm(cpDir, { recursive: true, force: true });
        throw e;
      } finally {
        await this.giveBackBoot(id, held);
        this.preparing.delete(tpl.id);
      }
    })();
    this.preparing.set(tpl.id, p);
    return p;
  }

  /**
   * A VM cold-booted from `layers` (tools disk, rootfs with a fresh upper, a slot) until envd
   * answers; what it took is recorded in `held` as it is taken, for giveBackBoot.
   */
  private async coldBoot(id: string, layers: TemplateLayer[], size: VmSize, held: BootHeld, pulledTrace?: Uint8Array): Promise<Vmm> {
    held.slot = await this.slots.acquire();
    const slot = held.slot;
    const upperDir = join(this.opts.home, "sandboxes", id, "upper");
    const { drives } = await this.devices(held.devices, layers, upperDir, size.diskSizeMB);
    // Its boot is recorded (the template's boot trace); a pulled image's trace is replayed where a layer is remote.
    let replay: string | undefined;
    if (pulledTrace && layers.some(isRemoteLayer)) {
      replay = join(this.opts.home, "sandboxes", id, "pulled.trace");
      await Bun.write(replay, pulledTrace).catch((e) => {
        console.error(`orchestrator: writing ${replay}: ${(e as Error).message}`);
        replay = undefined;
      });
    }
    held.tracing = await beginBootTrace(this.blockd, held.devices[0]!, replay);
    const vm = await this.driver.boot({
      id, runDir: join(this.opts.runRoot, id), kernel: this.guest.kernel, initrd: this.guest.initrd,
      cmdline: this.guest.cmdline(slot), vcpus: size.cpuCount, memMiB: size.memoryMB, drives,
      net: { tap: slot.tap, mac: slot.guestMac }, netnsPath: slot.netnsPath,
      // Free page reporting returns what the guest frees; the node inflates it under host pressure.
      balloon: true,
    });
    held.vm = vm;
    await waitEnvdReady(`http://${slot.nsIp}:${ENVD_PORT}`, this.envdTimeoutMs, () => vm.state !== "stopped");
    return vm;
  }

  /** Stops a cold-booted VM and gives back its device, slot and directories; idempotent. */
  private async giveBackBoot(id: string, held: BootHeld): Promise<void> {
    await held.vm?.stop().catch(() => {});
    held.vm = undefined;
    await this.giveBackDevice(held.devices.shift() ?? null);
    await rm(join(this.opts.home, "sandboxes", id), { recursive: true, force: true });
    await rm(join(this.opts.runRoot, id), { recursive: true, force: true });
    if (held.slot) await this.slots.release(held.slot).catch(() => {});
    held.slot = undefined;
  }

  // ─── template builds ───────────────────────────────────────────────────────

  /**
   * A VM for a template build, cold-booted from a clean layer stack (a restore would bring back a
   * page cache that does not match layers added by cached steps). The builder runs steps through
   * its envd, seals the rootfs upper after each step and checkpoints it when ready. `pulledTrace`:
   * the pulled image's boot trace, replayed on the rootfs before the VM starts (remote layers only).
   */
  async startBuildVm(layers: TemplateLayer[], size: VmSize, pulledTrace?: Uint8Array): Promise<BuildVm> {
    if (this.closed) throw new OrchestratorError(503, "the node is shutting down");
    const id = `bld${randomId(12)}`;
    const held: BootHeld = { devices: [] };
    let vm: Vmm;
    try {
      vm = await this.coldBoot(id, layers, size, held, pulledTrace);
    } catch (e) {
      await this.giveBackBoot(id, held);
      throw asOrchestratorError(e, "booting the build VM");
    }
    const device = held.devices[0]!;
    return {
      envdUrl: `http://${held.slot!.nsIp}:${ENVD_PORT}`,
      alive: () => vm.state !== "stopped",
      seal: async (layerPath) => {
        await vm.pause();
        try {
          await this.blockd.call("restack", { id: device, layerPath });
        } finally {
          await vm.resume();
        }
      },
      checkpoint: async (templateId, stack) => {
        const dir = join(this.opts.home, "checkpoints", `template-${templateId}-${randomId(8)}`);
        this.buildCheckpoints.add(dir);
        try {
          const snap = await vm.snapshot(dir, { resumable: false });
          if (held.tracing !== undefined) await endBootTrace(this.blockd, device, held.tracing, join(dir, BOOT_TRACE));
          const layer = join(dir, "rootfs.layer");
          await this.blockd.call("restack", { id: device, layerPath: layer });
          return { dir, layers: [...stack, layer], envdToken: null, memLayers: await this.memoryLayers(snap, undefined) };
        } catch (e) {
          this.discardBuildCheckpoint(dir);
          throw e;
        }
      },
      stop: () => this.giveBackBoot(id, held),
    };
  }

  /** A build checkpoint that will not be published: its directory goes. */
  discardBuildCheckpoint(dir: string): void {
    this.buildCheckpoints.delete(dir);
    rm(dir, { recursive: true, force: true }).catch((e) => console.error(`orchestrator: removing ${dir}: ${(e as Error).message}`));
  }

  /**
   * A finished build becomes the template (a new one, or in place of its previous build: sandboxes
   * of the old build keep its checkpoint until they go). Devices are prepared for the new stack.
   */
  publishTemplate(t: TemplateRecord): void {
    const old = this.templates.list("template").find((x) => x.id === t.id);
    this.templates.upsert(t);
    if (t.checkpoint) this.buildCheckpoints.delete(t.checkpoint.dir);
    if (old?.checkpoint && old.checkpoint.dir !== t.checkpoint?.dir) this.prepareDevices(old.checkpoint, old.diskSizeMB, 0);
    if (t.checkpoint) this.prepareDevices(t.checkpoint, t.diskSizeMB);
    this.collectCheckpointsLater();
  }

  /** The node's one tools disk device (a reference taken once; every VM opens the same file). */
  private toolsDisk(): Promise<{ id: string; path: string }> {
    this.tools ??= this.blockd.call<{ id: string; path: string }>("createReadOnly", { lowers: [this.guest.toolsLayer] }).catch((e) => {
      this.tools = undefined;
      throw e;
    });
    return this.tools;
  }

  /**
   * The tools disk and a rootfs with a fresh upper (`held`: one already acquired, a resume's);
   * the rootfs id is pushed to `devices` once made.
   */
  private async devices(devices: string[], layers: TemplateLayer[], upperDir: string, diskSizeMB: number, held?: ResumeDevice): Promise<{ drives: DriveSpec[] }> {
    const tools = await this.toolsDisk();
    const rootfs = held ?? (await this.acquireRootfs(layers, upperDir, diskSizeMB));
    if (!held) devices.push(rootfs.id);
    return { drives: [{ path: tools.path, readOnly: true }, { path: rootfs.path }] };
  }

  /** From blockd's pool: for a prepared stack, a device with the lowers already open. */
  private async acquireRootfs(layers: TemplateLayer[], upperDir: string, diskSizeMB: number): Promise<{ id: string; path: string }> {
    mkdirSync(join(upperDir, ".."), { recursive: true });
    return this.blockd.call("acquire", { lowers: await this.lowers(layers), upperDir, size: diskSizeMB * 1024 * 1024 });
  }

  /** A stack as blockd's lowers: files as they are, remote layers as the node hands them over now. */
  private lowers(layers: TemplateLayer[]): Promise<TemplateLayer[]> {
    const view = this.opts.remoteLayer;
    if (!view || !layers.some(isRemoteLayer)) return Promise.resolve(layers);
    return Promise.all(layers.map((l) => (isRemoteLayer(l) ? view(l) : l)));
  }

  /**
   * Asks blockd to keep rootfs devices ready for a checkpoint's stack (count 0 retires them), for
   * `acquires` acquires of it if given (a fork's children). Best effort: without them, creates
   * take the plain acquire path.
   */
  private prepareDevices(cp: VmCheckpoint, diskSizeMB: number, count = this.opts.preparedDevices ?? 2, acquires?: number): Promise<void> {
    // Its memory device too: kept open while devices are kept ready for the stack.
    if (cp.memLayers?.length) {
      if (count > 0) this.memDevices.pin(cp.memLayers);
      else this.memDevices.unpin(cp.memLayers);
    }
    const failed = (e: unknown) => console.error(`orchestrator: prepare devices for ${cp.dir}: ${(e as Error).message}`);
    // Resolves once the call is sent (a later call for the same stack then lands after it).
    return this.lowers(cp.layers).then((lowers) => {
      this.blockd.call("prepare", { lowers, size: diskSizeMB * 1024 * 1024, count, acquires }).catch(failed);
    }).catch(failed);
  }

  /** Paused sandboxes whose row names a ResumeDevice, oldest first (RESUME_READY_MAX, past it while resumes take theirs). */
  private readonly resumeReady = new Set<string>();

  /**
   * Acquires the rootfs device of paused sandbox `id`'s resume (its paused stack, a fresh upper)
   * and records it in its row; run in the pause's cleanup, which its resume and kill wait for.
   * The oldest holders past RESUME_READY_MAX give theirs back. Best effort: a resume without one
   * acquires its device as a create does.
   */
  private async acquireForResume(id: string, cp: VmCheckpoint, diskSizeMB: number): Promise<void> {
    const upperDir = join(this.opts.home, "sandboxes", id, `upper-${randomId(6)}`);
    let d: { id: string; path: string };
    try {
      d = await this.acquireRootfs(cp.layers, upperDir, diskSizeMB);
    } catch (e) {
      console.error(`orchestrator: a device for the resume of ${id}: ${(e as Error).message}`);
      return void (await rm(upperDir, { recursive: true, force: true }));
    }
    const rec = this.store.get(id);
    const rt = rec?.runtime as SandboxRuntime | null | undefined;
    if (rec?.state !== "paused" || rt?.paused?.dir !== cp.dir) {
      // Unreachable while resume and kill wait for the cleanup; given back rather than leaked.
      await this.giveBackDevice(d.id);
      return void (await rm(upperDir, { recursive: true, force: true }));
    }
    this.store.setRuntime(id, { ...rt, resumeDevice: { id: d.id, path: d.path, upperDir } });
    this.resumeReady.add(id);
    await this.trimResumeDevices();
  }

  /** The oldest paused holders past RESUME_READY_MAX give their devices back (a sandbox in an operation keeps its own). */
  private async trimResumeDevices(): Promise<void> {
    for (const id of [...this.resumeReady]) {
      if (this.resumeReady.size <= RESUME_READY_MAX) return;
      if (!this.inflight.has(id) && this.store.get(id)?.state === "paused") await this.dropResumeDevice(id);
    }
  }

  /** Paused sandbox `id` gives back its ResumeDevice: its row stops naming it first. */
  private async dropResumeDevice(id: string): Promise<void> {
    this.resumeReady.delete(id);
    const rt = this.store.get(id)?.runtime as SandboxRuntime | null | undefined;
    const d = rt?.resumeDevice;
    if (!d) return;
    this.store.setRuntime(id, { ...rt, resumeDevice: null });
    await this.giveBackDevice(d.id);
    await rm(d.upperDir, { recursive: true, force: true });
  }

  /** At node start: devices ready for every template that has a checkpoint. */
  warmUp(): void {
    for (const t of this.templates.list("template")) if (t.checkpoint) this.prepareDevices(t.checkpoint, t.diskSizeMB);
  }

  /**
   * A VM for `rec` restored from `cp` in a fresh slot with a fresh upper, envd initialised.
   * `traced`: a template's or snapshot's checkpoint, whose starts record and replay prefetch traces (start_traces.ts).
   * `ready` (a fork's first children, started at its seal): the checkpoint's VM state and memory
   * are still being written; the slot and the rootfs device are taken meanwhile, the memory device
   * and the snapshot after it, and the clock charges our steps only for what outlasts it
   * ("checkpoint": the source's, timed in its own row).
   * `resume` (a paused sandbox's): its rootfs is `held`, the device acquired at its pause, if given.
   */
  private async startFrom(rec: SandboxRecord, cp: VmCheckpoint, clock = new PhaseClock(), o: { traced?: boolean; ready?: Promise<void>; resume?: { held?: ResumeDevice } } = {}): Promise<SandboxRuntime> {
    const held = o.resume?.held;
    const devices: string[] = held ? [held.id] : [];
    const upperDir = held?.upperDir ?? join(this.opts.home, "sandboxes", rec.id, `upper-${randomId(6)}`);
    // A resume's row keeps naming its checkpoint until it runs: a restart mid-way pauses it again.
    const rt: SandboxRuntime = {
      slot: null, toolsDevice: null, rootfsDevice: held?.id ?? null, upperDir, layers: cp.layers, vmPid: null,
      runDir: join(this.opts.runRoot, rec.id), paused: o.resume ? cp : null, checkpoints: checkpointDirs(cp), memLayers: cp.memLayers, memDevice: null,
    };
    // Recorded before each step, so a crash or a kill mid-way can find what to give back.
    const save = () => this.store.setRuntime(rec.id, rt);
    if (held) save(); // the row names the held device as this start's, and no longer as the paused one's
    // One memory device per memory stack, shared by every VM restored from it (blockd counts
    // them), asked for alongside the rootfs device once the stack is written.
    const takeMemory = () =>
      cp.memLayers?.length
        ? this.memDevices.take(cp.memLayers, rec.id).then((m) => {
            rt.memDevice = m.id;
            return m.path;
          })
        : undefined;
    const readFirst = () => {
      const reading = readSnapshot(cp.dir); // read while blockd gets the devices
      reading.catch(() => {});
      return { reading, memory: takeMemory() };
    };
    let then = o.ready ? undefined : readFirst();
    const own = (async () => {
      const slot = (rt.slot = await this.slots.acquire());
      save();
      // The policy is in force before the VM runs; read from the store now, so a PUT meanwhile is not lost.
      await this.applyEgress(rec.id, slot);
      if (!o.ready) clock.lap("slot");
      try {
        return { slot, drives: (await this.devices(devices, cp.layers, upperDir, rec.diskSizeMB, held)).drives };
      } finally {
        rt.rootfsDevice = devices[0] ?? null;
      }
    })();
    own.catch(() => {});
    // On a throw, the caller's teardown() gives back what the saved runtime names.
    {
      if (o.ready) {
        try {
          await o.ready;
        } catch (e) {
          await own.catch(() => {});
          save();
          throw e;
        }
        clock.lap("checkpoint");
        rt.memLayers = cp.memLayers;
        rt.checkpoints = checkpointDirs(cp);
        then = readFirst();
      }
      const { reading, memory } = then!;
      let drives: DriveSpec[];
      let slot: Slot;
      try {
        ({ drives, slot } = await own);
      } finally {
        await memory?.catch(() => {}); // settled, so the record names it before a teardown reads it
        save();
      }
      const snap = await reading;
      const memImage = await memory;
      // The checkpoint's traces replayed ahead of the guest (rootfs: where a layer is remote), or recorded at its first start here.
      const traced = !o.traced ? () => {} : await this.traces.begin(cp.dir, [
        ...(rt.rootfsDevice ? [{ id: rt.rootfsDevice, file: ROOTFS_TRACE, replay: cp.layers.some(isRemoteLayer) }] : []),
        ...(rt.memDevice ? [{ id: rt.memDevice, file: MEMORY_TRACE, replay: true, shared: true }] : []),
      ]);
      clock.lap("devices");
      const vm = await this.driver.restore(snap, {
        id: rec.id, runDir: rt.runDir!, drives, net: { tap: slot.tap, mac: slot.guestMac }, netnsPath: slot.netnsPath, memImage,
      });
      clock.lap("vmm");
      rt.vmPid = vm.pid;
      this.live.set(rec.id, { vm, slot });
      save();
      clock.lap("record");
      const url = `http://${slot.nsIp}:${ENVD_PORT}`;
      await waitEnvdReady(url, this.envdTimeoutMs, () => vm.state !== "stopped");
      traced();
      clock.lap("guest");
      // A built or pulled template's env, user and working directory; the request's env wins.
      const config = this.templates.resolve(rec.templateId)?.config;
      await initEnvd(url, {
        accessToken: rec.envdAccessToken,
        currentToken: cp.envdToken,
        envVars: { ...config?.env, ...rec.envVars, E2B_SANDBOX_ID: rec.id, E2B_TEMPLATE_ID: rec.templateId },
        defaultUser: config?.user,
        defaultWorkdir: config?.workdir,
        caBundle: this.opts.caBundle,
      }, 30_000);
      clock.lap("init");
      return rt;
    }
  }

  // ─── lifecycle ─────────────────────────────────────────────────────────────

  /**
   * Runs `fn` as the one operation in flight on `id`. A second request for the same operation
   * joins it; a request for another one gets 409 (kill waits for it instead).
   */
  private track<T>(id: string, op: string, fn: () => Promise<T>): Promise<T> {
    const cur = this.inflight.get(id);
    if (cur) {
      if (cur.op === op) return cur.done as Promise<T>;
      throw new OrchestratorError(409, `sandbox ${id} is busy: ${cur.op} in progress`);
    }
    const done = fn().finally(() => this.inflight.delete(id));
    this.inflight.set(id, { op, done });
    return done;
  }

  private async settled(id: string): Promise<void> {
    for (let cur = this.inflight.get(id); cur; cur = this.inflight.get(id)) await cur.done.catch(() => {});
  }

  async kill(id: string): Promise<void> {
    if (!this.store.get(id)) throw notFound(id);
    await this.settled(id);
    const rec = this.store.transition(id, ["running", "paused"], "killing");
    if (!rec) {
      if (!this.store.get(id) || this.store.get(id)!.state === "killing") throw notFound(id);
      return this.kill(id); // a new operation started between the wait and the transition
    }
    await this.track(id, "kill", async () => {
      await this.teardown(id);
      this.store.delete(id);
      this.collectCheckpointsLater();
    });
  }

  async pause(id: string): Promise<void> {
    const rec = this.get(id);
    if (rec.state === "paused") throw new OrchestratorError(409, `sandbox ${id} is already paused`);
    const cur = this.inflight.get(id);
    if (cur?.op === "pause") return cur.done as Promise<void>;
    if (!this.store.transition(id, ["running"], "pausing")) {
      const now = this.store.get(id);
      if (now?.state === "paused" || now?.state === "pausing") throw new OrchestratorError(409, `sandbox ${id} is already paused`);
      throw new OrchestratorError(409, `sandbox ${id} is ${now?.state ?? "gone"}`);
    }
    await this.track(id, "pause", async () => {
      const rt = this.runtime(id);
      const live = this.live.get(id);
      try {
        if (!live || !rt.rootfsDevice) throw new OrchestratorError(500, `sandbox ${id} has no VM to pause`);
        const clock = new PhaseClock();
        // The VMM stops while its rootfs is restacked (its state is saved and its disks flushed by
        // then); devices and slot go back after the answer.
        const cp = await this.checkpoint(id, live.vm, rt, { resumable: false, stop: () => {
          for (const cb of this.goneListeners) cb(id);
          return live.vm.stop();
        } }, clock);
        this.live.delete(id);
        const paused: SandboxRuntime = { ...rt, slot: null, toolsDevice: null, rootfsDevice: null, upperDir: null, vmPid: null, paused: cp, layers: cp.layers, checkpoints: checkpointDirs(cp), memLayers: cp.memLayers, memDevice: null };
        this.store.transition(id, ["pausing"], "paused", { runtime: paused });
        clock.lap("record");
        this.timings.add("pause", id, clock);
        // The answer does not wait for the rest: the slot's scrub, the device and the page cache.
        this.afterReply(id, "pause", async () => {
          await this.release(id, rt);
          // Its resume will want its own memory stack: opened now, kept while it is among the last left.
          if (cp.memLayers) this.memDevices.warm(cp.memLayers);
          await rm(join(this.opts.home, "sandboxes", id), { recursive: true, force: true });
          await this.acquireForResume(id, cp, rec.diskSizeMB);
          // A paused sandbox's memory lives on disk, not in the host's page cache.
          for (const f of ["mem", "mem.layer", "vmstate"]) await dropCache(join(cp.dir, f));
          await this.collectCheckpoints();
        });
      } catch (e) {
        // Still running if the VM is: back to running; otherwise the sandbox is lost and goes.
        if (live && live.vm.state !== "stopped") {
          await live.vm.resume().catch(() => {});
          this.store.transition(id, ["pausing"], "running");
        } else {
          await this.teardown(id);
          this.store.delete(id);
        }
        throw e;
      }
    });
  }

  /**
   * Connect (E2B): a running sandbox gets its TTL extended (never shortened) → "running"; a paused
   * one is resumed with the TTL set → "resumed"; a connect that joins a resume in flight extends
   * the TTL. `extendOnly` (auto-resume by traffic): a resume never shortens the TTL either, its
   * end becomes max(the stored end, now + timeoutS).
   */
  async connect(id: string, timeoutS: number, o: { extendOnly?: boolean } = {}): Promise<{ rec: SandboxRecord; resumed: boolean }> {
    const rec = this.get(id);
    const endAt = Date.now() + timeoutS * 1000;
    if (rec.state === "running") return { rec: this.store.setEndAt(id, endAt, true)!, resumed: false };
    const cur = this.inflight.get(id);
    if (cur?.op === "resume") {
      await cur.done;
      return { rec: this.store.setEndAt(id, Date.now() + timeoutS * 1000, true) ?? this.get(id), resumed: true };
    }
    if (cur) await this.settled(id);
    const now = this.get(id);
    if (now.state === "running") return { rec: this.store.setEndAt(id, endAt, true)!, resumed: false };
    if (now.state !== "paused") throw new OrchestratorError(409, `sandbox ${id} is ${now.state}`);
    if (!this.store.transition(id, ["paused"], "resuming")) return this.connect(id, timeoutS, o);
    const out = await this.track(id, "resume", async () => {
      await this.cleanups.get(id);
      const rt = this.runtime(id);
      const cp = rt.paused;
      if (!cp) throw new OrchestratorError(500, `paused sandbox ${id} has no checkpoint`);
      // Its device acquired at the pause, if it holds one: from here on the resume's (startFrom records it).
      const held = rt.resumeDevice ?? undefined;
      this.resumeReady.delete(id);
      try {
        const clock = new PhaseClock();
        const started = await this.startFrom(now, cp, clock, { resume: { held } });
        const until = Date.now() + timeoutS * 1000;
        const end = o.extendOnly ? Math.max(this.store.get(id)?.endAt ?? 0, until) : until;
        const out = this.store.transition(id, ["resuming"], "running", { runtime: { ...started, paused: null }, endAt: end })!;
        clock.lap("record");
        this.timings.add("resume", id, clock);
        return out;
      } catch (e) {
        await this.teardown(id, { keepPaused: true });
        this.store.transition(id, ["resuming"], "paused", { runtime: { ...rt, resumeDevice: null } });
        throw asOrchestratorError(e, `resume of ${id} failed`);
      }
    });
    return { rec: out, resumed: true };
  }

  /**
   * Puts the stored policy of sandbox `id` in force on `slot`. Called right after each store write
   * of the policy or the slot (no await in between), so the last call carries the last policy.
   */
  private applyEgress(id: string, slot: Slot): Promise<void> {
    const rec = this.store.get(id);
    if (!this.opts.egress || !rec) return Promise.resolve();
    return this.opts.egress.apply(slot, id, egressPolicyOf(rec.allowInternetAccess, rec.network));
  }

  /**
   * PUT /sandboxes/{id}/network: replaces the sandbox's egress settings (omitted ones cleared, the
   * inbound ones kept); a running sandbox gets them live and loses its connections they refuse. A
   * malformed body is a 400 naming the field, and the policy in force stays.
   */
  async updateNetwork(id: string, body: Record<string, unknown>): Promise<void> {
    const old = this.get(id);
    const allow = body.allow_internet_access ?? null;
    const network: Record<string, unknown> = { ...((old.network ?? {}) as Record<string, unknown>) };
    for (const f of EGRESS_FIELDS) {
      if (body[f] === undefined) delete network[f];
      else network[f] = body[f];
    }
    egressPolicyOf(allow, network);
    if (!this.store.setNetwork(id, allow as boolean | null, network)) throw notFound(id);
    const slot = (this.store.get(id)?.runtime as SandboxRuntime | null)?.slot;
    if (!slot) return; // paused or not yet placed: applied when it gets a slot
    try {
      await this.applyEgress(id, slot);
    } catch (e) {
      this.store.setNetwork(id, old.allowInternetAccess, old.network);
      await this.applyEgress(id, slot).catch(() => {});
      throw asOrchestratorError(e, `applying the network policy of ${id}`);
    }
  }

  setTimeout(id: string, timeoutS: number): SandboxRecord {
    this.get(id);
    const r = this.store.setEndAt(id, Date.now() + timeoutS * 1000, false);
    if (!r) throw notFound(id);
    return r;
  }

  /** Checkpoint a running sandbox in place and start `count` children from it; one result each. */
  async fork(id: string, count: number, timeoutS: number | undefined): Promise<({ rec: SandboxRecord } | { error: OrchestratorError })[]> {
    const src = this.get(id);
    if (src.state !== "running" || this.inflight.has(id)) throw new OrchestratorError(409, `sandbox ${id} is ${src.state}, not running`);
    if (!this.store.transition(id, ["running"], "forking")) throw new OrchestratorError(409, `sandbox ${id} is busy`);
    // The first children (one per child started at once) start at the seal, before the checkpoint
    // is done: their slots and rootfs devices are taken while the VMM writes the memory (startFrom's
    // `ready`). For the children after them, devices of the children's own stack are prepared from
    // the seal on and replaced as children take them; retired when the fork ends.
    let preparing: { cp: VmCheckpoint; sent: Promise<void> } | undefined;
    /** The children's memory stack, pinned while they start (with or without devices prepared). */
    let pinned: string[] | undefined;
    const early: Promise<SandboxRecord>[] = [];
    let checkpointed!: (error?: Error) => void;
    const ready = new Promise<void>((resolve, reject) => (checkpointed = (error) => (error ? reject(error) : resolve())));
    ready.catch(() => {});
    try {
      const cp = await this.track(id, "fork", async () => {
        const rt = this.runtime(id);
        const live = this.live.get(id);
        let memoryAhead: AheadDevice | undefined;
        try {
          if (!live) throw new OrchestratorError(500, `sandbox ${id} has no VM`);
          const clock = new PhaseClock();
          const parallel = Math.min(count, this.opts.forkParallelism ?? 4);
          const onSealed = (c: VmCheckpoint) => {
            // Every acquire of the stack counts against the target, the early ones too.
            if (count > parallel) preparing = { cp: c, sent: this.prepareDevices(c, src.diskSizeMB, Math.min(count - parallel, parallel, FORK_PREPARED_MAX), count) };
            for (let i = 0; i < parallel; i++) {
              const child = this.createFromCheckpoint(src, c, timeoutS, ready);
              child.catch(() => {}); // settled by its worker below, or by the catch if the fork fails
              early.push(child);
            }
          };
          // The children's memory stack is the source's plus the layer this checkpoint writes
          // (unless it compacts): a device over the source's is taken now and grown into it then.
          const below = rt.memLayers;
          memoryAhead = below?.length && !this.compactsMemory(below) ? this.memDevices.ahead(below) : undefined;
          const cp = await this.checkpoint(id, live.vm, rt, { resumable: true, onSealed }, clock);
          const resumed = live.vm.resume();
          // The children's memory device, opened once for all of them (unpinned with their rootfs devices).
          pinned = cp.memLayers;
          const memory = pinned ? this.memDevices.pin(pinned, memoryAhead) : undefined;
          await resumed;
          clock.lap("vmm");
          await memory;
          clock.lap("memory-device");
          this.timings.add("fork-checkpoint", id, clock);
          checkpointed();
          return cp;
        } catch (e) {
          checkpointed(new OrchestratorError(500, `the checkpoint of ${id} failed: ${(e as Error).message}`));
          throw e;
        } finally {
          if (memoryAhead) this.memDevices.drop(memoryAhead); // not grown: back to the pool
          if (live?.vm.state === "paused") await live.vm.resume().catch(() => {});
          this.store.transition(id, ["forking"], "running", { runtime: rt });
        }
      });
      const results: ({ rec: SandboxRecord } | { error: OrchestratorError })[] = new Array(count);
      const settle = (child: Promise<SandboxRecord>, i: number) =>
        child.then(
          (rec) => void (results[i] = { rec }),
          (e) => void (results[i] = { error: e instanceof OrchestratorError ? e : new OrchestratorError(500, (e as Error).message) }),
        );
      let next = early.length;
      // Worker j goes on from child j when that one started early.
      const worker = async (j: number) => {
        if (j < early.length) await settle(early[j]!, j);
        for (let i = next++; i < count; i = next++) await settle(this.createFromCheckpoint(src, cp, timeoutS), i);
      };
      await Promise.all(Array.from({ length: Math.min(count, this.opts.forkParallelism ?? 4) }, (_, j) => worker(j)));
      this.collectCheckpointsLater();
      return results;
    } catch (e) {
      await Promise.allSettled(early); // each gave back what it took (createFromCheckpoint)
      throw e;
    } finally {
      const p = preparing;
      if (p) void p.sent.then(() => this.prepareDevices(p.cp, src.diskSizeMB, 0));
      if (pinned) this.memDevices.unpin(pinned); // its children hold it now
    }
  }

  /** A fork child; `ready`: see startFrom. */
  private async createFromCheckpoint(src: SandboxRecord, cp: VmCheckpoint, timeoutS: number | undefined, ready?: Promise<void>): Promise<SandboxRecord> {
    if (this.store.count() >= this.opts.maxSandboxes)
      throw new OrchestratorError(429, `this node holds its maximum of ${this.opts.maxSandboxes} sandboxes`);
    const startedAt = this.store.nextStartedAt();
    const ttl = (timeoutS ?? Math.max(1, Math.round((src.endAt - src.startedAt) / 1000))) * 1000;
    const rec: SandboxRecord = {
      ...src, id: randomId(), state: "creating", startedAt, endAt: startedAt + ttl,
      envdAccessToken: token(), trafficAccessToken: src.trafficAccessToken === null ? null : token(), runtime: null,
    };
    this.store.insert(rec);
    return this.track(rec.id, "create", async () => {
      try {
        const clock = new PhaseClock();
        const runtime = await this.startFrom(rec, cp, clock, { ready });
        const out = this.store.transition(rec.id, ["creating"], "running", { runtime, endAt: Date.now() + ttl })!;
        clock.lap("record");
        this.timings.add("fork-child", rec.id, clock);
        this.creates.successes++;
        return out;
      } catch (e) {
        this.creates.fails++;
        await this.teardown(rec.id);
        this.store.delete(rec.id);
        throw asOrchestratorError(e, `fork of ${src.id} failed`);
      }
    });
  }

  /** A named snapshot of a running sandbox: a template of kind "snapshot"; the sandbox keeps running. */
  async snapshot(id: string, name: string | undefined): Promise<TemplateRecord> {
    const src = this.get(id);
    if (src.state !== "running" || this.inflight.has(id)) throw new OrchestratorError(409, `sandbox ${id} is ${src.state}, not running`);
    if (name !== undefined && this.templates.resolve(name)) throw new OrchestratorError(409, `a template or snapshot named '${name}' exists`);
    if (!this.store.transition(id, ["running"], "snapshotting")) throw new OrchestratorError(409, `sandbox ${id} is busy`);
    const cp = await this.track(id, "snapshot", async () => {
      const rt = this.runtime(id);
      const live = this.live.get(id);
      try {
        if (!live) throw new OrchestratorError(500, `sandbox ${id} has no VM`);
        return await this.checkpoint(id, live.vm, rt, { resumable: true });
      } finally {
        await live?.vm.resume().catch(() => {});
        this.store.transition(id, ["snapshotting"], "running", { runtime: rt });
      }
    });
    const snapId = randomId();
    const alias = name ?? null;
    const t: TemplateRecord = {
      id: snapId, alias, kind: "snapshot", names: [`${alias ?? snapId}:default`], cpuCount: src.cpuCount,
      memoryMB: src.memoryMB, diskSizeMB: src.diskSizeMB, layers: cp.layers, checkpoint: cp, sourceSandboxId: id,
      envdVersion: src.envdVersion, createdAt: Date.now(), config: this.templates.resolve(src.templateId)?.config ?? null,
    };
    try {
      this.templates.insert(t);
    } catch (e) {
      this.collectCheckpointsLater();
      throw new OrchestratorError(409, (e as Error).message);
    }
    if (this.opts.snapshots) {
      try {
        await this.storeSnapshot(t, cp);
      } catch (e) {
        this.templates.delete(t.id);
        this.collectCheckpointsLater();
        throw asOrchestratorError(e, `storing snapshot ${t.id}`);
      }
    }
    return t;
  }

  /**
   * A start trace written into a snapshot's checkpoint goes to the snapshot store beside it, so a
   * cold node's first start from the snapshot replays it (best effort: a failure is logged).
   */
  private traceKept(path: string): void {
    const store = this.opts.snapshots;
    if (!store) return;
    const dir = dirname(path);
    const snap = this.templates.list("snapshot").find((t) => t.checkpoint?.dir === dir);
    if (!snap) return;
    store.attach(snap.id, basename(path), path).catch((e) => console.error(`orchestrator: attaching ${basename(path)} to snapshot ${snap.id}: ${(e as Error).message}`));
  }

  /** The snapshot's files and record into the snapshot store (layers stored once by content). */
  private async storeSnapshot(t: TemplateRecord, cp: VmCheckpoint): Promise<void> {
    const vm = await readSnapshot(cp.dir);
    const files = [{ name: "vmstate", path: vm.statePath }, ...(vm.memPath ? [{ name: "mem", path: vm.memPath }] : []),
      ...cp.layers.flatMap((path, i) => (typeof path === "string" ? [{ name: `layer-${i}`, path, shared: true }] : [])),
      ...(cp.memLayers ?? []).map((path, i) => ({ name: `mem-layer-${i}`, path, shared: true }))];
    // A remote layer stays where it is (its registry): the record names it instead of a file.
    const remote = Object.fromEntries(cp.layers.flatMap((l, i) => (isRemoteLayer(l) ? [[String(i), l]] : [])));
    const meta: StoredSnapshotMeta = {
      vm, layers: cp.layers.length, memLayers: cp.memLayers?.length ?? 0, envdToken: cp.envdToken, alias: t.alias, names: t.names, cpuCount: t.cpuCount,
      memoryMB: t.memoryMB, diskSizeMB: t.diskSizeMB, envdVersion: t.envdVersion, sourceSandboxId: t.sourceSandboxId, createdAt: t.createdAt,
      ...(Object.keys(remote).length ? { remote } : {}),
    };
    await this.opts.snapshots!.put(t.id, files, meta as unknown as Json);
  }

  /**
   * A snapshot known from the store but with no checkpoint on this node: its files are fetched
   * (S3) or found (a directory), linked into a checkpoint directory of this node, and recorded.
   */
  private async materializeSnapshot(t: TemplateRecord): Promise<VmCheckpoint> {
    const store = this.opts.snapshots;
    if (!store) throw new OrchestratorError(500, `snapshot ${t.id} has no checkpoint on this node and no snapshot store is configured`);
    const running = this.preparing.get(t.id);
    if (running) return running;
    const p = (async () => {
      const got = await store.get(t.id);
      const meta = got.meta as unknown as StoredSnapshotMeta;
      const dir = join(this.opts.home, "checkpoints", `snapshot-${t.id}`);
      await rm(dir, { recursive: true, force: true });
      mkdirSync(dir, { recursive: true });
      try {
        for (const [name, path] of Object.entries(got.paths)) await linkOrCopy(path, join(dir, name));
        // Start traces the store has for it (recorded where the snapshot was first started): replayed at this node's starts.
        for (const name of [ROOTFS_TRACE, MEMORY_TRACE]) {
          await store.attachment(t.id, name, join(dir, name)).catch((e) => console.error(`orchestrator: ${name} of snapshot ${t.id}: ${(e as Error).message}`));
        }
        const vm: SnapshotInfo = { ...meta.vm, dir, statePath: join(dir, "vmstate"), memPath: got.paths.mem ? join(dir, "mem") : undefined };
        await writeSnapshot(vm);
        const memLayers = Array.from({ length: meta.memLayers ?? 0 }, (_, i) => join(dir, `mem-layer-${i}`));
        const cp: VmCheckpoint = {
          dir, layers: Array.from({ length: meta.layers }, (_, i) => meta.remote?.[String(i)] ?? join(dir, `layer-${i}`)), envdToken: meta.envdToken,
          ...(memLayers.length ? { memLayers } : {}),
        };
        this.templates.setCheckpoint(t.id, cp);
        return cp;
      } catch (e) {
        await rm(dir, { recursive: true, force: true });
        throw e;
      }
    })().finally(() => this.preparing.delete(t.id));
    this.preparing.set(t.id, p);
    return p;
  }

  /**
   * At node start: snapshots in the store that this node has no record of (taken by another node
   * on a shared store, or before this node's state was lost) become snapshot templates; their
   * files are fetched on first use.
   */
  async importSnapshots(): Promise<string[]> {
    const store = this.opts.snapshots;
    if (!store) return [];
    const added: string[] = [];
    for (const id of await store.list()) {
      if (this.templates.resolve(id)) continue;
      try {
        const meta = (await store.get(id)).meta as unknown as StoredSnapshotMeta;
        this.templates.insert({
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

  async deleteTemplate(ref: string): Promise<boolean> {
    const t = this.templates.resolve(ref);
    if (!t) return false;
    if (t.checkpoint && t.kind === "template") this.prepareDevices(t.checkpoint, t.diskSizeMB, 0);
    if (t.kind === "snapshot" && this.opts.snapshots) await this.opts.snapshots.delete(t.id);
    this.templates.delete(t.id);
    this.collectCheckpointsLater();
    return true;
  }

  /**
   * Pauses the VM, writes its device state and memory into a new checkpoint directory and seals the
   * rootfs upper into a layer there (the device carries on over a fresh upper). `resumable`: the
   * VM may run again (memory copied), else the checkpoint takes its memory over. `stop` (a pause):
   * the VMM is stopped once its state is written. The rootfs is restacked while the VMM works
   * (QEMU: from its pause on, which drains and flushes every disk; otherwise once the snapshot
   * has flushed them), so the restack costs only what outlasts the VMM. `onSealed`: the new
   * stack, as soon as its layer is sealed (a fork prepares its children's devices meanwhile).
   */
  private async checkpoint(id: string, vm: Vmm, rt: SandboxRuntime, o: { resumable: boolean; stop?: () => Promise<void>; onSealed?: (cp: VmCheckpoint) => void }, clock = new PhaseClock()): Promise<VmCheckpoint> {
    const envdToken = this.store.get(id)?.envdAccessToken ?? null;
    const dir = join(this.opts.home, "checkpoints", `${id}-${randomId(8)}`);
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
        if (rt.rootfsDevice) this.traces.endOn(rt.rootfsDevice);
        return this.blockd.call("restack", { id: rt.rootfsDevice, layerPath: layer }).then(() => {
          sealed = true;
          o.onSealed?.(cp);
        });
      };
      const sealing = early ? restack() : undefined;
      const snap = vm.snapshot(dir, { resumable: o.resumable });
      const vmm = snap.then(async (info) => {
        clock.lap("vmm");
        // The dirty pages are read from the VMM process: before it stops or runs on.
        cp.memLayers = await this.memoryLayers(info, rt.memLayers);
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
      // A sealed layer is a lower of the rootfs from now on, checkpoint or not: the sandbox keeps it.
      if (sealed) {
        rt.layers = cp.layers;
        rt.checkpoints = [...rt.checkpoints, dir];
        this.store.setRuntime(id, rt);
      }
    }
  }

  /**
   * A snapshot's memory as layers (docs/vmm.md, "Memory layers"): its delta (the pages dirtied
   * since the VM's memory image) stacked on `below`, a fresh base layer past memoryLayersMax,
   * or its whole memory file as a base layer (the file then goes). Undefined: none of these.
   */
  private async memoryLayers(snap: SnapshotInfo, below: string[] | undefined): Promise<string[] | undefined> {
    const out = join(snap.dir, "mem.layer");
    const d = snap.delta;
    if (d) {
      if (!below?.length) throw new OrchestratorError(500, `${snap.dir}: a memory delta with no memory layers below it`);
      let pagesFile = d.pagesFile;
      const compact = this.compactsMemory(below);
      if (compact) {
        // Compaction: every page of the guest into one base layer (its cost is the guest's size, once in memoryLayersMax pauses).
        pagesFile = join(snap.dir, "mem.all");
        await Bun.write(pagesFile, new Uint32Array([0, d.size / d.pageSize]));
      }
      await this.blockd.call("memoryLayer", { out, size: d.size, from: { pid: d.pid, address: d.address, pagesFile }, zfile: this.opts.memoryZfile });
      await rm(d.pagesFile, { force: true });
      if (compact) await rm(pagesFile, { force: true });
      return compact ? [out] : [...below, out];
    }
    if (!snap.memPath) return undefined;
    await this.blockd.call("memoryLayer", { out, size: snap.spec.memMiB * 1024 * 1024, from: { file: snap.memPath }, zfile: this.opts.memoryZfile });
    await rm(snap.memPath, { force: true });
    await writeSnapshot({ ...snap, memPath: undefined, memoryImage: true });
    return [out];
  }

  /** A memory delta over `below` is written as one fresh base instead (memoryLayersMax). */
  private compactsMemory(below: string[]): boolean {
    return below.length >= (this.opts.memoryLayersMax ?? MEMORY_LAYERS_MAX);
  }

  /** Sandboxes whose balloon holds memory back: inflated under pressure, deflated when it passes. */
  private readonly ballooned = new Set<string>();

  /** One pass of the balloon policy (see balloonPressurePct); a VM without a balloon is left alone. */
  private async relieveMemory(): Promise<void> {
    const pct = this.opts.balloonPressurePct ?? 10;
    if (pct <= 0) return;
    const info = await Bun.file("/proc/meminfo").text();
    const kb = (k: string) => Number(new RegExp(`^${k}:\\s+(\\d+)`, "m").exec(info)?.[1] ?? NaN);
    const available = (kb("MemAvailable") / kb("MemTotal")) * 100;
    const inflate = available < pct;
    if (!inflate && available < 2 * pct) return;
    for (const id of [...this.ballooned]) if (!this.live.has(id)) this.ballooned.delete(id);
    for (const [id, { vm }] of this.live) {
      if (!vm.spec.balloon || inflate === this.ballooned.has(id) || vm.state !== "running" || this.inflight.has(id)) continue;
      await vm.balloon(inflate ? Math.max(1, Math.floor(vm.spec.memMiB / 2)) : vm.spec.memMiB);
      if (inflate) this.ballooned.add(id);
      else this.ballooned.delete(id);
    }
  }

  private runtime(id: string): SandboxRuntime {
    const r = this.store.get(id);
    if (!r?.runtime) throw new OrchestratorError(500, `sandbox ${id} has no runtime record`);
    return r.runtime as SandboxRuntime;
  }

  /** A rootfs device goes back to blockd's pool. */
  private async giveBackDevice(rootfs: string | null): Promise<void> {
    if (rootfs) await this.blockd.call("release", { id: rootfs }).catch((e) => console.error(`orchestrator: release ${rootfs}: ${(e as Error).message}`));
  }

  private async release(id: string, rt: SandboxRuntime): Promise<void> {
    await this.giveBackDevice(rt.rootfsDevice);
    this.memDevices.release(id);
    if (rt.slot) await this.opts.egress?.clear(rt.slot).catch((e) => console.error(`orchestrator: clearing the egress policy of ${rt.slot?.netns}: ${(e as Error).message}`));
    if (rt.slot) await this.slots.release(rt.slot).catch(() => {});
    if (rt.runDir) await rm(rt.runDir, { recursive: true, force: true });
  }

  /** Gives back everything a sandbox holds, whatever state it is in; idempotent. */
  private async teardown(id: string, o: { keepPaused?: boolean } = {}): Promise<void> {
    for (const cb of this.goneListeners) cb(id);
    await this.cleanups.get(id);
    const live = this.live.get(id);
    if (live) {
      await live.vm.stop().catch(() => {});
      this.live.delete(id);
    }
    const rt = this.store.get(id)?.runtime as SandboxRuntime | null | undefined;
    if (rt) {
      // A VM this process does not hold (started before a restart): stopped only if it is still
      // the one recorded in its run directory (pids are reused).
      if (!live && rt.runDir) await this.driver.adopt(rt.runDir).then((vm) => vm.stop()).catch(() => {});
      if (rt.rootfsDevice) this.traces.endOn(rt.rootfsDevice); // before the device goes back
      await this.release(id, rt);
      if (rt.upperDir) await rm(rt.upperDir, { recursive: true, force: true });
      // A paused sandbox's memory device, kept open for its resume, is not wanted any more.
      if (!o.keepPaused && rt.paused?.memLayers) this.memDevices.forget(rt.paused.memLayers);
      if (!o.keepPaused) await this.dropResumeDevice(id);
    }
    if (!o.keepPaused) {
      this.samples.delete(id);
      await rm(join(this.opts.home, "sandboxes", id), { recursive: true, force: true });
    }
  }

  /**
   * Removes checkpoint directories no sandbox and no template refers to any more. Runs one at a
   * time: a call while one runs makes that one go round again, and both resolve when it ends.
   */
  collectCheckpoints(): Promise<string[]> {
    if (this.collecting) {
      this.collectAgain = true;
      return this.collecting;
    }
    const run = async (): Promise<string[]> => {
      const removed: string[] = [];
      do {
        this.collectAgain = false;
        removed.push(...(await this.collectCheckpointsOnce()));
      } while (this.collectAgain);
      return removed;
    };
    this.collecting = run().finally(() => { this.collecting = undefined; });
    return this.collecting;
  }

  private async collectCheckpointsOnce(): Promise<string[]> {
    const root = join(this.opts.home, "checkpoints");
    const names = await readdir(root).catch(() => [] as string[]);
    // What is in use is read after the listing: a checkpoint recorded meanwhile is kept.
    const used = new Set<string>();
    for (const r of this.store.all()) for (const c of (r.runtime as SandboxRuntime | null)?.checkpoints ?? []) used.add(c);
    for (const l of this.templates.layersInUse()) if (!l.startsWith("remote:")) used.add(join(l, ".."));
    for (const t of [...this.templates.list("template"), ...this.templates.list("snapshot")]) if (t.checkpoint) used.add(t.checkpoint.dir);
    for (const p of this.preparing.keys()) used.add(join(root, `template-${p}`));
    for (const d of this.buildCheckpoints) used.add(d);
    const removed: string[] = [];
    for (const name of names) {
      const dir = join(root, name);
      if (used.has(dir) || this.inflightCheckpoint(dir)) continue;
      await rm(dir, { recursive: true, force: true });
      removed.push(dir);
    }
    return removed;
  }

  /**
   * Work an operation leaves for after its answer (giving back what it no longer needs); its
   * failure is logged. `settledCleanups` waits for all of it (tests, shutdown).
   */
  private afterReply(id: string, op: string, work: () => Promise<void>): void {
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

  /** Starts a collection after an operation; its failure is logged, never the operation's. */
  private collectCheckpointsLater(): void {
    this.collectCheckpoints().catch((e) => console.error(`orchestrator: collecting checkpoints: ${(e as Error).message}`));
  }

  /** A checkpoint being written right now belongs to a sandbox with an operation in flight. */
  private inflightCheckpoint(dir: string): boolean {
    const name = dir.slice(dir.lastIndexOf("/") + 1);
    for (const id of this.inflight.keys()) if (name.startsWith(`${id}-`)) return true;
    return false;
  }

  // ─── restart ───────────────────────────────────────────────────────────────

  /**
   * Network slots that sandboxes may still use after a node restart: the pool keeps these
   * (SlotPool.start({adopt})) and rebuilds every other slot.
   */
  static slotsInUse(store: SandboxStore): string[] {
    return store.all().map((r) => (r.runtime as SandboxRuntime | null)?.slot?.netns).filter((n): n is string => !!n);
  }

  /**
   * After a node restart: takes back the VMs of running sandboxes (they kept running under blockd
   * and their VMMs), and settles operations the old process left half done. A sandbox whose VM is
   * gone is given back and dropped; paused sandboxes stay paused.
   */
  async recover(): Promise<{ adopted: string[]; lost: string[]; paused: string[] }> {
    const out = { adopted: [] as string[], lost: [] as string[], paused: [] as string[] };
    const devices = await this.blockd.call<ListedDevice[]>("list");
    for (const r of this.store.all()) {
      const rt = r.runtime as SandboxRuntime | null;
      if (r.state === "paused") {
        await this.reloadResumeDevice(r.id, devices);
        out.paused.push(r.id);
        continue;
      }
      if (r.state === "resuming" && rt?.paused) {
        // The restore never finished: give back what it took and stay paused.
        await this.teardown(r.id, { keepPaused: true });
        this.store.transition(r.id, ["resuming"], "paused", { runtime: { ...rt, slot: null, toolsDevice: null, rootfsDevice: null, upperDir: null, vmPid: null, runDir: null, memDevice: null } });
        await this.reloadResumeDevice(r.id, devices);
        out.paused.push(r.id);
        continue;
      }
      const wasLive = r.state === "running" || r.state === "pausing" || r.state === "forking" || r.state === "snapshotting";
      if (wasLive && rt?.runDir && rt.slot) {
        try {
          const vm = await this.driver.adopt(rt.runDir);
          if (vm.state === "snapshotted") throw new OrchestratorError(500, "the VM gave its memory to a checkpoint that was never recorded");
          // An interrupted checkpoint left the VM paused; the half-written checkpoint is collected below.
          if (vm.state === "paused") await vm.resume();
          this.live.set(r.id, { vm, slot: rt.slot });
          const mem = rt.memDevice ? devices.find((d) => d.id === rt.memDevice) : undefined;
          if (mem && rt.memLayers) this.memDevices.adopt(mem.id, mem.path, rt.memLayers, r.id);
          this.store.transition(r.id, [r.state], "running", { runtime: { ...rt, vmPid: vm.pid } });
          await this.applyEgress(r.id, rt.slot); // the pool's start replaced the host table
          out.adopted.push(r.id);
          continue;
        } catch (e) {
          console.error(`recover: sandbox ${r.id} (${r.state}) is lost: ${(e as Error).message}`);
        }
      }
      // creating, killing, or a VM that is gone: give everything back.
      await this.teardown(r.id);
      this.store.delete(r.id);
      out.lost.push(r.id);
    }
    // Memory devices the node held before its restart that no adopted VM maps (warm or pinned ones).
    const held = this.memDevices.ids();
    for (const d of devices) {
      const top = d.config?.lowers?.at(-1);
      if (!d.readOnly || held.has(d.id) || typeof top !== "string" || !/(^|\/)mem(\.layer|-layer-\d+)$/.test(top)) continue;
      if (d.acquired) await this.blockd.call("release", { id: d.id }).catch(() => {});
      else if (d.kind === "ro") for (let i = 0; i < Math.max(1, d.refs); i++) await this.blockd.call("delete", { id: d.id }).catch(() => {});
    }
    // Rootfs devices acquired for a sandbox (their upper under sandboxes/) that no row names: the old
    // process died between blockd's answer and its record.
    const named = new Set<string>();
    for (const r of this.store.all()) {
      const rt = r.runtime as SandboxRuntime | null;
      if (rt?.rootfsDevice) named.add(rt.rootfsDevice);
      if (rt?.resumeDevice) named.add(rt.resumeDevice.id);
    }
    const sandboxes = `${join(this.opts.home, "sandboxes")}/`;
    for (const d of await this.blockd.call<ListedDevice[]>("list")) {
      if (d.acquired && !d.readOnly && !named.has(d.id) && d.config?.upper?.data?.startsWith(sandboxes)) await this.giveBackDevice(d.id);
    }
    await this.trimResumeDevices();
    this.collectCheckpointsLater();
    return out;
  }

  /**
   * After a restart: a paused sandbox's ResumeDevice is its again if blockd still holds it
   * acquired with its upper (a blockd restarted meanwhile has not); otherwise its row stops naming it.
   */
  private async reloadResumeDevice(id: string, devices: ListedDevice[]): Promise<void> {
    const rt = this.store.get(id)?.runtime as SandboxRuntime | null | undefined;
    const d = rt?.resumeDevice;
    if (!d) return;
    const live = devices.find((l) => l.id === d.id);
    if (live?.acquired && live.path === d.path && live.config?.upper?.data?.startsWith(`${d.upperDir}/`)) return void this.resumeReady.add(id);
    this.store.setRuntime(id, { ...rt, resumeDevice: null });
    await rm(d.upperDir, { recursive: true, force: true });
  }

  // ─── reaper ────────────────────────────────────────────────────────────────

  /**
   * Every `intervalMs`: an expired running sandbox is paused (autoPause) or killed. Every
   * METRICS_INTERVAL_MS it also starts a metrics round (one at a time, not waited for).
   */
  startReaper(intervalMs: number): void {
    let sampledAt = 0;
    let sampling = false;
    const tick = async () => {
      if (!sampling && Date.now() - sampledAt >= METRICS_INTERVAL_MS) {
        sampling = true;
        sampledAt = Date.now();
        void Promise.all([this.sampleAll().catch(() => {}), this.relieveMemory().catch((e) => console.error(`orchestrator: balloons: ${(e as Error).message}`))])
          .finally(() => { sampling = false; });
      }
      for (const r of this.store.expired(Date.now(), 64)) {
        if (this.inflight.has(r.id)) continue;
        const op = r.autoPause ? this.pause(r.id) : this.kill(r.id);
        await op.catch((e) => console.error(`reaper: ${r.autoPause ? "pause" : "kill"} ${r.id}: ${(e as Error).message}`));
      }
      if (!this.closed) this.reaper = setTimeout(tick, intervalMs);
    };
    this.reaper = setTimeout(tick, intervalMs);
  }

  /** Stops the reaper; sandboxes keep running (blockd and the VMMs outlive the node). */
  close(): void {
    this.closed = true;
    if (this.reaper) clearTimeout(this.reaper);
    this.traces.close();
  }

  /** Test and shutdown helper: kill every sandbox. */
  async killAll(): Promise<void> {
    for (const r of this.store.all()) await this.kill(r.id).catch(() => {});
  }

  describe(r: SandboxRecord): { state: "running" | "paused"; internal: SandboxState } {
    return { state: publicState(r.state), internal: r.state };
  }
}
