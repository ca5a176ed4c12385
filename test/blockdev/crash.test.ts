// kill -9 blockd under a write load with fsyncs and start it again. The fd keeper holds the FUSE
// connection, so the writer's open file keeps working across the restart (its requests wait, and
// the ones the dead blockd had taken are resent); every fsync'd byte is there, and what is
// visible is exactly a prefix of the writes.
import { expect, test } from "bun:test";
import { join } from "node:path";
import { openSync, readSync, closeSync, writeSync, readFileSync, rmSync } from "node:fs";
import { BlockdClient } from "../../src/blockdev/client.ts";
import { blockFor } from "../storage/crash_blocks.ts";
import { firstBadChunk } from "./patterns.ts";
import { blockdPid, haveFuse, haveLoop, makeLayer, mountsAt, processGone, readAll, spawnFixture, startBlockd, until } from "./harness.ts";

const BLOCKS = 1024; // 4 MiB device

/** readersAfter: the restarted blockd's AENV_FUSE_READER_SLOTS (it adopts the clone either way). */
async function crashAndRestart(label: string, readersAfter?: string) {
  const { dir, state, client } = await startBlockd(label);
  const dev = await client.call("create", { upperDir: join(dir, "up"), size: BLOCKS * 4096 });
  // One large write (zeros, as the disk already reads) starts the reader thread, so requests are
  // taken on both of the connection's fds when blockd dies.
  const pfd = openSync(dev.path, "r+");
  writeSync(pfd, new Uint8Array(256 << 10), 0, 256 << 10, 0);
  closeSync(pfd);
  const writer = Bun.spawn([process.execPath, join(import.meta.dir, "fsync_writer.ts"), dev.path, String(BLOCKS)], { stdout: "pipe", stderr: "pipe" });
  const reader = writer.stdout.getReader();
  let text = "";
  let synced = 0;
  const waitSynced = async (n: number) => {
    const started = Date.now();
    while (synced < n && Date.now() - started < 30_000) {
      const { value, done } = await reader.read();
      if (done) break;
      text += new TextDecoder().decode(value);
      const m = [...text.matchAll(/synced (\d+)/g)];
      if (m.length) synced = Number(m[m.length - 1]![1]);
    }
  };
  await waitSynced(400);
  expect((await client.call("stats", { id: dev.id })).takenByReader).toBeGreaterThan(0);
  const oldPid = blockdPid(state);
  process.kill(oldPid, "SIGKILL");
  const atKill = synced;
  client.close();
  await until(() => processGone(oldPid), "the killed blockd to be gone"); // the writer now waits on a dead server

  if (readersAfter !== undefined) process.env.AENV_FUSE_READER_SLOTS = readersAfter;
  const again = await BlockdClient.ensure(state).finally(() => delete process.env.AENV_FUSE_READER_SLOTS);
  expect(blockdPid(state)).not.toBe(oldPid);
  expect((await again.call("list")).map((d: { id: string }) => d.id)).toContain(dev.id);
  // The same writer, same fd, goes on without an error.
  await waitSynced(atKill + 400);
  expect(synced).toBeGreaterThanOrEqual(atKill + 400);
  writer.kill(9);
  await writer.exited;
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    text += new TextDecoder().decode(value);
  }
  const all = [...text.matchAll(/synced (\d+)/g)];
  synced = Number(all[all.length - 1]![1]);
  expect(await new Response(writer.stderr).text()).toBe(""); // no "writer stopped: ..." error

  const disk = new Uint8Array(BLOCKS * 4096);
  const fd = openSync(dev.path, "r");
  for (let done = 0; done < disk.length; ) done += readSync(fd, disk, done, disk.length - done, done);
  closeSync(fd);
  const dv = new DataView(disk.buffer);
  let maxSeen = 0;
  for (let b = 0; b < BLOCKS; b++) maxSeen = Math.max(maxSeen, dv.getFloat64(b * 4096, true));
  expect(maxSeen).toBeGreaterThanOrEqual(synced);
  const want = new Uint8Array(BLOCKS * 4096);
  for (let op = 0; op < maxSeen; op++) {
    const { block, bytes } = blockFor(op, BLOCKS);
    want.set(bytes, block * 4096);
  }
  expect(Buffer.compare(disk, want)).toBe(0);
  await again.call("delete", { id: dev.id });
  again.close();
}

test.skipIf(!haveFuse)("kill -9 blockd during fsync'd writes: the device survives, open files included", () => crashAndRestart("blockd-crash"), 90_000);

test.skipIf(!haveFuse)("the same, restarting without a reader thread: the dead reader's requests are resent, not lost", () => crashAndRestart("blockd-crash-noreader", "0"), 90_000);

test.skipIf(!haveFuse || !haveLoop)(
  "blockd and its fd keeper both killed: devices come back at their paths with new loops (read-only stays read-only), data there, marked lost until deleted",
  async () => {
    const { dir, state, client } = await startBlockd("blockd-crash-nokeeper");
    const size = 4 << 20;
    const dev = await client.call("create", { id: "vm-disk", upperDir: join(dir, "up"), size, loop: true });
    expect(dev.loop).toMatch(/^\/dev\/loop\d+$/);
    const base = await makeLayer(join(dir, "base.sealed"), size, 0, new Uint8Array(8192).fill(0x5a));
    const ro = await client.call("createReadOnly", { lowers: [base], loop: true });
    const w = spawnFixture("seq_writer", [dev.path, String(size), "1"]);
    expect(await w.exited()).toBe(0); // fsync'd: acknowledged data
    const user = spawnFixture("io_loop", [dev.loop, "120"]); // a VM with the disk open, through the loop
    await until(() => user.lines.length > 0, "the loop device to serve reads");

    const pids = [blockdPid(state), Number(readFileSync(join(state, "keeper.pid"), "utf8"))];
    for (const pid of pids) process.kill(pid, "SIGKILL");
    client.close();
    await until(() => pids.every(processGone), "blockd and the keeper to be gone");
    // With every fd of the connection closed, the kernel ends it: the user gets an error, no wait.
    expect(await user.exited()).toBe(0);
    expect(user.lines.at(-1)).toMatch(/^error (EIO|ENOTCONN|ECONNABORTED)$/);

    const again = await BlockdClient.ensure(state);
    const [back, roBack] = await again.call("list");
    expect(back).toMatchObject({ id: dev.id, path: dev.path, state: "lost" });
    expect(back.reason).toContain("died with blockd and the fd keeper");
    expect(back.loop).toMatch(/^\/dev\/loop\d+$/);
    expect(readFileSync(join(state, "blockd.log"), "utf8")).toContain(`device ${dev.id} is lost`);
    expect(mountsAt(dev.path)).toHaveLength(1); // the dead mount is gone, the new one serves
    // Every acknowledged byte is there, through the path and through the new loop.
    for (const path of [dev.path, back.loop]) expect(firstBadChunk(readAll(path, size), 0)).toBe(-1);
    // A read-only device comes back the same way, its loop read-only again.
    expect(roBack).toMatchObject({ id: ro.id, path: ro.path, state: "lost", readOnly: true });
    expect(readFileSync(`/sys/block/${roBack.loop.slice(5)}/ro`, "utf8").trim()).toBe("1");
    expect(readAll(roBack.loop, 8192).every((b) => b === 0x5a)).toBe(true);
    await again.call("delete", { id: ro.id });

    // "lost" outlives a plain restart (the keeper alive this time) ...
    const pid = blockdPid(state);
    process.kill(pid, "SIGKILL");
    again.close();
    await until(() => processGone(pid), "blockd to be gone");
    const third = await BlockdClient.ensure(state);
    expect((await third.call("list"))[0]).toMatchObject({ id: dev.id, state: "lost" });
    // ... until the device is deleted; made again, it is live.
    await third.call("delete", { id: dev.id });
    rmSync(join(dir, "up"), { recursive: true });
    const made = await third.call("create", { id: dev.id, upperDir: join(dir, "up"), size });
    expect(made).toMatchObject({ state: "live", reason: null });
    await third.call("delete", { id: dev.id });
    third.close();
  },
  120_000,
);
