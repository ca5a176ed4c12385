// The cluster's record of shared volumes (src/node/volume_cluster.ts) against a real etcd and a
// directory snapshot store, with two "nodes" in one process (two ClusterVolumes on their own volume
// leases): names unique cluster-wide, claims of which exactly one wins, layers put once and
// fetched checked, the fence that keeps a node whose lease lapsed from publishing, and the
// collection of layers no record names. Then two VolumeStores on their own blockd sharing them: a
// sandbox of one node holding a volume, and the stack's commit published. Whole nodes through the
// e2b SDK: volumes_cluster.test.ts.
import { Database } from "bun:sqlite";
import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { randomUUID } from "node:crypto";
import { readdirSync, readFileSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { ClusterVolumes, layerStoreId, sharesVolumes } from "../../src/node/volume_cluster.ts";
import { volumeHolderKey, volumeKey, parseVolume, parseVolumeHolder } from "../../src/cluster/records.ts";
import type { EtcdClient } from "../../src/cluster/etcd_client.ts";
import { ClaimLapsed, type SharedVolume, type VolumeClaim } from "../../src/orchestrator/volume_shared.ts";
import { DirSnapshotStore } from "../../src/snapshot/index.ts";
import { OrchestratorError } from "../../src/orchestrator/errors.ts";
import { VolumeStore } from "../../src/orchestrator/volumes.ts";
import { volumeLayers } from "../../src/node/volume_layers.ts";
import { haveFuse, startBlockd } from "../blockdev/harness.ts";
import { scratchDir, sha256 } from "../helpers/tmp.ts";
import { etcdSkipReason, etcdSuite } from "../services/harness.ts";

const skip = etcdSkipReason();
const haveTools = ["debugfs", "e2fsck", "mkfs.ext4"].every((t) => Bun.which(t, { PATH: `${process.env.PATH}:/usr/sbin:/sbin` }));
const storesSkip = skip ?? (haveFuse && haveTools ? undefined : "needs root, /dev/fuse and e2fsprogs (debugfs, e2fsck, mkfs.ext4)");

describe.skipIf(skip !== undefined)("shared volumes in etcd and the snapshot store", () => {
  const suite = etcdSuite("volcl-etcd");
  const dir = scratchDir("volcl");
  const store = new DirSnapshotStore(join(dir, "store"));
  let client: EtcdClient;
  let na: ClusterVolumes;
  let nb: ClusterVolumes;
  const node = (id: string) => new ClusterVolumes({ etcd: suite.client(), store, nodeId: id, leaseFile: join(dir, `lease-${id}`) });

  beforeAll(async () => {
    client = suite.client();
    na = node("na");
    nb = node("nb");
    await na.start();
    await nb.start();
  });
  afterAll(() => {
    na?.close();
    nb?.close();
  });

  /** A layer file of `text`, with its digest. */
  function layer(name: string, text: string): { digest: string; path: string } {
    const path = join(dir, name);
    writeFileSync(path, text);
    return { digest: sha256(new TextEncoder().encode(text)), path };
  }

  async function volume(name: string): Promise<SharedVolume> {
    const bottom = layer(`${name}.bottom`, `bottom of ${name}`);
    const v: SharedVolume = { id: randomUUID(), name, token: "t", sizeMB: 64, createdAt: Date.now(), layers: [bottom.digest], replay: false, epoch: 0 };
    await na.create(v, bottom.path);
    return v;
  }

  const claimOf = (r: Awaited<ReturnType<ClusterVolumes["claim"]>>): VolumeClaim => {
    if (!r || !("claim" in r)) throw new Error(`not claimed: ${JSON.stringify(r)}`);
    return r.claim;
  };

  test("the node's volumes are shared when it is in a cluster and its store is not under its home", () => {
    expect(sharesVolumes({ cluster: ["http://e:2379"], snapshotStore: "/shared/snaps", home: "/var/lib/aenv" })).toBe(true);
    expect(sharesVolumes({ cluster: ["http://e:2379"], snapshotStore: "s3://b/p", home: "/var/lib/aenv" })).toBe(true);
    expect(sharesVolumes({ cluster: ["http://e:2379"], snapshotStore: "/var/lib/aenv/snapshots", home: "/var/lib/aenv" })).toBe(false);
    expect(sharesVolumes({ cluster: [], snapshotStore: "/shared/snaps", home: "/var/lib/aenv" })).toBe(false);
  });

  test("a name is the cluster's: a second create of it on another node is 409, and leaves nothing in the store", async () => {
    const v = await volume("dup");
    expect((await nb.byName("dup"))?.id).toBe(v.id);
    expect((await nb.list(100)).map((x) => x.name)).toContain("dup");
    const other = layer("dup2.bottom", "another bottom");
    const again: SharedVolume = { ...v, id: randomUUID(), layers: [other.digest] };
    await expect(nb.create(again, other.path)).rejects.toMatchObject({ status: 409 });
    expect(await store.exists(layerStoreId(again.id, other.digest))).toBe(false);
    expect(await store.exists(layerStoreId(v.id, v.layers[0]!))).toBe(true);
  });

  test("claims: of two nodes claiming at once exactly one wins, every time; the other learns who holds it", async () => {
    const v = await volume("race");
    for (let round = 0; round < 20; round++) {
      const [a, b] = await Promise.all([na.claim(v.id, null), nb.claim(v.id, round % 2 ? "sbx1" : null)]);
      const won = [a, b].filter((r) => r && "claim" in r);
      expect(won.length).toBe(1);
      const lost = (won[0] === a ? b : a) as { holder: { node: string } };
      expect(lost.holder.node).toBe(won[0] === a ? "na" : "nb");
      const winner = won[0] === a ? na : nb;
      await winner.release(v.id, claimOf(won[0]!), v.layers.map((d) => ({ digest: d, path: "" })), false);
    }
    expect(await client.get(volumeHolderKey(v.id))).toBeUndefined();
    expect(await na.claim(randomUUID(), null)).toBeUndefined();
  });

  test("a published layer is put once and fetched by another node checked against its digest; a commit's old layers are collected", async () => {
    const v = await volume("flow");
    const ca = claimOf(await na.claim(v.id, null));
    expect(parseVolumeHolder((await client.get(volumeHolderKey(v.id)))!.value)).toMatchObject({ node: "na", sandbox: null });
    const l1 = layer("flow.1", "first writes");
    await na.release(v.id, ca, [{ digest: v.layers[0]!, path: "" }, l1], true);
    const rec = parseVolume((await client.get(volumeKey(v.id)))!.value);
    expect(rec).toMatchObject({ layers: [v.layers[0], l1.digest], replay: true, epoch: 1, node: "na" });
    const got = await nb.claim(v.id, "sbxB");
    const cb = claimOf(got);
    expect((got as { volume: SharedVolume }).volume.layers).toEqual([v.layers[0]!, l1.digest]);
    await nb.fetchLayer(v.id, l1.digest, join(dir, "fetched"));
    expect(readFileSync(join(dir, "fetched"), "utf8")).toBe("first writes");
    // A commit: the whole stack as one layer; the two old ones leave the store.
    const c = layer("flow.c", "committed");
    await nb.release(v.id, cb, [c], false);
    expect(parseVolume((await client.get(volumeKey(v.id)))!.value)).toMatchObject({ layers: [c.digest], epoch: 2, node: "nb" });
    expect(await store.exists(layerStoreId(v.id, l1.digest))).toBe(false);
    expect(await store.exists(layerStoreId(v.id, v.layers[0]!))).toBe(false);
    expect(await store.exists(layerStoreId(v.id, c.digest))).toBe(true);
    // A layer whose bytes are not its digest is refused at fetch.
    const blob = readdirSync(join(dir, "store", "blobs")).find((b) => b === c.digest)!;
    writeFileSync(join(dir, "store", "blobs", blob), "tampered");
    await expect(na.fetchLayer(v.id, c.digest, join(dir, "bad"))).rejects.toMatchObject({ status: 500 });
    writeFileSync(join(dir, "store", "blobs", blob), "committed");
  });

  test("fencing: a node whose lease lapsed cannot publish, relabel or delete; its puts are taken back; another node's claim stands", async () => {
    const v = await volume("fence");
    const ca = claimOf(await na.claim(v.id, null));
    // na's volume lease expires (as when its process is killed, or cut off from etcd for its TTL).
    await client.leaseRevoke(ca.lease);
    expect(await client.get(volumeHolderKey(v.id))).toBeUndefined();
    const cb = claimOf(await nb.claim(v.id, null));
    const fromB = layer("fence.b", "b's writes");
    await nb.release(v.id, cb, [{ digest: v.layers[0]!, path: "" }, fromB], false);
    const stale = layer("fence.a", "a's stale writes");
    await expect(na.release(v.id, ca, [{ digest: v.layers[0]!, path: "" }, stale], false)).rejects.toBeInstanceOf(ClaimLapsed);
    expect(await store.exists(layerStoreId(v.id, stale.digest))).toBe(false);
    await expect(na.relabel(v.id, ca, "sbx")).rejects.toBeInstanceOf(ClaimLapsed);
    await expect(na.destroy(v.id, ca)).rejects.toBeInstanceOf(ClaimLapsed);
    expect(parseVolume((await client.get(volumeKey(v.id)))!.value).layers).toEqual([v.layers[0], fromB.digest]);
    // Its renewal (every 3 s) finds the lease gone: the claim counts as lapsed from then on.
    const t0 = performance.now();
    while (!na.lapsed(ca)) {
      expect(performance.now() - t0).toBeLessThan(5000);
      await Bun.sleep(100);
    }
    // na's next claim takes a new lease.
    const again = claimOf(await na.claim(v.id, null));
    expect(again.lease).not.toBe(ca.lease);
    expect(na.lapsed(again)).toBe(false);
    expect(again.epoch).toBe(1);
    await na.destroy(v.id, again);
    expect(await client.get(volumeKey(v.id))).toBeUndefined();
    expect(await na.byName("fence")).toBeUndefined();
    expect((await store.list()).filter((x) => x.includes(v.id))).toEqual([]);
  });

  test("a restarted node takes its live lease back with its claims", async () => {
    const v = await volume("restart");
    const c = claimOf(await na.claim(v.id, "sbxR"));
    na.close();
    na = node("na");
    await na.start();
    expect(na.lapsed(c)).toBe(false);
    const l = layer("restart.1", "after the restart");
    await na.release(v.id, c, [{ digest: v.layers[0]!, path: "" }, l], true);
    expect(parseVolume((await client.get(volumeKey(v.id)))!.value).layers).toEqual([v.layers[0], l.digest]);
  });
});

describe.skipIf(storesSkip !== undefined)("two nodes' volume stores sharing volumes", async () => {
  const suite = etcdSuite("volst-etcd");
  const dir = scratchDir("volst");
  const store = new DirSnapshotStore(join(dir, "store"));
  const [bda, bdb] = [await startBlockd("volst-a"), await startBlockd("volst-b")];
  const made: { db: Database; shared: ClusterVolumes }[] = [];
  afterAll(() => {
    for (const m of made) {
      m.shared.close();
      m.db.close();
    }
  });
  /** Node `id`'s VolumeStore on its blockd: its database and folder, its ClusterVolumes on the shared etcd and store. */
  async function node(id: string, blockd: typeof bda.client): Promise<VolumeStore> {
    const shared = new ClusterVolumes({ etcd: suite.client(), store, nodeId: id, leaseFile: join(dir, `lease-${id}`) });
    await shared.start();
    const db = new Database(join(dir, `${id}.db`));
    made.push({ db, shared });
    const vols = join(dir, `volumes-${id}`);
    const s = new VolumeStore(db, blockd, { dir: vols, sizeMB: 64, ...volumeLayers(vols, blockd), idleMs: 200, layersMax: 3, shared });
    await s.start(() => false);
    return s;
  }
  const text = (t: string) => new Blob([t]).stream() as ReadableStream<Uint8Array>;
  const read = async (s: VolumeStore, id: string, path: string) => new Response((await s.readFile(id, path)).stream).text();
  async function status(p: Promise<unknown>): Promise<number | "ok"> {
    try {
      await p;
      return "ok";
    } catch (e) {
      if (e instanceof OrchestratorError) return e.status;
      throw e;
    }
  }
  const released = async (id: string) => {
    const t0 = performance.now();
    while (await suite.client().get(volumeHolderKey(id))) {
      expect(performance.now() - t0).toBeLessThan(10_000);
      await Bun.sleep(50);
    }
  };
  let sa: VolumeStore;
  let sb: VolumeStore;
  beforeAll(async () => {
    sa = await node("sa", bda.client);
    sb = await node("sb", bdb.client);
  });

  test("a sandbox on A holds it: B's attach and content calls are 409; A's detach publishes what the guest wrote, and B reads it", async () => {
    const v = await sa.create("sbx-vol");
    await sa.writeFile(v.id, "/before", text("1"), {}, false);
    // A's content claim becomes the sandbox's.
    const got = await sa.attach("sbx-vol", "sbxA");
    expect(parseVolumeHolder((await suite.client().get(volumeHolderKey(v.id)))!.value)).toMatchObject({ node: "sa", sandbox: "sbxA" });
    expect(await status(sb.attach("sbx-vol", "sbxB"))).toBe(409);
    expect((await sb.find(v.id))?.name).toBe("sbx-vol");
    expect(await status(sb.entry(v.id, "/"))).toBe(409);
    expect(await status(sb.destroy(v.id))).toBe(409);
    // The guest writes its device (debugfs here) and leaves a committed transaction in the journal.
    const p = Bun.spawn(["debugfs", "-w", "-f", "-", got.devicePath], { stdin: Buffer.from("write /etc/hostname /from-guest\n"), stdout: "ignore", stderr: "ignore" });
    await p.exited;
    await sa.detach("sbxA");
    expect(await suite.client().get(volumeHolderKey(v.id))).toBeUndefined();
    expect(parseVolume((await suite.client().get(volumeKey(v.id)))!.value)).toMatchObject({ replay: true, node: "sa" });
    expect((await sb.entry(v.id, "/from-guest")).type).toBe("file");
    expect(await read(sb, v.id, "/before")).toBe("1");
    await released(v.id);
    // B's sandbox now, then A's content calls wait out nothing: 409 at once.
    await sb.attach(v.id, "sbxB");
    expect(await status(sa.writeFile(v.id, "/x", text("x"), {}, false))).toBe(409);
    await sb.detach("sbxB");
  }, 180_000);

  test("a lapsed claim: kept with its writes when nobody changed the volume since; else a resume of its sandbox is 409 and its writes are discarded", async () => {
    const guestWrites = async (dev: string, name: string) => {
      const p = Bun.spawn(["debugfs", "-w", "-f", "-", dev], { stdin: Buffer.from(`write /etc/hostname /${name}\n`), stdout: "ignore", stderr: "ignore" });
      await p.exited;
    };
    /** A's volume lease expires (as when it is cut off from etcd past the TTL). */
    const lapse = async (id: string) => {
      const kv = (await suite.client().get(volumeHolderKey(id)))!;
      await suite.client().leaseRevoke(kv.lease);
    };
    const v = await sa.create("lapse-vol");
    const one = await sa.attach("lapse-vol", "sbxL");
    await guestWrites(one.devicePath, "kept");
    await lapse(v.id);
    await sa.detach("sbxL"); // nobody changed it: taken again, published
    expect((await sb.find(v.id))?.id).toBe(v.id);
    expect((await sb.entry(v.id, "/kept")).type).toBe("file");
    await released(v.id);
    const two = await sa.attach("lapse-vol", "sbxM");
    await guestWrites(two.devicePath, "lost");
    await lapse(v.id);
    await sb.writeFile(v.id, "/from-b", text("b"), {}, false);
    await released(v.id);
    expect(await status(sa.attach("lapse-vol", "sbxM"))).toBe(409);
    await sa.detach("sbxM");
    expect(await status(sb.entry(v.id, "/lost"))).toBe(404);
    expect(await read(sb, v.id, "/from-b")).toBe("b");
    await released(v.id);
  }, 180_000);

  test("past layersMax a close commits the stack; the committed layer is published alone, the old ones leave the store, the other node reads every file", async () => {
    const v = await sa.create("stacked-vol");
    for (let i = 0; i < 5; i++) {
      const s = i % 2 ? sb : sa;
      await s.find(v.id);
      await s.writeFile(v.id, `/f${i}`, text(`content ${i}`), {}, false);
      await released(v.id);
    }
    const rec = parseVolume((await suite.client().get(volumeKey(v.id)))!.value);
    expect(rec.layers.length).toBeLessThanOrEqual(3);
    expect(rec.epoch).toBe(5);
    expect((await store.list()).filter((x) => x.startsWith(`vol.${v.id}.`)).sort()).toEqual([...new Set(rec.layers)].map((d) => layerStoreId(v.id, d)).sort());
    for (let i = 0; i < 5; i++) expect(await read(sb, v.id, `/f${i}`)).toBe(`content ${i}`);
    await released(v.id);
    for (let i = 0; i < 5; i++) expect(await read(sa, v.id, `/f${i}`)).toBe(`content ${i}`);
    await released(v.id);
    // A's folder caches just the layers the record names.
    expect(readdirSync(join(dir, "volumes-sa", v.id)).sort()).toEqual([...new Set(rec.layers)].map((d) => `${d}.layer`).sort());
  }, 180_000);
});
