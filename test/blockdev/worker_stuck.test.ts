// Device workers that stop answering (AENV_BLOCKD_FAULT worker-hang blocks the worker's thread, as
// a deadlock would). Every call to a worker has a bound (AENV_BLOCKD_DEVICE_TIMEOUT_MS caps them
// here): a stuck worker fails its call with Timeout naming the device and the call, and is dealt
// with as a dead one: ended, its device failed, its connection closed so its users get errors.
// A memory writer stuck on its source (a FIFO nobody writes) is bounded alike
// (AENV_BLOCKD_MEMORY_TIMEOUT_MS caps its 110 s).
import { expect, test } from "bun:test";
import { closeSync, existsSync, openSync, readdirSync, readFileSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { fuseDevicePath } from "../../src/blockdev/device_table.ts";
import { BlockdError } from "../../src/blockdev/protocol.ts";
import { haveFuse, mountsAt, spawnFixture, startBlockd, stopBlockd, until } from "./harness.ts";

const MiB = 1 << 20;
/** The bound of every worker call in these blockds. */
const BOUND_MS = 2000;

/** A blockd whose worker of device `id` blocks for good when asked for `op`. */
const blockdWithHang = (label: string, id: string, op: string) =>
  startBlockd(label, { env: { AENV_BLOCKD_FAULT: `worker-hang:${id}:${op}`, AENV_BLOCKD_DEVICE_TIMEOUT_MS: String(BOUND_MS) } });

test.skipIf(!haveFuse)(
  "a worker stuck in a call: the call fails with Timeout naming the device and call, the device is failed, its reader gets an error, the other device serves on",
  async () => {
    const { dir, state, client } = await blockdWithHang("blockd-worker-stuck", "victim", "restack");
    const victim = await client.call("create", { id: "victim", upperDir: join(dir, "v"), size: 4 * MiB });
    await client.call("create", { id: "other", upperDir: join(dir, "o"), size: 4 * MiB });
    const reader = spawnFixture("io_loop", [victim.path, "120"]);
    await until(() => reader.lines.some((l) => l.startsWith("ok")), "the victim to serve reads");

    const asked = Date.now();
    const err = await client.call("restack", { id: "victim", layerPath: join(dir, "sealed") }, { timeoutMs: 60_000 }).catch((e) => e);
    expect(err).toBeInstanceOf(BlockdError);
    expect(err.code).toBe("Timeout");
    expect(err.message).toBe(`device victim: its worker did not answer restack within ${BOUND_MS} ms`);
    expect(Date.now() - asked).toBeGreaterThanOrEqual(BOUND_MS - 100); // it was given its bound

    // Its reader is told, rather than left waiting on a worker that will never answer.
    expect(await reader.exited()).toBe(0);
    expect(reader.lines.at(-1)).toMatch(/^error (ENOTCONN|ECONNABORTED|EIO)$/);
    const list = await client.call("list");
    const v = list.find((d: { id: string }) => d.id === "victim");
    expect(v.state).toBe("failed");
    expect(v.reason).toBe(`device victim: its worker did not answer restack within ${BOUND_MS} ms`);
    expect(list.find((d: { id: string }) => d.id === "other").state).toBe("live");
    expect((await client.call("stats", { id: "victim" }).catch((e) => e)).code).toBe("DeviceFailed"); // at once, no second wait
    expect((await client.call("stats", { id: "other" })).size).toBe(4 * MiB);
    const log = readFileSync(join(state, "blockd.log"), "utf8");
    expect(log).toContain("blockd fault injected: device victim's worker, asked for restack hangs");
    expect(log).toContain("device victim is failed until deleted");

    expect(await client.call("delete", { id: "victim" })).toMatchObject({ freed: true });
    expect(mountsAt(victim.path)).toHaveLength(0);
    await client.call("delete", { id: "other" });
  },
  120_000,
);

test.skipIf(!haveFuse)(
  "a worker stuck before it is ready: create fails with Timeout and leaves nothing (no device, mount, file or upper); blockd serves on",
  async () => {
    const { dir, state, client } = await blockdWithHang("blockd-start-stuck", "slow", "start");
    const err = await client.call("create", { id: "slow", upperDir: join(dir, "s"), size: 4 * MiB }, { timeoutMs: 60_000 }).catch((e) => e);
    expect(err).toBeInstanceOf(BlockdError);
    expect(err.code).toBe("Timeout");
    expect(err.message).toBe(`device slow: its worker did not start within ${BOUND_MS} ms`);
    const path = fuseDevicePath(state, "slow");
    await until(() => mountsAt(path).length === 0, `no mount at ${path}`, 10_000);
    expect(existsSync(path)).toBe(false);
    expect(existsSync(join(dir, "s"))).toBe(false);
    expect(await client.call("list")).toEqual([]);

    const fine = await client.call("create", { id: "fine", upperDir: join(dir, "f"), size: 4 * MiB });
    expect(fine.state).toBe("live");
    await client.call("delete", { id: "fine" });
  },
  120_000,
);

test.skipIf(!haveFuse)(
  "a worker stuck in stop: delete still frees the device, its worker ended as dead and its mount cleared",
  async () => {
    const { dir, state, client } = await blockdWithHang("blockd-stop-stuck", "victim", "stop");
    const victim = await client.call("create", { id: "victim", upperDir: join(dir, "v"), size: 4 * MiB });
    expect(await client.call("delete", { id: "victim" }, { timeoutMs: 60_000 })).toMatchObject({ freed: true });
    expect(mountsAt(victim.path)).toHaveLength(0);
    expect(existsSync(victim.path)).toBe(false);
    expect(await client.call("list")).toEqual([]);
    expect(readFileSync(join(state, "blockd.log"), "utf8")).toContain(`device victim: its worker did not answer stop within ${BOUND_MS} ms`);
  },
  120_000,
);

test.skipIf(!haveFuse)(
  "test cleanup waits for a shutdown that a stuck worker slows down: nothing is killed halfway, nothing is left mounted",
  async () => {
    const { dir, state, client } = await blockdWithHang("blockd-slow-shutdown", "lingering", "stop");
    const dev = await client.call("create", { id: "lingering", upperDir: join(dir, "l"), size: 4 * MiB });
    client.close();
    const killed = await stopBlockd(state);
    expect(killed).toEqual([]); // blockd and its keeper exited on their own
    expect(mountsAt(dev.path)).toHaveLength(0);
    const log = readFileSync(join(state, "blockd.log"), "utf8");
    expect(log).toContain(`device lingering: its worker did not answer stop within ${BOUND_MS} ms`);
  },
  180_000,
);

test("a memory writer stuck on its source: memoryLayer fails with Timeout and leaves no file; another thread takes its place", async () => {
  const { dir, state, client } = await startBlockd("blockd-memory-stuck", { env: { AENV_BLOCKD_MEMORY_TIMEOUT_MS: String(BOUND_MS) } });
  const fifo = join(dir, "never-written");
  expect(Bun.spawnSync(["mkfifo", fifo]).exitCode).toBe(0);
  const asked = Date.now();
  const err = await client.call("memoryLayer", { out: join(dir, "stuck.layer"), size: 4 * MiB, from: { file: fifo } }).catch((e) => e);
  expect(err).toBeInstanceOf(BlockdError);
  expect(err.code).toBe("Timeout");
  expect(err.message).toBe(`memory layer ${join(dir, "stuck.layer")} did not finish within ${BOUND_MS} ms`);
  expect(Date.now() - asked).toBeGreaterThanOrEqual(BOUND_MS - 100);
  await until(() => !readdirSync(dir).some((f) => f.startsWith("stuck.layer")), "the stuck write's scratch files to go");

  // More writes than threads (2), the stuck one's retired: each gets its own pages.
  const image = join(dir, "image");
  const bytes = new Uint8Array(4 * MiB);
  for (let page = 0; page < 1024; page += 4) bytes[page * 4096] = 7;
  writeFileSync(image, bytes);
  const done = await Promise.all([0, 1, 2].map((i) => client.call("memoryLayer", { out: join(dir, `ok-${i}.layer`), size: 4 * MiB, from: { file: image } })));
  for (const r of done) expect(r).toMatchObject({ dataPages: 256, zeroPages: 768 });
  expect(await client.call("list")).toEqual([]);

  closeSync(openSync(fifo, "r+")); // the stuck thread's open returns
  expect(await stopBlockd(state)).toEqual([]);
}, 60_000);
