// blockd on the FUSE frontend, for real: loop devices, ext4, restack under a mounted filesystem,
// shared read-only devices, the warm pool, and bad input that must not disturb other devices.
import { describe, expect, test } from "bun:test";
import { mkdirSync, readFileSync, readdirSync, rmSync, writeFileSync, openSync, readSync, closeSync } from "node:fs";
import { join } from "node:path";
import { sha256 } from "../helpers/tmp.ts";
import { haveFuse, haveLoop, makeLayer, readAll, sh, startBlockd, until } from "./harness.ts";
import { FrameReader, encodeFrame } from "../../src/blockdev/protocol.ts";

const canRun = haveFuse && haveLoop;
if (!canRun) console.log("blockd tests skipped: they need root, /dev/fuse and /dev/loop-control");

describe.skipIf(!canRun)("blockd (FUSE frontend)", async () => {
  // bun runs a skipped describe's body: start nothing there, and show why it skipped.
  if (!canRun) return void test.skip("needs root, /dev/fuse and /dev/loop-control", () => {});
  const { dir, state, client } = await startBlockd("blockd", { pool: 1 });
  const SIZE = 64 << 20;

  test("ext4 on a 3-layer stack: restack while mounted, then reopen the stack and verify every file", async () => {
    const lowers: string[] = [];
    for (let i = 0; i < 3; i++) lowers.push(await makeLayer(join(dir, `base-${i}.sealed`), SIZE, i * 4096, new Uint8Array(4096).fill(i + 1)));
    const dev = await client.call("create", { lowers, upperDir: join(dir, "up"), size: SIZE, loop: true });
    expect(dev.loop).toMatch(/^\/dev\/loop\d+$/);
    sh(["mkfs.ext4", "-F", "-q", dev.loop]);
    const mnt = join(dir, "mnt");
    mkdirSync(mnt, { recursive: true });
    sh(["mount", dev.loop, mnt]);
    const files = new Map<string, string>();
    const put = (name: string, bytes: number) => {
      const b = new Uint8Array(bytes);
      crypto.getRandomValues(b.subarray(0, Math.min(bytes, 65536)));
      writeFileSync(join(mnt, name), b);
      files.set(name, sha256(b));
    };
    try {
      for (let i = 0; i < 5; i++) put(`before-${i}`, 100_000 + i * 7777);
      sh(["sync", "-f", mnt]);
      const r1 = await client.call("restack", { id: dev.id, layerPath: join(dir, "snap-1.sealed") });
      expect(r1.config.lowers.length).toBe(4);
      for (let i = 0; i < 5; i++) put(`after-${i}`, 200_000 + i * 3333);
      sh(["sync", "-f", mnt]);
    } finally {
      sh(["umount", mnt]);
    }
    const r2 = await client.call("restack", { id: dev.id, layerPath: join(dir, "snap-2.sealed") });
    expect(r2.config.lowers.map((l: { file: string }) => l.file)).toEqual([...lowers, join(dir, "snap-1.sealed"), join(dir, "snap-2.sealed")]);
    await client.call("delete", { id: dev.id });

    const ro = await client.call("createReadOnly", { lowers: r2.config.lowers, loop: true });
    sh(["mount", "-o", "ro,noload", ro.loop, mnt]);
    try {
      for (const [name, sum] of files) expect(sha256(readFileSync(join(mnt, name)))).toBe(sum);
    } finally {
      sh(["umount", mnt]);
    }
    await client.call("delete", { id: ro.id });
  }, 120_000);

  test("a reader thread joins at the first large write and takes requests beside the device worker; fio verifies every block", async () => {
    const dev = await client.call("create", { upperDir: join(dir, "up-reader"), size: SIZE });
    const fio = (rw: string, bs: string) => {
      const r = Bun.spawnSync(
        ["fio", "--name=v", `--filename=${dev.path}`, `--rw=${rw}`, `--bs=${bs}`, "--iodepth=16", "--ioengine=io_uring", "--direct=1",
          "--size=16M", "--verify=crc32c", "--do_verify=1", "--verify_fatal=1", "--verify_state_save=0", "--output-format=json"],
        { stdout: "pipe", stderr: "pipe" },
      );
      expect(r.stderr.toString()).toBe("");
      expect(r.exitCode).toBe(0);
      const job = JSON.parse(r.stdout.toString()).jobs[0];
      expect(job.error).toBe(0);
      expect(job.read.io_bytes).toBe(16 << 20); // the verify pass read it all back
    };
    fio("randwrite", "4k");
    expect((await client.call("stats", { id: dev.id })).takenByReader).toBe(0); // small writes: no reader yet
    fio("randwrite", "256k");
    fio("randwrite", "4k"); // once there, it takes small requests too
    const stats = await client.call("stats", { id: dev.id });
    expect(stats.takenByReader).toBeGreaterThan(0);
    expect(stats.takenByReader).toBeLessThan(stats.requests);
    await client.call("delete", { id: dev.id });
  }, 60_000);

  test("two read-only devices for one image share one instance; the last release frees it", async () => {
    const layer = await makeLayer(join(dir, "shared.sealed"), 1 << 20, 0, new Uint8Array(8192).fill(0x5a));
    const a = await client.call("createReadOnly", { lowers: [layer] });
    const b = await client.call("createReadOnly", { lowers: [{ file: layer }] });
    expect(b.id).toBe(a.id);
    expect(b.refs).toBe(2);
    expect(readAll(a.path, 8192).every((x) => x === 0x5a)).toBe(true);
    // One copy in the host page cache for every reader: a second open and read reach no READ to us.
    const reads = (await client.call("stats", { id: a.id })).reads;
    expect(reads).toBeGreaterThan(0);
    expect(readAll(b.path, 8192).every((x) => x === 0x5a)).toBe(true);
    expect((await client.call("stats", { id: a.id })).reads).toBe(reads);
    expect((await client.call("delete", { id: a.id })).freed).toBe(false);
    expect((await client.call("list")).some((d: { id: string }) => d.id === a.id)).toBe(true);
    expect((await client.call("delete", { id: a.id })).freed).toBe(true);
    expect((await client.call("list")).some((d: { id: string }) => d.id === a.id)).toBe(false);
  }, 30_000);

  test("warm pool: acquire swaps the image under a live device and a reader sees it", async () => {
    const l1 = await makeLayer(join(dir, "pool-a.sealed"), 1 << 20, 0, new Uint8Array(4096).fill(0xa1));
    const l2 = await makeLayer(join(dir, "pool-b.sealed"), 2 << 20, 0, new Uint8Array(4096).fill(0xb2));
    const pooled = (await client.call("list")).filter((d: { kind: string }) => d.kind === "pool");
    expect(pooled.length).toBeGreaterThanOrEqual(1);
    const d0 = await client.call("acquire", { lowers: [l1] });
    expect(pooled.map((d: { id: string }) => d.id)).toContain(d0.id); // a ready device, not a new one
    expect(d0.size).toBe(1 << 20);
    const d1 = await client.call("acquire", { lowers: [l1] });
    expect(d1.id).not.toBe(d0.id);
    // Keep one fd open across the swap: the same live file shows the new image.
    const fd = openSync(d1.path, "r");
    const b = new Uint8Array(4096);
    readSync(fd, b, 0, 4096, 0);
    expect(b[0]).toBe(0xa1);
    await client.call("release", { id: d0.id });
    await client.call("release", { id: d1.id });
    // The device released last is handed out first: d1's live file, now over l2.
    const d2 = await client.call("acquire", { lowers: [l2] });
    expect(d2.id).toBe(d1.id);
    readSync(fd, b, 0, 4096, 0);
    expect(b[0]).toBe(0xb2);
    expect(readAll(d2.path, 4096)[0]).toBe(0xb2);
    closeSync(fd);
    await client.call("release", { id: d2.id });
    // Writable acquire: a fresh upper over the layer.
    const d3 = await client.call("acquire", { lowers: [l1], upperDir: join(dir, "pool-up"), size: 1 << 20 });
    expect(readAll(d3.path, 4096)[0]).toBe(0xa1);
    await client.call("release", { id: d3.id });
  }, 30_000);

  test("memory layers are written on the writer threads: racing writes each get their own bytes, errors keep their codes, and other calls are answered meanwhile", async () => {
    const MiB = 1 << 20;
    const images = [0x11, 0x22, 0x33].map((fill, k) => {
      const path = join(dir, `mem-${k}.raw`);
      const bytes = new Uint8Array(8 * MiB);
      bytes.fill(fill, 0, 2 * MiB); // then 2 MiB of zeros, left out of a base layer
      bytes.fill(fill + 1, 4 * MiB);
      writeFileSync(path, bytes);
      return path;
    });
    let answered = 0;
    let writing = true;
    const others = (async () => {
      while (writing) {
        await client.call("list");
        answered++;
      }
    })();
    // Three at once: two run on the writer threads, one waits for a thread.
    const results = await Promise.all(images.map((file, k) => client.call<{ dataPages: number; zeroPages: number }>("memoryLayer", { out: join(dir, `mem-${k}.layer`), size: 8 * MiB, from: { file } })));
    writing = false;
    await others;
    expect(answered).toBeGreaterThan(0);
    for (const r of results) expect(r).toMatchObject({ dataPages: 1536, zeroPages: 512 });
    for (const [k, fill] of [0x11, 0x22, 0x33].entries()) {
      const d = await client.call("acquire", { lowers: [join(dir, `mem-${k}.layer`)] });
      expect(readAll(d.path, 4096)[0]).toBe(fill);
      expect(readAll(d.path, 4096, 3 * MiB).every((b) => b === 0)).toBe(true);
      expect(readAll(d.path, 4096, 5 * MiB).every((b) => b === fill + 1)).toBe(true);
      await client.call("release", { id: d.id });
    }
    // Errors thrown on a writer thread come back as blockd's own, and leave nothing at `out`.
    const err = (p: Promise<unknown>) => p.then(() => undefined, (e: { code?: string }) => e.code);
    expect(await err(client.call("memoryLayer", { out: join(dir, "bad-size.layer"), size: 4 * MiB, from: { file: images[0] } }))).toBe("BadRequest");
    expect(await err(client.call("memoryLayer", { out: join(dir, "bad-pid.layer"), size: 4 * MiB, from: { pid: 2 ** 30, address: 0, pagesFile: images[0] } }))).toBe("NotFound");
    expect(await err(client.call("memoryLayer", { out: join(dir, "bad-size.layer"), size: 4097, from: { file: images[0] } }))).toBe("BadRequest");
    for (const f of readdirSync(dir)) expect(f.startsWith("bad-")).toBe(false);
  }, 60_000);

  test("new pool devices warm up (a swap over a small 2-layer stack and back) and keep no scratch; a warm-up that fails is logged and its device still serves", async () => {
    const warm = join(state, "warm-up");
    const l1 = await makeLayer(join(dir, "warm-a.sealed"), 1 << 20, 0, new Uint8Array(4096).fill(0xc3));
    const idle = async () => (await client.call("list")).filter((d: { kind: string; acquired: boolean; config: unknown }) => d.kind === "pool" && !d.acquired && !d.config);
    await until(async () => (await idle()).length >= 1, "an idle pool device");
    // Each warm-up's held upper goes; its two sealed layers stay for the next.
    await until(() => readdirSync(warm).sort().join() === "base,top", "the warm-up's scratch files to go", 10_000);
    // A warm-up that cannot make its files: past the idle devices, an acquire starts a worker, whose device serves.
    rmSync(warm, { recursive: true });
    writeFileSync(warm, "in the way");
    const taken: { id: string; path: string }[] = [];
    try {
      for (let n = (await idle()).length; n >= 0; n--) taken.push(await client.call("acquire", { lowers: [l1] }));
      await until(() => readFileSync(join(state, "blockd.log"), "utf8").includes("warm-up:"), "the failed warm-up in the log");
      for (const d of taken) expect(readAll(d.path, 4096).every((b) => b === 0xc3)).toBe(true);
    } finally {
      for (const d of taken) await client.call("release", { id: d.id });
      rmSync(warm, { force: true });
      mkdirSync(warm);
    }
  }, 60_000);

  test("bad input gets a typed error and blockd keeps serving other devices", async () => {
    const keep = await client.call("create", { upperDir: join(dir, "keep"), size: 1 << 20 });
    const { writeSync, fsyncSync } = await import("node:fs");
    const pattern = crypto.getRandomValues(new Uint8Array(4096));
    const pfd = openSync(keep.path, "r+");
    writeSync(pfd, pattern, 0, 4096, 0);
    fsyncSync(pfd);
    closeSync(pfd);
    const expectError = async (method: string, params: Record<string, unknown>, code: string) => {
      let err: Error | undefined;
      try {
        await client.call(method, params);
      } catch (e) {
        err = e as Error;
      }
      expect(err?.name).toBe(code);
    };
    await expectError("frobnicate", {}, "UnknownMethod");
    await expectError("create", { upperDir: join(dir, "x"), size: 1000 }, "BadRequest");
    await expectError("create", { lowers: [join(dir, "missing.sealed")], upperDir: join(dir, "y"), size: 1 << 20 }, "ConfigError");
    await expectError("create", { lowers: "nope", upperDir: join(dir, "z"), size: 1 << 20 }, "BadRequest");
    await expectError("create", { upperDir: join(dir, "keep"), size: 1 << 20 }, "Exists");
    await expectError("createReadOnly", { lowers: [{ file: join(dir, "keep", "writable_index") }] }, "DeviceFailed");
    await expectError("delete", { id: "no-such" }, "NotFound");
    await expectError("resize", { id: keep.id, size: 12345 }, "BadRequest");
    await expectError("restack", { id: keep.id }, "BadRequest");
    // Resize below what is in use.
    const fd = openSync(keep.path, "r+");
    writeSync(fd, new Uint8Array(4096).fill(1), 0, 4096, 512 * 1024);
    fsyncSync(fd);
    closeSync(fd);
    await expectError("resize", { id: keep.id, size: 256 * 1024 }, "IoRangeError");
    expect((await client.call("resize", { id: keep.id, size: 2 << 20 })).size).toBe(2 << 20);
    // A second operation on a busy device.
    const both = await Promise.allSettled([
      client.call("restack", { id: keep.id, layerPath: join(dir, "k1.sealed") }),
      client.call("restack", { id: keep.id, layerPath: join(dir, "k2.sealed") }),
    ]);
    expect(both.filter((r) => r.status === "rejected").map((r) => (r as PromiseRejectedResult).reason.name)).toEqual(["Busy"]);
    // Wrong version and malformed frames on a raw connection.
    const { BlockdClient } = await import("../../src/blockdev/client.ts");
    const raw = await BlockdClient.connect(join(dir, "state", "blockd.sock"));
    const got: string[] = [];
    const frames = new FrameReader();
    const replies = new Promise<void>((resolve) => {
      // Both replies may arrive in one chunk: split frames as the client does.
      (raw as unknown as { onData: (c: Uint8Array) => void }).onData = (c: Uint8Array) => {
        for (const f of frames.push(c)) got.push(new TextDecoder().decode(f));
        if (got.length >= 2) resolve();
      };
    });
    raw.sendRaw(encodeFrame({ v: 99, id: 7, method: "hello" }));
    raw.sendRaw(encodeFrame("not json object"));
    await replies;
    expect(got.join()).toContain("VersionMismatch");
    expect(got.join()).toContain("BadRequest");
    raw.close();
    // A burst in one write: started in order one per turn, at most 64 in flight (the rest Busy at
    // once), and the count comes back down (a second burst is answered whole).
    const burst = await BlockdClient.connect(join(dir, "state", "blockd.sock"));
    const answers: { id: number; result?: unknown; error?: { code: string } }[] = [];
    const reader = new FrameReader();
    let wanted = 0;
    let settle = () => {};
    (burst as unknown as { onData: (c: Uint8Array) => void }).onData = (c: Uint8Array) => {
      for (const f of reader.push(c)) answers.push(JSON.parse(new TextDecoder().decode(f)));
      if (answers.length >= wanted) settle();
    };
    const send = (ids: number[]) => {
      wanted += ids.length;
      const done = new Promise<void>((r) => (settle = r));
      const frames = ids.map((id) => encodeFrame({ v: 1, id, method: "hello" }));
      const all = new Uint8Array(frames.reduce((n, f) => n + f.length, 0));
      frames.reduce((at, f) => (all.set(f, at), at + f.length), 0);
      burst.sendRaw(all);
      return done;
    };
    await send(Array.from({ length: 70 }, (_, i) => i + 1));
    expect(answers.filter((a) => a.error).map((a) => [a.id, a.error!.code])).toEqual([65, 66, 67, 68, 69, 70].map((id) => [id, "Busy"]));
    expect(answers.filter((a) => a.result).map((a) => a.id)).toEqual(Array.from({ length: 64 }, (_, i) => i + 1));
    answers.length = 0;
    wanted = 0;
    await send(Array.from({ length: 64 }, (_, i) => i + 101));
    expect(answers.filter((a) => a.result).map((a) => a.id)).toEqual(Array.from({ length: 64 }, (_, i) => i + 101));
    burst.close();
    // The other device still serves.
    expect(readAll(keep.path, 4096)).toEqual(pattern);
    expect((await client.call("hello")).version).toBe(1);
    await client.call("delete", { id: keep.id });
  }, 30_000);
});
