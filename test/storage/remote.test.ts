// Remote layers on real origins: s3rver, Debian's docker-registry, and a loopback HTTP origin that
// misbehaves on demand; a real block cache on disk; a kill -9 mid-download.
import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { existsSync, readFileSync, readdirSync, statSync } from "node:fs";
import { Worker } from "node:worker_threads";
import { join } from "node:path";
import { S3Client } from "bun";
import { Image } from "../../src/storage/image.ts";
import { IoLimiter } from "../../src/storage/io_limiter.ts";
import { LocalFile } from "../../src/storage/local_file.ts";
import { WritableLayer } from "../../src/storage/lsmt/writable_layer.ts";
import { writeZFile } from "../../src/storage/zfile.ts";
import { BlockCache, isReadable } from "../../src/storage/remote/block_cache.ts";
import { LayerDigestError, RemoteReadError } from "../../src/storage/remote/errors.ts";
import { RegistryRangeSource } from "../../src/storage/remote/http_source.ts";
import { DOWNLOAD_PARALLEL, RemoteFile, RUN_MAX_BYTES } from "../../src/storage/remote/remote_file.ts";
import { S3RangeSource } from "../../src/storage/remote/s3_source.ts";
import { openLayerFile } from "../../src/storage/open_layer.ts";
import { registerRemoteLayer } from "../../src/storage/remote/layer.ts";
import type { ChunkSource } from "../../src/storage/remote/source.ts";
import { RegistryClient } from "../../src/template/registry.ts";
import { randomBytes } from "../helpers/memfile.ts";
import { prng, scratchDir, sha256 } from "../helpers/tmp.ts";
import { startS3Server, type TestS3 } from "../snapshot/s3_server.ts";
import { registrySkipReason, startRegistry, type RegistryServer } from "../template/registry_harness.ts";
import { startBlobOrigin, type BlobOrigin } from "./remote_origin.ts";

const dir = scratchDir("remote");
const KiB = 1024;
const MiB = 1024 * KiB;
const BUCKET = "snapshots"; // the one s3rver_main.ts makes
const creds = { accessKeyId: "S3RVER", secretAccessKey: "S3RVER", region: "us-east-1" };

let s3: TestS3;
let cacheN = 0;
const freshCache = (capacity = 64 * MiB, extra: { high?: number; low?: number } = {}) => BlockCache.open({ dir: join(dir, `cache-${cacheN++}`), capacity, ...extra });

async function putS3(key: string, bytes: Uint8Array): Promise<void> {
  await new S3Client({ ...creds, endpoint: s3.endpoint, bucket: BUCKET }).write(key, bytes);
}

const digestOf = (b: Uint8Array) => `sha256:${sha256(b)}` as const;

/** A sealed LSMT layer file holding `data` at byte 0. */
async function sealedLayerOf(name: string, data: Uint8Array): Promise<string> {
  const p = join(dir, name);
  const w = await WritableLayer.create(`${p}.data`, `${p}.index`, { virtualSize: data.length });
  await w.write(data, 0);
  await w.seal();
  await w.close();
  return `${p}.data`;
}

const s3Dir = scratchDir("remote-s3"); // at top level: an afterAll registered inside beforeAll runs at once
beforeAll(async () => {
  s3 = await startS3Server(s3Dir);
});
afterAll(async () => {
  await s3?.stop();
});

describe("origins", () => {
  test("a layer only in S3, empty cache: partial reads are right and fetch less than the layer", async () => {
    const bytes = randomBytes(8 * MiB + 12345, 1);
    const digest = digestOf(bytes);
    await putS3(`layers/${digest.slice(7)}`, bytes);
    const cache = await freshCache();
    const f = RemoteFile.open({ digest, size: bytes.length, cache, sources: [new S3RangeSource({ ...creds, endpoint: s3.endpoint, bucket: BUCKET, key: `layers/${digest.slice(7)}` })] });
    for (const [off, len] of [[0, 4096], [3 * MiB - 100, 300], [8 * MiB, 12345], [5 * MiB + 7, 2 * MiB]] as const) {
      const buf = new Uint8Array(len);
      expect(await f.pread(buf, off)).toBe(len);
      expect(Buffer.from(buf).equals(bytes.subarray(off, off + len))).toBe(true);
    }
    // Past the end: short at EOF.
    expect(await f.pread(new Uint8Array(100), bytes.length - 10)).toBe(10);
    expect(f.stats.bytesFetched).toBeLessThan(bytes.length);
    expect(f.stats.chunksFetched).toBe(7); // chunks 0, 2, 3, 8, 5, 6, 7: the EOF read found chunk 8 cached
    expect(f.stats.requests).toBe(4); // 2–3 and 5–7 each in one ranged request
    await f.close();
  });

  const noRegistry = registrySkipReason();
  test.skipIf(!!noRegistry)(`a blob in Debian's docker-registry, read by Range with the registry client's push${noRegistry ? ` (skipped: ${noRegistry})` : ""}`, async () => {
    const reg: RegistryServer = await startRegistry({ dir: join(dir, "registry") });
    try {
      const client = new RegistryClient({ dockerConfigPath: null, insecureRegistries: [reg.host] });
      const bytes = randomBytes(3 * MiB + 5, 2);
      const desc = await client.pushBlob(`${reg.host}/remote/test:1`, bytes);
      const url = `http://${reg.host}/v2/remote/test/blobs/${desc.digest}`;
      const cache = await freshCache();
      const f = RemoteFile.open({ digest: desc.digest as `sha256:${string}`, size: bytes.length, cache, sources: [new RegistryRangeSource({ url })] });
      const buf = new Uint8Array(1 * MiB + 10);
      expect(await f.pread(buf, 2 * MiB - 5)).toBe(buf.length);
      expect(Buffer.from(buf).equals(bytes.subarray(2 * MiB - 5, 3 * MiB + 5))).toBe(true);
      expect(f.stats.bytesFetched).toBeLessThan(bytes.length);
      // The whole layer, verified and promoted: later reads go to the local file.
      const path = await f.download();
      expect(sha256(readFileSync(path))).toBe(desc.digest.slice(7));
      expect(f.localPath).toBe(path);
      expect(await cache.held(desc.digest, f.chunkSize)).toEqual([]);
      await f.close();
    } finally {
      await reg.stop();
    }
  }, 60_000);
});

describe("bad origins: named errors, nothing wrong in the cache", () => {
  const bytes = randomBytes(2 * MiB, 3);
  let origin: BlobOrigin;
  beforeAll(() => {
    origin = startBlobOrigin(bytes);
  });
  afterAll(() => origin.stop());

  const open = async (extra: Partial<Parameters<typeof RemoteFile.open>[0]> = {}) => {
    const cache = await freshCache();
    const f = RemoteFile.open({ digest: origin.digest, size: bytes.length, cache, sources: [new RegistryRangeSource({ url: origin.url })], backoffBaseMs: 5, ...extra });
    return { f, cache };
  };

  for (const fault of ["404", "500", "hang", "short"] as const) {
    test(`origin answers ${fault}: RemoteReadError naming the layer, range and source; cache empty`, async () => {
      origin.fault = fault;
      const { f, cache } = await open({ timeoutMs: 300 });
      const before = origin.requests;
      try {
        const err = await f.pread(new Uint8Array(4096), MiB + 4096).catch((e) => e);
        expect(err).toBeInstanceOf(RemoteReadError);
        expect(err.digest).toBe(origin.digest);
        expect(err.rangeOffset).toBe(MiB);
        expect(err.rangeLength).toBe(MiB);
        expect(err.attempts[0].source).toContain("127.0.0.1");
        expect(err.message).toContain(fault === "hang" ? "no answer within 300 ms" : fault === "short" ? "of 1048576 bytes" : `HTTP ${fault}`);
        // 404 is final; 500, a hang and a short answer are tried three times.
        expect(origin.requests - before).toBe(fault === "404" ? 1 : 3);
        expect(cache.usage).toBe(0);
        expect(await cache.held(origin.digest, f.chunkSize)).toEqual([]);
      } finally {
        origin.fault = "none";
        await f.close();
      }
    });
  }

  test("a source that returns wrong bytes with per-chunk digests: caught, the next source answers", async () => {
    const bad = startBlobOrigin(bytes);
    bad.fault = "corrupt";
    try {
      const chunkDigests = [0, 1].map((i) => sha256(bytes.subarray(i * MiB, (i + 1) * MiB)));
      const { f, cache } = await open({ sources: [new RegistryRangeSource({ url: bad.url, name: "bad" }), new RegistryRangeSource({ url: origin.url })], chunkDigests });
      const buf = new Uint8Array(MiB);
      await f.pread(buf, MiB);
      expect(Buffer.from(buf).equals(bytes.subarray(MiB))).toBe(true);
      expect(f.stats.failures.bad).toBe(1); // a digest mismatch is final for that source and chunk
      await f.download();
      expect(sha256(readFileSync(f.localPath!))).toBe(origin.digest.slice(7));
      await f.close();
      void cache;
    } finally {
      bad.stop();
    }
  });

  test("wrong bytes without per-chunk digests: caught when the whole layer is verified, dropped, reads fail after", async () => {
    origin.fault = "corrupt";
    const { f, cache } = await open();
    try {
      const err = await f.download().catch((e) => e);
      expect(err).toBeInstanceOf(LayerDigestError);
      expect(err.message).toContain(origin.digest);
      expect(await cache.held(origin.digest, f.chunkSize)).toEqual([]);
      expect(cache.usage).toBe(0);
      expect(existsSync(cache.promotedPath(origin.digest))).toBe(false);
      await expect(f.pread(new Uint8Array(512), 0)).rejects.toBeInstanceOf(LayerDigestError);
    } finally {
      origin.fault = "none";
      await f.close();
    }
  });

  test("wrong bytes from a source ahead of the origin, no per-chunk digests: the layer is dropped, that source distrusted, the origin's bytes promoted", async () => {
    const bad = startBlobOrigin(bytes);
    bad.fault = "corrupt";
    try {
      const { f, cache } = await open({ sources: [new RegistryRangeSource({ url: bad.url, name: "bad peer" }), new RegistryRangeSource({ url: origin.url, name: "origin" })] });
      const before = [...origin.ranges.values()].reduce((a, b) => a + b, 0);
      const path = await f.download();
      expect(sha256(readFileSync(path))).toBe(origin.digest.slice(7));
      expect(f.stats.distrusted).toEqual(["bad peer"]);
      expect([...origin.ranges.values()].reduce((a, b) => a + b, 0)).toBeGreaterThan(before); // fetched again from the origin
      const badAsked = [...bad.ranges.values()].reduce((a, b) => a + b, 0);
      const buf = new Uint8Array(MiB);
      expect(await f.pread(buf, MiB)).toBe(MiB);
      expect(Buffer.from(buf).equals(bytes.subarray(MiB))).toBe(true);
      expect([...bad.ranges.values()].reduce((a, b) => a + b, 0)).toBe(badAsked); // not asked again
      await f.close();
      void cache;
    } finally {
      bad.stop();
    }
  });

  test("two readers racing for one missing chunk fetch it once", async () => {
    origin.delayMs = 50;
    const { f } = await open();
    try {
      const before = origin.ranges.get(`0-${MiB - 1}`) ?? 0;
      const a = new Uint8Array(4096);
      const b = new Uint8Array(8192);
      await Promise.all([f.pread(a, 4096), f.pread(b, 100 * 1024)]);
      expect(Buffer.from(a).equals(bytes.subarray(4096, 8192))).toBe(true);
      expect(Buffer.from(b).equals(bytes.subarray(100 * 1024, 108 * 1024))).toBe(true);
      expect((origin.ranges.get(`0-${MiB - 1}`) ?? 0) - before).toBe(1);
    } finally {
      origin.delayMs = 0;
      await f.close();
    }
  });
});

describe("block cache", () => {
  /** Allocated bytes of a layer's sparse data file. */
  const allocated = (cache: BlockCache, digest: string, cs: number) => {
    const p = join(cache.dir, "sparse", `${digest.slice(7)}-${cs}.data`);
    return existsSync(p) ? statSync(p).blocks * 512 : 0;
  };

  test("capacity smaller than the working set: data stays right, usage stays under the high watermark, evicted bytes are punched", async () => {
    const bytes = randomBytes(16 * MiB, 4);
    const origin = startBlobOrigin(bytes);
    try {
      const cache = await freshCache(2 * MiB, { high: 0.9, low: 0.6 });
      const f = RemoteFile.open({ digest: origin.digest, size: bytes.length, cache, chunkSize: 64 * KiB, sources: [new RegistryRangeSource({ url: origin.url })] });
      const rnd = prng(4);
      let peak = 0;
      for (let i = 0; i < 200; i++) {
        const off = Math.floor(rnd() * (bytes.length - 20000));
        const buf = new Uint8Array(1 + Math.floor(rnd() * 20000));
        await Promise.all([f.pread(buf, off), f.pread(new Uint8Array(4096), Math.floor(rnd() * (bytes.length - 4096)))]);
        expect(Buffer.from(buf).equals(bytes.subarray(off, off + buf.length))).toBe(true);
        await Bun.sleep(0);
        peak = Math.max(peak, cache.usage);
      }
      // At the end of a layer a whole number of chunks long: there is no chunk there to look at.
      expect(await f.pread(new Uint8Array(100), bytes.length)).toBe(0);
      await f.close();
      await Bun.sleep(50); // the last eviction's punches
      expect(cache.stats.evicted).toBeGreaterThan(0);
      expect(peak).toBeLessThanOrEqual(cache.highBytes);
      const held = await cache.held(origin.digest, 64 * KiB);
      expect(held.length * 64 * KiB).toBe(cache.usage);
      expect(allocated(cache, origin.digest, 64 * KiB)).toBeLessThanOrEqual(cache.usage + 64 * KiB);
      await cache.close();
      // A restart rescans the same usage, and every chunk it holds is right.
      const again = await BlockCache.open({ dir: cache.dir, capacity: 2 * MiB, high: 0.9, low: 0.6 });
      expect(again.usage).toBe(held.length * 64 * KiB);
      const g = RemoteFile.open({ digest: origin.digest, size: bytes.length, cache: again, chunkSize: 64 * KiB, sources: [] });
      for (const i of held) {
        const buf = new Uint8Array(64 * KiB);
        await g.pread(buf, i * 64 * KiB);
        expect(Buffer.from(buf).equals(bytes.subarray(i * 64 * KiB, (i + 1) * 64 * KiB))).toBe(true);
      }
      expect(g.stats.chunksFetched).toBe(0);
      await g.close();
      await again.close();
    } finally {
      origin.stop();
    }
  });

  test("a layer of 1200 chunks is one data file: warm random reads stay right and fetch nothing", async () => {
    const n = 1200;
    const bytes = randomBytes(n * 4 * KiB, 8);
    const d = digestOf(bytes);
    const cache = await freshCache();
    const l = await cache.layer(d, bytes.length, 4 * KiB);
    expect(await l.fill(0, bytes)).toBe(bytes.length);
    const f = RemoteFile.open({ digest: d, size: bytes.length, cache, chunkSize: 4 * KiB, sources: [] });
    const rnd = prng(8);
    await Promise.all(Array.from({ length: 32 }, async () => {
      for (let k = 0; k < 64; k++) {
        const off = Math.floor(rnd() * (bytes.length - 8 * KiB));
        const buf = new Uint8Array(rnd() < 0.5 ? 4 * KiB : 8 * KiB);
        expect(await f.pread(buf, off)).toBe(buf.length);
        expect(Buffer.from(buf).equals(bytes.subarray(off, off + buf.length))).toBe(true);
      }
    }));
    expect(f.stats.chunksFetched).toBe(0);
    expect(readdirSync(join(cache.dir, "sparse")).sort()).toEqual([`${d.slice(7)}-4096.data`, `${d.slice(7)}-4096.map`]);
    await f.close();
    await cache.close();
  });

  test("a RemoteFile used after its cache closed still reads right bytes (fetched)", async () => {
    const bytes = randomBytes(4 * 64 * KiB, 13);
    const d = digestOf(bytes);
    const cache = await freshCache();
    const l = await cache.layer(d, bytes.length, 64 * KiB);
    await l.fill(0, bytes);
    const f = RemoteFile.open({ digest: d, size: bytes.length, cache, chunkSize: 64 * KiB, sources: [{ name: "memory", read: async (_d, o, n) => bytes.slice(o, o + n) }] });
    const buf = new Uint8Array(4096);
    await f.pread(buf, 70_000);
    expect(f.stats.chunksFetched).toBe(0);
    await cache.close();
    await Promise.all([f.pread(buf, 70_000), f.pread(new Uint8Array(4096), 0)]);
    expect(Buffer.from(buf).equals(bytes.subarray(70_000, 70_000 + 4096))).toBe(true);
    await f.close();
  });

  test("a chunk pinned by a read is not evicted", async () => {
    const bytes = randomBytes(MiB, 5);
    const cache = await freshCache(256 * KiB, { high: 0.5, low: 0.25 });
    const d = digestOf(bytes);
    const C = 64 * KiB;
    const l = await cache.layer(d, bytes.length, C);
    await l.fill(0, bytes.subarray(0, C));
    l.pins[0]!++; // as a read in progress holds it
    for (let i = 1; i < 8; i++) await l.fill(i, bytes.subarray(i * C, (i + 1) * C));
    expect(cache.stats.evicted).toBeGreaterThan(0);
    expect(l.has(0)).toBe(true);
    l.pins[0]!--;
    for (let i = 8; i < 12; i++) await l.fill(i, bytes.subarray(i * C, (i + 1) * C));
    expect(l.has(0)).toBe(false);
    await cache.close();
  });

  test("a torn map, a data file shorter than the map claims, and claims of a dead process: no wrong bytes after reopening", async () => {
    const C = 64 * KiB;
    const bytes = randomBytes(8 * C, 12);
    const d = digestOf(bytes);
    const cache = await freshCache();
    const l = await cache.layer(d, bytes.length, C);
    await l.fill(0, bytes);
    await cache.syncAll();
    const base = join(cache.dir, "sparse", `${d.slice(7)}-${C}`);
    // A dead process's claim on chunk 2, and chunk 3's word from before this boot, not durable.
    Atomics.store(l.words, 2, (Atomics.load(l.words, 2) & ~7) + 3);
    Atomics.store(l.owner, 2, 2 ** 22 + 12345); // above pid_max's default: no such process
    Atomics.store(l.words, 3, (Atomics.load(l.words, 3) & ~7) + 1);
    Atomics.store(l.since, 3, 0);
    await cache.close();
    // The data file loses its last 1.5 chunks (a machine crash before the data reached the disk).
    const data = LocalFile.open(`${base}.data`, { write: true });
    await data.truncate(6 * C + C / 2);
    await data.close();
    const again = await BlockCache.open({ dir: cache.dir, capacity: 64 * MiB });
    const m = await again.layer(d, bytes.length, C);
    expect(m.held()).toEqual([0, 1, 4, 5]);
    const f = RemoteFile.open({ digest: d, size: bytes.length, cache: again, chunkSize: C, sources: [{ name: "memory", read: async (_d, o, n) => bytes.slice(o, o + n) }] });
    const all = new Uint8Array(bytes.length);
    await f.pread(all, 0);
    expect(sha256(all)).toBe(sha256(bytes));
    expect(f.stats.chunksFetched).toBe(4);
    await f.close();
    await again.close();
    // A torn map (its header cut off) is replaced: nothing is taken from it.
    const raw = readFileSync(`${base}.map`);
    await Bun.write(`${base}.map`, raw.subarray(0, 20));
    const third = await BlockCache.open({ dir: cache.dir, capacity: 64 * MiB });
    expect(third.usage).toBe(0);
    expect((await third.layer(d, bytes.length, C)).held()).toEqual([]);
    await third.close();
  });

  test("eviction racing reads in another thread and another process: every byte read is right", async () => {
    const C = 64 * KiB;
    const size = 64 * C;
    const raceDir = join(dir, "race");
    const child = join(import.meta.dir, "remote_race_child.ts");
    const args = (role: string, seed: number) => [role, raceDir, String(size), String(C), String(seed), "2500"];
    const inWorker = (a: string[]) =>
      new Promise<Record<string, number>>((resolve, reject) => {
        const w = new Worker(child, { workerData: a });
        w.once("message", (m) => resolve(m as Record<string, number>));
        w.once("error", reject);
      });
    const inProcess = async (a: string[]) => {
      const p = Bun.spawn([process.execPath, child, ...a], { stdout: "pipe", stderr: "inherit" });
      const [out, code] = await Promise.all([new Response(p.stdout).text(), p.exited]);
      expect(code).toBe(0);
      return JSON.parse(out) as Record<string, number>;
    };
    // Readers in a thread and a process; eviction from another thread and another process.
    const [rt, rp, ct, cp] = await Promise.all([inWorker(args("read", 21)), inProcess(args("read", 21)), inWorker(args("churn", 21)), inProcess(args("churn", 21))]);
    console.log(`race: reader thread ${JSON.stringify(rt)}, reader process ${JSON.stringify(rp)}, churn thread ${JSON.stringify(ct)}, churn process ${JSON.stringify(cp)}`);
    for (const r of [rt, rp]) {
      expect(r.wrong).toBe(0);
      expect(r.reads).toBeGreaterThan(1000);
      expect(r.hits).toBeGreaterThan(100);
    }
    expect(ct.evicted + cp.evicted).toBeGreaterThan(10 * C);
  }, 60_000);

  test("kill -9 mid-download: the cache is consistent on restart and the download continues", async () => {
    const N = 64;
    const bytes = randomBytes(N * MiB, 6);
    const origin = startBlobOrigin(bytes);
    origin.delayMs = 200;
    const cacheDir = join(dir, "killed-cache");
    try {
      const child = Bun.spawn([process.execPath, join(import.meta.dir, "remote_download_child.ts"), origin.url, origin.digest, String(bytes.length), cacheDir], { stdout: "pipe", stderr: "inherit" });
      // Wait until a few chunks landed, then kill it mid-download.
      const mapPath = join(cacheDir, "sparse", `${origin.digest.slice(7)}-${MiB}.map`);
      const present = () => {
        if (!existsSync(mapPath)) return 0;
        const raw = readFileSync(mapPath);
        const words = new Int32Array(raw.buffer, raw.byteOffset + 64, N);
        return words.filter(isReadable).length;
      };
      for (let i = 0; i < 1000 && present() < 5; i++) await Bun.sleep(5);
      child.kill(9);
      await child.exited;
      const cache = await BlockCache.open({ dir: cacheDir, capacity: 256 * MiB });
      const held = await cache.held(origin.digest, MiB);
      expect(held.length).toBeGreaterThanOrEqual(5);
      expect(held.length).toBeLessThan(N);
      // No temp files survive the rescan; every chunk the map holds is whole and right.
      expect(readdirSync(join(cacheDir, "sparse")).some((n) => n.includes(".tmp."))).toBe(false);
      const data = readFileSync(join(cacheDir, "sparse", `${origin.digest.slice(7)}-${MiB}.data`));
      for (const i of held) expect(sha256(data.subarray(i * MiB, (i + 1) * MiB))).toBe(sha256(bytes.subarray(i * MiB, (i + 1) * MiB)));
      origin.delayMs = 0;
      const before = new Map(origin.ranges);
      const f = RemoteFile.open({ digest: origin.digest, size: bytes.length, cache, sources: [new RegistryRangeSource({ url: origin.url })] });
      const path = await f.download();
      expect(sha256(readFileSync(path))).toBe(origin.digest.slice(7));
      // Only the missing chunks were fetched (the killed child's answers may still have been in flight).
      expect(f.stats.chunksFetched).toBe(N - held.length);
      const asked = [...origin.ranges].filter(([k, n]) => n !== (before.get(k) ?? 0)).map(([k]) => k.split("-").map(Number) as [number, number]);
      for (const i of held) expect(asked.some(([a, b]) => a <= i * MiB + MiB - 1 && b >= i * MiB)).toBe(false);
      // Promoted by a link of the same data file: the cache names are gone.
      expect(readdirSync(join(cacheDir, "sparse"))).toEqual([]);
      await f.close();
      await cache.close();
    } finally {
      origin.stop();
    }
  }, 60_000);
});

describe("priority", () => {
  test("foreground reads go before the background download", async () => {
    const C = MiB; // RUN_MAX_BYTES / C chunks per download request: 8 requests for the layer
    const N = 64;
    const bytes = randomBytes(N * C, 31);
    const digest = digestOf(bytes);
    const run = RUN_MAX_BYTES / C;
    // An origin of the test's own: records the ranges in the order asked, holds each answer 5 ms.
    const asked: { offset: number; length: number }[] = [];
    let twoAsked!: () => void;
    const downloading = new Promise<void>((r) => (twoAsked = r));
    const source: ChunkSource = {
      name: "held memory",
      async read(_d, offset, length) {
        asked.push({ offset, length });
        if (asked.length === 2) twoAsked();
        await Bun.sleep(5);
        return bytes.slice(offset, offset + length);
      },
    };
    const limiter = IoLimiter.create(2); // the two first download requests hold both permits; the rest queue
    const cache = await freshCache(2 * N * C);
    const f = RemoteFile.open({ digest, size: bytes.length, cache, chunkSize: C, limiter, sources: [source] });
    try {
      let downloaded = false;
      const download = f.download().then((p) => ((downloaded = true), p));
      await downloading;
      // Chunk 60 is in the download's last request, not started yet (only its first DOWNLOAD_PARALLEL are).
      const far = 60;
      expect(asked.every((r) => r.offset + r.length <= DOWNLOAD_PARALLEL * RUN_MAX_BYTES)).toBe(true);
      const buf = new Uint8Array(C);
      expect(await f.pread(buf, far * C)).toBe(C);
      expect(downloaded).toBe(false);
      expect(Buffer.from(buf).equals(bytes.subarray(far * C, (far + 1) * C))).toBe(true);
      const path = await download;
      const at = asked.findIndex((r) => r.offset === far * C && r.length === C);
      // Asked once, after at most the DOWNLOAD_PARALLEL requests the download had started when the read came
      // (those already waiting for a permit); every later download request waited for it.
      expect(at).toBeGreaterThanOrEqual(0);
      expect(at).toBeLessThanOrEqual(DOWNLOAD_PARALLEL);
      const before = asked.slice(0, at), after = asked.slice(at + 1);
      expect(before.every((r) => r.offset < DOWNLOAD_PARALLEL * RUN_MAX_BYTES)).toBe(true);
      expect(after.filter((r) => r.offset >= DOWNLOAD_PARALLEL * RUN_MAX_BYTES).length).toBeGreaterThanOrEqual(N / run - DOWNLOAD_PARALLEL);
      // The asked ranges tile the layer once: the download did not fetch chunk 60 again.
      const sorted = [...asked].sort((a, b) => a.offset - b.offset);
      let end = 0;
      for (const r of sorted) {
        expect(r.offset).toBe(end);
        end = r.offset + r.length;
      }
      expect(end).toBe(bytes.length);
      expect(f.stats.chunksFetched).toBe(N);
      // The whole layer is right, verified and promoted.
      expect(sha256(readFileSync(path))).toBe(digest.slice(7));
      expect(f.localPath).toBe(path);
      expect(limiter.available).toBe(2);
    } finally {
      await f.close();
      await cache.close();
    }
  });
});

describe("layers over remote files", () => {
  test("an LSMT layer, a ZFile of it and an image stack read from S3 as from the local files", async () => {
    const data = randomBytes(4 * MiB, 7);
    data.fill(0, MiB, 2 * MiB);
    const plain = await sealedLayerOf("plain", data);
    const zpath = join(dir, "plain.zfile");
    const src = LocalFile.open(plain);
    const out = LocalFile.open(zpath, { create: true });
    await writeZFile(src, out, { algorithm: "zstd", blockSize: 4096 });
    await src.close();
    await out.close();
    const limiter = IoLimiter.create(4);
    for (const p of [plain, zpath]) {
      const layerBytes = new Uint8Array(readFileSync(p));
      const digest = digestOf(layerBytes);
      await putS3(`layers/${digest.slice(7)}`, layerBytes);
      const cache = await freshCache();
      const source = new S3RangeSource({ ...creds, endpoint: s3.endpoint, bucket: BUCKET, key: `layers/${digest.slice(7)}` });
      // In-process: a registered layer opened by name.
      const name = registerRemoteLayer({ digest, size: layerBytes.length, sources: [source], cache, download: false });
      const stack = Image.fromLayers([await openLayerFile(name, { remoteIo: limiter })]);
      const buf = new Uint8Array(64 * KiB);
      await stack.read(buf, 3 * MiB + 512);
      expect(Buffer.from(buf).equals(data.subarray(3 * MiB + 512, 3 * MiB + 512 + buf.length))).toBe(true);
      await stack.close();
      // From an image config, as blockd gets it: a lower that names its origin and cache.
      const image = await Image.open(
        { lowers: [{ digest, size: layerBytes.length, remote: { sources: [{ kind: "s3", ...creds, endpoint: s3.endpoint, bucket: BUCKET, key: `layers/${digest.slice(7)}` }], cache: { dir: join(dir, `cfg-cache-${cacheN++}`), capacity: 64 * MiB } } }] },
        { remoteIo: limiter },
      );
      const all = new Uint8Array(data.length);
      await image.read(all, 0);
      expect(sha256(all)).toBe(sha256(data));
      await image.close();
    }
    expect(limiter.available).toBe(4);
  }, 60_000);
});
