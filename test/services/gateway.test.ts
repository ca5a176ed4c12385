// The gateway without nodes and with fake node records in etcd: its own answers (health, Swagger,
// auth, errors) and its routing decisions, against a real etcd. The full path through real nodes
// and VMs is test/services/cluster.test.ts.
import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { GATEWAY_ENTRY, startService, type ServiceProc } from "../../services/cluster/procs.ts";
import { EtcdClient } from "../../src/cluster/etcd_client.ts";
import { nodeKey, sandboxKey, type Binding, type NodeRecord } from "../../src/cluster/records.ts";
import { etcdSkipReason, etcdSuite } from "./harness.ts";

const skip = etcdSkipReason();
const KEY = "e2b_" + "9a".repeat(20);

describe.skipIf(skip !== undefined)("the gateway against etcd", () => {
  const suite = etcdSuite("gw-etcd");
  let client: EtcdClient;
  let gw: ServiceProc;
  /** A stand-in node: an HTTP server that records what reaches it and answers as a node would. */
  let fake: ReturnType<typeof Bun.serve>;
  const seen: string[] = [];
  const h = { "x-api-key": KEY, "content-type": "application/json" };

  beforeAll(async () => {
    client = suite.client();
    fake = Bun.serve<undefined>({
      hostname: "127.0.0.1", port: 0,
      websocket: { message: (ws, m) => void ws.send(`echo ${String(m)}`) },
      fetch(req, server) {
        const u = new URL(req.url);
        if (u.pathname === "/proxy/sb1/8080/ws" && server.upgrade(req, { data: undefined })) return undefined as unknown as Response;
        seen.push(`${req.method} ${u.pathname}${u.search} key=${req.headers.get("x-api-key") === KEY}`);
        if (u.pathname === "/v2/sandboxes" && req.method === "POST") return Response.json({ code: 429, message: "full" }, { status: 429 });
        if (u.pathname.endsWith("/move")) return Response.json({ sandboxID: u.pathname.split("/")[2] }, { status: 201 });
        if (u.pathname.startsWith("/proxy/")) return new Response(`proxied ${u.pathname}${u.search}`);
        if (u.pathname === "/v2/sandboxes") return Response.json([], { headers: { "x-total-running": "0" } });
        return Response.json({ sandboxID: "sb1", state: "running" });
      },
    });
    gw = await startService(GATEWAY_ENTRY, { ...process.env, AENV_CLUSTER: suite.etcd().endpoints, AENV_API_KEY: KEY, HOST: "127.0.0.1", PORT: "0" });
    // It listens at once and answers 503 until its view of etcd is loaded.
    const t0 = performance.now();
    while ((await fetch(`${gw.url}/health`)).status !== 200) {
      if (performance.now() - t0 > 15_000) throw new Error(`the gateway never loaded its view:\n${gw.log.join("\n")}`);
      await Bun.sleep(50);
    }
  });
  afterAll(async () => {
    gw?.proc.kill(9);
    fake?.stop(true);
  });

  const record = (id: string, max = 4): NodeRecord => ({
    id, apiUrl: `http://127.0.0.1:${fake.port}`, status: "ready", version: "t",
    capacity: { cpus: 2, memoryMB: 4096, diskFreeMB: 100_000, maxSandboxes: max }, used: { sandboxes: 0, running: 0, cpus: 0, memoryMB: 0 }, cached: {}, at: Date.now(),
  });

  test("health, Swagger and auth are the node's; no node: a create is 503 with the reason", async () => {
    const doc = (await (await fetch(`${gw.url}/swagger/json`)).json()) as { paths: Record<string, unknown> };
    expect(Object.keys(doc.paths)).toContain("/v2/sandboxes");
    expect((await fetch(`${gw.url}/v2/sandboxes`)).status).toBe(401);
    const bad = await fetch(`${gw.url}/v2/sandboxes`, { method: "POST", headers: h, body: JSON.stringify({ templateID: 5 }) });
    expect(bad.status).toBe(400);
    const r = await fetch(`${gw.url}/v2/sandboxes`, { method: "POST", headers: h, body: JSON.stringify({ templateID: "base" }) });
    expect(r.status).toBe(503);
    expect(await r.json()).toEqual({ code: 503, message: "no node is in the cluster" });
    expect((await fetch(`${gw.url}/sandboxes/nosuch`, { headers: h })).status).toBe(404);
  });

  test("a by-ID call, a proxied request and a list go to the node the binding names, with the caller's key", async () => {
    const lease = await client.leaseGrant(30);
    await client.put(nodeKey("fa"), JSON.stringify(record("fa")), lease);
    const b: Binding = { node: "fa", lease, templateId: "base", cpuCount: 1, memoryMB: 512, diskSizeMB: 1024, metadata: {}, envdVersion: "0.6.13", startedAt: 1, endAt: 2 };
    await client.put(sandboxKey("sb1"), JSON.stringify(b));
    const t0 = performance.now();
    while ((await fetch(`${gw.url}/sandboxes/sb1`, { headers: h })).status !== 200) {
      expect(performance.now() - t0).toBeLessThan(5000);
      await Bun.sleep(50);
    }
    seen.length = 0;
    await fetch(`${gw.url}/sandboxes/sb1/pause`, { method: "POST", headers: h, body: "{}" });
    const px = await fetch(`${gw.url}/files?path=%2Fx`, { headers: { "e2b-sandbox-id": "sb1", "e2b-sandbox-port": "49983" } });
    expect(await px.text()).toBe("proxied /proxy/sb1/49983/files?path=%2Fx");
    const hostForm = await fetch(`${gw.url}/x`, { headers: { host: "8080-sb1.example.test" } });
    expect(await hostForm.text()).toBe("proxied /proxy/sb1/8080/x");
    expect(seen).toEqual(["POST /sandboxes/sb1/pause key=true", "GET /proxy/sb1/49983/files?path=%2Fx key=false", "GET /proxy/sb1/8080/x key=false"]);
    // A WebSocket into the sandbox: relayed both ways through the gateway and the node.
    const ws = new WebSocket(`${gw.url.replace("http", "ws")}/proxy/sb1/8080/ws`);
    const echoed = await new Promise<string>((resolve, reject) => {
      ws.onopen = () => ws.send("ping");
      ws.onmessage = (e) => resolve(String(e.data));
      ws.onerror = () => reject(new Error("WebSocket failed"));
    });
    ws.close();
    expect(echoed).toBe("echo ping");
    // A proxied request for a sandbox nobody holds: E2B's 502 "not found".
    const gone = await fetch(`${gw.url}/`, { headers: { "e2b-sandbox-id": "zz9" } });
    expect(gone.status).toBe(502);
  });

  test("every candidate refuses (429): the create is answered 429 once, each node asked once", async () => {
    await client.put(nodeKey("fb"), JSON.stringify(record("fb")), (await client.get(nodeKey("fa")))!.lease);
    const t0 = performance.now();
    while (!(await (await fetch(`${gw.url}/metrics`)).text()).includes("aenv_gateway_nodes 2")) {
      expect(performance.now() - t0).toBeLessThan(5000);
      await Bun.sleep(50);
    }
    seen.length = 0;
    const r = await fetch(`${gw.url}/v2/sandboxes`, { method: "POST", headers: h, body: JSON.stringify({ templateID: "base" }) });
    expect(r.status).toBe(429);
    expect(seen).toEqual(["POST /v2/sandboxes key=true", "POST /v2/sandboxes key=true"]);
    expect(await client.get("/aenv/reservations/fa")).toBeUndefined(); // released
  });

  test("a paused sandbox in the shared store whose node left: listed paused; a connect moves it to a live node, then goes there", async () => {
    const b: Binding = { node: "gone2", lease: "1", templateId: "base", cpuCount: 1, memoryMB: 512, diskSizeMB: 1024, metadata: { m: "x" }, envdVersion: "0.6.13", startedAt: 7, endAt: 8, exported: true };
    await client.put(sandboxKey("away1"), JSON.stringify(b));
    const t0 = performance.now();
    let listed: { sandboxID: string; state: string }[] = [];
    while (!listed.some((x) => x.sandboxID === "away1")) {
      expect(performance.now() - t0).toBeLessThan(5000);
      listed = (await (await fetch(`${gw.url}/v2/sandboxes?metadata=${encodeURIComponent("m=x")}`, { headers: h })).json()) as typeof listed;
      await Bun.sleep(50);
    }
    expect(listed.find((x) => x.sandboxID === "away1")?.state).toBe("paused");
    seen.length = 0;
    const r = await fetch(`${gw.url}/sandboxes/away1/connect`, { method: "POST", headers: h, body: JSON.stringify({ timeout: 60 }) });
    expect(r.status).toBe(200);
    // The move first (to a live node), then the connect itself to that node.
    expect(seen).toEqual(["POST /sandboxes/away1/move key=true", "POST /sandboxes/away1/connect key=true"]);
    // Traffic to one that resumes on traffic: moved with the gateway's own key, then relayed.
    // (A binding the view has not seen yet is read from etcd.)
    await client.put(sandboxKey("away2"), JSON.stringify({ ...b, autoResume: true }));
    seen.length = 0;
    const px = await fetch(`${gw.url}/hello`, { headers: { "e2b-sandbox-id": "away2", "e2b-sandbox-port": "8080" } });
    expect(await px.text()).toBe("proxied /proxy/away2/8080/hello");
    expect(seen).toEqual(["POST /sandboxes/away2/move key=true", "GET /proxy/away2/8080/hello key=false"]);
  });

  test("a binding whose node left: listed as lost, by-ID 502 naming it, a kill forgets it", async () => {
    const b: Binding = { node: "gone", lease: "1", templateId: "base", cpuCount: 1, memoryMB: 512, diskSizeMB: 1024, metadata: { k: "v" }, envdVersion: "0.6.13", startedAt: 5, endAt: 6 };
    await client.put(sandboxKey("lost1"), JSON.stringify(b));
    const t0 = performance.now();
    let listed: { sandboxID: string; state: string }[] = [];
    while (!listed.some((s) => s.sandboxID === "lost1")) {
      expect(performance.now() - t0).toBeLessThan(5000);
      listed = (await (await fetch(`${gw.url}/v2/sandboxes?metadata=${encodeURIComponent("k=v")}`, { headers: h })).json()) as typeof listed;
      await Bun.sleep(50);
    }
    expect(listed.filter((s) => s.sandboxID === "lost1")).toEqual([expect.objectContaining({ sandboxID: "lost1", state: "lost" })]);
    const running = (await (await fetch(`${gw.url}/v2/sandboxes?state=running&metadata=${encodeURIComponent("k=v")}`, { headers: h })).json()) as unknown[];
    expect(running.some((s) => (s as { sandboxID: string }).sandboxID === "lost1")).toBe(false);
    const info = await fetch(`${gw.url}/sandboxes/lost1`, { headers: h });
    expect(info.status).toBe(502);
    expect(((await info.json()) as { message: string }).message).toContain("node gone left the cluster");
    expect((await fetch(`${gw.url}/sandboxes/lost1`, { method: "DELETE", headers: h })).status).toBe(204);
    expect(await client.get(sandboxKey("lost1"))).toBeUndefined();
  });
});
