// Fixture for crash.test.ts: numbered 4 KiB writes to a device file, fsync every 8, printing
// "synced N" once ops 0..N-1 are durable. Exits when the device goes away (blockd killed).
import { openSync, writeSync, fsyncSync } from "node:fs";
import { blockFor } from "../storage/crash_blocks.ts";

const [path, blocksArg] = process.argv.slice(2);
const blocks = Number(blocksArg);
const fd = openSync(path!, "r+");
try {
  for (let op = 0; ; op++) {
    const { block, bytes } = blockFor(op, blocks);
    writeSync(fd, bytes, 0, bytes.length, block * 4096);
    if (op % 8 === 7) {
      fsyncSync(fd);
      process.stdout.write(`synced ${op + 1}\n`);
    }
  }
} catch (e) {
  process.stderr.write(`writer stopped: ${(e as Error).message}\n`);
}
