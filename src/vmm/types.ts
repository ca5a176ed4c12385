// The one interface every VMM driver implements (docs/vmm.md): boot, pause, resume, snapshot,
// restore, stop, balloon. The orchestrator only sees these types; qemu.ts and firecracker.ts
// translate them to their VMM's command line and API.

import { chmod, mkdir, writeFile } from "node:fs/promises";

export type VmmKind = "qemu" | "firecracker";

export interface DriveSpec {
  /** A regular file (a blockd FUSE device, an image) or a block device. */
  path: string;
  readOnly?: boolean;
  /** Bandwidth and ops limits of this drive (Firecracker's rate_limiter; QEMU ignores it). */
  rateLimit?: IoRateLimit;
}

/** A token bucket: `size` tokens, refilled in full over `refillTimeMs`; `oneTimeBurst` extra tokens once at start. */
export interface TokenBucketSpec {
  size: number;
  refillTimeMs: number;
  oneTimeBurst?: number;
}

/** One device's I/O limits: a bytes bucket (bandwidth) and an operations bucket (ops); a 0-sized bucket is no limit. */
export interface IoRateLimit {
  bandwidth?: TokenBucketSpec;
  ops?: TokenBucketSpec;
}

/** A host port forwarded to a guest port (QEMU user networking; traffic stays on 127.0.0.1). */
export interface PortForward {
  hostPort: number;
  guestPort: number;
  /** Host address to bind; only loopback is accepted. */
  hostAddr?: string;
}

/**
 * Guest networking: QEMU's user-mode stack (slirp) with port forwards for now, or a TAP device
 * that src/network prepares in the sandbox's namespace.
 */
export type NetSpec = { user: { forwards: PortForward[] }; mac?: string } | { tap: string; mac?: string };

export interface VmSpec {
  /** Stable name: process title, socket and log names. */
  id: string;
  /** Per-VM directory for sockets, logs and (by default) the RAM file; created if missing. */
  runDir: string;
  kernel: string;
  initrd?: string;
  cmdline: string;
  vcpus: number;
  memMiB: number;
  /** In guest order: the first is /dev/vda (the tools disk), the second /dev/vdb (the rootfs). */
  drives: DriveSpec[];
  net?: NetSpec;
  /**
   * Where guest RAM lives. QEMU maps this file shared, so a snapshot is the file plus a small
   * device-state stream; default `<runDir>/ram` (put runDir on tmpfs to keep RAM off the disk).
   */
  memFile?: string;
  /** Add a virtio-balloon device so the host can take memory back. */
  balloon?: boolean;
  /**
   * The network namespace the VMM process runs in (a path such as /run/netns/<name>, e.g. a
   * slot's `netnsPath`), so `net: {tap}` names a TAP inside it. The VMM keeps its pid.
   */
  netnsPath?: string;
  /** Guest network limits, received (rx) and sent (tx) by the guest (Firecracker only). */
  netRateLimit?: { rx?: IoRateLimit; tx?: IoRateLimit };
  /** Sandbox metadata the guest reads from Firecracker's MMDS (V2, on the TAP interface; needs `net`). */
  metadata?: Record<string, string>;
  /** A virtio-vsock device (Firecracker: guest CID 3, host side `<runDir>/vsock.sock`). */
  vsock?: boolean;
}

/** What a restore needs that is not in the snapshot: this VM's own disks, network and files. */
export interface RestoreSpec {
  id: string;
  runDir: string;
  /** Same count, order and read-only flags as at snapshot time (each VM gets its own upper). */
  drives: DriveSpec[];
  /** Must be of the same kind (user / tap) as at snapshot time; ports and TAP names may change. */
  net?: NetSpec;
  /** Where the restored VM's own RAM file goes when the snapshot carries RAM in its stream. */
  memFile?: string;
  /**
   * The snapshot's memory served from elsewhere (a blockd read-only device over its memory layers),
   * mapped copy-on-write instead of `memPath`. Required for a snapshot with `memoryImage` set.
   */
  memImage?: string;
  /** This VM's own network namespace path (not inherited from the snapshot: each restore has its slot). */
  netnsPath?: string;
  /** This VM's MMDS data (a snapshot keeps none of it); default the snapshot spec's `metadata`. */
  metadata?: Record<string, string>;
  /** Network limits to set after the load; default: the snapshot's, which the load keeps. */
  netRateLimit?: { rx?: IoRateLimit; tx?: IoRateLimit };
}

/** A snapshot on disk: enough to start any number of VMs from it. */
export interface SnapshotInfo {
  vmm: VmmKind;
  /** Directory holding the files below and snapshot.json. */
  dir: string;
  /** Device state (QEMU migration stream / Firecracker vmstate). */
  statePath: string;
  /** Guest memory image, mapped copy-on-write by restores; absent when RAM is in the state stream. */
  memPath?: string;
  /** The spec the VM ran with; restores reuse kernel, cmdline, vcpus, memory and device layout. */
  spec: VmSpec;
  createdAt: string;
  /**
   * Memory is an image given at restore (`RestoreSpec.memImage`): the state stream holds device
   * state only and `memPath` is absent. Set on snapshots of a VM that ran on a memory image.
   */
  memoryImage?: boolean;
  /**
   * The pages this VM dirtied since its memory image, still in the stopped VMM process: the caller
   * writes them into a memory layer (stacked on the image's) before it stops or resumes the VM.
   */
  delta?: MemoryDelta;
  /** VMM-specific details (QEMU: whether the stream skipped shared RAM). */
  extra?: Record<string, unknown>;
}

/** Where the dirty pages of a paused VM are: guest page p is at `address + p * pageSize` in `pid`'s memory. */
export interface MemoryDelta {
  pid: number;
  address: number;
  /** Bytes of guest RAM (the memory image's size). */
  size: number;
  pageSize: number;
  /** Dirty pages as runs: little-endian u32 pairs (first page, page count), ascending. */
  pagesFile: string;
  pages: number;
}

export interface SnapshotOptions {
  /**
   * Keep the VM usable after the snapshot. QEMU then copies the RAM file (cost grows with touched
   * memory); without it the snapshot takes the RAM file over and the VM can only be stopped.
   */
  resumable?: boolean;
}

export type VmState = "running" | "paused" | "snapshotted" | "stopped";

export interface BalloonInfo {
  /** Guest memory the host currently lets the guest use. */
  actualMiB: number;
  targetMiB?: number;
}

/** One running VM. */
export interface Vmm {
  readonly kind: VmmKind;
  readonly id: string;
  readonly pid: number;
  readonly spec: VmSpec;
  readonly state: VmState;
  /** The guest's serial console: its last CONSOLE_LOG_MAX_BYTES (1 MiB), drained from the VMM while the VM runs (console.ts). */
  readonly consoleLog: string;
  /** Drains what the VMM holds of the console into `consoleLog` now (the timer does it within a second). */
  syncConsole(): Promise<void>;
  pause(): Promise<void>;
  resume(): Promise<void>;
  /** Pause (if running), write device state and memory into dir, leave the VM paused. */
  snapshot(dir: string, opts?: SnapshotOptions): Promise<SnapshotInfo>;
  /** Inflate or deflate the balloon so the guest keeps targetMiB. */
  balloon(targetMiB: number): Promise<BalloonInfo>;
  /** Kill the VMM process and remove its sockets; idempotent. */
  stop(): Promise<void>;
  /** Resolves when the VMM process exits, with its exit code. */
  readonly exited: Promise<number | null>;
}

/** One VMM implementation. */
export interface VmmDriver {
  readonly kind: VmmKind;
  boot(spec: VmSpec): Promise<Vmm>;
  /**
   * Takes control again of a VM this driver started earlier (in another process of the node) in
   * `runDir`; VmmError("BadState") when no VM of ours runs there any more.
   */
  adopt(runDir: string): Promise<Vmm>;
  /** Start a VM from a snapshot: memory mapped copy-on-write, device state loaded, running. */
  restore(snapshot: SnapshotInfo, spec: RestoreSpec): Promise<Vmm>;
}

export class VmmError extends Error {
  constructor(
    readonly code: "StartFailed" | "BadSpec" | "BadState" | "Protocol" | "Timeout" | "Unsupported",
    message: string,
  ) {
    super(message);
    this.name = `VmmError(${code})`;
  }
}

function checkNetnsPath(path: string): string {
  // An absolute path only: anything else could read as an option or a relative file.
  if (!/^\/[A-Za-z0-9_./-]{1,255}$/.test(path) || path.includes("/../")) throw new VmmError("BadSpec", `bad network namespace path ${JSON.stringify(path)}`);
  return path;
}

/**
 * argv run inside the network namespace at `netnsPath` and, with `nice` > 0, at that lower CPU
 * priority for all its threads (nsenter and nice exec in place: the pid stays the VMM's).
 */
export function netnsArgv(netnsPath: string | undefined, argv: string[], nice = 0): string[] {
  if (!Number.isInteger(nice) || nice < 0 || nice > 19) throw new VmmError("BadSpec", `nice ${nice} is not an integer in 0..19`);
  const run = nice > 0 ? ["nice", "-n", String(nice), ...argv] : argv;
  return netnsPath === undefined ? run : ["nsenter", `--net=${checkNetnsPath(netnsPath)}`, "--", ...run];
}

/**
 * A detached VMM leads a session of its own, and where the kernel groups sessions for the scheduler
 * (autogroup, kernel.sched_autogroup_enabled: on in Debian's kernels) each group weighs as one
 * nice-0 task, whatever the nice of its threads: so the VMM's group gets `nice` too
 * (/proc/<pid>/autogroup). 8 busy nice-10 sessions cost a nice-0 timer loop 25 ms of run-queue wait
 * over 400 wakes at group nice 0, 12 ms at group nice 10. A kernel without autogroups has no such
 * file: nice alone counts there. Best effort: a VMM runs whatever this says.
 */
export async function niceAutogroup(pid: number, nice: number): Promise<void> {
  if (nice <= 0) return;
  try {
    await writeFile(`/proc/${pid}/autogroup`, String(nice));
  } catch (e) {
    if ((e as NodeJS.ErrnoException).code !== "ENOENT") console.error(`vmm: the scheduler group of VMM ${pid} keeps its nice: ${(e as Error).message}`);
  }
}

/** The VMM process as a VM sees it: a child we spawned (Bun's Subprocess) or one we adopted. */
export interface VmmProcess {
  readonly pid: number;
  readonly exited: Promise<number | null>;
  readonly exitCode: number | null;
  readonly killed: boolean;
  kill(signal?: NodeJS.Signals | number): void;
}

/**
 * What every driver's VM shares: the VMM process, its exit, and the state checks around it.
 * The driver's class adds the VMM-specific control (QMP, Firecracker's API).
 */
export abstract class VmProcess {
  protected _state: VmState = "running";
  readonly exited: Promise<number | null>;

  constructor(
    readonly spec: VmSpec,
    protected proc: VmmProcess,
  ) {
    this.exited = proc.exited.then((code) => {
      this._state = "stopped";
      return code;
    });
  }
  get id(): string {
    return this.spec.id;
  }
  get pid(): number {
    return this.proc.pid;
  }
  get state(): VmState {
    return this._state;
  }
  protected need(...ok: VmState[]): void {
    if (!ok.includes(this._state)) throw new VmmError("BadState", `VM ${this.id} is ${this._state}, expected ${ok.join(" or ")}`);
  }
  protected get running(): boolean {
    return this.proc.exitCode === null && !this.proc.killed;
  }
}

/** A VM's run directory is the node's alone: 0700, and every file the node or its VMM makes there 0600. */
export const RUN_DIR_MODE = 0o700;
export const RUN_FILE_MODE = 0o600;

/** Makes `dir` (and missing parents) and sets it to RUN_DIR_MODE, also when it was there already. */
export async function makeRunDir(dir: string): Promise<void> {
  await mkdir(dir, { recursive: true, mode: RUN_DIR_MODE });
  await chmod(dir, RUN_DIR_MODE);
}

/** Reads snapshot.json from a snapshot directory. */
export async function readSnapshot(dir: string): Promise<SnapshotInfo> {
  return (await Bun.file(`${dir}/snapshot.json`).json()) as SnapshotInfo;
}

/** Records a snapshot's description (never its transient `delta`) as readSnapshot reads it. */
export async function writeSnapshot(info: SnapshotInfo): Promise<void> {
  const { delta: _, ...kept } = info;
  await Bun.write(`${info.dir}/snapshot.json`, JSON.stringify(kept, null, 1));
}
