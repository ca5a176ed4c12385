// Crash: kill -9 a writer mid-stream, reopen, and check that the layer shows exactly the writes
// of some prefix of the stream that includes every completed write (flushed or not: a process
// crash keeps the page cache), and nothing else.
import { expect, test } from "bun:test";
import { join } from "node:path";
import { WritableLayer } from "../../src/storage/lsmt/writable_layer.ts";
import { Image } from "../../src/storage/image.ts";
import { scratchDir } from "../helpers/tmp.ts";
import { blockFor } from "./crash_blocks.ts";

const BLOCKS = 512; // 2 MiB disk

test("kill -9 mid-stream keeps every flushed write and shows only a prefix", async () => {
  const dir = scratchDir("crash");
  for (let round = 0; round < 3; round++) {
    const data = join(dir, `data-${round}`);
    const index = join(dir, `index-${round}`);
    await (await WritableLayer.create(data, index, { virtualSize: BLOCKS * 4096 })).close();
    const child = Bun.spawn([process.execPath, join(import.meta.dir, "crash_writer.ts"), data, index, String(BLOCKS)], {
      stdout: "pipe",
      stderr: "inherit",
    });
    let flushed = 0;
    const reader = child.stdout.getReader();
    const started = Date.now();
    let text = "";
    // Let it run until a few flushes landed, then kill it at an arbitrary moment.
    while (flushed < 300 * (round + 1) && Date.now() - started < 20_000) {
      const { value, done } = await reader.read();
      if (done) break;
      text += new TextDecoder().decode(value);
      const m = [...text.matchAll(/flushed (\d+)/g)];
      if (m.length) flushed = Number(m[m.length - 1]![1]);
    }
    await Bun.sleep(Math.floor(Math.random() * 30));
    child.kill(9);
    await child.exited;
    // A flush line may have arrived after our last read: drain what is left.
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      text += new TextDecoder().decode(value);
    }
    const m = [...text.matchAll(/flushed (\d+)/g)];
    if (m.length) flushed = Math.max(flushed, Number(m[m.length - 1]![1]));
    expect(flushed).toBeGreaterThan(0);
    const w = [...text.matchAll(/wrote (\d+)/g)];
    const wrote = Number(w[w.length - 1]![1]);

    const layer = await WritableLayer.open(data, index);
    const image = Image.fromLayers([], layer);
    const disk = new Uint8Array(BLOCKS * 4096);
    await image.read(disk, 0);
    const dv = new DataView(disk.buffer);
    let maxSeen = 0;
    for (let b = 0; b < BLOCKS; b++) maxSeen = Math.max(maxSeen, dv.getFloat64(b * 4096, true));
    // The visible state must be the state after ops [0, maxSeen), which must cover the flushed ones.
    expect(maxSeen).toBeGreaterThanOrEqual(Math.max(flushed, wrote));
    const want = new Uint8Array(BLOCKS * 4096);
    for (let op = 0; op < maxSeen; op++) {
      const { block, bytes } = blockFor(op, BLOCKS);
      want.set(bytes, block * 4096);
    }
    expect(Buffer.compare(disk, want)).toBe(0);
    await image.close();
  }
}, 60_000);
