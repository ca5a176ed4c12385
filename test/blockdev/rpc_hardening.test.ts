// blockd's RPCs under failure and concurrency: a failed restack leaves the device serving its old
// stack; racing acquires and createReadOnlys get correct answers; failed creates leave nothing
// behind; clients never wait forever on a blockd or fd keeper that stops answering or dies.
import { afterAll, describe, expect, test } from "bun:test";
import { existsSync, mkdirSync, readdirSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { BlockdClient } from "../../src/blockdev/client.ts";
import { KeeperClient } from "../../src/blockdev/keeper_client.ts";
import { BlockdConnectionError, BlockdTimeoutError } from "../../src/blockdev/protocol.ts";
import { scratchDir } from "../helpers/tmp.ts";
import { failure, haveFuse, haveLoop, makeLayer, readAll, startBlockd, writeAt } from "./harness.ts";

const canRun = haveFuse && haveLoop;
const MiB = 1 << 20;

/** Every path under dir (relative), to show that a failed call left nothing new. */
function tree(dir: string): string[] {
  return existsSync(dir) ? (readdirSync(dir, { recursive: true }) as string[]).sort() : [];
}

describe.skipIf(!canRun)("blockd RPC hardening", async () => {
  if (!canRun) return void test.skip("needs root, /dev/fuse and /dev/loop-control", () => {});
  const { dir, state, client } = await startBlockd("blockd-rpc", { pool: 1 });
  const base = await makeLayer(join(dir, "base.sealed"), 4 * MiB, 0, new Uint8Array(4096).fill(0x3c));
  const garbage = join(dir, "garbage.sealed");
  writeFileSync(garbage, crypto.getRandomValues(new Uint8Array(64 << 10)));
  /** The pool after its background refill: one idle device, so snapshots of the state dir hold still. */
  const poolSettled = async () => {
    for (let i = 0; i < 200; i++) {
      const idle = (await client.call("list")).filter((d: { kind: string; config: unknown }) => d.kind === "pool" && d.config === null);
      if (idle.length >= 1) return;
      await Bun.sleep(25);
    }
    throw new Error("pool never refilled");
  };

  test("a restack to a path that cannot be made fails typed and the device keeps serving its old stack", async () => {
    const upperDir = join(dir, "rs-up");
    const dev = await client.call("create", { lowers: [base], upperDir, size: 4 * MiB });
    const a = crypto.getRandomValues(new Uint8Array(8192));
    writeAt(dev.path, a, 64 << 10);
    const upperBefore = tree(upperDir);

    const missingDir = await failure(client.call("restack", { id: dev.id, layerPath: join(dir, "no-such-dir", "snap.sealed") }));
    expect(missingDir?.name).toBe("ConfigError");
    writeFileSync(join(dir, "taken.sealed"), "someone else's file");
    const taken = await failure(client.call("restack", { id: dev.id, layerPath: join(dir, "taken.sealed") }));
    expect(taken?.name).toBe("ConfigError");
    expect(readFileSync(join(dir, "taken.sealed"), "utf8")).toBe("someone else's file");
    expect((await failure(client.call("restack", { id: dev.id, layerPath: "relative.sealed" })))?.name).toBe("BadRequest");
    expect(tree(upperDir)).toEqual(upperBefore);
    // Failures further in: a stray directory where the fresh upper is made (before the seal), and
    // one where the old index is kept while the fresh one moves in (after the seal: it is cut off).
    for (const stray of ["writable_data.next", "writable_index.prev"]) {
      mkdirSync(join(upperDir, stray, "x"), { recursive: true });
      const e = await failure(client.call("restack", { id: dev.id, layerPath: join(dir, "rs-stray.sealed") }));
      expect(e).toBeDefined();
      expect(e?.name).not.toBe("Internal");
      expect(existsSync(join(dir, "rs-stray.sealed"))).toBe(false);
      rmSync(join(upperDir, stray), { recursive: true });
      expect(tree(upperDir)).toEqual(upperBefore);
      expect(readAll(dev.path, 8192, 64 << 10)).toEqual(a);
    }

    // Same data, still writable, still resizable, and stats tells the size in effect.
    expect(readAll(dev.path, 8192, 64 << 10)).toEqual(a);
    expect(readAll(dev.path, 4096)).toEqual(new Uint8Array(4096).fill(0x3c));
    const b = crypto.getRandomValues(new Uint8Array(4096));
    writeAt(dev.path, b, 1 * MiB);
    expect((await client.call("resize", { id: dev.id, size: 8 * MiB })).size).toBe(8 * MiB);
    expect((await client.call("stats", { id: dev.id })).size).toBe(8 * MiB);

    // A good restack afterwards seals every byte written before it.
    const r = await client.call("restack", { id: dev.id, layerPath: join(dir, "rs-snap.sealed") });
    expect(r.config.lowers.map((l: { file: string }) => l.file)).toEqual([base, join(dir, "rs-snap.sealed")]);
    expect(tree(upperDir)).toEqual(upperBefore);
    expect(readAll(dev.path, 8192, 64 << 10)).toEqual(a);
    expect(readAll(dev.path, 4096, 1 * MiB)).toEqual(b);
    await client.call("delete", { id: dev.id });
    const ro = await client.call("createReadOnly", { lowers: r.config.lowers });
    expect(ro.size).toBe(8 * MiB);
    expect(readAll(ro.path, 8192, 64 << 10)).toEqual(a);
    expect(readAll(ro.path, 4096, 1 * MiB)).toEqual(b);
    await client.call("delete", { id: ro.id });
  }, 60_000);

  test("racing writable acquires get distinct devices, each with its own image", async () => {
    for (let round = 0; round < 3; round++) {
      await poolSettled();
      const got = await Promise.allSettled(
        ["a", "b", "c"].map((n) => client.call("acquire", { lowers: [base], upperDir: join(dir, `acq-${round}-${n}`), size: 4 * MiB })),
      );
      expect(got.map((r) => (r.status === "fulfilled" ? "ok" : (r.reason as Error).message))).toEqual(["ok", "ok", "ok"]);
      const devs = got.map((r) => (r as PromiseFulfilledResult<{ id: string; path: string }>).value);
      expect(new Set(devs.map((d) => d.id)).size).toBe(3);
      const marks = devs.map((d, i) => {
        const m = new Uint8Array(4096).fill(0x10 + i);
        writeAt(d.path, m, 8192);
        return m;
      });
      devs.forEach((d, i) => {
        expect(readAll(d.path, 4096, 8192)).toEqual(marks[i]!);
        expect(readAll(d.path, 4096)).toEqual(new Uint8Array(4096).fill(0x3c));
      });
      for (const d of devs) await client.call("release", { id: d.id });
    }
  }, 60_000);

  test("two racing createReadOnlys of one image share one device with two references", async () => {
    const [a, b] = await Promise.all([client.call("createReadOnly", { lowers: [base] }), client.call("createReadOnly", { lowers: [{ file: base }] })]);
    expect(b.id).toBe(a.id);
    const ro = (await client.call("list")).filter((d: { kind: string }) => d.kind === "ro");
    expect(ro.map((d: { id: string; refs: number }) => [d.id, d.refs])).toEqual([[a.id, 2]]);
    expect((await client.call("delete", { id: a.id })).freed).toBe(false);
    expect((await client.call("delete", { id: a.id })).freed).toBe(true);
  }, 30_000);

  test("racing creates of one id or one upper: one device, the other told Exists; an upper in use is not acquired", async () => {
    const sameUpper = await Promise.allSettled([
      client.call("create", { upperDir: join(dir, "race-up"), size: MiB }),
      client.call("create", { upperDir: join(dir, "race-up"), size: MiB }),
    ]);
    expect(sameUpper.map((r) => r.status).sort()).toEqual(["fulfilled", "rejected"]);
    expect((sameUpper.find((r) => r.status === "rejected") as PromiseRejectedResult).reason.name).toBe("Exists");
    const made = (sameUpper.find((r) => r.status === "fulfilled") as PromiseFulfilledResult<{ id: string }>).value;
    const inUse = await failure(client.call("acquire", { lowers: [base], upperDir: join(dir, "race-up"), size: MiB }));
    expect(inUse?.name).toBe("Exists");
    await client.call("delete", { id: made.id });

    const sameId = await Promise.allSettled([
      client.call("create", { id: "race-id", upperDir: join(dir, "race-id-1"), size: MiB }),
      client.call("create", { id: "race-id", upperDir: join(dir, "race-id-2"), size: MiB }),
    ]);
    expect(sameId.map((r) => r.status).sort()).toEqual(["fulfilled", "rejected"]);
    expect((sameId.find((r) => r.status === "rejected") as PromiseRejectedResult).reason.name).toBe("Exists");
    expect(existsSync(join(dir, "race-id-1")) !== existsSync(join(dir, "race-id-2"))).toBe(true); // the loser made nothing
    await client.call("delete", { id: "race-id" });
  }, 30_000);

  test("a failed create, createReadOnly or acquire leaves nothing behind and a retry with good input succeeds", async () => {
    await poolSettled();
    const stateBefore = tree(state).filter((p) => !p.startsWith("devices.json"));
    const up = join(dir, "cr-up");
    const expectNothingNew = () => {
      expect(existsSync(up)).toBe(false);
      expect(tree(state).filter((p) => !p.startsWith("devices.json"))).toEqual(stateBefore);
    };
    // create over a lower that is not a layer, twice (the second must not say Exists)
    for (let i = 0; i < 2; i++) {
      const e = await failure(client.call("create", { lowers: [garbage], upperDir: up, size: 4 * MiB }));
      expect(e?.name).toBe("DeviceFailed");
      expectNothingNew();
    }
    // createReadOnly over it, twice
    for (let i = 0; i < 2; i++) {
      expect((await failure(client.call("createReadOnly", { lowers: [garbage] })))?.name).toBe("DeviceFailed");
      expectNothingNew();
    }
    // acquire: sizes that are no size, no image at all, a lower that is not a layer
    for (const params of [
      { lowers: [base], upperDir: up, size: 0 },
      { lowers: [base], upperDir: up, size: -512 },
      { lowers: [base], upperDir: up },
      { lowers: [base], upperDir: 7, size: 4 * MiB },
      {},
      { lowers: [] },
    ]) {
      expect((await failure(client.call("acquire", params)))?.name).toBe("BadRequest");
      expectNothingNew();
    }
    expect((await failure(client.call("acquire", { lowers: [join(dir, "missing.sealed")], upperDir: up, size: 4 * MiB })))?.name).toBe("ConfigError");
    expectNothingNew();
    expect((await failure(client.call("acquire", { lowers: [garbage], upperDir: up, size: 4 * MiB })))?.name).toBe("FormatError");
    expectNothingNew();
    expect((await client.call("list")).filter((d: { kind: string; config: unknown }) => d.kind === "pool" && d.config !== null)).toEqual([]);

    // Retries with good input.
    const rw = await client.call("create", { lowers: [base], upperDir: up, size: 4 * MiB });
    expect(readAll(rw.path, 4096)).toEqual(new Uint8Array(4096).fill(0x3c));
    await client.call("delete", { id: rw.id });
    const ro = await client.call("createReadOnly", { lowers: [base] });
    expect(ro.refs).toBe(1);
    await client.call("delete", { id: ro.id });
    const acq = await client.call("acquire", { lowers: [base], upperDir: join(dir, "cr-up2"), size: 4 * MiB });
    expect(readAll(acq.path, 4096)).toEqual(new Uint8Array(4096).fill(0x3c));
    await client.call("release", { id: acq.id });
  }, 60_000);
});

describe.skipIf(!canRun)("clients of a blockd or fd keeper that stops answering or dies", async () => {
  if (!canRun) return void test.skip("needs root, /dev/fuse and /dev/loop-control", () => {});
  // A blockd of its own, without devices, so stopping and killing it disturbs nothing else.
  const state = join(scratchDir("blockd-hang"), "state");
  mkdirSync(state, { recursive: true });
  const client = await BlockdClient.ensure(state);
  const pidOf = (name: string) => Number(readFileSync(join(state, name), "utf8"));
  const blockdPid = pidOf("blockd.pid");
  const keeperPid = pidOf("keeper.pid");
  const kill = (pid: number, sig: NodeJS.Signals) => {
    try {
      process.kill(pid, sig);
    } catch {}
  };
  afterAll(() => {
    for (const pid of [blockdPid, keeperPid]) for (const sig of ["SIGKILL", "SIGCONT"] as const) kill(pid, sig);
  });

  test("a call to a blockd that never answers rejects with BlockdTimeoutError within its timeout", async () => {
    expect((await client.call("hello")).pid).toBe(blockdPid);
    kill(blockdPid, "SIGSTOP"); // the socket still accepts; nothing answers
    try {
      const started = Date.now();
      const e = await failure(client.call("list", {}, { timeoutMs: 500 }));
      expect(e).toBeInstanceOf(BlockdTimeoutError);
      expect(e?.message).toContain('"list"');
      expect(Date.now() - started).toBeLessThan(10_000);
      // A fresh connection: connect succeeds (the kernel accepts), hello times out.
      const other = await BlockdClient.connect(join(state, "blockd.sock"), { timeoutMs: 300 });
      expect(await failure(other.call("hello"))).toBeInstanceOf(BlockdTimeoutError);
      other.close();
    } finally {
      kill(blockdPid, "SIGCONT");
    }
    // The late reply to the timed-out call is dropped; the next call gets its own answer.
    expect(Array.isArray(await client.call("list"))).toBe(true);
  }, 30_000);

  test("a keeper call that is never answered rejects with BlockdTimeoutError, and later calls get their own replies", async () => {
    const keeper = await KeeperClient.ensure(state, { timeoutMs: 500 });
    expect(keeper.pid).toBe(keeperPid);
    kill(keeperPid, "SIGSTOP");
    try {
      const e = await failure(keeper.drop("nothing"));
      expect(e).toBeInstanceOf(BlockdTimeoutError);
      expect(e?.message).toContain("drop");
    } finally {
      kill(keeperPid, "SIGCONT");
    }
    // The keeper answers the timed-out drop first ({ok}); take's own reply is the list.
    expect(await keeper.take("nothing")).toBeUndefined();
    keeper.close();
  }, 30_000);

  test("a blockd and a keeper that die mid-call reject with BlockdConnectionError, and so does every later call", async () => {
    const keeper = await KeeperClient.ensure(state);
    kill(keeperPid, "SIGSTOP");
    const keeperCall = failure(keeper.take("nothing"));
    kill(keeperPid, "SIGKILL");
    kill(keeperPid, "SIGCONT");
    expect(await keeperCall).toBeInstanceOf(BlockdConnectionError);
    expect(await failure(keeper.drop("nothing"))).toBeInstanceOf(BlockdConnectionError);

    kill(blockdPid, "SIGSTOP");
    const call = failure(client.call("list"));
    kill(blockdPid, "SIGKILL");
    kill(blockdPid, "SIGCONT");
    const e = await call;
    expect(e).toBeInstanceOf(BlockdConnectionError);
    expect(e?.message).toContain('"list"');
    expect(await failure(client.call("hello"))).toBeInstanceOf(BlockdConnectionError);
  }, 30_000);
});

describe.skipIf(!canRun)("shutdown", async () => {
  if (!canRun) return void test.skip("needs root, /dev/fuse and /dev/loop-control", () => {});
  const { dir, state, client } = await startBlockd("blockd-stop", { pool: 1 });

  test("a shutdown right after an acquire waits for the pool refill it started: no device is left mounted", async () => {
    const layer = await makeLayer(join(dir, "l.sealed"), MiB, 0, new Uint8Array(4096).fill(1));
    const pid = Number(readFileSync(join(state, "blockd.pid"), "utf8"));
    await client.call("acquire", { lowers: [layer] }); // starts a refill in the background
    await client.call("shutdown");
    const gone = () => !existsSync(`/proc/${pid}`) || readFileSync(`/proc/${pid}/stat`, "utf8").replace(/^.*\) /s, "")[0] === "Z";
    for (let i = 0; i < 400 && !gone(); i++) await Bun.sleep(25);
    expect(gone()).toBe(true);
    expect(readFileSync("/proc/mounts", "utf8").split("\n").filter((l) => l.includes(state))).toEqual([]);
  }, 30_000);
});
