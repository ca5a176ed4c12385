// The FUSE reader thread (read/write path) is for large WRITEs: taking one is the kernel's copy
// of its payload. Small requests cost more handed over than read by the device worker itself, so
// once large writes stop the reader pauses, and the next large write wakes it.
import { expect, test } from "bun:test";
import { join } from "node:path";
import { haveFuse, startBlockd } from "./harness.ts";

const MiB = 1 << 20;
/** Requests the device worker lets pass after the last large write before it pauses the reader (fuse/server.ts), plus every reader slot. */
const PAUSE_WITHIN = 512 + 8;

function fio(path: string, rw: string, bs: string, size: number, verify: boolean) {
  const r = Bun.spawnSync(
    ["fio", "--name=v", `--filename=${path}`, `--rw=${rw}`, `--bs=${bs}`, "--iodepth=16", "--ioengine=io_uring", "--direct=1", `--size=${size}`,
      ...(verify ? ["--verify=crc32c", "--do_verify=1", "--verify_fatal=1", "--verify_state_save=0"] : []), "--output-format=json"],
    { stdout: "pipe", stderr: "pipe" },
  );
  expect(r.stderr.toString()).toBe("");
  expect(r.exitCode).toBe(0);
  expect(JSON.parse(r.stdout.toString()).jobs[0].error).toBe(0);
}

test.skipIf(!haveFuse)("the reader thread pauses once large writes stop (4 KiB reads are then the device worker's) and the next large write wakes it", async () => {
  const had = process.env.AENV_FUSE_URING; // the reader is the read/write path's: ring mode off for this blockd
  const { dir, client } = await startBlockd("blockd-reader-pause", { env: { AENV_FUSE_URING: "0" } }).finally(() => had !== undefined && (process.env.AENV_FUSE_URING = had));
  const dev = await client.call("create", { upperDir: join(dir, "up"), size: 32 * MiB });
  fio(dev.path, "randwrite", "256k", 16 * MiB, true); // starts the reader
  const afterWrites = await client.call("stats", { id: dev.id });
  expect(afterWrites.takenByReader).toBeGreaterThan(0);

  fio(dev.path, "randread", "4k", 16 * MiB, false); // 4096 small reads
  const afterReads = await client.call("stats", { id: dev.id });
  expect(afterReads.reads - afterWrites.reads).toBeGreaterThanOrEqual(4096);
  expect(afterReads.readerPauses).toBe(1);
  expect(afterReads.takenByReader - afterWrites.takenByReader).toBeLessThanOrEqual(PAUSE_WITHIN);

  fio(dev.path, "randwrite", "256k", 16 * MiB, true); // woken: it takes large writes again
  const again = await client.call("stats", { id: dev.id });
  expect(again.takenByReader).toBeGreaterThan(afterReads.takenByReader);
  await client.call("delete", { id: dev.id });
}, 120_000);
