// QEMU driver: `-M microvm,acpi=on` driven over QMP. Guest RAM is a memory-backend-file mapped
// shared, so a snapshot is a QMP migration with x-ignore-shared (device state only, ~70 KB) and the
// RAM file itself; a restore maps that file private (copy-on-write) and loads the device state.
// KVM when it is usable, TCG otherwise (docs/vmm.md).

import { accessSync, closeSync, constants, existsSync, openSync, readFileSync } from "node:fs";
import { chmod, link, mkdir, open, readFile, rm, stat, writeFile } from "node:fs/promises";
import { dirname, join, resolve } from "node:path";
import { QmpClient, QmpFdSession } from "./qmp.ts";
import { readAdoptRecord, writeAdoptRecord } from "./adopt.ts";
import { BoundedLogFile, CONSOLE_RING_BYTES, ConsoleDrain, RingbufConsole } from "./console.ts";
import { checkBootFiles } from "./snapshot_paths.ts";
import { canDropPrivileges, ensureSystemUser, VMM_USER } from "./vmm_user.ts";
import {
  type BalloonInfo,
  type DriveSpec,
  type NetSpec,
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
  RUN_FILE_MODE,
  makeRunDir,
  netnsArgv,
  niceAutogroup,
  writeSnapshot,
} from "./types.ts";
import { withTimeout } from "./wait.ts";
import { dirtyRuns, mappingOf, PAGE_SIZE } from "./pagemap.ts";

export type Accel = "kvm" | "tcg";

export interface QemuOptions {
  /** qemu-system-x86_64 on PATH by default (the node passes its qemu_bin setting). */
  binary?: string;
  /**
   * TCG's translated-code cache per VMM, MiB (`-accel tcg,tb-size=`; the node's qemu_tcg_cache_mb
   * setting): QEMU 7.2's default is 1 GiB, of which an idle base guest fills 75–85 MiB (bench/density).
   */
  tcgCacheMiB?: number;
  /** Forced accelerator (the node's qemu_accel setting); otherwise KVM when probeKvm() says usable. */
  accel?: Accel;
  /** Guest TSC frequency for TCG (the host's by default); 0 leaves the kernel command line alone. */
  tscKhz?: number;
  /** How long QEMU may take to answer on QMP after it starts. */
  startTimeoutMs?: number;
  /** CPU niceness of the VMM process, its vCPU threads and its scheduler group (0..19; the node passes its vmm_nice setting). */
  nice?: number;
  /**
   * Directories a restored snapshot's kernel and initrd must be in (the node's guest cache), since a
   * snapshot may come from a shared store; absent: not checked.
   */
  bootDirs?: string[];
  /**
   * The user QEMU switches to once it has opened its files (`-runas`): by default VMM_USER,
   * created when missing, when the node runs as root; null: QEMU stays the node's user.
   */
  runAs?: string | null;
}

/** How the RAM of one QEMU is backed. */
interface RamBacking {
  path: string;
  /** true: MAP_SHARED (writes land in the file); false: MAP_PRIVATE copy-on-write of the file. */
  share: boolean;
}

/** Everything the argv depends on; a pure input so tests can check the command line. */
export interface QemuLaunch {
  spec: VmSpec;
  accel: Accel;
  /** TCG's translated-code cache, MiB (QemuOptions.tcgCacheMiB); none: QEMU's default. */
  tcgCacheMiB?: number;
  ram: RamBacking;
  qmpSocket: string;
  /** A second QMP monitor, for the commands that carry a descriptor (SCM_RIGHTS: `add-fd`). */
  fdMonitor: string;
  /** The console file the node drains QEMU's console ring into (console.ts). */
  consoleLog: string;
  pidFile: string;
  /** Start waiting for a migration stream (restore) on descriptor INCOMING_FD instead of booting. */
  incoming?: boolean;
  tscKhz?: number;
  /** `-runas`: the unprivileged user QEMU switches to once its files are open. */
  runAs?: string;
}

const MiB = 1 << 20;
/** The ringbuf chardev that holds the guest's serial console (console.ts drains it). */
const CONSOLE_DEVICE = "console";
/** A restore's QEMU gets the snapshot's device state open as this descriptor (`migrate-incoming fd:3`). */
const INCOMING_FD = 3;
/** Drive descriptors follow it in QEMU's table (driveDescriptors). */
const DRIVE_FD_BASE = 4;

/**
 * The descriptors QEMU gets for its drives, opened by the node: drive i is fdset i+1 (`-add-fd`,
 * `file=/dev/fdset/<i+1>`), holding a read-only descriptor and, for a writable drive, a
 * read-write one. Under -runas QEMU cannot open the node's device paths, and a restore's QEMU
 * reopens its drives when the loaded VM is activated: it takes a duplicate from the set instead.
 */
export function driveDescriptors(drives: readonly DriveSpec[]): { drive: number; fdset: number; fd: number; write: boolean }[] {
  const out: { drive: number; fdset: number; fd: number; write: boolean }[] = [];
  drives.forEach((d, i) => {
    for (const write of d.readOnly ? [false] : [false, true]) out.push({ drive: i, fdset: i + 1, fd: DRIVE_FD_BASE + out.length, write });
  });
  return out;
}
/** A device-state stream is read whole: past 16 MiB it is refused (a microvm's is ~70 KB). */
export const DEVICE_STATE_MAX_BYTES = 16 * MiB;

/**
 * `-sandbox` (seccomp): obsolete system calls, spawning processes and resource control denied.
 * elevateprivileges=deny only without -runas: QEMU 7.2 installs the filter before its own -runas
 * setuid, which deny (and children) kill with SIGSYS; once -runas has run no uid is 0 and no
 * capability is left, so a setuid back fails anyway, and the filter sets no_new_privs.
 */
export function sandboxOption(runAs: string | undefined): string {
  return `on,obsolete=deny,elevateprivileges=${runAs ? "allow" : "deny"},spawn=deny,resourcecontrol=deny`;
}

/** QEMU option values separate fields with commas; a literal comma is doubled. */
export function qemuOptValue(v: string): string {
  return v.replaceAll(",", ",,");
}

function isLoopback(addr: string): boolean {
  return /^127\.\d{1,3}\.\d{1,3}\.\d{1,3}$/.test(addr);
}

/** Kernel command line as the guest will see it: TCG on microvm needs the TSC frequency given. */
export function effectiveCmdline(cmdline: string, accel: Accel, tscKhz: number | undefined): string {
  // microvm has no HPET or PM timer, so under TCG the kernel cannot calibrate the TSC and may hang.
  if (accel !== "tcg" || !tscKhz || /\btsc_early_khz=/.test(cmdline)) return cmdline;
  return `${cmdline} tsc_early_khz=${tscKhz} tsc=reliable`.trim();
}

function netArgs(net: NetSpec | undefined): string[] {
  if (!net) return [];
  const mac = net.mac ? `,mac=${net.mac}` : "";
  if ("tap" in net) {
    if (!/^[A-Za-z0-9_.-]{1,15}$/.test(net.tap)) throw new VmmError("BadSpec", `bad TAP name ${JSON.stringify(net.tap)}`);
    return ["-netdev", `tap,id=n0,ifname=${net.tap},script=no,downscript=no`, "-device", `virtio-net-device,netdev=n0${mac}`];
  }
  const fwd = net.user.forwards.map((f) => {
    const addr = f.hostAddr ?? "127.0.0.1";
    // Forwards stay on loopback: the node proxies into sandboxes, nothing else may reach them.
    if (!isLoopback(addr)) throw new VmmError("BadSpec", `port forwards bind to loopback only, not ${addr}`);
    for (const p of [f.hostPort, f.guestPort])
      if (!Number.isInteger(p) || p < 1 || p > 65535) throw new VmmError("BadSpec", `bad port ${p}`);
    return `,hostfwd=tcp:${addr}:${f.hostPort}-:${f.guestPort}`;
  });
  return ["-netdev", `user,id=n0${fwd.join("")}`, "-device", `virtio-net-device,netdev=n0${mac}`];
}

/** The full QEMU argv (without the binary) for a boot or a restore. */
export function qemuArgs(l: QemuLaunch): string[] {
  const { spec } = l;
  if (!Number.isInteger(spec.vcpus) || spec.vcpus < 1) throw new VmmError("BadSpec", `vcpus must be ≥ 1`);
  if (!Number.isInteger(spec.memMiB) || spec.memMiB < 16) throw new VmmError("BadSpec", `memMiB must be ≥ 16`);
  const args = [
    "-name", qemuOptValue(spec.id),
    "-nodefaults", "-no-user-config", "-nographic",
    // A guest reboot or panic ends the process instead of booting again behind our back.
    "-no-reboot",
    "-M", `${MACHINE},acpi=on,memory-backend=ram0`,
    "-accel", l.accel === "tcg" && l.tcgCacheMiB ? `tcg,tb-size=${l.tcgCacheMiB}` : l.accel,
    "-cpu", l.accel === "kvm" ? "host" : "max",
    "-smp", String(spec.vcpus),
    "-m", `${spec.memMiB}M`,
    "-object", `memory-backend-file,id=ram0,size=${spec.memMiB}M,mem-path=${qemuOptValue(l.ram.path)},share=${l.ram.share ? "on" : "off"}`,
    "-kernel", qemuOptValue(spec.kernel),
  ];
  if (spec.initrd) args.push("-initrd", qemuOptValue(spec.initrd));
  args.push("-append", effectiveCmdline(spec.cmdline, l.accel, l.tscKhz));
  for (const f of driveDescriptors(spec.drives)) args.push("-add-fd", `fd=${f.fd},set=${f.fdset}`);
  spec.drives.forEach((d, i) => {
    // Device order is guest order: drive 0 is /dev/vda. No O_DIRECT: blockd's FUSE files are direct already.
    args.push(
      "-drive", `id=d${i},file=/dev/fdset/${i + 1},format=raw,if=none,cache=writeback,aio=threads${d.readOnly ? ",readonly=on" : ""}`,
      "-device", `virtio-blk-device,drive=d${i}`,
    );
  });
  args.push(...netArgs(spec.net));
  // Free pages the guest reports go back to the host (2 MiB at a time, a few seconds after they are freed).
  if (spec.balloon) args.push("-device", "virtio-balloon-device,deflate-on-oom=on,free-page-reporting=on");
  args.push(
    // The console stays in QEMU's memory (CONSOLE_RING_BYTES, oldest bytes dropped first) until the node drains it.
    "-chardev", `ringbuf,id=${CONSOLE_DEVICE},size=${CONSOLE_RING_BYTES}`,
    "-serial", `chardev:${CONSOLE_DEVICE}`,
    "-qmp", `unix:${qemuOptValue(l.qmpSocket)},server=on,wait=off`,
    "-qmp", `unix:${qemuOptValue(l.fdMonitor)},server=on,wait=off`,
    "-pidfile", l.pidFile,
    "-sandbox", sandboxOption(l.runAs),
  );
  if (l.runAs) {
    if (!/^[a-z_][a-z0-9_-]{0,31}$/.test(l.runAs)) throw new VmmError("BadSpec", `bad -runas user ${JSON.stringify(l.runAs)}`);
    args.push("-runas", l.runAs);
  }
  if (l.incoming) args.push("-incoming", "defer");
  return args;
}

/**
 * Whether /dev/kvm can run an ordinary guest. A kvm_pvm /dev/kvm only runs PVM-enabled guest
 * kernels (stock kernels die with "emulation failure"), so it counts as unusable.
 */
export function probeKvm(): { usable: boolean; reason: string } {
  if (!existsSync("/dev/kvm")) return { usable: false, reason: "no /dev/kvm" };
  try {
    accessSync("/dev/kvm", constants.R_OK | constants.W_OK);
  } catch {
    return { usable: false, reason: "/dev/kvm is not readable and writable by us" };
  }
  if (existsSync("/sys/module/kvm_pvm")) return { usable: false, reason: "/dev/kvm is kvm_pvm (PVM guests only)" };
  if (!existsSync("/sys/module/kvm_intel") && !existsSync("/sys/module/kvm_amd"))
    return { usable: false, reason: "neither kvm_intel nor kvm_amd is loaded" };
  return { usable: true, reason: "hardware KVM" };
}

/** Host TSC in kHz, which the TCG guest sees as its own TSC. */
export function hostTscKhz(): number | undefined {
  try {
    const m = /^cpu MHz\s*:\s*([\d.]+)/m.exec(readFileSync("/proc/cpuinfo", "utf8"));
    return m ? Math.floor(Number(m[1]) * 1000) : undefined;
  } catch {
    return undefined;
  }
}

export function resolveAccel(opts: QemuOptions = {}): Accel {
  const forced: string | undefined = opts.accel;
  if (forced === "kvm" || forced === "tcg") return forced;
  if (forced !== undefined) throw new VmmError("BadSpec", `accel must be kvm or tcg, not ${forced}`);
  return probeKvm().usable ? "kvm" : "tcg";
}

export function qemuBinary(opts: QemuOptions = {}): string {
  return opts.binary ?? "qemu-system-x86_64";
}

/** A RAM copy's time limit: cp moves well over 100 MiB/s even on a loaded disk, so 2 min is ≥ 12 GiB. */
export const COPY_TIMEOUT_MS = 120_000;

/**
 * Copy keeping holes, so an untouched 512 MiB RAM file costs only its touched pages. Awaited
 * (the event loop keeps serving), killed after timeoutMs (Timeout); on any failure the partial
 * copy is removed and the error carries cp's stderr.
 */
export async function sparseCopy(from: string, to: string, timeoutMs = COPY_TIMEOUT_MS): Promise<void> {
  const deadline = AbortSignal.timeout(timeoutMs);
  const cp = Bun.spawn(["cp", "--sparse=always", "--", from, to], { stdin: "ignore", stdout: "ignore", stderr: "pipe", signal: deadline, killSignal: "SIGKILL" });
  const [stderr] = await Promise.all([new Response(cp.stderr).text(), cp.exited]);
  if (cp.exitCode === 0) return;
  await rm(to, { force: true });
  if (cp.exitCode === null && deadline.aborted) throw new VmmError("Timeout", `copying ${from} to ${to} took over ${timeoutMs} ms (killed)`);
  throw new VmmError("Protocol", `copying ${from} to ${to} failed (${cp.exitCode ?? cp.signalCode}): ${stderr.trim()}`);
}

class QemuVm extends VmProcess implements Vmm {
  readonly kind = "qemu" as const;
  private readonly console: ConsoleDrain;

  constructor(
    spec: VmSpec,
    proc: VmmProcess,
    private qmp: QmpClient,
    private launch: QemuLaunch,
    /** The RAM file is ours to delete on stop (not a snapshot's image mapped private). */
    private ownsRam: boolean,
    state: VmState = "running",
  ) {
    super(spec, proc);
    this._state = state;
    this.console = new ConsoleDrain(new RingbufConsole(qmp, CONSOLE_DEVICE), new BoundedLogFile(launch.consoleLog)).start();
  }

  get consoleLog(): string {
    return this.launch.consoleLog;
  }

  syncConsole(): Promise<void> {
    return this.console.drain();
  }
  /** The QMP connection, for callers that need a command this interface does not cover. */
  get monitor(): QmpClient {
    return this.qmp;
  }

  async pause(): Promise<void> {
    this.need("running", "paused");
    await this.qmp.execute("stop");
    this._state = "paused";
  }

  async resume(): Promise<void> {
    this.need("running", "paused");
    await this.qmp.execute("cont");
    this._state = "running";
  }

  async snapshot(dir: string, opts: SnapshotOptions = {}): Promise<SnapshotInfo> {
    this.need("running", "paused");
    dir = resolve(dir);
    await mkdir(dir, { recursive: true });
    const statePath = join(dir, "vmstate");
    if (this._state === "running") await this.pause();
    const sharedRam = this.launch.ram.share;
    if (!sharedRam) return this.deltaSnapshot(dir, statePath, opts);
    // Device state only: the RAM is the shared file, taken over or copied below.
    await this.saveDeviceState(statePath);
    let memPath: string | undefined;
    if (sharedRam) {
      memPath = join(dir, "mem");
      await rm(memPath, { force: true });
      if (opts.resumable) await sparseCopy(this.launch.ram.path, memPath);
      else {
        // Taking the RAM file over: the VM must never run again, or it would change the image.
        try {
          await link(this.launch.ram.path, memPath);
        } catch {
          await sparseCopy(this.launch.ram.path, memPath);
        }
        await this.markSnapshotted();
      }
    }
    const info: SnapshotInfo = {
      vmm: "qemu",
      dir,
      statePath,
      memPath,
      spec: this.spec,
      createdAt: new Date().toISOString(),
      extra: { ignoreShared: false, accel: this.launch.accel, tscKhz: this.launch.tscKhz },
    };
    await writeSnapshot(info);
    return info;
  }

  /**
   * The device state (no RAM section: `xen-save-devices-state`) into `statePath` as a stream a
   * restore loads (deviceOnlyStream). QEMU gets the file as a descriptor over the fd monitor
   * (`add-fd`, then `/dev/fdset/<id>`): under -runas it cannot open the node's files, and under
   * -sandbox spawn=deny it cannot run a migration's `exec:` command.
   */
  private async saveDeviceState(statePath: string): Promise<void> {
    const devices = `${statePath}.devices`;
    await rm(devices, { force: true });
    const file = await open(devices, "w", RUN_FILE_MODE);
    try {
      // A QEMU launched without an fd monitor runs as the node's user, unconfined: it opens the file itself.
      if (!this.launch.fdMonitor) await this.qmp.execute("xen-save-devices-state", { filename: devices, live: false });
      else await this.saveThroughFdMonitor(file.fd);
    } finally {
      await file.close();
    }
    try {
      const bytes = (await stat(devices)).size;
      if (bytes > DEVICE_STATE_MAX_BYTES) throw new VmmError("Protocol", `VM ${this.id} wrote ${bytes} bytes of device state, more than ${DEVICE_STATE_MAX_BYTES}`);
      await writeFile(statePath, deviceOnlyStream(new Uint8Array(await readFile(devices))), { mode: RUN_FILE_MODE });
    } finally {
      await rm(devices, { force: true });
    }
  }

  /** `xen-save-devices-state` into descriptor `fd`, handed over on the fd monitor as a new fdset (removed again after). */
  private async saveThroughFdMonitor(fd: number): Promise<void> {
    const session = await QmpFdSession.open(this.launch.fdMonitor);
    try {
      const { "fdset-id": fdset } = await session.execute<{ "fdset-id": number }>("add-fd", {}, fd);
      try {
        await session.execute("xen-save-devices-state", { filename: `/dev/fdset/${fdset}`, live: false });
      } finally {
        await session.execute("remove-fd", { "fdset-id": fdset }).catch(() => {});
      }
    } finally {
      session.close();
    }
  }

  /** Never to run again (its memory is a snapshot's now): recorded, so a node that adopts it knows too. */
  private async markSnapshotted(): Promise<void> {
    this._state = "snapshotted";
    await writeAdoptRecord<QemuAdoptRecord>(this.spec.runDir, this.pid, { launch: this.launch, ownsRam: this.ownsRam, snapshotted: true });
  }

  /**
   * A VM on a private mapping of its memory image: its dirty pages are the mapping's anonymous
   * pages (pagemap.ts), left in the stopped process for the caller to write out, and the stream
   * is device state only (`xen-save-devices-state`: no RAM section), so the snapshot costs what
   * the guest dirtied, not what it holds.
   */
  private async deltaSnapshot(dir: string, statePath: string, opts: SnapshotOptions): Promise<SnapshotInfo> {
    const size = this.spec.memMiB * MiB;
    const map = await mappingOf(this.pid, this.launch.ram.path);
    if (map.length !== size) throw new VmmError("BadState", `VM ${this.id} maps ${map.length} bytes of ${this.launch.ram.path}, not ${size}`);
    const { runs, dirty } = await dirtyRuns(this.pid, map.address, size / PAGE_SIZE);
    const pagesFile = join(dir, "mem.pages");
    await Bun.write(pagesFile, runs);
    await this.saveDeviceState(statePath);
    // Not resumable: the pages are the caller's to take, and running on would change them.
    if (!opts.resumable) await this.markSnapshotted();
    const info: SnapshotInfo = {
      vmm: "qemu",
      dir,
      statePath,
      spec: this.spec,
      createdAt: new Date().toISOString(),
      memoryImage: true,
      delta: { pid: this.pid, address: map.address, size, pageSize: PAGE_SIZE, pagesFile, pages: dirty },
      extra: { ignoreShared: false, accel: this.launch.accel, tscKhz: this.launch.tscKhz },
    };
    await writeSnapshot(info); // without its delta: that lives only as long as this process
    return info;
  }

  async balloon(targetMiB: number): Promise<BalloonInfo> {
    if (!this.spec.balloon) throw new VmmError("Unsupported", `VM ${this.id} was started without a balloon device`);
    this.need("running", "paused");
    if (!Number.isInteger(targetMiB) || targetMiB < 1 || targetMiB > this.spec.memMiB)
      throw new VmmError("BadSpec", `balloon target must be 1..${this.spec.memMiB} MiB`);
    await this.qmp.execute("balloon", { value: targetMiB * MiB });
    const q = await this.qmp.execute<{ actual: number }>("query-balloon");
    return { actualMiB: Math.round(q.actual / MiB), targetMiB };
  }

  async stop(): Promise<void> {
    await this.console.stop();
    if (this.running) {
      try {
        await withTimeout(this.qmp.execute("quit"), 2000, "quit");
      } catch {}
      try {
        await withTimeout(this.exited, 3000, "exit");
      } catch {
        this.proc.kill("SIGKILL");
        await this.exited;
      }
    }
    this.qmp.close();
    this._state = "stopped";
    await rm(this.launch.qmpSocket, { force: true });
    await rm(this.launch.fdMonitor, { force: true });
    await rm(this.launch.pidFile, { force: true });
    if (this.ownsRam) await rm(this.launch.ram.path, { force: true });
  }
}

export class QemuDriver implements VmmDriver {
  readonly kind = "qemu" as const;
  readonly accel: Accel;
  readonly binary: string;
  private tscKhz: number | undefined;

  constructor(private opts: QemuOptions = {}) {
    this.accel = resolveAccel(opts);
    this.binary = qemuBinary(opts);
    this.tscKhz = opts.tscKhz === 0 ? undefined : (opts.tscKhz ?? hostTscKhz());
  }

  private runAs: Promise<string | undefined> | undefined;
  /** The user for -runas (made when missing, once per driver), or undefined: QEMU keeps the node's user. */
  private vmmUser(): Promise<string | undefined> {
    const want = this.opts.runAs === undefined ? (canDropPrivileges() ? VMM_USER : null) : this.opts.runAs;
    this.runAs ??= want === null ? Promise.resolve(undefined) : ensureSystemUser(want).then((u) => u.name);
    this.runAs.catch(() => (this.runAs = undefined));
    return this.runAs;
  }

  private paths(runDir: string) {
    return {
      qmpSocket: join(runDir, "qmp.sock"),
      fdMonitor: join(runDir, "qmp-fd.sock"),
      consoleLog: join(runDir, "console.log"),
      pidFile: join(runDir, "qemu.pid"),
      qemuLog: join(runDir, "qemu.log"),
    };
  }

  /**
   * Spawn QEMU and connect to QMP; a QEMU that dies first is reported with its stderr. A restore's
   * device state (`incomingState`) is QEMU's descriptor INCOMING_FD.
   */
  private async start(launch: QemuLaunch, qemuLog: string, incomingState?: string): Promise<{ proc: ReturnType<typeof Bun.spawn>; qmp: QmpClient }> {
    const argv = netnsArgv(launch.spec.netnsPath, [this.binary, ...qemuArgs(launch)], this.opts.nice);
    for (const sock of [launch.qmpSocket, launch.fdMonitor]) await rm(sock, { force: true });
    await writeFile(join(dirname(qemuLog), "qemu.argv"), JSON.stringify(argv), { mode: RUN_FILE_MODE });
    await new BoundedLogFile(launch.consoleLog).create();
    const fds: number[] = [];
    let proc: ReturnType<typeof Bun.spawn>;
    try {
      const log = openSync(qemuLog, "w", RUN_FILE_MODE);
      fds.push(log);
      const stdio: (number | "ignore")[] = ["ignore", log, log, "ignore"];
      if (incomingState !== undefined) {
        const state = openSync(incomingState, "r");
        fds.push(state);
        stdio[INCOMING_FD] = state;
      }
      for (const f of driveDescriptors(launch.spec.drives)) {
        const fd = openSync(launch.spec.drives[f.drive]!.path, f.write ? "r+" : "r");
        fds.push(fd);
        stdio[f.fd] = fd;
      }
      // Detached with its output in a file: a VM outlives the node process that started it.
      proc = Bun.spawn(argv, { stdio: stdio as ["ignore", number, number], detached: true });
    } catch (e) {
      throw new VmmError("StartFailed", `cannot run ${this.binary}: ${(e as Error).message}`);
    } finally {
      for (const fd of fds) closeSync(fd);
    }
    proc.unref();
    await niceAutogroup(proc.pid, this.opts.nice ?? 0);
    const failure = async (why: string) => {
      if (proc.exitCode === null) proc.kill("SIGKILL");
      await proc.exited;
      const stderr = (await Bun.file(qemuLog).text().catch(() => "")).trim();
      return new VmmError("StartFailed", `QEMU ${launch.spec.id} ${why}${stderr ? `: ${stderr}` : ""}`);
    };
    const until = Date.now() + (this.opts.startTimeoutMs ?? 10_000);
    let exited = false;
    void proc.exited.then(() => (exited = true));
    while (!existsSync(launch.qmpSocket)) {
      if (exited) throw await failure(`exited with ${proc.exitCode} before opening QMP`);
      if (Date.now() > until) throw await failure("did not open its QMP socket in time");
      await Bun.sleep(2);
    }
    try {
      // QEMU greets only once its main loop runs, i.e. after every device and backend came up.
      const qmp = await QmpClient.connect(launch.qmpSocket, Math.max(1000, until - Date.now()));
      for (const sock of [launch.qmpSocket, launch.fdMonitor]) await chmod(sock, RUN_FILE_MODE);
      return { proc, qmp };
    } catch (e) {
      await Bun.sleep(20); // let a dying QEMU finish writing its error
      throw await failure(exited || proc.exitCode !== null ? `exited with ${proc.exitCode}` : `QMP failed (${(e as Error).message})`);
    }
  }

  /** A fresh RAM file, 0600 (QEMU would make it 0644): a fresh VM starts from zeroed memory. */
  private async freshRamFile(path: string): Promise<void> {
    await mkdir(dirname(path), { recursive: true });
    await rm(path, { force: true });
    await writeFile(path, "", { mode: RUN_FILE_MODE });
  }

  async boot(spec: VmSpec): Promise<Vmm> {
    spec = { ...spec, runDir: resolve(spec.runDir) };
    checkSpec(spec);
    const runAs = await this.vmmUser();
    await makeRunDir(spec.runDir);
    const p = this.paths(spec.runDir);
    const ram = { path: resolve(spec.memFile ?? join(spec.runDir, "ram")), share: true };
    await this.freshRamFile(ram.path);
    const launch: QemuLaunch = { spec, accel: this.accel, tcgCacheMiB: this.opts.tcgCacheMiB, ram, ...p, tscKhz: this.tscKhz, runAs };
    const { proc, qmp } = await this.start(launch, p.qemuLog);
    await writeAdoptRecord<QemuAdoptRecord>(spec.runDir, proc.pid, { launch, ownsRam: true });
    return new QemuVm(spec, proc, qmp, launch, true);
  }

  async adopt(runDir: string): Promise<Vmm> {
    const { proc, driver: rec } = await readAdoptRecord<QemuAdoptRecord>(runDir);
    let qmp: QmpClient;
    try {
      qmp = await QmpClient.connect(rec.launch.qmpSocket, ADOPT_QMP_TIMEOUT_MS);
    } catch (e) {
      throw new VmmError("BadState", `the VM of ${runDir} does not answer on QMP: ${(e as Error).message}`);
    }
    const st = await qmp.execute<{ status: string }>("query-status");
    const state: VmState = rec.snapshotted || st.status === "postmigrate" ? "snapshotted" : st.status === "running" ? "running" : "paused";
    return new QemuVm(rec.launch.spec, proc, qmp, rec.launch, rec.ownsRam, state);
  }

  async restore(snap: SnapshotInfo, r: RestoreSpec): Promise<Vmm> {
    if (snap.vmm !== "qemu") throw new VmmError("BadSpec", `a ${snap.vmm} snapshot cannot be restored by QEMU`);
    if (this.opts.bootDirs) {
      try {
        checkBootFiles(snap.spec, this.opts.bootDirs);
      } catch (e) {
        throw new VmmError("BadSpec", (e as Error).message);
      }
    }
    const old = snap.spec;
    if (r.drives.length !== old.drives.length || r.drives.some((d, i) => !!d.readOnly !== !!old.drives[i]!.readOnly))
      throw new VmmError("BadSpec", `restore needs ${old.drives.length} drives with the snapshot's read-only flags`);
    const kindOf = (n: NetSpec | undefined) => (!n ? "none" : "tap" in n ? "tap" : "user");
    // The netdev backend is part of the migration stream; a different kind fails to load.
    if (kindOf(r.net) !== kindOf(old.net)) throw new VmmError("BadSpec", `restore needs a ${kindOf(old.net)} network like the snapshot`);
    const spec: VmSpec = { ...old, id: r.id, runDir: resolve(r.runDir), drives: r.drives, net: r.net, memFile: r.memFile, netnsPath: r.netnsPath };
    const runAs = await this.vmmUser();
    await makeRunDir(spec.runDir);
    const p = this.paths(spec.runDir);
    const ignoreShared = snap.extra?.ignoreShared === true;
    let ram: RamBacking;
    if (snap.memoryImage && !r.memImage) throw new VmmError("BadSpec", `snapshot ${snap.dir} keeps its memory in layers: restore needs memImage`);
    if (!existsSync(snap.statePath)) throw new VmmError("BadSpec", `no snapshot state at ${snap.statePath}`);
    // A memory image of another size, or a stream in another accelerator's terms, fails QEMU half-way: refuse first.
    const memory = r.memImage ?? snap.memPath;
    if (memory !== undefined) {
      const bytes = await stat(memory).then((st) => st.size, () => undefined);
      if (bytes === undefined) throw new VmmError("BadSpec", `${memory} does not exist`);
      if (bytes !== old.memMiB * MiB) throw new VmmError("BadSpec", `memory image ${memory} holds ${bytes} bytes, the snapshot's VM has ${old.memMiB} MiB`);
    }
    const snapAccel = snap.extra?.accel as Accel | undefined;
    if (snapAccel !== undefined && snapAccel !== this.accel) throw new VmmError("BadSpec", `snapshot ${snap.dir} was taken under ${snapAccel}; this host runs QEMU with ${this.accel}`);
    if (r.memImage) ram = { path: resolve(r.memImage), share: false };
    else if (snap.memPath) {
      // QEMU 7.2 discards a private mapping's pages (balloon, free page reporting) by punching its
      // file first: with a balloon, only a read-only device (which refuses the punch) may back RAM.
      if (old.balloon) throw new VmmError("BadSpec", `snapshot ${snap.dir} has a balloon: restore it from a read-only memory image (memImage), not its mem file, which the balloon would punch`);
      ram = { path: snap.memPath, share: false };
    }
    else {
      // RAM comes in the stream: load it into a shared file of our own, so our next snapshot is cheap.
      ram = { path: resolve(r.memFile ?? join(spec.runDir, "ram")), share: true };
      await this.freshRamFile(ram.path);
    }
    // The accelerator and TSC must match the source: the stream holds CPU state in its terms.
    const accel = snapAccel ?? this.accel;
    const tscKhz = (snap.extra?.tscKhz as number | undefined) ?? this.tscKhz;
    const launch: QemuLaunch = { spec, accel, tcgCacheMiB: accel === "tcg" ? this.opts.tcgCacheMiB : undefined, ram, ...p, incoming: true, tscKhz, runAs };
    const { proc, qmp } = await this.start(launch, p.qemuLog, snap.statePath);
    await writeAdoptRecord<QemuAdoptRecord>(spec.runDir, proc.pid, { launch, ownsRam: ram.share });
    const vm = new QemuVm(spec, proc, qmp, launch, ram.share);
    try {
      await qmp.execute("migrate-set-capabilities", { capabilities: [{ capability: "x-ignore-shared", state: ignoreShared }] });
      await qmp.execute("migrate-incoming", { uri: `fd:${INCOMING_FD}` });
      for (;;) {
        const s = await qmp.execute<{ status: string }>("query-status");
        if (s.status === "running") break;
        if (s.status === "paused" || s.status === "postmigrate" || s.status === "prelaunch") {
          await qmp.execute("cont");
          break;
        }
        if (s.status !== "inmigrate") throw new VmmError("Protocol", `restore of ${r.id}: QEMU is ${s.status}`);
        if (proc.exitCode !== null) throw new VmmError("Protocol", `restore of ${r.id}: QEMU exited`);
        await Bun.sleep(2);
      }
    } catch (e) {
      await vm.stop();
      const log = (await Bun.file(p.qemuLog).text().catch(() => "")).trim();
      throw new VmmError("StartFailed", `${(e as Error).message}${log ? `: ${log}` : ""}`);
    }
    return vm;
  }
}

/** The machine type of every VM here; a migration stream names it in its configuration section. */
const MACHINE = "microvm";
// Migration stream bytes (QEMU migration/savevm.c): section types and the file header.
const QEMU_VM_CONFIGURATION = 0x07;
const QEMU_VM_VMDESCRIPTION = 0x06;
const STREAM_HEADER = 8; // "QEVM" magic + version 3, both big-endian u32

/**
 * `xen-save-devices-state` writes the header, the device sections and EOF, but a microvm's
 * loader wants a configuration section after the header (the machine name; no capability
 * subsection, so the restore runs with x-ignore-shared off) and a VM description after EOF.
 */
export function deviceOnlyStream(saved: Uint8Array): Uint8Array {
  const magic = new DataView(saved.buffer, saved.byteOffset, saved.byteLength);
  if (saved.length < STREAM_HEADER + 1 || magic.getUint32(0) !== 0x5145564d || magic.getUint32(4) !== 3)
    throw new VmmError("Protocol", "xen-save-devices-state wrote no QEMU migration stream");
  const name = new TextEncoder().encode(MACHINE);
  const desc = new TextEncoder().encode("{}");
  const out = new Uint8Array(saved.length + 5 + name.length + 5 + desc.length);
  const v = new DataView(out.buffer);
  out.set(saved.subarray(0, STREAM_HEADER));
  let at = STREAM_HEADER;
  out[at++] = QEMU_VM_CONFIGURATION;
  v.setUint32(at, name.length);
  out.set(name, at + 4);
  at += 4 + name.length;
  out.set(saved.subarray(STREAM_HEADER), at);
  at += saved.length - STREAM_HEADER;
  out[at++] = QEMU_VM_VMDESCRIPTION;
  v.setUint32(at, desc.length);
  out.set(desc, at + 4);
  return out;
}

/** QEMU's part of the adoption record: how it was launched (QMP socket, RAM file, spec). */
interface QemuAdoptRecord {
  launch: QemuLaunch;
  ownsRam: boolean;
  /** Its memory became a snapshot's: it may only be stopped. */
  snapshotted?: boolean;
}
const ADOPT_QMP_TIMEOUT_MS = 5000;

function checkSpec(spec: VmSpec): void {
  if (!/^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$/.test(spec.id)) throw new VmmError("BadSpec", `bad VM id ${JSON.stringify(spec.id)}`);
  for (const f of [spec.kernel, spec.initrd, ...spec.drives.map((d) => d.path)])
    if (f !== undefined && !existsSync(f)) throw new VmmError("BadSpec", `${f} does not exist`);
}
