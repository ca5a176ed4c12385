// Delta memory layers read from a live process (docs/vmm.md, "Memory layers"): a fixture maps an
// image copy-on-write as a VMM does and writes pages; blockd copies the dirty pages (found in its
// pagemap) into a layer over the image's base layer, and a device over the two reads the image
// with every write on top. Runs past a step (4 MiB) and past an entry, more runs than one
// process_vm_readv takes (1024), zero pages in a run, a sparse image's base layer, and bad input,
// each with its own error.
import { describe, expect, test } from "bun:test";
import { closeSync, existsSync, ftruncateSync, openSync, readFileSync, writeFileSync, writeSync } from "node:fs";
import { join } from "node:path";
import { dirtyRuns } from "../../src/vmm/pagemap.ts";
import { haveFuse, readAll, spawnFixture, startBlockd, until } from "./harness.ts";

const MiB = 1 << 20;
const PAGE = 4096;
const SIZE = 32 * MiB;
const PAGES = SIZE / PAGE;

describe.skipIf(!haveFuse)("memory layers from a live process", async () => {
  if (!haveFuse) return void test.skip("needs root and /dev/fuse", () => {});
  const { dir, client } = await startBlockd("memory-layer");
  // The image: every page non-zero (its first byte 0xb0 + page % 16), so a zero page above must mask it.
  const image = join(dir, "image");
  const expected = new Uint8Array(SIZE);
  for (let p = 0; p < PAGES; p++) expected[p * PAGE] = 0xb0 + (p % 16);
  writeFileSync(image, expected);
  const base = join(dir, "base.layer");

  /** The fixture over `image`, with `runs` written and `zero` pages zeroed; its pid and mapping address. */
  async function writer(runs: [number, number][], zero: number[]) {
    const f = spawnFixture("private_mapping", [image, String(SIZE), runs.map(([a, n]) => `${a}:${n}`).join(","), zero.join(",")]);
    await until(() => f.lines.length > 0 || f.proc.exitCode !== null, "the fixture's address");
    const address = Number(f.lines[0]);
    expect(Number.isSafeInteger(address)).toBe(true);
    return { f, pid: f.proc.pid, address };
  }

  test("dirty pages become a layer that reads as the process's memory over the base; zero pages mask the base", async () => {
    expect(await client.call("memoryLayer", { out: base, size: SIZE, from: { file: image } })).toMatchObject({ dataPages: PAGES, zeroPages: 0 });
    // 8 MiB in one run (two steps, two 4 MiB entries) with 4 zeroed pages in it; then every
    // other page over 16 MiB (2048 one-page runs: two steps of 1024 iovecs), some zeroed.
    const runs: [number, number][] = [[16, 2048]];
    for (let p = 4096; p < 8192; p += 2) runs.push([p, 1]);
    const zero = [100, 101, 102, 103, 2063, 4096, 6000, 8190];
    const { f, pid, address } = await writer(runs, zero);
    try {
      const { runs: found, dirty } = await dirtyRuns(pid, address, PAGES);
      expect(dirty).toBe(2048 + 2048);
      const pagesFile = join(dir, "mem.pages");
      writeFileSync(pagesFile, found);
      const out = join(dir, "delta.layer");
      const r = await client.call("memoryLayer", { out, size: SIZE, from: { pid, address, pagesFile } });
      expect(r).toMatchObject({ dataPages: dirty - zero.length, zeroPages: zero.length });
      for (const [first, count] of runs)
        for (let p = first; p < first + count; p++) {
          expected.fill(0, p * PAGE, (p + 1) * PAGE);
          if (!zero.includes(p)) new DataView(expected.buffer).setUint32(p * PAGE, p + 1, true), new DataView(expected.buffer).setUint32(p * PAGE + 100, 0xdeadbeef, true);
        }
      const dev = await client.call("createReadOnly", { lowers: [base, out] });
      try {
        const got = readAll(dev.path, SIZE);
        let bad = -1;
        for (let p = 0; p < PAGES && bad < 0; p++) if (Buffer.compare(got.subarray(p * PAGE, (p + 1) * PAGE), expected.subarray(p * PAGE, (p + 1) * PAGE)) !== 0) bad = p;
        expect(bad).toBe(-1);
      } finally {
        await client.call("delete", { id: dev.id });
      }
    } finally {
      f.proc.kill();
      await f.exited();
    }
  }, 60_000);

  test("a sparse image's base layer, read by its data extents: writes that start and end inside pages, a zero page among them, read back exactly", async () => {
    const sparse = join(dir, "sparse.raw");
    const fd = openSync(sparse, "w");
    ftruncateSync(fd, 8 * MiB);
    // Writes that start and end inside pages; one holds a page of zeros.
    const bytes = new Uint8Array(3 * PAGE).fill(0x5a);
    bytes.fill(0, PAGE, 2 * PAGE);
    writeSync(fd, bytes, 0, bytes.length, MiB + 100);
    writeSync(fd, new Uint8Array(5000).fill(0xa5), 0, 5000, 6 * MiB - 100);
    closeSync(fd);
    const want = readFileSync(sparse);
    const out = join(dir, "sparse.layer");
    const r = await client.call("memoryLayer", { out, size: 8 * MiB, from: { file: sparse } });
    let nonZero = 0;
    for (let p = 0; p < (8 * MiB) / PAGE; p++) if (want.subarray(p * PAGE, (p + 1) * PAGE).some((b) => b !== 0)) nonZero++;
    expect(r).toMatchObject({ dataPages: nonZero, zeroPages: (8 * MiB) / PAGE - nonZero });
    const dev = await client.call("createReadOnly", { lowers: [out] });
    try {
      expect(Buffer.compare(readAll(dev.path, 8 * MiB), want)).toBe(0);
    } finally {
      await client.call("delete", { id: dev.id });
    }
  }, 60_000);

  test("bad input: each is refused with its code and leaves no file", async () => {
    const { f, pid, address } = await writer([[0, 8]], []);
    const pagesOf = (name: string, words: number[]) => {
      const path = join(dir, name);
      writeFileSync(path, new Uint32Array(words));
      return path;
    };
    const code = (from: Record<string, unknown>, size = SIZE, out = "bad.layer") =>
      client.call("memoryLayer", { out: join(dir, out), size, from }).then(() => "ok", (e: { code?: string }) => e.code);
    const good = pagesOf("good.pages", [0, 8]);
    try {
      expect(await code({ pid, address, pagesFile: pagesOf("order.pages", [4, 2, 0, 2]) })).toBe("BadRequest");
      expect(await code({ pid, address, pagesFile: pagesOf("range.pages", [PAGES - 1, 2]) })).toBe("BadRequest");
      expect(await code({ pid, address, pagesFile: pagesOf("empty-run.pages", [0, 0]) })).toBe("BadRequest");
      expect(await code({ pid, address, pagesFile: pagesOf("odd.pages", [0, 8, 9]) })).toBe("BadRequest");
      expect(await code({ pid, address: address + 512, pagesFile: good })).toBe("BadRequest");
      expect(await code({ pid, address, pagesFile: good }, 4097)).toBe("BadRequest");
      // A run in the PROT_NONE bytes after the mapping: the copy comes up short.
      expect(await code({ pid, address, pagesFile: pagesOf("unmapped.pages", [0, 8, PAGES, 4]) }, 2 * SIZE)).toBe("Io");
      expect(await code({ pid, address, pagesFile: good }, SIZE, "good.layer")).toBe("ok");
    } finally {
      f.proc.kill();
      await f.exited();
    }
    expect(await code({ pid, address, pagesFile: good })).toBe("NotFound");
    for (const name of ["bad.layer", "bad.layer.tmp.data", "bad.layer.tmp.zfile"]) expect(existsSync(join(dir, name))).toBe(false);
    expect(readFileSync(join(dir, "good.layer")).length).toBeGreaterThan(0);
  }, 60_000);
});
