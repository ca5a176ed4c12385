// Volumes shared by a cluster's nodes, through the stock e2b SDK's `Volume` class against two real
// nodes on one etcd and one shared snapshot store (a directory): what one node writes another
// reads (its layers fetched from the store), names unique in the cluster, another node's sandbox
// holding a volume, a node killed with -9 while it holds one with unpublished writes (another
// takes it once its lease expires; the killed one, restarted, cannot publish them), and two
// nodes writing at once. No VM: the nodes' VMM is unavailable, so their start stops after the
// volumes are served (as in volumes.test.ts), and they never register for sandboxes.
import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { existsSync, readdirSync } from "node:fs";
import { join } from "node:path";
import { Volume, VolumeNotFoundError, VolumePathNotFoundError } from "e2b";
import { NODE_ENTRY, startService } from "../../services/cluster/procs.ts";
import type { EtcdClient } from "../../src/cluster/etcd_client.ts";
import { parseVolume, volumeHolderKey, volumeKey } from "../../src/cluster/records.ts";
import { haveFuse } from "../blockdev/harness.ts";
import { scratchDir } from "../helpers/tmp.ts";
import { etcdSkipReason, etcdSuite } from "../services/harness.ts";
import { nodeSetup, stopNode, until, type NodeProc, type NodeSetup } from "./harness.ts";

const haveTools = ["debugfs", "e2fsck", "mkfs.ext4"].every((t) => Bun.which(t, { PATH: `${process.env.PATH}:/usr/sbin:/sbin` }));
const skip = haveFuse && haveTools ? etcdSkipReason() : "needs root, /dev/fuse and e2fsprogs (debugfs, e2fsck, mkfs.ext4)";
const KEY = "e2b_" + "c7".repeat(20);
/** Until the volume routes answer: blockd started, the empty ext4 layer not yet made. */
const SERVE_MS = 120_000;
/** A call waiting for another node to let a volume go: its idle close (10 s), or its lease's expiry (10 s after its last renewal). */
const HANDOFF_MS = 30_000;

describe.skipIf(!!skip)("volumes shared by a cluster's nodes", () => {
  if (skip) return void test.skip(skip, () => {});
  const suite = etcdSuite("cvol-etcd");
  const store = scratchDir("cvol-store");
  let client: EtcdClient;
  let setupA: NodeSetup;
  let setupB: NodeSetup;
  let a: NodeProc;
  let b: NodeProc;
  const api = (n: () => NodeProc) => () => ({ apiKey: KEY, apiUrl: n().base, requestTimeoutMs: 120_000 });
  const apiA = api(() => a);
  const apiB = api(() => b);
  /** The content API is on each node's own port. */
  const atA = () => ({ apiUrl: a.base, requestTimeoutMs: 120_000 });
  const atB = () => ({ apiUrl: b.base, requestTimeoutMs: 120_000 });

  async function start(s: NodeSetup): Promise<NodeProc> {
    const { proc, url, log } = await startService(NODE_ENTRY, s.env, { logLines: 10_000 });
    await until(async () => {
      if (proc.exitCode !== null) throw new Error(`node exited: ${log.slice(-30).join("\n")}`);
      return (await fetch(`${url}/volumes`, { headers: { "x-api-key": KEY } }).catch(() => undefined))?.status === 200;
    }, SERVE_MS, "GET /volumes 200");
    return { proc, base: url, log };
  }

  const settings = (id: string) => ({
    AENV_P2P: "0", AENV_VOLUME_SIZE_MB: "64", AENV_VMM: "firecracker", AENV_FIRECRACKER_BIN: "/nonexistent/firecracker",
    AENV_CLUSTER: suite.etcd().endpoints, AENV_NODE_ID: id, AENV_SNAPSHOT_STORE: store,
  });

  beforeAll(async () => {
    client = suite.client();
    setupA = nodeSetup("cva", 200, KEY, settings("cva"));
    setupB = nodeSetup("cvb", 201, KEY, settings("cvb"));
    [a, b] = await Promise.all([start(setupA), start(setupB)]);
  }, SERVE_MS + 30_000);
  afterAll(async () => {
    await stopNode(a, setupA);
    await stopNode(b, setupB);
  }, 180_000);

  /** Until no node holds volume `id` (its holder's idle close published it). */
  const released = (id: string) => until(async () => (await client.get(volumeHolderKey(id))) === undefined, HANDOFF_MS, `volume ${id} let go`);

  test("made on A, written on A, read on B (its layers from the shared store), written on B, read on A; the name is the cluster's; a delete on B", async () => {
    const vol = await Volume.create("shared-vol", apiA());
    expect((await Volume.list(apiB())).map((v) => v.name)).toContain("shared-vol");
    expect((await Volume.getInfo(vol.volumeId, apiB())).token).toBe(vol.token);
    await expect(Volume.create("shared-vol", apiB())).rejects.toThrow(/^409: /);
    await vol.makeDir("/dir", { ...atA(), force: true });
    await vol.writeFile("/dir/from-a.txt", "written on A", atA());
    // A holds the volume for its content calls until 10 s after the last; B's call waits for it.
    const t0 = performance.now();
    expect(await vol.readFile("/dir/from-a.txt", atB())).toBe("written on A");
    const waited = performance.now() - t0;
    console.log(`  B's first call waited ${Math.round(waited)} ms for A to publish`);
    expect(waited).toBeGreaterThan(5_000);
    await vol.writeFile("/from-b.txt", "written on B", atB());
    expect(await vol.readFile("/from-b.txt", atA())).toBe("written on B");
    expect((await vol.list("/", atA())).map((e) => e.name)).toEqual(expect.arrayContaining(["dir", "from-b.txt"]));
    const rec = parseVolume((await client.get(volumeKey(vol.volumeId)))!.value);
    expect(rec.epoch).toBeGreaterThanOrEqual(2);
    expect(rec.layers.length).toBe(1 + rec.epoch);
    // A delete on B waits for A's content calls too; A then forgets its copy.
    expect(await Volume.destroy(vol.volumeId, apiB())).toBe(true);
    await expect(Volume.getInfo(vol.volumeId, apiA())).rejects.toBeInstanceOf(VolumeNotFoundError);
    expect(existsSync(join(setupA.home, "volumes", vol.volumeId))).toBe(false);
    expect((await Volume.list(apiA())).map((v) => v.name)).not.toContain("shared-vol");
    await expect(vol.readFile("/from-b.txt", atA())).rejects.toThrow(/^403: /);
  }, 180_000);

  test("a sandbox of another node holding it: content calls and a delete are 409 at once", async () => {
    const vol = await Volume.create("held-vol", apiB());
    const lease = await client.leaseGrant(30);
    await client.put(volumeHolderKey(vol.volumeId), JSON.stringify({ node: "cva", sandbox: "sbxfake", at: Date.now() }), lease);
    const t0 = performance.now();
    await expect(vol.writeFile("/x", "x", atB())).rejects.toThrow(/^409: .*mounted by sandbox sbxfake on node cva/);
    expect(performance.now() - t0).toBeLessThan(5_000);
    await expect(Volume.destroy(vol.volumeId, apiB())).rejects.toThrow(/409/);
    await client.leaseRevoke(lease);
    await vol.writeFile("/x", "free again", atB());
    expect(await vol.readFile("/x", atB())).toBe("free again");
  }, 120_000);

  test("kill -9 of A holding the volume with unpublished writes: B takes it once A's lease expires and sees what was published; A restarted cannot publish them", async () => {
    const vol = await Volume.create("crash-vol", apiA());
    await vol.writeFile("/published", "v1", atA());
    await released(vol.volumeId);
    await vol.writeFile("/unpublished", "never seen", atA());
    expect(JSON.parse((await client.get(volumeHolderKey(vol.volumeId)))!.value)).toMatchObject({ node: "cva", sandbox: null });
    a.proc.kill("SIGKILL");
    await a.proc.exited;
    expect(await vol.readFile("/published", atB())).toBe("v1");
    await expect(vol.readFile("/unpublished", atB())).rejects.toBeInstanceOf(VolumePathNotFoundError);
    await vol.writeFile("/after", "B's", atB());
    // A's blockd kept the device it left open: its restart seals it, and the publish is fenced off.
    a = await start(setupA);
    await until(async () => a.log.some((l) => l.includes(`crash-vol (${vol.volumeId})`) && l.includes("is discarded")), HANDOFF_MS, "A's log: its writes discarded");
    expect(await vol.readFile("/after", atA())).toBe("B's");
    await expect(vol.readFile("/unpublished", atA())).rejects.toBeInstanceOf(VolumePathNotFoundError);
    expect(await vol.readFile("/published", atA())).toBe("v1");
    // The store holds the layers the record names, and nothing of A's discarded writes.
    await released(vol.volumeId);
    const rec = parseVolume((await client.get(volumeKey(vol.volumeId)))!.value);
    const stored = readdirSync(join(store, "snapshots")).filter((x) => x.startsWith(`vol.${vol.volumeId}.`)).sort();
    expect(stored).toEqual([...new Set(rec.layers)].map((d) => `vol.${vol.volumeId}.${d}`).sort());
  }, 240_000);

  test("A and B writing one path at once: both are answered, one after the other; the file is the later one's", async () => {
    const vol = await Volume.create("race-vol", apiA());
    await released(vol.volumeId);
    const [ra, rb] = await Promise.allSettled([vol.writeFile("/race", "from A", atA()), vol.writeFile("/race", "from B", atB())]);
    expect([ra.status, rb.status]).toEqual(["fulfilled", "fulfilled"]);
    const holder = JSON.parse((await client.get(volumeHolderKey(vol.volumeId)))!.value) as { node: string };
    // The node that holds it now wrote last.
    expect(await vol.readFile("/race", holder.node === "cva" ? atA() : atB())).toBe(holder.node === "cva" ? "from A" : "from B");
    expect(await vol.readFile("/race", holder.node === "cva" ? atB() : atA())).toBe(holder.node === "cva" ? "from A" : "from B");
  }, 180_000);
});
