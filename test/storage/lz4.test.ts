import { describe, expect, test } from "bun:test";
import { FormatError } from "../../src/storage/errors.ts";
import { lz4Compress, lz4CompressBound, lz4CompressInto, lz4Decompress, lz4DecompressInto } from "../../src/storage/lz4.ts";
import { compressible, randomBytes } from "../helpers/memfile.ts";

const hex = (b: Uint8Array) => Buffer.from(b).toString("hex");

describe("lz4 compressor", () => {
  test("inputs under 13 bytes are one literal run", () => {
    expect(hex(lz4Compress(new TextEncoder().encode("0123456789")))).toBe("a030313233343536373839");
    expect(hex(lz4Compress(new Uint8Array(0)))).toBe("00");
    expect(hex(lz4Compress(new Uint8Array(12).fill(7)))).toBe("c0" + "07".repeat(12));
  });

  test("4096 zero bytes and 4096 x 0xAA match LZ4 1.8.3", () => {
    const tail = "ff".repeat(15) + "f650";
    expect(hex(lz4Compress(new Uint8Array(4096)))).toBe("1f000100" + tail + "0000000000");
    expect(hex(lz4Compress(new Uint8Array(4096).fill(0xaa)))).toBe("1faa0100" + tail + "aaaaaaaaaa");
  });

  test("literal runs of 15 and more use length bytes", () => {
    const data = randomBytes(300, 3);
    const c = lz4Compress(data);
    expect(c[0]).toBe(0xf0);
    expect(c[1]).toBe(255);
    expect(c[2]).toBe(300 - 15 - 255);
    expect(c.length).toBe(303);
  });

  test("round trips", () => {
    for (const n of [0, 1, 12, 13, 14, 17, 100, 4095, 4096, 65536, 65547, 70000, 200000]) {
      for (const data of [randomBytes(n, n + 1), compressible(n, n + 2), new Uint8Array(n).fill(0x5a)]) {
        const c = lz4Compress(data);
        expect(c.length).toBeLessThanOrEqual(lz4CompressBound(n));
        expect(hex(lz4Decompress(c, n))).toBe(hex(data));
      }
    }
  });

  test("compressible data shrinks", () => {
    const data = compressible(65536, 5);
    expect(lz4Compress(data).length).toBeLessThan(data.length / 2);
  });

  test("refuses an output buffer below the bound", () => {
    expect(() => lz4CompressInto(new Uint8Array(100), new Uint8Array(100))).toThrow(RangeError);
  });
});

describe("lz4 decoder on malformed input", () => {
  const bad: [string, number[], number][] = [
    ["empty block", [], 16],
    ["literal run past the input", [0x50, 1, 2, 3], 16],
    ["literal length byte missing", [0xf0], 64],
    ["literal length past the input", [0xf0, 10, 1, 2], 64],
    ["output larger than expected", [0x40, 1, 2, 3, 4], 3],
    ["offset cut short", [0x10, 1, 0x01], 16],
    ["offset zero", [0x10, 1, 0x00, 0x00, 0x00], 16],
    ["offset before the output start", [0x10, 1, 0x02, 0x00, 0x00], 16],
    ["match past the output", [0x1f, 1, 0x01, 0x00, 0x40, 0x00], 16],
    ["match length byte missing", [0x1f, 1, 0x01, 0x00], 64],
    ["ends after a match", [0x10, 1, 0x01, 0x00], 16],
  ];
  for (const [what, bytes, cap] of bad) {
    test(what, () => {
      expect(() => lz4DecompressInto(new Uint8Array(bytes), new Uint8Array(cap))).toThrow(FormatError);
    });
  }

  test("a wrong expected size is a FormatError", () => {
    const c = lz4Compress(compressible(1000, 1));
    expect(() => lz4Decompress(c, 999)).toThrow(FormatError);
    expect(() => lz4Decompress(c, 1001)).toThrow(FormatError);
  });

  test("mutated blocks either decode or throw FormatError, never write outside the output", () => {
    const data = compressible(4096, 11);
    const good = lz4Compress(data);
    const rnd = randomBytes(4000, 77);
    const arena = new Uint8Array(4096 + 64);
    for (let iter = 0; iter < 1000; iter++) {
      const c = good.slice(0, good.length - (rnd[iter]! % 3 === 0 ? rnd[iter + 1]! % 8 : 0));
      for (let k = 0; k < 3; k++) {
        const at = rnd[(iter * 3 + k) % rnd.length]! % c.length;
        c[at] = c[at]! ^ (1 << (rnd[(iter + k) % rnd.length]! & 7));
      }
      arena.fill(0xee);
      const out = arena.subarray(32, 32 + 4096);
      try {
        lz4DecompressInto(c, out);
      } catch (e) {
        expect(e).toBeInstanceOf(FormatError);
      }
      let guardsIntact = true;
      for (let i = 0; i < 32; i++) guardsIntact &&= arena[i] === 0xee && arena[arena.length - 1 - i] === 0xee;
      expect(guardsIntact).toBe(true);
    }
  });
});
