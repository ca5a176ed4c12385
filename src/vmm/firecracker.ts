// Firecracker driver: its HTTP API over a unix socket (Firecracker's swagger, docs/vmm.md). Upstream rejects unknown fields with a 400, so every request comes from a builder below that
// emits exactly the documented fields, checks their types and enums, and drops absent optionals.

import { closeSync, existsSync, openSync, readFileSync, realpathSync } from "node:fs";
import { chmod, chown, copyFile, link, mkdir, readFile, realpath, rename, rm, stat, symlink, writeFile } from "node:fs/promises";
import { basename, dirname, join, resolve } from "node:path";
import { AdoptedProcess, readAdoptRecord, writeAdoptRecord } from "./adopt.ts";
import { BoundedLogFile, ConsoleDrain, FifoConsole } from "./console.ts";
import { dirtyRuns, mappingOf, PAGE_SIZE } from "./pagemap.ts";
import { probeKvm, sparseCopy } from "./qemu.ts";
import {
  type BalloonInfo,
  type IoRateLimit,
  type RestoreSpec,
  type SnapshotInfo,
  type SnapshotOptions,
  type TokenBucketSpec,
  type VmSpec,
  type VmState,
  type Vmm,
  type VmmDriver,
  type VmmProcess,
  VmmError,
  VmProcess,
  RUN_FILE_MODE,
  makeRunDir,
  netnsArgv,
  niceAutogroup,
  writeSnapshot,
} from "./types.ts";
import { canDropPrivileges, ensureSystemUser, VMM_USER } from "./vmm_user.ts";
import { retryUntilListening } from "./wait.ts";

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

/** Firecracker's TokenBucket and RateLimiter are the VM spec's own shapes (types.ts). */
export type TokenBucket = TokenBucketSpec;
export type RateLimiter = IoRateLimit;

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
/** Sandbox metadata as the MMDS data store: string keys (non-empty) to string values, at the top level. */
export function mmdsData(metadata: Record<string, string>): Json {
  if (!metadata || typeof metadata !== "object" || Array.isArray(metadata)) bad("metadata", "an object of strings", metadata);
  const out: Json = {};
  for (const [k, v] of Object.entries(metadata)) {
    if (k === "") bad("metadata key", "a non-empty string", k);
    if (typeof v !== "string") bad(`metadata.${k}`, "a string", v);
    out[k] = v;
  }
  return out;
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

/** GET /balloon/statistics, parsed: the balloon's size (always there) and what the guest reported (where it did). */
export interface BalloonStatistics {
  targetPages: number;
  actualPages: number;
  targetMib: number;
  actualMib: number;
  swapIn?: number;
  swapOut?: number;
  majorFaults?: number;
  minorFaults?: number;
  freeMemory?: number;
  totalMemory?: number;
  availableMemory?: number;
  diskCaches?: number;
  hugetlbAllocations?: number;
  hugetlbFailures?: number;
  oomKill?: number;
  allocStall?: number;
  asyncScan?: number;
  directScan?: number;
  asyncReclaim?: number;
  directReclaim?: number;
}
/** BalloonStats' required fields (u32 upstream) and its guest-reported optional ones (u64), as reply field → our name. */
const BALLOON_STATS_REQUIRED = { target_pages: "targetPages", actual_pages: "actualPages", target_mib: "targetMib", actual_mib: "actualMib" } as const;
const BALLOON_STATS_OPTIONAL = {
  swap_in: "swapIn", swap_out: "swapOut", major_faults: "majorFaults", minor_faults: "minorFaults", free_memory: "freeMemory", total_memory: "totalMemory",
  available_memory: "availableMemory", disk_caches: "diskCaches", hugetlb_allocations: "hugetlbAllocations", hugetlb_failures: "hugetlbFailures", oom_kill: "oomKill",
  alloc_stall: "allocStall", async_scan: "asyncScan", direct_scan: "directScan", async_reclaim: "asyncReclaim", direct_reclaim: "directReclaim",
} as const;
/** Balloon pages are 4 KiB whatever the guest's page size: 256 to the MiB (Firecracker's MIB_TO_4K_PAGES). */
const BALLOON_PAGES_PER_MIB = 256;

/**
 * Checks a statistics reply field by field: the four sizes are u32 integers, each MiB figure is its
 * page count / 256, and neither size exceeds the guest's `memMiB`; every guest-reported field present
 * is a non-negative safe integer. Fields newer than this list are ignored. Protocol error otherwise.
 */
export function parseBalloonStats(reply: unknown, memMiB: number): BalloonStatistics {
  const no = (why: string): never => {
    throw new VmmError("Protocol", `firecracker GET /balloon/statistics: ${why} in ${JSON.stringify(reply)}`);
  };
  if (!reply || typeof reply !== "object" || Array.isArray(reply)) no("not an object");
  const o = reply as Record<string, unknown>;
  const out: Record<string, number> = {};
  for (const [field, name] of Object.entries(BALLOON_STATS_REQUIRED)) {
    const v = o[field];
    if (!Number.isSafeInteger(v) || (v as number) < 0 || (v as number) > 0xffff_ffff) no(`${field} is not a u32`);
    out[name] = v as number;
  }
  for (const [field, name] of Object.entries(BALLOON_STATS_OPTIONAL)) {
    const v = o[field];
    if (v === undefined) continue;
    if (!Number.isSafeInteger(v) || (v as number) < 0) no(`${field} is not a non-negative integer`);
    out[name] = v as number;
  }
  const s = out as unknown as BalloonStatistics;
  if (s.targetMib !== Math.floor(s.targetPages / BALLOON_PAGES_PER_MIB)) no("target_mib is not target_pages / 256");
  if (s.actualMib !== Math.floor(s.actualPages / BALLOON_PAGES_PER_MIB)) no("actual_mib is not actual_pages / 256");
  if (s.targetMib > memMiB || s.actualMib > memMiB) no(`a balloon larger than the guest's ${memMiB} MiB`);
  return s;
}
export function patchBalloonStatistics(o: { statsPollingIntervalS: number }): FcRequest {
  // Statistics cannot be turned on or off after boot: the new interval is 1 s or more.
  return { method: "PATCH", path: "/balloon/statistics", body: { stats_polling_interval_s: int("stats_polling_interval_s", o.statsPollingIntervalS, 1) } };
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

/** A path with its symlinks resolved where it exists (as Rust's canonicalize), else as given. */
function canonical(path: string): string {
  try {
    return realpathSync(path);
  } catch {
    return path;
  }
}

/** The Firecracker binary as the jailer sees `--exec-file`: found on PATH, then canonicalized (the chroot is named after that file's name). */
export function canonicalExecFile(bin: string): string {
  return canonical(bin.includes("/") ? resolve(bin) : (Bun.which(bin) ?? bin));
}

/** `<chroot_base>/<exec_file_name>/<id>`: the jailer's directory for one VM, its root/ inside (both canonicalized as the jailer does). */
export function jailDir(id: string, execFile: string, j: JailerOptions): string {
  return join(canonical(j.chrootBaseDir ?? "/srv/jailer"), basename(canonicalExecFile(execFile)), id);
}
/** Where the jailer puts a VM's root: every API path is resolved inside it. */
export function jailRoot(id: string, execFile: string, j: JailerOptions): string {
  return join(jailDir(id, execFile, j), "root");
}
/** The jailer writes the pid of the process it execs (after its forks) to `<root>/<exec_file_name>.pid`, in every mode. */
export function jailPidFile(id: string, execFile: string, j: JailerOptions): string {
  return join(jailRoot(id, execFile, j), `${basename(canonicalExecFile(execFile))}.pid`);
}

/** How a host file got into a jail. */
export type Placement = "link" | "copy" | "bind";

/**
 * Puts host file `src` at `dst` in a jail: a hard link when both are on one filesystem. Across
 * filesystems a file read once at start (`once`: kernel, initrd, vmstate) is copied and owned by
 * the jail's user; one used for the VM's life (`live`: a drive, a block device, the memory file) is
 * bind-mounted onto an empty file, since a copy would take the guest's writes away from the device.
 */
export async function placeInJail(src: string, dst: string, use: "once" | "live", owner?: { uid: number; gid: number }): Promise<Placement> {
  // link(2) does not follow a symlink: link its target.
  const from = await realpath(src).catch((e: Error) => {
    throw new VmmError("StartFailed", `cannot put ${src} into the jail: ${e.message}`);
  });
  await rm(dst, { force: true });
  try {
    await link(from, dst);
    return "link";
  } catch (e) {
    if ((e as { code?: string }).code !== "EXDEV") throw new VmmError("StartFailed", `cannot link ${from} to ${dst}: ${(e as Error).message}`);
  }
  if (use === "once") {
    await copyFile(from, dst);
    if (owner) await chown(dst, owner.uid, owner.gid);
    return "copy";
  }
  await writeFile(dst, "");
  await runTool(["mount", "--bind", from, dst], "StartFailed");
  return "bind";
}

/** A mount or umount, bounded (10 s); its stderr in a named error. */
async function runTool(argv: string[], code: "StartFailed" | "BadState"): Promise<void> {
  const p = Bun.spawn(argv, { stdin: "ignore", stdout: "ignore", stderr: "pipe", signal: AbortSignal.timeout(10_000), killSignal: "SIGKILL" });
  const [err] = await Promise.all([new Response(p.stderr).text(), p.exited]);
  if (p.exitCode !== 0) throw new VmmError(code, `${argv.join(" ")} failed (${p.exitCode ?? p.signalCode}): ${err.trim()}`);
}

/** Mount points at or below `dir`, from /proc/self/mountinfo (field 5, octal escapes undone). */
export function mountsUnder(dir: string): string[] {
  let info = "";
  try {
    info = readFileSync("/proc/self/mountinfo", "utf8");
  } catch {
    return [];
  }
  const out: string[] = [];
  for (const line of info.split("\n")) {
    const at = line.split(" ")[4];
    if (!at) continue;
    const path = at.replace(/\\([0-7]{3})/g, (_, o: string) => String.fromCharCode(parseInt(o, 8)));
    if (path === dir || path.startsWith(`${dir}/`)) out.push(path);
  }
  return out;
}

/**
 * Removes a jail directory: unmounts the bind mounts in it (deepest first), then deletes it. A
 * mount that stays is BadState and nothing is deleted (a recursive delete must never reach through a mount).
 */
export async function cleanJail(dir: string): Promise<void> {
  for (const m of mountsUnder(dir).sort((a, b) => b.length - a.length)) await runTool(["umount", m], "BadState");
  const left = mountsUnder(dir);
  if (left.length) throw new VmmError("BadState", `not removing jail ${dir}: still mounted at ${left.join(", ")}`);
  await rm(dir, { recursive: true, force: true });
}

// ---- API client ---------------------------------------------------------------------------------

/** How long a request waits for the API socket to accept (Firecracker binds, then listens). */
export const API_CONNECT_TIMEOUT_MS = 5_000;
/** How long a request waits for its answer once connected; snapshot create and load get their own. */
export const API_REQUEST_TIMEOUT_MS = 10_000;
/** A snapshot load maps the memory file and restores device state: seconds, not minutes. */
export const SNAPSHOT_LOAD_TIMEOUT_MS = 30_000;
/** A snapshot create writes guest memory: 30 s plus 50 ms per MiB (20 MiB/s, a slow disk). */
export function snapshotCreateTimeoutMs(memMiB: number): number {
  return 30_000 + memMiB * 50;
}

export class FirecrackerApi {
  constructor(
    readonly socketPath: string,
    readonly connectTimeoutMs = API_CONNECT_TIMEOUT_MS,
  ) {}

  /**
   * One request: a refused connect is retried until connectTimeoutMs, the answer waited for
   * timeoutMs (Timeout); an error status, a broken connection or a reply that is not JSON is Protocol.
   */
  async send<T = unknown>(req: FcRequest, timeoutMs = API_REQUEST_TIMEOUT_MS): Promise<T> {
    const what = `firecracker ${req.method} ${req.path} on ${this.socketPath}`;
    const attempt = () =>
      fetch(`http://localhost${req.path}`, {
        unix: this.socketPath,
        method: req.method,
        headers: req.body !== undefined ? { "Content-Type": "application/json", Accept: "application/json" } : { Accept: "application/json" },
        body: req.body !== undefined ? JSON.stringify(req.body) : undefined,
        signal: AbortSignal.timeout(timeoutMs),
      } as RequestInit);
    let status: number;
    let text: string;
    try {
      const res = await retryUntilListening(attempt, Date.now() + this.connectTimeoutMs, what);
      status = res.status;
      text = await res.text();
    } catch (e) {
      if (e instanceof VmmError) throw e;
      if ((e as Error)?.name === "TimeoutError" || (e as Error)?.name === "AbortError") throw new VmmError("Timeout", `${what}: no answer in ${timeoutMs} ms`);
      throw new VmmError("Protocol", `${what}: ${(e as Error).message}`);
    }
    if (status < 200 || status > 299) {
      let msg = text;
      try {
        msg = (JSON.parse(text) as { fault_message?: string }).fault_message ?? text;
      } catch {}
      throw new VmmError("Protocol", `firecracker ${req.method} ${req.path} → ${status}: ${msg}`);
    }
    try {
      return (text ? JSON.parse(text) : undefined) as T;
    } catch {
      throw new VmmError("Protocol", `${what}: the reply is not JSON: ${text.slice(0, 200)}`);
    }
  }
}

// ---- driver -------------------------------------------------------------------------------------

export interface FirecrackerOptions {
  /** firecracker binary (default `firecracker` on PATH; the node passes its firecracker_bin setting). */
  binary?: string;
  /**
   * Run under the jailer; spec paths stay host paths, the driver links them into the jail. Absent:
   * the jailer when a `jailer` binary is on PATH and the node runs as root, as VMM_USER
   * (defaultJailer); null: never.
   */
  jailer?: JailerOptions | null;
  /** virtio-blk engine for every drive. */
  ioEngine?: (typeof IO_ENGINES)[number];
  /** Dirty page tracking, for Diff snapshots. */
  trackDirtyPages?: boolean;
  startTimeoutMs?: number;
  /** CPU niceness of the VMM process, its vCPU threads and its scheduler group (0..19; the node passes its vmm_nice setting). */
  nice?: number;
}

export function firecrackerBinary(o: FirecrackerOptions = {}): string {
  return o.binary ?? "firecracker";
}

/** `jailer` on the PATH this process has now, or null. */
export function findJailer(): string | null {
  return Bun.which("jailer", { PATH: process.env.PATH ?? "" });
}

/** The jailer a driver uses when given none: the `jailer` binary found (on PATH), run as `user`; undefined without one. */
export function defaultJailer(user: { uid: number; gid: number }, jailerBinary: string | null = findJailer()): JailerOptions | undefined {
  return jailerBinary ? { binary: jailerBinary, uid: user.uid, gid: user.gid } : undefined;
}

/** Whether Firecracker can run here: its binary on PATH (or given) and a usable /dev/kvm. */
export function firecrackerAvailable(o: FirecrackerOptions = {}): { usable: boolean; reason: string } {
  const bin = firecrackerBinary(o);
  const found = bin.includes("/") ? existsSync(bin) : Bun.which(bin) !== null;
  if (!found) return { usable: false, reason: `no ${bin} binary` };
  const kvm = probeKvm();
  return kvm.usable ? { usable: true, reason: `${bin} with ${kvm.reason}` } : { usable: false, reason: kvm.reason };
}

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
/** Firecracker's stderr, in the VM's run directory (what it says before its logger is set, and a panic). */
const FC_STDERR = "firecracker.stderr";
/** The FIFO that is Firecracker's stdout, i.e. the guest's serial console (console.ts drains it), in the run directory. */
const CONSOLE_FIFO = "console.fifo";

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

// Paths Firecracker records in a snapshot and reopens at load are names relative to its working
// directory: the VM's run directory, or the jail's root (the jailer chdirs there). Every VM has its
// own entries under the same names, so a restore never needs the source VM's files (docs/vmm.md).

/** Drive i's id in the API and in the snapshot: vda, vdb, … in guest order. */
export function driveId(i: number): string {
  return `vd${String.fromCharCode(97 + i)}`;
}
/** Drive i's path_on_host: a per-VM name (a symlink to the device, or its link in the jail). */
export function driveName(i: number): string {
  return `drive-${i}`;
}
/** The vsock device's uds_path, a per-VM name too (Firecracker binds it, also at load). */
export const VSOCK_NAME = "vsock.sock";
/** Every VM's vsock guest CID: 0-2 are reserved (hypervisor, local, host), and each VM's device is its own. */
export const GUEST_CID = 3;
/** The VM's one network interface (its TAP), where MMDS answers too. */
const IFACE_ID = "eth0";

/** The kernel and initrd as Firecracker opens them: the spec's paths, or their copies at the jail's root. */
export function bootPaths(spec: Pick<VmSpec, "kernel" | "initrd">, o: FirecrackerOptions = {}): { kernel: string; initrd?: string } {
  if (!o.jailer) return { kernel: spec.kernel, initrd: spec.initrd };
  return { kernel: "/vmlinux", initrd: spec.initrd === undefined ? undefined : "/initrd" };
}

/** MMDS for the sandbox's metadata: V2 (session tokens) on the TAP interface, then the data; before InstanceStart. */
export function mmdsRequests(spec: Pick<VmSpec, "net" | "metadata">): FcRequest[] {
  if (spec.metadata === undefined) return [];
  if (!spec.net) throw new VmmError("BadSpec", "metadata needs a network interface: MMDS answers on one");
  return [putMmdsConfig({ networkInterfaces: [IFACE_ID], version: "V2" }), putMmds(mmdsData(spec.metadata))];
}

/** The API requests that configure a fresh Firecracker for spec, in the documented order. */
export function bootRequests(spec: VmSpec, o: FirecrackerOptions = {}, caps: FirecrackerCaps = capsOf(undefined)): FcRequest[] {
  const boot = bootPaths(spec, o);
  const reqs: FcRequest[] = [
    ...telemetryRequests(spec, o),
    putMachineConfig({ vcpuCount: spec.vcpus, memSizeMib: spec.memMiB, trackDirtyPages: o.trackDirtyPages }),
    putBootSource({ kernelImagePath: boot.kernel, initrdPath: boot.initrd, bootArgs: spec.cmdline }),
  ];
  spec.drives.forEach((d, i) => {
    // Without an initramfs the kernel mounts drive 0 (the tools disk) itself; Firecracker appends root=.
    reqs.push(putDrive({ driveId: driveId(i), isRootDevice: i === 0 && !spec.initrd, pathOnHost: driveName(i), isReadOnly: !!d.readOnly, ioEngine: o.ioEngine, rateLimiter: d.rateLimit }));
  });
  if (spec.net) {
    if (!("tap" in spec.net)) throw new VmmError("Unsupported", "Firecracker networking needs a TAP device (user-mode networking is QEMU's)");
    reqs.push(putNetworkInterface({ ifaceId: IFACE_ID, hostDevName: spec.net.tap, guestMac: spec.net.mac, rxRateLimiter: spec.netRateLimit?.rx, txRateLimiter: spec.netRateLimit?.tx }));
  } else if (spec.netRateLimit) throw new VmmError("BadSpec", "netRateLimit without a network interface");
  reqs.push(...mmdsRequests(spec));
  if (spec.balloon) reqs.push(putBalloon({ amountMib: 0, deflateOnOom: true, statsPollingIntervalS: 1, ...(caps.freePageReporting ? { freePageReporting: true } : {}) }));
  if (spec.vsock) reqs.push(putVsock({ guestCid: GUEST_CID, udsPath: VSOCK_NAME }));
  // virtio-rng on every VM: the guest's CRNG is fed from the host's, so clones of one snapshot do
  // not share a random stream (the entropy device is part of the snapshot a restore loads).
  reqs.push(putEntropy());
  reqs.push(action("InstanceStart"));
  return reqs;
}

/** Rate limits to change on a running (or just loaded) VM: PATCH for each drive and the interface given. */
export interface RateLimitUpdate {
  /** By drive index; an absent entry is left as it is. */
  drives?: (IoRateLimit | undefined)[];
  net?: { rx?: IoRateLimit; tx?: IoRateLimit };
}
export function rateLimitRequests(u: RateLimitUpdate): FcRequest[] {
  const reqs: FcRequest[] = [];
  (u.drives ?? []).forEach((r, i) => {
    if (r) reqs.push(patchDrive({ driveId: driveId(i), rateLimiter: r }));
  });
  if (u.net && (u.net.rx || u.net.tx)) reqs.push(patchNetworkInterface({ ifaceId: IFACE_ID, rxRateLimiter: u.net.rx, txRateLimiter: u.net.tx }));
  return reqs;
}

/** The drive names a snapshot recorded (SnapshotInfo.extra.drives): a restore makes its own under them. */
function snapshotDriveNames(n: number): string[] {
  return Array.from({ length: n }, (_, i) => driveName(i));
}

/**
 * The requests that bring a fresh Firecracker up from a snapshot: logger and metrics (not part of a
 * snapshot), the load (paused; the TAP overridden when it differs), this VM's rate limits where the
 * restore gives them, its MMDS data (a snapshot keeps the MMDS config, never the data store), Resumed.
 */
export function restoreRequests(
  snap: SnapshotInfo,
  spec: VmSpec,
  r: Pick<RestoreSpec, "drives" | "netRateLimit">,
  files: { statePath: string; memPath: string },
  o: FirecrackerOptions = {},
): FcRequest[] {
  const oldTap = snap.spec.net && "tap" in snap.spec.net ? snap.spec.net.tap : undefined;
  const newTap = spec.net && "tap" in spec.net ? spec.net.tap : undefined;
  return [
    ...telemetryRequests(spec, o),
    loadSnapshot({
      snapshotPath: files.statePath,
      // MAP_PRIVATE of the file: clones share its page cache, their writes stay their own.
      memBackend: { backendType: "File", backendPath: files.memPath },
      trackDirtyPages: o.trackDirtyPages,
      resumeVm: false,
      networkOverrides: newTap && newTap !== oldTap ? [{ ifaceId: IFACE_ID, hostDevName: newTap }] : undefined,
    }),
    ...rateLimitRequests({ drives: r.drives.map((d) => d.rateLimit), net: r.netRateLimit }),
    ...(spec.metadata !== undefined ? [putMmds(mmdsData(spec.metadata))] : []),
    patchVm("Resumed"),
  ];
}

/**
 * Full, or Diff where dirty pages are tracked (without tracking a Diff relies on mincore and misses
 * swapped pages). A Diff holds only the pages written since the VM's memory base: with no base (a
 * booted VM, never snapshotted) that is all its memory; with one, the base must still exist to be
 * merged under it, else Full.
 */
export function snapshotTypeFor(trackDirtyPages: boolean, memBase: string | null): (typeof SNAPSHOT_TYPES)[number] {
  if (!trackDirtyPages) return "Full";
  return memBase === null || existsSync(memBase) ? "Diff" : "Full";
}

/** Bytes of a memory file: a regular file's size, or a block device's (sysfs sectors × 512). */
export async function memoryFileSize(path: string): Promise<number> {
  const st = await stat(path).catch((e: Error) => {
    throw new VmmError("BadSpec", `memory file ${path}: ${e.message}`);
  });
  if (st.isFile()) return st.size;
  if (!st.isBlockDevice()) throw new VmmError("BadSpec", `memory file ${path} is neither a file nor a block device`);
  // Linux dev_t: major in bits 8-19, minor in bits 0-7 and 20-31.
  const dev = `${(st.rdev >>> 8) & 0xfff}:${(st.rdev & 0xff) | ((st.rdev >>> 12) & 0xfff00)}`;
  const sectors = Number((await readFile(`/sys/dev/block/${dev}/size`, "utf8").catch(() => "")).trim());
  if (!Number.isSafeInteger(sectors) || sectors <= 0) throw new VmmError("BadSpec", `memory device ${path} (${dev}): no size in /sys/dev/block`);
  return sectors * 512;
}

/** A snapshot's memory must be exactly the guest's (Firecracker sizes a snapshot memory file to mem_size_mib). */
async function checkMemorySize(path: string, memMiB: number): Promise<void> {
  const size = await memoryFileSize(path);
  if (size !== memMiB * 1024 * 1024) throw new VmmError("BadSpec", `memory file ${path} has ${size} bytes, the snapshot's guest has ${memMiB} MiB (${memMiB * 1024 * 1024} bytes)`);
}

/** Whether two paths name one file (device and inode), e.g. a snapshot's memory and its hard link. */
async function sameFile(a: string, b: string): Promise<boolean> {
  const [x, y] = await Promise.all([stat(a).catch(() => undefined), stat(b).catch(() => undefined)]);
  return !!x && !!y && x.dev === y.dev && x.ino === y.ino;
}

/** Moves a file out of the jail: a rename, or a copy keeping holes across filesystems. */
async function moveOut(from: string, to: string): Promise<void> {
  try {
    await rename(from, to);
  } catch (e) {
    if ((e as { code?: string }).code !== "EXDEV") throw new VmmError("Protocol", `cannot move ${from} to ${to}: ${(e as Error).message}`);
    await sparseCopy(from, to);
    await rm(from, { force: true });
  }
}

/** How one VMM runs: its argv and the places it uses, before anything is spawned. */
export interface Launch {
  argv: string[];
  /** The API socket as this host reaches it. */
  sock: string;
  /** Where Firecracker's relative names (drives, vsock) resolve, as this host sees it: the run directory or the jail's root. */
  hostDir: string;
  /** The jailer's directory for this VM (`<chroot_base>/<exec_file_name>/<id>`), removed on stop. */
  jailDir?: string;
  /** The jail's user, who must own what the driver puts there. */
  owner?: { uid: number; gid: number };
  /** The jailer forks (--daemonize or --new-pid-ns) and exits: the VMM's pid is in this file. */
  pidFile?: string;
}

export function launchPlan(spec: Pick<VmSpec, "id" | "runDir" | "netnsPath">, o: FirecrackerOptions = {}): Launch {
  checkVmId(spec.id);
  const bin = firecrackerBinary(o);
  if (!o.jailer) {
    const sock = join(spec.runDir, "firecracker.sock");
    return { argv: netnsArgv(spec.netnsPath, [bin, "--api-sock", sock, "--id", spec.id], o.nice), sock, hostDir: spec.runDir };
  }
  // The jailer canonicalizes --exec-file and names the chroot after it; give it the canonical path.
  const exec = canonicalExecFile(bin);
  // The jailer joins the namespace itself (by path) before it execs Firecracker.
  const j = spec.netnsPath && !o.jailer.netns ? { ...o.jailer, netns: spec.netnsPath } : o.jailer;
  const root = jailRoot(spec.id, exec, j);
  return {
    argv: netnsArgv(undefined, jailerArgs(spec.id, exec, j, ["--api-sock", "/firecracker.sock"]), o.nice),
    // The jailer's Firecracker binds its socket inside the chroot.
    sock: join(root, "firecracker.sock"),
    hostDir: root,
    jailDir: dirname(root),
    owner: { uid: j.uid, gid: j.gid },
    pidFile: j.daemonize || j.newPidNs ? jailPidFile(spec.id, exec, j) : undefined,
  };
}

/**
 * This VM's drives under their per-VM names: symlinks in the run directory to the devices, or
 * (jailer) their links into the jail; with the jailer also the kernel and initrd, read once at boot.
 */
async function stageFiles(spec: VmSpec, l: Launch, withBootFiles: boolean): Promise<void> {
  for (const [i, d] of spec.drives.entries()) {
    const at = join(l.hostDir, driveName(i));
    if (l.jailDir) await placeInJail(d.path, at, "live", l.owner);
    else {
      await rm(at, { force: true });
      await symlink(resolve(d.path), at);
    }
  }
  if (!l.jailDir || !withBootFiles) return;
  await placeInJail(spec.kernel, join(l.hostDir, "vmlinux"), "once", l.owner);
  if (spec.initrd !== undefined) await placeInJail(spec.initrd, join(l.hostDir, "initrd"), "once", l.owner);
}

/** A restore's snapshot files inside its jail, under /restore/ (never where its own snapshots go: /snapshot/). */
async function stageSnapshotInJail(l: Launch, statePath: string, memPath: string): Promise<{ statePath: string; memPath: string }> {
  await mkdir(join(l.hostDir, "restore"), { recursive: true });
  await placeInJail(statePath, join(l.hostDir, "restore/vmstate"), "once", l.owner);
  await placeInJail(memPath, join(l.hostDir, "restore/mem"), "live", l.owner);
  return { statePath: "/restore/vmstate", memPath: "/restore/mem" };
}

/** How often a forked VMM's liveness is checked (it is not our child: no exit notification). */
const FORKED_POLL_MS = 100;

/**
 * A VMM the jailer forked off: not our child, so `exited` (null: the code is not ours to read)
 * resolves once /proc/<pid> is gone, is another process, or is a zombie (its reaper is init, which may be slow).
 */
class ForkedProcess implements VmmProcess {
  private gone = false;
  killed = false;
  readonly exited: Promise<number | null>;

  constructor(
    readonly pid: number,
    private readonly startTime: string,
  ) {
    this.exited = new Promise((resolveExit) => {
      const t = setInterval(() => {
        if (this.alive()) return;
        clearInterval(t);
        this.gone = true;
        resolveExit(null);
      }, FORKED_POLL_MS);
      t.unref();
    });
  }
  private alive(): boolean {
    if (AdoptedProcess.startTimeOf(this.pid) !== this.startTime) return false;
    try {
      const stat = readFileSync(`/proc/${this.pid}/stat`, "utf8");
      return !"ZX".includes(stat.slice(stat.lastIndexOf(")") + 2, stat.lastIndexOf(")") + 3));
    } catch {
      return false;
    }
  }
  get exitCode(): number | null {
    return this.gone ? -1 : null;
  }
  kill(signal: NodeJS.Signals | number = "SIGTERM"): void {
    if (this.gone || !this.alive()) return;
    try {
      process.kill(this.pid, signal);
      this.killed = true;
    } catch {}
  }
}

/** What a VM needs beyond its spec: how it was launched and the memory its next Diff snapshot is merged onto. */
interface VmContext {
  opts: FirecrackerOptions;
  launch: Launch;
  /** The full memory file this VM's memory diverged from (host path): the one it was loaded from or last snapshotted to; null: none (booted). */
  memBase: string | null;
  /**
   * The memory image this VM was restored on (RestoreSpec.memImage, host path): Firecracker maps it
   * privately, so the pages the guest dirtied are the mapping's anonymous pages; null: none.
   */
  memImage: string | null;
}

/** Firecracker's part of the adoption record. */
interface FirecrackerAdoptRecord {
  spec: VmSpec;
  socketPath: string;
  consoleLog: string;
  launch?: Launch;
  memBase?: string | null;
  memImage?: string | null;
}

export class FirecrackerVm extends VmProcess implements Vmm {
  readonly kind = "firecracker" as const;
  private readonly console: ConsoleDrain;

  constructor(
    spec: VmSpec,
    proc: VmmProcess,
    readonly api: FirecrackerApi,
    readonly consoleLog: string,
    private ctx: VmContext,
    state: VmState = "running",
  ) {
    super(spec, proc);
    this._state = state;
    this.console = new ConsoleDrain(new FifoConsole(join(spec.runDir, CONSOLE_FIFO)), new BoundedLogFile(consoleLog)).start();
  }

  syncConsole(): Promise<void> {
    return this.console.drain();
  }

  /** The host side of the vsock device (host-initiated: connect, then `CONNECT <port>\n`; guest-initiated: `<path>_<port>`). */
  get vsockPath(): string | undefined {
    return this.spec.vsock ? join(this.ctx.launch.hostDir, VSOCK_NAME) : undefined;
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

  /**
   * Paused, then `snapshot/create` into `<dir>/vmstate` and `<dir>/mem` (the VM stays resumable).
   * A Diff (snapshotTypeFor) is written into a copy of the memory base: Firecracker leaves a memory
   * file of the guest's size in place and writes the dirty pages over it, so `mem` is always a full
   * image. With the jailer Firecracker writes under the jail's /snapshot/ and the files move out.
   */
  async snapshot(dir: string, _opts: SnapshotOptions = {}): Promise<SnapshotInfo> {
    this.need("running", "paused");
    dir = resolve(dir);
    await mkdir(dir, { recursive: true });
    const statePath = join(dir, "vmstate");
    const memPath = join(dir, "mem");
    if (this.ctx.memImage !== null) return this.deltaSnapshot(dir, statePath, memPath);
    const base = this.ctx.memBase;
    // Writing over the file this VM maps would change its memory under it.
    if (base !== null && (await sameFile(base, memPath))) throw new VmmError("BadSpec", `${memPath} is the memory this VM runs on`);
    if (this._state === "running") await this.pause();
    const type = snapshotTypeFor(!!this.ctx.opts.trackDirtyPages, base);
    const l = this.ctx.launch;
    const { host, inVm } = await this.snapshotFiles(statePath, memPath);
    if (type === "Diff" && base !== null) {
      await sparseCopy(base, host.mem);
      if (l.owner && l.jailDir) await chown(host.mem, l.owner.uid, l.owner.gid);
    }
    await this.api.send(createSnapshot({ snapshotType: type, snapshotPath: inVm.state, memFilePath: inVm.mem }), snapshotCreateTimeoutMs(this.spec.memMiB));
    if (l.jailDir) {
      await moveOut(host.state, statePath);
      await moveOut(host.mem, memPath);
    }
    const extra: Record<string, unknown> = { snapshotType: type, drives: snapshotDriveNames(this.spec.drives.length) };
    if (type === "Diff" && base !== null) extra.base = base;
    const info: SnapshotInfo = { vmm: "firecracker", dir, statePath, memPath, spec: this.spec, createdAt: new Date().toISOString(), extra };
    await writeSnapshot(info);
    // Either type resets the dirty log: the next Diff holds what is written from now on, over this file.
    this.ctx.memBase = memPath;
    await writeAdoptRecord<FirecrackerAdoptRecord>(this.spec.runDir, this.pid, adoptRecordOf(this));
    return info;
  }

  /**
   * Where snapshot/create writes (host paths, and the same as the VMM names them): the given paths,
   * or under the jail's /snapshot/ (moved out after). Both files are made fresh: Firecracker writes
   * into an existing memory file of the right size in place, under any VM that maps it.
   */
  private async snapshotFiles(statePath: string, memPath: string): Promise<{ host: { state: string; mem: string }; inVm: { state: string; mem: string } }> {
    const l = this.ctx.launch;
    const host = l.jailDir ? { state: join(l.hostDir, "snapshot/vmstate"), mem: join(l.hostDir, "snapshot/mem") } : { state: statePath, mem: memPath };
    await mkdir(dirname(host.mem), { recursive: true });
    if (l.owner && l.jailDir) await chown(dirname(host.mem), l.owner.uid, l.owner.gid);
    await rm(host.state, { force: true });
    await rm(host.mem, { force: true });
    return { host, inVm: l.jailDir ? { state: "/snapshot/vmstate", mem: "/snapshot/mem" } : host };
  }

  /**
   * A VM on a memory image (memory layers): its dirtied pages are the anonymous pages of its private
   * mapping of the image (pagemap.ts, as for QEMU), left in the paused process for the caller to
   * write into a memory layer; the memory file snapshot/create must write goes to a scratch file
   * that is removed. With dirty tracking that write is a Diff (the dirtied pages only), else Full.
   */
  private async deltaSnapshot(dir: string, statePath: string, memPath: string): Promise<SnapshotInfo> {
    if (this._state === "running") await this.pause();
    const size = this.spec.memMiB * 2 ** 20;
    const type = snapshotTypeFor(!!this.ctx.opts.trackDirtyPages, null);
    const l = this.ctx.launch;
    const { host, inVm } = await this.snapshotFiles(statePath, `${memPath}.scratch`);
    try {
      await this.api.send(createSnapshot({ snapshotType: type, snapshotPath: inVm.state, memFilePath: inVm.mem }), snapshotCreateTimeoutMs(this.spec.memMiB));
    } finally {
      await rm(host.mem, { force: true });
    }
    if (l.jailDir) await moveOut(host.state, statePath);
    const map = await mappingOf(this.pid, this.ctx.memImage!, { byInode: true });
    if (map.length !== size) throw new VmmError("BadState", `VM ${this.id} maps ${map.length} bytes of ${this.ctx.memImage}, not ${size}`);
    const { runs, dirty } = await dirtyRuns(this.pid, map.address, size / PAGE_SIZE);
    const pagesFile = join(dir, "mem.pages");
    await Bun.write(pagesFile, runs);
    const info: SnapshotInfo = {
      vmm: "firecracker", dir, statePath, spec: this.spec, createdAt: new Date().toISOString(), memoryImage: true,
      delta: { pid: this.pid, address: map.address, size, pageSize: PAGE_SIZE, pagesFile, pages: dirty },
      extra: { snapshotType: type, drives: snapshotDriveNames(this.spec.drives.length) },
    };
    await writeSnapshot(info); // without its delta: that lives only as long as this process
    await writeAdoptRecord<FirecrackerAdoptRecord>(this.spec.runDir, this.pid, adoptRecordOf(this));
    return info;
  }

  /** The balloon's statistics, checked field by field (parseBalloonStats). */
  async balloonStatistics(): Promise<BalloonStatistics> {
    if (!this.spec.balloon) throw new VmmError("Unsupported", `VM ${this.id} was started without a balloon device`);
    return parseBalloonStats(await this.api.send(getBalloonStatistics()), this.spec.memMiB);
  }

  async balloon(targetMiB: number): Promise<BalloonInfo> {
    if (!this.spec.balloon) throw new VmmError("Unsupported", `VM ${this.id} was started without a balloon device`);
    if (!Number.isInteger(targetMiB) || targetMiB < 1 || targetMiB > this.spec.memMiB)
      throw new VmmError("BadSpec", `balloon target must be 1..${this.spec.memMiB} MiB`);
    // Firecracker's amount is what the balloon holds, i.e. what the guest gives up.
    await this.api.send(patchBalloon({ amountMib: this.spec.memMiB - targetMiB }));
    const stats = await this.balloonStatistics();
    return { actualMiB: this.spec.memMiB - stats.actualMib, targetMiB };
  }

  /** New rate limits on the running VM (PATCH merges: an absent bucket stays, a 0-sized one lifts the limit). */
  async setRateLimits(u: RateLimitUpdate): Promise<void> {
    this.need("running", "paused");
    if ((u.drives?.length ?? 0) > this.spec.drives.length) throw new VmmError("BadSpec", `VM ${this.id} has ${this.spec.drives.length} drives`);
    if (u.net && !this.spec.net) throw new VmmError("BadSpec", `VM ${this.id} has no network interface`);
    for (const r of rateLimitRequests(u)) await this.api.send(r);
  }

  /** Replaces the MMDS data store (the guest sees it at once). */
  async setMetadata(metadata: Record<string, string>): Promise<void> {
    this.need("running", "paused");
    if (!this.spec.net || this.spec.metadata === undefined) throw new VmmError("Unsupported", `VM ${this.id} was started without MMDS (metadata)`);
    await this.api.send(putMmds(mmdsData(metadata)));
  }

  async stop(): Promise<void> {
    if (this.running) {
      this.proc.kill("SIGKILL");
      await this.exited;
    }
    // The FIFO keeps what the VMM wrote while our end is open: drained once more, then closed.
    await this.console.stop();
    this._state = "stopped";
    await rm(this.api.socketPath, { force: true });
    if (this.ctx.launch.jailDir) await cleanJail(this.ctx.launch.jailDir);
  }

  /** For the adoption record. */
  get context(): VmContext {
    return this.ctx;
  }
}

function adoptRecordOf(vm: FirecrackerVm): FirecrackerAdoptRecord {
  return { spec: vm.spec, socketPath: vm.api.socketPath, consoleLog: vm.consoleLog, launch: vm.context.launch, memBase: vm.context.memBase, memImage: vm.context.memImage };
}

export class FirecrackerDriver implements VmmDriver {
  readonly kind = "firecracker" as const;
  private caps: Promise<FirecrackerCaps> | undefined;
  private settled: Promise<FirecrackerOptions> | undefined;
  constructor(private opts: FirecrackerOptions = {}) {}

  /** The options with the jailer settled (given, or defaultJailer as VMM_USER, made when missing), once per driver. */
  private options(): Promise<FirecrackerOptions> {
    this.settled ??= (async () => {
      if (this.opts.jailer !== undefined || !canDropPrivileges()) return { ...this.opts, jailer: this.opts.jailer ?? null };
      const jailer = findJailer();
      if (jailer === null) return { ...this.opts, jailer: null };
      return { ...this.opts, jailer: defaultJailer(await ensureSystemUser(VMM_USER), jailer) ?? null };
    })();
    this.settled.catch(() => (this.settled = undefined));
    return this.settled;
  }

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

  /** The files this VM's Firecracker opens: a fresh jail (a stale one of the same id removed), its drives under their names, the log and metrics. */
  private async prepare(spec: VmSpec, l: Launch, withBootFiles: boolean, o: FirecrackerOptions): Promise<void> {
    await makeRunDir(spec.runDir);
    if (l.jailDir) {
      await cleanJail(l.jailDir);
      await mkdir(l.hostDir, { recursive: true });
    }
    try {
      await this.stage(spec, l, withBootFiles, o);
    } catch (e) {
      if (l.jailDir) await cleanJail(l.jailDir).catch(() => {});
      throw e;
    }
  }
  private async stage(spec: VmSpec, l: Launch, withBootFiles: boolean, o: FirecrackerOptions): Promise<void> {
    await stageFiles(spec, l, withBootFiles);
    // Firecracker binds these itself, and a stale socket file would stop it.
    await rm(l.sock, { force: true });
    await rm(join(l.hostDir, VSOCK_NAME), { force: true });
    const t = telemetryPaths(spec, o);
    for (const f of [t.hostLog, t.hostMetrics]) {
      await mkdir(dirname(f), { recursive: true });
      await rm(f, { force: true });
      await writeFile(f, "", { mode: RUN_FILE_MODE });
      if (l.jailDir && l.owner) await chown(f, l.owner.uid, l.owner.gid);
    }
  }

  /**
   * Spawns the VMM (its working directory is where its relative names resolve) and waits for its
   * API socket. The guest's serial console is Firecracker's stdout: the FIFO CONSOLE_FIFO (console.ts;
   * /dev/null once a jailer daemonizes it); its stderr goes to FC_STDERR.
   */
  private async start(spec: VmSpec, l: Launch): Promise<{ proc: VmmProcess; api: FirecrackerApi; consoleLog: string }> {
    const consoleLog = join(spec.runDir, "console.log");
    const stderrLog = join(spec.runDir, FC_STDERR);
    await new BoundedLogFile(consoleLog).create();
    const fds: number[] = [];
    let spawned: ReturnType<typeof Bun.spawn>;
    try {
      fds.push(await FifoConsole.openForVmm(join(spec.runDir, CONSOLE_FIFO)));
      fds.push(openSync(stderrLog, "w", RUN_FILE_MODE));
      spawned = Bun.spawn(l.argv, { cwd: l.hostDir, stdio: ["ignore", fds[0]!, fds[1]!], detached: true });
    } catch (e) {
      throw new VmmError("StartFailed", `cannot run ${l.argv[0]}: ${(e as Error).message}`);
    } finally {
      for (const fd of fds) closeSync(fd);
    }
    spawned.unref();
    const until = Date.now() + (this.opts.startTimeoutMs ?? 5000);
    const fail = async (proc: VmmProcess, why: string): Promise<never> => {
      if (proc.exitCode === null) proc.kill("SIGKILL");
      await proc.exited;
      const log = (await Bun.file(stderrLog).text().catch(() => "")).trim();
      throw new VmmError("StartFailed", `firecracker ${spec.id} ${why}${log ? `: ${log}` : ""}`);
    };
    const proc = l.pidFile ? await this.forkedVmm(spawned, l.pidFile, until, (why) => fail(spawned, why)) : spawned;
    // A daemonizing jailer starts a session of its own: the VMM's, whose scheduler group gets the nice.
    await niceAutogroup(proc.pid, this.opts.nice ?? 0);
    while (!existsSync(l.sock)) {
      if (proc.exitCode !== null || Date.now() > until) await fail(proc, `did not open ${l.sock}`);
      await Bun.sleep(2);
    }
    await writeAdoptRecord<FirecrackerAdoptRecord>(spec.runDir, proc.pid, { spec, socketPath: l.sock, consoleLog, launch: l, memBase: null, memImage: null });
    return { proc, api: new FirecrackerApi(l.sock), consoleLog };
  }

  /** With --daemonize or --new-pid-ns the jailer exits 0 once it has forked: the VMM is the pid in its pid file. */
  private async forkedVmm(jailer: ReturnType<typeof Bun.spawn>, pidFile: string, until: number, fail: (why: string) => Promise<never>): Promise<VmmProcess> {
    const code = await Promise.race([jailer.exited, Bun.sleep(Math.max(0, until - Date.now())).then(() => "timeout" as const)]);
    if (code !== 0) return fail(code === "timeout" ? "jailer did not exit after forking" : `jailer exited with ${code}`);
    for (;;) {
      const pid = Number((await readFile(pidFile, "utf8").catch(() => "")).trim());
      const startTime = Number.isSafeInteger(pid) && pid > 0 ? AdoptedProcess.startTimeOf(pid) : undefined;
      if (startTime !== undefined) return new ForkedProcess(pid, startTime);
      if (Date.now() > until) return fail(`left no live pid in ${pidFile}`);
      await Bun.sleep(5);
    }
  }

  /** Starts, then sends reqs; on any failure the VM is stopped (its jail removed) and the error thrown. */
  private async run(spec: VmSpec, l: Launch, o: FirecrackerOptions, memBase: string | null, reqs: (vm: FirecrackerVm) => Promise<void>, memImage: string | null = null): Promise<FirecrackerVm> {
    let started;
    try {
      started = await this.start(spec, l);
    } catch (e) {
      if (l.jailDir) await cleanJail(l.jailDir).catch(() => {});
      throw e;
    }
    const vm = new FirecrackerVm(spec, started.proc, started.api, started.consoleLog, { opts: o, launch: l, memBase, memImage });
    try {
      await reqs(vm);
      // The sockets Firecracker bound (umask modes): the node's alone, as every run file.
      for (const sock of [l.sock, join(l.hostDir, VSOCK_NAME)]) if (existsSync(sock)) await chmod(sock, RUN_FILE_MODE);
    } catch (e) {
      await vm.stop().catch(() => {});
      throw e;
    }
    await writeAdoptRecord<FirecrackerAdoptRecord>(spec.runDir, vm.pid, adoptRecordOf(vm));
    return vm;
  }

  async adopt(runDir: string): Promise<Vmm> {
    const { proc, driver: rec } = await readAdoptRecord<FirecrackerAdoptRecord>(runDir);
    const api = new FirecrackerApi(rec.socketPath);
    // GET / answers the instance info; its state is "Running", "Paused" or "Not started".
    const info = await api.send<{ state?: string }>(getInstanceInfo()).catch((e) => {
      throw new VmmError("BadState", `the VM of ${runDir} does not answer on its API socket: ${(e as Error).message}`);
    });
    const launch = rec.launch ?? { argv: [], sock: rec.socketPath, hostDir: rec.spec.runDir };
    return new FirecrackerVm(rec.spec, proc, api, rec.consoleLog, { opts: await this.options(), launch, memBase: rec.memBase ?? null, memImage: rec.memImage ?? null }, info?.state === "Paused" ? "paused" : "running");
  }

  async boot(spec: VmSpec): Promise<Vmm> {
    // Absolute paths: Firecracker's working directory is the VM's run directory.
    spec = { ...spec, runDir: resolve(spec.runDir), kernel: spec.kernel && resolve(spec.kernel), ...(spec.initrd ? { initrd: resolve(spec.initrd) } : {}) };
    // Every check before any process: the id (it also names the jail) and the whole request sequence.
    const o = await this.options();
    const l = launchPlan(spec, o);
    bootRequests(spec, o);
    const reqs = bootRequests(spec, o, await this.capabilities());
    await this.prepare(spec, l, true, o);
    return this.run(spec, l, o, null, async (vm) => {
      for (const r of reqs) await vm.api.send(r);
    });
  }

  async restore(snap: SnapshotInfo, r: RestoreSpec): Promise<Vmm> {
    // Every check before any process starts.
    if (snap.vmm !== "firecracker") throw new VmmError("BadSpec", `a ${snap.vmm} snapshot cannot be restored by Firecracker`);
    checkVmId(r.id);
    if (snap.memoryImage && !r.memImage) throw new VmmError("BadSpec", `snapshot ${snap.dir} keeps its memory in layers: restore needs memImage`);
    const given = r.memImage ?? snap.memPath;
    if (!given) throw new VmmError("BadSpec", "Firecracker snapshot without a memory file or image");
    // Absolute: Firecracker's working directory is the new VM's own.
    const memory = resolve(given);
    const statePath = resolve(snap.statePath);
    const old = snap.spec;
    const names = snapshotDriveNames(old.drives.length);
    // Firecracker reopens the drive paths the snapshot recorded; only per-VM names let another VM's files be opened.
    if (JSON.stringify(snap.extra?.drives) !== JSON.stringify(names)) throw new VmmError("BadSpec", `${snap.dir}: the snapshot records no per-VM drive names (${names.join(", ")}); take it again`);
    if (r.drives.length !== old.drives.length) throw new VmmError("BadSpec", `restore needs ${old.drives.length} drives`);
    r.drives.forEach((d, i) => {
      if (!!d.readOnly !== !!old.drives[i]!.readOnly) throw new VmmError("BadSpec", `drive ${i} must be ${old.drives[i]!.readOnly ? "read-only" : "writable"} as at snapshot time`);
    });
    if (r.net && !("tap" in r.net)) throw new VmmError("Unsupported", "Firecracker networking needs a TAP device");
    if (!!r.net !== !!old.net) throw new VmmError("BadSpec", `the snapshot's VM had ${old.net ? "a" : "no"} network interface`);
    if (r.netRateLimit && !r.net) throw new VmmError("BadSpec", "netRateLimit without a network interface");
    // The MMDS config comes with the snapshot: a VM that had none cannot get data.
    if (r.metadata !== undefined && old.metadata === undefined) throw new VmmError("BadSpec", "metadata for a restore whose snapshot's VM had no MMDS");
    if (!existsSync(statePath)) throw new VmmError("BadSpec", `no snapshot state at ${statePath}`);
    await checkMemorySize(memory, old.memMiB);
    const spec: VmSpec = {
      ...old,
      id: r.id,
      runDir: resolve(r.runDir),
      drives: r.drives,
      net: r.net,
      netnsPath: r.netnsPath,
      metadata: r.metadata ?? old.metadata,
      netRateLimit: r.netRateLimit ?? old.netRateLimit,
    };
    const o = await this.options();
    const l = launchPlan(spec, o);
    const reqsFor = (files: { statePath: string; memPath: string }) => restoreRequests(snap, spec, r, files, o);
    reqsFor({ statePath, memPath: memory });
    await this.prepare(spec, l, false, o);
    let files = { statePath, memPath: memory };
    try {
      if (l.jailDir) files = await stageSnapshotInJail(l, statePath, memory);
    } catch (e) {
      await cleanJail(l.jailDir!).catch(() => {});
      throw e;
    }
    const reqs = reqsFor(files);
    return this.run(spec, l, o, memory, async (vm) => {
      for (const q of reqs) await vm.api.send(q, q.path === "/snapshot/load" ? SNAPSHOT_LOAD_TIMEOUT_MS : undefined);
    }, r.memImage ? memory : null);
  }
}
