// initEnvd against a real envd (a host process): the orchestrator's /init must land exactly once
// in effect even when an attempt's answer is lost, as under a loaded TCG guest.
import { afterAll, beforeAll, expect, test } from "bun:test";
import { initEnvd } from "../../src/orchestrator/envd.ts";
import { startEnvd, type Envd } from "../envd/harness.ts";

let envd: Envd;
beforeAll(async () => { envd = await startEnvd(); });
afterAll(async () => { await envd?.stop(); });

const envsWith = (token: string) => fetch(`${envd.url}/envs`, { headers: { "x-access-token": token } });

test("an /init whose answer is lost is retried with proof of the new token: the token changes once, no 401", async () => {
  await initEnvd(envd.url, { accessToken: "old-token", currentToken: null, envVars: { A: "1" } }, 10_000);
  expect((await envsWith("old-token")).status).toBe(200);
  // A relay that passes every request on but holds back the first answer past the attempt's timeout.
  let calls = 0;
  const relay = Bun.serve({
    port: 0, hostname: "127.0.0.1",
    async fetch(req) {
      const url = new URL(req.url);
      const upstream = await fetch(`${envd.url}${url.pathname}`, { method: req.method, headers: req.headers, body: await req.arrayBuffer() });
      const body = await upstream.arrayBuffer();
      if (calls++ === 0) await Bun.sleep(3000); // envd has applied it; the orchestrator never hears
      return new Response(body, { status: upstream.status, headers: upstream.headers });
    },
  });
  try {
    await initEnvd(`http://127.0.0.1:${relay.port}`, { accessToken: "new-token", currentToken: "old-token", envVars: { A: "2" } }, 15_000);
  } finally {
    relay.stop(true);
  }
  expect(calls).toBeGreaterThanOrEqual(2);
  expect((await envsWith("old-token")).status).toBe(401);
  const r = await envsWith("new-token");
  expect(r.status).toBe(200);
  expect(((await r.json()) as Record<string, string>).A).toBe("2");
}, 30_000);

test("a wrong current token is still refused at once, naming envd's answer", async () => {
  const err = await initEnvd(envd.url, { accessToken: "x", currentToken: "not-the-token", envVars: {} }, 10_000).catch((e) => e);
  expect(err).toBeInstanceOf(Error);
  expect(String(err.message)).toContain("401");
});
