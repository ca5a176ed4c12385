// The proxy of `bun run node` end to end, from the host's side: a python server in a base sandbox
// sends an SSE stream (reached by x-agentenv-* headers), 1 GiB each way, and the auto-resume of a
// paused sandbox by its traffic; a paused one without auto-resume answers E2B's 502.
import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { readFileSync } from "node:fs";
import { Sandbox } from "e2b";
import { FIRST_START_MS, nodeSetup, nodeSkipReason, startNode, stopNode, until, type NodeProc } from "./harness.ts";

const skip = nodeSkipReason();
const KEY = "e2b_" + "6c".repeat(20);
const GIB = 1 << 30;
/** The node's RSS may grow by at most this while 1 GiB passes each way (streamed, not buffered). */
const RSS_GROWTH_MAX = 300 << 20;
const PORT = 8000;

// GET /sse: one event, the next only once /tmp/sse-go exists; GET /down/N: N bytes; POST /up: the
// byte count of a chunked or sized body; GET /hello: the sandbox's mark. Standard library only.
const SERVER = `
import http.server, os, time
BLOCK = bytes(range(256)) * 4096
class H(http.server.BaseHTTPRequestHandler):
    def log_message(self, *a): pass
    def reply(self, body, ctype='text/plain'):
        self.send_response(200); self.send_header('content-type', ctype); self.send_header('content-length', str(len(body))); self.end_headers(); self.wfile.write(body)
    def do_GET(self):
        if self.path == '/sse':
            self.send_response(200); self.send_header('content-type', 'text/event-stream'); self.send_header('cache-control', 'no-cache'); self.end_headers()
            self.wfile.write(b'data: one\\n\\n')
            for _ in range(1200):
                if os.path.exists('/tmp/sse-go'): break
                time.sleep(0.05)
            self.wfile.write(b'data: two\\n\\n')
        elif self.path.startswith('/down/'):
            n = int(self.path[6:])
            self.send_response(200); self.send_header('content-type', 'application/octet-stream'); self.send_header('content-length', str(n)); self.end_headers()
            while n > 0:
                k = min(n, len(BLOCK)); self.wfile.write(BLOCK[:k] if k < len(BLOCK) else BLOCK); n -= k
        else:
            self.reply(open('/tmp/mark', 'rb').read())
    def do_POST(self):
        buf = memoryview(bytearray(1 << 20)); n = 0
        def drain(left):
            while left:
                k = self.rfile.readinto(buf[:min(left, len(buf))])
                if not k: raise EOFError('body cut')
                left -= k
        if 'chunked' in (self.headers.get('transfer-encoding') or '').lower():
            while True:
                size = int(self.rfile.readline().split(b';')[0], 16)
                if size == 0:
                    while self.rfile.readline() not in (b'\\r\\n', b''): pass
                    break
                drain(size); n += size; self.rfile.readline()
        else:
            n = int(self.headers.get('content-length') or 0); drain(n)
        self.reply(str(n).encode())
http.server.ThreadingHTTPServer(('0.0.0.0', ${PORT}), H).serve_forever()
`;

/** The node's resident set, in bytes. */
function rssOf(pid: number): number {
  return Number(/^VmRSS:\s+(\d+) kB/m.exec(readFileSync(`/proc/${pid}/status`, "utf8"))?.[1] ?? 0) * 1024;
}

/** Reads `reader` into `seen.text` until `want` is in it; throws after `ms` or at the stream's end. */
async function readUntil(reader: { read(): Promise<{ done: boolean; value?: Uint8Array }> }, seen: { text: string }, want: string, ms: number): Promise<void> {
  const dec = new TextDecoder();
  const deadline = Date.now() + ms;
  while (!seen.text.includes(want)) {
    const left = deadline - Date.now();
    const next = await Promise.race([reader.read(), Bun.sleep(Math.max(0, left)).then(() => "timeout" as const)]);
    if (next === "timeout") throw new Error(`no ${JSON.stringify(want)} within ${ms} ms; got ${JSON.stringify(seen.text)}`);
    if (next.done) throw new Error(`stream ended before ${JSON.stringify(want)}; got ${JSON.stringify(seen.text)}`);
    seen.text += dec.decode(next.value, { stream: true });
  }
}

describe.skipIf(!!skip)("the node's proxy", () => {
  if (skip) return void test.skip(skip!, () => {});
  const setup = nodeSetup("apx", 226, KEY);
  const { tag, env } = setup;
  let node: NodeProc;
  let sbx: Sandbox;
  const opts = () => ({ apiKey: KEY, apiUrl: node.base, sandboxUrl: node.base, requestTimeoutMs: 180_000 });
  const viaHeaders = (id: string, port = PORT) => ({ "x-agentenv-sandbox-id": id, "x-agentenv-target-port": String(port) });
  const hello = (id: string) => fetch(`${node.base}/hello`, { headers: viaHeaders(id) });
  const resumedLines = (id: string) => node.log.filter((l) => l.includes(`proxy: sandbox ${id} resumed by traffic`)).length;

  beforeAll(async () => {
    node = await startNode(env, FIRST_START_MS);
    // Auto-resume needs onTimeout "pause" (the SDK checks); a long TTL, so only the test pauses it.
    sbx = await Sandbox.create({ ...opts(), metadata: { tag }, timeoutMs: 1800_000, lifecycle: { onTimeout: "pause", autoResume: true } });
    await sbx.files.write("/tmp/srv.py", SERVER);
    await sbx.files.write("/tmp/mark", `sandbox ${sbx.sandboxId}`);
    await sbx.commands.run("python3 /tmp/srv.py", { background: true, timeoutMs: 0 });
    await until(async () => (await hello(sbx.sandboxId).catch(() => undefined))?.status === 200, 60_000, "the server answers through the proxy");
  }, FIRST_START_MS + 180_000);

  afterAll(() => stopNode(node, setup), 180_000);

  test("x-agentenv-sandbox-id + x-agentenv-target-port route a request; the id alone reaches envd", async () => {
    const r = await hello(sbx.sandboxId);
    expect(await r.text()).toBe(`sandbox ${sbx.sandboxId}`);
    const envd = await fetch(`${node.base}/health`, { headers: { "x-agentenv-sandbox-id": sbx.sandboxId } });
    expect(envd.status).toBe(204);
  }, 60_000);

  test("SSE arrives event by event: the first is read before the server sends the second", async () => {
    const r = await fetch(`${node.base}/sse`, { headers: viaHeaders(sbx.sandboxId) });
    expect(r.status).toBe(200);
    expect(r.headers.get("content-type")).toBe("text/event-stream");
    const reader = r.body!.getReader();
    const seen = { text: "" };
    await readUntil(reader, seen, "data: one\n\n", 30_000);
    expect(seen.text).toBe("data: one\n\n"); // the server holds the second until /tmp/sse-go exists
    await sbx.files.write("/tmp/sse-go", "go");
    await readUntil(reader, seen, "data: two\n\n", 30_000);
    expect(seen.text).toBe("data: one\n\ndata: two\n\n");
    expect((await reader.read()).done).toBe(true);
  }, 90_000);

  test("1 GiB down and 1 GiB up through the proxy, streamed: the node's RSS stays bounded", async () => {
    const pid = node.proc.pid;
    const before = rssOf(pid);
    let peak = before;
    const sampler = setInterval(() => void (peak = Math.max(peak, rssOf(pid))), 100);
    try {
      let t0 = performance.now();
      const down = await fetch(`${node.base}/down/${GIB}`, { headers: viaHeaders(sbx.sandboxId) });
      expect(down.status).toBe(200);
      let got = 0;
      for await (const chunk of down.body!) got += chunk.byteLength;
      expect(got).toBe(GIB);
      const downS = (performance.now() - t0) / 1000;

      t0 = performance.now();
      let sent = 0;
      const chunk = 1 << 20;
      const body = new ReadableStream<Uint8Array>({
        pull(c) {
          if (sent >= GIB) return c.close();
          c.enqueue(new Uint8Array(chunk).fill(sent / chunk & 0xff));
          sent += chunk;
        },
      }, { highWaterMark: 0 });
      const up = await fetch(`${node.base}/up`, { method: "POST", headers: viaHeaders(sbx.sandboxId), body, duplex: "half" } as RequestInit);
      expect(up.status).toBe(200);
      expect(await up.text()).toBe(String(GIB));
      const upS = (performance.now() - t0) / 1000;
      console.log(`  1 GiB down ${downS.toFixed(1)} s, up ${upS.toFixed(1)} s; node RSS ${before >> 20} MiB, peak ${peak >> 20} MiB`);
    } finally {
      clearInterval(sampler);
    }
    expect(peak - before).toBeLessThan(RSS_GROWTH_MAX);
  }, 900_000);

  test("auto-resume: traffic resumes a paused sandbox once for concurrent requests; its TTL is never shortened", async () => {
    const id = sbx.sandboxId;
    const endAt = (await Sandbox.getInfo(id, opts())).endAt.getTime();
    expect(await sbx.pause()).toBe(true);
    // A TTL longer than 300 s stays as it was.
    const answers = await Promise.all(Array.from({ length: 8 }, () => hello(id).then(async (r) => `${r.status} ${await r.text()}`)));
    expect(answers).toEqual(Array(8).fill(`200 sandbox ${id}`));
    expect(resumedLines(id)).toBe(1);
    let info = await Sandbox.getInfo(id, opts());
    expect(info.state).toBe("running");
    expect(info.endAt.getTime()).toBe(endAt);
    // One shorter than 300 s is topped up to now + 300 s.
    expect(await sbx.pause()).toBe(true);
    const set = await fetch(`${node.base}/sandboxes/${id}/timeout`, { method: "POST", headers: { "x-api-key": KEY, "content-type": "application/json" }, body: JSON.stringify({ timeout: 5 }) });
    expect(set.status).toBe(204);
    const t0 = Date.now();
    expect(await (await hello(id)).text()).toBe(`sandbox ${id}`);
    expect(resumedLines(id)).toBe(2);
    info = await Sandbox.getInfo(id, opts());
    expect(info.state).toBe("running");
    expect(info.endAt.getTime()).toBeGreaterThanOrEqual(t0 + 300_000);
    expect(info.endAt.getTime()).toBeLessThanOrEqual(Date.now() + 300_000);
  }, 300_000);

  test("a paused sandbox without auto-resume answers 502 'not found' and stays paused; isRunning() is false", async () => {
    const other = await Sandbox.create({ ...opts(), metadata: { tag } });
    expect(await other.pause()).toBe(true);
    const r = await fetch(`${node.base}/health`, { headers: { "x-agentenv-sandbox-id": other.sandboxId } });
    expect(r.status).toBe(502);
    expect(await r.json()).toEqual({ sandboxId: other.sandboxId, message: "The sandbox was not found", code: 502 });
    expect(await other.isRunning()).toBe(false);
    expect((await Sandbox.getInfo(other.sandboxId, opts())).state).toBe("paused");
    expect(resumedLines(other.sandboxId)).toBe(0);
    expect(await other.kill()).toBe(true);
  }, 180_000);
});
