// Threads of blockd that die while it runs (AENV_BLOCKD_FAULT, src/blockdev/fault.ts, makes them
// die as a crash would). A device worker that dies fails its device cleanly: its pending call gets
// a named error, its users get I/O errors instead of a wait, and the other devices serve on. A
// FUSE reader thread that dies holding a request leaves the device serving, nothing lost.
import { expect, test } from "bun:test";
import { closeSync, openSync, readFileSync, writeSync } from "node:fs";
import { join } from "node:path";
import { BlockdError } from "../../src/blockdev/protocol.ts";
import { firstBadChunk } from "./patterns.ts";
import { blockdPid, fdsSettled, haveFuse, mountsAt, openFds, readAll, spawnFixture, startBlockd, until } from "./harness.ts";

const MiB = 1 << 20;

/** A blockd started with fault `fault` armed (its threads read AENV_BLOCKD_FAULT). */
const blockdWithFault = (label: string, fault: string) => startBlockd(label, { env: { AENV_BLOCKD_FAULT: fault } });

test.skipIf(!haveFuse)(
  "a device worker dies: its pending call fails with DeviceFailed, the device is failed, its reader gets an error, the other device serves on",
  async () => {
    const { dir, state, client } = await blockdWithFault("blockd-worker-death", "worker-exit:victim:stats");
    const victim = await client.call("create", { id: "victim", upperDir: join(dir, "v"), size: 4 * MiB });
    const other = await client.call("create", { id: "other", upperDir: join(dir, "o"), size: 4 * MiB });
    const writer = spawnFixture("seq_writer", [other.path, String(4 * MiB), "1"]);
    expect(await writer.exited()).toBe(0);

    // Someone has the victim open and reads from it all the time.
    const reader = spawnFixture("io_loop", [victim.path, "120"]);
    await until(() => reader.lines.some((l) => l.startsWith("ok")), "the victim to serve reads");

    // The call in flight when the worker dies is answered, with a named error.
    const err = await client.call("stats", { id: "victim" }).catch((e) => e);
    expect(err).toBeInstanceOf(BlockdError);
    expect(err.code).toBe("DeviceFailed");
    expect(err.message).toContain("victim: its worker died");

    // Its reader is told, rather than left waiting on a device nobody serves.
    expect(await reader.exited()).toBe(0);
    expect(reader.lines.at(-1)).toMatch(/^error (ENOTCONN|ECONNABORTED|EIO)$/);

    const list = await client.call("list");
    const v = list.find((d: { id: string }) => d.id === "victim");
    expect(v.state).toBe("failed");
    expect(v.reason).toContain("its worker died");
    expect(list.find((d: { id: string }) => d.id === "other").state).toBe("live");
    // Later calls fail at once with the same error; the failure is in the log.
    expect((await client.call("stats", { id: "victim" }).catch((e) => e)).code).toBe("DeviceFailed");
    expect(readFileSync(join(state, "blockd.log"), "utf8")).toContain("device victim is failed until deleted");

    // The other device serves on: its data reads back and it takes new writes.
    const back = readAll(other.path, 4 * MiB);
    expect(firstBadChunk(back, 0)).toBe(-1);
    const again = spawnFixture("seq_writer", [other.path, String(4 * MiB), "2"]);
    expect(await again.exited()).toBe(0);
    expect((await client.call("stats", { id: "other" })).writes).toBeGreaterThan(0);

    // Deleting the failed device clears its dead mount.
    expect(mountsAt(victim.path)).toHaveLength(1);
    expect(await client.call("delete", { id: "victim" })).toMatchObject({ freed: true });
    expect(mountsAt(victim.path)).toHaveLength(0);
    expect((await client.call("list")).map((d: { id: string }) => d.id)).toEqual(["other"]);
    await client.call("delete", { id: "other" });
  },
  120_000,
);

test.skipIf(!haveFuse)(
  "a FUSE reader thread dies holding a request: the request is resent, the writer finishes, every byte is there",
  async () => {
    // The reader dies right after taking its 2nd request, before handing it to the device worker.
    const { dir, state, client } = await blockdWithFault("blockd-reader-death", "reader-exit:2");
    const size = 8 * MiB;
    const dev = await client.call("create", { upperDir: join(dir, "up"), size });
    const writer = spawnFixture("seq_writer", [dev.path, String(size), "4"]);
    const code = await Promise.race([writer.exited(), Bun.sleep(90_000).then(() => "still running")]);
    if (code === "still running") writer.proc.kill(9);
    expect(code).toBe(0);
    expect(writer.lines).toEqual(["pass 0", "pass 1", "pass 2", "pass 3"]);

    const log = readFileSync(join(state, "blockd.log"), "utf8");
    expect(log).toContain("blockd fault injected: a FUSE reader, after taking request 2");
    expect(log).toMatch(/fuse reader on fd \d+: died \(exit code 70\); its requests are resent/);
    const stats = await client.call("stats", { id: dev.id });
    expect(stats.takenByReader).toBeGreaterThanOrEqual(1); // it had handed one over before it died

    const back = readAll(dev.path, size);
    expect(firstBadChunk(back, 3)).toBe(-1);
    expect((await client.call("list"))[0].state).toBe("live");
    await client.call("delete", { id: dev.id });
  },
  120_000,
);

test.skipIf(!haveFuse)(
  "a worker's fds (eventfds, I/O ring, layer files, /dev/fuse, its reader's) are closed when its thread ends: after a crash and a delete blockd holds what it held before",
  async () => {
    const { dir, state, client } = await blockdWithFault("blockd-worker-fds", "worker-exit:victim:stats");
    const pid = blockdPid(state);
    // A first device: what blockd's main thread keeps for good (its own I/O ring) is made here.
    await client.call("create", { id: "warm", upperDir: join(dir, "w"), size: 4 * MiB });
    await client.call("delete", { id: "warm" });
    const base = await fdsSettled(pid, openFds(pid));

    // A clean stop leaves nothing either (the worker's I/O ring outlived it before).
    await client.call("create", { id: "clean", upperDir: join(dir, "c"), size: 4 * MiB });
    await client.call("delete", { id: "clean" });
    expect(await fdsSettled(pid, base)).toEqual(base);

    // A crash with the reader thread running: every fd of both threads goes.
    const victim = await client.call("create", { id: "victim", upperDir: join(dir, "v"), size: 4 * MiB });
    const fd = openSync(victim.path, "r+");
    writeSync(fd, new Uint8Array(256 << 10), 0, 256 << 10, 0); // a large write starts the reader
    closeSync(fd);
    const held = openFds(pid);
    expect(held.filter((f) => f === "/dev/fuse").length - base.filter((f) => f === "/dev/fuse").length).toBe(2);
    expect(held.length).toBeGreaterThan(base.length + 5); // eventfds, ring, upper files: what must go
    expect((await client.call("stats", { id: "victim" }).catch((e) => e)).code).toBe("DeviceFailed");
    await client.call("delete", { id: "victim" });
    expect(await fdsSettled(pid, base)).toEqual(base);
  },
  120_000,
);
