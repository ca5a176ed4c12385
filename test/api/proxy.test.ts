// The proxy (src/api/proxy.ts) without a VM: the real SandboxProxy and serveNode over a stand-in for
// the orchestrator (the four members the proxy calls) whose sandboxes' ports are loopback servers:
// envd's internal paths however a request spells them, the traffic token, WebSocket backpressure.
import { afterAll, describe, expect, spyOn, test } from "bun:test";
import * as nodeCrypto from "node:crypto";
import { connect } from "node:net";
import type { ServerWebSocket } from "bun";
import { SandboxProxy, WS_BUFFERED_MAX } from "../../src/api/proxy.ts";
import { serveNode } from "../../src/api/server.ts";
import { ENVD_PORT } from "../../src/orchestrator/envd.ts";
import type { Orchestrator } from "../../src/orchestrator/orchestrator.ts";

const APP_PORT = 8080;
/** A message of the WebSocket tests. */
const WS_MESSAGE_BYTES = 64 << 10;
/** What each WebSocket test pushes through a side that does not read. */
const WS_TOTAL_BYTES = 64 << 20;
/** Read but not yet relayed when a side pauses: one socket read of messages (Bun reads up to 512 KiB), twice for margin. */
const WS_IN_FLIGHT_SLACK = 1 << 20;

/** The paths envd and the app on APP_PORT were asked for, in order (path and query as they arrived). */
const seen: string[] = [];
type Side = { ws: ServerWebSocket<string>; sent: number; received: number; pump?: () => void };
const upstreamWs: Side[] = [];

function upstream() {
  return Bun.serve({
    hostname: "127.0.0.1",
    port: 0,
    fetch(req, server) {
      const url = new URL(req.url);
      if (url.pathname === "/ws-firehose" || url.pathname === "/ws-sink") return server.upgrade(req, { data: url.pathname }) ? undefined : new Response("no", { status: 400 });
      seen.push(url.pathname + url.search);
      return new Response(`upstream ${url.pathname}${url.search}`);
    },
    websocket: {
      data: "" as string, // the path the upgrade asked for
      open(ws) {
        const side: Side = { ws, sent: 0, received: 0 };
        upstreamWs.push(side);
        if (ws.data === "/ws-sink") return void ws.pause(); // reads nothing until the test resumes it
        // The firehose sends WS_TOTAL_BYTES as fast as its own socket takes them.
        const msg = new Uint8Array(WS_MESSAGE_BYTES);
        side.pump = () => {
          while (side.sent < WS_TOTAL_BYTES && ws.readyState === 1) {
            const n = ws.send(msg);
            if (n === 0) return; // dropped: not expected, the test sees the shortfall
            side.sent += msg.byteLength;
            if (n === -1) return; // backpressure: drain() goes on
          }
        };
        side.pump();
      },
      drain(ws) { upstreamWs.find((s) => s.ws === ws)?.pump?.(); },
      message(ws, m) { const s = upstreamWs.find((x) => x.ws === ws)!; s.received += typeof m === "string" ? m.length : m.byteLength; },
    },
  });
}

const envd = upstream();
const app = upstream();
const TOKEN = "tok-" + "5a".repeat(16);
const sandboxes = new Map<string, { id: string; state: string; autoResume: boolean; trafficAccessToken: string | null; network: null }>([
  ["sbxopen", { id: "sbxopen", state: "running", autoResume: false, trafficAccessToken: null, network: null }],
  ["sbxtoken", { id: "sbxtoken", state: "running", autoResume: false, trafficAccessToken: TOKEN, network: null }],
]);
/** Stand-in for the orchestrator: the proxy reads sandboxes, asks where a port is, and hears of kills. */
const orchestrator = {
  store: { get: (id: string) => sandboxes.get(id) },
  target: (id: string, port: number) => (sandboxes.has(id) ? { host: "127.0.0.1", port: port === ENVD_PORT ? envd.port : app.port } : undefined),
  onGone: () => {},
  connect: () => Promise.reject(new Error("no resumes in this test")),
} as unknown as Orchestrator;
const proxy = new SandboxProxy(orchestrator, { domain: "" });
const node = serveNode({ handle: () => new Response("api", { status: 404 }) }, { hostname: "127.0.0.1", port: 0, proxy: () => proxy });
afterAll(() => { node.stop(true); envd.stop(true); app.stop(true); });

/** One request as written on the wire (no client-side URL cleanup): its status and body. */
function raw(target: string, headers: Record<string, string> = {}): Promise<{ status: number; body: string }> {
  return new Promise((resolve, reject) => {
    const lines = [`GET ${target} HTTP/1.1`, "Host: 127.0.0.1", "Connection: close", ...Object.entries(headers).map(([k, v]) => `${k}: ${v}`)];
    const c = connect(node.port!, "127.0.0.1", () => c.write(lines.join("\r\n") + "\r\n\r\n"));
    let text = "";
    c.on("data", (b) => { text += b.toString("latin1"); });
    c.on("error", reject);
    c.on("end", () => {
      const [head = "", body = ""] = text.split("\r\n\r\n");
      resolve({ status: Number(/^HTTP\/1\.1 (\d{3})/.exec(head)?.[1]), body: /transfer-encoding: chunked/i.test(head) ? unchunk(body) : body });
    });
  });
}
function unchunk(s: string): string {
  let out = "";
  for (let at = 0; ;) {
    const nl = s.indexOf("\r\n", at);
    const n = parseInt(s.slice(at, nl), 16);
    if (!n) return out;
    out += s.slice(nl + 2, nl + 2 + n);
    at = nl + 2 + n + 2;
  }
}
const toEnvd = { "e2b-sandbox-id": "sbxopen" };

describe("envd's internal paths through the proxy", () => {
  test("refused (403) however the path spells them; envd hears none of them", async () => {
    seen.length = 0;
    const spellings = [
      "/init", "//init", "///init?x=1", "/./init", "/x/../init", "/x/%2e%2e/init", "/%69nit", "/%2e/init", "/%2E/init", "/init/", "/init//",
      "/INIT", "/Freeze", "/%66reeze", "/upgrade/.", "/fsthaw/", "/collapse", "/unfreeze",
    ];
    for (const path of spellings) {
      const r = await raw(path, toEnvd);
      expect({ path, status: r.status }).toEqual({ path, status: 403 });
      expect(JSON.parse(r.body)).toMatchObject({ code: 403, sandboxId: "sbxopen" });
    }
    for (const path of ["//init", "/x/../init", "/%69nit", "/INIT"]) expect({ path, status: (await raw(`/proxy/sbxopen/${ENVD_PORT}${path}`)).status }).toEqual({ path, status: 403 });
    expect(seen).toEqual([]);
  });

  test("an encoded slash or backslash is refused (400): a server that decodes it would see other segments", async () => {
    seen.length = 0;
    for (const path of ["/x/..%2finit", "/x/..%2Finit", "/%2finit", "/x%5c..%5cinit", "/files%2F..%2Finit", "/bad%zzescape", "/trailing%"]) {
      const r = await raw(path, toEnvd);
      expect({ path, status: r.status }).toEqual({ path, status: 400 });
      expect(JSON.parse(r.body).code).toBe(400);
    }
    expect(seen).toEqual([]);
  });

  test("other envd paths go through as the path that was checked; the query is untouched", async () => {
    seen.length = 0;
    for (const [sent, arrives] of [
      ["/files?path=%2Ftmp%2Fa&username=user", "/files?path=%2Ftmp%2Fa&username=user"],
      ["//files?path=/x", "/files?path=/x"],
      ["/%66iles/./", "/files"],
      ["/x/../health", "/health"],
      ["/process.Process/Start", "/process.Process/Start"],
    ] as const) {
      const r = await raw(sent, toEnvd);
      expect({ sent, status: r.status, body: r.body }).toEqual({ sent, status: 200, body: `upstream ${arrives}` });
    }
    expect(seen).toEqual(["/files?path=%2Ftmp%2Fa&username=user", "/files?path=/x", "/files", "/health", "/process.Process/Start"]);
  });

  test("a sandbox's own ports get the path as it was sent (no envd rule applies there)", async () => {
    seen.length = 0;
    const r = await raw("/a//b/%2F?q=%2F", { "e2b-sandbox-id": "sbxopen", "e2b-sandbox-port": String(APP_PORT) });
    expect(r).toEqual({ status: 200, body: "upstream /a//b/%2F?q=%2F" });
  });
});

describe("the traffic access token", () => {
  const get = (token?: string) => raw("/hello", { "e2b-sandbox-id": "sbxtoken", "e2b-sandbox-port": String(APP_PORT), ...(token !== undefined ? { "e2b-traffic-access-token": token } : {}) });

  test("the right token passes; missing, wrong, short or long ones are 403; compared in constant time", async () => {
    const compare = spyOn(nodeCrypto, "timingSafeEqual");
    try {
      expect(await get(TOKEN)).toEqual({ status: 200, body: "upstream /hello" });
      expect(compare).toHaveBeenCalled();
    } finally {
      compare.mockRestore();
    }
    const wrongLast = TOKEN.slice(0, -1) + (TOKEN.endsWith("a") ? "b" : "a");
    for (const [what, token] of [["missing", undefined], ["wrong", wrongLast], ["short", TOKEN.slice(0, -1)], ["long", TOKEN + "a"], ["empty", ""]] as const) {
      const r = await get(token);
      expect({ what, status: r.status }).toEqual({ what, status: 403 });
      expect(JSON.parse(r.body).message).toContain("e2b-traffic-access-token");
    }
    // envd's port wants no traffic token (envd has its own).
    expect((await raw("/health", { "e2b-sandbox-id": "sbxtoken" })).status).toBe(200);
  });
});

describe("WebSocket backpressure", () => {
  /** The largest of the proxy's WebSocket buffered bytes, sampled for `ms`. */
  async function peakBuffered(ms: number): Promise<number> {
    let peak = 0;
    for (const end = Date.now() + ms; Date.now() < end; await Bun.sleep(5)) peak = Math.max(peak, proxy.wsBufferedBytes());
    return peak;
  }
  const open = (path: string) => new Promise<WebSocket>((resolve, reject) => {
    const ws = new WebSocket(`ws://127.0.0.1:${node.port}/proxy/sbxopen/${APP_PORT}${path}`);
    ws.binaryType = "arraybuffer";
    ws.onopen = () => resolve(ws);
    ws.onerror = () => reject(new Error(`${path}: the WebSocket did not open`));
  });

  test(`sandbox → a client that does not read: the proxy holds at most ${WS_BUFFERED_MAX} bytes (+ one read); the sandbox is slowed, nothing is lost`, async () => {
    upstreamWs.length = 0;
    let received = 0;
    const client = await open("/ws-firehose");
    client.pause(); // reads nothing: the proxy's send to it backs up
    client.onmessage = (e) => { received += (e.data as ArrayBuffer).byteLength; };
    const side = () => upstreamWs[0]!;
    const peak = await peakBuffered(1500);
    expect(peak).toBeLessThanOrEqual(WS_BUFFERED_MAX + WS_IN_FLIGHT_SLACK);
    expect(side().sent).toBeLessThan(WS_TOTAL_BYTES); // the backpressure reached the sandbox's sender
    client.resume();
    for (const end = Date.now() + 20_000; received < WS_TOTAL_BYTES && Date.now() < end;) await Bun.sleep(20);
    expect({ received, sent: side().sent }).toEqual({ received: WS_TOTAL_BYTES, sent: WS_TOTAL_BYTES });
    client.close();
  }, 30_000);

  test(`client → a sandbox that does not read: the proxy holds at most ${WS_BUFFERED_MAX} bytes (+ one read); nothing is lost`, async () => {
    upstreamWs.length = 0;
    const client = await open("/ws-sink");
    const msg = new Uint8Array(WS_MESSAGE_BYTES);
    for (let n = 0; n < WS_TOTAL_BYTES; n += msg.byteLength) client.send(msg); // the client's own buffer takes them all
    const peak = await peakBuffered(1500);
    expect(peak).toBeLessThanOrEqual(WS_BUFFERED_MAX + WS_IN_FLIGHT_SLACK);
    expect(client.bufferedAmount).toBeGreaterThan(0); // the backpressure reached the sender
    const sink = upstreamWs[0]!;
    sink.ws.resume();
    for (const end = Date.now() + 20_000; sink.received < WS_TOTAL_BYTES && Date.now() < end;) await Bun.sleep(20);
    expect(sink.received).toBe(WS_TOTAL_BYTES);
    client.close();
  }, 30_000);
});
