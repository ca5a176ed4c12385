// RemoteFile: a layer that lives elsewhere, read through the one random-access file interface.
// Rules:
// - A read is split into aligned chunks (default 1 MiB). Each chunk comes from the BlockCache,
//   else from the sources in order: each source is tried up to `tries` times with exponential
//   backoff (non-retryable failures move on at once), each try under `timeoutMs`, each holding
//   one permit of the node-wide IoLimiter. An answer of the wrong length is a failure.
// - When every source failed the read rejects with RemoteReadError: the caller gets EIO, never
//   wrong or missing bytes, and nothing is cached.
// - Two reads of the same missing chunk share one fetch.
// - With `chunkDigests` (sha256 per chunk) every fetched chunk is checked before use; without,
//   bytes are as good as the source's transport until the whole layer is verified at promotion.
// - download() fills the whole layer at low priority (foreground fetches go first), then joins
//   the chunks and checks the layer's sha256: on a match the layer becomes a local file and reads
//   go there; on a mismatch its chunks are dropped and this file fails every later read.
// - Several threads or processes may open one layer over one cache folder (blockd's device
//   workers): a chunk or a promoted layer another one wrote is found on disk at a miss, not fetched.

import type { ReadableFile } from "../file.ts";
import { IoLimiter } from "../io_limiter.ts";
import { LocalFile } from "../local_file.ts";
import { existsSync } from "node:fs";
import type { BlockCache } from "./block_cache.ts";
import { type SourceAttempt, RemoteReadError, RemoteSpecError } from "./errors.ts";
import { type ChunkSource, type LayerDigest, SourceError } from "./source.ts";
import { DEFAULT_CHUNK_SIZE, checkRemoteShape } from "./spec.ts";
import { trackRemote } from "./pending.ts";

/** Tries per source for one chunk. */
export const DEFAULT_TRIES = 3;
/** Backoff before try n (n ≥ 1) is base·2^(n-1), capped at BACKOFF_MAX_MS. */
export const BACKOFF_BASE_MS = 100;
export const BACKOFF_MAX_MS = 2_000;
export const DEFAULT_TIMEOUT_MS = 30_000;
/** Chunk fetches the background download keeps in flight. */
export const DOWNLOAD_PARALLEL = 4;
/** Cache writes of fetched chunks in flight per file; past this a fetch waits for one to land. */
const MAX_PENDING_WRITES = 16;

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
  tries?: number;
  timeoutMs?: number;
  backoffBaseMs?: number;
}

interface InFlight {
  bytes: Promise<Uint8Array>;
  landed: Promise<void>;
}

export interface RemoteFileStats {
  /** Bytes received from sources (answers that were used). */
  bytesFetched: number;
  chunksFetched: number;
  /** Chunks read from the cache. */
  cacheHits: number;
  /** Failed tries per source name. */
  failures: Record<string, number>;
}

export class RemoteFile implements ReadableFile {
  readonly name: string;
  readonly digest: LayerDigest;
  readonly chunkSize: number;
  readonly stats: RemoteFileStats = { bytesFetched: 0, chunksFetched: 0, cacheHits: 0, failures: {} };
  private readonly limiter: IoLimiter;
  private readonly inflight = new Map<number, InFlight>();
  private pendingWrites = 0;
  private writeLanded: (() => void)[] = [];
  private fgWaiting = 0;
  private fgIdle: (() => void)[] = [];
  private local: LocalFile | undefined;
  private failed: Error | undefined;
  private downloading: Promise<string> | undefined;
  private closed = false;

  private constructor(private readonly opts: RemoteFileOptions) {
    checkRemoteShape(opts.digest, opts.size, opts.chunkSize, opts.chunkDigests, `remote:${opts.digest}`);
    this.digest = opts.digest;
    this.name = `remote:${opts.digest}`;
    this.chunkSize = opts.chunkSize ?? DEFAULT_CHUNK_SIZE;
    this.limiter = opts.limiter ?? IoLimiter.create(8);
  }

  /** A remote layer; when the cache already holds it promoted, reads go to that local file. */
  static open(opts: RemoteFileOptions): RemoteFile {
    const f = new RemoteFile(opts);
    const p = opts.cache?.promotedPath(opts.digest);
    if (p && existsSync(p)) f.local = LocalFile.open(p);
    return f;
  }

  size(): number {
    return this.opts.size;
  }

  /** The promoted local file's path once the layer is whole and verified. */
  get localPath(): string | undefined {
    return this.local?.name;
  }

  async pread(buf: Uint8Array, offset: number): Promise<number> {
    if (this.failed) throw this.failed;
    if (this.local) return this.local.pread(buf, offset);
    const n = Math.max(0, Math.min(buf.length, this.opts.size - offset));
    if (n === 0) return 0;
    const cs = this.chunkSize;
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

  private async readPiece(index: number, inChunk: number, dst: Uint8Array): Promise<void> {
    const cache = this.opts.cache;
    const pinned = cache?.pin(this.digest, this.chunkSize, index);
    if (pinned) {
      try {
        const got = await pinned.file.pread(dst, inChunk);
        if (got === dst.length) {
          this.stats.cacheHits++;
          return;
        }
      } finally {
        pinned.release();
      }
    }
    // Promoted by another thread or process (a device worker beside this one): its file from now on.
    const promoted = cache && !this.local ? cache.promotedPath(this.digest) : undefined;
    if (promoted && existsSync(promoted)) this.local ??= LocalFile.open(promoted);
    if (this.local) {
      if ((await this.local.pread(dst, index * this.chunkSize + inChunk)) === dst.length) return;
      throw new RemoteReadError(this.digest, index * this.chunkSize + inChunk, dst.length, [{ source: this.local.name, error: "short read of the promoted layer" }]);
    }
    const bytes = await this.chunk(index, true).bytes;
    dst.set(bytes.subarray(inChunk, inChunk + dst.length));
  }

  private chunkLength(index: number): number {
    return Math.min(this.chunkSize, this.opts.size - index * this.chunkSize);
  }

  /**
   * A chunk's bytes, fetched once however many reads want it; `landed` settles once it is in
   * the cache (or the write failed: a full or broken disk costs a refetch, never a failed read).
   */
  private chunk(index: number, foreground: boolean): InFlight {
    let f = this.inflight.get(index);
    if (f) return f;
    const bytes = this.fetchChunk(index, foreground);
    const landed = trackRemote(bytes.then(
      async (b) => {
        const cache = this.opts.cache;
        if (!cache) return;
        this.pendingWrites++;
        try {
          await cache.put(this.digest, this.chunkSize, index, b);
        } catch {
          // refetched next time
        } finally {
          this.pendingWrites--;
          for (const w of this.writeLanded.splice(0)) w();
        }
      },
      () => {},
    ));
    // Kept in flight until it lands in the cache, so a read in between does not fetch again.
    f = { bytes, landed };
    this.inflight.set(index, f);
    void landed.then(() => this.inflight.delete(index));
    return f;
  }

  private async fetchChunk(index: number, foreground: boolean): Promise<Uint8Array> {
    while (this.pendingWrites >= MAX_PENDING_WRITES) await new Promise<void>((r) => this.writeLanded.push(r));
    const offset = index * this.chunkSize;
    const length = this.chunkLength(index);
    const attempts: SourceAttempt[] = [];
    const tries = this.opts.tries ?? DEFAULT_TRIES;
    const base = this.opts.backoffBaseMs ?? BACKOFF_BASE_MS;
    for (const source of this.opts.sources) {
      for (let t = 0; t < tries; t++) {
        if (t > 0) await Bun.sleep(Math.min(base * 2 ** (t - 1), BACKOFF_MAX_MS));
        if (this.closed) throw new RemoteReadError(this.digest, offset, length, [...attempts, { source: "-", error: "file closed" }]);
        try {
          const bytes = await this.tryOnce(source, offset, length, foreground);
          const want = this.opts.chunkDigests?.[index];
          if (want) {
            const got = new Bun.CryptoHasher("sha256").update(bytes).digest("hex");
            if (got !== want) throw new SourceError(`chunk ${index} hashes to ${got.slice(0, 12)}…, expected ${want.slice(0, 12)}…`, false);
          }
          this.stats.bytesFetched += bytes.length;
          this.stats.chunksFetched++;
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
    const count = Math.ceil(this.opts.size / this.chunkSize);
    // Chunks evicted while the layer fills are fetched again; three passes, then give up.
    for (let pass = 0; pass < 3; pass++) {
      const held = new Set(cache.held(this.digest, this.chunkSize));
      const missing: number[] = [];
      for (let i = 0; i < count; i++) if (!held.has(i)) missing.push(i);
      let next = 0;
      const worker = async () => {
        while (next < missing.length && !this.closed) {
          const i = missing[next++]!;
          // Written meanwhile by another thread or process sharing the cache: not fetched again.
          const have = cache.pin(this.digest, this.chunkSize, i);
          if (have) {
            have.release();
            continue;
          }
          const f = this.chunk(i, false);
          await f.bytes;
          await f.landed;
        }
      };
      await Promise.all(Array.from({ length: DOWNLOAD_PARALLEL }, worker));
      if (this.closed) throw new RemoteSpecError("closed during download", this.name);
      let path: string | undefined;
      try {
        path = await cache.promote(this.digest, this.chunkSize, this.opts.size);
      } catch (e) {
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
    while (this.inflight.size) await Promise.all([...this.inflight.values()].map((f) => f.landed));
  }

  /** Stops the download after its fetches in flight; waits for their cache writes. */
  async close(): Promise<void> {
    this.closed = true;
    await this.downloading?.catch(() => {});
    await this.settled();
    await this.local?.close();
  }
}
