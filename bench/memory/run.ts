// Memory as layers, measured under real QEMU VMs (docs/vmm.md, "Memory layers"), each row against
// a baseline taken in the same run:
// - pause (VMM stop + dirty-page scan + device state, then the memory layer written by blockd) vs
//   MiB dirtied (1, 64, 512 in a 1 GiB guest), against a full snapshot of the same VM (QEMU's
//   migration stream with its RAM in it, what a snapshot cost before memory layers): --pairs
//   fresh restores per size, each measured both ways, the full snapshot first in even pairs and
//   ours first in odd ones, each started on a settled disk (syncfs first: nothing an earlier step
//   wrote is still being written back); medians with their range, and beside each the CPU time it
//   took (QEMU, blockd and this process together: /proc/<pid>/stat, 10 ms ticks). Ours ends with
//   the layer's fdatasync; the full snapshot's time is QEMU's, and its own fdatasync is shown
//   beside it (fullSyncMs) with the ratio to that durable total (speedupDurable);
// - resume (restore until the guest answers) from stacks of 1, 4 and 16 memory layers;
// - host memory of 16 VMs restored from one snapshot (one memory device, as the node shares it)
//   vs 16 cold boots, each phase on a blockd of its own: the VMMs' PSS (which counts the mapped
//   device pages and tmpfs RAM files in shares), plus that blockd's PSS growth over the phase,
//   plus the page cache of the layer files and uppers the phase reads (fincore; dropped before it
//   starts);
// - an idle restored VM's private memory before and after free page reporting returns what a
//   workload freed.
//   npx bun bench/memory/run.ts [--guest-mib N] [--vms N] [--pairs N] [--dirty-mib 1,64,512]
//     [--phases pause,resume,host,reporting] [--json]
import { closeSync, mkdirSync, mkdtempSync, openSync, readdirSync, readFileSync, rmSync, statSync } from "node:fs";
import { join } from "node:path";
import { fdatasync, posixFadvise, POSIX_FADV_DONTNEED } from "../../ffi/libc.ts";
import { guestCmdline } from "../../src/template/artifacts.ts";
import { BlockdClient } from "../../src/blockdev/client.ts";
import { QemuDriver } from "../../src/vmm/qemu.ts";
import { QmpFdSession } from "../../src/vmm/qmp.ts";
import type { SnapshotInfo, Vmm } from "../../src/vmm/types.ts";
import { anonymousBytes, freePort, guestFixture, guestRun, waitHttp } from "../../test/vmm/harness.ts";

const argv = process.argv.slice(2);
const flag = (name: string, dflt: number) => {
  const i = argv.indexOf(name);
  return i >= 0 ? Number(argv[i + 1]) : dflt;
};
const GUEST_MIB = flag("--guest-mib", 1024);
const VMS = flag("--vms", 16);
const PAIRS = flag("--pairs", 5);
const DIRTY_MIB = argv.includes("--dirty-mib") ? argv[argv.indexOf("--dirty-mib") + 1]!.split(",").map(Number) : [1, 64, 512];
const PHASES = new Set(argv.includes("--phases") ? argv[argv.indexOf("--phases") + 1]!.split(",") : ["pause", "resume", "host", "reporting"]);
const STACKS = [1, 4, 16];
const GUEST_PORT = 8080;
const MiB = 1 << 20;
const r1 = (x: number) => Math.round(x * 10) / 10;
const r2 = (x: number) => Math.round(x * 100) / 100;
/** Median and range of samples, rounded by `round` (to 0.1 unless told). */
function spread(xs: number[], round = r1): { median: number; min: number; max: number } {
  const s = [...xs].sort((a, b) => a - b);
  const mid = s.length >> 1;
  return { median: round(s.length % 2 ? s[mid]! : (s[mid - 1]! + s[mid]!) / 2), min: round(s[0]!), max: round(s.at(-1)!) };
}
const results: Record<string, unknown> = {};

const TICK_MS = 1000 / Number(Bun.spawnSync(["getconf", "CLK_TCK"]).stdout.toString().trim());
/** CPU time of process `pid` so far, ms: utime + stime of all its threads, ended ones too (/proc/<pid>/stat fields 14, 15). */
function cpuMs(pid: number): number {
  const stat = readFileSync(`/proc/${pid}/stat`, "utf8");
  const f = stat.slice(stat.lastIndexOf(")") + 2).split(" ");
  return (Number(f[11]) + Number(f[12])) * TICK_MS;
}
/** CPU time so far of `pids` and of this process together, ms. */
function cpuOf(pids: number[]): number {
  const self = process.cpuUsage();
  return pids.reduce((a, pid) => a + cpuMs(pid), (self.user + self.system) / 1000);
}
/** Writes back everything dirty on the bench's filesystem (syncfs), so the next timed step starts on a settled disk. */
async function settleDisk(): Promise<void> {
  const p = Bun.spawn(["sync", "-f", work], { stdio: ["ignore", "ignore", "inherit"] });
  if ((await p.exited) !== 0) throw new Error("sync -f failed");
}

const fx = await guestFixture();
mkdirSync("/var/tmp/aenv-bench", { recursive: true });
const work = mkdtempSync("/var/tmp/aenv-bench/memory-");
const runRoot = mkdtempSync("/dev/shm/aenv-bench-memory-");
const driver = new QemuDriver();
const upperDirs: string[] = [];
const live = new Set<Vmm>();
let n = 0;

/** A blockd and the devices made on it, the tools disk first. */
interface Blockd {
  client: BlockdClient;
  pid: number;
  tools: { id: string; path: string };
  devices: string[];
}
const blockds: Blockd[] = [];
async function startBlockd(name: string): Promise<Blockd> {
  const state = join(work, name);
  mkdirSync(state, { recursive: true });
  const client = await BlockdClient.ensure(state, {});
  const tools = await client.call<{ id: string; path: string }>("createReadOnly", { lowers: [fx.toolsLayer] });
  const b = { client, pid: Number(readFileSync(join(state, "blockd.pid"), "utf8").trim()), tools, devices: [tools.id] };
  blockds.push(b);
  return b;
}
async function stopBlockd(b: Blockd) {
  for (const id of b.devices.splice(0)) await b.client.call("delete", { id }).catch(() => {});
  await b.client.call("shutdown", {}).catch(() => {});
  blockds.splice(blockds.indexOf(b), 1);
}
const main = await startBlockd("blockd");
/** Where VMs get their devices: the bench's blockd, or a host-memory phase's own (hostMemory). */
let blockd = main;

async function drives(name: string) {
  const upperDir = join(work, "uppers", name);
  const d = await blockd.client.call("create", { lowers: [fx.rootfsLayer], upperDir, size: 64 * MiB });
  blockd.devices.push(d.id);
  upperDirs.push(upperDir);
  return [{ path: blockd.tools.path, readOnly: true }, { path: d.path as string }];
}

/** Deletes the devices made on the bench's blockd since `mark` (a length of its `devices`). */
async function deleteDevicesFrom(mark: number) {
  for (const id of main.devices.splice(mark)) await main.client.call("delete", { id });
}
const net = (port: number) => ({ user: { forwards: [{ hostPort: port, guestPort: GUEST_PORT }] } });
async function cold(memMiB: number) {
  const name = `c${n++}`;
  const port = freePort();
  const vm = await driver.boot({
    id: name, runDir: join(runRoot, name), kernel: fx.kernel.vmlinux, initrd: fx.kernel.initrd,
    cmdline: guestCmdline({ httpdPort: GUEST_PORT, httpdRoot: "/srv/www" }), vcpus: 1, memMiB, drives: await drives(name), net: net(port), balloon: true,
  });
  live.add(vm);
  await waitHttp(`http://127.0.0.1:${port}/health`, 120_000);
  return { vm, port };
}

/** A VM restored from `snap` on a memory device over `layers`, its own unless `shared` is given. */
async function restore(snap: SnapshotInfo, layers: string[], shared?: { id: string; path: string }) {
  const name = `r${n++}`;
  const port = freePort();
  const mem = shared ?? (await blockd.client.call<{ id: string; path: string }>("createReadOnly", { lowers: layers }));
  if (!shared) blockd.devices.push(mem.id);
  const t0 = performance.now();
  const vm = await driver.restore(snap, { id: name, runDir: join(runRoot, name), drives: await drives(name), net: net(port), memImage: mem.path });
  live.add(vm);
  await waitHttp(`http://127.0.0.1:${port}/health`, 120_000);
  return { vm, port, mem: mem.path as string, readyMs: performance.now() - t0 };
}

async function stop(vm: Vmm) {
  await vm.stop();
  live.delete(vm);
}

/** Pause into a memory layer: the VMM's part (stop, dirty scan, device state) and blockd's (the layer); the VM is left paused. */
async function pause(vm: Vmm, below: string[]) {
  const dir = join(work, `p${n++}`);
  await settleDisk();
  const c0 = cpuOf([vm.pid, main.pid]);
  const t0 = performance.now();
  const snap = await vm.snapshot(dir);
  const t1 = performance.now();
  const d = snap.delta!;
  const out = join(dir, "mem.layer");
  await main.client.call("memoryLayer", { out, size: d.size, from: { pid: d.pid, address: d.address, pagesFile: d.pagesFile } });
  const t2 = performance.now();
  const cpu = cpuOf([vm.pid, main.pid]) - c0;
  return { snap, layers: [...below, out], vmmMs: t1 - t0, layerMs: t2 - t1, cpuMs: cpu, dirtyMiB: (d.pages * 4096) / MiB, layerMiB: statSync(out).size / MiB };
}

/**
 * The same moment as a full snapshot: QEMU's stream with the RAM in it (a restored VM's RAM is
 * private), into a file handed to QEMU as a descriptor (`getfd`, `fd:` migration): under -runas it
 * cannot open ours, and under -sandbox spawn=deny an `exec:` migration kills it.
 */
async function fullSnapshot(vm: Vmm): Promise<{ ms: number; syncMs: number; cpuMs: number; mib: number; path: string }> {
  const { fdMonitor } = (vm as unknown as { launch: { fdMonitor: string } }).launch;
  const path = join(work, `full${n++}`);
  const file = openSync(path, "w", 0o600);
  const session = await QmpFdSession.open(fdMonitor);
  try {
    await settleDisk();
    const c0 = cpuOf([vm.pid, main.pid]);
    const t0 = performance.now();
    await session.execute("getfd", { fdname: "full" }, file);
    await session.execute("migrate-set-parameters", { "max-bandwidth": 100 * 1024 * MiB });
    await session.execute("migrate", { uri: "fd:full" });
    for (;;) {
      const m = await session.execute<{ status: string; "error-desc"?: string }>("query-migrate");
      if (m.status === "completed") break;
      if (m.status === "failed") throw new Error(`full snapshot failed: ${m["error-desc"] ?? "no reason given"}`);
      await Bun.sleep(2);
    }
    const ms = performance.now() - t0;
    const cpu = cpuOf([vm.pid, main.pid]) - c0;
    const s0 = performance.now();
    await fdatasync(file);
    return { ms, syncMs: performance.now() - s0, cpuMs: cpu, mib: statSync(path).size / MiB, path };
  } finally {
    session.close();
    closeSync(file);
  }
}

const pss = (pid: number) => Number(/\nPss:\s+(\d+) kB/.exec(readFileSync(`/proc/${pid}/smaps_rollup`, "utf8"))![1]) / 1024;

/** The files of the uppers made since `mark` (a length of `upperDirs`). */
const upperFilesFrom = (mark: number) => upperDirs.slice(mark).flatMap((d) => readdirSync(d).map((f) => join(d, f)).filter((f) => statSync(f).isFile()));

/** MiB of `files` in the page cache (fincore, util-linux). */
function cachedMiB(files: string[]): number {
  const r = Bun.spawnSync(["fincore", "--bytes", "--noheadings", "--output", "RES", ...files], { stdout: "pipe", stderr: "pipe" });
  if (r.exitCode !== 0) throw new Error(`fincore: ${r.stderr.toString()}`);
  return r.stdout.toString().trim().split("\n").reduce((a, l) => a + Number(l), 0) / MiB;
}

/** Drops `files`' pages from the page cache (read-only here: nothing dirty to write first). */
function dropCache(files: string[]): void {
  for (const f of files) {
    const fd = openSync(f, "r");
    try {
      posixFadvise(fd, 0, 0, POSIX_FADV_DONTNEED, f);
    } finally {
      closeSync(fd);
    }
  }
}

/**
 * Host memory of the VMs `start` brings up, once settled, on a blockd of the phase's own (so no
 * other phase's devices or freed heap are in its numbers): the VMs' PSS, that blockd's PSS growth
 * from when it held only the tools disk, and the page cache of `layers` (dropped first) and of the
 * phase's uppers. The VMs and that blockd are gone after.
 */
async function hostMemory(layers: string[], start: () => Promise<Vmm[]>) {
  blockd = await startBlockd(`blockd-${n++}`);
  try {
    const uppersMark = upperDirs.length;
    dropCache(layers);
    const blockd0 = pss(blockd.pid);
    const vms = await start();
    await Bun.sleep(2000);
    const vmmPssMiB = vms.reduce((a, vm) => a + pss(vm.pid), 0);
    const blockdPssMiB = pss(blockd.pid) - blockd0;
    const pageCacheMiB = cachedMiB([...layers, ...upperFilesFrom(uppersMark)]);
    for (const vm of vms) await stop(vm);
    return { vmmPssMiB: r1(vmmPssMiB), blockdPssMiB: r1(blockdPssMiB), pageCacheMiB: r1(pageCacheMiB), totalMiB: r1(vmmPssMiB + blockdPssMiB + pageCacheMiB) };
  } finally {
    await stopBlockd(blockd);
    blockd = main;
  }
}
try {
  // ---- the base: a cold boot's RAM file as one layer ---------------------------------------------
  const c = await cold(GUEST_MIB);
  const baseSnap = await c.vm.snapshot(join(work, "base"));
  await stop(c.vm);
  const base = join(work, "base.mem.layer");
  const t0 = performance.now();
  const b = await main.client.call("memoryLayer", { out: base, size: GUEST_MIB * MiB, from: { file: baseSnap.memPath } });
  results.base = { guestMiB: GUEST_MIB, layerMiB: r1(b.bytes / MiB), ms: r1(performance.now() - t0) };

  // ---- pause vs MiB dirtied -------------------------------------------------------------------------
  if (PHASES.has("pause")) {
    const pauses: Record<string, unknown>[] = [];
    for (const mib of DIRTY_MIB) {
      const pairs: { p: Awaited<ReturnType<typeof pause>>; full: Awaited<ReturnType<typeof fullSnapshot>> }[] = [];
      for (let i = 0; i < PAIRS; i++) {
        const mark = main.devices.length;
        const r = await restore(baseSnap, [base]);
        await guestRun(r.port, `dd if=/dev/urandom of=/dev/shm/dirty bs=1M count=${mib} 2>/dev/null`, 600_000);
        await r.vm.pause();
        // The full snapshot goes first in even pairs, ours in odd ones.
        let full = i % 2 === 0 ? await fullSnapshot(r.vm) : undefined;
        const p = await pause(r.vm, [base]);
        full ??= await fullSnapshot(r.vm);
        pairs.push({ p, full });
        await stop(r.vm);
        rmSync(p.snap.dir, { recursive: true, force: true });
        rmSync(full.path, { force: true });
        await deleteDevicesFrom(mark);
      }
      const ours = pairs.map(({ p }) => p.vmmMs + p.layerMs);
      pauses.push({
        dirtiedMiB: mib, pairs: PAIRS, dirtyMiB: spread(pairs.map(({ p }) => p.dirtyMiB)), layerMiB: spread(pairs.map(({ p }) => p.layerMiB)),
        vmmMs: spread(pairs.map(({ p }) => p.vmmMs)), layerMs: spread(pairs.map(({ p }) => p.layerMs)), pauseMs: spread(ours), pauseCpuMs: spread(pairs.map(({ p }) => p.cpuMs)),
        fullSnapshotMs: spread(pairs.map(({ full }) => full.ms)), fullCpuMs: spread(pairs.map(({ full }) => full.cpuMs)), fullSyncMs: spread(pairs.map(({ full }) => full.syncMs)),
        fullSnapshotMiB: spread(pairs.map(({ full }) => full.mib)),
        speedup: spread(pairs.map(({ full }, i) => full.ms / ours[i]!), r2), speedupDurable: spread(pairs.map(({ full }, i) => (full.ms + full.syncMs) / ours[i]!), r2),
        cpuRatio: spread(pairs.map(({ p, full }) => p.cpuMs / full.cpuMs), r2),
      });
    }
    results.pause = pauses;
  }

  // ---- resume from stacked layers -------------------------------------------------------------------
  if (PHASES.has("resume")) {
    let layers = [base];
    let snap = baseSnap;
    const stacks: Record<string, number> = {};
    const deepest = Math.max(...STACKS);
    for (let depth = 1; ; depth++) {
      const r = await restore(snap, layers);
      if (STACKS.includes(depth)) stacks[`${depth}`] = r1(r.readyMs);
      if (depth === deepest) {
        await stop(r.vm);
        break;
      }
      await guestRun(r.port, `dd if=/dev/urandom of=/dev/shm/l${depth} bs=1M count=1 2>/dev/null`);
      ({ layers, snap } = await pause(r.vm, layers));
      await stop(r.vm);
    }
    results.resumeMs = stacks;
  }

  // ---- 16 restores of one snapshot vs 16 cold boots ------------------------------------------------
  if (PHASES.has("host")) {
    const SMALL = 256;
    const sc = await cold(SMALL);
    const smallSnap = await sc.vm.snapshot(join(work, "small"));
    await stop(sc.vm);
    const smallBase = join(work, "small.mem.layer");
    await main.client.call("memoryLayer", { out: smallBase, size: SMALL * MiB, from: { file: smallSnap.memPath } });
    const disks = [fx.toolsLayer, fx.rootfsLayer];
    const restored = await hostMemory([...disks, smallBase], async () => {
      const mem = await blockd.client.call<{ id: string; path: string }>("createReadOnly", { lowers: [smallBase] });
      blockd.devices.push(mem.id);
      const vms: Vmm[] = [];
      for (let i = 0; i < VMS; i++) vms.push((await restore(smallSnap, [smallBase], mem)).vm);
      return vms;
    });
    const colds = await hostMemory(disks, async () => {
      const vms: Vmm[] = [];
      for (let i = 0; i < VMS; i++) vms.push((await cold(SMALL)).vm);
      return vms;
    });
    results.hostMemory = { vms: VMS, guestMiB: SMALL, restored, cold: colds, ratio: r2(restored.totalMiB / colds.totalMiB), vmmPssRatio: r2(restored.vmmPssMiB / colds.vmmPssMiB) };
  }

  // ---- free page reporting ---------------------------------------------------------------------------
  if (PHASES.has("reporting")) {
    const f = await restore(baseSnap, [base]);
    const idle = anonymousBytes(f.vm.pid, f.mem) / MiB;
    await guestRun(f.port, "dd if=/dev/urandom of=/dev/shm/big bs=1M count=256 2>/dev/null", 600_000);
    const busy = anonymousBytes(f.vm.pid, f.mem) / MiB;
    await guestRun(f.port, "rm /dev/shm/big");
    let after = busy;
    for (let i = 0; i < 60 && after > idle + 32; i++) {
      await Bun.sleep(500);
      after = anonymousBytes(f.vm.pid, f.mem) / MiB;
    }
    await stop(f.vm);
    results.freePageReporting = { idleMiB: r1(idle), afterWriteMiB: r1(busy), afterFreeMiB: r1(after) };
  }
} finally {
  for (const vm of live) await vm.stop().catch(() => {});
  for (const b of [...blockds]) await stopBlockd(b);
  rmSync(runRoot, { recursive: true, force: true });
  await Bun.sleep(1000);
  rmSync(work, { recursive: true, force: true });
}

if (argv.includes("--json")) console.log(JSON.stringify(results, null, 1));
else console.log(Bun.inspect(results, { depth: 6 }));
