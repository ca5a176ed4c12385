// An acquire `onto` a read-only device its caller gives up: the device's worker opens only the
// layers above the ones it holds and the device serves the longer stack under the same id (a
// fork's memory device, opened over its source's layers while the VMM writes the new one). Bad
// `onto`s are refused and leave the device as it was; two acquires onto one device get one
// device each way (one grows it, the other is told Busy or BadRequest); a blockd killed with -9
// before its table names the longer stack brings it back from the acquire's crumb.
import { describe, expect, test } from "bun:test";
import { mkdirSync, readFileSync, rmSync } from "node:fs";
import { join } from "node:path";
import { type DeviceView, failure, haveFuse, killAndRestart, makeLayer, readAll, startBlockd, until } from "./harness.ts";

const MiB = 1 << 20;
const SIZE = 8 * MiB;

type Dev = DeviceView;

const filled = (b: Uint8Array, x: number) => b.every((v) => v === x);

describe.skipIf(!haveFuse)("acquire onto a read-only device", async () => {
  if (!haveFuse) return void test.skip("needs root and /dev/fuse", () => {});
  const { dir, state, client } = await startBlockd("blockd-onto", { pool: 2 });
  // base: 0x11 at 0 and 1 MiB; mid: 0x22 at 1 MiB; top: 0x33 at 0 and 2 MiB.
  const base = await makeLayer(join(dir, "base.layer"), SIZE, 0, new Uint8Array(2 * MiB).fill(0x11));
  const mid = await makeLayer(join(dir, "mid.layer"), SIZE, MiB, new Uint8Array(4096).fill(0x22));
  const top = join(dir, "top.layer");
  await makeLayer(join(dir, "top-at-0.layer"), SIZE, 0, new Uint8Array(4096).fill(0x33));
  await makeLayer(top, SIZE, 2 * MiB, new Uint8Array(4096).fill(0x33));
  const topAt0 = join(dir, "top-at-0.layer");
  const pool = async () => ((await client.call("list")) as Dev[]).filter((d) => d.kind === "pool");

  test("the device serves the longer stack under its id, its table entry names it, and no other device is taken", async () => {
    const d: Dev = await client.call("acquire", { lowers: [base, mid] });
    // Read (so cached) where the longer stack differs: a stale page would show below.
    expect(filled(readAll(d.path, 4096, 0), 0x11)).toBe(true);
    expect(filled(readAll(d.path, 4096, MiB), 0x22)).toBe(true);
    expect(filled(readAll(d.path, 4096, 2 * MiB), 0)).toBe(true);
    const taken = (await pool()).filter((x) => x.acquired).length;
    const grown: Dev = await client.call("acquire", { lowers: [base, mid, topAt0, top], onto: d.id });
    expect(grown).toMatchObject({ id: d.id, path: d.path, acquired: true, readOnly: true });
    expect(grown.config?.lowers.map((l) => l.file)).toEqual([base, mid, topAt0, top]);
    // The page cache of the shorter stack is gone.
    expect(filled(readAll(d.path, 4096, 0), 0x33)).toBe(true);
    expect(filled(readAll(d.path, 4096, MiB), 0x22)).toBe(true);
    expect(filled(readAll(d.path, 4096, 2 * MiB), 0x33)).toBe(true);
    expect(filled(readAll(d.path, 4096, MiB + 4096), 0x11)).toBe(true);
    expect((await pool()).filter((x) => x.acquired).length).toBe(taken);
    const onDisk = () => (JSON.parse(readFileSync(join(state, "devices.json"), "utf8")) as Dev[]).find((r) => r.id === d.id);
    await until(() => onDisk()?.config?.lowers.length === 4, "the longer stack in the table");
    await client.call("release", { id: d.id });
  }, 60_000);

  test("a bad onto is refused and the device serves its stack as before", async () => {
    const d: Dev = await client.call("acquire", { lowers: [base, mid] });
    const idle = (await pool()).find((x) => !x.acquired)!;
    const rw: Dev = await client.call("acquire", { lowers: [base], upperDir: join(dir, "rw-up"), size: SIZE });
    const cases: [Record<string, unknown>, string][] = [
      [{ lowers: [base, mid, top], onto: 7 }, "BadRequest"],
      [{ lowers: [base, mid, top], onto: "pool-999" }, "NotFound"],
      [{ lowers: [base, mid, top], onto: idle.id }, "BadRequest"], // not acquired
      [{ lowers: [base, top], upperDir: join(dir, "x"), size: SIZE, onto: rw.id }, "BadRequest"], // writable
      [{ lowers: [base, top], onto: rw.id }, "BadRequest"],
      [{ lowers: [mid, base, top], onto: d.id }, "BadRequest"], // not its lowers first
      [{ lowers: [base, mid], onto: d.id }, "BadRequest"], // nothing above them
      [{ lowers: [base], onto: d.id }, "BadRequest"],
      [{ lowers: [base, mid, join(dir, "missing.layer")], onto: d.id }, "ConfigError"],
    ];
    for (const [params, code] of cases) expect([JSON.stringify(params), (await failure(client.call("acquire", params)))?.name]).toEqual([JSON.stringify(params), code]);
    const still = ((await client.call("list")) as Dev[]).find((x) => x.id === d.id)!;
    expect(still.config?.lowers.map((l) => l.file)).toEqual([base, mid]);
    expect(filled(readAll(d.path, 4096, 0), 0x11)).toBe(true);
    expect(filled(readAll(d.path, 4096, MiB), 0x22)).toBe(true);
    // It still grows afterwards.
    expect((await client.call("acquire", { lowers: [base, mid, top], onto: d.id })).config.lowers).toHaveLength(3);
    for (const id of [d.id, rw.id]) await client.call("release", { id });
  }, 60_000);

  test("two acquires racing onto one device: one grows it, the other is refused, and the device serves the winner's stack", async () => {
    const d: Dev = await client.call("acquire", { lowers: [base] });
    const stacks = [[base, mid], [base, topAt0]];
    const got = await Promise.allSettled(stacks.map((lowers) => client.call<Dev>("acquire", { lowers, onto: d.id })));
    const won = got.flatMap((r, i) => (r.status === "fulfilled" ? [i] : []));
    expect(won).toHaveLength(1);
    const lost = got.find((r) => r.status === "rejected") as PromiseRejectedResult;
    expect(["Busy", "BadRequest"]).toContain((lost.reason as Error).name);
    const winner = stacks[won[0]!]!;
    expect(((await client.call("list")) as Dev[]).find((x) => x.id === d.id)!.config?.lowers.map((l) => l.file)).toEqual(winner);
    if (winner[1] === mid) expect(filled(readAll(d.path, 4096, MiB), 0x22)).toBe(true);
    else expect(filled(readAll(d.path, 4096, 0), 0x33)).toBe(true);
    await client.call("release", { id: d.id });
  }, 60_000);

  test("killed with -9 before the table names the longer stack: it comes back acquired with it, from the crumb", async () => {
    const d: Dev = await client.call("acquire", { lowers: [base, mid] });
    const onDisk = () => (JSON.parse(readFileSync(join(state, "devices.json"), "utf8")) as Dev[]).find((r) => r.id === d.id);
    await until(() => onDisk()?.acquired === true, "the first acquire in the table");
    const tmp = join(state, "devices.json.tmp");
    mkdirSync(join(tmp, "in-the-way"), { recursive: true }); // every table write fails from here
    await client.call("acquire", { lowers: [base, mid, top], onto: d.id });
    await until(() => readFileSync(join(state, "blockd.log"), "utf8").includes(`recording the acquire of ${d.id}`), "the failed table write");
    expect(onDisk()?.config?.lowers.map((l) => l.file)).toEqual([base, mid]); // the table still says the shorter stack
    const again = await killAndRestart(state, client, () => rmSync(tmp, { recursive: true, force: true }));
    const it = ((await again.call("list")) as Dev[]).find((x) => x.id === d.id)!;
    expect(it).toMatchObject({ acquired: true, readOnly: true });
    expect(it.config?.lowers.map((l) => l.file)).toEqual([base, mid, top]);
    expect(filled(readAll(d.path, 4096, 2 * MiB), 0x33)).toBe(true);
    expect(filled(readAll(d.path, 4096, MiB), 0x22)).toBe(true);
    await again.call("release", { id: d.id });
    again.close();
  }, 90_000);
});
