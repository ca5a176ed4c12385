// blockd's start on a bad device table (devices.json): each bad entry is named and left out, the
// good devices come back, the file as it was is set aside, and what the bad entries had (a
// connection in the fd keeper, a mount) is ended.
import { expect, test } from "bun:test";
import { existsSync, readdirSync, readFileSync, watch, writeFileSync } from "node:fs";
import { join } from "node:path";
import { BlockdClient } from "../../src/blockdev/client.ts";
import { checkDeviceTable, fuseDevicePath } from "../../src/blockdev/device_table.ts";
import { KeeperClient } from "../../src/blockdev/keeper_client.ts";
import { firstBadChunk } from "./patterns.ts";
import { blockdPid, haveFuse, makeLayer, mountsAt, processGone, readAll, spawnFixture, startBlockd, until } from "./harness.ts";

const MiB = 1 << 20;
const STATE = "/var/lib/aenv/blockd";
const enc = (v: unknown) => new TextEncoder().encode(typeof v === "string" ? v : JSON.stringify(v));
const good = (id: string) => ({
  id,
  kind: "rw",
  path: fuseDevicePath(STATE, id),
  config: { lowers: [], upper: { data: `/u/${id}/writable_data`, index: `/u/${id}/writable_index` } },
  readOnly: false,
  refs: 1,
  frontend: "fuse",
  size: 4 * MiB,
});

test("a whole table that is not one: no records, one line saying why", () => {
  for (const [bytes, why] of [
    [enc("{not json"), "is not JSON"],
    [enc({ id: "a" }), "is not a list of devices (it is object)"],
    [enc("null"), "is not a list of devices (it is null)"],
    [new Uint8Array([0x5b, 0xff, 0x5d]), "is not JSON"], // not UTF-8
  ] as const) {
    const r = checkDeviceTable(bytes, STATE);
    expect(r.records).toEqual([]);
    expect(r.problems).toHaveLength(1);
    expect(r.problems[0]).toContain(why);
  }
});

test("each bad entry is named by place and id, with its reason; the good ones are kept", () => {
  const entries = [
    good("a"),
    { ...good("b"), path: "/etc/passwd" }, // never mount over, or unmount, what blockd did not make
    { ...good("c"), kind: "disk" },
    "a string",
    { ...good("d"), loop: "/dev/sda" },
    { ...good("e"), config: { lowers: "x" } },
    { ...good("f"), refs: -1 },
    good("a"),
    { ...good("g"), id: "../../etc" },
    { ...good("h"), frontend: "ublk", ublkId: 3, path: "/dev/sda" },
    { ...good("i"), state: "weird" },
    { ...good("j"), size: 1000 },
    { ...good("k"), config: null },
    good("z"),
  ];
  const r = checkDeviceTable(enc(entries), STATE);
  expect(r.records.map((x) => x.id)).toEqual(["a", "z"]);
  expect(r.problems).toEqual([
    `devices.json entry 1 (id "b"): "path" must be ${STATE}/dev/b`,
    `devices.json entry 2 (id "c"): "kind" must be one of rw, ro, pool`,
    `devices.json entry 3: not an object`,
    `devices.json entry 4 (id "d"): "loop" must be /dev/loopN`,
    `devices.json entry 5 (id "e"): "config": image config: "lowers" must be an array`,
    `devices.json entry 6 (id "f"): "refs" must be a count`,
    `devices.json entry 7 (id "a"): the id appears twice`,
    `devices.json entry 8 (id "../../etc"): "id" must match /^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$/`,
    `devices.json entry 9 (id "h"): "path" must be /dev/ublkb3 for ublk device 3`,
    `devices.json entry 10 (id "i"): "state" must be lost or failed`,
    `devices.json entry 11 (id "j"): "size" must be a positive multiple of 512`,
    `devices.json entry 12 (id "k"): a rw device needs a "config"`,
  ]);
});

/** Kill blockd -9 (its keeper stays, holding the connections), let `edit` change the table, start again. */
async function restartWithTable(state: string, edit: (table: any[]) => unknown): Promise<BlockdClient> {
  const pid = blockdPid(state);
  process.kill(pid, "SIGKILL");
  await until(() => processGone(pid), "the killed blockd to be gone");
  const table = JSON.parse(readFileSync(join(state, "devices.json"), "utf8"));
  const next = edit(table);
  writeFileSync(join(state, "devices.json"), typeof next === "string" ? next : JSON.stringify(next));
  return BlockdClient.ensure(state);
}

const setAside = (state: string) => readdirSync(state).filter((n) => n.startsWith("devices.json.bad-"));

test.skipIf(!haveFuse)(
  "an unparseable table: blockd starts with no devices, sets the file aside, ends the connections the keeper held",
  async () => {
    const { dir, state, client } = await startBlockd("blockd-table-garbage");
    const dev = await client.call("create", { upperDir: join(dir, "up"), size: 4 * MiB });
    client.close();
    const again = await restartWithTable(state, () => "[{ torn write");
    expect(await again.call("list")).toEqual([]);
    const aside = setAside(state);
    expect(aside).toHaveLength(1);
    expect(readFileSync(join(state, aside[0]!), "utf8")).toBe("[{ torn write");
    expect(JSON.parse(readFileSync(join(state, "devices.json"), "utf8"))).toEqual([]);
    const log = readFileSync(join(state, "blockd.log"), "utf8");
    expect(log).toContain("devices.json is not JSON");
    expect(log).toContain(`the fd keeper held a connection for "${dev.id}"`);
    // Nothing of the device it no longer knows is left: no mount, no connection in the keeper.
    expect(mountsAt(dev.path)).toHaveLength(0);
    const keeper = await KeeperClient.ensure(state);
    expect(await keeper.keys()).toEqual([]);
    keeper.close();
    // And it serves: a new device works.
    const fresh = await again.call("create", { upperDir: join(dir, "up2"), size: 4 * MiB });
    expect(fresh.state).toBe("live");
    await again.call("delete", { id: fresh.id });
    again.close();
  },
  60_000,
);

test.skipIf(!haveFuse)(
  "one bad entry: it is named and left out, the other device comes back with its open file, the file is set aside",
  async () => {
    const { dir, state, client } = await startBlockd("blockd-table-entry");
    const a = await client.call("create", { id: "a", upperDir: join(dir, "a"), size: 4 * MiB });
    const b = await client.call("create", { id: "b", upperDir: join(dir, "b"), size: 4 * MiB });
    const w = spawnFixture("seq_writer", [a.path, String(4 * MiB), "1"]);
    expect(await w.exited()).toBe(0);
    const reader = spawnFixture("io_loop", [a.path, "120"]); // holds a open across the restart
    await until(() => reader.lines.length > 0, "a to serve reads");
    client.close();
    let before = "";
    const again = await restartWithTable(state, (t) => {
      before = JSON.stringify(t);
      t[1].path = "/etc/passwd";
      return t;
    });
    const list = await again.call("list");
    expect(list.map((d: { id: string; state: string }) => [d.id, d.state])).toEqual([["a", "live"]]);
    const log = readFileSync(join(state, "blockd.log"), "utf8");
    expect(log).toContain(`blockd: devices.json entry 1 (id "b"): "path" must be ${b.path}; left out`);
    const aside = setAside(state);
    expect(aside).toHaveLength(1);
    expect(JSON.parse(readFileSync(join(state, aside[0]!), "utf8"))[1].path).toBe("/etc/passwd");
    expect(JSON.parse(readFileSync(join(state, "devices.json"), "utf8")).map((r: { id: string }) => r.id)).toEqual(["a"]);
    expect(JSON.parse(before)[1].path).toBe(b.path);
    expect(mountsAt(b.path)).toHaveLength(0);
    expect(existsSync("/etc/passwd")).toBe(true);

    // a kept serving its open file through the restart, and its data is all there.
    const n = reader.lines.length;
    await until(() => reader.lines.length > n + 2, "a's reader to go on reading");
    reader.proc.kill(9);
    expect(reader.lines.filter((l) => !l.startsWith("ok"))).toEqual([]);
    const back = readAll(a.path, 4 * MiB);
    expect(firstBadChunk(back, 0)).toBe(-1);
    await again.call("delete", { id: "a" });
    again.close();
  },
  60_000,
);

test.skipIf(!haveFuse)(
  "a burst of concurrent table changes: a few coalesced writes off the event loop, the file always a whole table; after kill -9 the restart has what the replies said",
  async () => {
    const { dir, state, client } = await startBlockd("blockd-table-burst");
    const layer = await makeLayer(join(dir, "base.layer"), 4 * MiB, 0, new Uint8Array(4096).fill(7));
    await client.call("create", { id: "rw", upperDir: join(dir, "up"), size: 4 * MiB });
    const table = join(state, "devices.json");
    let writes = 0; // renames onto devices.json: one per table write
    const watcher = watch(state, (ev, name) => {
      if (ev === "rename" && name === "devices.json") writes++;
    });
    // Someone reads the table all along: every read is a whole, valid table.
    let reading = true;
    let reads = 0;
    const bad: string[] = [];
    const readLoop = (async () => {
      while (reading) {
        bad.push(...checkDeviceTable(readFileSync(table), state).problems);
        reads++;
        await Bun.sleep(1);
      }
    })();

    const N = 48;
    const D = 16;
    const made = await Promise.all(Array.from({ length: N }, () => client.call("createReadOnly", { lowers: [layer] })));
    const id = made[0].id;
    expect(new Set(made.map((d) => d.id))).toEqual(new Set([id]));
    expect(made.map((d) => d.refs).sort((a, b) => a - b)).toEqual(Array.from({ length: N }, (_, i) => i + 1)); // each its own count
    const dropped = await Promise.all(Array.from({ length: D }, () => client.call("delete", { id })));
    expect(dropped.map((r) => r.refs).sort((a, b) => a - b)).toEqual(Array.from({ length: D }, (_, i) => N - D + i));
    reading = false;
    await readLoop;
    watcher.close();
    expect(reads).toBeGreaterThan(0);
    expect(bad).toEqual([]);
    // N + D changes (and the device made) cost a handful of writes, not one each.
    expect(writes).toBeGreaterThan(0);
    expect(writes).toBeLessThanOrEqual((N + D) / 4);

    // Every reply came after its change was on disk: a kill -9 now loses none of them.
    const pid = blockdPid(state);
    process.kill(pid, "SIGKILL");
    client.close();
    await until(() => processGone(pid), "the killed blockd to be gone");
    const onDisk = checkDeviceTable(readFileSync(table), state);
    expect(onDisk.problems).toEqual([]);
    expect(onDisk.records.map((r) => [r.id, r.refs])).toEqual([
      ["rw", 1],
      [id, N - D],
    ]);
    const again = await BlockdClient.ensure(state);
    const list = await again.call("list");
    expect(list.map((d: { id: string; refs: number; state: string }) => [d.id, d.refs, d.state])).toEqual([
      ["rw", 1, "live"],
      [id, N - D, "live"],
    ]);
    again.close();
  },
  120_000,
);
