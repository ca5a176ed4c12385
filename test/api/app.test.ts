import { afterAll, describe, expect, test } from "bun:test";
import { t } from "elysia";
import { hostname } from "node:os";
import { join } from "node:path";
import { createApi } from "../../src/api/app.ts";
import { ApiError, conflict } from "../../src/api/errors.ts";
import { CLUSTER_ID, nodeRoutes } from "../../src/api/nodes.ts";
import { sandboxRoutes } from "../../src/api/sandboxes.ts";
import { templateRoutes } from "../../src/api/templates.ts";
import { volumeRoutes } from "../../src/api/volumes.ts";
import { secretRoutes } from "../../src/api/secrets.ts";
import { SecretStore } from "../../src/network/index.ts";
import { SandboxStore } from "../../src/orchestrator/store.ts";
import { TemplateStore } from "../../src/orchestrator/templates.ts";
import { scratchDir } from "../helpers/tmp.ts";

const KEY = "e2b_" + "ab".repeat(20);
let notReady: string | undefined = "blockd is starting";
const app = createApi({ apiKey: KEY, maxBodyBytes: 4096, notReadyReason: () => notReady, version: "0.0.0-test" })
  .post("/echo", ({ body }) => body, { body: t.Object({ n: t.Number() }) })
  .post("/busy", () => { throw conflict("sandbox is pausing"); })
  .get("/boom", () => { throw new Error("secret internal detail"); })
  .get("/badshape", () => ({ n: "not a number" }) as unknown as { n: number }, { response: { 200: t.Object({ n: t.Number() }) } })
  .listen({ hostname: "127.0.0.1", port: 0 });
afterAll(() => app.stop());
const base = `http://127.0.0.1:${app.server!.port}`;
const auth = { "x-api-key": KEY };

async function json(r: Response) { return { status: r.status, body: await r.json() as any }; }

describe("API basics", () => {
  test("/health: 503 with the reason until ready, then 200; no key needed", async () => {
    expect(await json(await fetch(base + "/health"))).toEqual({ status: 503, body: { code: 503, message: "blockd is starting" } });
    notReady = undefined;
    expect((await fetch(base + "/health")).status).toBe(200);
  });

  test("API key: missing or wrong → 401 {code, message}; X-API-Key and Bearer both accepted", async () => {
    const post = (h: Record<string, string>) => fetch(base + "/echo", { method: "POST", headers: { ...h, "content-type": "application/json" }, body: '{"n":1}' });
    const missing = await json(await post({}));
    expect(missing.status).toBe(401);
    expect(missing.body.code).toBe(401);
    expect(typeof missing.body.message).toBe("string");
    expect((await post({ "x-api-key": KEY.slice(0, -1) + "0" })).status).toBe(401);
    expect((await post({ "x-api-key": KEY + "0" })).status).toBe(401);
    expect(await json(await post(auth))).toEqual({ status: 200, body: { n: 1 } });
    expect((await post({ authorization: `Bearer ${KEY}` })).status).toBe(200);
  });

  test("the key is checked before the body: without it any body is 401, never 400, 413 or 415 with schema detail", async () => {
    const post = (body: string, h: Record<string, string> = { "content-type": "application/json" }) => fetch(base + "/echo", { method: "POST", headers: h, body });
    for (const r of [
      await post('{"n":"x"}'),
      await post("{bad"),
      await post("[1]"),
      await post(JSON.stringify({ n: 1, pad: "x".repeat(5000) })),
      await post("n=1", { "content-type": "application/x-www-form-urlencoded" }),
      await post('{"n":"x"}', { "content-type": "application/json", "x-api-key": "e2b_wrong" }),
    ]) {
      const { status, body } = await json(r);
      expect({ status, body }).toEqual({ status: 401, body: { code: 401, message: expect.stringContaining("API key") } });
    }
  });

  test("bad input: malformed JSON, wrong types, oversized (also chunked), wrong content type → 4xx {code, message}", async () => {
    const post = (body: string | ReadableStream<Uint8Array>, h: Record<string, string> = { "content-type": "application/json" }) =>
      fetch(base + "/echo", { method: "POST", headers: { ...auth, ...h }, body });
    for (const [r, status] of [
      [await post("{bad"), 400],
      [await post('{"n":"x"}'), 400],
      // Not an object: refused before validation would normalize it into one.
      [await post("[1]"), 400],
      [await post("5"), 400],
      [await post("null"), 400],
      [await post(JSON.stringify({ n: 1, pad: "x".repeat(5000) })), 413],
      [await post(new ReadableStream({ start(c) { for (let i = 0; i < 10; i++) c.enqueue(new Uint8Array(1000).fill(32)); c.close(); } })), 413],
      [await post("n=1", { "content-type": "application/x-www-form-urlencoded" }), 415],
    ] as [Response, number][]) {
      const { status: got, body } = await json(r);
      expect(got).toBe(status);
      expect(body.code).toBe(status);
      expect(typeof body.message).toBe("string");
    }
  });

  test("ApiError carries its status; an unexpected error is a 500 that leaks nothing", async () => {
    expect(await json(await fetch(base + "/busy", { method: "POST", headers: auth }))).toEqual({ status: 409, body: { code: 409, message: "sandbox is pausing" } });
    const boom = await json(await fetch(base + "/boom", { headers: auth }));
    expect(boom.status).toBe(500);
    expect(JSON.stringify(boom.body)).not.toContain("secret");
    expect(new ApiError(404, "x", { sandboxId: "a" }).body()).toEqual({ code: 404, message: "x", sandboxId: "a" });
    // An answer that breaks its own response schema is the node's fault: 500, not the caller's 400.
    const bad = await json(await fetch(base + "/badshape", { headers: auth }));
    expect(bad.status).toBe(500);
    expect(bad.body.code).toBe(500);
  });

  test("unknown route → 404 JSON", async () => {
    const r = await json(await fetch(base + "/nope", { headers: auth }));
    expect(r.status).toBe(404);
    expect(r.body.code).toBe(404);
  });

  test("Swagger: the OpenAPI document lists the routes; the UI and its assets come from this node", async () => {
    const doc = await json(await fetch(base + "/swagger/json"));
    expect(doc.status).toBe(200);
    expect(Object.keys(doc.body.paths)).toEqual(expect.arrayContaining(["/health", "/echo"]));
    const page = await (await fetch(base + "/swagger")).text();
    const refs = [...page.matchAll(/(?:src|href)="([^"]+)"/g)].map((m) => m[1]!);
    expect(refs.length).toBeGreaterThanOrEqual(3);
    for (const ref of refs) {
      expect(ref.startsWith("/swagger/assets/")).toBe(true);
      const a = await fetch(base + ref);
      expect(a.status).toBe(200);
      expect((await a.arrayBuffer()).byteLength).toBeGreaterThan(100);
    }
    expect((await fetch(base + "/swagger/_plugin_ui")).status).toBe(404);
    expect((await fetch(base + "/swagger/assets/../../package.json")).status).not.toBe(200);
  });
});

// The node's whole route table (sandboxes, templates, nodes) over a real store while the node
// starts: the OpenAPI document and the routes that answer before an orchestrator exists.
describe("the node's routes before it is ready", () => {
  const home = scratchDir("api-routes");
  const store = new SandboxStore(join(home, "node.db"));
  const templates = new TemplateStore(store.db);
  const starting = () => { throw new ApiError(503, "starting: blockd"); };
  const node = createApi({ apiKey: KEY, maxBodyBytes: 4096, notReadyReason: () => "starting: blockd", version: "0.0.0-test" })
    .use(sandboxRoutes(starting, { domain: null, defaultTimeoutS: 300 }))
    .use(templateRoutes(starting))
    .use(volumeRoutes(starting, { maxBodyBytes: 4096 }))
    .use(secretRoutes(new SecretStore(join(home, "secrets"))))
    .use(nodeRoutes({ store, templates, orch: () => undefined, status: () => "connecting", openStreams: () => undefined, version: "0.0.0-test", home }))
    .listen({ hostname: "127.0.0.1", port: 0 });
  afterAll(() => { node.stop(); store.close(); });
  const url = `http://127.0.0.1:${node.server!.port}`;

  test("Swagger: every route has its parameters and a response schema per status, errors as {code, message}; none hidden", async () => {
    const doc = (await (await fetch(url + "/swagger/json")).json()) as { paths: Record<string, Record<string, any>> };
    const ops = Object.entries(doc.paths).flatMap(([path, methods]) => Object.entries(methods).map(([method, op]) => ({ where: `${method.toUpperCase()} ${path}`, path, op })));
    expect(ops.length).toBeGreaterThanOrEqual(40);
    for (const route of ["GET /metrics", "GET /nodes", "GET /nodes/{nodeID}", "GET /sandboxes/{sandboxID}/custom-extension-params", "PATCH /sandboxes/{sandboxID}/custom-extension-params",
      "POST /secrets", "GET /secrets", "GET /secrets/{secretID}", "POST /secrets/{secretID}", "DELETE /secrets/{secretID}",
      "POST /volumes", "GET /volumes", "GET /volumes/{volumeID}", "DELETE /volumes/{volumeID}", "GET /volumecontent/{volumeID}/path", "PATCH /volumecontent/{volumeID}/path",
      "DELETE /volumecontent/{volumeID}/path", "GET /volumecontent/{volumeID}/dir", "POST /volumecontent/{volumeID}/dir", "GET /volumecontent/{volumeID}/file", "PUT /volumecontent/{volumeID}/file"])
      expect(ops.map((o) => o.where)).toContain(route);
    for (const { where, path, op } of ops) {
      const responses = Object.entries(op.responses ?? {}) as [string, any][];
      // A success with its body's schema (a 202/204 without a body: its description).
      const ok = responses.filter(([s]) => s.startsWith("2"));
      expect({ where, ok: ok.length > 0 }).toEqual({ where, ok: true });
      for (const [status, r] of responses) {
        expect({ where, status, description: typeof r.description }).toEqual({ where, status, description: "string" });
        if (status === "204" || (status === "202" && !r.content)) continue;
        const schema = (Object.values(r.content ?? {})[0] as { schema?: unknown } | undefined)?.schema;
        expect({ where, status, schema: schema !== undefined }).toEqual({ where, status, schema: true });
        if (!status.startsWith("2")) expect({ where, status, required: (schema as any).required }).toEqual({ where, status, required: ["code", "message"] });
      }
      // A route that wants the key says 401, and its path parameters are declared.
      if (!(Array.isArray(op.security) && op.security.length === 0)) expect({ where, has401: !!op.responses["401"] }).toEqual({ where, has401: true });
      const inPath = [...path.matchAll(/\{(\w+)\}/g)].map((m) => m[1]).sort();
      const declared = ((op.parameters ?? []) as { in: string; name: string }[]).filter((p) => p.in === "path").map((p) => p.name).sort();
      expect({ where, params: declared }).toEqual({ where, params: inPath });
    }
  });

  test("volume content takes the volume's token, not the API key, and its errors carry a string code", async () => {
    const r = await fetch(url + "/volumecontent/v1/path?path=/", { headers: { authorization: "Bearer some-volume-token" } });
    expect(r.status).toBe(503);
    expect(await r.json()).toEqual({ code: "503", message: "starting: blockd" });
    const bad = await fetch(url + "/volumecontent/v1/dir?path=/&depth=0", { headers: { authorization: "Bearer t" } });
    expect(bad.status).toBe(400);
    expect(((await bad.json()) as { code: unknown }).code).toBe("400");
    expect((await fetch(url + "/volumes")).status).toBe(401);
    expect(((await (await fetch(url + "/volumes", { headers: auth })).json()) as { code: unknown }).code).toBe(503);
  });

  test("sandbox routes answer 503 {code, message} while the node starts; /nodes and /metrics already answer", async () => {
    const r = await fetch(url + "/v2/sandboxes", { headers: auth });
    expect(r.status).toBe(503);
    expect(await r.json()).toEqual({ code: 503, message: "starting: blockd" });
    // Opaque JSON fields must be objects (validation alone would turn [1] into {"0": 1}).
    for (const body of [{ templateID: "base", customExtensionParams: [1] }, { templateID: "base", network: "open" }]) {
      const bad = await fetch(url + "/v2/sandboxes", { method: "POST", headers: { ...auth, "content-type": "application/json" }, body: JSON.stringify(body) });
      expect(bad.status).toBe(400);
      expect(((await bad.json()) as { message: string }).message).toContain("must be a JSON object");
    }
    const nodes = (await (await fetch(url + "/nodes", { headers: auth })).json()) as any[];
    expect(nodes.length).toBe(1);
    expect(nodes[0]).toMatchObject({ id: hostname(), clusterID: CLUSTER_ID, status: "connecting", sandboxCount: 0, sandboxStartingCount: 0, sandboxPausedCount: 0, createSuccesses: 0 });
    expect(nodes[0].metrics.cpuCount).toBeGreaterThan(0);
    expect(nodes[0].metrics.disks[0].totalBytes).toBeGreaterThan(0);
    expect(await (await fetch(url + `/nodes?clusterID=${"1".repeat(8)}-0000-0000-0000-000000000000`, { headers: auth })).json()).toEqual([]);
    const one = (await (await fetch(url + `/nodes/${hostname()}`, { headers: auth })).json()) as any;
    expect(one).toMatchObject({ id: hostname(), cachedBuilds: [] });
    expect(one.sandboxStartingCount).toBeUndefined();
    const other = await fetch(url + "/nodes/elsewhere", { headers: auth });
    expect(other.status).toBe(404);
    expect(((await other.json()) as { code: number }).code).toBe(404);
    expect((await fetch(url + "/nodes")).status).toBe(401);
    const prom = await fetch(url + "/metrics");
    expect(prom.headers.get("content-type")).toContain("text/plain");
    expect(await prom.text()).toContain("aenv_ready 0");
  });
});
