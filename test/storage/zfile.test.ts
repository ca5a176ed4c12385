import { describe, expect, test } from "bun:test";
import { createHash } from "node:crypto";
import { decompress as fzstdDecompress } from "fzstd";
import { rawCrc32c } from "../../src/storage/crc32c.ts";
import { ChecksumError, FormatError, TruncatedError } from "../../src/storage/errors.ts";
import { lz4Compress } from "../../src/storage/lz4.ts";
import {
  ZFileBuilder,
  ZFileReader,
  ZF_FLAGS_OVERWRITTEN_HEADER,
  ZF_FLAGS_TRAILER,
  decodeZFileHeader,
  encodeZFileHeader,
  isZFile,
  writeZFile,
  zfileHeaderDigest,
  zstdCompressBlock,
  zstdDecompressBlock,
  zstdRawFrame,
  zstdRawFrameSize,
  type ZFileAlgorithm,
} from "../../src/storage/zfile.ts";
import { MemFile, compressible, randomBytes } from "../helpers/memfile.ts";
import { zstdDecompressInto, zstdLibLoaded } from "../../ffi/zstd.ts";

const sha256 = (b: Uint8Array) => createHash("sha256").update(b).digest("hex");
const hex = (b: Uint8Array) => Buffer.from(b).toString("hex");
const ten = new TextEncoder().encode("0123456789");

async function zfileOf(data: Uint8Array, opts: Parameters<typeof writeZFile>[2]): Promise<MemFile> {
  const out = new MemFile("test.zfile");
  await writeZFile(new MemFile("src", data), out, opts);
  return out;
}

async function readAll(r: ZFileReader): Promise<Uint8Array> {
  const buf = new Uint8Array(r.size());
  expect(await r.pread(buf, 0)).toBe(r.size());
  return buf;
}

async function expectRejects(p: Promise<unknown>, cls: Function, match?: RegExp): Promise<Error> {
  try {
    await p;
  } catch (e) {
    expect(e).toBeInstanceOf(cls);
    if (match) expect((e as Error).message).toMatch(match);
    return e as Error;
  }
  throw new Error(`expected ${cls.name}`);
}

describe("the ten-byte LZ4 ZFile", () => {
  test("no header overwrite: byte for byte", async () => {
    const f = await zfileOf(ten, { algorithm: "lz4" });
    const b = f.bytes();
    expect(b.length).toBe(1043);
    expect(sha256(b)).toBe("34cb8840ef215e0e651debd350b04687d532474226d3da046161d8613863abfb");
    expect(hex(b.subarray(0x1c, 0x24))).toBe("fc12a2c713000000");
    expect(hex(b.subarray(0x200, 0x213))).toBe("a030313233343536373839f1e3bc1f0f000000");
    const trailer = decodeZFileHeader(b.subarray(0x213));
    expect(trailer.digest).toBe(0x81b07445);
    expect(trailer.flags).toBe(ZF_FLAGS_TRAILER);
    expect(trailer.indexCrc).toBe(0xef44db2c);
    expect(trailer.indexOffset).toBe(0x20f);
  });

  test("header overwrite: byte for byte", async () => {
    const f = await zfileOf(ten, { algorithm: "lz4", headerOverwrite: true });
    const b = f.bytes();
    expect(sha256(b)).toBe("b94d99a4c2c125d13614361f24203ca0ebe8a5277f4ae452857e8e26afef12dc");
    expect(hex(b.subarray(0x10, 0x60))).toBe(
      "40416c69626162616000000061a170711b000000000000000f02000000000000" +
        "01000000000000000a000000000000002cdb44ef000000000010000001000000" +
        "00000000000000000100000000000000",
    );
    expect(decodeZFileHeader(b).flags).toBe(ZF_FLAGS_OVERWRITTEN_HEADER);
  });

  test("the reader returns 0123456789 from both files", async () => {
    for (const headerOverwrite of [false, true]) {
      const f = await zfileOf(ten, { algorithm: "lz4", headerOverwrite });
      const r = await ZFileReader.open(new MemFile("b", f.bytes()));
      expect(r.size()).toBe(10);
      expect(r.blockCount).toBe(1);
      expect(new TextDecoder().decode(await readAll(r))).toBe("0123456789");
      const part = new Uint8Array(4);
      expect(await r.pread(part, 8)).toBe(2);
      expect(new TextDecoder().decode(part.subarray(0, 2))).toBe("89");
      expect(await r.pread(part, 10)).toBe(0);
    }
  });

  test("isZFile", async () => {
    const f = await zfileOf(ten, { algorithm: "lz4" });
    const b = f.bytes();
    expect(isZFile(b.subarray(0, 512))).toBe(true);
    expect(isZFile(b.subarray(b.length - 512))).toBe(false); // the trailer has no header bit
    expect(isZFile(new Uint8Array(512))).toBe(false);
    expect(isZFile(b.subarray(0, 20))).toBe(false);
  });
});

describe("header codec", () => {
  test("encode/decode round trip and digest over all 512 bytes", () => {
    const h = {
      flags: 0x16,
      indexOffset: 2 ** 40 + 5,
      indexSize: 123456,
      originalFileSize: 2 ** 45,
      indexCrc: 0xdeadbeef,
      blockSize: 65536,
      algorithm: 2,
      level: 0,
      useDict: 0,
      dictSize: 0,
      verify: true,
      digest: 0,
    };
    const b = encodeZFileHeader(h);
    const d = decodeZFileHeader(b);
    expect({ ...d, digest: 0 }).toEqual(h);
    expect(d.digest).toBe(zfileHeaderDigest(b));
    const zeroed = b.slice();
    zeroed.fill(0, 28, 32);
    expect(d.digest).toBe(rawCrc32c(0, zeroed));
  });
});

describe("round trips", () => {
  const algorithms: ZFileAlgorithm[] = ["zstd", "lz4"];
  for (const algorithm of algorithms) {
    for (const blockSize of [4096, 65536]) {
      for (const kind of ["random", "compressible"] as const) {
        test(`${algorithm}, ${blockSize}-byte blocks, ${kind}`, async () => {
          const gen = kind === "random" ? randomBytes : compressible;
          for (const n of [0, 1, blockSize - 1, blockSize, 3 * blockSize + 123]) {
            const data = gen(n, n + blockSize);
            const f = await zfileOf(data, { algorithm, blockSize });
            const r = await ZFileReader.open(new MemFile("z", f.bytes()));
            expect(r.size()).toBe(n);
            expect(r.blockCount).toBe(Math.ceil(n / blockSize));
            expect(r.blockSize).toBe(blockSize);
            expect(hex(await readAll(r))).toBe(hex(data));
            if (kind === "compressible" && n > blockSize) expect(f.size()).toBeLessThan(n);
            // Unaligned ranges, across block boundaries and past the end.
            const rnd = randomBytes(64, n + 1);
            for (let k = 0; k + 1 < rnd.length && n > 0; k += 2) {
              const off = (rnd[k]! * 997 + rnd[k + 1]!) % n;
              const len = 1 + ((rnd[k + 1]! * 131) % (2 * blockSize));
              const buf = new Uint8Array(len);
              const got = await r.pread(buf, off);
              expect(got).toBe(Math.min(len, n - off));
              expect(hex(buf.subarray(0, got))).toBe(hex(data.subarray(off, off + got)));
            }
          }
        });
      }
    }
  }

  test("empty file: header, empty index, trailer", async () => {
    const f = await zfileOf(new Uint8Array(0), { algorithm: "zstd" });
    expect(f.size()).toBe(1024);
    const t = decodeZFileHeader(f.bytes().subarray(512));
    expect(t.indexOffset).toBe(512);
    expect(t.indexSize).toBe(0);
    expect(t.indexCrc).toBe(0);
    const r = await ZFileReader.open(f);
    expect(r.size()).toBe(0);
    expect(await r.pread(new Uint8Array(10), 0)).toBe(0);
  });

  test("verify off, header overwrite on, and ZFileBuilder fed in odd pieces", async () => {
    const data = compressible(50000, 9);
    for (const algorithm of ["zstd", "lz4"] as const) {
      const out = new MemFile("piecewise");
      const b = await ZFileBuilder.create(out, { algorithm, verify: false, headerOverwrite: true });
      for (let at = 0, step = 1; at < data.length; at += step, step = step * 3 + 1) {
        await b.append(data.subarray(at, Math.min(data.length, at + step)));
      }
      const meta = await b.finish();
      expect(meta.verify).toBe(false);
      expect(meta.originalFileSize).toBe(data.length);
      const whole = await zfileOf(data, { algorithm, verify: false, headerOverwrite: true });
      expect(hex(out.bytes())).toBe(hex(whole.bytes()));
      const r = await ZFileReader.open(out);
      expect(r.verify).toBe(false);
      expect(hex(await readAll(r))).toBe(hex(data));
      await expect(b.append(data)).rejects.toThrow("ZFileBuilder used after finish()");
    }
  });

  test("the writer cuts a longer existing file", async () => {
    const out = new MemFile("reused", randomBytes(100000, 1));
    await writeZFile(new MemFile("src", ten), out, { algorithm: "lz4" });
    expect(sha256(out.bytes())).toBe("34cb8840ef215e0e651debd350b04687d532474226d3da046161d8613863abfb");
  });

  test("rejects block sizes the C++ tools cannot read", async () => {
    for (const blockSize of [512, 5000, 131072]) {
      await expect(ZFileBuilder.create(new MemFile("x"), { algorithm: "lz4", blockSize })).rejects.toThrow(RangeError);
    }
  });

  test("small reads within blocks (cache) and many reads in flight", async () => {
    const data = compressible(40000, 21);
    for (const cacheBytes of [0, 8192, undefined]) {
      const r = await ZFileReader.open(await zfileOf(data, { algorithm: "zstd" }), { cacheBytes });
      const reads: Promise<void>[] = [];
      for (let off = 0; off < data.length; off += 512) {
        reads.push(
          (async () => {
            const buf = new Uint8Array(512);
            const got = await r.pread(buf, off);
            expect(hex(buf.subarray(0, got))).toBe(hex(data.subarray(off, off + got)));
          })(),
        );
      }
      await Promise.all(reads);
      for (let off = 100; off < data.length; off += 700) {
        const buf = new Uint8Array(300);
        const got = await r.pread(buf, off);
        expect(hex(buf.subarray(0, got))).toBe(hex(data.subarray(off, off + got)));
      }
    }
  });

  test("close() closes the underlying file", async () => {
    const f = await zfileOf(ten, { algorithm: "lz4" });
    const r = await ZFileReader.open(f);
    await r.close();
    expect(f.closed).toBe(true);
  });
});

describe("corruption is reported, never read as data", () => {
  test("a flipped bit in a block is a ChecksumError naming the block", async () => {
    for (const algorithm of ["zstd", "lz4"] as const) {
      const data = compressible(5 * 4096, 3);
      const f = await zfileOf(data, { algorithm });
      const good = await ZFileReader.open(new MemFile("good", f.bytes()));
      const { offset, length } = good.blockExtent(2);
      const bytes = f.bytes();
      bytes[offset + (length >> 1)] = bytes[offset + (length >> 1)]! ^ 0x10;
      const r = await ZFileReader.open(new MemFile("bad.zfile", bytes));
      const intact = new Uint8Array(8192);
      await r.pread(intact, 0);
      expect(hex(intact)).toBe(hex(data.subarray(0, 8192)));
      const e = (await expectRejects(r.pread(new Uint8Array(100), 2 * 4096 + 50), ChecksumError, /block 2\b/)) as ChecksumError;
      expect(e.file).toBe("bad.zfile");
      expect(e.offset).toBe(offset);
      expect(e.message).toContain("bad.zfile");
    }
  });

  test("a flipped bit in a stored CRC is caught too", async () => {
    const f = await zfileOf(compressible(3 * 4096, 4), { algorithm: "lz4" });
    const { offset, length } = (await ZFileReader.open(new MemFile("g", f.bytes()))).blockExtent(1);
    const bytes = f.bytes();
    bytes[offset + length - 1] = bytes[offset + length - 1]! ^ 1;
    const r = await ZFileReader.open(new MemFile("crc", bytes));
    await expectRejects(r.pread(new Uint8Array(4096), 4096), ChecksumError, /block 1\b/);
  });

  test("a malformed block with a matching CRC is a FormatError naming the block", async () => {
    for (const algorithm of ["zstd", "lz4"] as const) {
      const f = await zfileOf(compressible(2 * 4096, 5), { algorithm });
      const { offset, length } = (await ZFileReader.open(new MemFile("g", f.bytes()))).blockExtent(1);
      const bytes = f.bytes();
      const payload = bytes.subarray(offset, offset + length - 4);
      if (algorithm === "lz4") payload[0] = 0xff; // the first literal run no longer fits the block
      else payload[5] = payload[5]! ^ 0x01; // the frame no longer declares 4096 bytes
      new DataView(bytes.buffer).setUint32(offset + length - 4, rawCrc32c(100007, payload), true);
      const r = await ZFileReader.open(new MemFile("fmt", bytes));
      await expectRejects(r.pread(new Uint8Array(4096), 4096), FormatError, /block 1\b/);
    }
  });

  test("bad magic is a FormatError", async () => {
    const bytes = (await zfileOf(ten, { algorithm: "lz4" })).bytes();
    bytes[0] = 0x59;
    await expectRejects(ZFileReader.open(new MemFile("m", bytes)), FormatError, /magic/);
    await expectRejects(ZFileReader.open(new MemFile("zeros", new Uint8Array(4096))), FormatError);
  });

  test("a bad header digest is a ChecksumError", async () => {
    const bytes = (await zfileOf(ten, { algorithm: "lz4" })).bytes();
    bytes[100] = 1;
    await expectRejects(ZFileReader.open(new MemFile("d", bytes)), ChecksumError, /digest/);
  });

  test("a bad index_crc is a ChecksumError", async () => {
    for (const headerOverwrite of [false, true]) {
      const f = await zfileOf(compressible(3 * 4096, 6), { algorithm: "lz4", headerOverwrite });
      const bytes = f.bytes();
      const meta = decodeZFileHeader(bytes.subarray(bytes.length - 512));
      // Swap two index entries: lengths stay plausible, the CRC does not.
      const v = new DataView(bytes.buffer);
      const a = v.getUint32(meta.indexOffset, true);
      v.setUint32(meta.indexOffset, v.getUint32(meta.indexOffset + 4, true), true);
      v.setUint32(meta.indexOffset + 4, a, true);
      await expectRejects(ZFileReader.open(new MemFile("i", bytes)), ChecksumError, /index_crc/);
    }
  });

  test("truncated files are TruncatedErrors", async () => {
    const data = compressible(4 * 4096, 8);
    const plain = (await zfileOf(data, { algorithm: "zstd" })).bytes();
    const over = (await zfileOf(data, { algorithm: "zstd", headerOverwrite: true })).bytes();
    for (const cut of [1, 100, 600, plain.length - 520]) {
      await expectRejects(ZFileReader.open(new MemFile("t", plain.subarray(0, plain.length - cut))), TruncatedError);
    }
    await expectRejects(ZFileReader.open(new MemFile("t", plain.subarray(0, 300))), TruncatedError);
    // With the rewritten header, losing only the trailer still leaves a readable file.
    const noTrailer = await ZFileReader.open(new MemFile("t", over.subarray(0, over.length - 512)));
    expect(hex(await readAll(noTrailer))).toBe(hex(data));
    await expectRejects(ZFileReader.open(new MemFile("t", over.subarray(0, over.length - 600))), TruncatedError);
  });

  test("data cut short after open is a TruncatedError", async () => {
    const f = await zfileOf(compressible(4 * 4096, 8), { algorithm: "lz4", headerOverwrite: true });
    const r = await ZFileReader.open(f);
    await f.truncate(1000);
    await expectRejects(r.pread(new Uint8Array(4096), 8192), TruncatedError);
  });

  test("a trailer that disagrees with the rewritten header is a FormatError", async () => {
    const bytes = (await zfileOf(compressible(3 * 4096, 6), { algorithm: "lz4", headerOverwrite: true })).bytes();
    const t = decodeZFileHeader(bytes.subarray(bytes.length - 512));
    bytes.set(encodeZFileHeader({ ...t, originalFileSize: t.originalFileSize - 1 }), bytes.length - 512);
    await expectRejects(ZFileReader.open(new MemFile("x", bytes)), FormatError, /trailer/);
  });

  test("unsupported algorithm and impossible sizes are FormatErrors", async () => {
    const bytes = (await zfileOf(ten, { algorithm: "lz4" })).bytes();
    const t = decodeZFileHeader(bytes.subarray(bytes.length - 512));
    const at = bytes.length - 512;
    for (const bad of [{ algorithm: 0 }, { originalFileSize: 5000 }, { indexOffset: 0x20e, flags: 0x06 }, { blockSize: 0 }]) {
      const copy = bytes.slice();
      copy.set(encodeZFileHeader({ ...t, ...bad }), at);
      await expectRejects(ZFileReader.open(new MemFile("x", copy)), FormatError);
    }
  });
});

describe("zstd blocks", () => {
  test("the raw-block frame decodes with Bun and with fzstd", () => {
    for (const n of [0, 1, 255, 256, 4096, 65535 + 256, 65536 + 256, 200000]) {
      const data = randomBytes(n, n + 3);
      const frame = zstdRawFrame(data);
      expect(frame.length).toBe(zstdRawFrameSize(n));
      expect(hex(frame.subarray(0, 4))).toBe("28b52ffd");
      expect(hex(Bun.zstdDecompressSync(frame))).toBe(hex(data));
      expect(hex(fzstdDecompress(frame))).toBe(hex(data));
      expect(hex(zstdDecompressBlock(frame, n))).toBe(hex(data));
    }
  });

  test("the raw-block frame layout for 4096 bytes", () => {
    const frame = zstdRawFrame(new Uint8Array(4096).fill(1));
    // FHD 0x60 (2-byte FCS, single segment), FCS 4096-256, block header last|raw|4096<<3.
    expect(hex(frame.subarray(0, 10))).toBe("28b52ffd60000f018000");
    expect(frame.length).toBe(4106);
  });

  test("incompressible blocks never exceed the raw frame; compressible ones shrink", () => {
    const rnd = randomBytes(4096, 1);
    expect(zstdCompressBlock(rnd).length).toBeLessThanOrEqual(zstdRawFrameSize(4096));
    expect(hex(zstdDecompressBlock(zstdCompressBlock(rnd), 4096))).toBe(hex(rnd));
    const text = compressible(4096, 2);
    const z = zstdCompressBlock(text);
    expect(z.length).toBeLessThan(4096);
    expect(hex(fzstdDecompress(z))).toBe(hex(text));
  });

  test("a wrong size or a broken frame is a FormatError", () => {
    const z = zstdCompressBlock(compressible(4096, 2));
    expect(() => zstdDecompressBlock(z, 4095)).toThrow(FormatError);
    expect(() => zstdDecompressBlock(new Uint8Array([1, 2, 3, 4, 5, 6]), 10)).toThrow(FormatError);
    const broken = z.slice(0, z.length - 3);
    expect(() => zstdDecompressBlock(broken, 4096)).toThrow(FormatError);
  });

  test.skipIf(!zstdLibLoaded)(`libzstd decodes into the caller's buffer and never past it${zstdLibLoaded ? "" : " (skipped: libzstd.so.1 did not load)"}`, () => {
    const text = compressible(4096, 3);
    const frame = Bun.zstdCompressSync(text, { content_size: false } as never);
    const out = new Uint8Array(4100).fill(0xee);
    expect(zstdDecompressInto(out.subarray(0, 4096), frame)).toBe(4096);
    expect(hex(out.subarray(0, 4096))).toBe(hex(text));
    expect(hex(out.subarray(4096))).toBe("eeeeeeee"); // untouched
    out.fill(0xee);
    expect(() => zstdDecompressInto(out.subarray(0, 4000), frame)).toThrow(/too small/);
    expect(hex(out.subarray(4000))).toBe("ee".repeat(100));
    expect(() => zstdDecompressInto(out, new Uint8Array([0x28, 0xb5, 0x2f, 0xfd, 1]))).toThrow(Error);
    expect(zstdDecompressInto(new Uint8Array(0), zstdRawFrame(new Uint8Array(0)))).toBe(0);
  });

  test("lz4 and zstd files of the same data read the same", async () => {
    const data = compressible(20000, 12);
    const a = await ZFileReader.open(await zfileOf(data, { algorithm: "lz4" }));
    const b = await ZFileReader.open(await zfileOf(data, { algorithm: "zstd" }));
    expect(hex(await readAll(a))).toBe(hex(await readAll(b)));
    expect(lz4Compress(data).length).toBeGreaterThan(0);
  });
});
