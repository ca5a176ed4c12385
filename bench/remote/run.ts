// Remote-layer benchmarks (issue 11). Every figure is a ratio against a baseline measured in the
// same run; sides alternate over rounds (forward in even rounds, backward in odd ones) and each row
// prints the median per-round ratio with its range. One sealed layer of random bytes (--mib) is the
// payload of every row:
// - warm: 4 KiB random reads, QD32, through RemoteFile with every chunk in the block cache vs the
//   same reads of the local layer file; before timing every file of both sides is dropped from the
//   page cache and read back in 4 KiB folios (the same shape). Rows: the whole layer, reads within
//   its first 256 MiB, and the layer opened as a sealed LSMT layer (an Image over it). Target ≥ 0.9×.
// - cold: the whole layer read in order (1 MiB reads, QD 8, the blockd budget of 32 remote
//   permits) through RemoteFile from an empty block cache (and with none) vs `curl` of the same
//   object to /dev/null; origins: s3rver (as the tests start it) and Debian's docker-registry.
//   A third side, curl of the same 1 MiB ranges QD 8 at once, splits the origin's per-request cost
//   from ours. The origin's files sit in the page cache for every side. Target ≥ 0.8×.
// - peer: the layer fetched whole (to a file, sha256 verified) over iroh (PeerChunkSource.fetchLayer
//   on the main thread; one PeerWorker per side) vs raw loopback TCP between the same two processes
//   (bench/p2p/harness.ts), and vs the origin: RemoteFile.download() of it from s3rver (fetched,
//   cached, verified, promoted). Goal ≥ 0.5× of TCP. --peer-mib sizes this row on its own.
//   npx bun bench/remote/run.ts [--mib 1024] [--peer-mib N] [--rounds 25] [--slice 0.2] [--cold-rounds 3]
//     [--peer-rounds 3] [--qd 8] [--only warm,cold,peer] [--origins s3,registry]
// Time to first command from a cold cache with and without a prefetch trace: bench/remote/prefetch.ts.
import { mkdirSync, rmSync } from "node:fs";
import { join } from "node:path";
import { S3Client } from "bun";
import { SecretKey } from "@number0/iroh";
import { POSIX_FADV_DONTNEED, POSIX_FADV_WILLNEED, posixFadvise } from "../../ffi/libc.ts";
import { Image } from "../../src/storage/image.ts";
import { IoLimiter } from "../../src/storage/io_limiter.ts";
import { LocalFile } from "../../src/storage/local_file.ts";
import { openLayerFile } from "../../src/storage/open_layer.ts";
import { BlockCache } from "../../src/storage/remote/block_cache.ts";
import { RegistryRangeSource } from "../../src/storage/remote/http_source.ts";
import { registerRemoteLayer } from "../../src/storage/remote/layer.ts";
import { RemoteFile } from "../../src/storage/remote/remote_file.ts";
import { S3RangeSource } from "../../src/storage/remote/s3_source.ts";
import type { ChunkSource } from "../../src/storage/remote/source.ts";
import { DEFAULT_CHUNK_SIZE } from "../../src/storage/remote/spec.ts";
import { RegistryClient } from "../../src/template/registry.ts";
import { loadOrCreateSecretKey, PeerChunkSource, PeerNode } from "../../p2p/index.ts";
import { type BenchLayer, randomSealedLayer, startPeerBenchServer, tcpFetch, timed, verifyFetched, workerFetch } from "../p2p/harness.ts";
import { startS3Server } from "../../test/snapshot/s3_server.ts";
import { registrySkipReason, startRegistry } from "../../test/template/registry_harness.ts";

const argv = process.argv.slice(2);
const arg = (name: string, dflt: string) => {
  const i = argv.indexOf(`--${name}`);
  return i >= 0 ? argv[i + 1]! : dflt;
};
const MIB = Number(arg("mib", "1024"));
const PEER_MIB = Number(arg("peer-mib", String(MIB)));
const ROUNDS = Number(arg("rounds", "25"));
const SLICE = Number(arg("slice", "0.2"));
const COLD_ROUNDS = Number(arg("cold-rounds", "3"));
const PEER_ROUNDS = Number(arg("peer-rounds", "3"));
const ROWS = ["warm", "cold", "peer"];
const only = arg("only", ROWS.join(",")).split(",");
for (const r of only) if (!ROWS.includes(r)) throw new Error(`--only: ${r} is not one of ${ROWS.join(", ")}`);
const origins = arg("origins", "s3,registry").split(",");
const QD_RANDOM = 32;
const QD_SEQ = Number(arg("qd", "8"));
/** blockd's node-wide remote-I/O budget (src/blockdev/server.ts). */
const REMOTE_PERMITS = 32;
const CREDS = { accessKeyId: "S3RVER", secretAccessKey: "S3RVER", region: "us-east-1" };
const BUCKET = "snapshots"; // the one test/snapshot/s3rver_main.ts makes

mkdirSync("/var/tmp/aenv-bench", { recursive: true });
const dir = join("/var/tmp/aenv-bench", `remote-${process.pid}`);
mkdirSync(dir, { recursive: true });
const cleanups: (() => unknown)[] = [];
process.on("exit", () => {
  for (const c of cleanups.reverse()) {
    try {
      c();
    } catch {} // already stopped
  }
  rmSync(dir, { recursive: true, force: true });
});
process.on("SIGINT", () => process.exit(130));

let seed = 42;
const rnd = () => ((seed = (Math.imul(seed, 1103515245) + 12345) >>> 0) / 2 ** 32);
const fmt = (x: number) => (x >= 1e6 ? `${(x / 1e6).toFixed(2)}M` : x >= 1e3 ? `${(x / 1e3).toFixed(1)}k` : x.toFixed(1));
const mbps = (bytes: number, s: number) => bytes / s / 1e6;
const verdict = (ratio: number, target: number, word = "target") => `  (${word} ≥ ${target}×${ratio >= target ? "" : "  MISSED"})`;

console.log(`# remote bench: a ${MIB} MiB sealed layer of random bytes, ${navigator.hardwareConcurrency} CPUs; chunks of ${DEFAULT_CHUNK_SIZE >> 20} MiB`);
const t0 = performance.now();
const layer = await randomSealedLayer(dir, MIB);
console.log(`# fixture: ${(layer.size / 2 ** 20).toFixed(1)} MiB layer ${layer.digest.slice(0, 19)}… made in ${((performance.now() - t0) / 1000).toFixed(1)} s`);
const limiter = IoLimiter.create(REMOTE_PERMITS);

// ---- origins ---------------------------------------------------------------------------------
interface Origin {
  label: string;
  /** The object's URL for curl. */
  url: string;
  source: () => ChunkSource;
}
const s3 = await startS3Server(join(dir, "s3"));
cleanups.push(() => process.kill(s3.pid));
const s3Client = new S3Client({ ...CREDS, endpoint: s3.endpoint, bucket: BUCKET });
/** The layer as an S3 object under its digest: the warm and peer rows' origin, and a cold row's. */
async function s3Origin(l: BenchLayer): Promise<Origin> {
  const key = `layers/${l.digest.slice(7)}`;
  await s3Client.write(key, Bun.file(l.path));
  return { label: "s3rver", url: `${s3.endpoint}/${BUCKET}/${key}`, source: () => new S3RangeSource({ ...CREDS, endpoint: s3.endpoint, bucket: BUCKET, key }) };
}
const s3Layer = await s3Origin(layer);
const coldOrigins: Origin[] = origins.includes("s3") ? [s3Layer] : [];
let registry: { stop(): Promise<void> } | undefined;
if (only.includes("cold") && origins.includes("registry")) {
  const why = registrySkipReason();
  if (why) console.log(`# registry origin skipped: ${why}`);
  else {
    const reg = await startRegistry({ dir: join(dir, "registry") });
    registry = reg;
    cleanups.push(() => void reg.stop());
    await new RegistryClient({ dockerConfigPath: null, insecureRegistries: [reg.host] }).pushBlob(`${reg.host}/bench/remote:1`, layer.path);
    const url = `http://${reg.host}/v2/bench/remote/blobs/${layer.digest}`;
    coldOrigins.push({ label: "registry", url, source: () => new RegistryRangeSource({ url }) });
  }
}

/** `curl` of the whole object to /dev/null; checks the size it got. */
async function curl(url: string): Promise<void> {
  const p = Bun.spawn(["curl", "-sS", "--fail", "-o", "/dev/null", "-w", "%{size_download}", url], { stdout: "pipe", stderr: "inherit" });
  const [out, code] = await Promise.all([new Response(p.stdout).text(), p.exited]);
  if (code !== 0 || Number(out) !== layer.size) throw new Error(`curl ${url}: exit ${code}, ${out} of ${layer.size} bytes`);
}

/** `curl` of the same 1 MiB ranges RemoteFile asks, QD_SEQ at once on reused connections: the origin's per-request cost alone. */
async function curlRanges(url: string): Promise<void> {
  const cfg = join(dir, `ranges-${Bun.hash(url)}.cfg`);
  const lines: string[] = [];
  for (let at = 0; at < layer.size; at += 1 << 20) lines.push(`url = "${url}"`, `range = ${at}-${Math.min(at + (1 << 20), layer.size) - 1}`, `output = "/dev/null"`);
  await Bun.write(cfg, lines.join("\n") + "\n");
  // -Z draws its progress meter even under -s: stderr is shown only on failure.
  const p = Bun.spawn(["curl", "-sS", "--fail", "-Z", "--parallel-max", String(QD_SEQ), "-K", cfg], { stdout: "ignore", stderr: "pipe" });
  const [code, err] = await Promise.all([p.exited, new Response(p.stderr).text()]);
  if (code !== 0) throw new Error(`curl ranges of ${url}: exit ${code}: ${err.slice(-500)}`);
}

let cacheN = 0;
const freshCache = () => BlockCache.open({ dir: join(dir, `cache-${cacheN++}`), capacity: 2 * layer.size });

const localLayer = LocalFile.open(layer.path);
cleanups.push(() => void localLayer.close());
/** The whole layer in order through RemoteFile, 1 MiB reads, QD_SEQ in flight (every 64th compared with the local file); waits for the cache writes. */
async function readInOrder(source: ChunkSource, cache: BlockCache | undefined): Promise<RemoteFile> {
  const f = RemoteFile.open({ digest: layer.digest, size: layer.size, sources: [source], cache, limiter });
  let next = 0;
  await Promise.all(Array.from({ length: QD_SEQ }, async () => {
    const buf = new Uint8Array(1 << 20);
    const check = new Uint8Array(1 << 20);
    for (let at = next; at < layer.size; at = next) {
      next += buf.length;
      const want = Math.min(buf.length, layer.size - at);
      if ((await f.pread(buf, at)) !== want) throw new Error(`short read at ${at}`);
      if ((at >> 20) % 64 === 0 && (await localLayer.pread(check, at), Buffer.compare(buf.subarray(0, want), check.subarray(0, want))))
        throw new Error(`remote bytes differ from the local layer at ${at}`);
    }
  }));
  await f.settled();
  if (f.stats.bytesFetched !== layer.size) throw new Error(`fetched ${f.stats.bytesFetched} of ${layer.size} bytes`);
  return f;
}

/** Bytes of `f` at a few places equal the local layer file's. */
async function spotCheck(read: (b: Uint8Array, o: number) => Promise<unknown>, local: (b: Uint8Array, o: number) => Promise<unknown>, span: number): Promise<void> {
  const a = new Uint8Array(4096), b = new Uint8Array(4096);
  for (let i = 0; i < 200; i++) {
    const off = Math.floor(rnd() * (span / 4096)) * 4096;
    await read(a, off);
    await local(b, off);
    if (Buffer.compare(a, b)) throw new Error(`remote bytes differ from the local layer at ${off}`);
  }
}

/** Median per-round ratio (baseline seconds / ours), its range, and the median round's rates. */
function timeRow(name: string, ours: number[], base: number[], baseName: string, bytes: number, target?: number, word?: string): void {
  const per = ours.map((o, i) => ({ o, b: base[i]!, ratio: base[i]! / o })).sort((x, y) => x.ratio - y.ratio);
  const mid = per[Math.floor(per.length / 2)]!;
  console.log(
    `${name.padEnd(46)} ours ${mbps(bytes, mid.o).toFixed(0).padStart(5)} MB/s | ${baseName} ${mbps(bytes, mid.b).toFixed(0).padStart(5)} MB/s | ` +
      `ratio ${mid.ratio.toFixed(2)}× [${per[0]!.ratio.toFixed(2)}–${per[per.length - 1]!.ratio.toFixed(2)}]` + (target ? verdict(mid.ratio, target, word) : ""),
  );
}

// ---- cold: a whole layer from the origin through RemoteFile vs curl ---------------------------
let warmCacheDir: string | undefined;
if (only.includes("cold")) {
  console.log(`# cold: the whole layer in order, 1 MiB reads at QD ${QD_SEQ}, ${REMOTE_PERMITS} remote permits; median of ${COLD_ROUNDS} rounds`);
  for (const o of coldOrigins) {
    await curl(o.url); // the origin's file into the page cache, for both sides
    type Side = [string, () => Promise<void>];
    const sides: Side[] = [
      ["curl", () => curl(o.url)],
      ["ranges", () => curlRanges(o.url)],
      ["cache", async () => {
        const cache = await freshCache();
        const f = await readInOrder(o.source(), cache);
        await f.close();
        await cache.close();
        if (warmCacheDir) rmSync(warmCacheDir, { recursive: true, force: true });
        warmCacheDir = cache.dir; // the last full cache is the warm rows'
      }],
      ["nocache", async () => void (await readInOrder(o.source(), undefined)).close()],
    ];
    const got = new Map<string, number[]>(sides.map(([n]) => [n, []]));
    for (let r = 0; r < COLD_ROUNDS; r++) {
      for (const [name, run] of r % 2 ? [...sides].reverse() : sides) {
        const t = performance.now();
        await run();
        got.get(name)!.push((performance.now() - t) / 1000);
      }
    }
    timeRow(`cold read from ${o.label}, RemoteFile + block cache`, got.get("cache")!, got.get("curl")!, "curl", layer.size, 0.8);
    timeRow(`cold read from ${o.label}, RemoteFile, no cache`, got.get("nocache")!, got.get("curl")!, "curl", layer.size, 0.8);
    timeRow(`  curl of its 1 MiB ranges, QD ${QD_SEQ}, vs whole`, got.get("ranges")!, got.get("curl")!, "curl", layer.size);
    timeRow(`  RemoteFile, no cache, vs curl of the ranges`, got.get("nocache")!, got.get("ranges")!, "ranges", layer.size);
  }
}

// ---- warm: every chunk cached vs the local layer file ----------------------------------------
/**
 * Drop a file from the page cache (synced first: dirty pages are not dropped) and read it back in
 * 4 KiB folios (WILLNEED in 8 MiB windows), then read it through so the timing starts only once
 * WILLNEED's asynchronous reads are done.
 */
async function recacheSmall(paths: string[]): Promise<void> {
  const buf = new Uint8Array(8 << 20);
  for (const p of paths) {
    const f = LocalFile.open(p);
    await f.fdatasync();
    posixFadvise(f.fd, 0, 0, POSIX_FADV_DONTNEED);
    for (let at = 0; at < f.size(); at += 8 << 20) posixFadvise(f.fd, at, 8 << 20, POSIX_FADV_WILLNEED);
    for (let at = 0; at < f.size(); at += buf.length) await f.pread(buf, at);
    await f.close();
  }
}

type Reader = (buf: Uint8Array, offset: number) => Promise<unknown>;
/** `one` with QD_RANDOM in flight for `seconds`: ops/s and CPU µs per op. */
async function measure(read: Reader, span: number, seconds: number): Promise<{ rate: number; cpu: number }> {
  const bufs = Array.from({ length: QD_RANDOM }, () => new Uint8Array(4096));
  let ops = 0;
  const cpu0 = process.cpuUsage();
  const until = performance.now() + seconds * 1000;
  await Promise.all(bufs.map(async (b) => {
    while (performance.now() < until) {
      await read(b, Math.floor(rnd() * (span / 4096)) * 4096);
      ops++;
    }
  }));
  const cpu = process.cpuUsage(cpu0);
  return { rate: ops / seconds, cpu: (cpu.user + cpu.system) / ops };
}

async function alternateRandom(name: string, ours: Reader, base: Reader, span: number, target: number): Promise<void> {
  await spotCheck(ours, base, span);
  const per: { o: { rate: number; cpu: number }; b: { rate: number; cpu: number }; ratio: number }[] = [];
  for (let r = 0; r < ROUNDS; r++) {
    let o, b;
    if (r % 2) {
      b = await measure(base, span, SLICE);
      o = await measure(ours, span, SLICE);
    } else {
      o = await measure(ours, span, SLICE);
      b = await measure(base, span, SLICE);
    }
    per.push({ o, b, ratio: o.rate / b.rate });
  }
  per.sort((x, y) => x.ratio - y.ratio);
  const mid = per[Math.floor(per.length / 2)]!;
  console.log(
    `${name.padEnd(46)} ours ${fmt(mid.o.rate).padStart(7)} IOPS ${mid.o.cpu.toFixed(2).padStart(5)} µs CPU/op | local ${fmt(mid.b.rate).padStart(7)} IOPS ${mid.b.cpu.toFixed(2).padStart(5)} µs CPU/op | ` +
      `ratio ${mid.ratio.toFixed(2)}× [${per[0]!.ratio.toFixed(2)}–${per[per.length - 1]!.ratio.toFixed(2)}] CPU ${(mid.o.cpu / mid.b.cpu).toFixed(2)}×` + verdict(mid.ratio, target),
  );
}

if (only.includes("warm")) {
  if (!warmCacheDir) {
    const cache = await freshCache();
    await (await readInOrder(s3Layer.source(), cache)).close();
    await cache.close();
    warmCacheDir = cache.dir;
  }
  const cache = await BlockCache.open({ dir: warmCacheDir, capacity: 2 * layer.size });
  const held = (await cache.held(layer.digest, DEFAULT_CHUNK_SIZE)).length;
  if (held !== Math.ceil(layer.size / DEFAULT_CHUNK_SIZE)) throw new Error(`the warm cache holds ${held} chunks`);
  await recacheSmall([layer.path, join(warmCacheDir, "sparse", `${layer.digest.slice(7)}-${DEFAULT_CHUNK_SIZE}.data`)]);
  console.log(`# warm: 4 KiB random reads, QD${QD_RANDOM}, all ${held} chunks cached, every file in 4 KiB folios; median of ${ROUNDS} rounds of ${SLICE}s`);
  const remote = RemoteFile.open({ digest: layer.digest, size: layer.size, sources: [s3Layer.source()], cache, limiter });
  const local = LocalFile.open(layer.path);
  const hot = Math.min(layer.size, 256 << 20);
  await remote.pread(new Uint8Array(4096), 0); // the cache files open on the first read
  await alternateRandom(`warm 4 KiB random read, whole layer (${layer.size >> 20} MiB)`, (b, o) => remote.pread(b, o), (b, o) => local.pread(b, o), layer.size, 0.9);
  await alternateRandom(`warm 4 KiB random read, first ${hot >> 20} MiB`, (b, o) => remote.pread(b, o), (b, o) => local.pread(b, o), hot, 0.9);
  // The same layer as a sealed LSMT layer under an Image, as blockd reads it.
  const name = registerRemoteLayer({ digest: layer.digest, size: layer.size, sources: [s3Layer.source()], cache, download: false });
  const remoteImage = Image.fromLayers([await openLayerFile(name, { remoteIo: limiter })]);
  const localImage = Image.fromLayers([await openLayerFile(layer.path)]);
  await alternateRandom(`warm 4 KiB random read, LSMT layer, first ${hot >> 20} MiB`, (b, o) => remoteImage.read(b, o), (b, o) => localImage.read(b, o), Math.min(MIB << 20, hot), 0.9);
  if (remote.stats.chunksFetched !== 0) throw new Error(`the warm rows fetched ${remote.stats.chunksFetched} chunks`);
  await remoteImage.close();
  await localImage.close();
  await remote.close();
  await local.close();
  await cache.close();
}

// ---- peer: iroh vs raw TCP between the same two processes, and vs the origin ------------------
if (only.includes("peer")) {
  const peerLayer: BenchLayer = PEER_MIB === MIB ? layer : await randomSealedLayer(dir, PEER_MIB, "peer.sealed");
  const peerS3 = peerLayer === layer ? s3Layer : await s3Origin(peerLayer);
  const workerHome = join(dir, "cli-w0");
  const workerId = SecretKey.fromBytes(await loadOrCreateSecretKey(workerHome)).public().toString();
  const client = await PeerNode.start({ home: join(dir, "cli-main"), bindAddr: "127.0.0.1:0" });
  const srv = await startPeerBenchServer(dir, peerLayer, client.id, [workerId]);
  cleanups.push(() => srv.stop());
  client.setPeers([srv.main]);
  const src = new PeerChunkSource(client, { streams: 8 });
  type Side = [string, () => Promise<void>];
  const sides: Side[] = [
    ["tcp", () => tcpFetch(srv.tcpPort, peerLayer, join(dir, "tcp.out"))],
    ["iroh", async () => verifyFetched((await src.fetchLayer(peerLayer.digest, join(dir, "iroh.out"))).path, peerLayer.digest)],
    ["worker", () => workerFetch(srv, [workerHome], peerLayer, 1, join(dir, "w1.out"))],
    ["s3", async () => {
      const cache = await BlockCache.open({ dir: join(dir, `cache-${cacheN++}`), capacity: 2 * peerLayer.size });
      const f = RemoteFile.open({ digest: peerLayer.digest, size: peerLayer.size, sources: [peerS3.source()], cache, limiter });
      await f.download();
      await f.close();
      await cache.close();
      rmSync(cache.dir, { recursive: true, force: true });
    }],
  ];
  const got = new Map<string, { s: number[]; cpu: number[]; srv: number[] }>(sides.map(([n]) => [n, { s: [], cpu: [], srv: [] }]));
  for (let r = 0; r < PEER_ROUNDS; r++) {
    for (const [name, run] of r % 2 ? [...sides].reverse() : sides) {
      const row = await timed(name, srv, run);
      const g = got.get(name)!;
      g.s.push(row.s);
      g.cpu.push(row.cpuClient);
      g.srv.push(row.cpuServer);
    }
  }
  const gib = peerLayer.size / 2 ** 30;
  console.log(`# peer: a ${(peerLayer.size / 2 ** 20).toFixed(0)} MiB sealed layer fetched whole to a file, sha256 verified; median of ${PEER_ROUNDS} round(s)`);
  const med = (xs: number[]) => [...xs].sort((a, b) => a - b)[Math.floor(xs.length / 2)]!;
  for (const [name, label] of [["tcp", "raw TCP, 1 connection"], ["iroh", "iroh, main thread, 8 streams"], ["worker", "iroh, 1 PeerWorker per side"], ["s3", "origin: RemoteFile.download from s3rver"]] as const) {
    const g = got.get(name)!;
    const serving = name === "s3" ? "s3rver's not counted" : `serving process ${(med(g.srv) / gib).toFixed(1)}`;
    console.log(`${label.padEnd(46)} ${med(g.s).toFixed(2).padStart(7)} s ${mbps(peerLayer.size, med(g.s)).toFixed(0).padStart(5)} MB/s  CPU s per GiB: this process ${(med(g.cpu) / gib).toFixed(1)}, ${serving}`);
  }
  for (const name of ["iroh", "worker"] as const) {
    const label = name === "iroh" ? "iroh, main thread, 8 streams" : "iroh, 1 PeerWorker per side";
    timeRow(`peer ${label} vs TCP`, got.get(name)!.s, got.get("tcp")!.s, "TCP", peerLayer.size, 0.5, "goal");
    timeRow(`peer ${label} vs s3rver`, got.get(name)!.s, got.get("s3")!.s, "s3rver", peerLayer.size);
  }
  await client.close();
  srv.stop();
}

console.log("time to first command from a cold cache, with vs without a prefetch trace: bench/remote/prefetch.ts (device level) and bench/remote/prefetch_node.ts (a node)");
await registry?.stop();
await s3.stop();
process.exit(0);
