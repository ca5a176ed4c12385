// The node's memory devices against a real blockd: a device taken ahead over a stack's first
// layers (a fork's, over its source's) grows into the stack's device, one device and the whole
// stack's bytes; one that does not fit the stack, or is not needed, goes back with drop; one that
// failed to open leaves the stack to open anew.
import { describe, expect, test } from "bun:test";
import { join } from "node:path";
import { MemoryDevices } from "../../src/orchestrator/memory_devices.ts";
import { haveFuse, makeLayer, readAll, startBlockd, until } from "../blockdev/harness.ts";

const MiB = 1 << 20;
const SIZE = 4 * MiB;

describe.skipIf(!haveFuse)("memory devices taken ahead", async () => {
  if (!haveFuse) return void test.skip("needs root and /dev/fuse", () => {});
  const { dir, client } = await startBlockd("memdev-ahead", { pool: 2 });
  const base = await makeLayer(join(dir, "base.layer"), SIZE, 0, new Uint8Array(2 * MiB).fill(0x11));
  const mid = await makeLayer(join(dir, "mid.layer"), SIZE, MiB, new Uint8Array(4096).fill(0x22));
  const top = await makeLayer(join(dir, "top.layer"), SIZE, 0, new Uint8Array(4096).fill(0x33));
  const acquired = async () => ((await client.call("list")) as { id: string; acquired: boolean }[]).filter((d) => d.acquired).map((d) => d.id).sort();
  const devices = new MemoryDevices(client);

  test("grown into the stack's device: the same device, the whole stack's bytes, nothing else taken", async () => {
    const ahead = devices.ahead([base, mid]);
    const early = await ahead.made;
    await devices.pin([base, mid, top], ahead);
    const dev = await devices.take([base, mid, top], "vm-1");
    expect(dev.id).toBe(early.id);
    expect(readAll(dev.path, 4096)[0]).toBe(0x33);
    expect(readAll(dev.path, 4096, MiB)[0]).toBe(0x22);
    expect(readAll(dev.path, 4096, MiB + 4096)[0]).toBe(0x11);
    devices.drop(ahead); // grown: drop leaves it alone
    await Bun.sleep(100);
    expect(await acquired()).toEqual([dev.id]);
    devices.release("vm-1");
    devices.unpin([base, mid, top]);
  }, 60_000);

  // Pool devices are recycled (a released id is acquired again), so each test starts with none acquired.
  const none = () => until(async () => (await acquired()).length === 0, "the test before gave its devices back");

  test("one that does not fit the stack (a fresh base) or meets a stack already open stays unused, and drop gives it back", async () => {
    await none();
    const before: string[] = [];
    const misfit = devices.ahead([base, mid]);
    const kept = await misfit.made;
    await devices.pin([top], misfit); // not over [base, mid]: opened anew
    const fresh = await devices.take([top], "vm-2");
    expect(fresh.id).not.toBe(kept.id);
    expect(misfit.used).toBe(false);
    await devices.pin([base, mid, top]); // open already when the next pin asks for it
    const late = devices.ahead([base]);
    await devices.pin([base, mid, top], late);
    expect(late.used).toBe(false);
    const lateId = (await late.made).id;
    devices.drop(misfit);
    devices.drop(late);
    await until(async () => !(await acquired()).some((id) => id === kept.id || id === lateId), "both given back");
    devices.unpin([base, mid, top]);
    devices.release("vm-2");
    expect((await acquired()).filter((id) => !before.includes(id))).toContain(fresh.id); // still pinned
    devices.unpin([top]);
    // Nothing maps, pins or keeps either stack warm: both devices go back.
    await until(async () => (await acquired()).filter((id) => !before.includes(id)).length === 0, "unwanted devices given back");
  }, 60_000);

  test("a device is kept only while wanted: mapped, pinned, or warm for a paused sandbox until it resumes or goes", async () => {
    await none();
    const mine = acquired;
    const dev = await devices.take([base, top], "vm-4");
    devices.release("vm-4"); // killed while running: nobody wants it
    await until(async () => !(await mine()).includes(dev.id), "a device nobody wants goes back");
    devices.warm([mid, top], "paused-1");
    await until(async () => (await mine()).length === 1, "a warm device opens");
    const warm = (await mine())[0]!;
    expect((await devices.take([mid, top], "paused-1")).id).toBe(warm); // its resume finds it open
    devices.release("paused-1");
    await until(async () => (await mine()).length === 0, "resumed, then killed: gone");
    devices.warm([mid, top], "paused-2");
    await until(async () => (await mine()).length === 1, "warm again");
    devices.forget("paused-2"); // killed while paused
    await until(async () => (await mine()).length === 0, "forgotten: gone");
  }, 60_000);

  test("one whose layers failed to open: the stack opens anew", async () => {
    const later = join(dir, "later.layer");
    const broken = devices.ahead([base, later]); // not there yet
    expect(await broken.made.then(() => "opened", (e: Error) => e.name)).toBe("ConfigError");
    await makeLayer(later, SIZE, 3 * MiB, new Uint8Array(4096).fill(0x44));
    await devices.pin([base, later, top], broken);
    const dev = await devices.take([base, later, top], "vm-3");
    expect(readAll(dev.path, 4096, 3 * MiB)[0]).toBe(0x44);
    expect(readAll(dev.path, 4096)[0]).toBe(0x33);
    devices.release("vm-3");
    devices.unpin([base, later, top]);
  }, 60_000);
});
