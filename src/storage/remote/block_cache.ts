// BlockCache: remote layers' bytes on local disk. One sparse data file per (layer, chunk size),
// DIR/sparse/<hex>-<chunkSize>.data, chunks at their layer offsets, and beside it a presence map,
// DIR/sparse/<hex>-<chunkSize>.map, mapped MAP_SHARED by every thread and process that opens the
// layer: per chunk one Int32 state word (generation · 8 + state), one Int32 "since" (seconds) and
// one Int32 owner (the pid that holds a claim).
// Rules:
// - A chunk is read only while its word says present, and its bytes count only if the word is the
//   same after the pread (seqlock): an eviction changes the word before it punches the bytes, so a
//   pread that raced one in any thread or process is thrown away and the chunk fetched again.
// - One writer per chunk: a fill claims the word (ABSENT → FILLING) before its pwrite and marks it
//   PRESENT after; an eviction claims it (PRESENT/DURABLE → EVICTING), punches, then ABSENT with the
//   next generation. A claim whose owner process is gone, or older than CLAIM_STALE_S (a dead
//   thread of a live process), is taken over.
// - Durability: a chunk becomes DURABLE only after an fdatasync of the data file that followed its
//   write (batched: every SYNC_BYTES written or SYNC_MS). An eviction of a DURABLE chunk syncs the
//   map (EVICTING on disk) before it punches. At open, PRESENT, FILLING and EVICTING words whose
//   `since` predates this boot go ABSENT (a machine crash may have lost their data), and so do
//   chunks past the data file's end: a torn map or a short data file never yields wrong bytes.
// - Usage is kept between two watermarks of `capacity`: past `high` (default 90 %) the least
//   recently used chunks go (FALLOC_FL_PUNCH_HOLE) until under `low` (default 70 %); chunks
//   pinned by a read in progress in this thread are skipped. Each thread or process counts the
//   layers it knows (found at open, opened since), as every one of them sees the shared words.
// - A layer whose every chunk is present is sealed (SEALED words are never evicted), synced,
//   hashed and, when its sha256 is its digest, promoted by a hard link of the same data file to
//   DIR/layers/<hex> (outside the chunk budget); its map is retired and both cache names unlinked.
//   Readers with the old files open keep reading the same (verified) inode.
// - Old per-chunk folders (DIR/chunks/) are removed at open.

import { fdatasync, write as fsWrite } from "node:fs";
import { link, mkdir, readFile, readdir, rm, stat, unlink, writeFile } from "node:fs/promises";
import { join } from "node:path";
import { MAP_ANONYMOUS, MAP_FIXED, MAP_PRIVATE, MAP_SHARED, PROT_READ, PROT_WRITE, PAGE_SIZE, type AlignedBuffer, allocAligned, mmap, viewAt } from "../../../ffi/libc.ts";
import { LocalFile } from "../local_file.ts";
import { ConfigError } from "../errors.ts";
import { LayerDigestError } from "./errors.ts";
import { trackRemote } from "./pending.ts";

/** Bytes hashed per step when a layer is promoted. */
const PROMOTE_STEP = 4 << 20;
/** Data written since the last fdatasync that triggers the next one, and the longest wait for it. */
export const SYNC_BYTES = 64 << 20;
export const SYNC_MS = 1_000;
/** A FILLING or EVICTING claim older than this is a dead thread's: the next one takes it over. */
export const CLAIM_STALE_S = 60;
/** Fills are written O_DIRECT in pieces of this, through this many page-aligned buffers per thread. */
const DIRECT_PIECE = 1 << 20;
const DIRECT_BUFFERS = 16;
/** Layer handles kept open in this thread with no RemoteFile on them. */
const MAX_IDLE_LAYERS = 64;

// Map file: a header of HEADER_INTS Int32s, then `count` state words, `count` since, `count` owners.
const MAGIC = 0x41454e42; // "AENB"
const VERSION = 1;
const HEADER_INTS = 16;
const H_MAGIC = 0, H_VERSION = 1, H_CHUNK = 2, H_COUNT = 3, H_SIZE_LO = 4, H_SIZE_HI = 5, H_RETIRED = 6;

export const ABSENT = 0;
export const PRESENT = 1;
export const DURABLE = 2;
export const FILLING = 3;
export const EVICTING = 4;
export const SEALED = 5;
const GEN = 8;
const GEN_MASK = 0x0fffffff;
/** Present states (PRESENT, DURABLE, SEALED) by the word's low 3 bits. */
const READABLE = [false, true, true, false, false, true, false, false];
export const isReadable = (w: number): boolean => READABLE[w & 7]!;
const nextGen = (w: number) => (((w >>> 3) + 1) & GEN_MASK) * GEN;
const EPOCH_S = 1_700_000_000;
const nowS = () => Math.floor(Date.now() / 1000) - EPOCH_S;

export interface BlockCacheOptions {
  dir: string;
  /** Bytes of chunks this cache may hold. */
  capacity: number;
  /** Fraction of capacity past which eviction starts (default 0.9). */
  high?: number;
  /** Fraction of capacity eviction brings usage under (default 0.7). */
  low?: number;
}

const instances = new Map<string, Promise<BlockCache>>();

/** One layer's cache files as this thread sees them. */
export class CachedLayer {
  readonly count: number;
  /** Shared state words (mmap of the map file). */
  readonly words: Int32Array;
  /** Shared seconds of each word's last change. */
  readonly since: Int32Array;
  /** Shared pid holding each FILLING or EVICTING claim. */
  readonly owner: Int32Array;
  private readonly header: Int32Array;
  /** This thread's reads in progress per chunk: never evicted by this thread. */
  readonly pins: Uint16Array;
  /** This thread's recency per chunk (the cache's tick at the last use). */
  readonly lastUse: Float64Array;
  /** RemoteFiles of this thread on this layer. */
  refs = 0;
  closed = false;
  /** Chunks written since the last sync of the data file, with the word each was marked with. */
  unsynced: number[] = [];

  constructor(
    readonly cache: BlockCache,
    readonly key: string,
    readonly digest: string,
    readonly size: number,
    readonly chunkSize: number,
    readonly data: LocalFile,
    /** The data file opened O_DIRECT for fills (undefined where the filesystem refuses it: buffered then). */
    private readonly direct: LocalFile | undefined,
    readonly mapFile: LocalFile,
    private readonly addr: number,
    private readonly mapLen: number,
  ) {
    this.count = Math.ceil(size / chunkSize);
    const v = viewAt(addr, mapLen);
    this.header = new Int32Array(v.buffer, v.byteOffset, HEADER_INTS);
    this.words = new Int32Array(v.buffer, v.byteOffset + HEADER_INTS * 4, this.count);
    this.since = new Int32Array(v.buffer, v.byteOffset + (HEADER_INTS + this.count) * 4, this.count);
    this.owner = new Int32Array(v.buffer, v.byteOffset + (HEADER_INTS + 2 * this.count) * 4, this.count);
    this.pins = new Uint16Array(this.count);
    this.lastUse = new Float64Array(this.count);
  }

  get retired(): boolean {
    return Atomics.load(this.header, H_RETIRED) !== 0;
  }

  chunkLength(i: number): number {
    return Math.min(this.chunkSize, this.size - i * this.chunkSize);
  }

  has(i: number): boolean {
    return isReadable(Atomics.load(this.words, i));
  }

  /** Chunk indices present now. */
  held(): number[] {
    const out: number[] = [];
    for (let i = 0; i < this.count; i++) if (isReadable(Atomics.load(this.words, i))) out.push(i);
    return out;
  }

  /** Bytes of the chunks present now. */
  presentBytes(): number {
    let n = 0;
    for (let i = 0; i < this.count; i++) if (isReadable(Atomics.load(this.words, i))) n += this.chunkLength(i);
    return n;
  }

  /**
   * Read `dst.length` bytes at layer offset `offset`, inside chunk `i`, from the data file: true
   * when the chunk was present before and after the pread (the bytes are right), false otherwise.
   */
  async read(i: number, dst: Uint8Array, offset: number): Promise<boolean> {
    const w = Atomics.load(this.words, i);
    if (!isReadable(w) || this.closed) return false;
    this.pins[i]!++;
    this.lastUse[i] = ++this.cache.tick;
    try {
      const got = await this.data.pread(dst, offset);
      return got === dst.length && Atomics.load(this.words, i) === w;
    } catch (e) {
      if (this.closed) return false; // closed under the read: fetched instead
      throw e;
    } finally {
      this.pins[i]!--;
    }
  }

  /** Claim chunk i for a fill: the claimed word, or -1 (present, or another fill or eviction holds it). */
  private claim(i: number): number {
    const w = Atomics.load(this.words, i);
    const st = w & 7;
    let base: number;
    if (st === ABSENT) base = w;
    else if ((st === FILLING || st === EVICTING) && this.claimStale(i)) base = nextGen(w);
    else return -1;
    // Owner and time first: a claim is never seen with a dead one's.
    Atomics.store(this.since, i, nowS());
    Atomics.store(this.owner, i, process.pid);
    if (Atomics.compareExchange(this.words, i, w, base + FILLING) !== w) return -1;
    return base + FILLING;
  }

  /** A FILLING or EVICTING claim nobody will finish: its process is gone, or it is older than CLAIM_STALE_S. */
  claimStale(i: number): boolean {
    if (nowS() - Atomics.load(this.since, i) > CLAIM_STALE_S) return true;
    const pid = Atomics.load(this.owner, i);
    if (pid === process.pid) return false;
    try {
      process.kill(pid, 0);
      return false;
    } catch (e) {
      return (e as NodeJS.ErrnoException).code === "ESRCH";
    }
  }

  /**
   * Write chunks first..first+n-1 (`bytes` holds them, in order) where absent, then mark them
   * present. Chunks another thread holds or has are left alone. Resolves with the bytes marked.
   */
  async fill(first: number, bytes: Uint8Array): Promise<number> {
    if (this.closed || this.retired) return 0;
    const cs = this.chunkSize;
    const n = Math.ceil(bytes.length / cs);
    const claimed: number[] = new Array(n).fill(-1);
    for (let k = 0; k < n; k++) claimed[k] = this.claim(first + k);
    let marked = 0;
    try {
      // One pwrite per run of claimed chunks.
      const writes: Promise<void>[] = [];
      for (let k = 0; k < n; ) {
        if (claimed[k]! < 0) {
          k++;
          continue;
        }
        let e = k;
        while (e < n && claimed[e]! >= 0) e++;
        writes.push(this.write(bytes.subarray(k * cs, Math.min(bytes.length, e * cs)), (first + k) * cs));
        k = e;
      }
      const results = await Promise.allSettled(writes);
      const failed = results.find((r) => r.status === "rejected");
      for (let k = 0; k < n; k++) {
        const w = claimed[k]!;
        if (w < 0) continue;
        const i = first + k;
        const to = failed ? w - FILLING + ABSENT : w - FILLING + PRESENT;
        if (Atomics.compareExchange(this.words, i, w, to) !== w) continue; // taken over as stale meanwhile
        Atomics.store(this.since, i, nowS());
        if (!failed) {
          marked += this.chunkLength(i);
          this.lastUse[i] = ++this.cache.tick;
          this.unsynced.push(i, to);
        }
      }
      if (failed) throw (failed as PromiseRejectedResult).reason;
    } finally {
      if (marked) this.cache.wrote(this, marked);
    }
    return marked;
  }

  /**
   * Fetched bytes into the data file. Whole DIRECT_PIECEs go O_DIRECT on libuv's pool where the
   * filesystem allows it: a bulk fill neither takes fresh page-cache pages (here ~3 ms of kernel CPU
   * per MiB, more than the fetch) nor holds this thread, and the read that asked is served from the
   * fetched bytes. The rest (small chunks, the layer's tail) is buffered: a random read's
   * neighbours are read soon, from the page cache.
   */
  private async write(bytes: Uint8Array, pos: number): Promise<void> {
    const direct = this.direct;
    const aligned = direct ? bytes.length - (bytes.length % DIRECT_PIECE) : 0;
    const parts: Promise<void>[] = [];
    for (let at = 0; at < aligned; at += DIRECT_PIECE) {
      const n = Math.min(DIRECT_PIECE, aligned - at);
      parts.push(withDirectBuffer(async (b) => {
        b.bytes.set(bytes.subarray(at, at + n));
        await new Promise<void>((resolve, reject) =>
          fsWrite(direct!.fd, b.bytes, 0, n, pos + at, (e, done) => (e ? reject(e) : done !== n ? reject(new Error(`short O_DIRECT write to ${direct!.name}: ${done} of ${n}`)) : resolve())),
        );
      }));
    }
    if (aligned < bytes.length) parts.push(this.data.pwrite(bytes.subarray(aligned), pos + aligned));
    await Promise.all(parts);
    this.data.grow(pos + bytes.length);
  }

  /** fdatasync the data file, then mark the chunks written before it DURABLE. */
  async sync(): Promise<void> {
    if (this.unsynced.length === 0 || this.closed) return;
    const batch = this.unsynced;
    this.unsynced = [];
    await datasync(this.data.fd);
    for (let k = 0; k < batch.length; k += 2) {
      const w = batch[k + 1]!;
      Atomics.compareExchange(this.words, batch[k]!, w, w - PRESENT + DURABLE);
    }
  }

  /**
   * Evict the given chunks (claimed here, then punched): the bytes freed. A chunk pinned here, or
   * not in a present state any more, is skipped.
   */
  async evict(indices: number[]): Promise<number> {
    const taken: [number, number][] = [];
    let durable = false;
    let freed = 0;
    for (const i of indices) {
      if (this.pins[i]! > 0) continue;
      const w = Atomics.load(this.words, i);
      const st = w & 7;
      if (st !== PRESENT && st !== DURABLE) continue;
      const to = w - st + EVICTING;
      Atomics.store(this.since, i, nowS());
      Atomics.store(this.owner, i, process.pid);
      if (Atomics.compareExchange(this.words, i, w, to) !== w) continue;
      if (st === DURABLE) durable = true;
      taken.push([i, to]);
      freed += this.chunkLength(i);
    }
    if (!taken.length) return 0;
    void trackRemote((async () => {
      try {
        // On disk the word must say EVICTING before the bytes go: a machine crash then finds it absent.
        if (durable) await datasync(this.mapFile.fd);
        for (const [i, w] of taken) {
          if (Atomics.load(this.words, i) !== w) continue; // taken over as stale
          await this.data.punchHole(i * this.chunkSize, this.chunkLength(i));
          if (Atomics.compareExchange(this.words, i, w, nextGen(w) + ABSENT) === w) Atomics.store(this.since, i, nowS());
        }
      } catch {
        // Left EVICTING: unreadable, taken over after CLAIM_STALE_S.
      }
    })());
    return freed;
  }

  /**
   * Seal every chunk (no eviction from now on in any thread), sync, hash; on a match hard-link the
   * data file to `final` and retire the cache names. Undefined when a chunk is missing (unsealed
   * again); LayerDigestError (the layer dropped) on a mismatch.
   */
  async promote(final: string): Promise<string | undefined> {
    const sealed: [number, number][] = [];
    let complete = true;
    for (let i = 0; i < this.count && complete; i++) {
      for (;;) {
        const w = Atomics.load(this.words, i);
        const st = w & 7;
        if (st === SEALED) break;
        if (st !== PRESENT && st !== DURABLE) {
          complete = false;
          break;
        }
        if (Atomics.compareExchange(this.words, i, w, w - st + SEALED) === w) {
          sealed.push([i, w]);
          break;
        }
      }
    }
    if (complete && this.data.size() < this.size) complete = false;
    if (!complete) {
      for (const [i, w] of sealed) Atomics.compareExchange(this.words, i, w - (w & 7) + SEALED, w);
      return undefined;
    }
    await datasync(this.data.fd);
    const hasher = new Bun.CryptoHasher("sha256");
    const step = new Uint8Array(Math.min(PROMOTE_STEP, Math.max(this.size, 1)));
    for (let at = 0; at < this.size; at += step.length) {
      const piece = step.subarray(0, Math.min(step.length, this.size - at));
      if ((await this.data.pread(piece, at)) !== piece.length) {
        for (const [i, w] of sealed) Atomics.compareExchange(this.words, i, w - (w & 7) + SEALED, w);
        return undefined;
      }
      hasher.update(piece);
    }
    const actual = hasher.digest("hex");
    if (actual !== hexOf(this.digest)) {
      await this.cache.dropLayer(this);
      throw new LayerDigestError(this.digest, actual);
    }
    await link(this.data.name, final).catch((e: NodeJS.ErrnoException) => {
      if (e.code !== "EEXIST") throw e;
    });
    await this.cache.retire(this);
    return final;
  }

  /** @internal mark every chunk absent and the map retired (a dropped layer). */
  retireWords(dropAll: boolean): void {
    Atomics.store(this.header, H_RETIRED, 1);
    if (!dropAll) return;
    for (let i = 0; i < this.count; i++) {
      const w = Atomics.load(this.words, i);
      Atomics.compareExchange(this.words, i, w, nextGen(w) + ABSENT);
    }
  }

  /** @internal */
  async closeFiles(): Promise<void> {
    if (this.closed) return;
    this.closed = true;
    await this.sync().catch(() => {});
    await this.data.close();
    await this.direct?.close();
    await this.mapFile.close();
    // Zero pages over the map instead of an unmap: a view still held (a RemoteFile used after its
    // cache closed) reads ABSENT and goes the slow way, never into unmapped memory.
    mmap(this.addr, this.mapLen, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
  }
}

interface Known {
  hex: string;
  chunkSize: number;
  /** Bytes present when found at open (layers not opened in this thread). */
  bytes: number;
}

export class BlockCache {
  /** This thread's recency clock. */
  tick = 0;
  private used = 0;
  /** Open layer handles by "<hex>-<chunkSize>". */
  private readonly layers = new Map<string, CachedLayer>();
  private readonly opening = new Map<string, Promise<CachedLayer>>();
  /** Layers found at open and not opened here since. */
  private readonly known = new Map<string, Known>();
  private unsyncedBytes = 0;
  private syncTimer: ReturnType<typeof setTimeout> | undefined;
  private syncing: Promise<void> | undefined;
  private bootS = 0;
  readonly highBytes: number;
  readonly lowBytes: number;
  /** Counters for tests and benchmarks (bytes and chunk counts). */
  readonly stats = { evicted: 0, written: 0, syncs: 0 };

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
  /** Bytes of chunks this thread counts now. */
  get usage(): number {
    return this.used;
  }

  /** Where a promoted layer lives (whether or not it exists). */
  promotedPath(digest: string): string {
    return join(this.opts.dir, "layers", hexOf(digest));
  }

  private base(hex: string, chunkSize: number): string {
    return join(this.opts.dir, "sparse", `${hex}-${chunkSize}`);
  }

  private async rescan(): Promise<void> {
    const sparse = join(this.opts.dir, "sparse");
    await mkdir(sparse, { recursive: true });
    await mkdir(join(this.opts.dir, "layers"), { recursive: true });
    await rm(join(this.opts.dir, "chunks"), { recursive: true, force: true });
    for (const name of await readdir(join(this.opts.dir, "layers"))) if (name.includes(".tmp.")) await rm(join(this.opts.dir, "layers", name), { force: true });
    this.bootS = await bootTimeS();
    for (const name of await readdir(sparse)) {
      const m = /^([0-9a-f]{64})-(\d+)\.map$/.exec(name);
      if (!m) {
        if (name.includes(".tmp.")) await rm(join(sparse, name), { force: true });
        continue;
      }
      const bytes = await this.scanMap(join(sparse, name), join(sparse, name.replace(/\.map$/, ".data")));
      if (bytes === undefined) continue;
      this.known.set(`${m[1]}-${m[2]}`, { hex: m[1]!, chunkSize: Number(m[2]), bytes });
      this.used += bytes;
    }
    if (this.used > this.highBytes) await this.evict();
  }

  /** Present bytes a map file claims that its data file holds; undefined (both removed) when unusable. */
  private async scanMap(mapPath: string, dataPath: string): Promise<number | undefined> {
    const raw = await readFile(mapPath).catch(() => undefined);
    const dataSize = (await stat(dataPath).catch(() => undefined))?.size ?? 0;
    const h = raw && raw.length >= HEADER_INTS * 4 ? new Int32Array(raw.buffer, raw.byteOffset, HEADER_INTS) : undefined;
    if (!h || h[H_MAGIC] !== MAGIC || h[H_VERSION] !== VERSION || h[H_RETIRED] !== 0 || raw!.length < (HEADER_INTS + 3 * h[H_COUNT]!) * 4) {
      await rm(mapPath, { force: true });
      await rm(dataPath, { force: true });
      return undefined;
    }
    const count = h[H_COUNT]!, cs = h[H_CHUNK]!, size = h[H_SIZE_LO]! + h[H_SIZE_HI]! * 2 ** 32;
    const words = new Int32Array(raw!.buffer, raw!.byteOffset + HEADER_INTS * 4, count);
    let bytes = 0;
    for (let i = 0; i < count; i++) if (isReadable(words[i]!) && Math.min(size, (i + 1) * cs) <= dataSize) bytes += Math.min(cs, size - i * cs);
    return bytes;
  }

  /** The chunk indices of a layer present now (from its map file when not open here). */
  async held(digest: string, chunkSize: number): Promise<number[]> {
    const l = this.layers.get(`${hexOf(digest)}-${chunkSize}`);
    if (l) return l.held();
    const raw = await readFile(`${this.base(hexOf(digest), chunkSize)}.map`).catch(() => undefined);
    if (!raw || raw.length < HEADER_INTS * 4) return [];
    const h = new Int32Array(raw.buffer, raw.byteOffset, HEADER_INTS);
    if (h[H_MAGIC] !== MAGIC || h[H_RETIRED] !== 0) return [];
    const words = new Int32Array(raw.buffer, raw.byteOffset + HEADER_INTS * 4, h[H_COUNT]!);
    const out: number[] = [];
    for (let i = 0; i < words.length; i++) if (isReadable(words[i]!)) out.push(i);
    return out;
  }

  /** The cache files of a layer, opened (created when missing) in this thread; repaired as the rules say. */
  layer(digest: string, size: number, chunkSize: number): Promise<CachedLayer> {
    const hex = hexOf(digest);
    const key = `${hex}-${chunkSize}`;
    const have = this.layers.get(key);
    if (have && !have.retired) return Promise.resolve(have);
    let p = this.opening.get(key);
    if (!p) {
      p = this.openLayer(key, hex, digest, size, chunkSize).finally(() => this.opening.delete(key));
      this.opening.set(key, p);
    }
    return p;
  }

  private async openLayer(key: string, hex: string, digest: string, size: number, chunkSize: number): Promise<CachedLayer> {
    const old = this.layers.get(key);
    if (old) {
      this.layers.delete(key);
      this.used -= old.presentBytes();
      if (old.refs === 0) await old.closeFiles();
    }
    const base = this.base(hex, chunkSize);
    const count = Math.ceil(size / chunkSize);
    const mapBytes = (HEADER_INTS + 3 * count) * 4;
    for (let attempt = 0; ; attempt++) {
      await this.createMap(`${base}.map`, chunkSize, count, size, mapBytes);
      const mapFile = LocalFile.open(`${base}.map`, { write: true });
      const h = new Int32Array(4 * HEADER_INTS);
      const hv = new Uint8Array(h.buffer, 0, HEADER_INTS * 4);
      const fits = mapFile.size() >= mapBytes && (await mapFile.pread(hv, 0)) === hv.length;
      if (!fits || h[H_MAGIC] !== MAGIC || h[H_VERSION] !== VERSION || h[H_CHUNK] !== chunkSize || h[H_COUNT] !== count || h[H_SIZE_LO]! + h[H_SIZE_HI]! * 2 ** 32 !== size || h[H_RETIRED] !== 0) {
        // Torn, of another shape, or retired: replaced (readers of the old one keep their files).
        await mapFile.close();
        await rm(`${base}.map`, { force: true });
        await rm(`${base}.data`, { force: true });
        if (attempt >= 2) throw new ConfigError(`block cache map ${base}.map cannot be made`, this.opts.dir);
        continue;
      }
      const data = LocalFile.open(`${base}.data`, { create: true });
      let direct: LocalFile | undefined;
      try {
        direct = LocalFile.open(`${base}.data`, { write: true, direct: true });
      } catch {
        direct = undefined; // tmpfs and a few others refuse O_DIRECT
      }
      const mapLen = Math.ceil(mapBytes / PAGE_SIZE) * PAGE_SIZE;
      const addr = mmap(0, mapLen, PROT_READ | PROT_WRITE, MAP_SHARED, mapFile.fd, 0);
      const l = new CachedLayer(this, key, digest, size, chunkSize, data, direct, mapFile, addr, mapLen);
      this.repair(l);
      const k = this.known.get(key);
      if (k) {
        this.used -= k.bytes;
        this.known.delete(key);
      }
      this.used += l.presentBytes();
      this.layers.set(key, l);
      return l;
    }
  }

  /** Create the map file whole (temp, then link: a racing creator's file wins) unless it exists. */
  private async createMap(path: string, chunkSize: number, count: number, size: number, bytes: number): Promise<void> {
    if (await stat(path).then(() => true, () => false)) return;
    const buf = new Int32Array(bytes / 4);
    buf[H_MAGIC] = MAGIC;
    buf[H_VERSION] = VERSION;
    buf[H_CHUNK] = chunkSize;
    buf[H_COUNT] = count;
    buf[H_SIZE_LO] = size % 2 ** 32 | 0;
    buf[H_SIZE_HI] = Math.floor(size / 2 ** 32);
    const tmp = `${path}.tmp.${process.pid}.${Math.random().toString(36).slice(2)}`;
    await writeFile(tmp, new Uint8Array(buf.buffer));
    await link(tmp, path).catch((e: NodeJS.ErrnoException) => {
      if (e.code !== "EEXIST") throw e;
    });
    await unlink(tmp);
  }

  /**
   * Words a machine crash may have made wrong (not durable, from before this boot), claims of dead
   * owners, and chunks past the data file's end go absent (a dead eviction's bytes stay until refilled).
   */
  private repair(l: CachedLayer): void {
    const dataSize = l.data.size();
    const bootS = this.bootS - EPOCH_S;
    for (let i = 0; i < l.count; i++) {
      const w = Atomics.load(l.words, i);
      const st = w & 7;
      if (st === ABSENT) continue;
      const beforeBoot = Atomics.load(l.since, i) < bootS;
      const short = Math.min(l.size, (i + 1) * l.chunkSize) > dataSize;
      const lost = (st === PRESENT && beforeBoot) || ((st === FILLING || st === EVICTING) && (beforeBoot || l.claimStale(i)));
      if ((lost || (short && isReadable(w))) && Atomics.compareExchange(l.words, i, w, nextGen(w) + ABSENT) === w) continue;
    }
  }

  /** @internal a fill marked `bytes`: sync and evict as the watermarks say. */
  wrote(l: CachedLayer, bytes: number): void {
    this.used += bytes;
    this.stats.written += bytes;
    this.unsyncedBytes += bytes;
    if (this.unsyncedBytes >= SYNC_BYTES) void this.syncAll();
    // Not holding the process open: chunks left unsynced at exit are only lost to a machine crash.
    else this.syncTimer ??= setTimeout(() => void this.syncAll(), SYNC_MS).unref();
    if (this.used > this.highBytes) void this.evict();
    void l;
  }

  /** fdatasync every layer written since the last sync; their chunks become DURABLE. */
  syncAll(): Promise<void> {
    if (this.syncTimer) clearTimeout(this.syncTimer);
    this.syncTimer = undefined;
    this.unsyncedBytes = 0;
    const run = async () => {
      await this.syncing;
      this.stats.syncs++;
      await Promise.all([...this.layers.values()].map((l) => l.sync().catch(() => {})));
    };
    const p = run();
    this.syncing = p;
    return p;
  }

  /**
   * Least recently used unpinned chunks go until usage is under the low watermark. Usage is
   * recounted from the shared words first (other threads evict and promote too); chunks are
   * accounted at once, punched after.
   */
  async evict(): Promise<void> {
    // Layers only found at open are opened to be evicted (their chunks are the oldest here).
    for (const k of [...this.known.values()]) {
      if (this.used <= this.highBytes) break;
      const size = await this.sizeOf(k);
      if (size !== undefined) await this.layer(k.hex, size, k.chunkSize).catch(() => undefined);
      else {
        this.known.delete(`${k.hex}-${k.chunkSize}`);
        this.used -= k.bytes;
      }
    }
    let used = 0;
    for (const k of this.known.values()) used += k.bytes;
    const cands: { l: CachedLayer; i: number; t: number }[] = [];
    for (const l of this.layers.values()) {
      for (let i = 0; i < l.count; i++) {
        const w = Atomics.load(l.words, i);
        if (!isReadable(w)) continue;
        used += l.chunkLength(i);
        const st = w & 7;
        if ((st === PRESENT || st === DURABLE) && l.pins[i] === 0) cands.push({ l, i, t: l.lastUse[i]! });
      }
    }
    this.used = used;
    if (this.used <= this.lowBytes) return;
    cands.sort((a, b) => a.t - b.t);
    const pick = new Map<CachedLayer, number[]>();
    let over = this.used - this.lowBytes;
    for (const c of cands) {
      if (over <= 0) break;
      let list = pick.get(c.l);
      if (!list) pick.set(c.l, (list = []));
      list.push(c.i);
      over -= c.l.chunkLength(c.i);
    }
    for (const [l, list] of pick) {
      const freed = await l.evict(list);
      this.used -= freed;
      this.stats.evicted += freed;
    }
  }

  private async sizeOf(k: Known): Promise<number | undefined> {
    const raw = await readFile(`${this.base(k.hex, k.chunkSize)}.map`).catch(() => undefined);
    if (!raw || raw.length < HEADER_INTS * 4) return undefined;
    const h = new Int32Array(raw.buffer, raw.byteOffset, HEADER_INTS);
    return h[H_MAGIC] === MAGIC && h[H_RETIRED] === 0 ? h[H_SIZE_LO]! + h[H_SIZE_HI]! * 2 ** 32 : undefined;
  }

  /** @internal a RemoteFile stopped using `l`. */
  async unref(l: CachedLayer): Promise<void> {
    if (--l.refs > 0) return;
    if (this.layers.get(l.key) !== l) return l.closeFiles();
    let idle = 0;
    for (const x of this.layers.values()) if (x.refs === 0) idle++;
    if (idle <= MAX_IDLE_LAYERS) return;
    for (const [key, x] of this.layers) {
      if (idle <= MAX_IDLE_LAYERS) break;
      if (x.refs > 0) continue;
      this.layers.delete(key);
      const bytes = x.presentBytes();
      this.used -= bytes;
      this.known.set(key, { hex: key.slice(0, 64), chunkSize: x.chunkSize, bytes });
      this.used += bytes;
      idle--;
      await x.closeFiles();
    }
  }

  /** @internal promoted: the cache names go, the chunks leave this cache's budget. */
  async retire(l: CachedLayer): Promise<void> {
    const bytes = l.presentBytes();
    l.retireWords(false);
    await this.forget(l, bytes);
  }

  /** @internal a layer that failed verification: every chunk absent, the files gone. */
  async dropLayer(l: CachedLayer): Promise<void> {
    const bytes = l.presentBytes();
    l.retireWords(true);
    await this.forget(l, bytes);
  }

  private async forget(l: CachedLayer, bytes: number): Promise<void> {
    if (this.layers.get(l.key) === l) {
      this.layers.delete(l.key);
      this.used -= bytes;
      if (this.used < 0) this.used = 0;
    }
    const base = this.base(hexOf(l.digest), l.chunkSize);
    await rm(`${base}.map`, { force: true });
    await rm(`${base}.data`, { force: true });
    if (l.refs === 0) await l.closeFiles();
  }

  async close(): Promise<void> {
    if (this.syncTimer) clearTimeout(this.syncTimer);
    this.syncTimer = undefined;
    await this.syncing;
    for (const l of this.layers.values()) await l.closeFiles();
    this.layers.clear();
    if (instances.get(this.opts.dir)) {
      const mine = await instances.get(this.opts.dir)!.catch(() => undefined);
      if (mine === this) instances.delete(this.opts.dir);
    }
  }
}

const directFree: AlignedBuffer[] = [];
let directMade = 0;
const directWaiting: ((b: AlignedBuffer) => void)[] = [];

/** Run fn with one of this thread's DIRECT_BUFFERS page-aligned buffers (waits for one when all are out). */
async function withDirectBuffer(fn: (b: AlignedBuffer) => Promise<void>): Promise<void> {
  let b = directFree.pop();
  if (!b && directMade < DIRECT_BUFFERS) {
    directMade++;
    b = allocAligned(DIRECT_PIECE);
  }
  b ??= await new Promise<AlignedBuffer>((r) => directWaiting.push(r));
  try {
    await fn(b);
  } finally {
    const next = directWaiting.shift();
    if (next) next(b);
    else directFree.push(b);
  }
}

/**
 * fdatasync on libuv's thread pool: a sync of tens of MiB takes up to seconds, and through this
 * thread's ring it would hold the thread (and every fetch it drives) in io_uring_enter.
 */
function datasync(fd: number): Promise<void> {
  return new Promise((resolve, reject) => fdatasync(fd, (e) => (e ? reject(e) : resolve())));
}

/** This boot's start in seconds since the Unix epoch (/proc/stat btime); 0 when unknown. */
async function bootTimeS(): Promise<number> {
  const s = await readFile("/proc/stat", "utf8").catch(() => "");
  const m = /^btime (\d+)$/m.exec(s);
  return m ? Number(m[1]) : 0;
}

export function hexOf(digest: string): string {
  return digest.startsWith("sha256:") ? digest.slice(7) : digest;
}
