import { afterAll, describe, expect, test } from "bun:test";
import { t } from "elysia";
import { createApi } from "../../src/api/app.ts";
import { ApiError, conflict } from "../../src/api/errors.ts";

const KEY = "e2b_" + "ab".repeat(20);
let notReady: string | undefined = "blockd is starting";
const app = createApi({ apiKey: KEY, maxBodyBytes: 4096, notReadyReason: () => notReady, version: "0.0.0-test" })
  .post("/echo", ({ body }) => body, { body: t.Object({ n: t.Number() }) })
  .post("/busy", () => { throw conflict("sandbox is pausing"); })
  .get("/boom", () => { throw new Error("secret internal detail"); })
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

  test("bad input: malformed JSON, wrong types, oversized (also chunked), wrong content type → 4xx {code, message}", async () => {
    const post = (body: string | ReadableStream<Uint8Array>, h: Record<string, string> = { "content-type": "application/json" }) =>
      fetch(base + "/echo", { method: "POST", headers: { ...auth, ...h }, body });
    for (const [r, status] of [
      [await post("{bad"), 400],
      [await post('{"n":"x"}'), 400],
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
