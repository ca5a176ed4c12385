// BlockCache: chunks of remote layers on local disk, one file per chunk, keyed by (layer digest,
// chunk size, chunk index): DIR/chunks/<hex>-<chunkSize>/<index>. Rules:
// - A chunk appears under its final name only whole: written to a temp name, synced, renamed. A
//   crash leaves at most temp files, removed at the next open; restart rescans the folders.
// - Usage is kept between two watermarks of `capacity`: when a write takes it past `high`
//   (default 90 %), least recently used chunks go until it is under `low` (default 70 %).
//   Chunks pinned by a read in progress are skipped.
// - Memory: one small entry per cached chunk (capacity / chunkSize of them) and at most
//   MAX_OPEN_CHUNKS open files.
// - Another process may share the folder: eviction is an unlink, so a reader that has the file
//   open still reads whole bytes, and one that finds it gone fetches it again. Each process
//   (each thread: blockd's device workers) enforces the capacity on the chunks it knows: those
//   found at open, those it wrote, and those another one wrote that a miss found on disk.
// Promoted layers (whole, verified) live in DIR/layers/<hex>, outside the chunk budget.

import { mkdir, readdir, rename, rm, stat, unlink } from "node:fs/promises";
import { join } from "node:path";
import { LocalFile } from "../local_file.ts";
import { ConfigError } from "../errors.ts";
import { LayerDigestError } from "./errors.ts";

/** Chunk files kept open for reads; past this the least recently used unpinned ones close. */
export const MAX_OPEN_CHUNKS = 256;
/** Bytes hashed and copied per step when a layer is promoted. */
const PROMOTE_STEP = 4 << 20;

export interface BlockCacheOptions {
  dir: string;
  /** Bytes of chunks this cache may hold. */
  capacity: number;
  /** Fraction of capacity past which eviction starts (default 0.9). */
  high?: number;
  /** Fraction of capacity eviction brings usage under (default 0.7). */
  low?: number;
}

interface Entry {
  bytes: number;
  pins: number;
  file: LocalFile | undefined;
}

/** A chunk held for reading: it is not evicted until release(). */
export interface PinnedChunk {
  file: LocalFile;
  release(): void;
}

const instances = new Map<string, Promise<BlockCache>>();

export class BlockCache {
  /** Map order is recency: a use moves the entry to the end. */
  private entries = new Map<string, Entry>();
  private used = 0;
  private openFiles = 0;
  /**
   * Chunks this instance evicted and is unlinking, each with its unlink's end: not adopted back
   * from disk meanwhile, and a put of one renames its new file into place only after.
   */
  private readonly unlinking = new Map<string, Promise<void>>();
  /** Puts in flight by chunk: a second put of one joins the first (at most one rename per chunk at a time). */
  private readonly putting = new Map<string, Promise<void>>();
  readonly highBytes: number;
  readonly lowBytes: number;
  /** Counters for tests and benchmarks. */
  readonly stats = { evicted: 0, written: 0, hits: 0, misses: 0, adopted: 0 };

  private constructor(readonly opts: Required<BlockCacheOptions>) {
    this.highBytes = Math.floor(opts.capacity * opts.high);
    this.lowBytes = Math.floor(opts.capacity * opts.low);
  }

  /** Open (and rescan) the cache in `dir`. */
  static async open(o: BlockCacheOptions): Promise<BlockCache> {
    const opts = { high: 0.9, low: 0.7, ...o };
    if (!Number.isSafeInteger(opts.capacity) || opts.capacity <= 0) throw new ConfigError(`block cache capacity must be a positive byte count, got ${opts.capacity}`, opts.dir);
    if (!(opts.low > 0 && opts.low < opts.high && opts.high <= 1)) throw new ConfigError(`block cache watermarks need 0 < low < high <= 1, got ${opts.low}, ${opts.high}`, opts.dir);
    const c = new BlockCache(opts);
    await c.rescan();
    return c;
  }

  /** One instance per folder in this thread (devices of one worker share it). */
  static shared(o: BlockCacheOptions): Promise<BlockCache> {
    let p = instances.get(o.dir);
    if (!p) {
      p = BlockCache.open(o);
      instances.set(o.dir, p);
      p.catch(() => instances.delete(o.dir));
    }
    return p;
  }

  get dir(): string {
    return this.opts.dir;
  }
  get capacity(): number {
    return this.opts.capacity;
  }
  /** Bytes of chunks held now. */
  get usage(): number {
    return this.used;
  }

  private layerDir(hex: string, chunkSize: number): string {
    return join(this.opts.dir, "chunks", `${hex}-${chunkSize}`);
  }
  private key(hex: string, chunkSize: number, index: number): string {
    return `${hex}-${chunkSize}/${index}`;
  }
  private path(key: string): string {
    return join(this.opts.dir, "chunks", key);
  }

  /** Where a promoted layer lives (whether or not it exists). */
  promotedPath(digest: string): string {
    return join(this.opts.dir, "layers", hexOf(digest));
  }

  private async rescan(): Promise<void> {
    const root = join(this.opts.dir, "chunks");
    await mkdir(root, { recursive: true });
    await mkdir(join(this.opts.dir, "layers"), { recursive: true });
    for (const name of await readdir(join(this.opts.dir, "layers"))) if (name.includes(".tmp.")) await rm(join(this.opts.dir, "layers", name), { force: true });
    const found: { key: string; bytes: number; mtime: number }[] = [];
    for (const layer of await readdir(root)) {
      for (const name of await readdir(join(root, layer)).catch(() => [] as string[])) {
        const p = join(root, layer, name);
        if (name.includes(".tmp.")) {
          await rm(p, { force: true });
          continue;
        }
        const st = await stat(p).catch(() => undefined);
        if (st?.isFile()) found.push({ key: `${layer}/${name}`, bytes: st.size, mtime: st.mtimeMs });
      }
    }
    found.sort((a, b) => a.mtime - b.mtime);
    for (const f of found) {
      this.entries.set(f.key, { bytes: f.bytes, pins: 0, file: undefined });
      this.used += f.bytes;
    }
    if (this.used > this.highBytes) await this.evict();
  }

  has(digest: string, chunkSize: number, index: number): boolean {
    return this.entries.has(this.key(hexOf(digest), chunkSize, index));
  }

  /** The chunk indices of a layer held now. */
  held(digest: string, chunkSize: number): number[] {
    const prefix = `${hexOf(digest)}-${chunkSize}/`;
    const out: number[] = [];
    for (const k of this.entries.keys()) if (k.startsWith(prefix)) out.push(Number(k.slice(prefix.length)));
    return out;
  }

  /** Hold a cached chunk for reading, or undefined when it is not here (or another process evicted it). */
  pin(digest: string, chunkSize: number, index: number): PinnedChunk | undefined {
    const key = this.key(hexOf(digest), chunkSize, index);
    const e = this.entries.get(key) ?? this.adopt(key);
    if (!e) {
      this.stats.misses++;
      return undefined;
    }
    if (!e.file) {
      try {
        e.file = LocalFile.open(this.path(key));
      } catch {
        // Gone under us (another process evicted it): a miss.
        this.entries.delete(key);
        this.used -= e.bytes;
        this.stats.misses++;
        return undefined;
      }
      this.openFiles++;
    }
    this.entries.delete(key);
    this.entries.set(key, e);
    e.pins++;
    // Only after the pin: closing down to 3/4 of MAX_OPEN_CHUNKS skips pinned chunks, this one too.
    if (this.openFiles > MAX_OPEN_CHUNKS) this.closeSome();
    this.stats.hits++;
    let done = false;
    return {
      file: e.file,
      release: () => {
        if (done) return;
        done = true;
        e.pins--;
      },
    };
  }

  /**
   * A chunk this instance does not know but another thread or process wrote (its final name exists
   * only whole): taken into this instance's entries, accounted, and evicted from here on like its
   * own. One failed open per miss; a miss goes to the network anyway.
   */
  private adopt(key: string): Entry | undefined {
    if (this.unlinking.has(key)) return undefined;
    let file: LocalFile;
    try {
      file = LocalFile.open(this.path(key));
    } catch {
      return undefined;
    }
    const e: Entry = { bytes: file.size(), pins: 0, file };
    this.openFiles++;
    this.entries.set(key, e);
    this.used += e.bytes;
    this.stats.adopted++;
    // After the caller's pin (same tick): eviction skips the chunk being read.
    if (this.used > this.highBytes) queueMicrotask(() => void this.evict());
    return e;
  }

  private closeSome(): void {
    for (const e of this.entries.values()) {
      if (this.openFiles <= MAX_OPEN_CHUNKS * 0.75) break;
      if (e.pins === 0) this.closeFile(e);
    }
  }

  private closeFile(e: Entry): void {
    if (!e.file) return;
    void e.file.close();
    e.file = undefined;
    this.openFiles--;
  }

  /** Store a whole chunk (temp, sync, rename), then evict down to the low watermark if past the high one. */
  put(digest: string, chunkSize: number, index: number, bytes: Uint8Array): Promise<void> {
    const hex = hexOf(digest);
    const key = this.key(hex, chunkSize, index);
    if (this.entries.has(key)) return Promise.resolve();
    const cur = this.putting.get(key);
    if (cur) return cur;
    const p = this.putNow(hex, chunkSize, key, bytes).finally(() => this.putting.delete(key));
    this.putting.set(key, p);
    return p;
  }

  private async putNow(hex: string, chunkSize: number, key: string, bytes: Uint8Array): Promise<void> {
    const dir = this.layerDir(hex, chunkSize);
    await mkdir(dir, { recursive: true });
    const final = this.path(key);
    const tmp = `${final}.tmp.${process.pid}.${Math.random().toString(36).slice(2)}`;
    const f = LocalFile.open(tmp, { create: true });
    try {
      await f.pwrite(bytes, 0);
      await f.fdatasync();
    } catch (e) {
      await f.close();
      await rm(tmp, { force: true });
      throw e;
    }
    await f.close();
    // An eviction's unlink still to come would take the new file: it goes first.
    for (let gone = this.unlinking.get(key); gone; gone = this.unlinking.get(key)) await gone;
    await rename(tmp, final);
    if (this.entries.has(key)) return; // a racing put of the same chunk
    this.entries.set(key, { bytes: bytes.length, pins: 0, file: undefined });
    this.used += bytes.length;
    this.stats.written++;
    if (this.used > this.highBytes) await this.evict();
  }

  /**
   * Least recently used unpinned chunks go until usage is under the low watermark. They are
   * forgotten and accounted at once (no await between a write's accounting and this), and
   * unlinked after: a read that pins one from now on finds it gone and refetches; one already
   * reading keeps its open file.
   */
  private async evict(): Promise<void> {
    const gone: [string, () => void][] = [];
    for (const [k, e] of this.entries) {
      if (this.used <= this.lowBytes) break;
      if (e.pins > 0) continue;
      this.entries.delete(k);
      this.used -= e.bytes;
      this.closeFile(e);
      const unlinked = Promise.withResolvers<void>();
      this.unlinking.set(k, unlinked.promise);
      gone.push([k, unlinked.resolve]);
      this.stats.evicted++;
    }
    for (const [k, done] of gone) {
      await unlink(this.path(k)).catch(() => {});
      this.unlinking.delete(k);
      done();
    }
  }

  /** Forget every chunk of a layer (a failed verification). */
  async dropLayer(digest: string, chunkSize: number): Promise<void> {
    const prefix = `${hexOf(digest)}-${chunkSize}/`;
    for (const [k, e] of [...this.entries]) {
      if (!k.startsWith(prefix)) continue;
      this.entries.delete(k);
      this.used -= e.bytes;
      this.closeFile(e);
    }
    await rm(this.layerDir(hexOf(digest), chunkSize), { recursive: true, force: true });
  }

  /**
   * Join a layer's `count` chunks into DIR/layers/<hex> while hashing them: the path when the
   * sha256 matches the digest, undefined when a chunk is missing (evicted meanwhile). A mismatch
   * drops every chunk of the layer and throws LayerDigestError. The chunks are dropped after.
   */
  async promote(digest: string, chunkSize: number, size: number): Promise<string | undefined> {
    const final = this.promotedPath(digest);
    const tmp = `${final}.tmp.${process.pid}.${Math.random().toString(36).slice(2)}`;
    const count = Math.ceil(size / chunkSize);
    const hasher = new Bun.CryptoHasher("sha256");
    const out = LocalFile.open(tmp, { create: true });
    let complete = true;
    try {
      const step = new Uint8Array(Math.min(PROMOTE_STEP, chunkSize));
      for (let i = 0; i < count && complete; i++) {
        const c = this.pin(digest, chunkSize, i);
        if (!c) {
          complete = false;
          break;
        }
        try {
          const len = Math.min(chunkSize, size - i * chunkSize);
          if (c.file.size() !== len) {
            complete = false;
            break;
          }
          for (let at = 0; at < len; at += step.length) {
            const piece = step.subarray(0, Math.min(step.length, len - at));
            const n = await c.file.pread(piece, at);
            if (n !== piece.length) {
              complete = false;
              break;
            }
            hasher.update(piece);
            await out.pwrite(piece, i * chunkSize + at);
          }
        } finally {
          c.release();
        }
      }
      if (complete) await out.fdatasync();
    } finally {
      await out.close();
    }
    if (!complete) {
      await rm(tmp, { force: true });
      return undefined;
    }
    const actual = hasher.digest("hex");
    if (actual !== hexOf(digest)) {
      await rm(tmp, { force: true });
      await this.dropLayer(digest, chunkSize);
      throw new LayerDigestError(digest, actual);
    }
    await rename(tmp, final);
    await this.dropLayer(digest, chunkSize);
    return final;
  }

  async close(): Promise<void> {
    for (const e of this.entries.values()) {
      if (e.file) await e.file.close();
      e.file = undefined;
    }
    this.openFiles = 0;
    if (instances.get(this.opts.dir)) {
      const mine = await instances.get(this.opts.dir)!.catch(() => undefined);
      if (mine === this) instances.delete(this.opts.dir);
    }
  }
}

export function hexOf(digest: string): string {
  return digest.startsWith("sha256:") ? digest.slice(7) : digest;
}
