// Child of remote.test.ts (a process, or a worker thread): races eviction against reads over one
// block cache folder. usage: remote_race_child.ts ROLE DIR SIZE CHUNK SEED MS
// - churn: fills random chunks with the right bytes into a small cache, so eviction punches constantly.
// - read: random reads through a RemoteFile (a large cache over the same folder, an in-memory
//   source), every byte checked; prints {reads, hits, raced, wrong}.
import { isMainThread, parentPort, workerData } from "node:worker_threads";
import { BlockCache } from "../../src/storage/remote/block_cache.ts";
import { RemoteFile } from "../../src/storage/remote/remote_file.ts";
import type { ChunkSource, LayerDigest } from "../../src/storage/remote/source.ts";
import { randomBytes } from "../helpers/memfile.ts";
import { prng, sha256 } from "../helpers/tmp.ts";

const [role, dir, sizeS, chunkS, seedS, msS] = (isMainThread ? process.argv.slice(2) : (workerData as string[])) as string[];
const size = Number(sizeS), cs = Number(chunkS), seed = Number(seedS), ms = Number(msS);
const bytes = randomBytes(size, seed);
const digest = `sha256:${sha256(bytes)}` as LayerDigest;
const rnd = prng(seed + (role === "read" ? 1 : 2) + (isMainThread ? 0 : 10));
const until = performance.now() + ms;
let out: Record<string, number>;

if (role === "churn") {
  const cache = await BlockCache.open({ dir: dir!, capacity: Math.floor(size / 3), high: 0.9, low: 0.4 });
  const l = await cache.layer(digest, size, cs);
  let fills = 0;
  while (performance.now() < until) {
    const i = Math.floor(rnd() * l.count);
    if (!l.has(i)) fills += (await l.fill(i, bytes.subarray(i * cs, (i + 1) * cs))) > 0 ? 1 : 0;
    if (fills % 16 === 0) await new Promise((r) => setImmediate(r));
  }
  out = { fills, evicted: cache.stats.evicted };
  await cache.close();
} else {
  const cache = await BlockCache.open({ dir: dir!, capacity: 64 * size });
  const source: ChunkSource = { name: "memory", read: async (_d, off, len) => bytes.slice(off, off + len) };
  const f = RemoteFile.open({ digest, size, cache, chunkSize: cs, sources: [source] });
  let reads = 0, wrong = 0;
  await Promise.all(Array.from({ length: 8 }, async () => {
    const buf = new Uint8Array(cs);
    while (performance.now() < until) {
      const len = rnd() < 0.5 ? 4096 : 1 + Math.floor(rnd() * cs);
      const off = Math.floor(rnd() * (size - len));
      const b = buf.subarray(0, len);
      await f.pread(b, off);
      reads++;
      if (Buffer.compare(b, bytes.subarray(off, off + len)) !== 0) wrong++;
    }
  }));
  out = { reads, hits: f.stats.cacheHits, raced: f.stats.raced, fetched: f.stats.chunksFetched, wrong };
  await f.close();
  await cache.close();
}
if (isMainThread) console.log(JSON.stringify(out));
else parentPort!.postMessage(out);
