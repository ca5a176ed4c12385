// Image reads that span several layer files: one read, several preads, one settle.
import { describe, expect, test } from "bun:test";
import { join } from "node:path";
import { Image } from "../../src/storage/image.ts";
import { LocalFile } from "../../src/storage/local_file.ts";
import { ReadOnlyLayer } from "../../src/storage/lsmt/readonly_layer.ts";
import { WritableLayer } from "../../src/storage/lsmt/writable_layer.ts";
import { LocalFileError } from "../../src/storage/local_file.ts";
import type { ReadableFile } from "../../src/storage/file.ts";
import { scratchDir } from "../helpers/tmp.ts";

const dir = scratchDir("image-read");

/** A local layer file whose reads can be held back or made to fail once the layer is open. */
class FaultyFile implements ReadableFile {
  delayMs = 0;
  failWith: Error | undefined;
  readsDone = 0;
  constructor(private inner: LocalFile) {}
  get name(): string {
    return this.inner.name;
  }
  size(): number {
    return this.inner.size();
  }
  async pread(buf: Uint8Array, offset: number): Promise<number> {
    if (this.delayMs) await Bun.sleep(this.delayMs);
    if (this.failWith) throw this.failWith;
    const n = await this.inner.pread(buf, offset);
    this.readsDone++;
    return n;
  }
  close(): Promise<void> {
    return this.inner.close();
  }
}

/** A sealed layer holding `fill` bytes at [offset, offset + length). */
async function layerWith(name: string, offset: number, length: number, fill: number): Promise<FaultyFile> {
  const data = join(dir, `${name}.data`);
  const l = await WritableLayer.create(data, join(dir, `${name}.index`), { virtualSize: 1 << 20 });
  await l.write(new Uint8Array(length).fill(fill), offset);
  await l.seal();
  await l.close();
  return new FaultyFile(LocalFile.open(data, {}));
}

describe("a read over several layer files", () => {
  test("returns every layer's bytes and the holes as zeros", async () => {
    const a = await layerWith("ok-a", 0, 4096, 0xaa);
    const b = await layerWith("ok-b", 8192, 4096, 0xbb);
    const image = Image.fromLayers([await ReadOnlyLayer.open(a), await ReadOnlyLayer.open(b)]);
    a.readsDone = b.readsDone = 0; // the opens' reads
    const buf = new Uint8Array(16384).fill(0xff);
    await image.read(buf, 0);
    expect(buf.subarray(0, 4096).every((x) => x === 0xaa)).toBe(true);
    expect(buf.subarray(4096, 8192).every((x) => x === 0)).toBe(true);
    expect(buf.subarray(8192, 12288).every((x) => x === 0xbb)).toBe(true);
    expect(buf.subarray(12288).every((x) => x === 0)).toBe(true);
    expect(a.readsDone + b.readsDone).toBe(2);
    await image.close();
  });

  test("one failed pread fails the read only once the others have finished with the buffer", async () => {
    const slow = await layerWith("slow", 0, 4096, 0xaa);
    const bad = await layerWith("bad", 4096, 4096, 0xbb);
    const image = Image.fromLayers([await ReadOnlyLayer.open(slow), await ReadOnlyLayer.open(bad)]);
    slow.readsDone = 0; // the open's reads
    slow.delayMs = 100;
    bad.failWith = new LocalFileError("pread", 5, bad.name, 4096);
    const buf = new Uint8Array(8192);
    const err = await image.read(buf, 0).then(
      () => undefined,
      (e: unknown) => e,
    );
    expect(err).toBeInstanceOf(LocalFileError);
    // The caller may reuse the buffer once the read settles: no pread may still write into it.
    expect(slow.readsDone).toBe(1);
    // And the image counts the read as over only then: close (which waits for I/O) goes through.
    slow.delayMs = 0;
    bad.failWith = undefined;
    await image.close();
  });
});
