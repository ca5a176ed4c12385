// Storage benchmarks (issue: storage engine). Every figure is a ratio against a baseline measured
// in the same run on the same machine, so noisy shared hosts still give comparable numbers. The
// read and ZFile rows alternate the targets over --rounds rounds (forward in even rounds, backward
// in odd ones) and print the median of the per-round ratios with their range, and CPU time per op.
// Restack rows run --repeat times each (the first in a process includes compiling its code).
//   bun bench/storage/run.ts [--size MiB] [--seconds S per single figure] [--slice S per round] [--rounds N]
//     [--repeat N] [--only reads,write,zfile,restack]
import { mkdirSync, readFileSync, rmSync } from "node:fs";
import { join } from "node:path";
import { Image } from "../../src/storage/image.ts";
import { LocalFile } from "../../src/storage/local_file.ts";
import { WritableLayer } from "../../src/storage/lsmt/writable_layer.ts";
import { openLayerFile } from "../../src/storage/open_layer.ts";
import { ReadOnlyLayer } from "../../src/storage/lsmt/readonly_layer.ts";
import { ZFileReader, writeZFile } from "../../src/storage/zfile.ts";
import { zstdDecompressInto, zstdLibLoaded } from "../../ffi/zstd.ts";
import { MADV_HUGEPAGE, MAP_SHARED, PROT_READ, madvise, mmap, munmap, posixFadvise, POSIX_FADV_DONTNEED, POSIX_FADV_WILLNEED } from "../../ffi/libc.ts";

const arg = (name: string, dflt: number) => {
  const i = process.argv.indexOf(`--${name}`);
  return i > 0 ? Number(process.argv[i + 1]) : dflt;
};
const SIZE = arg("size", 256) << 20; // virtual disk and raw file size
const SECONDS = arg("seconds", 2);
const SLICE = arg("slice", 0.2); // short slices, many rounds: other load on the host hits both sides
const ROUNDS = arg("rounds", 25);
const REPEAT = arg("repeat", 3);
const onlyAt = process.argv.indexOf("--only");
const ONLY = new Set(onlyAt > 0 ? process.argv[onlyAt + 1]!.split(",") : ["reads", "write", "zfile", "restack"]);
const QD = 32;
const STACKS = [1, 8, 64];
const dir = join("/var/tmp", `aenv-bench-${process.pid}`);
mkdirSync(dir, { recursive: true });
process.on("exit", () => rmSync(dir, { recursive: true, force: true }));

let seed = 42;
const rnd = () => ((seed = (Math.imul(seed, 1103515245) + 12345) >>> 0) / 2 ** 32);

/** Run `one(i)` with QD in flight for `seconds`; returns ops/s and CPU µs (user + system) per op. */
async function measure(one: (i: number) => Promise<unknown>, seconds = SECONDS): Promise<{ rate: number; cpu: number }> {
  let ops = 0;
  const cpu0 = process.cpuUsage();
  const until = performance.now() + seconds * 1000;
  await Promise.all(
    Array.from({ length: QD }, async (_, lane) => {
      while (performance.now() < until) {
        await one(lane);
        ops++;
      }
    }),
  );
  const cpu = process.cpuUsage(cpu0);
  return { rate: ops / seconds, cpu: (cpu.user + cpu.system) / ops };
}

const fmt = (x: number) => (x >= 1e6 ? `${(x / 1e6).toFixed(2)}M` : x >= 1e3 ? `${(x / 1e3).toFixed(1)}k` : x.toFixed(1));
const line = (name: string, ours: number, base: number, unit: string, target?: number) =>
  console.log(
    `${name.padEnd(44)} ours ${fmt(ours).padStart(8)} ${unit}  baseline ${fmt(base).padStart(8)} ${unit}  ratio ${(ours / base).toFixed(2)}×` +
      (target ? `  (target ≥ ${target}×${ours / base >= target ? "" : "  MISSED"})` : ""),
  );

// --- fixture: a raw image and the same bytes as stacks of 1, 8 and 64 layers -------------------
console.log(`# storage bench: ${SIZE >> 20} MiB disk, QD${QD}; reads: median of ${ROUNDS} rounds of ${SLICE}s slices; others: ${SECONDS}s`);
const rawPath = join(dir, "raw.img");
const blocks = SIZE / 4096;
{
  // Real binaries as content, so compressed figures see the ratios a root filesystem has (~2×).
  const corpus: string[] = [];
  const { readdirSync, statSync } = await import("node:fs");
  for (const d of ["/usr/bin", "/usr/lib/x86_64-linux-gnu"])
    for (const n of readdirSync(d)) {
      const p = join(d, n);
      try {
        if (statSync(p).isFile() && statSync(p).size > 16384) corpus.push(p);
      } catch {}
    }
  const f = await LocalFile.open(rawPath, { write: true, create: true });
  let pos = 0;
  for (let i = 0; pos < SIZE; i++) {
    const bytes = new Uint8Array(await Bun.file(corpus[i % corpus.length]!).arrayBuffer());
    const n = Math.min(bytes.length - (bytes.length % 4096), SIZE - pos);
    if (n <= 0) continue;
    await f.pwrite(bytes.subarray(0, n), pos);
    pos += n;
  }
  await f.close();
}

async function buildStack(layers: number): Promise<string[]> {
  // The image is cut into runs of 4 KiB to 1 MiB (files, as an OCI layer holds them), each run
  // owned by a random layer; together the layers tile the raw image.
  const raw = await LocalFile.open(rawPath, {});
  const owner = new Uint8Array(blocks);
  for (let b = 0; b < blocks; ) {
    const run = 1 + Math.floor(rnd() * 256);
    owner.fill(Math.floor(rnd() * layers), b, b + run);
    b += run;
  }
  const paths: string[] = [];
  const buf = new Uint8Array(4096);
  for (let k = 0; k < layers; k++) {
    const data = join(dir, `s${layers}-${k}.data`);
    const l = await WritableLayer.create(data, join(dir, `s${layers}-${k}.index`), { virtualSize: SIZE });
    for (let b = 0; b < blocks; b++) {
      if (owner[b] !== k) continue;
      await raw.pread(buf, b * 4096);
      await l.write(buf, b * 4096);
    }
    await l.seal();
    await l.close();
    paths.push(data);
  }
  await raw.close();
  return paths;
}

const MADV_POPULATE_READ = 22; // Linux 5.14
/**
 * The page cache holds a file in folios of 4 KiB to 2 MiB, and a 1 MiB copy out of 4 KiB folios
 * costs ~2.5× the CPU of one out of 2 MiB folios, so both sides must sit in the same shape.
 * Read-ahead alone does not give that: it starts each file at 4 KiB folios and grows them only
 * over a long file (a 4 MiB layer file stays small, a 256 MiB one reaches 2 MiB).
 *
 * "large": faulted in through a MADV_HUGEPAGE mapping, every file in 2 MiB folios but its tail
 * (a file's last partial 2 MiB gets smaller ones, which is most of a small layer file).
 * "small": WILLNEED in windows of 8 MiB (it reads in 4 KiB folios, up to read_ahead_kb a call),
 * every file in 4 KiB folios: the same shape exactly.
 */
async function recache(paths: string[], folios: "large" | "small"): Promise<void> {
  for (const p of paths) {
    const f = await LocalFile.open(p, {});
    await f.fdatasync(); // dirty pages would survive DONTNEED and keep their write-time shape
    posixFadvise(f.fd, 0, 0, POSIX_FADV_DONTNEED);
    const len = f.size();
    if (folios === "small") {
      for (let at = 0; at < len; at += 8 << 20) posixFadvise(f.fd, at, 8 << 20, POSIX_FADV_WILLNEED);
    } else {
      const addr = mmap(0, len, PROT_READ, MAP_SHARED, f.fd, 0);
      try {
        madvise(addr, len, MADV_HUGEPAGE);
        madvise(addr, len, MADV_POPULATE_READ);
      } finally {
        munmap(addr, len);
      }
    }
    await f.close();
  }
}
const thp = readFileSync("/sys/kernel/mm/transparent_hugepage/enabled", "utf8");
if (thp.includes("[never]")) console.log("# THP is off: \"large\" folios are read-ahead's, which differ with file size");

async function openStack(paths: string[]): Promise<Image> {
  const lowers: ReadOnlyLayer[] = [];
  for (const p of paths) lowers.push(await openLayerFile(p));
  return Image.fromLayers(lowers);
}

const stackPaths = new Map<number, string[]>();
if (ONLY.has("reads")) for (const layers of STACKS) stackPaths.set(layers, await buildStack(layers));
const allFiles = [rawPath, ...[...stackPaths.values()].flat()];
await recache(allFiles, "large");
const raw = await LocalFile.open(rawPath, {});
const images = new Map<number, Image>();
for (const layers of stackPaths.keys()) {
  const image = await openStack(stackPaths.get(layers)!);
  // Spot-check correctness before timing.
  const a = new Uint8Array(4096);
  const b = new Uint8Array(4096);
  for (let i = 0; i < 200; i++) {
    const off = Math.floor(rnd() * blocks) * 4096;
    await image.read(a, off);
    await raw.pread(b, off);
    if (Buffer.compare(a, b)) throw new Error(`stack of ${layers} differs from raw at ${off}`);
  }
  images.set(layers, image);
}

const bufs4k = Array.from({ length: QD }, () => new Uint8Array(4096));
const bufs1m = Array.from({ length: QD }, () => new Uint8Array(1 << 20));
type Reader = (buf: Uint8Array, offset: number) => Promise<unknown>;
const targets: [string, Reader][] = [
  ["raw", (b, o) => raw.pread(b, o)],
  ...STACKS.map((n): [string, Reader] => [`${n}`, (b, o) => images.get(n)!.read(b, o)]),
];
const random4k = (read: Reader) => (l: number) => read(bufs4k[l]!, Math.floor(rnd() * blocks) * 4096);
const sequential1m = (read: Reader) => {
  let pos = 0;
  return (l: number) => {
    const p = pos;
    pos = (pos + (1 << 20)) % SIZE;
    return read(bufs1m[l]!, p);
  };
};

/** The round with the median ours/base ratio, the range of the ratios, and CPU per op (rates are ops/s: 1 MiB ops/s = MiB/s). */
function medianRow(name: string, rounds: Map<string, { rate: number; cpu: number }>[], ours: string, base: string, unit: string, target?: number, baseLabel = base === "raw" ? "raw file" : `${base} layer `) {
  const per = rounds.map((r) => ({ o: r.get(ours)!, b: r.get(base)!, ratio: r.get(ours)!.rate / r.get(base)!.rate }));
  per.sort((x, y) => x.ratio - y.ratio);
  const mid = per[Math.floor(per.length / 2)]!;
  console.log(
    `${name.padEnd(40)} ours ${fmt(mid.o.rate).padStart(7)} ${unit} ${mid.o.cpu.toFixed(2).padStart(6)} µs CPU/op | ` +
      `${baseLabel} ${fmt(mid.b.rate).padStart(7)} ${unit} ${mid.b.cpu.toFixed(2).padStart(6)} µs CPU/op | ` +
      `ratio ${mid.ratio.toFixed(2)}× [${per[0]!.ratio.toFixed(2)}–${per[per.length - 1]!.ratio.toFixed(2)}] CPU ${(mid.o.cpu / mid.b.cpu).toFixed(2)}×` +
      (target ? `  (target ≥ ${target}×${mid.ratio >= target ? "" : "  MISSED"})` : ""),
  );
}

type Rounds = Map<string, { rate: number; cpu: number }>[];
/** ROUNDS rounds of one slice per target, forward in even rounds and backward in odd ones. */
async function alternate(make: (read: Reader) => (l: number) => Promise<unknown>, among: [string, Reader][]): Promise<Rounds> {
  const rounds: Rounds = [];
  for (let r = 0; r < ROUNDS; r++) {
    const got = new Map<string, { rate: number; cpu: number }>();
    for (const [name, read] of r % 2 ? [...among].reverse() : among) got.set(name, await measure(make(read), SLICE));
    rounds.push(got);
  }
  return rounds;
}

const top = STACKS[STACKS.length - 1]!;
const workloads = [
  ["4 KiB random read", "IOPS", random4k, 0.9],
  ["1 MiB sequential read", "MiB/s", sequential1m, 0.9],
] as const;
if (ONLY.has("reads")) {
  console.log("# every file in 2 MiB folios (a file's tail in smaller ones)");
  for (const [label, unit, make, target] of workloads) {
    const rounds = await alternate(make, targets);
    for (const n of STACKS) medianRow(`${label}, ${n} layer(s)`, rounds, `${n}`, "raw", unit, target);
    medianRow(`${label}, ${top} vs 1 layer`, rounds, `${top}`, "1", unit, 0.9);
  }
  // The same stacks with every file in 4 KiB folios: what the engine costs per layer count alone.
  await recache(allFiles, "small");
  console.log("# every file in 4 KiB folios");
  for (const [label, unit, make] of workloads) {
    const rounds = await alternate(make, targets.filter(([n]) => n === "1" || n === `${top}`));
    medianRow(`${label}, ${top} vs 1 layer`, rounds, `${top}`, "1", unit, 0.9);
  }
}
for (const image of images.values()) await image.close();

// --- 4 KiB random writes into the upper vs pwrite to a raw file ---------------------------------
// The baseline is O_DIRECT; the upper takes writes under 64 KiB through the page cache, appending
// the first write of a block and rewriting it in place afterwards (see writable_layer.ts).
if (ONLY.has("write")) {
  const wpath = join(dir, "w.raw");
  const wf = await LocalFile.open(wpath, { write: true, create: true, direct: true });
  await wf.truncate(SIZE);
  const up = await WritableLayer.create(join(dir, "w.data"), join(dir, "w.index"), { virtualSize: SIZE });
  const base = (await measure((l) => wf.pwrite(bufs4k[l]!, Math.floor(rnd() * blocks) * 4096))).rate;
  const ours = (await measure((l) => up.write(bufs4k[l]!, Math.floor(rnd() * blocks) * 4096))).rate;
  line("4 KiB random write into the upper", ours, base, "IOPS");
  await up.close();
  await wf.close();
}

// --- ZFile 4 KiB block reads vs the zstd decoding of the same blocks alone -------------------
// Two baselines, each alternated with the reader: Bun.zstdDecompressSync (a context and an output
// buffer per call), and libzstd with one reused context into one buffer, the reader's own decoder:
// the first says what a read costs against decoding as Bun offers it, the second what the reader
// (pread, CRC, bookkeeping) adds to its decoder.
if (ONLY.has("zfile")) {
  const zpath = join(dir, "raw.zfile");
  const zsrc = await LocalFile.open(rawPath, {});
  const zdst = await LocalFile.open(zpath, { write: true, create: true });
  const ZSIZE = Math.min(SIZE, 64 << 20);
  const sub = { name: rawPath, size: () => ZSIZE, pread: zsrc.pread.bind(zsrc), close: async () => {} };
  await writeZFile(sub, zdst, { algorithm: "zstd" });
  await zdst.close();
  await zsrc.close();
  await recache([zpath], "large");
  const z = await ZFileReader.open(await LocalFile.open(zpath, {}));
  const nblk = ZSIZE / 4096;
  // The same kind of blocks, compressed alone and held in memory.
  const rawF = await LocalFile.open(rawPath, {});
  const frames: Uint8Array[] = [];
  const tmp = new Uint8Array(4096);
  for (let i = 0; i < 4096; i++) {
    await rawF.pread(tmp, Math.floor(rnd() * nblk) * 4096);
    frames.push(Bun.zstdCompressSync(tmp, { level: 3 }));
  }
  await rawF.close();
  let k = 0;
  const out = new Uint8Array(4096);
  const sides: [string, Reader][] = [
    ["zfile", (b, o) => z.pread(b, o)],
    ["bun", async () => Bun.zstdDecompressSync(frames[k++ & 4095]!)],
  ];
  if (zstdLibLoaded) sides.push(["libzstd", async () => zstdDecompressInto(out, frames[k++ & 4095]!)]);
  const rounds = await alternate((read) => (l) => read(bufs4k[l]!, Math.floor(rnd() * nblk) * 4096), sides);
  medianRow("ZFile 4 KiB block read vs Bun zstd decode", rounds, "zfile", "bun", "blk/s", 0.9, "Bun decode");
  if (zstdLibLoaded) medianRow("ZFile 4 KiB block read vs libzstd decode", rounds, "zfile", "libzstd", "blk/s", undefined, "libzstd  ");
  await z.close();
}

// --- seal + restack time tracks the index, not the data -----------------------------------------
// Each run writes 1 GiB into a fresh upper, flushes it, and times the restack alone; CPU is the
// process's (user + system) over the restack. A merge of sorted indexes is linear: the target is
// 1 ms per 10,000 entries of the sealed layer.
if (ONLY.has("restack")) {
  const GIB = 1 << 30;
  for (const [label, io] of [["1 GiB in 4 KiB random writes", 4096], ["1 GiB in 4 MiB sequential writes", 4 << 20]] as const) {
    const times: number[] = [];
    for (let rep = 0; rep < REPEAT; rep++) {
      const data = join(dir, `r-${io}.data`);
      const index = join(dir, `r-${io}.index`);
      const up = await WritableLayer.create(data, index, { virtualSize: GIB });
      const image = Image.fromLayers([], up);
      const buf = new Uint8Array(io);
      const n = GIB / io;
      const t0 = performance.now();
      for (let i = 0; i < n; i += QD) {
        const jobs: Promise<void>[] = [];
        for (let j = 0; j < QD && i + j < n; j++)
          jobs.push(image.write(buf, io === 4096 ? Math.floor(rnd() * (GIB / 4096)) * 4096 : (i + j) * io));
        await Promise.all(jobs);
      }
      await image.flush();
      const writeMs = performance.now() - t0;
      const entries = image.upper!.index.size;
      const cpu0 = process.cpuUsage();
      const t1 = performance.now();
      await image.restack(join(dir, `r-${io}.sealed`));
      const ms = performance.now() - t1;
      const cpu = process.cpuUsage(cpu0);
      times.push(ms);
      const per10k = (ms / entries) * 1e4;
      console.log(
        `seal+restack after ${label.padEnd(34)} run ${rep + 1}: index ${entries} entries (${((entries * 16) / 2 ** 20).toFixed(2)} MiB): ` +
          `${ms.toFixed(1)} ms, CPU ${((cpu.user + cpu.system) / 1000).toFixed(1)} ms, ${per10k.toFixed(2)} ms per 10k entries` +
          (io === 4096 ? `  (target ≤ 1 ms per 10k${per10k <= 1 ? "" : "  MISSED"})` : "") +
          `  (writing took ${(writeMs / 1000).toFixed(1)} s)`,
      );
      await image.close();
      rmSync(join(dir, `r-${io}.sealed`), { force: true });
    }
    const sorted = [...times].sort((a, b) => a - b);
    console.log(`seal+restack after ${label}: median ${sorted[sorted.length >> 1]!.toFixed(1)} ms [${sorted[0]!.toFixed(1)}–${sorted[sorted.length - 1]!.toFixed(1)}] over ${REPEAT} runs`);
  }
}
await raw.close();
