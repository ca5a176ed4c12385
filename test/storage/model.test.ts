// Randomized model test: random writes, discards, flushes, restacks, commits and reopens over
// stacks of up to 64 layers, compared sector by sector with a plain in-memory disk.
// Reproduce a failure with AENV_SEED=<printed seed> bun test test/storage/model.test.ts
import { expect, test } from "bun:test";
import { join } from "node:path";
import { Image } from "../../src/storage/image.ts";
import { LocalFile } from "../../src/storage/local_file.ts";
import { WritableLayer } from "../../src/storage/lsmt/writable_layer.ts";
import { writeZFile } from "../../src/storage/zfile.ts";
import { prng, scratchDir } from "../helpers/tmp.ts";

const SECTORS = 8192; // 4 MiB virtual disk keeps thousands of operations quick
const OPS = Number(process.env.AENV_MODEL_OPS ?? 3000);
const MAX_LAYERS = 64;

test(`random operations match an in-memory disk (${OPS} ops)`, async () => {
  const seed = Number(process.env.AENV_SEED ?? Math.floor(Math.random() * 2 ** 31));
  const rnd = prng(seed);
  const int = (n: number) => Math.floor(rnd() * n);
  const dir = scratchDir("model");
  const model = new Uint8Array(SECTORS * 512);
  let layerNo = 0;
  const upperPaths = () => ({ data: join(dir, "upper.data"), index: join(dir, "upper.index") });
  let image = Image.fromLayers([], await WritableLayer.create(upperPaths().data, upperPaths().index, { virtualSize: SECTORS * 512 }));
  const counts: Record<string, number> = {};
  let maxDepth = 0;
  const check = async (what: string) => {
    const b = int(SECTORS);
    const n = 1 + int(Math.min(SECTORS - b, 2048));
    const got = new Uint8Array(n * 512);
    await image.read(got, b * 512);
    const want = model.subarray(b * 512, (b + n) * 512);
    if (Buffer.compare(got, want) !== 0) {
      let i = 0;
      while (got[i] === want[i]) i++;
      throw new Error(`after ${what}: sector ${b + Math.floor(i / 512)} differs (layers ${image.lowers.length})`);
    }
  };
  try {
    for (let op = 0; op < OPS; op++) {
      const r = rnd();
      let what: string;
      if (r < 0.6) {
        what = "write";
        const off = int(SECTORS);
        const len = 1 + int(Math.min(SECTORS - off, rnd() < 0.1 ? 1024 : 16));
        const data = new Uint8Array(len * 512);
        for (let i = 0; i < data.length; i += 64) data.fill(int(256), i, i + 64);
        await image.write(data, off * 512);
        model.set(data, off * 512);
      } else if (r < 0.72) {
        what = "discard";
        const off = int(SECTORS);
        const len = 1 + int(Math.min(SECTORS - off, 300));
        await image.discard(off * 512, len * 512);
        model.fill(0, off * 512, (off + len) * 512);
      } else if (r < 0.8) {
        what = "flush";
        await image.flush();
      } else if (r < 0.9) {
        what = "restack";
        if (image.lowers.length >= MAX_LAYERS - 1) what = "commit";
        else await image.restack(join(dir, `layer-${layerNo++}.sealed`));
      } else if (r < 0.95) {
        what = "reopen";
        const cfg = image.config();
        await image.close();
        image = await Image.open(cfg);
      } else if (r < 0.96) what = "commit";
      else what = "flush";
      if (what === "commit" && (image.lowers.length > 0 || rnd() < 0.3)) {
        // Flatten the stack (optionally as a zstd ZFile) and carry on over the single layer.
        const out = join(dir, `commit-${layerNo++}`);
        const f = await LocalFile.open(out, { write: true, create: true });
        await image.commit(f);
        await f.close();
        await image.close();
        let path = out;
        if (rnd() < 0.5) {
          path = `${out}.zfile`;
          const src = await LocalFile.open(out, {});
          const dst = await LocalFile.open(path, { write: true, create: true });
          await writeZFile(src, dst, { algorithm: "zstd" });
          await src.close();
          await dst.close();
        }
        const { data, index } = upperPaths();
        const upper = await WritableLayer.create(data, index, { virtualSize: SECTORS * 512 });
        await upper.close();
        image = await Image.open({ lowers: [{ file: path }], upper: { data, index } });
      }
      counts[what] = (counts[what] ?? 0) + 1;
      maxDepth = Math.max(maxDepth, image.lowers.length);
      await check(`op ${op} (${what})`);
    }
    // Full comparison at the end, after one more reopen.
    const cfg = image.config();
    await image.close();
    image = await Image.open(cfg);
    const all = new Uint8Array(SECTORS * 512);
    await image.read(all, 0);
    expect(Buffer.compare(all, model)).toBe(0);
    await image.close();
    console.log(`model test seed ${seed}: ${JSON.stringify(counts)}, deepest stack ${maxDepth} lowers`);
    expect(maxDepth).toBeGreaterThan(8);
  } catch (e) {
    console.error(`model test FAILED with AENV_SEED=${seed}`);
    throw e;
  }
}, 120_000);
