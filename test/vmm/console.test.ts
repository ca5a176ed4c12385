// The console file's bound (no VM): whatever is appended, in whatever pieces, the file holds at most
// its bound, ends with the newest bytes in order, and is 0600; a FIFO the way a VMM gets it drains
// through a ConsoleDrain into it.
import { expect, test } from "bun:test";
import { closeSync, readFileSync, statSync, writeSync } from "node:fs";
import { join } from "node:path";
import { BoundedLogFile, CONSOLE_LOG_MAX_BYTES, ConsoleDrain, FifoConsole } from "../../src/vmm/console.ts";
import { prng, scratchDir } from "../helpers/tmp.ts";

const dir = scratchDir("console");

test("appends past the bound keep the newest bytes, never more than the bound", async () => {
  const f = new BoundedLogFile(join(dir, "a.log"), 64 << 10);
  const rand = prng(7);
  let all = "";
  let largest = 0;
  for (let i = 0; i < 400; i++) {
    const n = Math.floor(rand() * 3000) + 1;
    const piece = `${i}:` + "x".repeat(n) + "\n";
    all += piece;
    await f.append(new TextEncoder().encode(piece));
    largest = Math.max(largest, statSync(f.path).size);
  }
  const kept = readFileSync(f.path, "utf8");
  expect(largest).toBeLessThanOrEqual(64 << 10);
  expect(all.endsWith(kept)).toBe(true);
  expect(kept.length).toBeGreaterThanOrEqual(32 << 10);
  expect(statSync(f.path).mode & 0o777).toBe(0o600);
  // One piece bigger than the bound: its own last half.
  const huge = new Uint8Array(200 << 10).map((_, i) => 97 + (i % 26));
  await f.append(huge);
  expect(new Uint8Array(readFileSync(f.path))).toEqual(huge.subarray(huge.length - (32 << 10)));
});

test("a console FIFO drained into the file: 8 MiB through it leave at most the bound, the last bytes last", async () => {
  const fifo = join(dir, "console.fifo");
  const vmmEnd = await FifoConsole.openForVmm(fifo);
  expect(statSync(fifo).mode & 0o777).toBe(0o600);
  const drain = new ConsoleDrain(new FifoConsole(fifo), new BoundedLogFile(join(dir, "console.log")));
  const chunk = new Uint8Array(4096).fill(0x61);
  let written = 0;
  let largest = 0;
  while (written < 8 << 20) {
    try {
      written += writeSync(vmmEnd, chunk);
    } catch (e) {
      if ((e as { code?: string }).code !== "EAGAIN") throw e;
      await drain.drain(); // the pipe is full (64 KiB): the node takes it
      largest = Math.max(largest, statSync(join(dir, "console.log")).size);
    }
  }
  await drain.drain();
  writeSync(vmmEnd, new TextEncoder().encode("\nlast line\n"));
  closeSync(vmmEnd);
  await drain.stop();
  const log = readFileSync(join(dir, "console.log"), "utf8");
  expect(Math.max(largest, log.length)).toBeLessThanOrEqual(CONSOLE_LOG_MAX_BYTES);
  expect(log.endsWith("aaaa\nlast line\n")).toBe(true);
});
