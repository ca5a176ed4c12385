// Prepared pool devices: `prepare` keeps devices with a stack's lowers open and a fresh upper in
// blockd's state dir; an acquire of that stack renames the upper to its upperDir and replies
// without waiting for the table write. The device serves the stack's bytes, its writes land in
// upperDir, racing acquires get distinct devices, and a blockd killed with -9 (its table written
// or not) comes back with every acquired device and no prepared leftovers.
import { describe, expect, test } from "bun:test";
import { copyFileSync, existsSync, mkdirSync, readdirSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { Image } from "../../src/storage/image.ts";
import { WRITABLE_DATA, WRITABLE_INDEX, WritableLayer } from "../../src/storage/lsmt/writable_layer.ts";
import { scratchDir } from "../helpers/tmp.ts";
import { type DeviceView, failure, haveFuse, killAndRestart, makeLayer, mountsAt, readAll, startBlockd, until, writeAt } from "./harness.ts";

const MiB = 1 << 20;
const SIZE = 8 * MiB;

type Dev = DeviceView;

/** Bytes of the stack `lowers` + the upper in upperDir, read from the files (not through blockd). */
async function readUpper(lowers: string[], upperDir: string, at: number, length: number): Promise<Uint8Array> {
  const image = await Image.open({ lowers: lowers.map((file) => ({ file })), upper: { data: join(upperDir, WRITABLE_DATA), index: join(upperDir, WRITABLE_INDEX) } });
  try {
    const b = new Uint8Array(length);
    await image.read(b, at);
    return b;
  } finally {
    await image.close();
  }
}

/** Pool devices holding the stack but not handed out: what `prepare` keeps. */
const preparedOf = (list: Dev[]) => list.filter((d) => d.kind === "pool" && !d.acquired && d.config !== null);
const preparedFolders = (state: string) => readdirSync(join(state, "prepared")).sort();

test("Image.attachUpper: a fresh upper goes on a lowers-only image (writes land in it, the lowers read as before); a used upper or a second one is refused", async () => {
  const dir = scratchDir("attach-upper");
  const base = await makeLayer(join(dir, "base.sealed"), SIZE, 0, new Uint8Array(4096).fill(0x3c));
  const image = await Image.open({ lowers: [{ file: base }] });
  const fresh = () => WritableLayer.create(join(dir, `u-${Math.random()}`), join(dir, `i-${Math.random()}`), { virtualSize: 2 * SIZE });
  const used = await fresh();
  await used.write(new Uint8Array(512).fill(1), 0);
  expect(() => image.attachUpper(used)).toThrow("only a fresh upper");
  expect(image.readOnly).toBe(true);
  const upper = await fresh();
  image.attachUpper(upper);
  expect(image.virtualSize).toBe(2 * SIZE);
  const b = new Uint8Array(4096);
  await image.read(b, 0);
  expect(b.every((x) => x === 0x3c)).toBe(true);
  await image.write(new Uint8Array(4096).fill(0x55), 4096);
  expect(upper.index.size).toBe(1);
  const second = await fresh();
  expect(() => image.attachUpper(second)).toThrow("already has a writable layer");
  for (const l of [used, second]) await l.close();
  await image.close();
});

test("Image.detachUpper: an attach undone takes the upper and the lowers it stacked off (the image reads as before); an upper written to stays", async () => {
  const dir = scratchDir("detach-upper");
  const base = await makeLayer(join(dir, "base.sealed"), SIZE, 0, new Uint8Array(4096).fill(0x3c));
  const own = await makeLayer(join(dir, "own.sealed"), SIZE, 0, new Uint8Array(4096).fill(0x11));
  const image = await Image.open({ lowers: [{ file: base }] });
  const upper = await WritableLayer.create(join(dir, "u"), join(dir, "i"), { virtualSize: SIZE });
  const read = async () => {
    const b = new Uint8Array(4096);
    await image.read(b, 0);
    return b[0];
  };
  image.attachUpper(upper, await Image.openLowers({ lowers: [{ file: own }] }, 0));
  expect(await read()).toBe(0x11);
  const off = image.detachUpper(1);
  expect(off.upper).toBe(upper);
  expect(off.above).toHaveLength(1);
  for (const l of off.above) await l.close();
  expect(image.readOnly).toBe(true);
  expect(image.lowers).toHaveLength(1);
  expect(await read()).toBe(0x3c);
  image.attachUpper(upper); // fresh still: it goes on again
  await image.write(new Uint8Array(4096).fill(0x55), 4096);
  expect(() => image.detachUpper(1)).toThrow("nothing was written to");
  await image.close();
});

describe.skipIf(!haveFuse)("prepared pool devices", async () => {
  if (!haveFuse) return void test.skip("needs root and /dev/fuse", () => {});
  const { dir, state, client } = await startBlockd("blockd-prepared", { pool: 1 });
  const base = await makeLayer(join(dir, "base.sealed"), SIZE, 0, new Uint8Array(64 << 10).fill(0x3c));
  const top = await makeLayer(join(dir, "top.sealed"), SIZE, 1 * MiB, new Uint8Array(4096).fill(0x7e));
  const lowers = [base, top];
  const list = async (): Promise<Dev[]> => client.call("list");
  const settled = async (n: number) => until(async () => preparedOf(await list()).length === n && preparedFolders(state).length === n, `${n} prepared devices`);

  test("an acquire of a prepared stack gets the stack's bytes, and its writes land in the requested upperDir", async () => {
    const ready = await client.call("prepare", { lowers, size: SIZE, count: 2 });
    expect(ready).toEqual({ lowers, size: SIZE, count: 2, ready: 2 });
    const prepared = preparedOf(await list());
    expect(prepared).toHaveLength(2);
    for (const d of prepared) expect(existsSync(join(state, "prepared", d.id, "upper", WRITABLE_DATA))).toBe(true);

    const upperDir = join(dir, "sandbox-1", "upper"); // its parent is made too, as makeUpper does
    const dev: Dev = await client.call("acquire", { lowers, upperDir, size: SIZE });
    expect(dev.prepared).toBe(true);
    expect(prepared.map((d) => d.id)).toContain(dev.id);
    expect(dev.config?.upper).toEqual({ data: join(upperDir, WRITABLE_DATA), index: join(upperDir, WRITABLE_INDEX) });
    expect((await client.call("stats", { id: dev.id })).size).toBe(SIZE);
    expect(readAll(dev.path, 64 << 10).every((b) => b === 0x3c)).toBe(true);
    expect(readAll(dev.path, 4096, 1 * MiB).every((b) => b === 0x7e)).toBe(true);
    expect(readAll(dev.path, 4096, 4 * MiB).every((b) => b === 0)).toBe(true);

    const mark = crypto.getRandomValues(new Uint8Array(8192));
    writeAt(dev.path, mark, 2 * MiB); // fsync'd: the upper's files hold it
    expect(await readUpper(lowers, upperDir, 2 * MiB, 8192)).toEqual(mark);
    expect(await readUpper(lowers, upperDir, 1 * MiB, 4096)).toEqual(new Uint8Array(4096).fill(0x7e));

    // The table names it acquired over upperDir, its prepared folder goes, and a fresh one is made.
    await until(() => {
      const rec = JSON.parse(readFileSync(join(state, "devices.json"), "utf8")).find((r: Dev) => r.id === dev.id);
      return rec?.acquired === true && rec.config?.upper?.data === join(upperDir, WRITABLE_DATA);
    }, "the acquire in the table");
    await settled(2);
    expect(preparedFolders(state)).not.toContain(dev.id);

    // Released, it holds nothing; the upper stays with its owner.
    await client.call("release", { id: dev.id });
    expect(await readUpper(lowers, upperDir, 2 * MiB, 8192)).toEqual(mark);
  }, 60_000);

  test("a stack that extends a prepared one takes a prepared device, which opens only the layers above; a stack it does not begin is not served", async () => {
    await client.call("prepare", { lowers, size: SIZE, count: 1 });
    await settled(1);
    const own = await makeLayer(join(dir, "own.sealed"), SIZE, 1 * MiB + 4096, new Uint8Array(4096).fill(0x11)); // a sandbox's sealed pause layer
    const stack = [...lowers, own];
    const upperDir = join(dir, "resumed", "upper");
    const dev: Dev = await client.call("acquire", { lowers: stack, upperDir, size: SIZE });
    expect(dev.prepared).toBe(true);
    expect(dev.config?.lowers.map((l) => l.file)).toEqual(stack);
    expect(readAll(dev.path, 4096, 1 * MiB).every((b) => b === 0x7e)).toBe(true);
    expect(readAll(dev.path, 4096, 1 * MiB + 4096).every((b) => b === 0x11)).toBe(true);
    expect(readAll(dev.path, 4096).every((b) => b === 0x3c)).toBe(true);
    const mark = crypto.getRandomValues(new Uint8Array(4096));
    writeAt(dev.path, mark, 3 * MiB);
    expect(await readUpper(stack, upperDir, 3 * MiB, 4096)).toEqual(mark);
    await until(() => JSON.parse(readFileSync(join(state, "devices.json"), "utf8")).find((r: Dev) => r.id === dev.id)?.config?.lowers?.length === 3, "the whole stack in the table");
    await settled(1);
    // Not a prefix (the order differs), or another size: a plain acquire, the prepared device stays.
    const other: Dev = await client.call("acquire", { lowers: [top, base, own], upperDir: join(dir, "other", "upper"), size: SIZE });
    expect(other.prepared).toBe(false);
    expect(preparedOf(await list())).toHaveLength(1);
    for (const d of [dev, other]) await client.call("release", { id: d.id });
    await client.call("prepare", { lowers, size: SIZE, count: 0 });
    await settled(0);
  }, 60_000);

  test("racing acquires of prepared devices each get a distinct device with its own upper", async () => {
    await client.call("prepare", { lowers, size: SIZE, count: 4 });
    await settled(4);
    const dirs = [0, 1, 2, 3, 4, 5].map((i) => join(dir, `race-${i}`));
    const got = await Promise.allSettled(dirs.map((upperDir) => client.call("acquire", { lowers, upperDir, size: SIZE })));
    expect(got.map((r) => (r.status === "fulfilled" ? "ok" : (r.reason as Error).message))).toEqual(dirs.map(() => "ok"));
    const devs = got.map((r) => (r as PromiseFulfilledResult<Dev>).value);
    expect(new Set(devs.map((d) => d.id)).size).toBe(devs.length);
    expect(devs.filter((d) => d.prepared).length).toBeGreaterThanOrEqual(4); // 4 were ready; the rest made their own
    const marks = devs.map((d, i) => {
      const m = new Uint8Array(4096).fill(0x10 + i);
      writeAt(d.path, m, 3 * MiB);
      return m;
    });
    for (const [i, d] of devs.entries()) {
      expect(readAll(d.path, 4096, 3 * MiB)).toEqual(marks[i]!);
      expect(readAll(d.path, 4096, 1 * MiB).every((b) => b === 0x7e)).toBe(true);
      expect(await readUpper(lowers, dirs[i]!, 3 * MiB, 4096)).toEqual(marks[i]!);
    }
    for (const d of devs) await client.call("release", { id: d.id });
    await settled(4);
  }, 90_000);

  test("an upperDir that is not empty, or another size, is acquired without a prepared device, which stays ready", async () => {
    await settled(4);
    const before = preparedOf(await list()).map((d) => d.id).sort();
    const busyDir = join(dir, "not-empty");
    mkdirSync(busyDir, { recursive: true });
    writeFileSync(join(busyDir, "someone-elses"), "x");
    const a: Dev = await client.call("acquire", { lowers, upperDir: busyDir, size: SIZE });
    expect(a.prepared).toBe(false);
    expect(before).not.toContain(a.id);
    expect(readFileSync(join(busyDir, "someone-elses"), "utf8")).toBe("x");
    const b: Dev = await client.call("acquire", { lowers, upperDir: join(dir, "other-size"), size: 2 * SIZE });
    expect(b.prepared).toBe(false);
    expect((await client.call("stats", { id: b.id })).size).toBe(2 * SIZE);
    expect(preparedOf(await list()).map((d) => d.id).sort()).toEqual(before);
    for (const d of [a, b]) await client.call("release", { id: d.id });
  }, 60_000);

  test("a target for a number of acquires (a fork's children): its devices are replaced until the last of them, then it ends and none stays prepared", async () => {
    await client.call("prepare", { lowers, size: SIZE, count: 0 });
    await settled(0);
    expect(await client.call("prepare", { lowers, size: SIZE, count: 2, acquires: 3 })).toMatchObject({ count: 2, ready: 2 });
    const devs: Dev[] = [];
    for (let i = 0; i < 3; i++) {
      devs.push(await client.call("acquire", { lowers, upperDir: join(dir, `child-${i}`), size: SIZE }));
      await settled(Math.min(2, 2 - i)); // 2 ready while 2 acquires are to come; then 1; then none
    }
    expect(devs.map((d) => d.prepared)).toEqual([true, true, true]);
    // Nothing refills it afterwards: a fourth acquire is a plain one.
    const fourth: Dev = await client.call("acquire", { lowers, upperDir: join(dir, "child-3"), size: SIZE });
    expect(fourth.prepared).toBe(false);
    await Bun.sleep(200);
    expect(preparedOf(await list())).toEqual([]);
    for (const d of [...devs, fourth]) await client.call("release", { id: d.id });
    for (const acquires of [1, 1025, 2.5]) expect((await failure(client.call("prepare", { lowers, size: SIZE, count: 2, acquires })))?.name).toBe("BadRequest");
  }, 60_000);

  test("an acquire over a prepared stack that does not go on (its upperDir not empty) closes the layers it opened above and leaves the device prepared, its above.json blank", async () => {
    await client.call("prepare", { lowers, size: SIZE, count: 1 });
    await settled(1);
    const [ready] = preparedOf(await list());
    const own = await makeLayer(join(dir, "own-2.sealed"), SIZE, 1 * MiB + 4096, new Uint8Array(4096).fill(0x22));
    const busyDir = join(dir, "not-empty-2");
    mkdirSync(busyDir, { recursive: true });
    writeFileSync(join(busyDir, "someone-elses"), "x");
    const a: Dev = await client.call("acquire", { lowers: [...lowers, own], upperDir: busyDir, size: SIZE });
    expect(a.prepared).toBe(false);
    expect(preparedOf(await list()).map((d) => d.id)).toEqual([ready!.id]);
    expect(readFileSync(join(state, "prepared", ready!.id, "above.json"), "utf8").trim()).toBe("");
    // It serves the next acquire of the same stack, from a fresh upperDir.
    const b: Dev = await client.call("acquire", { lowers: [...lowers, own], upperDir: join(dir, "resumed-2"), size: SIZE });
    expect(b).toMatchObject({ id: ready!.id, prepared: true });
    expect(readAll(b.path, 4096, 1 * MiB + 4096).every((x) => x === 0x22)).toBe(true);
    for (const d of [a, b]) await client.call("release", { id: d.id });
    await client.call("prepare", { lowers, size: SIZE, count: 4 });
    await settled(4);
  }, 60_000);

  test("prepare refuses bad input and leaves the prepared devices as they were; count 0 retires them, folders and mounts", async () => {
    await settled(4);
    const before = preparedOf(await list()).map((d) => d.id).sort();
    for (const params of [
      { lowers, size: SIZE, count: 17 },
      { lowers, size: SIZE, count: -1 },
      { lowers, size: SIZE, count: 1.5 },
      { lowers, size: SIZE },
      { lowers, size: 1000, count: 1 },
      { lowers: [], size: SIZE, count: 1 },
      { lowers: "base", size: SIZE, count: 1 },
    ])
      expect((await failure(client.call("prepare", params)))?.name).toBe("BadRequest");
    expect((await failure(client.call("prepare", { lowers: [join(dir, "missing.sealed")], size: SIZE, count: 1 })))?.name).toBe("ConfigError");
    // A stack whose layer is no layer: the refill fails, prepare says why and keeps nothing of it.
    const garbage = join(dir, "garbage.sealed");
    writeFileSync(garbage, crypto.getRandomValues(new Uint8Array(64 << 10)));
    expect((await failure(client.call("prepare", { lowers: [garbage], size: SIZE, count: 2 })))?.name).toBe("FormatError");
    expect(preparedOf(await list()).map((d) => d.id).sort()).toEqual(before);
    expect(preparedFolders(state)).toEqual(before);

    expect(await client.call("prepare", { lowers, size: SIZE, count: 0 })).toMatchObject({ count: 0, ready: 0 });
    expect(preparedOf(await list())).toEqual([]);
    expect(preparedFolders(state)).toEqual([]);
    for (const id of before) expect(mountsAt(join(state, "dev", id))).toEqual([]);
  }, 60_000);

  test("count 0 retires a stack whose layer files are gone (its checkpoint removed first); a stack never prepared is nothing to retire", async () => {
    const gone = join(dir, "gone.sealed");
    copyFileSync(top, gone);
    const stack = [base, gone];
    await client.call("prepare", { lowers: stack, size: SIZE, count: 1 });
    await settled(1);
    rmSync(gone);
    expect(await client.call("prepare", { lowers: stack, size: SIZE, count: 0 })).toMatchObject({ lowers: stack, count: 0, ready: 0 });
    await settled(0);
    expect(await client.call("prepare", { lowers: [join(dir, "never.sealed")], size: SIZE, count: 0 })).toMatchObject({ count: 0, ready: 0 });
    expect((await failure(client.call("prepare", { lowers: [], size: SIZE, count: 0 })))?.name).toBe("BadRequest");
  }, 60_000);
});

describe.skipIf(!haveFuse)("prepared devices across kill -9", () => {
  for (const [tableWritten, extended] of [[true, false], [false, false], [false, true]] as const)
    test(
      tableWritten
        ? "acquired, table written: it comes back acquired with its data; prepared ones come back idle; no prepared folder is left"
        : extended
          ? "acquired over a stack that extends the prepared one, table not yet written: it comes back with the whole stack"
          : "acquired, table not yet written: the rename is the commit, so it comes back acquired over its upperDir with its data",
      async () => {
        const label = tableWritten ? "blockd-prep-crash" : extended ? "blockd-prep-crash-ext" : "blockd-prep-crash-nt";
        const { dir, state, client } = await startBlockd(label, { pool: 1 });
        const prepared = await makeLayer(join(dir, "base.sealed"), SIZE, 0, new Uint8Array(64 << 10).fill(0x3c));
        const stack = extended ? [prepared, await makeLayer(join(dir, "own.sealed"), SIZE, 7 * MiB, new Uint8Array(4096).fill(0x22))] : [prepared];
        const base = stack.at(-1)!;
        await client.call("prepare", { lowers: [prepared], size: SIZE, count: 3 });
        const tmp = join(state, "devices.json.tmp");
        if (!tableWritten) mkdirSync(join(tmp, "in-the-way"), { recursive: true }); // every table write fails from here
        const upperDir = join(dir, "vm", "upper");
        const dev: Dev = await client.call("acquire", { lowers: stack, upperDir, size: SIZE });
        expect(dev.prepared).toBe(true);
        const mark = crypto.getRandomValues(new Uint8Array(16384));
        writeAt(dev.path, mark, 5 * MiB);
        const onDisk = () => JSON.parse(readFileSync(join(state, "devices.json"), "utf8")).find((r: Dev) => r.id === dev.id);
        if (tableWritten) await until(() => onDisk()?.acquired === true, "the acquire in the table");
        else {
          await until(() => readFileSync(join(state, "blockd.log"), "utf8").includes(`recording the acquire of ${dev.id}`), "the failed table write");
          expect(onDisk()).toMatchObject({ kind: "pool", config: { lowers: [{ file: prepared }] } }); // the table still says prepared
          expect(onDisk().acquired).toBeFalsy();
          expect(existsSync(join(state, "prepared", dev.id, "acquired"))).toBe(true);
        }
        mkdirSync(join(state, "prepared", "pool-999", "upper"), { recursive: true }); // an orphan, as a crash mid-prepare leaves
        writeFileSync(join(state, "prepared", "pool-999", "upper", WRITABLE_DATA), "x");

        const again = await killAndRestart(state, client, () => rmSync(tmp, { recursive: true, force: true }));
        const back: Dev[] = await again.call("list");
        const it = back.find((d) => d.id === dev.id)!;
        expect(it).toMatchObject({ id: dev.id, path: dev.path, acquired: true, readOnly: false });
        expect(it.config?.upper).toEqual({ data: join(upperDir, WRITABLE_DATA), index: join(upperDir, WRITABLE_INDEX) });
        expect(readAll(dev.path, 16384, 5 * MiB)).toEqual(mark);
        expect(readAll(dev.path, 4096).every((b) => b === 0x3c)).toBe(true);
        expect(it.config?.lowers.map((l) => l.file)).toEqual(stack);
        if (extended) expect(readAll(dev.path, 4096, 7 * MiB).every((b) => b === 0x22)).toBe(true);
        // It still takes writes, into the same upper.
        const more = crypto.getRandomValues(new Uint8Array(4096));
        writeAt(dev.path, more, 6 * MiB);
        expect(await readUpper(stack, upperDir, 6 * MiB, 4096)).toEqual(more);
        // No prepared device survives a restart (prepare is asked again), none of their folders, no orphan.
        expect(preparedOf(back)).toEqual([]);
        expect(preparedFolders(state)).toEqual([]);
        const table: Dev[] = JSON.parse(readFileSync(join(state, "devices.json"), "utf8"));
        expect(table.map((r) => r.id).sort()).toEqual(back.map((d) => d.id).sort());
        expect(table.find((r) => r.id === dev.id)).toMatchObject({ acquired: true, config: { upper: { data: join(upperDir, WRITABLE_DATA) } } });
        expect(preparedOf(table)).toEqual([]);
        await again.call("release", { id: dev.id });
        again.close();
      },
      90_000,
    );
});

describe.skipIf(!haveFuse)("plain pool acquires across kill -9", () => {
  for (const readOnly of [true, false])
    test(
      `a ${readOnly ? "read-only" : "writable"} acquire from the pool (no prepared device), table not yet written: its crumb is the commit, so it comes back acquired with its image${readOnly ? "" : " and its data"}; an unreadable crumb comes back failed`,
      async () => {
        const { dir, state, client } = await startBlockd(readOnly ? "blockd-pool-crash-ro" : "blockd-pool-crash-rw", { pool: 2 });
        const base = await makeLayer(join(dir, "base.sealed"), SIZE, 0, new Uint8Array(64 << 10).fill(0x5a));
        const tmp = join(state, "devices.json.tmp");
        mkdirSync(join(tmp, "in-the-way"), { recursive: true }); // every table write fails from here
        const upperDir = join(dir, "vm", "upper");
        const dev: Dev = await client.call("acquire", readOnly ? { lowers: [base] } : { lowers: [base], upperDir, size: SIZE });
        expect(dev.prepared).toBe(false);
        const mark = crypto.getRandomValues(new Uint8Array(8192));
        if (!readOnly) writeAt(dev.path, mark, 3 * MiB);
        // A second one whose crumb is then damaged, as a torn write would leave it.
        const torn: Dev = await client.call("acquire", { lowers: [base] });
        await until(() => readFileSync(join(state, "blockd.log"), "utf8").includes(`recording the acquire of ${torn.id}`), "the failed table writes");
        const onDisk = (id: string) => JSON.parse(readFileSync(join(state, "devices.json"), "utf8")).find((r: Dev) => r.id === id);
        expect(onDisk(dev.id)?.acquired).toBeFalsy(); // the table still says idle
        expect(existsSync(join(state, "prepared", dev.id, "acquired.json"))).toBe(true);
        writeFileSync(join(state, "prepared", torn.id, "acquired.json"), '{"config": {"lowers": [');

        const again = await killAndRestart(state, client, () => rmSync(tmp, { recursive: true, force: true }));
        const back: Dev[] = await again.call("list");
        const it = back.find((d) => d.id === dev.id)!;
        expect(it).toMatchObject({ id: dev.id, path: dev.path, acquired: true, readOnly });
        expect(it.config?.lowers.map((l) => l.file)).toEqual([base]);
        expect(readAll(dev.path, 4096).every((b) => b === 0x5a)).toBe(true);
        if (!readOnly) {
          expect(it.config?.upper).toEqual({ data: join(upperDir, WRITABLE_DATA), index: join(upperDir, WRITABLE_INDEX) });
          expect(readAll(dev.path, 8192, 3 * MiB)).toEqual(mark);
          expect(await readUpper([base], upperDir, 3 * MiB, 8192)).toEqual(mark);
        }
        const bad = (await again.call<(Dev & { state?: string; reason?: string })[]>("list")).find((d) => d.id === torn.id)!;
        expect(bad.acquired).toBe(true); // never handed out again as idle: a VM may be reading it
        expect(bad.state).toBe("lost");
        expect(bad.reason).toContain("acquired.json");
        expect(preparedFolders(state)).toEqual([]);
        const table: Dev[] = JSON.parse(readFileSync(join(state, "devices.json"), "utf8"));
        expect(table.find((r) => r.id === dev.id)).toMatchObject({ acquired: true, readOnly });
        await again.call("release", { id: dev.id });
        again.close();
      },
      90_000,
    );
});
