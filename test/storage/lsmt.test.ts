// The layer vector of docs/formats.md, byte for byte, plus the read-only open rules.
import { describe, expect, test } from "bun:test";
import { readFileSync, writeFileSync, copyFileSync, statSync, openSync, closeSync, existsSync, unlinkSync, mkdirSync, rmdirSync } from "node:fs";
import { join } from "node:path";
import { WritableLayer } from "../../src/storage/lsmt/writable_layer.ts";
import { ReadOnlyLayer } from "../../src/storage/lsmt/readonly_layer.ts";
import { Image } from "../../src/storage/image.ts";
import { LocalFile, localIoEngine, localIoSqes } from "../../src/storage/local_file.ts";
import { openLayerFile } from "../../src/storage/open_layer.ts";
import { writeZFile } from "../../src/storage/zfile.ts";
import { FormatError, TruncatedError, IoRangeError, StorageError } from "../../src/storage/errors.ts";
import { scratchDir, sha256 } from "../helpers/tmp.ts";
import { lseek, SEEK_DATA, SEEK_HOLE } from "../../ffi/libc.ts";

const dir = scratchDir("lsmt");
const fill = (n: number, v: number) => new Uint8Array(n).fill(v);

async function layerVector(tag: string) {
  const data = join(dir, `${tag}.data`);
  const index = join(dir, `${tag}.index`);
  const l = await WritableLayer.create(data, index, {
    virtualSize: 1 << 30,
    uuid: "5D8A6F1E-2B3C-4D4E-8F90-A1B2C3D4E5F6",
    appendOnly: true, // the vector is C++'s writer, which appends the rewrite of sector 1
  });
  await l.write(fill(4096, 0xaa), 0);
  await l.write(fill(1024, 0xbb), 8192);
  await l.discard(16384, 2048);
  await l.write(fill(512, 0xcc), 512);
  return { l, data, index };
}

describe("the layer vector: write, write, discard, rewrite on 1 GiB", () => {
  test("RW data and index files", async () => {
    const { l, data, index } = await layerVector("rw");
    await l.close();
    expect(readFileSync(data).length).toBe(9728);
    expect(sha256(readFileSync(data))).toBe("9c0cd02f51fa571474133183ec21e7df345a32a359b7b5108b305e1245b8d00f");
    expect(readFileSync(index).length).toBe(4160);
    expect(sha256(readFileSync(index))).toBe("7be2a4d1fde49b06b954fbb0e0ec16559c729963acd5fddfd74dcfa71f065782");
    const re = await WritableLayer.open(data, index);
    expect(re.index.toArray().map((s) => [s.offset, s.length, s.moffset, s.zeroed])).toEqual([
      [0, 1, 8, false], [1, 1, 18, false], [2, 6, 10, false], [16, 2, 16, false], [32, 4, 18, true],
    ]);
    await re.close();
  });

  test("sealed in place", async () => {
    const { l, data } = await layerVector("seal");
    await l.seal();
    await l.close();
    const b = readFileSync(data);
    expect(b.length).toBe(14336);
    expect(sha256(b)).toBe("e294afa5a3f1bd44fcfc399e3099c1303cbb5d203efcca0cc5e06c382aa1eccc");
    const ro = await openLayerFile(data);
    expect(ro.index.length).toBe(5);
    await ro.close();
  });

  test("committed with message and uuid", async () => {
    const { l } = await layerVector("commit");
    const out = join(dir, "commit.out");
    const image = Image.fromLayers([], l);
    const f = await LocalFile.open(out, { write: true, create: true });
    await image.commit(f, { message: "hello", uuid: "0a1b2c3d-4e5f-6071-8293-a4b5c6d7e8f9" });
    await f.close();
    await image.close();
    const b = readFileSync(out);
    expect(b.length).toBe(17408);
    expect(sha256(b)).toBe("e5075f9e80a305323b1d5f927d39f927d0360ed76eaa9441bee3615fb101d09d");
    const ro = await openLayerFile(out);
    const img = Image.fromLayers([ro]);
    const got = new Uint8Array(40 * 512);
    await img.read(got, 0);
    const want = new Uint8Array(40 * 512);
    want.fill(0xaa, 0, 4096);
    want.fill(0xcc, 512, 1024);
    want.fill(0xbb, 16 * 512, 18 * 512);
    expect(sha256(got)).toBe(sha256(want));
    await img.close();
  });

  test("the committed layer as an LZ4 ZFile (commit -z), byte for byte", async () => {
    const src = await LocalFile.open(join(dir, "commit.out"), {});
    const out = join(dir, "commit.lz4.zfile");
    const dst = await LocalFile.open(out, { write: true, create: true });
    await writeZFile(src, dst, { algorithm: "lz4", headerOverwrite: true });
    await src.close();
    await dst.close();
    const b = readFileSync(out);
    expect(b.length).toBe(1477);
    expect(sha256(b)).toBe("ad0ba65ef0364c7bb71e32bb66623a0fbdd07e320a063181e9a956ec9028c026");
    const ro = await openLayerFile(out);
    expect(ro.index.length).toBe(3);
    await ro.close();
  });

  test("empty committed layer is 8192 bytes", async () => {
    const l = await WritableLayer.create(join(dir, "e.data"), join(dir, "e.index"), { virtualSize: 1 << 20 });
    const out = join(dir, "empty.commit");
    const image = Image.fromLayers([], l);
    const f = await LocalFile.open(out, { write: true, create: true });
    await image.commit(f);
    await f.close();
    await image.close();
    const b = readFileSync(out);
    expect(b.length).toBe(8192);
    const ro = await openLayerFile(out);
    expect(ro.trailer.indexOffset).toBe(4096);
    expect(ro.trailer.indexSize).toBe(0);
    await ro.close();
  });
});

describe("read-only open rejects bad files (C++'s rules)", () => {
  const committed = join(dir, "commit.out");
  const mutate = (name: string, fn: (b: Uint8Array) => Uint8Array) => {
    const p = join(dir, name);
    writeFileSync(p, fn(new Uint8Array(readFileSync(committed))));
    return p;
  };
  const dv = (b: Uint8Array) => new DataView(b.buffer, b.byteOffset, b.byteLength);

  test("bad magic", async () => {
    const p = mutate("badmagic", (b) => ((b[0] = 0), b));
    await expect(openLayerFile(p)).rejects.toThrow(FormatError);
    await expect(openLayerFile(p)).rejects.toThrow(/badmagic @0: bad LSMT magic/);
  });
  test("truncated", async () => {
    const p = mutate("trunc", (b) => b.subarray(0, 5000));
    await expect(openLayerFile(p)).rejects.toThrow(TruncatedError);
  });
  test("no trailer", async () => {
    const p = mutate("notrailer", (b) => b.subarray(0, b.length - 512));
    await expect(openLayerFile(p)).rejects.toThrow(FormatError);
  });
  test("index size beyond the file", async () => {
    const p = mutate("bigindex", (b) => (dv(b).setUint32(b.length - 4096 + 40, 100000, true), b));
    await expect(openLayerFile(p)).rejects.toThrow(/runs past the trailer/);
  });
  test("impossible index size", async () => {
    const p = mutate("hugeindex", (b) => (dv(b).setUint32(b.length - 4096 + 44, 7, true), b));
    await expect(openLayerFile(p)).rejects.toThrow(FormatError);
  });
  test("overlapping entries", async () => {
    // entry 1 {16,2,16} → offset 4: overlaps entry 0 {0,8,8}
    const p = mutate("overlap", (b) => ((b[0x2410] = 4), b));
    await expect(openLayerFile(p)).rejects.toThrow(/overlaps or is out of order/);
  });
  test("moffset out of range", async () => {
    const p = mutate("moff", (b) => ((b[0x2408] = 0xf0), b));
    await expect(openLayerFile(p)).rejects.toThrow(/outside the data area/);
  });
  test("zero-filled moffset of a zeroed entry is refused as C++ does", async () => {
    const p = mutate("zmoff", (b) => ((b[0x2428] = 0), b));
    await expect(openLayerFile(p)).rejects.toThrow(/outside the data area/);
  });
});

describe("writable layer rules", () => {
  test("unaligned and out-of-range I/O is refused by name", async () => {
    const l = await WritableLayer.create(join(dir, "u.data"), join(dir, "u.index"), { virtualSize: 1 << 20 });
    await expect(l.write(fill(100, 1), 0)).rejects.toThrow(IoRangeError);
    await expect(l.write(fill(512, 1), 7)).rejects.toThrow(/not 512-aligned/);
    await expect(l.write(fill(512, 1), 1 << 20)).rejects.toThrow(/past the virtual size/);
    await l.close();
  });

  test("a torn index tail and entries past the data end are dropped on open", async () => {
    const { l, data, index } = await layerVector("torn");
    await l.close();
    const ib = readFileSync(index);
    // A partial 5th entry, then a 6th entry naming data that never reached the data file.
    const extra = new Uint8Array(16 + 7);
    const d = new DataView(extra.buffer);
    d.setUint32(0, 40, true);
    d.setUint32(4, 8 << 18, true);
    d.setUint32(8, 10_000, true);
    writeFileSync(index, Buffer.concat([ib, extra]));
    const re = await WritableLayer.open(data, index);
    expect(re.index.size).toBe(5);
    await re.close();
    expect(readFileSync(index).length).toBe(4160);
  });

  test("a flush with nothing written since the last sync waits for it instead of syncing again", async () => {
    const l = await WritableLayer.create(join(dir, "fl.data"), join(dir, "fl.index"), { virtualSize: 1 << 20 });
    const sqes = localIoSqes();
    await l.flush(); // create synced both files
    expect(localIoSqes()).toBe(sqes);
    await l.write(fill(4096, 1), 0);
    const afterWrite = localIoSqes();
    // Two flushes at once: one pair of syncs, and both resolve only once it is done.
    await Promise.all([l.flush(), l.flush()]);
    const synced = localIoSqes();
    expect(synced - afterWrite).toBe(localIoEngine() === "io_uring" ? 2 : 0);
    await l.close(); // nothing written since: no sync (closes run outside the ring)
    expect(localIoSqes()).toBe(synced);
  });

  test("a restack that fails after the seal is undone: the old stack serves, the fresh upper's files are gone, the next one works", async () => {
    const data = join(dir, "ru.data");
    const index = join(dir, "ru.index");
    const low = await WritableLayer.create(join(dir, "rul.data"), join(dir, "rul.index"), { virtualSize: 1 << 20 });
    await low.write(fill(65536, 0x11), 0);
    await low.seal();
    await low.close();
    const image = Image.fromLayers([await openLayerFile(join(dir, "rul.data"))], await WritableLayer.create(data, index, { virtualSize: 1 << 20 }));
    await image.write(fill(8192, 0x22), 4096);
    const want = fill(65536, 0x11).fill(0x22, 4096, 12288);
    const read = async () => {
      const got = new Uint8Array(65536);
      await image.read(got, 0);
      return sha256(got);
    };
    // The undo copy of the index cannot be made (a directory holds its name): the seal is done by then.
    mkdirSync(`${index}.prev`);
    await expect(image.restack(join(dir, "ru.sealed"))).rejects.toThrow(StorageError);
    expect(image.lowers.length).toBe(1);
    expect(await read()).toBe(sha256(want));
    expect(existsSync(join(dir, "ru.sealed")) || existsSync(`${data}.next`) || existsSync(`${index}.next`)).toBe(false);
    await image.write(fill(4096, 0x33), 0); // the old upper takes writes again
    want.fill(0x33, 0, 4096);
    rmdirSync(`${index}.prev`);
    await image.restack(join(dir, "ru.sealed"));
    expect(image.lowers.length).toBe(2);
    await image.write(fill(512, 0x44), 512); // into the fresh upper, which kept its files open
    want.fill(0x44, 512, 1024);
    expect(await read()).toBe(sha256(want));
    await image.close();
    expect(existsSync(`${index}.prev`)).toBe(false);
    const again = Image.fromLayers([await openLayerFile(join(dir, "rul.data")), await openLayerFile(join(dir, "ru.sealed"))], await WritableLayer.open(data, index));
    const got = new Uint8Array(65536);
    await again.read(got, 0);
    expect(sha256(got)).toBe(sha256(want));
    await again.close();
  });

  test("rewrites of ranges the layer owns go in place; others append; all survive a reopen", async () => {
    const data = join(dir, "ip.data");
    const index = join(dir, "ip.index");
    const l = await WritableLayer.create(data, index, { virtualSize: 1 << 20 });
    await l.write(fill(8192, 1), 0); // sectors 0..15
    await l.write(fill(8192, 2), 16384); // sectors 32..47
    await l.discard(65536, 4096); // sectors 128..135, zeroed
    const dataSize = l.dataSize;
    const entries = l.index.size;
    // Inside one run, and across two runs of the same layer: no new data, no new entries.
    await l.write(fill(2048, 3), 1024);
    await l.write(fill(512, 4), 7680);
    expect(l.dataSize).toBe(dataSize);
    expect(l.index.size).toBe(entries);
    // Across a hole, onto a zeroed run, and past the mapped end: appended and mapped.
    await l.write(fill(16384, 5), 4096);
    expect(l.dataSize).toBe(dataSize + 16384);
    await l.write(fill(1024, 6), 65536);
    await l.write(fill(1024, 7), 131072);
    expect(l.dataSize).toBe(dataSize + 16384 + 2048);
    // Now 4096..20480 is two runs of owned data: rewriting it stays in place.
    await l.write(fill(8192, 8), 12288);
    expect(l.dataSize).toBe(dataSize + 16384 + 2048);
    const want = new Uint8Array(1 << 20);
    want.fill(1, 0, 4096).fill(3, 1024, 3072).fill(5, 4096, 12288).fill(8, 12288, 20480).fill(2, 20480, 24576);
    want.fill(6, 65536, 66560).fill(7, 131072, 132096);
    await l.close();
    for (const appendOnly of [false, true]) {
      const re = await WritableLayer.open(data, index, { appendOnly });
      const image = Image.fromLayers([], re);
      const got = new Uint8Array(1 << 20);
      await image.read(got, 0);
      expect(sha256(got)).toBe(sha256(want));
      await image.close();
    }
  });

  test("discard: zeros over the lower, the index gets C++'s zero entry, whole dropped data blocks become holes", async () => {
    const data = join(dir, "dc.data");
    const index = join(dir, "dc.index");
    const lower = await WritableLayer.create(join(dir, "dcl.data"), join(dir, "dcl.index"), { virtualSize: 1 << 20 });
    await lower.write(fill(1 << 20, 0x11), 0);
    await lower.seal();
    await lower.close();
    const l = await WritableLayer.create(data, index, { virtualSize: 1 << 20 });
    await l.write(fill(65536, 0xaa), 0); // data file bytes 4096..69632
    await l.write(fill(8192, 0xbb), 65536); // 69632..77824
    const end = l.dataSize;
    // Sectors 1..40 (bytes 512..20992): only the whole 4 KiB blocks inside them, 8192..24576 of the file, are freed.
    await l.discard(512, 20480);
    expect(l.dataSize).toBe(end); // nothing appended
    await l.close();
    const ib = readFileSync(index);
    expect(ib.length).toBe(4096 + 3 * 16);
    // {offset 1, length 40, moffset = the data file's end in sectors, zeroed}, as C++'s discard appends it.
    const z = new DataView(ib.buffer, ib.byteOffset + 4096 + 32, 16);
    expect([z.getUint32(0, true), z.getUint16(6, true) >> 2, z.getUint32(8, true), z.getUint8(14)]).toEqual([1, 40, end / 512, 0x80]);
    const fd = openSync(data, "r");
    try {
      expect(lseek(fd, 4096, SEEK_HOLE)).toBe(8192);
      expect(lseek(fd, 8192, SEEK_DATA)).toBe(24576);
    } finally {
      closeSync(fd);
    }
    const re = await WritableLayer.open(data, index);
    const image = Image.fromLayers([await openLayerFile(join(dir, "dcl.data"))], re);
    const got = new Uint8Array(1 << 20);
    await image.read(got, 0);
    const want = fill(1 << 20, 0x11).fill(0xaa, 0, 65536).fill(0, 512, 20992).fill(0xbb, 65536, 73728);
    expect(sha256(got)).toBe(sha256(want));
    await image.close();
  });

  test("a discard racing rewrites of the sectors beside it: both land, no neighbour is punched", async () => {
    const data = join(dir, "dcr.data");
    const index = join(dir, "dcr.index");
    const l = await WritableLayer.create(data, index, { virtualSize: 1 << 20 });
    await l.write(fill(65536, 0xaa), 0); // one run at data bytes 4096..69632
    // Sectors 0..59 go; 60..63 (same 4 KiB data block as 56..59) and 64..71 are rewritten in place at the same time.
    await Promise.all([l.discard(0, 30720), l.write(fill(2048, 0xbb), 30720), l.write(fill(4096, 0xcc), 32768)]);
    await l.close();
    const re = await WritableLayer.open(data, index);
    const image = Image.fromLayers([], re);
    const got = new Uint8Array(65536);
    await image.read(got, 0);
    await image.close();
    const want = fill(65536, 0xaa).fill(0, 0, 30720).fill(0xbb, 30720, 32768).fill(0xcc, 32768, 36864);
    expect(sha256(got)).toBe(sha256(want));
  });

  test("a discard over hundreds of scattered runs frees every one of them", async () => {
    const data = join(dir, "dcf.data");
    const index = join(dir, "dcf.index");
    const l = await WritableLayer.create(data, index, { virtualSize: 1 << 20 });
    // 4 KiB blocks written last to first: neighbours on the disk are never neighbours in the file.
    for (let i = 199; i >= 0; i--) await l.write(fill(4096, i + 1), i * 4096);
    await l.discard(0, 200 * 4096);
    await l.close();
    const fd = openSync(data, "r");
    try {
      expect(lseek(fd, 4096, SEEK_DATA)).toBe(-1); // nothing but holes after the header
    } finally {
      closeSync(fd);
    }
    const image = Image.fromLayers([], await WritableLayer.open(data, index));
    const got = new Uint8Array(200 * 4096).fill(1);
    await image.read(got, 0);
    await image.close();
    expect(got.every((b) => b === 0)).toBe(true);
  });

  test("discard in append-only mode leaves the data file as C++ does (no holes)", async () => {
    const data = join(dir, "dca.data");
    const index = join(dir, "dca.index");
    const l = await WritableLayer.create(data, index, { virtualSize: 1 << 20, appendOnly: true });
    await l.write(fill(65536, 0xaa), 0);
    const before = sha256(readFileSync(data));
    await l.discard(0, 65536);
    await l.close();
    expect(sha256(readFileSync(data))).toBe(before);
  });

  test("a sealed file cannot be reopened writable", async () => {
    const { l, data, index } = await layerVector("sealrw");
    await l.seal();
    await l.close();
    await expect(WritableLayer.open(data, index)).rejects.toThrow(/sealed/);
  });

  test("ReadOnlyLayer.open on an RW data file says what is missing", async () => {
    copyFileSync(join(dir, "rw.data"), join(dir, "rw-copy.data"));
    const f = await LocalFile.open(join(dir, "rw-copy.data"), {});
    await expect(ReadOnlyLayer.open(f)).rejects.toThrow(FormatError);
    await f.close();
  });
});

describe("sparse writable layer", () => {
  test("create makes writable_index as overlaybd-create -s does: an empty 0644 file beside the data", async () => {
    const data = join(dir, "spc.data");
    const index = join(dir, "spc.index");
    writeFileSync(index, "stale"); // create replaces what was there
    const l = await WritableLayer.create(data, index, { virtualSize: 1 << 20, sparse: true, uuid: "5D8A6F1E-2B3C-4D4E-8F90-A1B2C3D4E5F6" });
    await l.close();
    // C++ opens both files O_CREAT|O_EXCL with mode 0644 and writes a header only into the data file.
    const st = statSync(index);
    expect(st.isFile()).toBe(true);
    expect(st.size).toBe(0);
    expect(st.mode & 0o777).toBe(0o644 & ~process.umask());
    const d = readFileSync(data);
    expect(d.length).toBe(4096 + (1 << 20));
    // Bytes 24..55: size 390, flags 0x13 (header, data, sparse), index_offset 0, index_size 0, virtual_size 1 MiB.
    expect(Buffer.from(d.subarray(24, 56)).toString("hex")).toBe("86010000" + "13000000" + "00".repeat(16) + "0000100000000000");
    expect(d.subarray(56, 93).toString()).toBe("5D8A6F1E-2B3C-4D4E-8F90-A1B2C3D4E5F6\0");
    expect(d.subarray(93, 130).toString()).toBe("00000000-0000-0000-0000-000000000000\0");
    expect([d[132], d[133]]).toEqual([1, 1]);
    expect(d.subarray(134).every((b) => b === 0)).toBe(true);
  });

  test("a sparse upper created, written, closed and reopened keeps its data; its empty index is accepted", async () => {
    const data = join(dir, "spr.data");
    const index = join(dir, "spr.index");
    const l = await WritableLayer.create(data, index, { virtualSize: 1 << 20, sparse: true });
    await l.write(fill(4096, 0x5a), 12288);
    await l.write(fill(512, 0xa5), 1 << 19);
    await l.close();
    const want = new Uint8Array(1 << 20).fill(0x5a, 12288, 16384).fill(0xa5, 1 << 19, (1 << 19) + 512);
    for (let round = 0; round < 2; round++) {
      const re = await WritableLayer.open(data, index);
      expect(re.sparse).toBe(true);
      const image = Image.fromLayers([], re);
      const got = new Uint8Array(1 << 20);
      await image.read(got, 0);
      expect(sha256(got)).toBe(sha256(want));
      await image.close();
      expect(statSync(index).size).toBe(0); // never written, as in C++
    }
    // Restack keeps the pair C++ opens: a fresh sparse upper with its empty index, nothing left beside it.
    const image = Image.fromLayers([], await WritableLayer.open(data, index));
    await image.restack(join(dir, "spr.sealed"));
    expect(image.upper!.sparse).toBe(true);
    expect(statSync(index).size).toBe(0);
    expect(existsSync(`${index}.next`) || existsSync(`${data}.next`)).toBe(false);
    const got = new Uint8Array(1 << 20);
    await image.read(got, 0);
    expect(sha256(got)).toBe(sha256(want));
    await image.close();
    // A sparse layer made before its index file existed still opens (C++ would not; we never read it).
    unlinkSync(index);
    const old = await WritableLayer.open(data, index);
    await old.close();
    expect(existsSync(index)).toBe(false);
  });

  test("writes in place, index from allocated ranges, discard falls through after reopen, seal", async () => {
    const data = join(dir, "sp.data");
    const index = join(dir, "sp.index");
    // A lower with 0x11 everywhere in the first 64 KiB.
    const lowUp = await WritableLayer.create(join(dir, "spl.data"), join(dir, "spl.index"), { virtualSize: 1 << 20 });
    await lowUp.write(fill(65536, 0x11), 0);
    await lowUp.seal();
    await lowUp.close();
    const l = await WritableLayer.create(data, index, { virtualSize: 1 << 20, sparse: true });
    expect(readFileSync(data).length).toBe(4096 + (1 << 20));
    expect(readFileSync(data)[28]).toBe(0x13);
    await l.write(fill(8192, 0xaa), 8192);
    await l.write(fill(4096, 0xbb), 32768);
    await l.discard(32768, 4096);
    const image = Image.fromLayers([await openLayerFile(join(dir, "spl.data"))], l);
    const got = new Uint8Array(65536);
    await image.read(got, 0);
    const want = fill(65536, 0x11);
    want.fill(0xaa, 8192, 16384);
    want.fill(0, 32768, 36864); // the zero entry masks the lower while the layer is open
    expect(sha256(got)).toBe(sha256(want));
    await image.close();
    // Reopen: the index is rebuilt from SEEK_DATA; the punched range reads through again.
    const re = await WritableLayer.open(data, index);
    expect(re.sparse).toBe(true);
    expect(re.index.toArray().map((s) => [s.offset, s.length, s.moffset])).toEqual([[16, 16, 24]]);
    const image2 = Image.fromLayers([await openLayerFile(join(dir, "spl.data"))], re);
    await image2.read(got, 0);
    want.fill(0x11, 32768, 36864);
    expect(sha256(got)).toBe(sha256(want));
    await image2.close();
    const re2 = await WritableLayer.open(data, index);
    await re2.seal();
    await re2.close();
    const sealed = await openLayerFile(data);
    expect(sealed.trailer.flags).toBe(0x16);
    expect(sealed.index.map((s) => [s.offset, s.length, s.moffset])).toEqual([[16, 16, 24]]);
    await sealed.close();
  });
});
