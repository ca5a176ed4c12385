// SegmentTable: a sorted, disjoint, read-only index in parallel typed arrays, one slot per entry
// and no object per entry: what a sealed layer's index decodes into, and the merged index of a
// stack's lowers. A lookup starts from a bucket of sectors and allocates nothing; putting a layer
// on top of a table is one linear merge of two sorted lists (docs/storage.md, Merged index).

import { FormatError } from "../errors.ts";
import { type Segment, INVALID_OFFSET, SEGMENT_BYTES } from "./segment.ts";
import type { PieceSink } from "./segment_index.ts";

const TWO32 = 2 ** 32;

export class SegmentTable {
  private count = 0;
  /** Virtual sector of each entry's first sector. */
  private offsets: Float64Array;
  /** Virtual sector one past each entry's last (offset + length): what lookups search. */
  private ends: Float64Array;
  /** Sector in the layer file that `offset` maps to (a zeroed entry's is kept as stored). */
  private moffsets: Float64Array;
  /** Bit 0: zeroed; above it the layer number (position in the stack's lowers, base = 0; 0 in a single layer's table). */
  private kinds: Uint16Array;
  /**
   * Where lookups start: buckets of 1 / perSector virtual sectors (a power of two, one bucket
   * per one or two entries), firsts[b] = the first entry that ends after bucket b starts. A
   * lookup searches only firsts[b]..firsts[b + 1], a few entries, where a binary search of the
   * whole table mispredicts its way through log2(n) steps (~55 ns at 500 entries against ~20).
   * Built by overlay (a merged table) or else by the first lookup (a layer's own table is only
   * ever merged, never looked up).
   */
  private perSector = 1; // buckets per sector: a power of two, so sector · perSector is exact
  private firsts: Uint32Array | undefined;
  /** The one Segment a visit hands its sink: valid only during that piece() call. */
  private readonly cursor: Segment = { offset: 0, length: 0, moffset: 0, zeroed: false, tag: 0 };

  private constructor(capacity: number) {
    this.offsets = new Float64Array(capacity);
    this.ends = new Float64Array(capacity);
    this.moffsets = new Float64Array(capacity);
    this.kinds = new Uint16Array(capacity);
  }

  static empty(): SegmentTable {
    return new SegmentTable(0);
  }

  get size(): number {
    return this.count;
  }

  /**
   * A sealed layer's on-disk entries, checked as C++ checks them: padding entries (offset 2^50 − 1)
   * are skipped; every other entry, length-0 ones included, must start at or after the previous
   * one's end and map inside [8, limit] (zeroed) or [8, limit − length] (data) sectors. Length-0
   * entries map nothing and are dropped; nothing is folded. Tags read as 0. `at`: the entries'
   * byte offset in `name`, for errors.
   */
  static decode(bytes: Uint8Array, limitSectors: number, name: string, at: number): SegmentTable {
    const n = Math.floor(bytes.byteLength / SEGMENT_BYTES);
    // The entries' u32 words (little-endian, as every host we run on); a copy when unaligned.
    const aligned = bytes.byteOffset % 4 ? bytes.slice(0, n * SEGMENT_BYTES) : bytes;
    const words = new Uint32Array(aligned.buffer, aligned.byteOffset, n * 4);
    const t = new SegmentTable(n);
    const { offsets, ends, moffsets, kinds } = t;
    // One loop without calls: a restack decodes 100k+ entries in code too rarely run to be compiled well first.
    let c = 0;
    let prevEnd = 0;
    let entry = 0; // padding entries are not counted, as decodeSegments drops them
    for (let w = 0; w < n * 4; w += 4) {
      const w0hi = words[w + 1]!;
      const w1hi = words[w + 3]!;
      const offset = words[w]! + (w0hi & 0x3ffff) * TWO32;
      if (offset === INVALID_OFFSET) continue;
      const length = w0hi >>> 18;
      const moffset = words[w + 2]! + (w1hi & 0x7fffff) * TWO32;
      const zeroed = (w1hi & 0x800000) !== 0;
      if (offset < prevEnd) throw new FormatError(`entry ${entry} at sector ${offset} overlaps or is out of order`, name, at + entry * SEGMENT_BYTES);
      if (moffset < 8 || (zeroed ? moffset > limitSectors : moffset + length > limitSectors))
        throw new FormatError(`entry ${entry} maps sector ${moffset} outside the data area [8, ${limitSectors})`, name, at + entry * SEGMENT_BYTES);
      prevEnd = offset + length;
      entry++;
      if (length === 0) continue;
      offsets[c] = offset;
      ends[c] = prevEnd;
      moffsets[c] = moffset;
      kinds[c] = zeroed ? 1 : 0;
      c++;
    }
    t.count = c;
    return t.done();
  }

  /** Sorted, disjoint segments of length > 0, as they are (tags kept, nothing folded). */
  static fromSorted(list: readonly Segment[]): SegmentTable {
    const t = new SegmentTable(list.length);
    for (const s of list) t.push(s.offset, s.offset + s.length, s.moffset, (s.zeroed ? 1 : 0) + 2 * s.tag);
    return t.done();
  }

  /**
   * Layers stacked base first, merged: entry tags are positions in `tables`. Pairs of halves are
   * overlaid, so each entry is copied once per level: O(n log layers) for n entries in all.
   */
  static stack(tables: readonly SegmentTable[], from = 0, to = tables.length): SegmentTable {
    if (to - from === 0) return SegmentTable.empty();
    if (to - from === 1) return SegmentTable.empty().overlay(tables[from]!, from);
    const mid = (from + to) >>> 1;
    return SegmentTable.stack(tables, from, mid).overlay(SegmentTable.stack(tables, mid, to), 0);
  }

  /**
   * `top` laid over this table, its tags raised by `tagBase`: what `top` maps hides what lies
   * under it, the rest of this table shows through. One pass over both, linear in their sizes;
   * neighbours of one tag that continue each other in the file come out as one entry (no length
   * cap: this index is never written as is).
   */
  overlay(top: SegmentTable, tagBase: number): SegmentTable {
    // Each top entry adds itself and can cut one entry below in two.
    const out = new SegmentTable(this.count ? this.count + 2 * top.count : top.count);
    const { offsets: O, ends: E, moffsets: M, kinds: K } = out;
    const { offsets: bo, ends: be, moffsets: bm, kinds: bk } = this;
    const { offsets: to, ends: te, moffsets: tm, kinds: tk } = top;
    const n = this.count;
    const tn = top.count;
    const tagKind = 2 * tagBase;
    // The buckets are filled as entries come out (a merged table is looked up: they are part of
    // the merge), sized for the most entries there can be.
    const { size, firsts } = out.bucketsFor(Math.max(this.end(), top.end()), n + tn);
    let bucket = 0; // buckets before this one have their first entry
    // One loop with one place that adds an entry, no calls: a restack merges 100k+ entries in
    // code too rarely run to be compiled well first.
    let c = 0;
    let i = 0; // next entry below
    let j = 0; // next top entry
    let from = 0; // what lies below before here is hidden or out already
    for (;;) {
      const ts = j < tn ? to[j]! : Infinity;
      let off: number;
      let end: number;
      let mo: number;
      let kind: number;
      const bOff = i < n ? bo[i]! : Infinity;
      const b = bOff > from ? bOff : from;
      if (b < ts) {
        // Entry i shows from b up to its end or the next top entry's start.
        const bEnd = be[i]!;
        kind = bk[i]!;
        off = b;
        end = bEnd < ts ? bEnd : ts;
        mo = kind & 1 ? bm[i]! : bm[i]! + (b - bOff);
        from = end;
        if (end === bEnd) i++;
      } else if (j < tn) {
        off = ts;
        end = te[j]!;
        mo = tm[j]!;
        kind = tk[j]! + tagKind;
        j++;
        from = end;
        while (i < n && be[i]! <= end) i++; // hidden under it
      } else break;
      // Neighbours of one kind and tag that continue each other in the file fold into one entry
      // (C++'s compress_raw_index rule; a zeroed entry has no extent: the next one's moffset equals its own).
      let k = c - 1;
      if (k >= 0 && E[k] === off && K[k] === kind && (kind & 1 ? M[k]! : M[k]! + (off - O[k]!)) === mo) {
        E[k] = end;
      } else {
        k = c++;
        O[k] = off;
        E[k] = end;
        M[k] = mo;
        K[k] = kind;
      }
      // Entry k is the first to end after every bucket start before its end not yet given one.
      for (; bucket * size < end; bucket++) firsts[bucket] = k;
    }
    firsts.fill(c, bucket);
    out.count = c;
    return out.done();
  }

  /** Append an entry after the last, as it is. */
  private push(offset: number, end: number, moffset: number, kind: number): void {
    const c = this.count++;
    this.offsets[c] = offset;
    this.ends[c] = end;
    this.moffsets[c] = moffset;
    this.kinds[c] = kind;
  }

  /** Filled: arrays cut to size when over half of them is slack (a copy). */
  private done(): SegmentTable {
    const n = this.count;
    if (this.offsets.length > 2 * n) {
      this.offsets = this.offsets.slice(0, n);
      this.ends = this.ends.slice(0, n);
      this.moffsets = this.moffsets.slice(0, n);
      this.kinds = this.kinds.slice(0, n);
    }
    return this;
  }

  /** This table's bucket array, unfilled, for n entries over sectors [0, end): between n/2 and n buckets, at most 4 bytes an entry. */
  private bucketsFor(end: number, n: number): { size: number; firsts: Uint32Array } {
    const size = n ? 2 ** Math.max(0, Math.ceil(Math.log2(end / n))) : 1;
    const firsts = new Uint32Array(Math.floor(end / size) + 2);
    this.perSector = 1 / size;
    this.firsts = firsts;
    return { size, firsts };
  }

  private buildBuckets(): Uint32Array {
    const n = this.count;
    const { size, firsts } = this.bucketsFor(this.end(), n);
    const ends = this.ends;
    let i = 0;
    for (let b = 0; b < firsts.length; b++) {
      const at = b * size;
      while (i < n && ends[i]! <= at) i++;
      firsts[b] = i;
    }
    return firsts;
  }

  /** The first entry that ends after `sector` (size when none): searched in the sector's bucket only. */
  private firstEndingAfter(sector: number): number {
    const firsts = this.firsts ?? this.buildBuckets();
    const b = Math.floor(sector * this.perSector);
    if (b + 1 >= firsts.length) return this.count; // past every entry's end
    const ends = this.ends;
    let lo = firsts[b]!;
    let hi = firsts[b + 1]!;
    while (lo < hi) {
      const mid = (lo + hi) >>> 1;
      if (ends[mid]! > sector) hi = mid;
      else lo = mid + 1;
    }
    return lo;
  }

  /** Each entry overlapping sectors [start, end), with the overlap, in order; nothing allocated. */
  visit(start: number, end: number, sink: PieceSink, fromUpper: boolean): void {
    const ends = this.ends;
    const n = this.count;
    const s = this.cursor;
    for (let i = this.firstEndingAfter(start); i < n; i++) {
      const off = this.offsets[i]!;
      if (off >= end) return;
      const e = ends[i]!;
      s.offset = off;
      s.length = e - off;
      const kind = this.kinds[i]!;
      s.moffset = this.moffsets[i]!;
      s.zeroed = (kind & 1) === 1;
      s.tag = kind >>> 1;
      sink.piece(s, off > start ? off : start, e < end ? e : end, fromUpper);
    }
  }

  /** The entry that maps all of sectors [start, end), or -1 when none does (a hole, or more than one entry). */
  covering(start: number, end: number): number {
    const i = this.firstEndingAfter(start);
    return i < this.count && this.offsets[i]! <= start && this.ends[i]! >= end ? i : -1;
  }
  zeroedAt(i: number): boolean {
    return (this.kinds[i]! & 1) === 1;
  }
  tagAt(i: number): number {
    return this.kinds[i]! >>> 1;
  }
  /** The file sector that entry i maps virtual sector `sector` to. */
  fileSectorAt(i: number, sector: number): number {
    return this.moffsets[i]! + (sector - this.offsets[i]!);
  }

  /** Entry i as a Segment of its own. */
  at(i: number): Segment {
    const kind = this.kinds[i]!;
    return { offset: this.offsets[i]!, length: this.ends[i]! - this.offsets[i]!, moffset: this.moffsets[i]!, zeroed: (kind & 1) === 1, tag: kind >>> 1 };
  }

  toArray(): Segment[] {
    const out: Segment[] = new Array(this.count);
    for (let i = 0; i < this.count; i++) out[i] = this.at(i);
    return out;
  }

  /** Highest virtual sector mapped + 1 (0 when empty). */
  end(): number {
    return this.count ? this.ends[this.count - 1]! : 0;
  }
}
