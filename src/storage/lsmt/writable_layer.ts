// The writable (RW) LSMT layer, log-structured: a data file that only grows and an index file of
// 16-byte entries replayed on open (docs/formats.md, Writable layer). Sealing appends the index and a
// trailer in place, which makes the data file a read-only layer with no data copied.

import { unlinkSync, existsSync } from "node:fs";
import { FormatError, IoRangeError, StorageError, TruncatedError } from "../errors.ts";
import type { WritableFile } from "../file.ts";
import { LocalFile } from "../local_file.ts";
import { lseek, SEEK_DATA, SEEK_HOLE } from "../../../ffi/libc.ts";
import {
  type HeaderTrailer,
  HT_SPACE,
  FLAG_DATA,
  FLAG_HEADER,
  FLAG_SEALED,
  FLAG_SPARSE,
  decodeHeader,
  encodeHeader,
  newHeader,
  randomUuid,
  normalizeUuid,
  hasLsmtMagic,
} from "./header.ts";
import {
  type Segment,
  SECTOR,
  SEGMENT_BYTES,
  INVALID_OFFSET,
  MAX_SEGMENT_SECTORS,
  decodeSegment,
  encodeSegments,
  seg,
  splitLong,
} from "./segment.ts";
import { type PieceSink, SegmentIndex } from "./segment_index.ts";

/** File names of a writable layer in its directory, as containerd's overlaybd snapshotter names them. */
export const WRITABLE_DATA = "writable_data";
export const WRITABLE_INDEX = "writable_index";

/** Appends this large go to the data file with O_DIRECT; smaller ones through the page cache. */
const DIRECT_MIN = 64 << 10;

/** Discarded data is punched out of the data file in whole blocks of this size (ext4's block). */
const HOLE_BLOCK = 4096;
/** A discard over a fragmented range punches its runs this many at a time. */
const MAX_PUNCHES_IN_FLIGHT = 64;

/** Rewrites spread over more runs than this are appended instead (one pwrite per run). */
const MAX_IN_PLACE_PIECES = 8;

/** C++ MAX_IO_SIZE: one index entry maps at most 4 MiB of written data. */
export const MAX_IO_SECTORS = 8192;
/** C++ limit on entries in an RW index file. */
export const MAX_RW_INDEX_ENTRIES = 128_000_000;

export interface WritableLayerOptions {
  virtualSize: number;
  uuid?: string;
  parentUuid?: string;
  /** Sparse mode: the disk lives in place in the data file; no index file is kept. */
  sparse?: boolean;
  /** Append rewrites too, as C++ overlaybd's writer does (byte-identical files for the same writes). */
  appendOnly?: boolean;
}

export class LayerSealedError extends StorageError {
  override name = "LayerSealedError";
}

export class WritableLayer {
  readonly index = new SegmentIndex();
  /** Entries mapped in this tick, appended to the index file together by one pwrite. */
  private queued: Segment[] = [];
  private queuedWrite: Promise<void> | undefined;
  private inflight = 0;
  private idle: (() => void)[] = [];
  private sealed = false;
  /**
   * Data appends go through an O_DIRECT fd: a log-structured upper only grows, so caching what
   * the guest writes (it has its own cache) only fills host memory and throttles on writeback.
   * Reads and everything else use the buffered fd; the kernel keeps the two coherent.
   */
  private appender: WritableFile | undefined;
  /** See WritableLayerOptions.appendOnly. */
  appendOnly = false;

  private constructor(
    private dataAt: string,
    private indexAt: string,
    private data: WritableFile,
    private indexFile: WritableFile | undefined, // none in sparse mode
    public header: HeaderTrailer,
    private dataEnd: number,
    private indexEnd: number,
    readonly sparse = false,
  ) {}

  get dataPath(): string {
    return this.dataAt;
  }
  get indexPath(): string {
    return this.indexAt;
  }

  /** The open files were renamed (their directory moved): later operations use the new paths. */
  moved(dataPath: string, indexPath: string): void {
    this.dataAt = dataPath;
    this.indexAt = indexPath;
  }

  get virtualSize(): number {
    return this.header.virtualSize;
  }
  get uuid(): string {
    return this.header.uuid;
  }
  get parentUuid(): string {
    return this.header.parentUuid;
  }
  /** The data file, for reads of the sectors this layer maps. */
  get dataFile(): WritableFile {
    return this.data;
  }
  /** Bytes in the data file (header + appended data). */
  get dataSize(): number {
    return this.dataEnd;
  }

  static async create(dataPath: string, indexPath: string, opts: WritableLayerOptions): Promise<WritableLayer> {
    checkVirtualSize(opts.virtualSize, dataPath);
    const header = newHeader({
      flags: FLAG_HEADER | FLAG_DATA | (opts.sparse ? FLAG_SPARSE : 0),
      virtualSize: opts.virtualSize,
      uuid: opts.uuid ? normalizeUuid(opts.uuid) : randomUuid(),
      parentUuid: normalizeUuid(opts.parentUuid),
    });
    for (const p of [dataPath, indexPath]) if (existsSync(p)) unlinkSync(p);
    const data = await LocalFile.open(dataPath, { write: true, create: true });
    await data.pwrite(encodeHeader(header), 0);
    if (opts.sparse) {
      await data.truncate(HT_SPACE + opts.virtualSize);
      await data.fdatasync();
      // overlaybd-create -s creates the index file too (C++ opens upper.index without O_CREAT) but
      // writes nothing into it: the index of a sparse layer is the data file's allocated ranges.
      await (await LocalFile.open(indexPath, { write: true, create: true })).close();
      return new WritableLayer(dataPath, indexPath, data, undefined, header, HT_SPACE + opts.virtualSize, 0, true);
    }
    const indexFile = await LocalFile.open(indexPath, { write: true, create: true });
    await indexFile.pwrite(encodeHeader({ ...header, flags: FLAG_HEADER, indexOffset: HT_SPACE }), 0);
    await data.fdatasync();
    await indexFile.fdatasync();
    const layer = new WritableLayer(dataPath, indexPath, data, indexFile, header, HT_SPACE, HT_SPACE);
    layer.appendOnly = opts.appendOnly === true;
    layer.dirty = false; // both files were just synced
    return layer;
  }

  /** A sparse layer's index is the data file's allocated ranges (SEEK_DATA / SEEK_HOLE from 4096). */
  private static async openSparse(dataPath: string, indexPath: string, data: LocalFile, header: HeaderTrailer): Promise<WritableLayer> {
    const size = data.size();
    const layer = new WritableLayer(dataPath, indexPath, data, undefined, header, size, 0, true);
    for (let pos = HT_SPACE; pos < size; ) {
      const b = lseek(data.fd, pos, SEEK_DATA, dataPath);
      if (b < 0 || b >= size) break;
      let e = lseek(data.fd, b, SEEK_HOLE, dataPath);
      if (e < 0 || e > size) e = size;
      for (const s of splitLong(seg((b - HT_SPACE) / SECTOR, (e - b) / SECTOR, b / SECTOR))) layer.index.insert(s);
      pos = e;
    }
    return layer;
  }

  /**
   * Open an RW pair and replay its index. Recovery after a crash: a torn last entry is cut off,
   * and entries from the first one that points past the data file's end are dropped (only a
   * machine crash can leave those: an entry is written after the data it names).
   */
  static async open(dataPath: string, indexPath: string, opts: { appendOnly?: boolean } = {}): Promise<WritableLayer> {
    const data = await LocalFile.open(dataPath, { write: true });
    const hb0 = new Uint8Array(HT_SPACE);
    if ((await data.pread(hb0, 0)) === HT_SPACE && hasLsmtMagic(hb0) && hb0[28]! & FLAG_SPARSE && !(hb0[28]! & FLAG_SEALED)) {
      try {
        await refuseSealed(data, dataPath);
        return await WritableLayer.openSparse(dataPath, indexPath, data, decodeHeader(hb0, dataPath, 0));
      } catch (e) {
        await data.close();
        throw e;
      }
    }
    const indexFile = await LocalFile.open(indexPath, { write: true });
    try {
      const dsize = data.size();
      const isize = indexFile.size();
      if (dsize < HT_SPACE) throw new TruncatedError(`data file of ${dsize} bytes has no header`, dataPath, 0);
      if (isize < HT_SPACE) throw new TruncatedError(`index file of ${isize} bytes has no header`, indexPath, 0);
      const hb = new Uint8Array(HT_SPACE);
      await data.pread(hb, 0);
      const dh = decodeHeader(hb, dataPath, 0);
      if ((dh.flags & (FLAG_HEADER | FLAG_DATA)) !== (FLAG_HEADER | FLAG_DATA))
        throw new FormatError(`flags 0x${dh.flags.toString(16)} do not say RW data header`, dataPath, 0);
      await refuseSealed(data, dataPath);
      await indexFile.pread(hb, 0);
      const ih = decodeHeader(hb, indexPath, 0);
      if (!(ih.flags & FLAG_HEADER) || ih.flags & (FLAG_DATA | FLAG_SEALED) || ih.indexOffset !== HT_SPACE)
        throw new FormatError(`flags 0x${ih.flags.toString(16)} / index_offset ${ih.indexOffset} do not say RW index header`, indexPath, 0);
      // A torn data append leaves a partial sector: round up so appends stay sector-aligned.
      const dataEnd = Math.ceil(dsize / SECTOR) * SECTOR;
      if (dataEnd !== dsize) await data.truncate(dataEnd);
      let n = Math.floor((isize - HT_SPACE) / SEGMENT_BYTES);
      if (n > MAX_RW_INDEX_ENTRIES) throw new FormatError(`${n} entries exceed ${MAX_RW_INDEX_ENTRIES}`, indexPath, HT_SPACE);
      const raw = new Uint8Array(n * SEGMENT_BYTES);
      if (n) await indexFile.pread(raw, HT_SPACE);
      const layer = new WritableLayer(dataPath, indexPath, data, indexFile, { ...dh, virtualSize: ih.virtualSize, uuid: ih.uuid }, dataEnd, 0);
      const dv = new DataView(raw.buffer);
      const limit = dataEnd / SECTOR;
      for (let i = 0; i < n; i++) {
        const s = decodeSegment(dv, i * SEGMENT_BYTES);
        if (s.offset === INVALID_OFFSET) continue;
        if (s.length === 0 || s.moffset < 8 || (s.zeroed ? s.moffset > limit : s.moffset + s.length > limit)) {
          n = i; // unflushed tail: see above
          break;
        }
        s.tag = 0;
        layer.index.insert(s);
      }
      layer.indexEnd = HT_SPACE + n * SEGMENT_BYTES;
      layer.appendOnly = opts.appendOnly === true;
      if (layer.indexEnd !== isize) await indexFile.truncate(layer.indexEnd);
      return layer;
    } catch (e) {
      await data.close();
      await indexFile.close();
      throw e;
    }
  }

  private checkRange(offset: number, length: number): void {
    if (this.sealed) throw new LayerSealedError("write to a sealed layer", this.dataPath);
    if (offset % SECTOR || length % SECTOR)
      throw new IoRangeError(`I/O at ${offset}+${length} is not 512-aligned`, this.dataPath, offset);
    if (offset + length > this.header.virtualSize)
      throw new IoRangeError(`I/O at ${offset}+${length} is past the virtual size ${this.header.virtualSize}`, this.dataPath, offset);
  }

  private begin(): void {
    this.inflight++;
    this.dirty = true;
  }
  private end(): void {
    if (--this.inflight === 0) for (const f of this.idle.splice(0)) f();
  }
  /** Resolves when no write started before this call is still running. */
  drain(): Promise<void> {
    return this.inflight === 0 ? Promise.resolve() : new Promise((r) => this.idle.push(r));
  }

  /**
   * Write buf's bytes at `offset` (bytes, 512-aligned). A range this layer already maps to its
   * own data is overwritten in place (a guest rewrites its journal and hot blocks all the time:
   * appending each rewrite would grow the upper without bound and allocate fresh disk blocks);
   * anything else is appended to the data file and mapped.
   */
  async write(buf: Uint8Array, offset: number): Promise<void> {
    this.checkRange(offset, buf.length);
    this.begin();
    try {
      const step = MAX_IO_SECTORS * SECTOR;
      const jobs: Promise<void>[] = [];
      for (let done = 0; done < buf.length; done += step) {
        const chunk = buf.subarray(done, Math.min(buf.length, done + step));
        const voff = offset + done;
        const file = this.fileFor(chunk.length);
        if (this.sparse) {
          // The disk sits in place after the header.
          const pos = HT_SPACE + voff;
          jobs.push(file.pwrite(chunk, pos).then(() => this.map(seg(voff / SECTOR, chunk.length / SECTOR, pos / SECTOR))));
        } else if (!this.appendOnly && this.ownPieces(voff / SECTOR, (voff + chunk.length) / SECTOR)) {
          // The mapping may still be on its way to the index file: resolve only once it is there,
          // or a process crash could lose this acknowledged write with the entry.
          const mapped = this.indexTail;
          const p = this.pieces;
          for (let i = 0; i < this.npieces; i++) {
            const at = (p[3 * i]! - offset / SECTOR) * SECTOR;
            jobs.push(file.pwrite(buf.subarray(at, at + p[3 * i + 1]! * SECTOR), p[3 * i + 2]! * SECTOR));
          }
          jobs.push(mapped);
        } else {
          const pos = this.dataEnd; // reserved now, so concurrent writes never share space
          this.dataEnd += chunk.length;
          jobs.push(file.pwrite(chunk, pos).then(() => this.map(seg(voff / SECTOR, chunk.length / SECTOR, pos / SECTOR))));
        }
      }
      await Promise.all(jobs);
    } finally {
      this.end();
    }
  }

  /**
   * Small writes stay buffered: O_DIRECT writes that extend a file serialize on the inode lock
   * and go through io-wq (profiled: context switches dominated 4 KiB random writes).
   */
  private fileFor(length: number): WritableFile {
    return length >= DIRECT_MIN ? (this.appender ??= this.openAppender()) : this.data;
  }

  /**
   * Whether sectors [start, end) are all mapped to this layer's own data (not zeroed, not a
   * lower layer), in at most MAX_IN_PLACE_PIECES runs; the runs are left in `pieces` as
   * (virtual sector, sectors, data-file sector) triples. Allocates nothing.
   */
  private ownPieces(start: number, end: number): boolean {
    const sink = this.pieceSink;
    sink.next = start;
    sink.n = 0;
    sink.ok = true;
    this.index.visit(start, end, sink, true);
    this.npieces = sink.n;
    return sink.ok && sink.next === end;
  }

  private readonly pieces = new Float64Array(3 * MAX_IN_PLACE_PIECES);
  private npieces = 0;
  private readonly pieceSink = new OwnPieceSink(this.pieces);
  /** Settles once every index entry mapped so far is in the index file. */
  private indexTail: Promise<void> = Promise.resolve();

  private openAppender(): WritableFile {
    try {
      return LocalFile.open(this.dataPath, { write: true, direct: true });
    } catch {
      return this.data; // O_DIRECT refused (tmpfs, some FUSE): buffered appends
    }
  }

  /**
   * Make [offset, offset+length) read as zeros, masking lower layers (discard and write-zeroes):
   * zero entries of at most 16383 sectors whose moffset is the data file's end, as C++ appends
   * them. The data the range held is then garbage: unless appendOnly (C++ keeps it), the whole
   * 4 KiB blocks of it are punched out of the data file once the entries are in the index file.
   */
  async discard(offset: number, length: number): Promise<void> {
    this.checkRange(offset, length);
    this.begin();
    try {
      // Sparse layers punch a hole and keep the zero entry in memory only (C++ does the same, so
      // after a reopen the range falls through to the lower layers again).
      if (this.sparse) await this.data.punchHole(HT_SPACE + offset, length);
      const start = offset / SECTOR;
      const end = start + length / SECTOR;
      const dropped = this.sparse || this.appendOnly ? [] : this.ownRuns(start, end);
      const jobs: Promise<void>[] = [];
      for (let s = start; s < end; ) {
        const k = Math.min(end - s, MAX_SEGMENT_SECTORS);
        jobs.push(this.map(seg(s, k, this.sparse ? s + HT_SPACE / SECTOR : this.dataEnd / SECTOR, true)));
        s += k;
      }
      await Promise.all(jobs);
      // No mapping names these sectors any more and none ever will (appends take fresh space), so
      // a write racing this discard can at worst land in a hole nobody reads.
      for (let i = 0; i < dropped.length; i += MAX_PUNCHES_IN_FLIGHT) {
        const holes: Promise<void>[] = [];
        for (const [m, n] of dropped.slice(i, i + MAX_PUNCHES_IN_FLIGHT)) {
          const from = Math.ceil((m * SECTOR) / HOLE_BLOCK) * HOLE_BLOCK;
          const to = Math.floor(((m + n) * SECTOR) / HOLE_BLOCK) * HOLE_BLOCK;
          if (to > from) holes.push(this.data.punchHole(from, to - from));
        }
        await Promise.all(holes);
      }
    } finally {
      this.end();
    }
  }

  /** The data-file runs (sector, sectors) that this layer maps sectors [start, end) to, in order. */
  private ownRuns(start: number, end: number): [number, number][] {
    const runs: [number, number][] = [];
    this.index.visit(
      start,
      end,
      {
        piece: (s, from, to) => {
          if (s.zeroed) return;
          const m = s.moffset + (from - s.offset);
          const last = runs.at(-1);
          if (last && last[0] + last[1] === m) last[1] += to - from;
          else runs.push([m, to - from]);
        },
      },
      true,
    );
    return runs;
  }

  /**
   * Map s and put its entry in the index file (page cache, not synced) before the write that
   * made it resolves: a completed write then survives the death of this process, and only a
   * machine crash can take back what no flush covered.
   */
  private map(s: Segment): Promise<void> {
    this.index.insert(s);
    if (this.sparse || !this.indexFile) return Promise.resolve();
    this.queued.push(s);
    // Entries queued in the same tick share one pwrite; the order in the file is map order.
    if (this.queuedWrite) return this.queuedWrite;
    const batch = Promise.resolve().then(() => {
      const list = this.queued;
      this.queued = [];
      this.queuedWrite = undefined;
      const pos = this.indexEnd;
      this.indexEnd += list.length * SEGMENT_BYTES;
      return this.indexFile!.pwrite(encodeSegments(list), pos);
    });
    const before = this.indexTail;
    this.indexTail = batch.then(() => before);
    this.indexTail.catch(() => {}); // the failure reaches writers through their own awaits
    return (this.queuedWrite = batch);
  }

  /**
   * Persist every completed write: data first, then the entries that name it. With nothing
   * written since the last sync began, that sync covers everything: it is waited for, not repeated.
   */
  async flush(): Promise<void> {
    await this.drain();
    if (!this.dirty) return this.syncing;
    this.dirty = false;
    const syncing = (this.syncing = this.data.fdatasync().then(() => this.indexFile?.fdatasync()));
    try {
      await syncing;
    } catch (e) {
      this.dirty = true;
      throw e;
    }
  }

  /** Set by every write, discard and resize; cleared when a sync of both files begins. */
  private dirty = true;
  private syncing: Promise<void> = Promise.resolve();

  async resize(virtualSize: number): Promise<void> {
    checkVirtualSize(virtualSize, this.dataPath);
    this.dirty = true;
    this.header = { ...this.header, virtualSize };
    await this.data.pwrite(encodeHeader(this.header), 0);
    if (this.sparse) {
      await this.data.truncate(HT_SPACE + virtualSize);
      this.dataEnd = HT_SPACE + virtualSize;
    }
    await this.indexFile?.pwrite(encodeHeader({ ...this.header, flags: FLAG_HEADER, indexOffset: HT_SPACE }), 0);
    await this.flush();
  }

  /**
   * C++'s close_seal: append the index (padded with zeros to 512) and a sealed trailer to the
   * data file. The data file is then a read-only layer; this object accepts no more writes.
   */
  async seal(): Promise<void> {
    await this.flush();
    this.sealed = true;
    const entries = this.index.size;
    const ioff = this.dataEnd;
    const ibytes = Math.ceil((entries * SEGMENT_BYTES) / SECTOR) * SECTOR;
    const region = new Uint8Array(ibytes + HT_SPACE);
    this.index.encodeInto(region, 0); // zeros pad the last sector
    const trailer = newHeader({
      flags: FLAG_DATA | FLAG_SEALED | (this.header.flags & FLAG_SPARSE),
      indexOffset: ioff,
      indexSize: entries,
      virtualSize: this.header.virtualSize,
      uuid: this.header.uuid,
      parentUuid: this.header.parentUuid,
    });
    region.set(encodeHeader(trailer), ibytes);
    await this.data.pwrite(region, ioff);
    this.dataEnd += region.length;
    await this.data.fdatasync();
  }

  async close(): Promise<void> {
    await this.drain();
    if (!this.sealed) await this.flush();
    if (this.appender && this.appender !== this.data) await this.appender.close();
    await this.data.close();
    await this.indexFile?.close();
  }
}

/** Collects the runs of a range that a layer maps to its own data; see ownPieces. */
class OwnPieceSink implements PieceSink {
  next = 0;
  n = 0;
  ok = true;
  constructor(private readonly out: Float64Array) {}
  piece(s: Segment, from: number, to: number): void {
    if (!this.ok) return;
    if (s.zeroed || from !== this.next || this.n === MAX_IN_PLACE_PIECES) return void (this.ok = false);
    const o = this.out;
    o[3 * this.n] = from;
    o[3 * this.n + 1] = to - from;
    o[3 * this.n + 2] = s.moffset + (from - s.offset);
    this.n++;
    this.next = to;
  }
}

/** A sealed file still has an RW header at 0: its trailer is what says it is read-only now. */
async function refuseSealed(data: WritableFile, dataPath: string): Promise<void> {
  const dsize = data.size();
  if (dsize < 2 * HT_SPACE) return;
  const tb = new Uint8Array(HT_SPACE);
  await data.pread(tb, dsize - HT_SPACE);
  if (hasLsmtMagic(tb) && tb[28]! & FLAG_SEALED && !(tb[28]! & FLAG_HEADER))
    throw new LayerSealedError("the layer is sealed; open it read-only", dataPath, dsize - HT_SPACE);
}

function checkVirtualSize(v: number, file: string): void {
  if (!Number.isSafeInteger(v) || v <= 0 || v % SECTOR)
    throw new IoRangeError(`virtual size ${v} must be a positive multiple of 512`, file);
}
