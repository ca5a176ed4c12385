import { describe, expect, test } from "bun:test";
import { crc32c, crc32cBackend, rawCrc32c, rawCrc32cPortable } from "../../src/storage/crc32c.ts";
import { randomBytes } from "../helpers/memfile.ts";

const check = new TextEncoder().encode("123456789");

describe("raw CRC-32C (ZFile's checksum)", () => {
  test("check values", () => {
    expect(rawCrc32c(0, check)).toBe(0x58e3fa20);
    expect(rawCrc32c(100007, check)).toBe(0x3c9bd4e0);
    expect(crc32c(check)).toBe(0xe3069283);
    expect(rawCrc32c(0, new Uint8Array(512))).toBe(0);
    expect(rawCrc32c(12345, new Uint8Array(0))).toBe(12345);
  });

  test("the napi module is in use", () => {
    expect(crc32cBackend).toBe("napi");
  });

  test("the TS fallback gives the same check values", () => {
    expect(rawCrc32cPortable(0, check)).toBe(0x58e3fa20);
    expect(rawCrc32cPortable(100007, check)).toBe(0x3c9bd4e0);
    expect((rawCrc32cPortable(0xffffffff, check) ^ 0xffffffff) >>> 0).toBe(0xe3069283);
  });

  test("napi and TS agree on unaligned views, all seeds are unsigned", () => {
    const big = randomBytes(70000, 7);
    for (const [start, len] of [[0, 0], [1, 1], [3, 7], [5, 13], [1, 4096], [7, 4099], [11, 65536]] as const) {
      const view = big.subarray(start, start + len);
      for (const seed of [0, 1, 100007, 0x80000000, 0xffffffff, 0xdeadbeef]) {
        const r = rawCrc32c(seed, view);
        expect(r).toBe(rawCrc32cPortable(seed, view));
        expect(r).toBeGreaterThanOrEqual(0);
      }
    }
  });

  test("chaining: raw(seed, a ++ b) = raw(raw(seed, a), b)", () => {
    const data = randomBytes(10000, 99);
    const whole = rawCrc32c(100007, data);
    expect(rawCrc32c(rawCrc32c(100007, data.subarray(0, 3333)), data.subarray(3333))).toBe(whole);
  });
});
