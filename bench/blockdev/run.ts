// blockd benchmarks: fio against our device (FUSE file + loop with direct I/O here; ublk where
// present) vs a loop device on a raw image file (the raw file itself for the rows on our FUSE
// file), measured in the same run. Prints IOPS, MB/s and CPU time per I/O, and both as ratios.
// Each row alternates the two devices over --rounds rounds (baseline first in even rounds, ours
// first in odd ones) and prints the round with the median throughput ratio, with the range: this
// machine's disk drifts by up to 2× within a minute.
//
// Reads compare the same cache state on both sides. "cold": nothing of the device's data is in
// the page cache: ours has its layer files dropped (fdatasync + DONTNEED) before each run, which is
// one pass over the device, and the baseline is the loop device with direct I/O (a loop without it
// serves its queue one request at a time from a kworker: QD32 reads would reach the disk at QD1).
// "warm": the data is in the page cache on both sides: ours has its layer files read whole first,
// and the baseline is a second loop device without direct I/O, on the raw file read whole first.
// Rows "on the FUSE file" take the loop hop out of both sides: fio on our FUSE file (O_DIRECT, as
// QEMU and Firecracker open it; FOPEN_DIRECT_IO sends every read to blockd whatever the flag)
// against fio on the raw file itself, buffered (O_DIRECT there would read the disk, not the warm
// pages), both with --invalidate=0 so fio drops no cached pages first.
// Writes go to the loop device with direct I/O, as ours do from 64 KiB (docs/storage.md).
//
// CPU per I/O counts fio, blockd (ours only) and every kworker on the host: the loop devices do
// their I/O in kworkers (a buffered loop copies 1 MiB reads there), so leaving them out would hide
// most of the baseline's cost. Other load on the host lands in the kworker share too.
//
// Rows marked "ring" are a second blockd in ring mode (AENV_FUSE_URING=1: FUSE over io_uring, see
// docs/blockd.md), its own device filled the same way; they are skipped where the kernel has no
// FUSE ring (CONFIG_FUSE_IO_URING).
//   bun bench/blockdev/run.ts [--size MiB] [--seconds S per run] [--rounds N]
import { existsSync, mkdirSync, readdirSync, readFileSync, rmSync, truncateSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { BlockdClient } from "../../src/blockdev/client.ts";
import { loopAttach, loopDetach } from "../../ffi/loop.ts";
import { posixFadvise, POSIX_FADV_DONTNEED } from "../../ffi/libc.ts";
import { LocalFile } from "../../src/storage/local_file.ts";
import { WRITABLE_DATA, WRITABLE_INDEX } from "../../src/storage/lsmt/writable_layer.ts";
import { FUSE_ENABLE_URING_PARAM } from "../../ffi/fuse.ts";

const arg = (n: string, d: number) => {
  const i = process.argv.indexOf(`--${n}`);
  return i > 0 ? Number(process.argv[i + 1]) : d;
};
const SIZE = arg("size", 512) << 20;
const SECONDS = arg("seconds", 3);
const ROUNDS = arg("rounds", 3);
const dir = `/var/tmp/aenv-bench-blockdev-${process.pid}`;
mkdirSync(join(dir, "state"), { recursive: true });
const CLK = 100; // USER_HZ

/** utime + stime of a process (all its threads), in ticks. */
function cpuTicks(pid: number): number {
  const f = readFileSync(`/proc/${pid}/stat`, "utf8").split(") ")[1]!.split(" ");
  return Number(f[11]) + Number(f[12]);
}

/** utime + stime of every kworker thread now, by pid. */
function kworkerTicks(): Map<number, number> {
  const m = new Map<number, number>();
  for (const d of readdirSync("/proc")) {
    if (d.charCodeAt(0) > 57) continue; // not a pid
    try {
      const s = readFileSync(`/proc/${d}/stat`, "utf8");
      if (!s.startsWith("kworker", s.indexOf("(") + 1)) continue;
      const f = s.slice(s.lastIndexOf(") ") + 2).split(" ");
      m.set(Number(d), Number(f[11]) + Number(f[12]));
    } catch {} // exited meanwhile
  }
  return m;
}

function kworkerDelta(before: Map<number, number>): number {
  let t = 0;
  for (const [pid, ticks] of kworkerTicks()) t += ticks - (before.get(pid) ?? 0);
  return t / CLK;
}

interface Fio {
  iops: number;
  mbps: number;
  ios: number;
  /** CPU seconds: all, and its parts. */
  cpuSec: number;
  fioCpu: number;
  blockdCpu: number;
  kworkerCpu: number;
}

/** How fio opens its target: O_DIRECT or buffered, and whether it drops the target's cached pages first (fio's default). */
interface FioOpen {
  direct: boolean;
  invalidate: boolean;
}
const BLOCK_DEVICE: FioOpen = { direct: true, invalidate: true };

/** One fio run: time-based, or (once) a single pass over the device. */
function fio(dev: string, rw: string, bs: string, qd: number, pid?: number, once = false, how: FioOpen = BLOCK_DEVICE): Fio {
  const before = pid ? cpuTicks(pid) : 0;
  const kw = kworkerTicks();
  const r = Bun.spawnSync(
    ["fio", "--name=b", `--filename=${dev}`, `--rw=${rw}`, `--bs=${bs}`, `--iodepth=${qd}`, "--ioengine=io_uring", `--direct=${how.direct ? 1 : 0}`, `--invalidate=${how.invalidate ? 1 : 0}`,
      ...(once ? [] : [`--runtime=${SECONDS}`, "--time_based"]), `--size=${SIZE}`, "--output-format=json"],
    { stdout: "pipe", stderr: "pipe" },
  );
  if (r.exitCode !== 0) throw new Error(`fio: ${r.stderr.toString()}`);
  const kworkers = kworkerDelta(kw);
  const j = JSON.parse(r.stdout.toString()).jobs[0];
  const side = rw.includes("write") ? j.write : j.read;
  const serverCpu = pid ? (cpuTicks(pid) - before) / CLK : 0;
  const fioCpu = ((j.usr_cpu + j.sys_cpu) / 100) * (j.job_runtime / 1000);
  return {
    iops: side.iops,
    mbps: side.bw_bytes / 1e6,
    ios: side.total_ios,
    cpuSec: serverCpu + fioCpu + kworkers,
    fioCpu,
    blockdCpu: serverCpu,
    kworkerCpu: kworkers,
  };
}

/** Write back, then drop a file's pages from the page cache. */
async function dropCache(path: string): Promise<void> {
  const f = LocalFile.open(path, {});
  try {
    await f.fdatasync(); // dirty pages survive DONTNEED
    posixFadvise(f.fd, 0, 0, POSIX_FADV_DONTNEED, path);
  } finally {
    await f.close();
  }
}

/** Read a file whole, so its pages are in the page cache. */
async function warmCache(path: string): Promise<void> {
  const f = LocalFile.open(path, {});
  const buf = new Uint8Array(1 << 20);
  try {
    for (let pos = 0; pos < f.size(); pos += buf.length) await f.pread(buf, pos);
  } finally {
    await f.close();
  }
}

/** A blockd of its own (ring mode or not) with one device over a loop. */
async function blockdWithDevice(name: string, ring: boolean) {
  const state = join(dir, name, "state");
  mkdirSync(state, { recursive: true });
  process.env.AENV_FUSE_URING = ring ? "1" : "0";
  const client = await BlockdClient.ensure(state).finally(() => delete process.env.AENV_FUSE_URING);
  const upperDir = join(dir, name, "up");
  return {
    client,
    pid: Number(readFileSync(join(state, "blockd.pid"), "utf8")),
    dev: await client.call("create", { upperDir, size: SIZE, loop: true }),
    files: [join(upperDir, WRITABLE_DATA), join(upperDir, WRITABLE_INDEX)],
  };
}
const main = await blockdWithDevice("rw", false);
const { client, pid } = main;
const ours = main.dev;
let ring = existsSync(FUSE_ENABLE_URING_PARAM) ? await blockdWithDevice("ring", true) : undefined;
const rawPath = join(dir, "raw.img");
writeFileSync(rawPath, "");
truncateSync(rawPath, SIZE);
const base = loopAttach(rawPath);
const baseBuffered = loopAttach(rawPath, { directIo: false });
console.log(
  `# blockdev bench: ${SIZE >> 20} MiB, ${SECONDS}s per timed run, median of ${ROUNDS} rounds; ours = ${ours.loop} on FUSE file ${ours.path}; ` +
    `baseline = ${base.path} (dio ${base.directIo}: writes, cold reads) and ${baseBuffered.path} (buffered: warm reads) on ${rawPath}, ` +
    `and for the FUSE file rows ${rawPath} itself (fio buffered)` +
    (ring ? `; ring mode = ${ring.dev.loop} on ${ring.dev.path}` : `; no ring mode rows (${FUSE_ENABLE_URING_PARAM} is missing)`),
);
console.log("# CPU/IO = fio + blockd (ours) + host kworkers; ratios are ours / baseline");
try {
  const us = (sec: number, f: Fio) => ((sec / f.ios) * 1e6).toFixed(1);
  const line = (name: string, o: Fio, b: Fio, ratio: number, target?: number, spread = "", baseName = "loop-on-raw") => {
    console.log(
      `${name.padEnd(30)} ours ${o.iops.toFixed(0).padStart(7)} IOPS ${o.mbps.toFixed(0).padStart(6)} MB/s ${((o.cpuSec / o.ios) * 1e6).toFixed(1).padStart(6)} µs CPU/IO | ` +
        `${baseName} ${b.iops.toFixed(0).padStart(7)} IOPS ${b.mbps.toFixed(0).padStart(6)} MB/s ${((b.cpuSec / b.ios) * 1e6).toFixed(1).padStart(6)} µs CPU/IO | ` +
        `ratio ${ratio.toFixed(2)}×${spread} CPU/IO ${(o.cpuSec / o.ios / (b.cpuSec / b.ios)).toFixed(2)}×` +
        (target ? ` (target ≥ ${target}×${ratio >= target ? "" : "  MISSED"})` : ""),
    );
    console.log(
      `${"".padEnd(30)} µs CPU/IO: ours fio ${us(o.fioCpu, o)} + blockd ${us(o.blockdCpu, o)} + kworkers ${us(o.kworkerCpu, o)} | ` +
        `${baseName} fio ${us(b.fioCpu, b)} + kworkers ${us(b.kworkerCpu, b)}`,
    );
  };
  // The first pass fills both (so reads hit mapped data rather than holes): every write
  // allocates, and ours appends to the upper's log. Later writes rewrite blocks the upper owns.
  {
    const o = fio(ours.loop, "write", "1M", 8, pid, true);
    const b = fio(base.path, "write", "1M", 8, undefined, true);
    line("1 MiB first write (fill)", o, b, o.mbps / b.mbps);
    if (ring) {
      fio(ring.dev.loop, "write", "1M", 8, ring.pid, true);
      if (!((await ring.client.call("stats", { id: ring.dev.id })).overRing > 0)) {
        console.log(`# ring mode did not start (its blockd.log says why): no ring mode rows`);
        await ring.client.call("delete", { id: ring.dev.id });
        await ring.client.call("shutdown");
        ring = undefined;
      }
    }
  }
  type Cache = "cold" | "warm" | "";
  // The "FUSE file" rows are where the loop hop goes: fio on our FUSE file itself, as QEMU and
  // Firecracker open it, against fio on the raw file itself (see the top of this file).
  const rows: [string, string, string, number, Cache, number?, ("file" | "ring" | "ring-file")?][] = [
    ["4 KiB random read QD32, cold", "randread", "4k", 32, "cold"],
    ["1 MiB sequential read, cold", "read", "1M", 8, "cold"],
    ["4 KiB random read QD32, warm", "randread", "4k", 32, "warm", 0.7],
    ["  same, ours on the FUSE file", "randread", "4k", 32, "warm", undefined, "file"],
    ["  same, ring mode", "randread", "4k", 32, "warm", 0.7, "ring"],
    ["  same, ring mode, FUSE file", "randread", "4k", 32, "warm", undefined, "ring-file"],
    ["1 MiB sequential read, warm", "read", "1M", 8, "warm", 0.9],
    ["1 MiB sequential write", "write", "1M", 8, "", 0.9],
    ["  same, ring mode", "write", "1M", 8, "", 0.9, "ring"],
    ["4 KiB random write QD32", "randwrite", "4k", 32, ""],
    ["  same, ring mode", "randwrite", "4k", 32, "", undefined, "ring"],
  ];
  for (const [name, rw, bs, qd, cache, target, on] of rows) {
    const side = on?.startsWith("ring") ? ring : main;
    if (!side) continue; // no FUSE ring in this kernel
    const onFile = on?.endsWith("file") ?? false;
    if (onFile && cache !== "warm") throw new Error(`${name}: the FUSE file rows have a baseline for warm reads only`);
    const ourDev = onFile ? side.dev.path : side.dev.loop;
    const baseDev = onFile ? rawPath : cache === "warm" ? baseBuffered.path : base.path;
    const ourOpen: FioOpen = onFile ? { direct: true, invalidate: false } : BLOCK_DEVICE;
    const baseOpen: FioOpen = onFile ? { direct: false, invalidate: false } : BLOCK_DEVICE;
    const run = async (which: "ours" | "base"): Promise<Fio> => {
      const files = which === "ours" ? side.files : [rawPath];
      for (const f of files) await (cache === "cold" ? dropCache(f) : cache === "warm" ? warmCache(f) : Promise.resolve());
      return which === "ours" ? fio(ourDev, rw, bs, qd, side.pid, cache === "cold", ourOpen) : fio(baseDev, rw, bs, qd, undefined, cache === "cold", baseOpen);
    };
    const runs: { o: Fio; b: Fio; ratio: number }[] = [];
    for (let r = 0; r < ROUNDS; r++) {
      let b: Fio, o: Fio;
      if (r % 2 === 0) {
        b = await run("base");
        o = await run("ours");
      } else {
        o = await run("ours");
        b = await run("base");
      }
      runs.push({ o, b, ratio: bs === "4k" ? o.iops / b.iops : o.mbps / b.mbps });
    }
    runs.sort((x, y) => x.ratio - y.ratio);
    const mid = runs[Math.floor(runs.length / 2)]!;
    const spread = runs.length > 1 ? ` [${runs[0]!.ratio.toFixed(2)}–${runs[runs.length - 1]!.ratio.toFixed(2)}]` : "";
    line(name, mid.o, mid.b, mid.ratio, target, spread, onFile ? "raw-file" : "loop-on-raw");
  }
} finally {
  loopDetach(baseBuffered.path);
  loopDetach(base.path);
  if (ring) {
    await ring.client.call("delete", { id: ring.dev.id });
    await ring.client.call("shutdown");
  }
  await client.call("delete", { id: ours.id });
  await client.call("shutdown");
  await Bun.sleep(300);
  rmSync(dir, { recursive: true, force: true });
}
