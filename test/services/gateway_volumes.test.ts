// The gateway's routing of the volume routes against a real etcd, with two stand-in nodes (HTTP
// servers that record what reaches them): the list merged from every node, a create passed over a
// node that is starting, a call on a volume to the node holding it (its holder key) or else to the
// first node that knows it, a content call's token and body relayed as they came. Real nodes
// sharing volumes: test/node/volumes_cluster.test.ts.
import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { GATEWAY_ENTRY, startService, type ServiceProc } from "../../services/cluster/procs.ts";
import type { EtcdClient } from "../../src/cluster/etcd_client.ts";
import { nodeKey, volumeHolderKey, type NodeRecord } from "../../src/cluster/records.ts";
import { etcdSkipReason, etcdSuite } from "./harness.ts";

const skip = etcdSkipReason();
const KEY = "e2b_" + "5b".repeat(20);

describe.skipIf(skip !== undefined)("the gateway's volume routes", () => {
  const suite = etcdSuite("gwvol-etcd");
  let client: EtcdClient;
  let gw: ServiceProc;
  const seen: string[] = [];
  const fakes: ReturnType<typeof Bun.serve>[] = [];
  const h = { "x-api-key": KEY, "content-type": "application/json" };

  /** A stand-in node `id` that knows volume `v-{id}` and answers a create with `createStatus`. */
  function fakeNode(id: string, createStatus: number) {
    return Bun.serve({
      hostname: "127.0.0.1", port: 0,
      async fetch(req) {
        const u = new URL(req.url);
        const body = req.method === "GET" ? "" : await req.text();
        seen.push(`${id} ${req.method} ${u.pathname}${u.search}${req.headers.get("authorization") ? ` auth=${req.headers.get("authorization")}` : ""}${body ? ` body=${body}` : ""}`);
        if (u.pathname === "/volumes" && req.method === "GET") return Response.json([{ volumeID: `v-${id}`, name: id }, { volumeID: "v-both", name: "both" }]);
        if (u.pathname === "/volumes" && req.method === "POST") return Response.json(createStatus === 201 ? { volumeID: "v-new", name: "new", token: "t" } : { code: createStatus, message: "starting" }, { status: createStatus });
        if (u.pathname === `/volumes/v-${id}`) return Response.json({ volumeID: `v-${id}`, name: id, token: "t" });
        if (u.pathname.startsWith("/volumecontent/")) return Response.json({ from: id });
        return Response.json({ code: 404, message: "not found" }, { status: 404 });
      },
    });
  }

  const record = (id: string, port: number): NodeRecord => ({
    id, apiUrl: `http://127.0.0.1:${port}`, status: "ready", version: "t",
    capacity: { cpus: 2, memoryMB: 4096, diskFreeMB: 100_000, maxSandboxes: 4 }, used: { sandboxes: 0, running: 0, cpus: 0, memoryMB: 0 }, cached: {}, at: Date.now(),
  });

  beforeAll(async () => {
    client = suite.client();
    fakes.push(fakeNode("na", 503), fakeNode("nb", 201));
    const lease = await client.leaseGrant(60);
    await client.put(nodeKey("na"), JSON.stringify(record("na", fakes[0]!.port!)), lease);
    await client.put(nodeKey("nb"), JSON.stringify(record("nb", fakes[1]!.port!)), lease);
    gw = await startService(GATEWAY_ENTRY, { ...process.env, AENV_CLUSTER: suite.etcd().endpoints, AENV_API_KEY: KEY, HOST: "127.0.0.1", PORT: "0" });
    const t0 = performance.now();
    while (!(await (await fetch(`${gw.url}/metrics`)).text()).includes("aenv_gateway_nodes 2")) {
      if (performance.now() - t0 > 15_000) throw new Error(`the gateway never saw both nodes:\n${gw.log.join("\n")}`);
      await Bun.sleep(50);
    }
  });
  afterAll(() => {
    gw?.proc.kill(9);
    for (const f of fakes) f.stop(true);
  });

  test("the list is every node's, each volume once; a create passes over a node that is starting", async () => {
    const doc = (await (await fetch(`${gw.url}/swagger/json`)).json()) as { paths: Record<string, unknown> };
    expect(Object.keys(doc.paths)).toEqual(expect.arrayContaining(["/volumes", "/volumecontent/{volumeID}/file"]));
    const list = (await (await fetch(`${gw.url}/volumes`, { headers: h })).json()) as { volumeID: string }[];
    expect(list.map((v) => v.volumeID).sort()).toEqual(["v-both", "v-na", "v-nb"]);
    seen.length = 0;
    const r = await fetch(`${gw.url}/volumes`, { method: "POST", headers: h, body: JSON.stringify({ name: "new" }) });
    expect(r.status).toBe(201);
    expect(seen).toEqual([`na POST /volumes body={"name":"new"}`, `nb POST /volumes body={"name":"new"}`]);
    expect((await fetch(`${gw.url}/volumes`, { method: "POST", headers: h, body: JSON.stringify({ name: 5 }) })).status).toBe(400);
  });

  test("a content call goes to the first node that knows the volume, its token and body as they came; to its holder when one holds it", async () => {
    seen.length = 0;
    const put = await fetch(`${gw.url}/volumecontent/v-nb/file?path=%2Fx`, { method: "PUT", headers: { authorization: "Bearer tok", "content-type": "application/octet-stream" }, body: "hello" });
    expect(await put.json()).toEqual({ from: "nb" });
    expect(seen).toEqual(["na GET /volumes/v-nb", "nb GET /volumes/v-nb", "nb PUT /volumecontent/v-nb/file?path=%2Fx auth=Bearer tok body=hello"]);
    // nb holds v-na (its holder key): calls on it go there, no node asked first.
    const lease = await client.leaseGrant(30);
    await client.put(volumeHolderKey("v-na"), JSON.stringify({ node: "nb", sandbox: null, at: Date.now() }), lease);
    const t0 = performance.now();
    for (;;) {
      seen.length = 0;
      const r = await fetch(`${gw.url}/volumecontent/v-na/dir?path=%2F`, { headers: { authorization: "Bearer tok" } });
      if (((await r.json()) as { from: string }).from === "nb") break;
      expect(performance.now() - t0).toBeLessThan(5000);
      await Bun.sleep(50);
    }
    expect(seen).toEqual(["nb GET /volumecontent/v-na/dir?path=%2F auth=Bearer tok"]);
    // Its holder gone (its lease expired): the first node that knows it again.
    await client.leaseRevoke(lease);
    const t1 = performance.now();
    while ((await fetch(`${gw.url}/volumes/v-na`, { headers: h })).status !== 200) {
      expect(performance.now() - t1).toBeLessThan(5000);
      await Bun.sleep(50);
    }
  });

  test("a volume no node knows: 404 on the team routes, 403 with a string code on the content routes", async () => {
    expect((await fetch(`${gw.url}/volumes/nosuch`, { headers: h })).status).toBe(404);
    const r = await fetch(`${gw.url}/volumecontent/nosuch/file?path=%2Fx`, { headers: { authorization: "Bearer tok" } });
    expect(r.status).toBe(403);
    expect(((await r.json()) as { code: unknown }).code).toBe("403");
    // The team routes take the API key; the content routes their token.
    expect((await fetch(`${gw.url}/volumes`)).status).toBe(401);
    expect((await fetch(`${gw.url}/volumecontent/v-nb/file?path=%2Fx`)).status).toBe(401);
  });
});
