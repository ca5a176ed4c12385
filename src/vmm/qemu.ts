// QEMU driver: `-M microvm,acpi=on` driven over QMP. Guest RAM is a memory-backend-file mapped
// shared, so a snapshot is a QMP migration with x-ignore-shared (device state only, ~70 KB) and the
// RAM file itself; a restore maps that file private (copy-on-write) and loads the device state.
// KVM when it is usable, TCG otherwise (docs/vmm.md).

import { accessSync, constants, existsSync, readFileSync } from "node:fs";
import { link, mkdir, rm, stat } from "node:fs/promises";
import { dirname, join, resolve } from "node:path";
import { QmpClient } from "./qmp.ts";
import { readAdoptRecord, writeAdoptRecord } from "./adopt.ts";
import {
  type BalloonInfo,
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
  /** Forced accelerator (the node's qemu_accel setting); otherwise KVM when probeKvm() says usable. */
  accel?: Accel;
  /** Guest TSC frequency for TCG (the host's by default); 0 leaves the kernel command line alone. */
  tscKhz?: number;
  /** How long QEMU may take to answer on QMP after it starts. */
  startTimeoutMs?: number;
  /** CPU niceness of the VMM process, its vCPU threads and its scheduler group (0..19; the node passes its vmm_nice setting). */
  nice?: number;
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
  ram: RamBacking;
  qmpSocket: string;
  consoleLog: string;
  pidFile: string;
  /** Start waiting for a migration stream (restore) instead of booting. */
  incoming?: boolean;
  tscKhz?: number;
}

const MiB = 1 << 20;

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
    "-accel", l.accel,
    "-cpu", l.accel === "kvm" ? "host" : "max",
    "-smp", String(spec.vcpus),
    "-m", `${spec.memMiB}M`,
    "-object", `memory-backend-file,id=ram0,size=${spec.memMiB}M,mem-path=${qemuOptValue(l.ram.path)},share=${l.ram.share ? "on" : "off"}`,
    "-kernel", qemuOptValue(spec.kernel),
  ];
  if (spec.initrd) args.push("-initrd", qemuOptValue(spec.initrd));
  args.push("-append", effectiveCmdline(spec.cmdline, l.accel, l.tscKhz));
  spec.drives.forEach((d, i) => {
    // Device order is guest order: drive 0 is /dev/vda. No O_DIRECT: blockd's FUSE files are direct already.
    args.push(
      "-drive", `id=d${i},file=${qemuOptValue(d.path)},format=raw,if=none,cache=writeback,aio=threads${d.readOnly ? ",readonly=on" : ""}`,
      "-device", `virtio-blk-device,drive=d${i}`,
    );
  });
  args.push(...netArgs(spec.net));
  // Free pages the guest reports go back to the host (2 MiB at a time, a few seconds after they are freed).
  if (spec.balloon) args.push("-device", "virtio-balloon-device,deflate-on-oom=on,free-page-reporting=on");
  args.push(
    "-serial", `file:${l.consoleLog}`,
    "-qmp", `unix:${l.qmpSocket},server=on,wait=off`,
    "-pidfile", l.pidFile,
  );
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

function shellQuote(s: string): string {
  return `'${s.replaceAll("'", `'\\''`)}'`;
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
  }

  get consoleLog(): string {
    return this.launch.consoleLog;
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
    // The 7.2 default of 128 MiB/s would throttle a stream that carries RAM.
    await this.qmp.execute("migrate-set-parameters", { "max-bandwidth": 100 * 1024 * MiB });
    await this.qmp.execute("migrate-set-capabilities", { capabilities: [{ capability: "x-ignore-shared", state: sharedRam }] });
    // QEMU 7.2 has no file: URI; exec: runs the command through /bin/sh.
    await this.qmp.execute("migrate", { uri: `exec:cat > ${shellQuote(statePath)}` });
    for (;;) {
      const m = await this.qmp.execute<{ status: string; "error-desc"?: string }>("query-migrate");
      if (m.status === "completed") break;
      if (m.status === "failed" || m.status === "cancelled") throw new VmmError("Protocol", `snapshot of ${this.id} ${m.status}: ${m["error-desc"] ?? ""}`);
      await Bun.sleep(2);
    }
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
        this._state = "snapshotted";
      }
    }
    const info: SnapshotInfo = {
      vmm: "qemu",
      dir,
      statePath,
      memPath,
      spec: this.spec,
      createdAt: new Date().toISOString(),
      extra: { ignoreShared: sharedRam, accel: this.launch.accel, tscKhz: this.launch.tscKhz },
    };
    await writeSnapshot(info);
    return info;
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
    const devices = join(dir, "devices.tmp");
    await this.qmp.execute("xen-save-devices-state", { filename: devices, live: false });
    await Bun.write(statePath, deviceOnlyStream(new Uint8Array(await Bun.file(devices).arrayBuffer())));
    await rm(devices, { force: true });
    // Not resumable: the pages are the caller's to take, and running on would change them.
    if (!opts.resumable) this._state = "snapshotted";
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

  private paths(runDir: string) {
    return {
      qmpSocket: join(runDir, "qmp.sock"),
      consoleLog: join(runDir, "console.log"),
      pidFile: join(runDir, "qemu.pid"),
      qemuLog: join(runDir, "qemu.log"),
    };
  }

  /** Spawn QEMU and connect to QMP; a QEMU that dies first is reported with its stderr. */
  private async start(launch: QemuLaunch, qemuLog: string): Promise<{ proc: ReturnType<typeof Bun.spawn>; qmp: QmpClient }> {
    const argv = netnsArgv(launch.spec.netnsPath, [this.binary, ...qemuArgs(launch)], this.opts.nice);
    await rm(launch.qmpSocket, { force: true });
    await Bun.write(join(dirname(qemuLog), "qemu.argv"), JSON.stringify(argv));
    const log = Bun.file(qemuLog);
    let proc: ReturnType<typeof Bun.spawn>;
    try {
      // Detached with its output in a file: a VM outlives the node process that started it.
      proc = Bun.spawn(argv, { stdin: "ignore", stdout: log, stderr: log, detached: true });
    } catch (e) {
      throw new VmmError("StartFailed", `cannot run ${this.binary}: ${(e as Error).message}`);
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
      return { proc, qmp };
    } catch (e) {
      await Bun.sleep(20); // let a dying QEMU finish writing its error
      throw await failure(exited || proc.exitCode !== null ? `exited with ${proc.exitCode}` : `QMP failed (${(e as Error).message})`);
    }
  }

  async boot(spec: VmSpec): Promise<Vmm> {
    spec = { ...spec, runDir: resolve(spec.runDir) };
    checkSpec(spec);
    await mkdir(spec.runDir, { recursive: true });
    const p = this.paths(spec.runDir);
    const ram = { path: resolve(spec.memFile ?? join(spec.runDir, "ram")), share: true };
    await mkdir(dirname(ram.path), { recursive: true });
    await rm(ram.path, { force: true }); // a fresh VM starts from zeroed memory
    const launch: QemuLaunch = { spec, accel: this.accel, ram, ...p, tscKhz: this.tscKhz };
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
    const state: VmState = st.status === "running" ? "running" : st.status === "postmigrate" ? "snapshotted" : "paused";
    return new QemuVm(rec.launch.spec, proc, qmp, rec.launch, rec.ownsRam, state);
  }

  async restore(snap: SnapshotInfo, r: RestoreSpec): Promise<Vmm> {
    if (snap.vmm !== "qemu") throw new VmmError("BadSpec", `a ${snap.vmm} snapshot cannot be restored by QEMU`);
    const old = snap.spec;
    if (r.drives.length !== old.drives.length || r.drives.some((d, i) => !!d.readOnly !== !!old.drives[i]!.readOnly))
      throw new VmmError("BadSpec", `restore needs ${old.drives.length} drives with the snapshot's read-only flags`);
    const kindOf = (n: NetSpec | undefined) => (!n ? "none" : "tap" in n ? "tap" : "user");
    // The netdev backend is part of the migration stream; a different kind fails to load.
    if (kindOf(r.net) !== kindOf(old.net)) throw new VmmError("BadSpec", `restore needs a ${kindOf(old.net)} network like the snapshot`);
    const spec: VmSpec = { ...old, id: r.id, runDir: resolve(r.runDir), drives: r.drives, net: r.net, memFile: r.memFile, netnsPath: r.netnsPath };
    await mkdir(spec.runDir, { recursive: true });
    const p = this.paths(spec.runDir);
    const ignoreShared = snap.extra?.ignoreShared === true;
    let ram: RamBacking;
    if (snap.memoryImage && !r.memImage) throw new VmmError("BadSpec", `snapshot ${snap.dir} keeps its memory in layers: restore needs memImage`);
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
      await rm(ram.path, { force: true });
    }
    // The accelerator and TSC must match the source: the stream holds CPU state in its terms.
    const accel = snapAccel ?? this.accel;
    const tscKhz = (snap.extra?.tscKhz as number | undefined) ?? this.tscKhz;
    const launch: QemuLaunch = { spec, accel, ram, ...p, incoming: true, tscKhz };
    const { proc, qmp } = await this.start(launch, p.qemuLog);
    await writeAdoptRecord<QemuAdoptRecord>(spec.runDir, proc.pid, { launch, ownsRam: ram.share });
    const vm = new QemuVm(spec, proc, qmp, launch, ram.share);
    try {
      await qmp.execute("migrate-set-capabilities", { capabilities: [{ capability: "x-ignore-shared", state: ignoreShared }] });
      await qmp.execute("migrate-incoming", { uri: `exec:cat ${shellQuote(snap.statePath)}` });
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
}
const ADOPT_QMP_TIMEOUT_MS = 5000;

function checkSpec(spec: VmSpec): void {
  if (!/^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$/.test(spec.id)) throw new VmmError("BadSpec", `bad VM id ${JSON.stringify(spec.id)}`);
  for (const f of [spec.kernel, spec.initrd, ...spec.drives.map((d) => d.path)])
    if (f !== undefined && !existsSync(f)) throw new VmmError("BadSpec", `${f} does not exist`);
}
