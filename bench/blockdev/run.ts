// blockd benchmarks: fio against our device (FUSE file + loop with direct I/O here; ublk where
// present) vs a loop device on a raw image file, measured in the same run. Prints IOPS, MB/s
// and CPU time per I/O (fio plus blockd, from /proc). Each row alternates the two devices over
// --rounds rounds (baseline first in odd rounds, ours first in even ones) and prints the median
// of the per-round ratios with their range: this machine's disk drifts by up to 2× within a minute.
//   bun bench/blockdev/run.ts [--size MiB] [--seconds S per run] [--rounds N]
import { mkdirSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { BlockdClient } from "../../src/blockdev/client.ts";
import { loopAttach, loopDetach } from "../../ffi/loop.ts";

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

function cpuTicks(pid: number): number {
  const f = readFileSync(`/proc/${pid}/stat`, "utf8").split(") ")[1]!.split(" ");
  return Number(f[11]) + Number(f[12]); // utime + stime
}

interface Fio {
  iops: number;
  mbps: number;
  ios: number;
  cpuSec: number;
}

/** One fio run: time-based, or (once) a single pass over the device. */
function fio(dev: string, rw: string, bs: string, qd: number, pid?: number, once = false): Fio {
  const before = pid ? cpuTicks(pid) : 0;
  const r = Bun.spawnSync(
    ["fio", "--name=b", `--filename=${dev}`, `--rw=${rw}`, `--bs=${bs}`, `--iodepth=${qd}`, "--ioengine=io_uring", "--direct=1",
      ...(once ? [] : [`--runtime=${SECONDS}`, "--time_based"]), `--size=${SIZE}`, "--output-format=json"],
    { stdout: "pipe", stderr: "pipe" },
  );
  if (r.exitCode !== 0) throw new Error(`fio: ${r.stderr.toString()}`);
  const j = JSON.parse(r.stdout.toString()).jobs[0];
  const side = rw.includes("write") ? j.write : j.read;
  const serverCpu = pid ? (cpuTicks(pid) - before) / CLK : 0;
  const fioCpu = ((j.usr_cpu + j.sys_cpu) / 100) * (j.job_runtime / 1000);
  return { iops: side.iops, mbps: side.bw_bytes / 1e6, ios: side.total_ios, cpuSec: serverCpu + fioCpu };
}

const client = await BlockdClient.ensure(join(dir, "state"));
const pid = Number(readFileSync(join(dir, "state", "blockd.pid"), "utf8"));
const ours = await client.call("create", { upperDir: join(dir, "up"), size: SIZE, loop: true });
const rawPath = join(dir, "raw.img");
writeFileSync(rawPath, "");
const { truncateSync } = await import("node:fs");
truncateSync(rawPath, SIZE);
const base = loopAttach(rawPath);
console.log(`# blockdev bench: ${SIZE >> 20} MiB, ${SECONDS}s per run, median of ${ROUNDS} rounds; ours = ${ours.loop} on FUSE file ${ours.path}; baseline = ${base.path} on ${rawPath} (dio ${base.directIo})`);
try {
  // The first pass fills both (so reads hit mapped data rather than holes): every write
  // allocates, and ours appends to the upper's log. Later writes rewrite blocks the upper owns.
  const line = (name: string, o: Fio, b: Fio, ratio: number, target?: number, spread = "") =>
    console.log(
      `${name.padEnd(28)} ours ${o.iops.toFixed(0).padStart(7)} IOPS ${o.mbps.toFixed(0).padStart(6)} MB/s ${((o.cpuSec / o.ios) * 1e6).toFixed(1).padStart(6)} µs CPU/IO | ` +
        `loop-on-raw ${b.iops.toFixed(0).padStart(7)} IOPS ${b.mbps.toFixed(0).padStart(6)} MB/s ${((b.cpuSec / b.ios) * 1e6).toFixed(1).padStart(6)} µs CPU/IO | ratio ${ratio.toFixed(2)}×${spread}` +
        (target ? ` (target ≥ ${target}×${ratio >= target ? "" : "  MISSED"})` : ""),
    );
  {
    const o = fio(ours.loop, "write", "1M", 8, pid, true);
    const b = fio(base.path, "write", "1M", 8, undefined, true);
    line("1 MiB first write (fill)", o, b, o.mbps / b.mbps);
  }
  const rows: [string, string, string, number, number?][] = [
    ["4 KiB random read QD32", "randread", "4k", 32, 0.7],
    ["1 MiB sequential read", "read", "1M", 8, 0.9],
    ["1 MiB sequential write", "write", "1M", 8, 0.9],
    ["4 KiB random write QD32", "randwrite", "4k", 32],
  ];
  for (const [name, rw, bs, qd, target] of rows) {
    const runs: { o: Fio; b: Fio; ratio: number }[] = [];
    for (let r = 0; r < ROUNDS; r++) {
      let b: Fio, o: Fio;
      if (r % 2 === 0) {
        b = fio(base.path, rw, bs, qd);
        o = fio(ours.loop, rw, bs, qd, pid);
      } else {
        o = fio(ours.loop, rw, bs, qd, pid);
        b = fio(base.path, rw, bs, qd);
      }
      runs.push({ o, b, ratio: bs === "4k" ? o.iops / b.iops : o.mbps / b.mbps });
    }
    runs.sort((x, y) => x.ratio - y.ratio);
    const mid = runs[Math.floor(runs.length / 2)]!;
    const spread = runs.length > 1 ? ` [${runs[0]!.ratio.toFixed(2)}–${runs[runs.length - 1]!.ratio.toFixed(2)}]` : "";
    line(name, mid.o, mid.b, mid.ratio, target, spread);
  }
} finally {
  loopDetach(base.path);
  await client.call("delete", { id: ours.id });
  await client.call("shutdown");
  await Bun.sleep(300);
  rmSync(dir, { recursive: true, force: true });
}
