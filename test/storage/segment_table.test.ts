// SegmentTable, the read-only index in typed arrays: its merge of a stack against the overwrite
// inserts of SegmentIndex (C++'s algorithm), its lookups against plain arrays, and its decode
// against decodeSegments plus C++'s checks.
import { describe, expect, test } from "bun:test";
import { FormatError } from "../../src/storage/errors.ts";
import { type Segment, decodeSegments, encodeSegments, lookup, seg } from "../../src/storage/lsmt/segment.ts";
import { SegmentIndex } from "../../src/storage/lsmt/segment_index.ts";
import { SegmentTable } from "../../src/storage/lsmt/segment_table.ts";
import { prng } from "../helpers/tmp.ts";

const SECTORS = 4000;

/** One layer: sorted, disjoint runs, some continuing each other in the file, some zeroed. */
function randomLayer(rnd: () => number): Segment[] {
  const out: Segment[] = [];
  let m = 8 + Math.floor(rnd() * 100);
  for (let o = Math.floor(rnd() * 50); o < SECTORS; ) {
    const len = 1 + Math.floor(rnd() * (rnd() < 0.1 ? 300 : 12));
    const zeroed = rnd() < 0.1;
    if (rnd() < 0.6) out.push(seg(o, Math.min(len, SECTORS - o), zeroed ? 77 : m, zeroed));
    m += rnd() < 0.7 ? len : len + 3; // mostly continuing in the file, so neighbours fold
    o += len + (rnd() < 0.5 ? 0 : Math.floor(rnd() * 40));
  }
  return out;
}

/** Per sector: the layer tag and file sector that shows there (-1: a hole, -2: zeroed). */
function sectorsOf(visit: (sink: { piece(s: Segment, from: number, to: number): void }) => void): Int32Array {
  const out = new Int32Array(2 * SECTORS).fill(-1);
  visit({
    piece(s, from, to) {
      for (let k = from; k < to; k++) {
        out[2 * k] = s.tag;
        out[2 * k + 1] = s.zeroed ? -2 : s.moffset + (k - s.offset);
      }
    },
  });
  return out;
}

describe("SegmentTable", () => {
  for (const seed of [1, 2, 3, 4, 5, 6, 7, 8]) {
    test(`a stack merged by overlay shows what overwrite inserts show (seed ${seed})`, () => {
      const rnd = prng(seed);
      const layers = Array.from({ length: 1 + Math.floor(rnd() * 12) }, () => randomLayer(rnd));
      const model = new SegmentIndex();
      layers.forEach((l, tag) => l.forEach((s) => model.insert({ ...s, tag })));
      const tables = layers.map((l) => SegmentTable.fromSorted(l));
      const want = sectorsOf((sink) => model.visit(0, SECTORS, sink, false));
      // Built all at once, and one layer at a time as restacks add them.
      const stacked = SegmentTable.stack(tables);
      let oneByOne = SegmentTable.empty();
      tables.forEach((t, tag) => (oneByOne = oneByOne.overlay(t, tag)));
      for (const t of [stacked, oneByOne]) {
        expect(sectorsOf((sink) => t.visit(0, SECTORS, sink, false))).toEqual(want);
        // The buckets a merge fills as it goes find what those of a table built from its entries find.
        const same = SegmentTable.fromSorted(t.toArray());
        for (let q = 0; q < 300; q++) {
          const b = Math.floor(rnd() * (SECTORS + 50));
          const e = b + 1 + Math.floor(rnd() * 40);
          const got: Segment[] = [];
          const ref: Segment[] = [];
          t.visit(b, e, { piece: (s) => got.push({ ...s }) }, false);
          same.visit(b, e, { piece: (s) => ref.push({ ...s }) }, false);
          expect(got).toEqual(ref);
          expect(t.covering(b, e)).toBe(same.covering(b, e));
        }
        // Neighbours that continue each other in one file are one entry.
        const all = t.toArray();
        for (let i = 1; i < all.length; i++) {
          const a = all[i - 1]!;
          const b = all[i]!;
          const continues = a.offset + a.length === b.offset && a.tag === b.tag && a.zeroed === b.zeroed && (a.zeroed ? a.moffset : a.moffset + a.length) === b.moffset;
          expect(continues).toBe(false);
        }
      }
    });
  }

  test("lookups agree with plain arrays: visit, covering, and past the end", () => {
    const rnd = prng(99);
    const list = randomLayer(rnd);
    const t = SegmentTable.fromSorted(list);
    for (let i = 0; i < 2000; i++) {
      const b = Math.floor(rnd() * (SECTORS + 100));
      const e = b + 1 + Math.floor(rnd() * 64);
      const got: Segment[] = [];
      t.visit(b, e, { piece: (s, from, to) => got.push({ ...s, offset: from, length: to - from, moffset: s.zeroed ? s.moffset : s.moffset + (from - s.offset) }) }, false);
      expect(got).toEqual(lookup(list, b, e));
      const one = list.findIndex((s) => s.offset <= b && s.offset + s.length >= e);
      expect(t.covering(b, e)).toBe(one);
      if (one >= 0 && !list[one]!.zeroed) expect(t.fileSectorAt(one, b)).toBe(list[one]!.moffset + (b - list[one]!.offset));
    }
    expect(SegmentTable.empty().covering(0, 8)).toBe(-1);
    expect(t.covering(t.end() + 5, t.end() + 6)).toBe(-1);
  });

  test("decode keeps entries as the file has them and checks them as C++ does", () => {
    const list = [seg(0, 8, 8), seg(8, 8, 16), seg(20, 0, 30), seg(24, 4, 40, true)];
    const bytes = encodeSegments(list, 6); // two padding entries
    const t = SegmentTable.decode(bytes, 100, "x", 0);
    expect(t.toArray()).toEqual(decodeSegments(bytes).filter((s) => s.length > 0)); // not folded; length 0 dropped
    // Unaligned bytes decode the same.
    const shifted = new Uint8Array(bytes.length + 1);
    shifted.set(bytes, 1);
    expect(SegmentTable.decode(shifted.subarray(1), 100, "x", 0).toArray()).toEqual(t.toArray());
    expect(() => SegmentTable.decode(encodeSegments([seg(8, 8, 8), seg(0, 8, 16)]), 100, "x", 0)).toThrow(/entry 1 at sector 0 overlaps/);
    expect(() => SegmentTable.decode(encodeSegments([seg(0, 8, 96)]), 100, "x", 0)).toThrow(FormatError);
    expect(() => SegmentTable.decode(encodeSegments([seg(0, 8, 4)]), 100, "x", 0)).toThrow(/outside the data area/);
  });
});

describe("SegmentIndex.maps", () => {
  test("says whether any segment overlaps a range, as lookup does", () => {
    const rnd = prng(7);
    const ix = new SegmentIndex();
    expect(ix.maps(0, 100)).toBe(false);
    for (let i = 0; i < 3000; i++) ix.insert(seg(Math.floor(rnd() * 20000), 1 + Math.floor(rnd() * 8), 100 + i * 8));
    for (let i = 0; i < 3000; i++) {
      const b = Math.floor(rnd() * 21000);
      const e = b + 1 + Math.floor(rnd() * 16);
      expect(ix.maps(b, e)).toBe(ix.lookup(b, e).length > 0);
    }
  });
});
