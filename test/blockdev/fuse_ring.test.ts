// FUSE over io_uring (AENV_FUSE_URING=1): requests come as ring completions and replies go back
// as COMMIT_AND_FETCH. Data is verified under concurrent random I/O of small and large requests.
// The kernel does not resend requests a dead server held in ring entries (FUSE_NOTIFY_RESEND covers
// /dev/fuse only), so a ring connection cannot be taken over: after kill -9 the restarted blockd
// ends it (its users get an error, no wait) and serves the device afresh as lost, with every
// fsync'd byte. A worker that dies ends its ring, and so its connection, like any other fd.
import { expect, test } from "bun:test";
import { existsSync, readFileSync } from "node:fs";
import { join } from "node:path";
import { BlockdClient } from "../../src/blockdev/client.ts";
import { FUSE_ENABLE_URING_PARAM } from "../../ffi/fuse.ts";
import { blockFor } from "../storage/crash_blocks.ts";
import { blockdPid, fdsSettled, haveFuse, mountsAt, openFds, processGone, readAll, spawnFixture, startBlockd, until } from "./harness.ts";

const MiB = 1 << 20;
const haveRing = haveFuse && existsSync(FUSE_ENABLE_URING_PARAM);
const skipped = haveRing ? "" : ` (skipped: ${haveFuse ? `${FUSE_ENABLE_URING_PARAM} is missing: a kernel without CONFIG_FUSE_IO_URING` : "needs /dev/fuse and root"})`;
const RING = { AENV_FUSE_URING: "1" };

/** startBlockd with `env`, leaving this process's own AENV_FUSE_URING as it was (the harness unsets what it set). */
async function blockdWith(label: string, env: Record<string, string>) {
  const had = process.env.AENV_FUSE_URING;
  try {
    return await startBlockd(label, { env });
  } finally {
    if (had !== undefined) process.env.AENV_FUSE_URING = had;
  }
}

/** fio on `path` with crc32c verify of everything it wrote; resolves to its parsed job. */
async function fioVerify(path: string, bs: string, offset: number, size: number) {
  const proc = Bun.spawn(
    ["fio", "--name=v", `--filename=${path}`, "--rw=randwrite", `--bs=${bs}`, "--iodepth=16", "--ioengine=io_uring", "--direct=1",
      `--offset=${offset}`, `--size=${size}`, "--verify=crc32c", "--do_verify=1", "--verify_fatal=1", "--verify_state_save=0", "--output-format=json"],
    { stdout: "pipe", stderr: "pipe" },
  );
  const [out, err, code] = await Promise.all([new Response(proc.stdout).text(), new Response(proc.stderr).text(), proc.exited]);
  expect(err).toBe("");
  expect(code).toBe(0);
  return JSON.parse(out).jobs[0];
}

test.skipIf(!haveRing)(`ring mode: concurrent random writes of 4 KiB and 256 KiB and a reader, every block verified, every request over the ring${skipped}`, async () => {
  const { dir, client } = await blockdWith("blockd-ring-io", RING);
  const dev = await client.call("create", { upperDir: join(dir, "up"), size: 64 * MiB });
  const reader = spawnFixture("io_loop", [dev.path, "60"]); // O_DIRECT 4 KiB reads of the first 256 KiB, all along
  const [small, large] = await Promise.all([fioVerify(dev.path, "4k", 16 * MiB, 16 * MiB), fioVerify(dev.path, "256k", 32 * MiB, 32 * MiB)]);
  for (const [job, bytes] of [[small, 16 * MiB], [large, 32 * MiB]] as const) {
    expect(job.error).toBe(0);
    expect(job.read.io_bytes).toBe(bytes); // the verify pass read all of it back
  }
  reader.proc.kill();
  await reader.exited();
  expect(reader.lines.some((l) => l.startsWith("ok"))).toBe(true);
  expect(reader.lines.some((l) => l.startsWith("error"))).toBe(false);
  const stats = await client.call("stats", { id: dev.id });
  // INIT (and what came before the ring was ready) went through /dev/fuse; everything else over the ring.
  expect(stats.overRing).toBeGreaterThan(stats.requests - 16);
  expect(stats.takenByReader).toBe(0);
  await client.call("delete", { id: dev.id });
  expect(mountsAt(dev.path)).toHaveLength(0);
}, 120_000);

test.skipIf(!haveRing)(`ring mode: kill -9 blockd under fsync'd writes: the restart ends the connection (the writer gets an error, no wait) and serves the device afresh as lost, every fsync'd write there${skipped}`, async () => {
  const BLOCKS = 1024;
  const { dir, state, client } = await blockdWith("blockd-ring-crash", RING);
  const dev = await client.call("create", { upperDir: join(dir, "up"), size: BLOCKS * 4096 });
  const writer = Bun.spawn([process.execPath, join(import.meta.dir, "fsync_writer.ts"), dev.path, String(BLOCKS)], { stdout: "pipe", stderr: "pipe" });
  const out = writer.stdout.getReader();
  let text = "";
  const syncedNow = () => Number([...text.matchAll(/synced (\d+)/g)].at(-1)?.[1] ?? 0);
  while (syncedNow() < 400) {
    const { value, done } = await out.read();
    if (done) break;
    text += new TextDecoder().decode(value);
  }
  expect((await client.call("stats", { id: dev.id })).overRing).toBeGreaterThan(400);
  const oldPid = blockdPid(state);
  process.kill(oldPid, "SIGKILL");
  client.close();
  await until(() => processGone(oldPid), "the killed blockd to be gone");

  const had = process.env.AENV_FUSE_URING;
  process.env.AENV_FUSE_URING = "1";
  const again = await BlockdClient.ensure(state).finally(() => (had === undefined ? delete process.env.AENV_FUSE_URING : (process.env.AENV_FUSE_URING = had)));
  // The writer's wait ends in an error: nobody can answer what the dead blockd held.
  const code = await Promise.race([writer.exited, Bun.sleep(30_000).then(() => "still waiting")]);
  if (code === "still waiting") writer.kill(9);
  expect(code).toBe(0);
  for (;;) {
    const { value, done } = await out.read();
    if (done) break;
    text += new TextDecoder().decode(value);
  }
  expect(await new Response(writer.stderr).text()).toMatch(/^writer stopped: /);

  const [back] = await again.call("list");
  expect(back).toMatchObject({ id: dev.id, path: dev.path, state: "lost" });
  expect(back.reason).toContain("served over io_uring");
  expect(mountsAt(dev.path)).toHaveLength(1);
  // Every fsync'd write is there, and what is there is a prefix of the writes.
  const disk = readAll(dev.path, BLOCKS * 4096);
  const dv = new DataView(disk.buffer);
  let maxSeen = 0;
  for (let b = 0; b < BLOCKS; b++) maxSeen = Math.max(maxSeen, dv.getFloat64(b * 4096, true));
  expect(maxSeen).toBeGreaterThanOrEqual(syncedNow());
  const want = new Uint8Array(BLOCKS * 4096);
  for (let op = 0; op < maxSeen; op++) {
    const { block, bytes } = blockFor(op, BLOCKS);
    want.set(bytes, block * 4096);
  }
  expect(Buffer.compare(disk, want)).toBe(0);
  // It serves again, over the ring.
  const w = spawnFixture("seq_writer", [dev.path, String(BLOCKS * 4096), "1"]);
  expect(await w.exited()).toBe(0);
  expect((await again.call("stats", { id: dev.id })).overRing).toBeGreaterThan(0);
  await again.call("delete", { id: dev.id });
  again.close();
}, 120_000);

test.skipIf(!haveRing)(`ring mode: a device worker that dies ends its ring and so its connection: its reader gets an error, and blockd's fds are what they were${skipped}`, async () => {
  const { dir, state, client } = await blockdWith("blockd-ring-death", { ...RING, AENV_BLOCKD_FAULT: "worker-exit:victim:stats" });
  const pid = blockdPid(state);
  await client.call("create", { id: "warm", upperDir: join(dir, "w"), size: 4 * MiB });
  await client.call("delete", { id: "warm" });
  const base = await fdsSettled(pid, openFds(pid));

  const victim = await client.call("create", { id: "victim", upperDir: join(dir, "v"), size: 4 * MiB });
  const reader = spawnFixture("io_loop", [victim.path, "60"]);
  await until(() => reader.lines.some((l) => l.startsWith("ok")), "the victim to serve reads");
  const rings = (fds: string[]) => fds.filter((f) => f === "anon_inode:[io_uring]").length;
  expect(rings(openFds(pid)) - rings(base)).toBe(2); // the worker's I/O ring and its FUSE ring
  expect((await client.call("stats", { id: "victim" }).catch((e) => e)).code).toBe("DeviceFailed");
  // The ring's commands held the connection; with the ring's fd closed they end, and it ends.
  expect(await reader.exited()).toBe(0);
  expect(reader.lines.at(-1)).toMatch(/^error (ENOTCONN|ECONNABORTED|EIO)$/);
  await client.call("delete", { id: "victim" });
  expect(await fdsSettled(pid, base)).toEqual(base);
  expect(readFileSync(join(state, "blockd.log"), "utf8")).toContain("device victim is failed until deleted");
}, 120_000);
