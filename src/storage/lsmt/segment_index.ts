// SegmentIndex: an ordered set of disjoint segments with the overwrite-insert of C++'s writable
// index (docs/formats.md, Index algorithms). Kept as a list of sorted chunks so that an insert costs
// O(log n + CHUNK) instead of shifting the whole array (1 GiB of 4 KiB writes = 262144 entries).
// A chunk holds its entries in one Float64Array, no object per entry: a walk over the index (a
// lookup, a seal's encoding) reads memory in order instead of chasing an object per entry.

import { type Segment, ENTRY_DOUBLES, SEGMENT_BYTES, clip, encodeEntries } from "./segment.ts";

const CHUNK = 256; // a chunk splits when it doubles
/** Doubles per entry: offset, length, moffset, flags (bit 0 zeroed, tag above it). */
const W = ENTRY_DOUBLES;
/** An insert adds at most two entries before its chunk splits. */
const CAP = 2 * CHUNK + 2;

class Chunk {
  n = 0;
  readonly d = new Float64Array(CAP * W);
}

const flagsOf = (s: Segment) => (s.zeroed ? 1 : 0) + s.tag * 2;

export class SegmentIndex {
  private chunks: Chunk[] = [];
  private count = 0;
  /** The one Segment a visit hands its sink: valid only during that piece() call. */
  private readonly cursor: Segment = { offset: 0, length: 0, moffset: 0, zeroed: false, tag: 0 };

  static fromSorted(list: readonly Segment[]): SegmentIndex {
    const ix = new SegmentIndex();
    for (let i = 0; i < list.length; i += CHUNK) {
      const c = new Chunk();
      for (const s of list.slice(i, i + CHUNK)) put(c.d, c.n++, s.offset, s.length, s.moffset, flagsOf(s));
      ix.chunks.push(c);
    }
    ix.count = list.length;
    return ix;
  }

  get size(): number {
    return this.count;
  }

  /** Chunk whose last segment ends after `sector` (chunks.length when none). */
  private chunkFor(sector: number): number {
    let lo = 0;
    let hi = this.chunks.length;
    while (lo < hi) {
      const mid = (lo + hi) >>> 1;
      const c = this.chunks[mid]!;
      const at = (c.n - 1) * W;
      if (c.d[at]! + c.d[at + 1]! > sector) hi = mid;
      else lo = mid + 1;
    }
    return lo;
  }

  /** Insert m, cutting away whatever it overlaps (no coalescing). */
  insert(m: Segment): void {
    if (m.length <= 0) return;
    const start = m.offset;
    const end = m.offset + m.length;
    if (this.chunks.length === 0) this.chunks.push(new Chunk());
    let ci = this.chunkFor(start);
    if (ci === this.chunks.length) {
      const last = this.chunks[ci - 1]!;
      put(last.d, last.n++, m.offset, m.length, m.moffset, flagsOf(m));
      this.count++;
      this.maybeSplit(ci - 1);
      return;
    }
    let chunk = this.chunks[ci]!;
    let d = chunk.d;
    let i = firstEndingAfter(chunk, start);
    const xOff = d[i * W]!;
    if (xOff < start) {
      const xEnd = xOff + d[i * W + 1]!;
      d[i * W + 1] = start - xOff; // x keeps its left part
      i++;
      if (xEnd > end) {
        // m falls inside x: x becomes left part, m, right part.
        const xm = d[(i - 1) * W + 2]!;
        const xf = d[(i - 1) * W + 3]!;
        open(chunk, i, 2);
        put(d, i, m.offset, m.length, m.moffset, flagsOf(m));
        put(d, i + 1, end, xEnd - end, xf % 2 ? xm : xm + (end - xOff), xf);
        this.count += 2;
        this.maybeSplit(ci);
        return;
      }
    }
    // Remove every segment m covers; trim the one it ends inside.
    const insertChunk = ci;
    const insertAt = i;
    let removeFrom = i;
    for (;;) {
      if (i === chunk.n) {
        this.removeRange(ci, removeFrom, i);
        if (ci + 1 >= this.chunks.length) break;
        // Continue into the next chunk; emptied chunks stay in place until placeAt drops them.
        chunk = this.chunks[++ci]!;
        d = chunk.d;
        i = 0;
        removeFrom = 0;
        continue;
      }
      const yOff = d[i * W]!;
      if (yOff >= end) {
        this.removeRange(ci, removeFrom, i);
        break;
      }
      const yEnd = yOff + d[i * W + 1]!;
      if (yEnd <= end) {
        i++;
        continue;
      }
      // y keeps its part past m.
      d[i * W] = end;
      d[i * W + 1] = yEnd - end;
      if (d[i * W + 3]! % 2 === 0) d[i * W + 2] = d[i * W + 2]! + (end - yOff);
      this.removeRange(ci, removeFrom, i);
      break;
    }
    this.placeAt(insertChunk, insertAt, m);
  }

  /** Remove entries [from, to) of chunk ci. An emptied chunk stays until placeAt drops it. */
  private removeRange(ci: number, from: number, to: number): void {
    if (to <= from) return;
    const c = this.chunks[ci]!;
    c.d.copyWithin(from * W, to * W, c.n * W);
    c.n -= to - from;
    this.count -= to - from;
  }

  private placeAt(ci: number, at: number, m: Segment): void {
    const chunk = this.chunks[ci]!;
    open(chunk, at, 1);
    put(chunk.d, at, m.offset, m.length, m.moffset, flagsOf(m));
    this.count++;
    // Drop chunks emptied by a long insert (they sit right after ci), then rebalance.
    let k = ci + 1;
    while (k < this.chunks.length && this.chunks[k]!.n === 0) k++;
    if (k > ci + 1) this.chunks.splice(ci + 1, k - ci - 1);
    this.maybeSplit(ci);
  }

  private maybeSplit(ci: number): void {
    const c = this.chunks[ci]!;
    if (c.n <= 2 * CHUNK) return;
    const right = new Chunk();
    right.d.set(c.d.subarray(CHUNK * W, c.n * W));
    right.n = c.n - CHUNK;
    c.n = CHUNK;
    this.chunks.splice(ci + 1, 0, right);
  }

  /** Whether any segment overlaps sectors [start, end). */
  maps(start: number, end: number): boolean {
    const ci = this.chunkFor(start);
    if (ci === this.chunks.length) return false;
    const c = this.chunks[ci]!;
    return c.d[firstEndingAfter(c, start) * W]! < end;
  }

  /** Lookup: pieces covering [start, end), trimmed, appended to out (each a Segment of its own). */
  lookup(start: number, end: number, out: Segment[] = []): Segment[] {
    this.visit(start, end, { piece: (s, from, to) => out.push(clip(s, from, to)) }, false);
    return out;
  }

  /** Each segment overlapping [start, end), with the overlap, in order; nothing allocated. */
  visit(start: number, end: number, sink: PieceSink, fromUpper: boolean): void {
    let ci = this.chunkFor(start);
    if (ci === this.chunks.length) return;
    let chunk = this.chunks[ci]!;
    let i = firstEndingAfter(chunk, start);
    const s = this.cursor;
    for (;;) {
      if (i === chunk.n) {
        if (++ci === this.chunks.length) return;
        chunk = this.chunks[ci]!;
        i = 0;
        continue;
      }
      const d = chunk.d;
      const at = i++ * W;
      const off = d[at]!;
      if (off >= end) return;
      const len = d[at + 1]!;
      const f = d[at + 3]!;
      s.offset = off;
      s.length = len;
      s.moffset = d[at + 2]!;
      s.zeroed = f % 2 === 1;
      s.tag = (f - (f % 2)) / 2;
      const e = off + len;
      sink.piece(s, off > start ? off : start, e < end ? e : end, fromUpper);
    }
  }

  /** All segments in order, each a Segment of its own. */
  *[Symbol.iterator](): IterableIterator<Segment> {
    for (const c of this.chunks) for (let i = 0; i < c.n; i++) yield entryAt(c.d, i);
  }

  toArray(): Segment[] {
    const out: Segment[] = [];
    for (const c of this.chunks) for (let i = 0; i < c.n; i++) out.push(entryAt(c.d, i));
    return out;
  }

  /** Every entry in order into bytes from 0, 16 bytes each, with tag `tag` (an index region as seal writes it). */
  encodeInto(bytes: Uint8Array, tag: number): void {
    const dv = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
    let pos = 0;
    for (const c of this.chunks) {
      encodeEntries(dv, pos, c.d, c.n, tag);
      pos += c.n * SEGMENT_BYTES;
    }
  }

  /** Highest virtual sector mapped + 1 (0 when empty). */
  end(): number {
    const c = this.chunks[this.chunks.length - 1];
    if (!c || !c.n) return 0;
    const at = (c.n - 1) * W;
    return c.d[at]! + c.d[at + 1]!;
  }
}

function put(d: Float64Array, i: number, offset: number, length: number, moffset: number, flags: number): void {
  const at = i * W;
  d[at] = offset;
  d[at + 1] = length;
  d[at + 2] = moffset;
  d[at + 3] = flags;
}

function entryAt(d: Float64Array, i: number): Segment {
  const at = i * W;
  const f = d[at + 3]!;
  return { offset: d[at]!, length: d[at + 1]!, moffset: d[at + 2]!, zeroed: f % 2 === 1, tag: (f - (f % 2)) / 2 };
}

/** Make room for k entries at i (the chunk has it: see CAP). */
function open(c: Chunk, i: number, k: number): void {
  c.d.copyWithin((i + k) * W, i * W, c.n * W);
  c.n += k;
}

/** First entry of c that ends after `sector` (c.n when none). */
function firstEndingAfter(c: Chunk, sector: number): number {
  const d = c.d;
  let lo = 0;
  let hi = c.n;
  while (lo < hi) {
    const mid = (lo + hi) >>> 1;
    if (d[mid * W]! + d[mid * W + 1]! > sector) hi = mid;
    else lo = mid + 1;
  }
  return lo;
}

/**
 * Receives the visible pieces of a range: segment s, clipped to sectors [from, to). `s` is valid
 * only during the call (a SegmentTable hands the same object for every piece).
 */
export interface PieceSink {
  piece(s: Segment, from: number, to: number, fromUpper: boolean): void;
}

/** An index a lookup walks: a writable layer's SegmentIndex or a read-only SegmentTable. */
export interface VisitableIndex {
  visit(start: number, end: number, sink: PieceSink, fromUpper: boolean): void;
}

/**
 * Combo lookup: the visible pieces of [start, end) of a writable index over a merged
 * read-only one, in order, as (segment, from, to); gaps between pieces are holes. Allocates
 * nothing (the read path runs it per request).
 */
export function comboVisit(upper: SegmentIndex | undefined, lower: VisitableIndex, start: number, end: number, sink: PieceSink): void {
  if (!upper || upper.size === 0) return lower.visit(start, end, sink, false);
  const gaps = GAP_FILLER;
  gaps.lower = lower;
  gaps.sink = sink;
  gaps.cur = start;
  upper.visit(start, end, gaps, true);
  if (gaps.cur < end) lower.visit(gaps.cur, end, sink, false);
  gaps.sink = undefined;
}

/** Passes upper pieces on and fills the gaps between them from the lower index. */
class GapFiller implements PieceSink {
  lower!: VisitableIndex;
  sink: PieceSink | undefined;
  cur = 0;
  piece(u: Segment, from: number, to: number): void {
    if (from > this.cur) this.lower.visit(this.cur, from, this.sink!, false);
    this.sink!.piece(u, from, to, true);
    this.cur = to;
  }
}
// One per thread is enough: a visit runs to completion before the next starts.
const GAP_FILLER = new GapFiller();
