// The node's volumes on a real blockd (test/blockdev/harness.ts) and e2fsprogs: the store's records,
// its single-writer rule between sandboxes (attach/detach) and the content calls, the journal a
// guest leaves replayed before the host's next call, the layer stack's bound, and a restart's
// recovery of a device the last process left open. The content API through the e2b SDK against a
// whole node is test/node/volumes.test.ts.
import { Database } from "bun:sqlite";
import { afterAll, describe, expect, test } from "bun:test";
import { readdirSync } from "node:fs";
import { join } from "node:path";
import { haveFuse, startBlockd } from "../blockdev/harness.ts";
import { scratchDir } from "../helpers/tmp.ts";
import { OrchestratorError } from "../../src/orchestrator/errors.ts";
import { VolumeStore, type VolumeStoreOptions } from "../../src/orchestrator/volumes.ts";
import { volumeLayers } from "../../src/node/volume_layers.ts";

const haveTools = ["debugfs", "e2fsck", "mkfs.ext4", "dumpe2fs"].every((t) => Bun.which(t, { PATH: `${process.env.PATH}:/usr/sbin:/sbin` }));
const why = haveFuse && haveTools ? undefined : "needs root, /dev/fuse and e2fsprogs (debugfs, e2fsck, mkfs.ext4, dumpe2fs)";
const named = (name: string) => (why ? `${name} (skipped: ${why})` : name);

const SIZE_MB = 64;

async function sh(argv: string[], stdin?: string): Promise<string> {
  const p = Bun.spawn(argv, { stdin: stdin === undefined ? "ignore" : Buffer.from(stdin), stdout: "pipe", stderr: "pipe", env: { ...process.env, PATH: `${process.env.PATH}:/usr/sbin:/sbin` } });
  const [out, err, code] = await Promise.all([new Response(p.stdout).text(), new Response(p.stderr).text(), p.exited]);
  if (code !== 0) throw new Error(`${argv.join(" ")} exited ${code}: ${err}`);
  return out;
}

const text = (s: string) => new Blob([s]).stream() as ReadableStream<Uint8Array>;
async function readText(store: VolumeStore, id: string, path: string): Promise<string> {
  return new Response((await store.readFile(id, path)).stream).text();
}
async function status(p: Promise<unknown>): Promise<number | "ok"> {
  try {
    await p;
    return "ok";
  } catch (e) {
    if (e instanceof OrchestratorError) return e.status;
    throw e;
  }
}

describe.skipIf(why !== undefined)("volumes on blockd", async () => {
  const { client } = await startBlockd("volumes");
  const dir = scratchDir("volumes");
  const db = new Database(join(dir, "node.db"));
  afterAll(() => db.close());
  const opts = (o: Partial<VolumeStoreOptions> = {}): VolumeStoreOptions => ({
    dir: join(dir, "volumes"), sizeMB: SIZE_MB, ...volumeLayers(join(dir, "volumes"), client), idleMs: 200, ...o,
  });
  const store = new VolumeStore(db, client, opts());
  await store.start(() => false);

  test(named("records: create, list, names checked and unique"), async () => {
    const v = await store.create("first");
    expect(v.layers).toEqual(["000000.layer"]);
    expect(store.list().map((r) => r.name)).toContain("first");
    expect(await status(store.create("first"))).toBe(409);
    expect(await status(store.create("bad name"))).toBe(400);
    expect(await status(store.create("../x"))).toBe(400);
    expect(store.byName("first")!.id).toBe(v.id);
  }, 120_000);

  test(named("content calls: write, read, list, mkdir, metadata, remove"), async () => {
    const v = await store.create("content");
    await store.makeDir(v.id, "/a/b", { mode: 0o750, uid: 1000, gid: 1000 }, true);
    const w = await store.writeFile(v.id, "a/b/../b/f.txt", text("hello"), { uid: 7 }, false);
    expect(w).toMatchObject({ name: "f.txt", path: "/a/b/f.txt", type: "file", size: 5, mode: 0o644, uid: 7, gid: 0 });
    expect(await readText(store, v.id, "/a/b/f.txt")).toBe("hello");
    const listed = await store.entries(v.id, "/a", 2);
    expect(listed.map((e) => e.path)).toEqual(["/a/b", "/a/b/f.txt"]);
    expect(listed[0]).toMatchObject({ type: "directory", mode: 0o750, uid: 1000, gid: 1000 });
    expect((await store.updateEntry(v.id, "/a/b/f.txt", { mode: 0o600, gid: 5 })).mode).toBe(0o600);
    await store.removeEntry(v.id, "/a");
    expect(await status(store.entry(v.id, "/a"))).toBe(404);
  }, 120_000);

  test(named("a file larger than the volume is 413; one larger than its free space 507, leaving nothing behind"), async () => {
    const v = await store.create("full");
    const mib = (n: number) => new Blob([new Uint8Array(n << 20).fill(1)]).stream() as ReadableStream<Uint8Array>;
    expect(await status(store.writeFile(v.id, "/huge", mib(SIZE_MB + 1), {}, false))).toBe(413);
    expect(await status(store.writeFile(v.id, "/big", mib(SIZE_MB - 2), {}, false))).toBe(507);
    expect(await status(store.entry(v.id, "/big"))).toBe(404);
    await store.writeFile(v.id, "/small", text("fits"), {}, false);
    expect(await readText(store, v.id, "/small")).toBe("fits");
  }, 120_000);

  test(named("attach: one of two racing sandboxes wins, the other is 409; content calls wait for detach"), async () => {
    const v = await store.create("shared");
    await store.writeFile(v.id, "/before", text("1"), {}, false);
    const [a, b] = await Promise.allSettled([store.attach("shared", "sbxA"), store.attach(v.id, "sbxB")]);
    const won = [a, b].filter((r) => r.status === "fulfilled");
    const lost = [a, b].filter((r): r is PromiseRejectedResult => r.status === "rejected");
    expect(won.length).toBe(1);
    expect(lost.length).toBe(1);
    expect((lost[0]!.reason as OrchestratorError).status).toBe(409);
    const holder = a.status === "fulfilled" ? "sbxA" : "sbxB";
    const got = (won[0] as PromiseFulfilledResult<{ volumeID: string; name: string; devicePath: string }>).value;
    expect(got).toMatchObject({ volumeID: v.id, name: "shared" });
    expect(store.heldBy(holder)).toEqual([v.id]);
    // Its holder gets the same device again (a resume); the device stays one.
    expect((await store.attach("shared", holder)).devicePath).toBe(got.devicePath);
    expect(await status(store.attach("nope", holder))).toBe(404);
    expect(await status(store.entry(v.id, "/"))).toBe(409);
    expect(await status(store.destroy(v.id))).toBe(409);
    expect([...store.holders().values()].some((h) => h.includes(`mounted by sandbox ${holder}`))).toBe(true);
    // The device is the sandbox's: a file written through it (as a guest would) stays after detach.
    await sh(["debugfs", "-w", "-f", "-", got.devicePath], `write /etc/hostname /from-guest\n`);
    await store.detach(holder);
    await store.detach(holder);
    expect(store.heldBy(holder)).toEqual([]);
    expect((await store.entry(v.id, "/from-guest")).type).toBe("file");
    expect(await readText(store, v.id, "/before")).toBe("1");
  }, 120_000);

  test(named("a journal left by a guest is replayed before the host's next call"), async () => {
    const v = await store.create("journal");
    const { devicePath } = await store.attach("journal", "sbxJ");
    // debugfs's journal commands leave a committed transaction unapplied, as a guest stopped mid-way does.
    await Bun.write(join(dir, "block"), new Uint8Array(4096).fill(7));
    await sh(["debugfs", "-w", "-f", "-", devicePath], `jo\njw -b 9000 ${join(dir, "block")}\njc\n`);
    expect(await sh(["dumpe2fs", "-h", devicePath])).toContain("needs_recovery");
    await store.detach("sbxJ");
    expect((await store.entry(v.id, "/")).type).toBe("directory");
    const again = await store.attach("journal", "sbxJ2");
    expect(await sh(["dumpe2fs", "-h", again.devicePath])).not.toContain("needs_recovery");
    await store.detach("sbxJ2");
  }, 120_000);

  test(named("the stack is bounded: past layersMax a close commits it into one layer"), async () => {
    const small = new VolumeStore(db, client, opts({ layersMax: 3 }));
    const v = await small.create("stacked");
    for (let i = 0; i < 5; i++) {
      await small.writeFile(v.id, `/f${i}`, text(`content ${i}`), {}, false);
      // attach closes nothing; a detach seals the writes: one layer per round.
      await small.attach("stacked", "sbxS");
      await small.detach("sbxS");
    }
    const rec = small.info(v.id);
    expect(rec.layers.length).toBeLessThanOrEqual(3);
    expect(readdirSync(join(dir, "volumes", v.id)).sort()).toEqual([...rec.layers].sort());
    for (let i = 0; i < 5; i++) expect(await readText(small, v.id, `/f${i}`)).toBe(`content ${i}`);
    await Bun.sleep(1000); // its idle close, before the next test's store takes blockd's devices over
    expect(small.holders().size).toBe(0);
  }, 180_000);

  test(named("a restart takes back a device left open: its writes are sealed, a gone holder is detached"), async () => {
    const before = new VolumeStore(db, client, opts({ idleMs: 600_000 }));
    const v = await before.create("crashy");
    await before.writeFile(v.id, "/kept", text("still here"), {}, false);
    const held = await before.create("held");
    await before.attach("held", "sbxGone");
    expect(before.info(v.id).device).not.toBeNull();
    // A new process on the same database and blockd: the old one's devices are still open.
    const after = new VolumeStore(db, client, opts());
    await after.start((id) => id !== "sbxGone");
    expect(after.info(v.id).device).toBeNull();
    expect(after.info(held.id).holder).toBeNull();
    expect(await readText(after, v.id, "/kept")).toBe("still here");
    // Closed again once idle (idleMs 200), the held one at the start: no device of either is left.
    await Bun.sleep(1000);
    const left = (await client.call<{ id: string }[]>("list")).map((d) => d.id);
    expect(left.filter((d) => d === `vol-${v.id}` || d === `vol-${held.id}`)).toEqual([]);
    expect(after.holders().size).toBe(0);
  }, 180_000);
});
