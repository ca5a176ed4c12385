// The orchestrator and the E2B API end to end, in this process: blockd, network slots and QEMU
// (TCG here) for real, a busybox template with our envd, and the stock e2b SDK as the client
// through the node's API and proxy. create → commands/files → pause → connect → fork → snapshot →
// create from the snapshot (kept in S3: s3rver on loopback) → list/filter → setTimeout expiry → kill → 404; bad input; no leaks.
import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { existsSync, mkdirSync, readFileSync, readdirSync, statSync } from "node:fs";
import { join } from "node:path";
import { Sandbox, SandboxNotFoundError } from "e2b";
import type { SlotPool } from "../../src/network/index.ts";
import type { Orchestrator, SandboxRuntime } from "../../src/orchestrator/orchestrator.ts";
import { MEMORY_TRACE, ROOTFS_TRACE, TRACE_WINDOW_MS } from "../../src/orchestrator/start_traces.ts";
import type { SandboxStore } from "../../src/orchestrator/store.ts";
import type { TemplateStore } from "../../src/orchestrator/templates.ts";
import type { SnapshotStore } from "../../src/snapshot/index.ts";
import { type DeviceView, startBlockd } from "../blockdev/harness.ts";
import { startS3Server, type TestS3 } from "../snapshot/s3_server.ts";
import { nodeParts, sandboxSkipReason, serveParts, SnapshotHookDriver } from "./harness.ts";
import { qemuPids, rmrf, runRoot, until } from "../vmm/harness.ts";

const skip = sandboxSkipReason();
const KEY = "e2b_" + "cd".repeat(20);
const tag = ((process.pid + 7) % 46656).toString(36).padStart(3, "0");

describe.skipIf(!!skip)("node API + orchestrator with the e2b SDK (QEMU, blockd, slots)", async () => {
  if (skip) return void test.skip(skip!, () => {});
  const { dir, client } = await startBlockd("orch", { pool: 2 });
  const root = runRoot("orch");
  const home = join(dir, "home");
  let orch: Orchestrator;
  let store: SandboxStore;
  let templates: TemplateStore;
  let snapshotStore: SnapshotStore;
  let pool: SlotPool;
  let stopServer = () => {};
  const driver = new SnapshotHookDriver();
  let s3: TestS3 | undefined;
  let base = "";
  const opts = () => ({ apiKey: KEY, apiUrl: base, sandboxUrl: base, requestTimeoutMs: 120_000 });

  beforeAll(async () => {
    // Snapshots go to S3 (s3rver on loopback): the store a cluster of nodes shares.
    mkdirSync(join(dir, "s3"), { recursive: true });
    s3 = await startS3Server(join(dir, "s3"));
    const snapshots = { location: "s3://snapshots/node", s3: { accessKeyId: "S3RVER", secretAccessKey: "S3RVER", endpoint: s3.endpoint } };
    const parts = await nodeParts({ dir, runRoot: root, slotPrefix: `aor${tag}-`, slotCidr: `10.215.${process.pid % 250}.0/24` }, client, { snapshots, driver });
    ({ orch, store, pool, templates, snapshotStore } = parts);
    const served = serveParts(orch, KEY);
    base = served.base;
    stopServer = served.stop;
    orch.startReaper(200);
  }, 300_000);

  afterAll(async () => {
    await orch?.killAll();
    orch?.close();
    stopServer();
    await pool?.destroy().catch(() => {});
    await s3?.stop();
    rmrf(root);
  });

  let sbx: Sandbox;

  test("create from a template (first create checkpoints it), then commands and files through the proxy", async () => {
    const t0 = performance.now();
    sbx = await Sandbox.create("busybox", { ...opts(), metadata: { suite: "orch", n: "1" }, envs: { GREETING: "hi there" } });
    console.log(`  first create (boot + checkpoint + restore): ${Math.round(performance.now() - t0)} ms`);
    expect(sbx.sandboxId).toMatch(/^[a-z0-9]{20}$/);
    const r = await sbx.commands.run('echo "$GREETING|$E2B_SANDBOX_ID"; id -un');
    expect(r.stdout).toBe(`hi there|${sbx.sandboxId}\nuser\n`);
    await sbx.files.write("/tmp/keep.txt", "kept across pause");
    expect(await sbx.files.read("/tmp/keep.txt")).toBe("kept across pause");
    const t1 = performance.now();
    const second = await Sandbox.create("busybox", opts());
    console.log(`  second create (restore only): ${Math.round(performance.now() - t1)} ms`);
    expect((await second.commands.run("cat /tmp/keep.txt 2>&1 || echo none")).stdout).toContain("none");
    expect(await second.kill()).toBe(true);
  }, 300_000);

  test("getInfo and list: metadata filter, state, pagination with X-Next-Token", async () => {
    const info = await Sandbox.getInfo(sbx.sandboxId, opts());
    expect(info.state).toBe("running");
    expect(info.metadata).toEqual({ suite: "orch", n: "1" });
    const found = await Sandbox.list({ ...opts(), query: { metadata: { suite: "orch" } } }).nextItems();
    expect(found.map((s) => s.sandboxId)).toEqual([sbx.sandboxId]);
    expect(await Sandbox.list({ ...opts(), query: { metadata: { suite: "none" } } }).nextItems()).toEqual([]);
  }, 60_000);

  test("pause → isRunning false, 409 on a second pause → connect resumes: files and processes survive", async () => {
    const bg = await sbx.commands.run("sleep 3600", { background: true, timeoutMs: 0 });
    expect(await sbx.pause()).toBe(true);
    expect(await sbx.isRunning()).toBe(false);
    expect((await Sandbox.getInfo(sbx.sandboxId, opts())).state).toBe("paused");
    expect(await Sandbox.pause(sbx.sandboxId, opts())).toBe(false); // 409 → false
    // Its memory is on disk, in layers: the template's base plus one thin layer of what it dirtied;
    // no VMM process, no RAM file left in the run root.
    const paused = (store.get(sbx.sandboxId)!.runtime as { paused: { memLayers?: string[]; dir: string } }).paused;
    expect(paused.memLayers?.length).toBe(2);
    for (const l of paused.memLayers!) expect(statSync(l).size).toBeGreaterThan(0);
    expect(statSync(paused.memLayers![1]!).size).toBeLessThan(64 << 20);
    expect(existsSync(join(paused.dir, "mem"))).toBe(false);
    await orch.settledCleanups(); // the run directory goes after the answer
    expect(existsSync(join(root, sbx.sandboxId))).toBe(false);
    expect(qemuPids(sbx.sandboxId)).toEqual([]);
    const back = await Sandbox.connect(sbx.sandboxId, opts());
    expect(await back.isRunning()).toBe(true);
    expect(await back.files.read("/tmp/keep.txt")).toBe("kept across pause");
    expect((await back.commands.list()).some((p) => p.pid === bg.pid)).toBe(true);
    sbx = back;
  }, 180_000);

  test("fork: children diverge, the source is untouched and keeps running", async () => {
    const res = await fetch(`${base}/sandboxes/${sbx.sandboxId}/fork`, { method: "POST", headers: { "x-api-key": KEY, "content-type": "application/json" }, body: JSON.stringify({ count: 3 }) });
    expect(res.status).toBe(201);
    const results = (await res.json()) as { sandbox?: { sandboxID: string } }[];
    expect(results.length).toBe(3);
    // The first two (forkParallelism) took their slots and devices during the checkpoint and waited
    // for it ("checkpoint"); the third started after it, as a create does ("slot").
    const starts = new Map(orch.timings.recent("fork-child").map((t) => [t.id, Object.keys(t.phases)]));
    const phases = results.map((r) => starts.get(r.sandbox!.sandboxID)!);
    expect(phases.map((p) => p.includes("checkpoint"))).toEqual([true, true, false]);
    expect(phases.map((p) => p.includes("slot"))).toEqual([false, false, true]);
    await Sandbox.kill(results[2]!.sandbox!.sandboxID, opts());
    results.pop();
    const kids = await Promise.all(results.map((r) => Sandbox.connect(r.sandbox!.sandboxID, opts())));
    expect(new Set(kids.map((k) => k.sandboxId)).size).toBe(2);
    // One memory device for both: the source's memory layers and the fork's new one on top.
    const srcMem = (store.get(sbx.sandboxId)!.runtime as SandboxRuntime).memLayers!;
    const kidRt = kids.map((k) => store.get(k.sandboxId)!.runtime as SandboxRuntime);
    expect(new Set(kidRt.map((r) => r.memDevice)).size).toBe(1);
    expect(kidRt[0]!.memLayers!.slice(0, -1)).toEqual(srcMem);
    const memDev = (await client.call<DeviceView[]>("list")).find((d) => d.id === kidRt[0]!.memDevice)!;
    expect(memDev.config!.lowers.map((l) => l.file)).toEqual(kidRt[0]!.memLayers!);
    for (const [i, k] of kids.entries()) {
      expect(await k.files.read("/tmp/keep.txt")).toBe("kept across pause");
      await k.files.write("/tmp/keep.txt", `child ${i}`);
    }
    expect(await kids[0]!.files.read("/tmp/keep.txt")).toBe("child 0");
    expect(await kids[1]!.files.read("/tmp/keep.txt")).toBe("child 1");
    expect(await sbx.files.read("/tmp/keep.txt")).toBe("kept across pause");
    for (const k of kids) expect(await k.kill()).toBe(true);
    // A fork no larger than forkParallelism prepares no devices; its children's memory stack is
    // unpinned all the same once they started, as the larger fork's is.
    const one = await fetch(`${base}/sandboxes/${sbx.sandboxId}/fork`, { method: "POST", headers: { "x-api-key": KEY, "content-type": "application/json" }, body: JSON.stringify({ count: 1 }) });
    expect(one.status).toBe(201);
    const only = ((await one.json()) as { sandbox: { sandboxID: string } }[])[0]!.sandbox.sandboxID;
    const onlyMem = (store.get(only)!.runtime as SandboxRuntime).memLayers!;
    expect(await Sandbox.kill(only, opts())).toBe(true);
    const pinned = (stack: string[]) => orch.pinnedMemoryStacks().some((s) => s.join() === stack.join());
    await until(() => !pinned(kidRt[0]!.memLayers!) && !pinned(onlyMem), 10_000, "both forks' memory stacks unpinned");
    expect(pinned(srcMem.slice(0, 1))).toBe(true); // the template's stays
  }, 300_000);

  test("a fork whose checkpoint fails after the seal (its VMM killed): 500, the children started early are given back, and so is the memory device taken ahead", async () => {
    const victim = await Sandbox.create("busybox", opts());
    const rt = store.get(victim.sandboxId)!.runtime as SandboxRuntime;
    const rows = store.count();
    const leased = pool.stats().leased;
    const fails = orch.creates.fails;
    const acquired = async () => (await client.call<DeviceView[]>("list")).filter((d) => d.acquired).map((d) => d.id).sort();
    const before = await acquired();
    // The victim's snapshot waits for the seal to show in blockd (the rootfs gains a lower), then
    // its VMM is killed: the snapshot and the memory layer, which come after the seal, fail.
    const lowers = rt.layers.length;
    let killed = false;
    driver.beforeSnapshot = async (vm) => {
      if (vm.pid !== rt.vmPid) return;
      await until(async () => ((await client.call<DeviceView[]>("list")).find((d) => d.id === rt.rootfsDevice)?.config?.lowers.length ?? 0) > lowers, 60_000, "the seal to show in blockd");
      process.kill(vm.pid, "SIGKILL");
      await vm.exited;
      killed = true;
    };
    let res: Response;
    try {
      res = await fetch(`${base}/sandboxes/${victim.sandboxId}/fork`, { method: "POST", headers: { "x-api-key": KEY, "content-type": "application/json" }, body: JSON.stringify({ count: 2 }) });
    } finally {
      driver.beforeSnapshot = undefined;
    }
    expect(killed).toBe(true);
    expect(res.status).toBe(500);
    expect(await res.json()).toMatchObject({ code: 500 });
    // Both early children were made (a row, a slot, a device each) and rolled back.
    expect(orch.creates.fails - fails).toBe(2);
    expect(store.count()).toBe(rows);
    expect(pool.stats().leased).toBe(leased);
    await until(async () => (await acquired()).join() === before.join(), 10_000, "the memory device taken ahead and the children's devices given back");
    await Sandbox.kill(victim.sandboxId, opts());
  }, 120_000);

  test("snapshot → a sandbox from it; delete twice → true, false", async () => {
    await sbx.files.write("/tmp/snap.txt", "in the snapshot");
    const snap = await sbx.createSnapshot();
    expect(snap.snapshotId).toMatch(/:default$/);
    const fromSnap = await Sandbox.create(snap.snapshotId, opts());
    expect(await fromSnap.files.read("/tmp/snap.txt")).toBe("in the snapshot");
    // Its first start recorded the start traces; they go to the store beside the snapshot.
    const id = snap.snapshotId.replace(/:default$/, "");
    const fetched = join(dir, "trace-back");
    await until(async () => (await snapshotStore.attachment(id, ROOTFS_TRACE, fetched)) && (await snapshotStore.attachment(id, MEMORY_TRACE, fetched)), TRACE_WINDOW_MS + 30_000, "both traces attached to the snapshot");
    const traces = [ROOTFS_TRACE, MEMORY_TRACE].map((f) => readFileSync(join(templates.resolve(id)!.checkpoint!.dir, f)));
    expect(await fromSnap.kill()).toBe(true);
    // The snapshot outlives this node's records: with its row and local checkpoint gone (a node
    // that lost its state, or another node on a shared store), it is imported from the store and
    // a create fetches its files.
    expect(snapshotStore.kind).toBe("s3");
    expect(await snapshotStore.exists(id)).toBe(true);
    templates.delete(id);
    await orch.settledCleanups();
    await orch.collectCheckpoints();
    expect(await orch.importSnapshots()).toEqual([id]);
    expect(templates.resolve(id)?.checkpoint).toBeNull();
    const fromStore = await Sandbox.create(snap.snapshotId, opts());
    expect(await fromStore.files.read("/tmp/snap.txt")).toBe("in the snapshot");
    // The fetched checkpoint came with the traces the first node recorded (replayed, not recorded again).
    const fetchedDir = templates.resolve(id)!.checkpoint!.dir;
    expect([ROOTFS_TRACE, MEMORY_TRACE].map((f) => readFileSync(join(fetchedDir, f)))).toEqual(traces);
    expect(await fromStore.kill()).toBe(true);
    expect(await Sandbox.deleteSnapshot(snap.snapshotId, opts())).toBe(true);
    expect(await snapshotStore.exists(id)).toBe(false);
    expect(await Sandbox.deleteSnapshot(snap.snapshotId, opts())).toBe(false);
  }, 300_000);

  test("setTimeout: the reaper kills at expiry; then kill → false and connect → not found", async () => {
    await sbx.setTimeout(2000);
    const end = Date.now() + 30_000;
    while (Date.now() < end && (await Sandbox.getInfo(sbx.sandboxId, opts()).then(() => true, () => false))) await Bun.sleep(200);
    await expect(Sandbox.getInfo(sbx.sandboxId, opts())).rejects.toBeInstanceOf(SandboxNotFoundError);
    expect(await Sandbox.kill(sbx.sandboxId, opts())).toBe(false);
    await expect(Sandbox.connect(sbx.sandboxId, opts())).rejects.toBeInstanceOf(SandboxNotFoundError);
  }, 60_000);

  test("E2B details: connect only extends the TTL; metrics carry timestamp; envd's internal paths and a traffic token guard the proxy", async () => {
    const s = await Sandbox.create("busybox", { ...opts(), timeoutMs: 600_000 });
    const end0 = Date.parse((await Sandbox.getInfo(s.sandboxId, opts())).endAt.toISOString());
    await Sandbox.connect(s.sandboxId, { ...opts(), timeoutMs: 60_000 });
    expect(Date.parse((await Sandbox.getInfo(s.sandboxId, opts())).endAt.toISOString())).toBe(end0);
    await Sandbox.connect(s.sandboxId, { ...opts(), timeoutMs: 1_200_000 });
    expect(Date.parse((await Sandbox.getInfo(s.sandboxId, opts())).endAt.toISOString())).toBeGreaterThan(end0);
    const m = await fetch(`${base}/sandboxes/${s.sandboxId}/metrics`, { headers: { "x-api-key": KEY } });
    const metrics = (await m.json()) as { timestamp: string; memTotal: number }[];
    expect(metrics.length).toBeGreaterThanOrEqual(1); // the reaper's round may have sampled it too
    expect(Number.isNaN(Date.parse(metrics[0]!.timestamp))).toBe(false);
    expect(metrics[0]!.memTotal).toBeGreaterThan(0);
    for (const path of ["/init", "/upgrade"]) {
      const r = await fetch(`${base}${path}`, { method: "POST", headers: { "e2b-sandbox-id": s.sandboxId }, body: "{}" });
      expect(r.status).toBe(403);
    }
    await s.kill();
    // allowPublicTraffic: false → non-envd ports want e2b-traffic-access-token.
    const r = await fetch(`${base}/v2/sandboxes`, { method: "POST", headers: { "x-api-key": KEY, "content-type": "application/json" }, body: JSON.stringify({ templateID: "busybox", network: { allowPublicTraffic: false } }) });
    const made = (await r.json()) as { sandboxID: string; trafficAccessToken: string | null };
    expect(typeof made.trafficAccessToken).toBe("string");
    const denied = await fetch(`${base}/proxy/${made.sandboxID}/8080/`);
    expect(denied.status).toBe(403);
    expect(((await denied.json()) as { message: string }).message).toContain("e2b-traffic-access-token");
    const wrong = await fetch(`${base}/proxy/${made.sandboxID}/8080/`, { headers: { "e2b-traffic-access-token": "nope" } });
    expect(wrong.status).toBe(403);
    // With the token the proxy lets it through (nothing listens on 8080: the port-not-open 502).
    const allowed = await fetch(`${base}/proxy/${made.sandboxID}/8080/`, { headers: { "e2b-traffic-access-token": made.trafficAccessToken! } });
    expect(allowed.status).toBe(502);
    expect(((await allowed.json()) as { message: string }).message).toContain("port is not open");
    expect(await Sandbox.kill(made.sandboxID, opts())).toBe(true);
  }, 180_000);

  test("autoPause: at expiry the sandbox is paused, not killed, and connect brings it back", async () => {
    const r = await fetch(`${base}/v2/sandboxes`, { method: "POST", headers: { "x-api-key": KEY, "content-type": "application/json" }, body: JSON.stringify({ templateID: "busybox", timeout: 1, autoPause: true }) });
    const id = ((await r.json()) as { sandboxID: string }).sandboxID;
    const end = Date.now() + 60_000;
    while (Date.now() < end && (await Sandbox.getInfo(id, opts())).state !== "paused") await Bun.sleep(200);
    expect((await Sandbox.getInfo(id, opts())).state).toBe("paused");
    const back = await Sandbox.connect(id, opts());
    expect(await back.isRunning()).toBe(true);
    expect(await back.kill()).toBe(true);
  }, 120_000);

  test("bad input: unknown template 404, wrong types 400, bad key 401, unknown sandbox 404 — all {code, message}", async () => {
    const post = (path: string, body: string, key = KEY) => fetch(base + path, { method: "POST", headers: { "x-api-key": key, "content-type": "application/json" }, body });
    for (const [r, status] of [
      [await post("/v2/sandboxes", JSON.stringify({ templateID: "nope" })), 404],
      [await post("/v2/sandboxes", JSON.stringify({ templateID: 5 })), 400],
      [await post("/v2/sandboxes", "{"), 400],
      [await post("/v2/sandboxes", JSON.stringify({ templateID: "busybox", timeout: -1 })), 400],
      [await post("/v2/sandboxes", JSON.stringify({ templateID: "busybox" }), "e2b_wrong"), 401],
      [await post("/sandboxes/abc/pause", "{}"), 404],
      [await post("/sandboxes/ABC!/pause", "{}"), 400],
    ] as [Response, number][]) {
      const body = (await r.json()) as { code: number; message: string };
      expect(r.status).toBe(status);
      expect(body.code).toBe(status);
      expect(typeof body.message).toBe("string");
    }
    const proxied = await fetch(base + "/health", { headers: { "e2b-sandbox-id": "nosuchsandbox" } });
    expect(proxied.status).toBe(502);
    expect(await proxied.json()).toEqual({ sandboxId: "nosuchsandbox", message: "The sandbox was not found", code: 502 });
  }, 60_000);

  test("nothing leaks: no sandbox rows, VMs, devices beyond the shared tools disk, or checkpoints", async () => {
    // Counted before anything is cleaned: every test killed its sandboxes, so a row left is a leak.
    expect(store.all().map((r) => `${r.id} ${r.state}`)).toEqual([]);
    expect(qemuPids(root)).toEqual([]);
    await orch.settledCleanups();
    // The node holds only the pinned templates' memory devices: none warm (nothing is paused), none mapped.
    const mine = orch.memoryDeviceIds();
    expect(mine.size).toBe(orch.pinnedMemoryStacks().length);
    const devs = await client.call<{ id: string; acquired: boolean; readOnly: boolean }[]>("list");
    expect(devs.filter((d) => d.acquired && !mine.has(d.id))).toEqual([]);
    expect(devs.filter((d) => mine.has(d.id)).every((d) => d.readOnly)).toBe(true);
    await orch.settledCleanups();
    await orch.collectCheckpoints();
    const cps = readdirSync(join(home, "checkpoints"));
    expect(cps.every((c) => c.startsWith("template-"))).toBe(true);
    expect(pool.stats().leased).toBe(0);
  }, 60_000);
});
