// RemoteFile: a layer that lives elsewhere, read through the one random-access file interface.
// Rules:
// - A read is split into aligned chunks (default 1 MiB). A chunk present in the BlockCache is one
//   pread of the layer's cache file, checked against the chunk's shared word after (block_cache.ts).
//   Missing chunks of one read go out as one ranged request per run of at most RUN_MAX_BYTES, to
//   the sources in order: each source is tried up to `tries` times with exponential backoff
//   (non-retryable failures move on at once), each try under `timeoutMs`, each holding one permit
//   of the node-wide IoLimiter. An answer of the wrong length is a failure.
// - Sequential reads (one starting where one of the last SEQ_TRACK reads ended) read ahead: runs of
//   RUN_MAX_BYTES up to READAHEAD_BYTES past the read, the next ones asked when reads reach the
//   first chunk of the last run asked, at background priority (this file's foreground fetches
//   first). Only with a cache (where the bytes land).
// - When every source failed the read rejects with RemoteReadError: the caller gets EIO, never
//   wrong or missing bytes, and nothing is cached.
// - Two reads of the same missing chunk share one fetch.
// - With `chunkDigests` (sha256 per chunk) every fetched chunk is checked before use; without,
//   bytes are as good as the source's transport until the whole layer is verified at promotion.
// - download() fills the whole layer at low priority (foreground fetches go first), then verifies
//   the layer's sha256: on a match the layer's cache file becomes the promoted local file and reads
//   go there; on a mismatch its chunks are dropped, and when sources other than the last one in the
//   list (the origin) served some of them, those are distrusted by this file (never asked again)
//   and the layer is fetched again from the rest; a mismatch of bytes only the last one served
//   fails every later read.
// - Several threads or processes may open one layer over one cache folder (blockd's device
//   workers): they share its cache file and words, so a chunk one fetched is a hit for all.

import type { ReadableFile } from "../file.ts";
import { IoLimiter } from "../io_limiter.ts";
import { LocalFile } from "../local_file.ts";
import { existsSync } from "node:fs";
import { type BlockCache, type CachedLayer, isReadable } from "./block_cache.ts";
import { type SourceAttempt, LayerDigestError, RemoteReadError, RemoteSpecError } from "./errors.ts";
import { type ChunkSource, type LayerDigest, SourceError } from "./source.ts";
import { DEFAULT_CHUNK_SIZE, checkRemoteShape } from "./spec.ts";
import { trackRemote } from "./pending.ts";

/** Tries per source for one request. */
export const DEFAULT_TRIES = 3;
/** Backoff before try n (n ≥ 1) is base·2^(n-1), capped at BACKOFF_MAX_MS. */
export const BACKOFF_BASE_MS = 100;
export const BACKOFF_MAX_MS = 2_000;
export const DEFAULT_TIMEOUT_MS = 30_000;
/** Requests the background download keeps in flight. */
export const DOWNLOAD_PARALLEL = 4;
/** The most one ranged request asks: adjacent missing chunks share a request up to this (a registry's ~3 ms per request amortized). */
export const RUN_MAX_BYTES = 8 << 20;
/** How far past a sequential read the readahead keeps requests going. */
export const READAHEAD_BYTES = 64 << 20;
/** Read ends remembered to tell a sequential read (one starting where one of them ended). */
const SEQ_TRACK = 4;
/** Fetched bytes waiting to land in the cache per file; past this a fetch waits for one to land. */
const MAX_PENDING_WRITE_BYTES = 64 << 20;

export interface RemoteFileOptions {
  digest: LayerDigest;
  /** The layer's size in bytes. */
  size: number;
  /** Where the bytes come from, first choice first. */
  sources: ChunkSource[];
  /** The local chunk cache (also where the layer is promoted to); without one nothing is kept. */
  cache?: BlockCache;
  /** The node-wide remote-I/O budget; without one this file has its own of 8. */
  limiter?: IoLimiter;
  /** Power of two, at least 4096 (default 1 MiB). */
  chunkSize?: number;
  /** sha256 (hex) of each chunk, in order: every fetched chunk is checked against it. */
  chunkDigests?: string[];
  /** How far sequential reads read ahead (default READAHEAD_BYTES; 0: never). */
  readaheadBytes?: number;
  tries?: number;
  timeoutMs?: number;
  backoffBaseMs?: number;
}

/** One ranged request: chunks first..first+count-1. */
interface Run {
  first: number;
  bytes: Promise<Uint8Array>;
  /** Settles once the bytes are in the cache (or the write failed: a refetch later, never a failed read). */
  landed: Promise<void>;
}

export interface RemoteFileStats {
  /** Bytes received from sources (answers that were used). */
  bytesFetched: number;
  chunksFetched: number;
  /** Ranged requests answered. */
  requests: number;
  /** Chunk reads served from the cache. */
  cacheHits: number;
  /** Cache preads thrown away because the chunk was evicted or refilled under them. */
  raced: number;
  /** Failed tries per source name. */
  failures: Record<string, number>;
  /** Sources this file stopped asking: they served bytes of the layer when it did not verify. */
  distrusted: string[];
}

export class RemoteFile implements ReadableFile {
  readonly name: string;
  readonly digest: LayerDigest;
  readonly chunkSize: number;
  readonly stats: RemoteFileStats = { bytesFetched: 0, chunksFetched: 0, requests: 0, cacheHits: 0, raced: 0, failures: {}, distrusted: [] };
  private readonly limiter: IoLimiter;
  private readonly count: number;
  private readonly inflight = new Map<number, Run>();
  private pendingWriteBytes = 0;
  private writeLanded: (() => void)[] = [];
  private fgWaiting = 0;
  private fgIdle: (() => void)[] = [];
  private local: LocalFile | undefined;
  /** Sources that served bytes into the cache since its files for this layer were last dropped. */
  private readonly contributed = new Set<ChunkSource>();
  /** Sources not asked any more (see the rules above); bounded by the source list. */
  private readonly distrusted = new Set<ChunkSource>();
  /** This layer's cache files, once opened. */
  private layer: CachedLayer | undefined;
  private layerOpen: Promise<CachedLayer | undefined> | undefined;
  private failed: Error | undefined;
  private downloading: Promise<string> | undefined;
  private closed = false;
  private readonly seqEnds = new Array<number>(SEQ_TRACK).fill(-1);
  private seqAt = 0;
  /** First chunk the readahead has not asked for yet. */
  private raNext = 0;
  /** Chunks that start a readahead run: reaching one asks for the next run. */
  private raMark: Uint8Array | undefined;

  private constructor(private readonly opts: RemoteFileOptions) {
    checkRemoteShape(opts.digest, opts.size, opts.chunkSize, opts.chunkDigests, `remote:${opts.digest}`);
    this.digest = opts.digest;
    this.name = `remote:${opts.digest}`;
    this.chunkSize = opts.chunkSize ?? DEFAULT_CHUNK_SIZE;
    this.count = Math.ceil(opts.size / this.chunkSize);
    if (opts.readaheadBytes !== undefined && !(Number.isSafeInteger(opts.readaheadBytes) && opts.readaheadBytes >= 0))
      throw new RemoteSpecError(`readaheadBytes must be a byte count ≥ 0, got ${opts.readaheadBytes}`, this.name);
    this.limiter = opts.limiter ?? IoLimiter.create(8);
  }

  /** A remote layer; when the cache already holds it promoted, reads go to that local file. */
  static open(opts: RemoteFileOptions): RemoteFile {
    const f = new RemoteFile(opts);
    const p = opts.cache?.promotedPath(opts.digest);
    if (p && existsSync(p)) f.local = LocalFile.open(p);
    else if (opts.cache) void f.openLayer();
    return f;
  }

  /** The cache files (undefined without a cache, or when they cannot be opened: then nothing is kept). */
  private openLayer(): Promise<CachedLayer | undefined> {
    const cache = this.opts.cache;
    if (!cache || this.closed) return Promise.resolve(undefined);
    if (this.layer && !this.layer.retired && !this.layer.closed) return Promise.resolve(this.layer);
    this.layerOpen ??= trackRemote(
      cache.layer(this.digest, this.opts.size, this.chunkSize).then(
        (l) => {
          const old = this.layer;
          l.refs++;
          this.layer = l;
          this.raMark ??= new Uint8Array(this.count);
          if (old && old !== l) void cache.unref(old);
          return l;
        },
        (e: Error) => {
          console.error(`remote layer ${this.digest}: block cache unusable, reading uncached: ${e.message}`);
          return undefined;
        },
      ).finally(() => (this.layerOpen = undefined)),
    );
    return this.layerOpen;
  }

  size(): number {
    return this.opts.size;
  }

  /** The promoted local file's path once the layer is whole and verified. */
  get localPath(): string | undefined {
    return this.local?.name;
  }

  pread(buf: Uint8Array, offset: number): Promise<number> {
    if (this.failed) return Promise.reject(this.failed);
    if (this.local) return this.local.pread(buf, offset);
    // Fast path: the whole read in one present chunk, one pread of the cache file.
    const l = this.layer;
    if (l !== undefined && offset >= 0) {
      const n = Math.min(buf.length, this.opts.size - offset);
      const i = Math.floor(offset / this.chunkSize);
      if (n > 0 && offset + n <= (i + 1) * this.chunkSize && this.raMark![i] === 0) {
        // One load of the word, both tested and compared after: a second load could see EVICTING,
        // and a pread that matched it would return punched bytes.
        const w = Atomics.load(l.words, i);
        if (isReadable(w)) return this.preadCached(l, i, w, n === buf.length ? buf : buf.subarray(0, n), offset);
      }
    }
    return this.preadSlow(buf, offset);
  }

  /** One pread of the cache file, checked against the chunk's word after; no async frame (the warm path's cost is per 4 KiB read). */
  private preadCached(l: CachedLayer, i: number, w: number, dst: Uint8Array, offset: number): Promise<number> {
    l.pins[i]!++;
    l.lastUse[i] = ++l.cache.tick;
    let read: Promise<number>;
    try {
      read = l.data.pread(dst, offset);
    } catch (e) {
      read = Promise.reject(e);
    }
    return read.then(
      (got) => {
        l.pins[i]!--;
        // Evicted or refilled under the pread (another thread or process): fetched again.
        if (got !== dst.length || Atomics.load(l.words, i) !== w) {
          this.stats.raced++;
          return this.preadSlow(dst, offset);
        }
        this.stats.cacheHits++;
        return got;
      },
      (e) => {
        l.pins[i]!--;
        if (!l.closed) throw e;
        this.stats.raced++; // the cache closed under the read: fetched instead
        return this.preadSlow(dst, offset);
      },
    );
  }

  private async preadSlow(buf: Uint8Array, offset: number): Promise<number> {
    if (this.failed) throw this.failed;
    if (this.opts.cache && (!this.layer || this.layer.retired || this.layer.closed) && !this.local) {
      // Promoted by another thread or process (a device worker beside this one): its file from now on.
      const promoted = this.opts.cache.promotedPath(this.digest);
      if (this.layer?.retired && existsSync(promoted)) this.local = LocalFile.open(promoted);
      else await this.openLayer();
    }
    if (this.local) return this.local.pread(buf, offset);
    const n = Math.max(0, Math.min(buf.length, this.opts.size - offset));
    if (n === 0) return 0;
    const cs = this.chunkSize;
    const first = Math.floor(offset / cs);
    const last = Math.floor((offset + n - 1) / cs);
    this.request(first, last + 1, true);
    this.readahead(offset, offset + n, first, last);
    const parts: Promise<void>[] = [];
    for (let at = offset; at < offset + n; ) {
      const index = Math.floor(at / cs);
      const end = Math.min(offset + n, (index + 1) * cs);
      parts.push(this.readPiece(index, at - index * cs, buf.subarray(at - offset, end - offset)));
      at = end;
    }
    await Promise.all(parts);
    return n;
  }

  /** Sequential reads keep requests going READAHEAD_BYTES ahead, in runs of RUN_MAX_BYTES. */
  private readahead(start: number, end: number, first: number, last: number): void {
    const seq = this.seqEnds.includes(start);
    this.seqEnds[this.seqAt] = end;
    this.seqAt = (this.seqAt + 1) % SEQ_TRACK;
    const mark = this.raMark;
    if (!mark || !this.layer) return;
    let hit = false;
    for (let i = first; i <= last; i++) if (mark[i]) (mark[i] = 0), (hit = true);
    if (!seq && !hit) return;
    const cs = this.chunkSize;
    const ahead = Math.ceil((this.opts.readaheadBytes ?? READAHEAD_BYTES) / cs);
    if (ahead === 0) return;
    const run = Math.max(1, Math.floor(RUN_MAX_BYTES / cs));
    if (this.raNext <= last || this.raNext > last + 1 + ahead + run) this.raNext = last + 1;
    while (this.raNext < Math.min(this.count, last + 1 + ahead)) {
      const e = Math.min(this.count, this.raNext + run);
      mark[this.raNext] = 1;
      this.request(this.raNext, e, false);
      this.raNext = e;
    }
  }

  /** Start requests for the chunks of [a, b) that are neither cached nor in flight, adjacent ones together. */
  private request(a: number, b: number, foreground: boolean): Run[] {
    const l = this.layer;
    const maxRun = Math.max(1, Math.floor(RUN_MAX_BYTES / this.chunkSize));
    const out: Run[] = [];
    for (let i = a; i < b; ) {
      if (this.inflight.has(i) || (l && l.has(i))) {
        i++;
        continue;
      }
      let e = i + 1;
      while (e < b && e - i < maxRun && !this.inflight.has(e) && !(l && l.has(e))) e++;
      out.push(this.startRun(i, e - i, foreground));
      i = e;
    }
    return out;
  }

  private async readPiece(index: number, inChunk: number, dst: Uint8Array): Promise<void> {
    const at = index * this.chunkSize + inChunk;
    for (let tries = 0; ; tries++) {
      const l = this.layer;
      if (l && !this.inflight.has(index) && (await l.read(index, dst, at))) {
        this.stats.cacheHits++;
        return;
      }
      if (this.local) {
        if ((await this.local.pread(dst, at)) === dst.length) return;
        throw new RemoteReadError(this.digest, at, dst.length, [{ source: this.local.name, error: "short read of the promoted layer" }]);
      }
      const run = this.inflight.get(index) ?? (l && l.has(index) && tries < 2 ? undefined : this.startRun(index, 1, true));
      if (!run) continue; // became present meanwhile
      const bytes = await run.bytes;
      const from = (index - run.first) * this.chunkSize + inChunk;
      dst.set(bytes.subarray(from, from + dst.length));
      return;
    }
  }

  private chunkLength(index: number): number {
    return Math.min(this.chunkSize, this.opts.size - index * this.chunkSize);
  }

  /** Fetch chunks first..first+count-1 in one request; kept in flight until they land in the cache. */
  private startRun(first: number, count: number, foreground: boolean): Run {
    const bytes = this.fetchRun(first, count, foreground);
    const landed = trackRemote(bytes.then(
      async (b) => {
        const l = this.layer;
        if (!l) return;
        this.pendingWriteBytes += b.length;
        try {
          await l.fill(first, b);
        } catch {
          // refetched next time
        } finally {
          this.pendingWriteBytes -= b.length;
          for (const w of this.writeLanded.splice(0)) w();
        }
      },
      () => {},
    ));
    const run: Run = { first, bytes, landed };
    for (let k = 0; k < count; k++) this.inflight.set(first + k, run);
    void landed.then(() => {
      for (let k = 0; k < count; k++) if (this.inflight.get(first + k) === run) this.inflight.delete(first + k);
    });
    return run;
  }

  private async fetchRun(first: number, count: number, foreground: boolean): Promise<Uint8Array> {
    while (this.pendingWriteBytes >= MAX_PENDING_WRITE_BYTES) await new Promise<void>((r) => this.writeLanded.push(r));
    const offset = first * this.chunkSize;
    const length = Math.min(count * this.chunkSize, this.opts.size - offset);
    const attempts: SourceAttempt[] = [];
    const tries = this.opts.tries ?? DEFAULT_TRIES;
    const base = this.opts.backoffBaseMs ?? BACKOFF_BASE_MS;
    for (const source of this.opts.sources) {
      if (this.distrusted.has(source)) continue;
      for (let t = 0; t < tries; t++) {
        if (t > 0) await Bun.sleep(Math.min(base * 2 ** (t - 1), BACKOFF_MAX_MS));
        if (this.closed) throw new RemoteReadError(this.digest, offset, length, [...attempts, { source: "-", error: "file closed" }]);
        try {
          const bytes = await this.tryOnce(source, offset, length, foreground);
          const digests = this.opts.chunkDigests;
          if (digests) {
            for (let k = 0; k < count; k++) {
              const want = digests[first + k];
              const piece = bytes.subarray(k * this.chunkSize, k * this.chunkSize + this.chunkLength(first + k));
              const got = new Bun.CryptoHasher("sha256").update(piece).digest("hex");
              if (want && got !== want) throw new SourceError(`chunk ${first + k} hashes to ${got.slice(0, 12)}…, expected ${want.slice(0, 12)}…`, false);
            }
          }
          this.contributed.add(source);
          this.stats.bytesFetched += bytes.length;
          this.stats.chunksFetched += count;
          this.stats.requests++;
          return bytes;
        } catch (e) {
          this.stats.failures[source.name] = (this.stats.failures[source.name] ?? 0) + 1;
          attempts.push({ source: source.name, error: (e as Error).message ?? String(e) });
          if (e instanceof SourceError && !e.retryable) break;
        }
      }
    }
    throw new RemoteReadError(this.digest, offset, length, attempts);
  }

  private async tryOnce(source: ChunkSource, offset: number, length: number, foreground: boolean): Promise<Uint8Array> {
    let release: () => void;
    if (foreground) {
      this.fgWaiting++;
      try {
        release = await this.limiter.acquire();
      } finally {
        if (--this.fgWaiting === 0) for (const f of this.fgIdle.splice(0)) f();
      }
    } else {
      // Background fetches start only while no foreground fetch of this file waits for a permit.
      while (this.fgWaiting > 0) await new Promise<void>((r) => this.fgIdle.push(r));
      release = await this.limiter.acquire();
    }
    const timeoutMs = this.opts.timeoutMs ?? DEFAULT_TIMEOUT_MS;
    const ac = new AbortController();
    const timer = setTimeout(() => ac.abort(new SourceError(`no answer within ${timeoutMs} ms`, true)), timeoutMs);
    try {
      const bytes = await source.read(this.digest, offset, length, ac.signal);
      if (bytes.length !== length) throw new SourceError(`answered ${bytes.length} of ${length} bytes`, true);
      return bytes;
    } catch (e) {
      if (ac.signal.aborted) throw ac.signal.reason;
      throw e;
    } finally {
      clearTimeout(timer);
      release();
    }
  }

  /**
   * Fill the cache with the whole layer at low priority, verify it and promote it to a local file
   * (the path). Idempotent; chunks already cached (from an earlier process too) are not fetched
   * again. Rejects with LayerDigestError on a mismatch (and this file fails later reads), with
   * RemoteReadError when a chunk cannot be fetched.
   */
  download(): Promise<string> {
    if (this.local) return Promise.resolve(this.local.name);
    if (this.failed) return Promise.reject(this.failed);
    this.downloading ??= trackRemote(this.downloadNow().finally(() => (this.downloading = undefined)));
    return this.downloading;
  }

  private async downloadNow(): Promise<string> {
    const cache = this.opts.cache;
    if (!cache) throw new RemoteSpecError("a download needs a block cache to promote into", this.name);
    if (this.opts.size > cache.lowBytes)
      throw new RemoteSpecError(`the layer (${this.opts.size} bytes) does not fit under the cache's low watermark (${cache.lowBytes} bytes)`, this.name);
    const run = Math.max(1, Math.floor(RUN_MAX_BYTES / this.chunkSize));
    // Chunks evicted while the layer fills are fetched again; three passes (and one more per source distrusted), then give up.
    for (let pass = 0; pass < 3 + this.distrusted.size; pass++) {
      const l = await this.openLayer();
      if (!l) throw new RemoteSpecError("the block cache cannot hold this layer", this.name);
      if (this.local) return this.local.name;
      let next = 0;
      const worker = async () => {
        while (next < this.count && !this.closed) {
          const a = next;
          next = Math.min(this.count, next + run);
          // Present already (another thread or process sharing the cache wrote it): not fetched again.
          for (const r of this.request(a, next, false)) {
            await r.bytes;
            await r.landed;
          }
        }
      };
      await Promise.all(Array.from({ length: DOWNLOAD_PARALLEL }, worker));
      await this.settled();
      if (this.closed) throw new RemoteSpecError("closed during download", this.name);
      if (existsSync(cache.promotedPath(this.digest))) {
        this.local = LocalFile.open(cache.promotedPath(this.digest));
        return this.local.name;
      }
      let path: string | undefined;
      try {
        path = await l.promote(cache.promotedPath(this.digest));
      } catch (e) {
        // The chunks are dropped: what served them, short of the last source, is blamed and the layer fetched again without it.
        const last = this.opts.sources[this.opts.sources.length - 1];
        const blamed = e instanceof LayerDigestError ? [...this.contributed].filter((c) => c !== last) : [];
        this.contributed.clear();
        if (blamed.length) {
          for (const b of blamed) this.distrusted.add(b);
          this.stats.distrusted = [...this.distrusted].map((d) => d.name);
          console.error(`remote layer ${this.digest}: ${(e as Error).message}; ${blamed.map((b) => b.name).join(", ")} served some of it: fetched again without ${blamed.length > 1 ? "them" : "it"}`);
          continue;
        }
        this.failed = e as Error;
        throw e;
      }
      if (path) {
        this.local = LocalFile.open(path);
        return path;
      }
    }
    throw new RemoteSpecError("the cache evicted the layer's chunks faster than they were fetched", this.name);
  }

  get isClosed(): boolean {
    return this.closed;
  }

  /** Every fetch started so far has landed in the cache (or failed). */
  async settled(): Promise<void> {
    while (this.inflight.size) await Promise.all([...new Set(this.inflight.values())].map((f) => f.landed));
  }

  /** Stops the download after its fetches in flight; waits for their cache writes. */
  async close(): Promise<void> {
    this.closed = true;
    await this.downloading?.catch(() => {});
    await this.layerOpen;
    await this.settled();
    await this.local?.close();
    const l = this.layer;
    this.layer = undefined;
    if (l) await this.opts.cache!.unref(l);
  }
}
