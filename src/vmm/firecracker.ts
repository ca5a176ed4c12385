// Firecracker driver: its HTTP API over a unix socket (Firecracker's swagger, docs/vmm.md). Upstream rejects unknown fields with a 400, so every request comes from a builder below that
// emits exactly the documented fields, checks their types and enums, and drops absent optionals.

import { existsSync } from "node:fs";
import { mkdir, rm, writeFile } from "node:fs/promises";
import { basename, dirname, join, resolve } from "node:path";
import { readAdoptRecord, writeAdoptRecord } from "./adopt.ts";
import { probeKvm } from "./qemu.ts";
import {
  type BalloonInfo,
  type RestoreSpec,
  type SnapshotInfo,
  type SnapshotOptions,
  type VmSpec,
  type VmState,
  type Vmm,
  type VmmDriver,
  type VmmProcess,
  VmmError,
  VmProcess,
  netnsArgv,
} from "./types.ts";
import { retryUntilListening, withTimeout } from "./wait.ts";

// ---- request builders -------------------------------------------------------------------------

export interface FcRequest {
  method: "GET" | "PUT" | "PATCH";
  path: string;
  body?: Record<string, unknown>;
}

type Json = Record<string, unknown>;

function bad(field: string, want: string, v: unknown): never {
  throw new VmmError("BadSpec", `firecracker: ${field} must be ${want}, got ${JSON.stringify(v)}`);
}
function str(field: string, v: unknown): string {
  if (typeof v !== "string" || v === "") bad(field, "a non-empty string", v);
  return v as string;
}
function bool(field: string, v: unknown): boolean {
  if (typeof v !== "boolean") bad(field, "a boolean", v);
  return v as boolean;
}
function int(field: string, v: unknown, min = 0, max = Number.MAX_SAFE_INTEGER): number {
  if (!Number.isSafeInteger(v) || (v as number) < min || (v as number) > max) bad(field, `an integer in ${min}..${max}`, v);
  return v as number;
}
function oneOf<T extends string>(field: string, v: unknown, allowed: readonly T[]): T {
  if (!allowed.includes(v as T)) bad(field, `one of ${allowed.join(", ")}`, v);
  return v as T;
}
/** Object with only the fields that are set: an absent optional is left out, never sent as null. */
function compact(o: Json): Json {
  const r: Json = {};
  for (const [k, v] of Object.entries(o)) if (v !== undefined) r[k] = v;
  return r;
}
function opt<T>(v: T | undefined, f: (v: T) => unknown): unknown {
  return v === undefined ? undefined : f(v);
}
/** Path parameter: Firecracker ids are plain names. */
function pathId(field: string, v: unknown): string {
  const s = str(field, v);
  if (!/^[A-Za-z0-9_-]{1,64}$/.test(s)) bad(field, "[A-Za-z0-9_-]{1,64}", v);
  return s;
}

export const LOG_LEVELS = ["Error", "Warning", "Info", "Debug", "Trace", "Off"] as const;
export const CACHE_TYPES = ["Unsafe", "Writeback"] as const;
export const IO_ENGINES = ["Sync", "Async"] as const;
export const HUGE_PAGES = ["None", "Transparent", "2M"] as const;
export const CPU_TEMPLATES = ["C3", "T2", "T2S", "T2CL", "T2A", "V1N1", "None"] as const;
export const ACTIONS = ["InstanceStart", "SendCtrlAltDel", "FlushMetrics"] as const;
export const VM_STATES = ["Paused", "Resumed"] as const;
export const SNAPSHOT_TYPES = ["Full", "Diff"] as const;
export const MEM_BACKENDS = ["File", "Uffd"] as const;
export const MMDS_VERSIONS = ["V1", "V2"] as const;

export interface TokenBucket {
  size: number;
  refillTimeMs: number;
  oneTimeBurst?: number;
}
export interface RateLimiter {
  bandwidth?: TokenBucket;
  ops?: TokenBucket;
}

export function tokenBucket(field: string, b: TokenBucket): Json {
  return compact({
    size: int(`${field}.size`, b.size),
    refill_time: int(`${field}.refill_time`, b.refillTimeMs),
    one_time_burst: opt(b.oneTimeBurst, (v) => int(`${field}.one_time_burst`, v)),
  });
}
export function rateLimiter(field: string, r: RateLimiter): Json {
  return compact({
    bandwidth: opt(r.bandwidth, (b) => tokenBucket(`${field}.bandwidth`, b)),
    ops: opt(r.ops, (b) => tokenBucket(`${field}.ops`, b)),
  });
}

export function getInstanceInfo(): FcRequest {
  return { method: "GET", path: "/" };
}
export function getVersion(): FcRequest {
  return { method: "GET", path: "/version" };
}
export function getVmConfig(): FcRequest {
  return { method: "GET", path: "/vm/config" };
}
export function getMachineConfig(): FcRequest {
  return { method: "GET", path: "/machine-config" };
}

export function putLogger(o: { logPath?: string; level?: (typeof LOG_LEVELS)[number]; showLevel?: boolean; showLogOrigin?: boolean; module?: string }): FcRequest {
  return {
    method: "PUT",
    path: "/logger",
    body: compact({
      log_path: opt(o.logPath, (v) => str("log_path", v)),
      level: opt(o.level, (v) => oneOf("level", v, LOG_LEVELS)),
      show_level: opt(o.showLevel, (v) => bool("show_level", v)),
      show_log_origin: opt(o.showLogOrigin, (v) => bool("show_log_origin", v)),
      module: opt(o.module, (v) => str("module", v)),
    }),
  };
}

export function putMetrics(o: { metricsPath: string }): FcRequest {
  return { method: "PUT", path: "/metrics", body: { metrics_path: str("metrics_path", o.metricsPath) } };
}

export function putBootSource(o: { kernelImagePath: string; bootArgs?: string; initrdPath?: string }): FcRequest {
  return {
    method: "PUT",
    path: "/boot-source",
    body: compact({
      kernel_image_path: str("kernel_image_path", o.kernelImagePath),
      boot_args: opt(o.bootArgs, (v) => str("boot_args", v)),
      initrd_path: opt(o.initrdPath, (v) => str("initrd_path", v)),
    }),
  };
}

export interface MachineConfig {
  vcpuCount: number;
  memSizeMib: number;
  smt?: boolean;
  trackDirtyPages?: boolean;
  hugePages?: (typeof HUGE_PAGES)[number];
  /** Deprecated upstream; kept for older templates. */
  cpuTemplate?: (typeof CPU_TEMPLATES)[number];
}

function machineConfigBody(o: Partial<MachineConfig>, full: boolean): Json {
  const vcpus = full || o.vcpuCount !== undefined ? int("vcpu_count", o.vcpuCount, 1, 32) : undefined;
  // With SMT the vCPU count must be 1 or even.
  if (o.smt && vcpus !== undefined && vcpus !== 1 && vcpus % 2) bad("vcpu_count", "1 or even with smt", vcpus);
  return compact({
    vcpu_count: vcpus,
    mem_size_mib: full || o.memSizeMib !== undefined ? int("mem_size_mib", o.memSizeMib, 1) : undefined,
    smt: opt(o.smt, (v) => bool("smt", v)),
    track_dirty_pages: opt(o.trackDirtyPages, (v) => bool("track_dirty_pages", v)),
    huge_pages: opt(o.hugePages, (v) => oneOf("huge_pages", v, HUGE_PAGES)),
    cpu_template: opt(o.cpuTemplate, (v) => oneOf("cpu_template", v, CPU_TEMPLATES)),
  });
}
export function putMachineConfig(o: MachineConfig): FcRequest {
  return { method: "PUT", path: "/machine-config", body: machineConfigBody(o, true) };
}
export function patchMachineConfig(o: Partial<MachineConfig>): FcRequest {
  return { method: "PATCH", path: "/machine-config", body: machineConfigBody(o, false) };
}

export interface DriveConfig {
  driveId: string;
  isRootDevice: boolean;
  /** virtio-blk: a regular file or a block device. Omit with `socket` (vhost-user). */
  pathOnHost?: string;
  isReadOnly?: boolean;
  partuuid?: string;
  cacheType?: (typeof CACHE_TYPES)[number];
  ioEngine?: (typeof IO_ENGINES)[number];
  rateLimiter?: RateLimiter;
  /** vhost-user-blk backend socket; excludes pathOnHost, isReadOnly, rateLimiter and ioEngine. */
  socket?: string;
}
export function putDrive(o: DriveConfig): FcRequest {
  const id = pathId("drive_id", o.driveId);
  if (o.socket !== undefined && (o.pathOnHost !== undefined || o.isReadOnly !== undefined || o.rateLimiter !== undefined || o.ioEngine !== undefined))
    bad("socket", "alone: vhost-user drives take no path_on_host, is_read_only, rate_limiter or io_engine", o.socket);
  if (o.socket === undefined && o.pathOnHost === undefined) bad("path_on_host", "set for a virtio-blk drive", undefined);
  if (o.partuuid !== undefined && !o.isRootDevice) bad("partuuid", "given only for the root device", o.partuuid);
  return {
    method: "PUT",
    path: `/drives/${id}`,
    body: compact({
      drive_id: id,
      is_root_device: bool("is_root_device", o.isRootDevice),
      partuuid: opt(o.partuuid, (v) => str("partuuid", v)),
      cache_type: opt(o.cacheType, (v) => oneOf("cache_type", v, CACHE_TYPES)),
      is_read_only: opt(o.isReadOnly, (v) => bool("is_read_only", v)),
      path_on_host: opt(o.pathOnHost, (v) => str("path_on_host", v)),
      rate_limiter: opt(o.rateLimiter, (v) => rateLimiter("rate_limiter", v)),
      io_engine: opt(o.ioEngine, (v) => oneOf("io_engine", v, IO_ENGINES)),
      socket: opt(o.socket, (v) => str("socket", v)),
    }),
  };
}
export function patchDrive(o: { driveId: string; pathOnHost?: string; rateLimiter?: RateLimiter }): FcRequest {
  const id = pathId("drive_id", o.driveId);
  return {
    method: "PATCH",
    path: `/drives/${id}`,
    body: compact({
      drive_id: id,
      path_on_host: opt(o.pathOnHost, (v) => str("path_on_host", v)),
      rate_limiter: opt(o.rateLimiter, (v) => rateLimiter("rate_limiter", v)),
    }),
  };
}

const MAC_RE = /^[0-9A-Fa-f]{2}(:[0-9A-Fa-f]{2}){5}$/;
export interface NetworkInterfaceConfig {
  ifaceId: string;
  hostDevName: string;
  guestMac?: string;
  mtu?: number;
  rxRateLimiter?: RateLimiter;
  txRateLimiter?: RateLimiter;
}
export function putNetworkInterface(o: NetworkInterfaceConfig): FcRequest {
  const id = pathId("iface_id", o.ifaceId);
  if (o.guestMac !== undefined && !MAC_RE.test(o.guestMac)) bad("guest_mac", "AA:BB:CC:DD:EE:FF", o.guestMac);
  return {
    method: "PUT",
    path: `/network-interfaces/${id}`,
    body: compact({
      iface_id: id,
      host_dev_name: str("host_dev_name", o.hostDevName),
      guest_mac: o.guestMac,
      mtu: opt(o.mtu, (v) => int("mtu", v, 68, 65535)),
      rx_rate_limiter: opt(o.rxRateLimiter, (v) => rateLimiter("rx_rate_limiter", v)),
      tx_rate_limiter: opt(o.txRateLimiter, (v) => rateLimiter("tx_rate_limiter", v)),
    }),
  };
}
export function patchNetworkInterface(o: { ifaceId: string; rxRateLimiter?: RateLimiter; txRateLimiter?: RateLimiter }): FcRequest {
  const id = pathId("iface_id", o.ifaceId);
  return {
    method: "PATCH",
    path: `/network-interfaces/${id}`,
    body: compact({
      iface_id: id,
      rx_rate_limiter: opt(o.rxRateLimiter, (v) => rateLimiter("rx_rate_limiter", v)),
      tx_rate_limiter: opt(o.txRateLimiter, (v) => rateLimiter("tx_rate_limiter", v)),
    }),
  };
}

export function putMmdsConfig(o: { networkInterfaces: string[]; version?: (typeof MMDS_VERSIONS)[number]; ipv4Address?: string; imdsCompat?: boolean }): FcRequest {
  if (!Array.isArray(o.networkInterfaces) || !o.networkInterfaces.length) bad("network_interfaces", "a non-empty list of interface ids", o.networkInterfaces);
  // MMDS must sit on a link-local address.
  if (o.ipv4Address !== undefined && !/^169\.254\.\d{1,3}\.\d{1,3}$/.test(o.ipv4Address)) bad("ipv4_address", "a 169.254.x.y address", o.ipv4Address);
  return {
    method: "PUT",
    path: "/mmds/config",
    body: compact({
      network_interfaces: o.networkInterfaces.map((n, i) => str(`network_interfaces[${i}]`, n)),
      version: opt(o.version, (v) => oneOf("version", v, MMDS_VERSIONS)),
      ipv4_address: o.ipv4Address,
      imds_compat: opt(o.imdsCompat, (v) => bool("imds_compat", v)),
    }),
  };
}
/** The metadata store: PUT replaces it, PATCH merges (RFC 7396). Any JSON object. */
export function putMmds(data: Json): FcRequest {
  if (!data || typeof data !== "object" || Array.isArray(data)) bad("mmds", "a JSON object", data);
  return { method: "PUT", path: "/mmds", body: data };
}
export function patchMmds(data: Json): FcRequest {
  if (!data || typeof data !== "object" || Array.isArray(data)) bad("mmds", "a JSON object", data);
  return { method: "PATCH", path: "/mmds", body: data };
}
export function getMmds(): FcRequest {
  return { method: "GET", path: "/mmds" };
}

export interface BalloonConfig {
  amountMib: number;
  deflateOnOom: boolean;
  /** 0 = off; cannot be turned on after boot. */
  statsPollingIntervalS?: number;
  freePageReporting?: boolean;
  freePageHinting?: boolean;
}
export function putBalloon(o: BalloonConfig): FcRequest {
  return {
    method: "PUT",
    path: "/balloon",
    body: compact({
      amount_mib: int("amount_mib", o.amountMib),
      deflate_on_oom: bool("deflate_on_oom", o.deflateOnOom),
      stats_polling_interval_s: opt(o.statsPollingIntervalS, (v) => int("stats_polling_interval_s", v)),
      free_page_hinting: opt(o.freePageHinting, (v) => bool("free_page_hinting", v)),
      free_page_reporting: opt(o.freePageReporting, (v) => bool("free_page_reporting", v)),
    }),
  };
}
export function patchBalloon(o: { amountMib: number }): FcRequest {
  return { method: "PATCH", path: "/balloon", body: { amount_mib: int("amount_mib", o.amountMib) } };
}
export function getBalloon(): FcRequest {
  return { method: "GET", path: "/balloon" };
}
export function getBalloonStatistics(): FcRequest {
  return { method: "GET", path: "/balloon/statistics" };
}
export function patchBalloonStatistics(o: { statsPollingIntervalS: number }): FcRequest {
  return { method: "PATCH", path: "/balloon/statistics", body: { stats_polling_interval_s: int("stats_polling_interval_s", o.statsPollingIntervalS) } };
}
/** The swagger says PATCH (the prose docs say POST). */
export function startBalloonHinting(o: { acknowledgeOnStop?: boolean } = {}): FcRequest {
  return { method: "PATCH", path: "/balloon/hinting/start", body: compact({ acknowledge_on_stop: opt(o.acknowledgeOnStop, (v) => bool("acknowledge_on_stop", v)) }) };
}
export function getBalloonHintingStatus(): FcRequest {
  return { method: "GET", path: "/balloon/hinting/status" };
}
export function stopBalloonHinting(): FcRequest {
  return { method: "PATCH", path: "/balloon/hinting/stop" };
}

export function putVsock(o: { guestCid: number; udsPath: string }): FcRequest {
  return { method: "PUT", path: "/vsock", body: { guest_cid: int("guest_cid", o.guestCid, 3, 0xffffffff), uds_path: str("uds_path", o.udsPath) } };
}

export function putEntropy(o: { rateLimiter?: RateLimiter } = {}): FcRequest {
  return { method: "PUT", path: "/entropy", body: compact({ rate_limiter: opt(o.rateLimiter, (v) => rateLimiter("rate_limiter", v)) }) };
}

export function action(type: (typeof ACTIONS)[number]): FcRequest {
  return { method: "PUT", path: "/actions", body: { action_type: oneOf("action_type", type, ACTIONS) } };
}

export function patchVm(state: (typeof VM_STATES)[number]): FcRequest {
  return { method: "PATCH", path: "/vm", body: { state: oneOf("state", state, VM_STATES) } };
}

export function createSnapshot(o: { snapshotPath: string; memFilePath: string; snapshotType?: (typeof SNAPSHOT_TYPES)[number] }): FcRequest {
  return {
    method: "PUT",
    path: "/snapshot/create",
    body: compact({
      snapshot_type: opt(o.snapshotType, (v) => oneOf("snapshot_type", v, SNAPSHOT_TYPES)),
      snapshot_path: str("snapshot_path", o.snapshotPath),
      mem_file_path: str("mem_file_path", o.memFilePath),
    }),
  };
}

export interface SnapshotLoad {
  snapshotPath: string;
  memBackend: { backendType: (typeof MEM_BACKENDS)[number]; backendPath: string };
  trackDirtyPages?: boolean;
  /** Deprecated alias of trackDirtyPages, for Firecracker < 1.13. */
  enableDiffSnapshots?: boolean;
  resumeVm?: boolean;
  networkOverrides?: { ifaceId: string; hostDevName: string }[];
  vsockOverride?: { udsPath: string };
  clockRealtime?: boolean;
}
export function loadSnapshot(o: SnapshotLoad): FcRequest {
  if (o.trackDirtyPages !== undefined && o.enableDiffSnapshots !== undefined) bad("enable_diff_snapshots", "absent when track_dirty_pages is set", o.enableDiffSnapshots);
  return {
    method: "PUT",
    path: "/snapshot/load",
    body: compact({
      snapshot_path: str("snapshot_path", o.snapshotPath),
      mem_backend: {
        backend_type: oneOf("mem_backend.backend_type", o.memBackend?.backendType, MEM_BACKENDS),
        backend_path: str("mem_backend.backend_path", o.memBackend?.backendPath),
      },
      track_dirty_pages: opt(o.trackDirtyPages, (v) => bool("track_dirty_pages", v)),
      enable_diff_snapshots: opt(o.enableDiffSnapshots, (v) => bool("enable_diff_snapshots", v)),
      resume_vm: opt(o.resumeVm, (v) => bool("resume_vm", v)),
      network_overrides: opt(o.networkOverrides, (list) =>
        list.map((n, i) => ({ iface_id: str(`network_overrides[${i}].iface_id`, n.ifaceId), host_dev_name: str(`network_overrides[${i}].host_dev_name`, n.hostDevName) })),
      ),
      vsock_override: opt(o.vsockOverride, (v) => ({ uds_path: str("vsock_override.uds_path", v.udsPath) })),
      clock_realtime: opt(o.clockRealtime, (v) => bool("clock_realtime", v)),
    }),
  };
}

// ---- jailer -------------------------------------------------------------------------------------

export interface JailerOptions {
  /** The jailer binary (default `jailer` on PATH). */
  binary?: string;
  uid: number;
  gid: number;
  chrootBaseDir?: string;
  netns?: string;
  cgroupVersion?: 1 | 2;
  cgroups?: Record<string, string>;
  parentCgroup?: string;
  resourceLimits?: { fsize?: number; noFile?: number };
  daemonize?: boolean;
  newPidNs?: boolean;
}

/**
 * A VM id as Firecracker's and the jailer's `--id` accept it ([A-Za-z0-9-]{1,64}), and not
 * starting with "-" so it never reads as an option; BadSpec otherwise.
 */
export function checkVmId(id: unknown): string {
  if (typeof id !== "string" || !/^[A-Za-z0-9][A-Za-z0-9-]{0,63}$/.test(id)) bad("--id", "[A-Za-z0-9-]{1,64}, not starting with -", id);
  return id as string;
}

/** jailer argv: it chroots, drops privileges and execs firecracker with the args after `--`. */
export function jailerArgs(id: string, execFile: string, j: JailerOptions, firecrackerArgs: string[]): string[] {
  checkVmId(id);
  const argv = [j.binary ?? "jailer", "--id", id, "--exec-file", execFile, "--uid", String(int("uid", j.uid)), "--gid", String(int("gid", j.gid))];
  if (j.chrootBaseDir) argv.push("--chroot-base-dir", j.chrootBaseDir);
  if (j.netns) argv.push("--netns", j.netns);
  if (j.cgroupVersion) argv.push("--cgroup-version", String(j.cgroupVersion));
  for (const [k, v] of Object.entries(j.cgroups ?? {})) argv.push("--cgroup", `${k}=${v}`);
  if (j.parentCgroup) argv.push("--parent-cgroup", j.parentCgroup);
  if (j.resourceLimits?.fsize !== undefined) argv.push("--resource-limit", `fsize=${j.resourceLimits.fsize}`);
  if (j.resourceLimits?.noFile !== undefined) argv.push("--resource-limit", `no-file=${j.resourceLimits.noFile}`);
  if (j.daemonize) argv.push("--daemonize");
  if (j.newPidNs) argv.push("--new-pid-ns");
  return [...argv, "--", ...firecrackerArgs];
}

/** Where the jailer puts a VM's root: every API path is resolved inside it. */
export function jailRoot(id: string, execFile: string, j: JailerOptions): string {
  return join(j.chrootBaseDir ?? "/srv/jailer", basename(execFile), id, "root");
}

// ---- API client ---------------------------------------------------------------------------------

/** How long a request waits for the API socket to accept (Firecracker binds, then listens). */
export const API_CONNECT_TIMEOUT_MS = 5_000;

export class FirecrackerApi {
  constructor(
    readonly socketPath: string,
    readonly connectTimeoutMs = API_CONNECT_TIMEOUT_MS,
  ) {}

  async send<T = unknown>(req: FcRequest): Promise<T> {
    const attempt = () =>
      fetch(`http://localhost${req.path}`, {
        unix: this.socketPath,
        method: req.method,
        headers: req.body !== undefined ? { "Content-Type": "application/json", Accept: "application/json" } : { Accept: "application/json" },
        body: req.body !== undefined ? JSON.stringify(req.body) : undefined,
      } as RequestInit);
    const res = await retryUntilListening(attempt, Date.now() + this.connectTimeoutMs, `firecracker ${req.method} ${req.path} on ${this.socketPath}`);
    const text = await res.text();
    if (!res.ok) {
      let msg = text;
      try {
        msg = (JSON.parse(text) as { fault_message?: string }).fault_message ?? text;
      } catch {}
      throw new VmmError("Protocol", `firecracker ${req.method} ${req.path} → ${res.status}: ${msg}`);
    }
    return (text ? JSON.parse(text) : undefined) as T;
  }
}

// ---- driver -------------------------------------------------------------------------------------

export interface FirecrackerOptions {
  /** firecracker binary (default `firecracker` on PATH; the node passes its firecracker_bin setting). */
  binary?: string;
  /** Run under the jailer; spec paths must then be the paths inside the jail. */
  jailer?: JailerOptions;
  /** virtio-blk engine for every drive. */
  ioEngine?: (typeof IO_ENGINES)[number];
  /** Dirty page tracking, for Diff snapshots. */
  trackDirtyPages?: boolean;
  startTimeoutMs?: number;
  /** CPU niceness of the VMM process and its vCPU threads (0..19; the node passes its vmm_nice setting). */
  nice?: number;
}

export function firecrackerBinary(o: FirecrackerOptions = {}): string {
  return o.binary ?? "firecracker";
}

/** Whether Firecracker can run here: its binary on PATH (or given) and a usable /dev/kvm. */
export function firecrackerAvailable(o: FirecrackerOptions = {}): { usable: boolean; reason: string } {
  const bin = firecrackerBinary(o);
  const found = bin.includes("/") ? existsSync(bin) : Bun.which(bin) !== null;
  if (!found) return { usable: false, reason: `no ${bin} binary` };
  const kvm = probeKvm();
  return kvm.usable ? { usable: true, reason: `${bin} with ${kvm.reason}` } : { usable: false, reason: kvm.reason };
}

/** The API requests that configure a fresh Firecracker for spec, in the documented order. */
/**
 * Where Firecracker writes its log and metrics, as paths it opens (inside the jail with the
 * jailer) and as this host sees them: files of the VM's own, never mixed into the console.
 * Firecracker opens them without creating them: start() makes them first.
 */
export function telemetryPaths(spec: Pick<VmSpec, "id" | "runDir">, o: FirecrackerOptions = {}): { log: string; metrics: string; hostLog: string; hostMetrics: string } {
  const inVm = o.jailer ? "/" : spec.runDir;
  const onHost = o.jailer ? jailRoot(spec.id, firecrackerBinary(o), o.jailer) : spec.runDir;
  return { log: join(inVm, FC_LOG), metrics: join(inVm, FC_METRICS), hostLog: join(onHost, FC_LOG), hostMetrics: join(onHost, FC_METRICS) };
}
const FC_LOG = "firecracker.log";
const FC_METRICS = "metrics.json";

/** Logger and metrics, which Firecracker takes only before boot or snapshot load. */
export function telemetryRequests(spec: Pick<VmSpec, "id" | "runDir">, o: FirecrackerOptions = {}): FcRequest[] {
  const t = telemetryPaths(spec, o);
  return [putLogger({ logPath: t.log, level: "Warning", showLevel: true }), putMetrics({ metricsPath: t.metrics })];
}

/** What the running Firecracker binary supports, by its version. */
export interface FirecrackerCaps {
  /** virtio-balloon free page reporting: Firecracker 1.14.0 and later. */
  freePageReporting: boolean;
}
const FREE_PAGE_REPORTING_SINCE: readonly [number, number, number] = [1, 14, 0];

/** [major, minor, patch] of `firecracker --version`'s first line ("Firecracker v1.14.0"), or undefined. */
export function parseFirecrackerVersion(text: string): [number, number, number] | undefined {
  const m = /^Firecracker v(\d+)\.(\d+)\.(\d+)/m.exec(text);
  return m ? [Number(m[1]), Number(m[2]), Number(m[3])] : undefined;
}

/** The capabilities of a version; an unknown version gets none of the optional ones. */
export function capsOf(version: readonly [number, number, number] | undefined): FirecrackerCaps {
  const atLeast = (v: readonly [number, number, number]) => !!version && (version[0] - v[0] || version[1] - v[1] || version[2] - v[2]) >= 0;
  return { freePageReporting: atLeast(FREE_PAGE_REPORTING_SINCE) };
}

export function bootRequests(spec: VmSpec, o: FirecrackerOptions = {}, caps: FirecrackerCaps = capsOf(undefined)): FcRequest[] {
  const reqs: FcRequest[] = [
    ...telemetryRequests(spec, o),
    putMachineConfig({ vcpuCount: spec.vcpus, memSizeMib: spec.memMiB, trackDirtyPages: o.trackDirtyPages }),
    putBootSource({ kernelImagePath: spec.kernel, initrdPath: spec.initrd, bootArgs: spec.cmdline }),
  ];
  spec.drives.forEach((d, i) => {
    // Without an initramfs the kernel mounts drive 0 (the tools disk) itself; Firecracker appends root=.
    reqs.push(putDrive({ driveId: `vd${String.fromCharCode(97 + i)}`, isRootDevice: i === 0 && !spec.initrd, pathOnHost: d.path, isReadOnly: !!d.readOnly, ioEngine: o.ioEngine }));
  });
  if (spec.net) {
    if (!("tap" in spec.net)) throw new VmmError("Unsupported", "Firecracker networking needs a TAP device (user-mode networking is QEMU's)");
    reqs.push(putNetworkInterface({ ifaceId: "eth0", hostDevName: spec.net.tap, guestMac: spec.net.mac }));
  }
  if (spec.balloon) reqs.push(putBalloon({ amountMib: 0, deflateOnOom: true, statsPollingIntervalS: 1, ...(caps.freePageReporting ? { freePageReporting: true } : {}) }));
  // virtio-rng on every VM: the guest's CRNG is fed from the host's, so clones of one snapshot do
  // not share a random stream (the entropy device is part of the snapshot a restore loads).
  reqs.push(putEntropy());
  reqs.push(action("InstanceStart"));
  return reqs;
}

class FirecrackerVm extends VmProcess implements Vmm {
  readonly kind = "firecracker" as const;

  constructor(
    spec: VmSpec,
    proc: VmmProcess,
    readonly api: FirecrackerApi,
    readonly consoleLog: string,
    state: VmState = "running",
  ) {
    super(spec, proc);
    this._state = state;
  }

  async pause(): Promise<void> {
    this.need("running", "paused");
    await this.api.send(patchVm("Paused"));
    this._state = "paused";
  }
  async resume(): Promise<void> {
    this.need("running", "paused");
    await this.api.send(patchVm("Resumed"));
    this._state = "running";
  }

  async snapshot(dir: string, _opts: SnapshotOptions = {}): Promise<SnapshotInfo> {
    this.need("running", "paused");
    dir = resolve(dir);
    await mkdir(dir, { recursive: true });
    if (this._state === "running") await this.pause();
    const statePath = join(dir, "vmstate");
    const memPath = join(dir, "mem");
    // Firecracker writes a full memory file, so the VM stays resumable whatever opts say.
    await this.api.send(createSnapshot({ snapshotType: "Full", snapshotPath: statePath, memFilePath: memPath }));
    const info: SnapshotInfo = { vmm: "firecracker", dir, statePath, memPath, spec: this.spec, createdAt: new Date().toISOString() };
    await Bun.write(join(dir, "snapshot.json"), JSON.stringify(info, null, 1));
    return info;
  }

  async balloon(targetMiB: number): Promise<BalloonInfo> {
    if (!this.spec.balloon) throw new VmmError("Unsupported", `VM ${this.id} was started without a balloon device`);
    if (!Number.isInteger(targetMiB) || targetMiB < 1 || targetMiB > this.spec.memMiB)
      throw new VmmError("BadSpec", `balloon target must be 1..${this.spec.memMiB} MiB`);
    // Firecracker's amount is what the balloon holds, i.e. what the guest gives up.
    await this.api.send(patchBalloon({ amountMib: this.spec.memMiB - targetMiB }));
    const stats = await this.api.send<{ actual_mib: number }>(getBalloonStatistics()).catch(() => undefined);
    return { actualMiB: stats ? this.spec.memMiB - stats.actual_mib : targetMiB, targetMiB };
  }

  async stop(): Promise<void> {
    if (this.running) {
      this.proc.kill("SIGKILL");
      await this.exited;
    }
    this._state = "stopped";
    await rm(this.api.socketPath, { force: true });
  }
}

/** Firecracker's part of the adoption record. */
interface FirecrackerAdoptRecord {
  spec: VmSpec;
  socketPath: string;
  consoleLog: string;
}

export class FirecrackerDriver implements VmmDriver {
  readonly kind = "firecracker" as const;
  private caps: Promise<FirecrackerCaps> | undefined;
  constructor(private opts: FirecrackerOptions = {}) {}

  /** `firecracker --version`, asked once (5 s bound); a binary that does not say gets no optional capability. */
  capabilities(): Promise<FirecrackerCaps> {
    this.caps ??= (async () => {
      try {
        const p = Bun.spawn([firecrackerBinary(this.opts), "--version"], { stdin: "ignore", stdout: "pipe", stderr: "ignore", signal: AbortSignal.timeout(5000) });
        const [out] = await Promise.all([new Response(p.stdout).text(), p.exited]);
        return capsOf(parseFirecrackerVersion(out));
      } catch {
        return capsOf(undefined);
      }
    })();
    return this.caps;
  }

  private async start(spec: VmSpec): Promise<{ proc: ReturnType<typeof Bun.spawn>; api: FirecrackerApi; consoleLog: string }> {
    // Firecracker would refuse it after we spawned it; the id also names the jail directory.
    checkVmId(spec.id);
    await mkdir(spec.runDir, { recursive: true });
    const bin = firecrackerBinary(this.opts);
    const consoleLog = join(spec.runDir, "console.log");
    let sock: string;
    let argv: string[];
    if (this.opts.jailer) {
      // The jailer's Firecracker binds its socket inside the chroot.
      // The jailer joins the namespace itself (by path) before it execs Firecracker.
      const jailer = spec.netnsPath && !this.opts.jailer.netns ? { ...this.opts.jailer, netns: spec.netnsPath } : this.opts.jailer;
      argv = jailerArgs(spec.id, bin, jailer, ["--api-sock", "/firecracker.sock"]);
      sock = join(jailRoot(spec.id, bin, this.opts.jailer), "firecracker.sock");
    } else {
      sock = join(spec.runDir, "firecracker.sock");
      argv = netnsArgv(spec.netnsPath, [bin, "--api-sock", sock, "--id", spec.id], this.opts.nice);
    }
    await rm(sock, { force: true });
    const t = telemetryPaths(spec, this.opts);
    for (const f of [t.hostLog, t.hostMetrics]) {
      await mkdir(dirname(f), { recursive: true });
      await writeFile(f, "");
    }
    // The guest's serial console is Firecracker's stdout.
    const out = Bun.file(consoleLog);
    let proc: ReturnType<typeof Bun.spawn>;
    try {
      proc = Bun.spawn(argv, { stdin: "ignore", stdout: out, stderr: out, detached: true });
    } catch (e) {
      throw new VmmError("StartFailed", `cannot run ${argv[0]}: ${(e as Error).message}`);
    }
    proc.unref();
    const until = Date.now() + (this.opts.startTimeoutMs ?? 5000);
    while (!existsSync(sock)) {
      if (proc.exitCode !== null || Date.now() > until) {
        if (proc.exitCode === null) proc.kill("SIGKILL");
        await proc.exited;
        const log = (await Bun.file(consoleLog).text().catch(() => "")).trim();
        throw new VmmError("StartFailed", `firecracker ${spec.id} did not open ${sock}${log ? `: ${log}` : ""}`);
      }
      await Bun.sleep(2);
    }
    await writeAdoptRecord<FirecrackerAdoptRecord>(spec.runDir, proc.pid, { spec, socketPath: sock, consoleLog });
    return { proc, api: new FirecrackerApi(sock), consoleLog };
  }

  async adopt(runDir: string): Promise<Vmm> {
    const { proc, driver: rec } = await readAdoptRecord<FirecrackerAdoptRecord>(runDir);
    const api = new FirecrackerApi(rec.socketPath);
    // GET / answers the instance info; its state is "Running", "Paused" or "Not started".
    const info = await api.send<{ state?: string }>({ method: "GET", path: "/" }).catch((e) => {
      throw new VmmError("BadState", `the VM of ${runDir} does not answer on its API socket: ${(e as Error).message}`);
    });
    return new FirecrackerVm(rec.spec, proc, api, rec.consoleLog, info?.state === "Paused" ? "paused" : "running");
  }

  async boot(spec: VmSpec): Promise<Vmm> {
    spec = { ...spec, runDir: resolve(spec.runDir) };
    const reqs = bootRequests(spec, this.opts, await this.capabilities());
    const { proc, api, consoleLog } = await this.start(spec);
    const vm = new FirecrackerVm(spec, proc, api, consoleLog);
    try {
      for (const r of reqs) await withTimeout(api.send(r), 10_000, `${r.method} ${r.path}`);
    } catch (e) {
      await vm.stop();
      throw e;
    }
    return vm;
  }

  async restore(snap: SnapshotInfo, r: RestoreSpec): Promise<Vmm> {
    if (snap.vmm !== "firecracker") throw new VmmError("BadSpec", `a ${snap.vmm} snapshot cannot be restored by Firecracker`);
    if (!snap.memPath) throw new VmmError("BadSpec", "Firecracker snapshot without a memory file");
    const old = snap.spec;
    if (r.drives.length !== old.drives.length) throw new VmmError("BadSpec", `restore needs ${old.drives.length} drives`);
    if (r.net && !("tap" in r.net)) throw new VmmError("Unsupported", "Firecracker networking needs a TAP device");
    const spec: VmSpec = { ...old, id: r.id, runDir: resolve(r.runDir), drives: r.drives, net: r.net, netnsPath: r.netnsPath };
    const { proc, api, consoleLog } = await this.start(spec);
    const vm = new FirecrackerVm(spec, proc, api, consoleLog);
    try {
      for (const q of telemetryRequests(spec, this.opts)) await api.send(q);
      const oldTap = old.net && "tap" in old.net ? old.net.tap : undefined;
      const newTap = r.net && "tap" in r.net ? r.net.tap : undefined;
      await api.send(
        loadSnapshot({
          snapshotPath: snap.statePath,
          // MAP_PRIVATE of the file: clones share its page cache, their writes stay their own.
          memBackend: { backendType: "File", backendPath: snap.memPath },
          trackDirtyPages: this.opts.trackDirtyPages,
          resumeVm: false,
          networkOverrides: newTap && newTap !== oldTap ? [{ ifaceId: "eth0", hostDevName: newTap }] : undefined,
        }),
      );
      // Load reopens the snapshot-time drive paths; point each drive at this VM's own device.
      for (let i = 0; i < r.drives.length; i++)
        if (r.drives[i]!.path !== old.drives[i]!.path) await api.send(patchDrive({ driveId: `vd${String.fromCharCode(97 + i)}`, pathOnHost: r.drives[i]!.path }));
      await api.send(patchVm("Resumed"));
    } catch (e) {
      await vm.stop();
      throw e;
    }
    return vm;
  }
}
