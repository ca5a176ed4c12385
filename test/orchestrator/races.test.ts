// Two callers racing on one sandbox both get a correct answer, a client that goes away does not
// stop an operation half way, and a run of failures and kills leaves nothing behind: no VMM, no
// acquired device, no leased slot, no row, no checkpoint.
import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { readdirSync } from "node:fs";
import { join } from "node:path";
import { Sandbox } from "e2b";
import { type Orchestrator, RESUME_READY_MAX, type SandboxRuntime } from "../../src/orchestrator/orchestrator.ts";
import type { SandboxStore } from "../../src/orchestrator/store.ts";
import type { TemplateStore } from "../../src/orchestrator/templates.ts";
import { type DeviceView, startBlockd } from "../blockdev/harness.ts";
import { qemuPids, rmrf, runRoot } from "../vmm/harness.ts";
import { nodeParts, serveParts, sandboxSkipReason } from "./harness.ts";

const skip = sandboxSkipReason();
const KEY = "e2b_" + "7b".repeat(20);
const tag = ((process.pid + 13) % 46656).toString(36).padStart(3, "0");

describe.skipIf(!!skip)("races, disconnects and leaks on the node API", async () => {
  if (skip) return void test.skip(skip!, () => {});
  const { dir, client } = await startBlockd("races", { pool: 2 });
  const root = runRoot("races");
  let orch: Orchestrator;
  let store: SandboxStore;
  let templates: TemplateStore;
  let leasedSlots = () => -1;
  let base = "";
  const cleanup: (() => Promise<unknown> | void)[] = [];
  const opts = () => ({ apiKey: KEY, apiUrl: base, sandboxUrl: base, requestTimeoutMs: 120_000 });
  const api = (path: string, method = "POST", body: unknown = {}) =>
    fetch(base + path, { method, headers: { "x-api-key": KEY, "content-type": "application/json" }, body: method === "GET" || method === "DELETE" ? undefined : JSON.stringify(body) });

  beforeAll(async () => {
    const parts = await nodeParts({ dir, runRoot: root, slotPrefix: `arr${tag}-`, slotCidr: `10.220.${process.pid % 250}.0/24` }, client, { maxSandboxes: 8 });
    ({ orch, store, templates } = parts);
    leasedSlots = () => parts.pool.stats().leased;
    const served = serveParts(orch, KEY);
    base = served.base;
    cleanup.push(served.stop, async () => { await orch.killAll(); orch.close(); await parts.pool.destroy().catch(() => {}); });
    // Checkpoint the template once, so the races below are about sandboxes.
    await (await Sandbox.create("busybox", opts())).kill();
  }, 300_000);

  afterAll(async () => {
    for (const c of cleanup.reverse()) await c();
    rmrf(root);
  });

  test("two pauses at once join one operation: both 204; two connects at once resume it once", async () => {
    const s = await Sandbox.create("busybox", opts());
    await s.files.write("/tmp/x", "kept");
    const [a, b] = await Promise.all([api(`/sandboxes/${s.sandboxId}/pause`), api(`/sandboxes/${s.sandboxId}/pause`)]);
    expect([a.status, b.status]).toEqual([204, 204]);
    expect((await api(`/sandboxes/${s.sandboxId}/pause`)).status).toBe(409);
    const [c, d] = await Promise.all([api(`/v2/sandboxes/${s.sandboxId}/connect`), api(`/v2/sandboxes/${s.sandboxId}/connect`)]);
    expect(c.status).toBe(201);
    expect([200, 201]).toContain(d.status);
    const [bc, bd] = (await Promise.all([c.json(), d.json()])) as { envdAccessToken: string }[];
    expect(bc!.envdAccessToken).toBe(bd!.envdAccessToken);
    expect(orch.timings.recent("resume").filter((t) => t.id === s.sandboxId).length).toBe(1);
    const back = await Sandbox.connect(s.sandboxId, opts());
    expect(await back.files.read("/tmp/x")).toBe("kept");
    expect(qemuPids(root).length).toBe(1);
    await back.kill();
  }, 180_000);

  test("two kills at once: one true, one false; a kill racing a pause waits for it and wins", async () => {
    const s = await Sandbox.create("busybox", opts());
    const answers = await Promise.all([Sandbox.kill(s.sandboxId, opts()), Sandbox.kill(s.sandboxId, opts())]);
    expect(answers.sort()).toEqual([false, true]);
    const t = await Sandbox.create("busybox", opts());
    const [p, k] = await Promise.all([api(`/sandboxes/${t.sandboxId}/pause`), api(`/sandboxes/${t.sandboxId}`, "DELETE")]);
    expect(p.status).toBe(204);
    expect(k.status).toBe(204);
    expect(store.get(t.sandboxId)).toBeUndefined();
    expect(qemuPids(root)).toEqual([]);
  }, 180_000);

  test(`the last ${RESUME_READY_MAX} sandboxes to pause hold their resume's rootfs device: a resume takes it, a kill racing a resume gives it back`, async () => {
    const made: Sandbox[] = [];
    for (let i = 0; i <= RESUME_READY_MAX; i++) made.push(await Sandbox.create("busybox", opts()));
    for (const s of made) {
      await s.files.write("/tmp/who", s.sandboxId);
      expect(await s.pause()).toBe(true);
    }
    await orch.settledCleanups();
    const rt = (s: Sandbox) => store.get(s.sandboxId)!.runtime as SandboxRuntime;
    const held = made.map((s) => rt(s).resumeDevice ?? null);
    // The first to pause gave its device back when the fifth took one.
    expect(held.map((h) => h !== null)).toEqual([false, ...Array<boolean>(RESUME_READY_MAX).fill(true)]);
    const listed = await client.call<DeviceView[]>("list");
    for (const [i, h] of held.entries()) {
      if (!h) continue;
      const d = listed.find((l) => l.id === h.id)!;
      expect(d.acquired).toBe(true);
      expect(d.path).toBe(h.path);
      expect(d.config!.upper!.data.startsWith(`${h.upperDir}/`)).toBe(true);
      expect(d.config!.lowers.map((l) => l.file)).toEqual(rt(made[i]!).paused!.layers as string[]);
    }
    // A resume runs on the device it holds; one without a device acquires as a create does.
    const last = made.at(-1)!;
    const back = await Sandbox.connect(last.sandboxId, opts());
    expect(rt(last).rootfsDevice).toBe(held.at(-1)!.id);
    expect(rt(last).resumeDevice ?? null).toBeNull();
    expect(await back.files.read("/tmp/who")).toBe(last.sandboxId);
    const first = await Sandbox.connect(made[0]!.sandboxId, opts());
    expect(await first.files.read("/tmp/who")).toBe(made[0]!.sandboxId);
    // A kill and a resume at once on a sandbox that holds its device: the kill wins either way
    // (after the resume, or with the resume refused), and the device goes back.
    const racer = made[1]!.sandboxId;
    const [k, c] = await Promise.all([api(`/sandboxes/${racer}`, "DELETE"), api(`/v2/sandboxes/${racer}/connect`)]);
    expect(k.status).toBe(204);
    expect([201, 404, 409]).toContain(c.status);
    expect(store.get(racer)).toBeUndefined();
    const after = (await client.call<DeviceView[]>("list")).find((l) => l.id === held[1]!.id);
    expect(after?.acquired && after.config?.upper?.data.startsWith(`${held[1]!.upperDir}/`)).toBeFalsy();
    for (const s of made) await Sandbox.kill(s.sandboxId, opts());
    expect(qemuPids(root)).toEqual([]);
  }, 300_000);

  test("a client that goes away mid-create does not stop the create: the sandbox runs", async () => {
    const before = new Set(store.all().map((r) => r.id));
    const ctl = new AbortController();
    const req = fetch(`${base}/v2/sandboxes`, { method: "POST", signal: ctl.signal, headers: { "x-api-key": KEY, "content-type": "application/json" }, body: JSON.stringify({ templateID: "busybox" }) }).catch((e) => e);
    await Bun.sleep(50);
    ctl.abort();
    expect(await req).toBeInstanceOf(Error);
    let made: string | undefined;
    const end = Date.now() + 60_000;
    while (Date.now() < end) {
      made = store.all().find((r) => !before.has(r.id) && r.state === "running")?.id;
      if (made) break;
      await Bun.sleep(100);
    }
    expect(made).toBeDefined();
    const s = await Sandbox.connect(made!, opts());
    expect((await s.commands.run("echo alive")).stdout).toBe("alive\n");
    await s.kill();
  }, 120_000);

  test("a create that fails (a template whose layer is gone) says why and leaves nothing behind", async () => {
    templates.insert({
      id: "brokentpl", alias: "broken", kind: "template", names: ["broken:default"], cpuCount: 1, memoryMB: 128, diskSizeMB: 64,
      layers: [join(dir, "no-such-layer")], checkpoint: null, sourceSandboxId: null, envdVersion: "0.6.13", createdAt: Date.now(),
    });
    const rows = store.count();
    const acquired = async () => (await client.call<{ id: string; acquired?: boolean }[]>("list")).filter((d) => d.acquired && !orch.memoryDeviceIds().has(d.id));
    const devicesBefore = (await acquired()).length;
    for (let i = 0; i < 3; i++) {
      const r = await api("/v2/sandboxes", "POST", { templateID: "broken" });
      const body = (await r.json()) as { code: number; message: string };
      expect(r.status).toBe(500);
      expect(body.code).toBe(500);
      expect(body.message).toContain("no-such-layer");
    }
    expect(store.count()).toBe(rows);
    expect((await acquired()).length).toBe(devicesBefore);
    expect(qemuPids(root)).toEqual([]);
    templates.delete("brokentpl");
  }, 120_000);

  test("after all of it: no rows, no VMs, no acquired devices, no leased slots, no sandbox checkpoints", async () => {
    // Counted before anything is cleaned: every test killed its sandboxes, so a row left is a leak.
    expect(store.all().map((r) => `${r.id} ${r.state}`)).toEqual([]);
    expect(qemuPids(root)).toEqual([]);
    await orch.settledCleanups();
    // The node holds only the pinned templates' memory devices: none warm (nothing is paused), none mapped.
    const mine = orch.memoryDeviceIds();
    expect(mine.size).toBe(orch.pinnedMemoryStacks().length);
    expect((await client.call<{ id: string; acquired?: boolean }[]>("list")).filter((d) => d.acquired && !mine.has(d.id))).toEqual([]);
    await orch.settledCleanups();
    await orch.collectCheckpoints();
    expect(readdirSync(join(dir, "home", "checkpoints")).filter((c) => !c.startsWith("template-"))).toEqual([]);
    expect(readdirSync(join(dir, "home", "sandboxes"))).toEqual([]);
    expect(leasedSlots()).toBe(0);
  }, 60_000);
});
