// SegmentIndex: an ordered set of disjoint segments with the overwrite-insert of C++'s writable
// index (docs/formats.md, Index algorithms). Kept as a list of sorted chunks so that an insert costs
// O(log n + CHUNK) instead of shifting the whole array (1 GiB of 4 KiB writes = 262144 entries).

import { type Segment, firstEndingAfter, clip, segEnd } from "./segment.ts";

const CHUNK = 256; // a chunk splits when it doubles

export class SegmentIndex {
  private chunks: Segment[][] = [];
  private count = 0;

  static fromSorted(list: readonly Segment[]): SegmentIndex {
    const ix = new SegmentIndex();
    for (let i = 0; i < list.length; i += CHUNK) ix.chunks.push(list.slice(i, i + CHUNK));
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
      if (segEnd(c[c.length - 1]!) > sector) hi = mid;
      else lo = mid + 1;
    }
    return lo;
  }

  /** Insert m, cutting away whatever it overlaps (no coalescing). */
  insert(m: Segment): void {
    if (m.length <= 0) return;
    const start = m.offset;
    const end = m.offset + m.length;
    if (this.chunks.length === 0) {
      this.chunks.push([m]);
      this.count = 1;
      return;
    }
    let ci = this.chunkFor(start);
    if (ci === this.chunks.length) {
      const last = this.chunks[ci - 1]!;
      last.push(m);
      this.count++;
      this.maybeSplit(ci - 1);
      return;
    }
    let chunk = this.chunks[ci]!;
    let i = firstEndingAfter(chunk, start);
    const x = chunk[i]!;
    if (x.offset < start) {
      chunk[i] = clip(x, x.offset, start);
      i++;
      if (segEnd(x) > end) {
        // m falls inside x: x becomes left part, m, right part.
        chunk.splice(i, 0, m, clip(x, end, segEnd(x)));
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
      if (i === chunk.length) {
        this.removeRange(ci, removeFrom, i);
        if (ci + 1 >= this.chunks.length) break;
        // Continue into the next chunk; emptied chunks stay in place until placeAt drops them.
        ci++;
        chunk = this.chunks[ci]!;
        i = 0;
        removeFrom = 0;
        continue;
      }
      const y = chunk[i]!;
      if (y.offset >= end) {
        this.removeRange(ci, removeFrom, i);
        break;
      }
      if (segEnd(y) <= end) {
        i++;
        continue;
      }
      chunk[i] = clip(y, end, segEnd(y));
      this.removeRange(ci, removeFrom, i);
      break;
    }
    this.placeAt(insertChunk, insertAt, m);
  }

  /** Remove chunk[ci][from..to). An emptied chunk stays until placeAt/compact drops it. */
  private removeRange(ci: number, from: number, to: number): void {
    if (to > from) {
      this.chunks[ci]!.splice(from, to - from);
      this.count -= to - from;
    }
  }

  private placeAt(ci: number, at: number, m: Segment): void {
    const chunk = this.chunks[ci]!;
    chunk.splice(at, 0, m);
    this.count++;
    // Drop chunks emptied by a long insert (they sit right after ci), then rebalance.
    for (let k = ci + 1; k < this.chunks.length && this.chunks[k]!.length === 0; ) this.chunks.splice(k, 1);
    this.maybeSplit(ci);
  }

  private maybeSplit(ci: number): void {
    const c = this.chunks[ci]!;
    if (c.length <= 2 * CHUNK) return;
    this.chunks.splice(ci, 1, c.slice(0, CHUNK), c.slice(CHUNK));
  }

  /** Lookup: pieces covering [start, end), trimmed, appended to out. */
  lookup(start: number, end: number, out: Segment[] = []): Segment[] {
    this.visit(start, end, { piece: (s, from, to) => out.push(from === s.offset && to === segEnd(s) ? s : clip(s, from, to)) }, false);
    return out;
  }

  /** Each segment overlapping [start, end), with the overlap, in order; nothing allocated. */
  visit(start: number, end: number, sink: PieceSink, fromUpper: boolean): void {
    let ci = this.chunkFor(start);
    if (ci === this.chunks.length) return;
    let chunk = this.chunks[ci]!;
    let i = firstEndingAfter(chunk, start);
    for (;;) {
      if (i === chunk.length) {
        if (++ci === this.chunks.length) return;
        chunk = this.chunks[ci]!;
        i = 0;
        continue;
      }
      const s = chunk[i++]!;
      if (s.offset >= end) return;
      const e = s.offset + s.length;
      sink.piece(s, s.offset > start ? s.offset : start, e < end ? e : end, fromUpper);
    }
  }

  /** All segments in order. */
  *[Symbol.iterator](): IterableIterator<Segment> {
    for (const c of this.chunks) yield* c;
  }

  toArray(): Segment[] {
    const out: Segment[] = [];
    for (const c of this.chunks) for (const s of c) out.push(s);
    return out;
  }

  /** Highest virtual sector mapped + 1 (0 when empty). */
  end(): number {
    const c = this.chunks[this.chunks.length - 1];
    return c && c.length ? segEnd(c[c.length - 1]!) : 0;
  }
}

/** Receives the visible pieces of a range: segment s, clipped to sectors [from, to). */
export interface PieceSink {
  piece(s: Segment, from: number, to: number, fromUpper: boolean): void;
}

/**
 * Combo lookup: the visible pieces of [start, end) of a writable index over a merged
 * read-only one, in order, as (segment, from, to); gaps between pieces are holes. Allocates
 * nothing (the read path runs it per request).
 */
export function comboVisit(upper: SegmentIndex | undefined, lower: SegmentIndex, start: number, end: number, sink: PieceSink): void {
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
  lower!: SegmentIndex;
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
