// The API routes the SDK acceptance test does not reach, against one `bun run node` with room for
// two sandboxes: v1 create, list, connect and resume, refreshes, metrics in a range, AgentENV's
// custom-extension-params and /nodes, snapshots and templates by ID, pagination tokens that do
// not belong to their list, Prometheus /metrics, and 429 once the node is full.
import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { RateLimitError, Sandbox } from "e2b";
import { FIRST_START_MS, nodeSetup, nodeSkipReason, startNode, stopNode, until, type NodeProc } from "./harness.ts";

const skip = nodeSkipReason();
const KEY = "e2b_" + "a7".repeat(20);

describe.skipIf(!!skip)("API routes of bun run node", () => {
  if (skip) return void test.skip(skip!, () => {});
  const setup = nodeSetup("aro", 229, KEY, { AENV_MAX_SANDBOXES: "2", AENV_REAPER_INTERVAL_MS: "200" });
  const { tag } = setup;
  let node: NodeProc;
  const opts = () => ({ apiKey: KEY, apiUrl: node.base, sandboxUrl: node.base, requestTimeoutMs: 180_000 });
  const api = (path: string, init: RequestInit = {}) =>
    fetch(`${node.base}${path}`, { ...init, headers: { "x-api-key": KEY, "content-type": "application/json", ...init.headers } });
  const post = (path: string, body: unknown) => api(path, { method: "POST", body: JSON.stringify(body) });
  const patch = (path: string, body: string) => api(path, { method: "PATCH", body });
  /** Status and JSON body (null when there is none). */
  const answer = async (r: Response | Promise<Response>) => {
    const res = await r;
    const text = await res.text();
    return { status: res.status, body: text ? JSON.parse(text) : null, headers: res.headers };
  };
  /** A 4xx/5xx answer: its status and that its body is {code = status, message}. */
  const failure = async (r: Response | Promise<Response>) => {
    const a = await answer(r);
    expect(a.body.code).toBe(a.status);
    expect(typeof a.body.message).toBe("string");
    return a.status;
  };

  beforeAll(async () => {
    node = await startNode(setup.env, FIRST_START_MS);
  }, FIRST_START_MS + 60_000);

  afterAll(() => stopNode(node, setup), 180_000);

  let a = ""; // v1-created, customExtensionParams, paused and resumed
  let b: Sandbox; // through the SDK; snapshotted
  let startedS = 0;

  test("v1 POST /sandboxes: 201 with the sandbox and x-agentenv-sandbox-id; v1 GET /sandboxes lists running ones by metadata", async () => {
    startedS = Math.floor(Date.now() / 1000);
    const made = await answer(post("/sandboxes", { templateID: "base", timeout: 600, metadata: { suite: "routes", tag }, secure: true, customExtensionParams: { gpu: { count: 1 }, keep: "x" } }));
    expect(made.status).toBe(201);
    a = made.body.sandboxID;
    expect(a).toMatch(/^[a-z0-9]{20}$/);
    expect(made.headers.get("x-agentenv-sandbox-id")).toBe(a);
    expect(made.body).toMatchObject({ templateID: expect.any(String), alias: "base", clientID: expect.any(String), envdVersion: expect.stringMatching(/^\d+\.\d+\.\d+$/), envdAccessToken: expect.any(String), trafficAccessToken: null });
    b = await Sandbox.create("base", { ...opts(), metadata: { suite: "routes", tag, who: "b" } });
    const filter = encodeURIComponent(`tag=${tag}&who=b`);
    const listed = await answer(api(`/sandboxes?metadata=${filter}`));
    expect(listed.status).toBe(200);
    expect(listed.body.map((s: { sandboxID: string }) => s.sandboxID)).toEqual([b.sandboxId]);
    expect(listed.body[0]).toMatchObject({ state: "running", metadata: { suite: "routes", tag, who: "b" }, startedAt: expect.any(String), endAt: expect.any(String) });
    const all = await answer(api(`/sandboxes?metadata=${encodeURIComponent(`tag=${tag}`)}`));
    expect(all.body.map((s: { sandboxID: string }) => s.sandboxID).sort()).toEqual([a, b.sandboxId].sort());
  }, 300_000);

  test("429 {code, message} when the node is full (AENV_MAX_SANDBOXES=2), by v1 and v2 create", async () => {
    expect(await failure(post("/v2/sandboxes", { templateID: "base" }))).toBe(429);
    expect(await failure(post("/sandboxes", { templateID: "base" }))).toBe(429);
    expect(await Sandbox.create("base", opts()).catch((e) => e)).toBeInstanceOf(RateLimitError);
  }, 60_000);

  test("customExtensionParams: GET the create's value; PATCH merges (RFC 7396); bounded; 400 not an object; 404 unknown", async () => {
    const path = `/sandboxes/${a}/custom-extension-params`;
    expect(await answer(api(path))).toMatchObject({ status: 200, body: { gpu: { count: 1 }, keep: "x" } });
    expect(await answer(patch(path, JSON.stringify({ gpu: { count: 2, kind: "a10" }, added: [1, 2] })))).toMatchObject({ status: 200, body: { gpu: { count: 2, kind: "a10" }, keep: "x", added: [1, 2] } });
    expect((await answer(patch(path, JSON.stringify({ gpu: null, keep: null })))).body).toEqual({ added: [1, 2] });
    expect((await answer(api(path))).body).toEqual({ added: [1, 2] });
    expect(await failure(patch(path, JSON.stringify({ big: "x".repeat(20_000) })))).toBe(400);
    expect(await failure(patch(path, "[1]"))).toBe(400);
    expect(await failure(patch(path, "{bad"))).toBe(400);
    expect((await answer(api(path))).body).toEqual({ added: [1, 2] });
    expect(await answer(api(`/sandboxes/${b.sandboxId}/custom-extension-params`))).toMatchObject({ status: 200, body: {} });
    expect(await failure(api("/sandboxes/nosuchsandbox0000000/custom-extension-params"))).toBe(404);
    expect(await failure(patch("/sandboxes/nosuchsandbox0000000/custom-extension-params", "{}"))).toBe(404);
  }, 60_000);

  test("metrics: samples every 5 s, in [start, end] as the SDK sends them; a range before the sandbox is []; bad values 400", async () => {
    let samples: { timestampUnix: number; timestamp: string; memTotal: number }[] = [];
    await until(async () => {
      samples = (await answer(api(`/sandboxes/${a}/metrics`))).body;
      return samples.length >= 2;
    }, 60_000, "two metric samples");
    for (const s of samples) {
      expect(Date.parse(s.timestamp)).toBe(s.timestampUnix * 1000);
      expect(s.timestampUnix).toBeGreaterThanOrEqual(startedS - 1);
      expect(s.memTotal).toBeGreaterThan(0);
    }
    expect(samples.map((s) => s.timestampUnix)).toEqual([...samples.map((s) => s.timestampUnix)].sort((x, y) => x - y));
    const first = samples[0]!.timestampUnix;
    const one = (await answer(api(`/sandboxes/${a}/metrics?start=${first}&end=${first}`))).body;
    expect(one.map((s: { timestampUnix: number }) => s.timestampUnix)).toEqual([first]);
    expect((await answer(api(`/sandboxes/${a}/metrics?start=${startedS - 3600}&end=${startedS - 3000}`))).body).toEqual([]);
    const sdk = await Sandbox.getMetrics(a, { ...opts(), start: new Date((first + 1) * 1000), end: new Date() });
    expect(sdk.length).toBeGreaterThan(0);
    for (const m of sdk) expect(m.timestamp.getTime()).toBeGreaterThanOrEqual((first + 1) * 1000);
    for (const q of ["start=abc", "end=-1", "start=1.5", `start=${first + 10}&end=${first}`]) expect(await failure(api(`/sandboxes/${a}/metrics?${q}`))).toBe(400);
    expect(await failure(api("/sandboxes/nosuchsandbox0000000/metrics"))).toBe(404);
  }, 90_000);

  test("refreshes only extend the TTL; v1 connect of a running sandbox 200; resume of a running one 409; logs v1 and v2", async () => {
    const endAt = async () => Date.parse((await answer(api(`/sandboxes/${a}`))).body.endAt);
    const before = await endAt();
    expect((await api(`/sandboxes/${a}/refreshes`, { method: "POST", body: JSON.stringify({ duration: 3600 }) })).status).toBe(204);
    const longer = await endAt();
    expect(longer).toBeGreaterThan(before);
    expect((await api(`/sandboxes/${a}/refreshes`, { method: "POST", body: JSON.stringify({ duration: 10 }) })).status).toBe(204);
    expect(await endAt()).toBe(longer);
    expect(await failure(post(`/sandboxes/${a}/refreshes`, { duration: 3601 }))).toBe(400);
    expect(await failure(post("/sandboxes/nosuchsandbox0000000/refreshes", {}))).toBe(404);
    const c = await answer(post(`/sandboxes/${a}/connect`, { timeout: 60 }));
    expect(c.status).toBe(200);
    expect(c.body.sandboxID).toBe(a);
    expect(await endAt()).toBe(longer); // connect only extends
    expect(await failure(post(`/sandboxes/${a}/resume`, { timeout: 60 }))).toBe(409);
    // The console of a restored VM may be empty: the shapes, not the lines.
    const v1 = await answer(api(`/sandboxes/${a}/logs`));
    expect(v1.status).toBe(200);
    expect(v1.body.logEntries.length).toBe(v1.body.logs.length);
    for (const e of v1.body.logEntries) expect(e).toMatchObject({ level: "info", message: expect.any(String), fields: {} });
    expect(Array.isArray((await answer(api(`/v2/sandboxes/${a}/logs`))).body.logs)).toBe(true);
  }, 60_000);

  test("paused: params readable, not patchable (409); v1 resume 201; paused again, v1 connect 201", async () => {
    expect((await api(`/sandboxes/${a}/pause`, { method: "POST" })).status).toBe(204);
    const path = `/sandboxes/${a}/custom-extension-params`;
    expect((await answer(api(path))).body).toEqual({ added: [1, 2] });
    expect(await failure(patch(path, "{}"))).toBe(409);
    const resumed = await answer(post(`/sandboxes/${a}/resume`, { timeout: 300 }));
    expect(resumed.status).toBe(201);
    expect(resumed.body.sandboxID).toBe(a);
    expect((await answer(api(`/sandboxes/${a}`))).body.state).toBe("running");
    expect((await answer(patch(path, JSON.stringify({ back: true })))).body).toEqual({ added: [1, 2], back: true });
    expect((await api(`/sandboxes/${a}/pause`, { method: "POST" })).status).toBe(204);
    const connected = await answer(post(`/sandboxes/${a}/connect`, { timeout: 300 }));
    expect(connected.status).toBe(201);
    expect((await answer(api(`/sandboxes/${a}`))).body.state).toBe("running");
    expect(await failure(post("/sandboxes/nosuchsandbox0000000/resume", {}))).toBe(404);
  }, 300_000);

  test("snapshots: GET /snapshots/{id}; pages by nextToken; a token of another list or filter, or garbage, is 400", async () => {
    const s1 = await b.createSnapshot();
    const s2 = await b.createSnapshot();
    const one = await answer(api(`/snapshots/${s1.snapshotId}`));
    expect(one.status).toBe(200);
    expect(one.body).toMatchObject({ snapshotID: s1.snapshotId, names: expect.any(Array), createdAt: expect.any(String) });
    expect(await failure(api("/snapshots/nosuchsnapshot"))).toBe(404);
    expect(await failure(api("/snapshots/base"))).toBe(404); // a template, not a snapshot
    const q = `sandboxID=${b.sandboxId}`;
    const p1 = await answer(api(`/snapshots?${q}&limit=1`));
    expect(p1.body.map((s: { snapshotID: string }) => s.snapshotID)).toEqual([s2.snapshotId]);
    const token = p1.headers.get("x-next-token")!;
    expect(token).toBeTruthy();
    const p2 = await answer(api(`/snapshots?${q}&limit=1&nextToken=${token}`));
    expect(p2.body.map((s: { snapshotID: string }) => s.snapshotID)).toEqual([s1.snapshotId]);
    expect(p2.headers.get("x-next-token")).toBeNull();
    for (const bad of [`/snapshots?limit=1&nextToken=${token}`, `/snapshots?sandboxID=${a}&nextToken=${token}`, `/v2/templates?nextToken=${token}`, `/v2/sandboxes?nextToken=${token}`, "/snapshots?nextToken=garbage", `/snapshots?${q}&limit=0`])
      expect(await failure(api(bad))).toBe(400);
    const listed = await answer(api(`/v2/sandboxes?metadata=${encodeURIComponent(`tag=${tag}`)}&limit=1`));
    const sbxToken = listed.headers.get("x-next-token")!;
    expect(sbxToken).toBeTruthy();
    expect((await answer(api(`/v2/sandboxes?metadata=${encodeURIComponent(`tag=${tag}`)}&limit=1&nextToken=${sbxToken}`))).body.length).toBe(1);
    for (const bad of [`/v2/sandboxes?limit=1&nextToken=${sbxToken}`, `/v2/sandboxes?metadata=${encodeURIComponent(`tag=${tag}`)}&order=asc&nextToken=${sbxToken}`, `/snapshots?nextToken=${sbxToken}`])
      expect(await failure(api(bad))).toBe(400);
    // A token whose item is gone still marks its place.
    expect(await Sandbox.deleteSnapshot(s2.snapshotId, opts())).toBe(true);
    expect((await answer(api(`/snapshots?${q}&limit=1&nextToken=${token}`))).body.map((s: { snapshotID: string }) => s.snapshotID)).toEqual([s1.snapshotId]);
    expect(await Sandbox.deleteSnapshot(s1.snapshotId, opts())).toBe(true);
  }, 300_000);

  test("templates: GET /v2/templates pages, GET /templates/{id} with its build, aliases; a requested build's status", async () => {
    const list = await answer(api("/v2/templates?limit=1"));
    expect(list.status).toBe(200);
    expect(list.body.map((x: { aliases: string[] }) => x.aliases)).toEqual([["base"]]);
    expect(list.headers.get("x-next-token")).toBeNull();
    const v1 = await answer(api("/templates"));
    expect(v1.body.map((x: { templateID: string }) => x.templateID)).toEqual([list.body[0].templateID]);
    const id = list.body[0].templateID;
    for (const ref of [id, "base", "base:default"]) {
      const one = await answer(api(`/templates/${ref}`));
      expect(one.status).toBe(200);
      expect(one.body).toMatchObject({ templateID: id, aliases: ["base"], builds: [{ buildID: id, status: "ready" }] });
    }
    expect(await failure(api("/templates/nosuchtemplate"))).toBe(404);
    expect(await failure(api("/v2/templates?nextToken=garbage"))).toBe(400);
    expect(await answer(api("/templates/aliases/base"))).toMatchObject({ status: 200, body: { templateID: id, public: true } });
    const req = await answer(post("/v3/templates", { name: `routes-${tag}` }));
    expect(req.status).toBe(202);
    const st = await answer(api(`/templates/${req.body.templateID}/builds/${req.body.buildID}/status`));
    expect(st).toMatchObject({ status: 200, body: { templateID: req.body.templateID, buildID: req.body.buildID, status: "waiting", logEntries: [] } });
    const file = await answer(api(`/templates/${req.body.templateID}/files/${"0".repeat(64)}`));
    expect(file).toMatchObject({ status: 201, body: { present: false, url: expect.stringContaining("signature=") } });
  }, 60_000);

  test("/nodes and /nodes/{id}: this node's counts and cached builds; Prometheus /metrics without a key", async () => {
    const nodes = await answer(api("/nodes"));
    expect(nodes.status).toBe(200);
    expect(nodes.body.length).toBe(1);
    const n = nodes.body[0];
    expect(n).toMatchObject({ status: "ready", sandboxCount: 2, sandboxPausedCount: 0, sandboxStartingCount: 0, version: expect.any(String) });
    expect(n.createSuccesses).toBe(2);
    expect(n.metrics.allocatedCPU).toBeGreaterThanOrEqual(2);
    expect(n.metrics.allocatedMemoryBytes).toBeGreaterThan(0);
    const detail = await answer(api(`/nodes/${n.id}`));
    expect(detail.status).toBe(200);
    const base = (await answer(api("/templates/base"))).body.templateID;
    expect(detail.body.cachedBuilds).toContain(base);
    expect(await failure(api("/nodes/nosuchnode"))).toBe(404);
    const prom = await fetch(`${node.base}/metrics`);
    expect(prom.status).toBe(200);
    const text = await prom.text();
    expect(text).toContain('aenv_sandboxes{state="running"} 2');
    expect(text).toContain("aenv_ready 1");
    expect(text).toContain('aenv_sandbox_creates_total{result="success"} 2');
  }, 60_000);

  test("kill both: 204, then 404; the node is empty", async () => {
    for (const id of [a, b.sandboxId]) {
      expect((await api(`/sandboxes/${id}`, { method: "DELETE" })).status).toBe(204);
      expect(await failure(api(`/sandboxes/${id}`, { method: "DELETE" }))).toBe(404);
    }
    expect((await answer(api(`/sandboxes?metadata=${encodeURIComponent(`tag=${tag}`)}`))).body).toEqual([]);
  }, 60_000);
});
