// SegmentMapping: the 16-byte index entry of an LSMT layer (docs/formats.md, LSMT index entry),
// and the pure algorithms over sorted arrays of them (lookup, merging neighbours).
// Units are 512-byte sectors throughout.

export const SECTOR = 512;
export const SEGMENT_BYTES = 16;
/** Longest run one entry can map (14-bit length). */
export const MAX_SEGMENT_SECTORS = 16383;
/** offset value that marks a padding / invalid entry (2^50 − 1). */
export const INVALID_OFFSET = 2 ** 50 - 1;
/** moffset is 55 bits on disk, but a JS number is exact only to 2^53: larger ones are refused. */
export const MAX_MOFFSET = Number.MAX_SAFE_INTEGER;

export interface Segment {
  offset: number; // virtual sector
  length: number; // sectors, 1..16383
  moffset: number; // sector inside the layer file (unused when zeroed, but validated by C++)
  zeroed: boolean;
  tag: number; // layer number at run time
}

export function seg(offset: number, length: number, moffset: number, zeroed = false, tag = 0): Segment {
  return { offset, length, moffset, zeroed, tag };
}

export const segEnd = (s: Segment) => s.offset + s.length;
/** Where the mapped run ends in the layer file; a zeroed entry has no extent. */
export const segMend = (s: Segment) => (s.zeroed ? s.moffset : s.moffset + s.length);

const TWO32 = 2 ** 32;
const INV_TWO32 = 2 ** -32;

/**
 * Entries held in a Float64Array (SegmentIndex's chunks): ENTRY_DOUBLES doubles each, offset,
 * length, moffset, then flags: bit 0 zeroed, the tag above it (flags = zeroed + 2 · tag).
 */
export const ENTRY_DOUBLES = 4;
const ONE_ENTRY = new Float64Array(ENTRY_DOUBLES); // encodeSegment's; a call runs to completion

/**
 * Encode into dv at byte pos, as two little-endian u64 words (w0 = offset|length<<50,
 * w1 = moffset|zeroed<<55|tag<<56); `tag` replaces s.tag when given.
 */
export function encodeSegment(dv: DataView, pos: number, s: Segment, tag = s.tag): void {
  ONE_ENTRY[0] = s.offset;
  ONE_ENTRY[1] = s.length;
  ONE_ENTRY[2] = s.moffset;
  ONE_ENTRY[3] = s.zeroed ? 1 : 0;
  encodeEntries(dv, pos, ONE_ENTRY, 1, tag);
}

/**
 * The first `count` entries of `d` (ENTRY_DOUBLES each) encoded from byte pos on, each as
 * encodeSegment writes it, with tag `tag`. One loop without calls: a seal encodes 100k+ entries
 * in code that runs too rarely to be compiled well first.
 */
export function encodeEntries(dv: DataView, pos: number, d: Float64Array, count: number, tag: number): void {
  const w1tag = (tag & 0xff) << 24;
  for (let at = 0; at < count * ENTRY_DOUBLES; at += ENTRY_DOUBLES) {
    const offset = d[at]!;
    const moffset = d[at + 2]!;
    if (moffset > MAX_MOFFSET) throw new RangeError(`moffset ${moffset} exceeds 2^53`);
    // x >>> 0 is x mod 2^32 for any integer below 2^53, and (x - low) · 2^-32 its high word, exactly.
    const offLo = offset >>> 0;
    const mLo = moffset >>> 0;
    // w0: offset bits 0..49 (low 32 + high 18), length bits 50..63 → high word bits 18..31.
    dv.setUint32(pos, offLo, true);
    dv.setUint32(pos + 4, (((offset - offLo) * INV_TWO32) & 0x3ffff) | ((d[at + 1]! & 0x3fff) << 18), true);
    // w1: moffset bits 0..54 (low 32 + high 23), zeroed bit 55, tag bits 56..63.
    dv.setUint32(pos + 8, mLo, true);
    dv.setUint32(pos + 12, ((((moffset - mLo) * INV_TWO32) & 0x7fffff) | (d[at + 3]! % 2 === 1 ? 0x800000 : 0) | w1tag) >>> 0, true);
    pos += SEGMENT_BYTES;
  }
}

export function decodeSegment(dv: DataView, pos: number): Segment {
  const w0hi = dv.getUint32(pos + 4, true);
  const w1hi = dv.getUint32(pos + 12, true);
  return {
    offset: dv.getUint32(pos, true) + (w0hi & 0x3ffff) * TWO32,
    length: w0hi >>> 18,
    moffset: dv.getUint32(pos + 8, true) + (w1hi & 0x7fffff) * TWO32,
    zeroed: (w1hi & 0x800000) !== 0,
    tag: w1hi >>> 24,
  };
}

/** The padding entry, byte for byte `FF FF FF FF FF FF 03 00` + 8 zero bytes. */
export function encodeInvalid(dv: DataView, pos: number): void {
  dv.setUint32(pos, 0xffffffff, true);
  dv.setUint32(pos + 4, 0x0003ffff, true);
  dv.setUint32(pos + 8, 0, true);
  dv.setUint32(pos + 12, 0, true);
}

export function encodeSegments(list: readonly Segment[], paddedCount = list.length): Uint8Array {
  const out = new Uint8Array(paddedCount * SEGMENT_BYTES);
  const dv = new DataView(out.buffer);
  for (let i = 0; i < list.length; i++) encodeSegment(dv, i * SEGMENT_BYTES, list[i]!);
  for (let i = list.length; i < paddedCount; i++) encodeInvalid(dv, i * SEGMENT_BYTES);
  return out;
}

/** Decode an entry array, dropping padding entries (offset 2^50 − 1). */
export function decodeSegments(bytes: Uint8Array): Segment[] {
  const dv = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  const n = Math.floor(bytes.byteLength / SEGMENT_BYTES);
  const out: Segment[] = [];
  for (let i = 0; i < n; i++) {
    const s = decodeSegment(dv, i * SEGMENT_BYTES);
    if (s.offset !== INVALID_OFFSET) out.push(s);
  }
  return out;
}

/** First index i with list[i].offset + list[i].length > sector (binary search on a sorted, disjoint list). */
export function firstEndingAfter(list: readonly Segment[], sector: number, lo = 0, hi = list.length): number {
  while (lo < hi) {
    const mid = (lo + hi) >>> 1;
    const s = list[mid]!;
    if (s.offset + s.length > sector) hi = mid;
    else lo = mid + 1;
  }
  return lo;
}

/** Copy of s clipped to [start, end); moffset moves with the start unless zeroed. */
export function clip(s: Segment, start: number, end: number): Segment {
  const b = Math.max(s.offset, start);
  const e = Math.min(s.offset + s.length, end);
  return {
    offset: b,
    length: e - b,
    moffset: s.zeroed ? s.moffset : s.moffset + (b - s.offset),
    zeroed: s.zeroed,
    tag: s.tag,
  };
}

/** Lookup: the pieces of a sorted, disjoint list that cover [start, end), trimmed to it. */
export function lookup(list: readonly Segment[], start: number, end: number, out: Segment[] = []): Segment[] {
  for (let i = firstEndingAfter(list, start); i < list.length; i++) {
    const s = list[i]!;
    if (s.offset >= end) break;
    out.push(s.offset >= start && s.offset + s.length <= end ? s : clip(s, start, end));
  }
  return out;
}

/**
 * C++'s compress_raw_index: fold neighbours that continue each other on disk. `limit` is the
 * exclusive bound on a merged length: C++ uses 16383 (so runs come out as 16320 + rest).
 */
export function mergeAdjacent(list: readonly Segment[], limit = MAX_SEGMENT_SECTORS): Segment[] {
  const out: Segment[] = [];
  let a: Segment | undefined;
  for (const b of list) {
    if (
      a &&
      a.offset + a.length === b.offset &&
      segMend(a) === b.moffset &&
      a.zeroed === b.zeroed &&
      a.tag === b.tag &&
      a.length + b.length < limit
    ) {
      a.length += b.length;
      continue;
    }
    a = { ...b };
    out.push(a);
  }
  return out;
}

/** Split a run into entries of at most 16383 sectors (the on-disk length limit). */
export function splitLong(s: Segment, max = MAX_SEGMENT_SECTORS): Segment[] {
  if (s.length <= max) return [s];
  const out: Segment[] = [];
  for (let done = 0; done < s.length; done += max) {
    const k = Math.min(max, s.length - done);
    out.push(seg(s.offset + done, k, s.zeroed ? s.moffset : s.moffset + done, s.zeroed, s.tag));
  }
  return out;
}
