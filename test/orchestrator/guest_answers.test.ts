// The node reads what a guest serves it with a bound on bytes and on time: a loopback HTTP server
// plays a hostile envd (an endless body at loopback speed, a body that drips a byte at a time) on
// every path the node asks (/health, /init, /metrics, process Start, /files).
import { afterAll, expect, test } from "bun:test";
import { writeFileSync } from "node:fs";
import { join } from "node:path";
import {
  ENVD_HEALTH_MAX_BYTES, ENVD_METRICS_MAX_BYTES, GuestAnswerTimeoutError, GuestAnswerTooLargeError, envdMetrics, initEnvd, readBounded, waitEnvdReady,
} from "../../src/orchestrator/envd.ts";
import { EnvdProcessError, runProcess, uploadFile } from "../../src/orchestrator/envd_process.ts";
import { scratchDir } from "../helpers/tmp.ts";

/** Bytes the hostile server has handed to its sockets: endless bodies in all, the most for one request, and drips. */
const sent = { endless: 0, endlessMostPerRequest: 0, drip: 0 };
const CHUNK = 64 << 10;

function endless(): ReadableStream<Uint8Array> {
  let mine = 0;
  return new ReadableStream({
    pull(c) {
      sent.endless += CHUNK;
      mine += CHUNK;
      sent.endlessMostPerRequest = Math.max(sent.endlessMostPerRequest, mine);
      c.enqueue(new Uint8Array(CHUNK).fill(0x78));
    },
  });
}
function drip(): ReadableStream<Uint8Array> {
  return new ReadableStream({
    async pull(c) {
      await Bun.sleep(100);
      sent.drip += 1;
      c.enqueue(new Uint8Array([0x78]));
    },
  });
}

// /<mode>/<envd path>: mode endless or drip; status 200 (500 for Start and /init, which read error texts).
const server = Bun.serve({
  port: 0,
  hostname: "127.0.0.1",
  idleTimeout: 0,
  async fetch(req) {
    const [, mode, ...rest] = new URL(req.url).pathname.split("/");
    const path = `/${rest.join("/")}`;
    if (req.body) for await (const _ of req.body) { /* take the upload */ }
    const status = path === "/init" || path.startsWith("/process.Process") ? 500 : 200;
    return new Response(mode === "drip" ? drip() : endless(), { status, headers: { "content-type": "application/json" } });
  },
});
afterAll(() => server.stop(true));
const url = (mode: "endless" | "drip") => `http://127.0.0.1:${server.port}/${mode}`;

/** At most this much may leave the server per request: the bound plus what socket buffers hold. */
const SENT_LIMIT = 32 << 20;

test("readBounded: an endless body stops at the bound (named error, stream cancelled); a dripping one at its deadline", async () => {
  sent.endless = 0;
  const t0 = performance.now();
  const big = await readBounded(await fetch(`${url("endless")}/x`), 1 << 20, "endless").catch((e) => e);
  expect(big).toBeInstanceOf(GuestAnswerTooLargeError);
  expect(big.message).toContain("more than 1048576 bytes");
  expect(sent.endless).toBeLessThan(SENT_LIMIT);

  const signal = AbortSignal.timeout(500);
  const slow = await readBounded(await fetch(`${url("drip")}/x`, { signal }), 1 << 20, "drip", signal).catch((e) => e);
  expect(slow).toBeInstanceOf(GuestAnswerTimeoutError);
  console.log(`  endless: refused after ${sent.endless} bytes sent; both in ${Math.round(performance.now() - t0)} ms`);

  // A declared length past the bound is refused before any byte is read.
  const declared = await readBounded(new Response("x".repeat(100), { headers: { "content-length": "100" } }), 10, "declared").catch((e) => e);
  expect(declared).toBeInstanceOf(GuestAnswerTooLargeError);
  expect(new TextDecoder().decode(await readBounded(new Response("fine"), 10, "small"))).toBe("fine");
}, 20_000);

test("envd readiness: /health answering an endless or dripping body costs a bounded read per poll, then gives up at its deadline", async () => {
  for (const mode of ["endless", "drip"] as const) {
    sent.endlessMostPerRequest = 0;
    const t0 = performance.now();
    const err = await waitEnvdReady(url(mode), 1500, () => true).catch((e) => e);
    const ms = performance.now() - t0;
    expect(err.name).toBe("EnvdUnreachableError");
    expect(err.message).toMatch(mode === "endless" ? /more than 4096 bytes/ : /not read within its time/);
    expect(ms).toBeLessThan(5000);
    if (mode === "endless") expect(sent.endlessMostPerRequest).toBeLessThan(SENT_LIMIT);
    console.log(`  /health ${mode}: gave up in ${Math.round(ms)} ms${mode === "endless" ? `, at most ${sent.endlessMostPerRequest} bytes sent per poll` : ""}`);
  }
  expect(ENVD_HEALTH_MAX_BYTES).toBe(4096);
}, 30_000);

test("/init: an endless or dripping error answer is bounded; the call ends at its deadline", async () => {
  for (const mode of ["endless", "drip"] as const) {
    sent.endlessMostPerRequest = 0;
    const t0 = performance.now();
    const err = await initEnvd(url(mode), { accessToken: "t", currentToken: null, envVars: {} }, 1000).catch((e) => e);
    expect(err.name).toBe("EnvdUnreachableError");
    expect(performance.now() - t0).toBeLessThan(8000);
    if (mode === "endless") expect(sent.endlessMostPerRequest).toBeLessThan(SENT_LIMIT);
  }
}, 30_000);

test("/metrics: an endless body, a dripping one or one that is not numbers give no sample; the numbers of a good one are kept", async () => {
  sent.endless = 0;
  expect(await envdMetrics(url("endless"), "t")).toBeUndefined();
  expect(sent.endless).toBeLessThan(SENT_LIMIT);
  const t0 = performance.now();
  expect(await envdMetrics(url("drip"), "t")).toBeUndefined();
  expect(performance.now() - t0).toBeLessThan(7000); // ENVD_METRICS_TIMEOUT_MS is 5 s
  const good = Bun.serve({
    port: 0, hostname: "127.0.0.1",
    fetch: () => Response.json({ ts: 1e300, cpu_count: 2, cpu_used_pct: "x", mem_used: 5, other: 1 }),
  });
  try {
    // ts past what a Date holds and a string are left out: the sample keeps its defaults for them.
    expect(await envdMetrics(`http://127.0.0.1:${good.port}`, null)).toEqual({ cpu_count: 2, mem_used: 5 });
  } finally {
    good.stop(true);
  }
  expect(ENVD_METRICS_MAX_BYTES).toBe(65536);
}, 30_000);

test("process Start and /files upload: endless answers are bounded, named errors", async () => {
  sent.endless = 0;
  const start = await runProcess(url("endless"), null, { cmd: "true", args: [], user: "root" }, { timeoutMs: 5000 }).catch((e) => e);
  expect(start).toBeInstanceOf(EnvdProcessError);
  expect(start.message).toContain("more than 65536 bytes");
  expect(sent.endless).toBeLessThan(SENT_LIMIT);
  const file = join(scratchDir("guest-answers"), "f");
  writeFileSync(file, "data");
  sent.endless = 0;
  const up = await uploadFile(url("endless"), null, "root", "/tmp/f", file, 5000).catch((e) => e);
  expect(up).toBeInstanceOf(GuestAnswerTooLargeError);
  expect(sent.endless).toBeLessThan(SENT_LIMIT);
  const t0 = performance.now();
  const slow = await uploadFile(url("drip"), null, "root", "/tmp/f", file, 800).catch((e) => e);
  expect(slow).toBeInstanceOf(GuestAnswerTimeoutError);
  expect(performance.now() - t0).toBeLessThan(3000);
}, 30_000);
