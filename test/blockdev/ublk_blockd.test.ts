// blockd on its ublk frontend: a device is /dev/ublkbN, served by the device's worker thread.
// Killed with -9, blockd comes back through ublk user recovery (START/END_USER_RECOVERY, I/O
// "reissue"d): the same device node, and a reader that held it open across the restart carries
// on without an error. Needs ublk_drv and root; here (no ublk_drv) it is skipped.
import { expect, test } from "bun:test";
import { existsSync } from "node:fs";
import { join } from "node:path";
import { BlockdClient } from "../../src/blockdev/client.ts";
import { firstBadChunk } from "./patterns.ts";
import { blockdPid, processGone, readAll, spawnFixture, startBlockd, until } from "./harness.ts";

const ublkReason = !existsSync("/dev/ublk-control")
  ? "/dev/ublk-control does not exist (kernel without ublk_drv / CONFIG_BLK_DEV_UBLK)"
  : process.getuid?.() !== 0
    ? "not root (ADD_DEV needs CAP_SYS_ADMIN)"
    : "";

test.skipIf(ublkReason !== "")(
  `blockd on ublk: a device at /dev/ublkbN survives kill -9 through user recovery, its open reader included${ublkReason ? ` (skipped: ${ublkReason})` : ""}`,
  async () => {
    const size = 8 << 20;
    const { dir, state, client } = await startBlockd("blockd-ublk");
    expect((await client.call("hello")).frontend).toBe("ublk");
    const dev = await client.call("create", { upperDir: join(dir, "up"), size });
    expect(dev.path).toMatch(/^\/dev\/ublkb\d+$/);
    expect(dev).toMatchObject({ loop: null, size, state: "live" });
    const w = spawnFixture("seq_writer", [dev.path, String(size), "1"]);
    expect(await w.exited()).toBe(0);
    expect(firstBadChunk(readAll(dev.path, size), 0)).toBe(-1);

    const reader = spawnFixture("io_loop", [dev.path, "120"]);
    await until(() => reader.lines.length > 0, "the ublk device to serve reads");
    const pid = blockdPid(state);
    process.kill(pid, "SIGKILL");
    client.close();
    await until(() => processGone(pid), "the killed blockd to be gone");

    const again = await BlockdClient.ensure(state, { startTimeoutMs: 60_000 });
    const [back] = await again.call("list");
    expect(back).toMatchObject({ id: dev.id, path: dev.path, state: "live" }); // recovered, not added anew
    const n = reader.lines.length;
    await until(() => reader.lines.length > n + 2, "the reader to go on across the restart");
    reader.proc.kill(9);
    await reader.exited();
    expect(reader.lines.filter((l) => !l.startsWith("ok"))).toEqual([]);

    // The recovered worker serves writes too, and everything reads back.
    const w2 = spawnFixture("seq_writer", [dev.path, String(size), "2"]);
    expect(await w2.exited()).toBe(0);
    expect(firstBadChunk(readAll(dev.path, size), 1)).toBe(-1);
    expect((await again.call("stats", { id: dev.id })).size).toBe(size);

    await again.call("delete", { id: dev.id });
    await until(() => !existsSync(dev.path), `${dev.path} to go away`);
    expect(await again.call("list")).toEqual([]);
    again.close();
  },
  180_000,
);
