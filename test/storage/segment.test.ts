// The entry encodings of docs/formats.md and C++'s unit-test vectors for insert, merge, lookup and combo lookup.
import { describe, expect, test } from "bun:test";
import {
  type Segment,
  seg,
  encodeSegments,
  decodeSegment,
  decodeSegments,
  lookup,
  mergeAdjacent,
} from "../../src/storage/lsmt/segment.ts";
import { SegmentIndex } from "../../src/storage/lsmt/segment_index.ts";

const hex = (b: Uint8Array) => Array.from(b, (x) => x.toString(16).padStart(2, "0")).join(" ");
const bytes = (s: string) => new Uint8Array(s.split(" ").map((x) => parseInt(x, 16)));
const triple = (l: Segment[]) => l.map((s) => [s.offset, s.length, s.moffset]);
const quad = (l: Segment[]) => l.map((s) => [s.offset, s.length, s.moffset, s.tag]);

describe("segment encoding", () => {
  const vectors: [Segment, string][] = [
    [seg(0, 8, 8), "00 00 00 00 00 00 20 00 08 00 00 00 00 00 00 00"],
    [seg(16, 2, 16), "10 00 00 00 00 00 08 00 10 00 00 00 00 00 00 00"],
    [seg(32, 4, 18, true), "20 00 00 00 00 00 10 00 12 00 00 00 00 00 80 00"],
    [seg(1, 1, 1, false, 5), "01 00 00 00 00 00 04 00 01 00 00 00 00 00 00 05"],
  ];
  for (const [s, want] of vectors)
    test(`${JSON.stringify(s)}`, () => {
      expect(hex(encodeSegments([s]))).toBe(want);
      const d = decodeSegment(new DataView(bytes(want).buffer), 0);
      expect(d).toEqual(s);
    });

  test("padding entry", () => {
    expect(hex(encodeSegments([], 1))).toBe("ff ff ff ff ff ff 03 00 00 00 00 00 00 00 00 00");
    expect(decodeSegments(encodeSegments([seg(3, 1, 9)], 4))).toEqual([seg(3, 1, 9)]);
  });

  test("extreme fields decode; moffset beyond 2^53 is refused on encode", () => {
    const d = decodeSegment(new DataView(bytes("FE FF FF FF FF FF FF FF FF FF FF FF FF FF 7F AB").buffer), 0);
    expect(d.offset).toBe(2 ** 50 - 2);
    expect(d.length).toBe(16383);
    expect(d.zeroed).toBe(false);
    expect(d.tag).toBe(0xab);
    // 2^55 − 1 is not exact in a double; such a file would be 16 EiB, so we refuse to write one.
    expect(() => encodeSegments([seg(0, 1, 2 ** 54)])).toThrow(RangeError);
    const big = seg(2 ** 50 - 2, 16383, 2 ** 53 - 1, false, 0xab);
    expect(decodeSegment(new DataView(encodeSegments([big]).buffer), 0)).toEqual(big);
  });
});

describe("SegmentIndex insert (C++'s vector)", () => {
  test("overwrite insert", () => {
    const ix = new SegmentIndex();
    for (const [o, l, m] of [[0, 20, 0], [10, 15, 50], [30, 100, 20], [5, 10, 3], [40, 10, 123], [200, 10, 2133], [150, 100, 21]])
      ix.insert(seg(o!, l!, m!));
    expect(triple(ix.toArray())).toEqual([
      [0, 5, 0], [5, 10, 3], [15, 10, 55], [30, 10, 20], [40, 10, 123], [50, 80, 40], [150, 100, 21],
    ]);
  });

  test("zeroed entries keep moffset when cut", () => {
    const ix = new SegmentIndex();
    ix.insert(seg(0, 10, 100, true));
    ix.insert(seg(4, 2, 50));
    expect(ix.toArray()).toEqual([seg(0, 4, 100, true), seg(4, 2, 50), seg(6, 4, 100, true)]);
  });

  test("many random inserts across chunk boundaries match a per-sector model", () => {
    let seed = 12345;
    const rnd = (n: number) => ((seed = (seed * 1103515245 + 12345) >>> 0) % n);
    const model = new Int32Array(20000).fill(-1);
    const ix = new SegmentIndex();
    for (let i = 0; i < 5000; i++) {
      const off = rnd(19000);
      const len = 1 + (rnd(10) === 0 ? rnd(900) : rnd(8));
      const m = 100000 + i * 1000;
      ix.insert(seg(off, len, m));
      for (let k = 0; k < len; k++) model[off + k] = m + k;
    }
    const got = new Int32Array(20000).fill(-1);
    let prev = -1;
    for (const s of ix) {
      expect(s.offset).toBeGreaterThanOrEqual(prev);
      prev = s.offset + s.length;
      for (let k = 0; k < s.length; k++) got[s.offset + k] = s.moffset + k;
    }
    expect(Array.from(got)).toEqual(Array.from(model));
    // lookup agrees with the array form
    const arr = ix.toArray();
    for (let i = 0; i < 200; i++) {
      const b = rnd(19000);
      const e = b + 1 + rnd(2000);
      expect(ix.lookup(b, e)).toEqual(lookup(arr, b, e));
    }
  });
});

describe("mergeAdjacent (C++'s vectors)", () => {
  const q = (l: number[][]) => l.map(([o, len, m, t]) => seg(o!, len!, m!, false, t ?? 0));
  const cases: [number[][], number[][]][] = [
    [[[5, 5, 0], [10, 10, 5], [100, 10, 20]], [[5, 15, 0, 0], [100, 10, 20, 0]]],
    [[[5, 5, 0], [10, 10, 5], [20, 10, 15], [100, 10, 20]], [[5, 25, 0, 0], [100, 10, 20, 0]]],
    [[[5, 5, 0], [10, 10, 5], [20, 10, 15, 1], [100, 10, 20]], [[5, 15, 0, 0], [20, 10, 15, 1], [100, 10, 20, 0]]],
    [[[5, 5, 0], [10, 10, 5, 3], [20, 10, 15, 3], [30, 10, 20]], [[5, 5, 0, 0], [10, 20, 5, 3], [30, 10, 20, 0]]],
  ];
  for (const [input, want] of cases) test(JSON.stringify(input), () => expect(quad(mergeAdjacent(q(input)))).toEqual(want));
  test("merged length stays below 16383", () => {
    const parts = Array.from({ length: 300 }, (_, i) => seg(i * 64, 64, 8 + i * 64));
    expect(mergeAdjacent(parts).map((s) => s.length)).toEqual([16320, 300 * 64 - 16320]);
  });
});

describe("lookup (C++'s vector)", () => {
  const ix = [seg(0, 10, 0), seg(10, 10, 50), seg(100, 10, 20)];
  test.each([
    [5, 15, [[5, 5, 5], [10, 5, 50]]],
    [16, 26, [[16, 4, 56]]],
    [26, 36, []],
    [6, 106, [[6, 4, 6], [10, 10, 50], [100, 6, 20]]],
  ])("[%d,%d)", (b, e, want) => {
    expect(triple(lookup(ix, b, e))).toEqual(want);
    expect(triple(SegmentIndex.fromSorted(ix).lookup(b, e))).toEqual(want);
  });
});

describe("combo lookup (C++'s vectors)", () => {
  const { comboVisit } = require("../../src/storage/lsmt/segment_index.ts");
  const U = [[5, 5, 0], [10, 10, 50], [100, 10, 20]];
  const L1 = [[0, 1, 7], [2, 4, 5], [15, 10, 22], [30, 15, 89], [87, 50, 32], [150, 10, 84]];
  const L2 = [[1, 3, 134], [8, 4, 873], [18, 72, 320], [100, 100, 4893], [1000, 1000, 39823]];
  const L3 = [[23, 10, 0], [65, 10, 50], [89, 10, 20], [230, 43, 432], [1999, 31, 2393]];
  // Layers top-to-bottom as in the vector; the merged index numbers them base-first internally.
  const run = (lowersTopFirst: number[][][]) => {
    const merged = new SegmentIndex();
    const n = lowersTopFirst.length;
    lowersTopFirst
      .slice()
      .reverse()
      .forEach((layer, baseTag) => layer.forEach(([o, l, m]) => merged.insert(seg(o!, l!, m!, false, baseTag))));
    const upper = new SegmentIndex();
    U.forEach(([o, l, m]) => upper.insert(seg(o!, l!, m!)));
    const out: number[][] = [];
    comboVisit(upper, merged, 0, 10000, {
      piece: (s: Segment, from: number, to: number, fromUpper: boolean) =>
        out.push([from, to - from, s.moffset + (from - s.offset), fromUpper ? n : n - 1 - s.tag]),
    });
    return out;
  };
  const one = [[0, 1, 7, 0], [2, 3, 5, 0], [5, 5, 0, 1], [10, 10, 50, 1], [20, 5, 27, 0], [30, 15, 89, 0], [87, 13, 32, 0], [100, 10, 20, 1], [110, 27, 55, 0], [150, 10, 84, 0]];
  const two = [[0, 1, 7, 0], [1, 1, 134, 1], [2, 3, 5, 0], [5, 5, 0, 2], [10, 10, 50, 2], [20, 5, 27, 0], [25, 5, 327, 1], [30, 15, 89, 0], [45, 42, 347, 1], [87, 13, 32, 0], [100, 10, 20, 2], [110, 27, 55, 0], [137, 13, 4930, 1], [150, 10, 84, 0], [160, 40, 4953, 1], [1000, 1000, 39823, 1]];
  test("U over L1", () => expect(run([L1])).toEqual(one));
  test("U over L1,L2", () => expect(run([L1, L2])).toEqual(two));
  test("U over L1,L2,L3", () => {
    const three = two.map(([o, l, m, t]) => [o!, l!, m!, t === 2 ? 3 : t!]);
    three.splice(three.findIndex((e) => e[0] === 1000), 0, [230, 43, 432, 2]);
    three.push([2000, 30, 2394, 2]);
    expect(run([L1, L2, L3])).toEqual(three);
  });
});
