// Fixture for crash.test.ts: writes numbered 4 KiB blocks into a writable layer forever,
// printing "wrote N" once writes 0..N-1 have completed and "flushed N" once they are durable.
import { WritableLayer } from "../../src/storage/lsmt/writable_layer.ts";
import { blockFor } from "./crash_blocks.ts";

const [data, index, blocksArg] = process.argv.slice(2);
const blocks = Number(blocksArg);
const layer = await WritableLayer.open(data!, index!);
for (let op = 0; ; op++) {
  const { block, bytes } = blockFor(op, blocks);
  await layer.write(bytes, block * 4096);
  if (op % 4 === 3) process.stdout.write(`wrote ${op + 1}\n`);
  if (op % 16 === 15) {
    await layer.flush();
    process.stdout.write(`flushed ${op + 1}\n`);
  }
}
