// Sandbox network policy end to end: a real VM (QEMU, busybox template, our envd) created through
// the node's API with an egress policy, talking to the test "internet" (test/network/internet.ts)
// with busybox nc; PUT /sandboxes/{id}/network live, bad input refused with the field named, the
// inbound Host mask, a header rule's secret that reaches the server but never the VM, the node's CA
// in the guest's trust store. Traffic goes only to namespaces and veths this file creates.
import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { createHash } from "node:crypto";
import { join } from "node:path";
import { Sandbox } from "e2b";
import { DEFAULT_ALWAYS_DENIED, Egress, EgressCa, EgressProxy, SecretStore, type SlotPool } from "../../src/network/index.ts";
import type { Orchestrator } from "../../src/orchestrator/orchestrator.ts";
import { startBlockd } from "../blockdev/harness.ts";
import { startInternet, type TestInternet } from "../network/internet.ts";
import { nodeParts, sandboxSkipReason, serveParts } from "./harness.ts";
import { rmrf, runRoot } from "../vmm/harness.ts";

const skip = sandboxSkipReason();
const KEY = "e2b_" + "ef".repeat(20);
const tag = ((process.pid + 11) % 46656).toString(36).padStart(3, "0");

describe.skipIf(!!skip)("sandbox network policy through the API (QEMU, slots, egress proxy)", async () => {
  if (skip) return void test.skip(skip!, () => {});
  const { dir, client } = await startBlockd("orchnet", { pool: 1 });
  const root = runRoot("orchnet");
  let orch: Orchestrator;
  let pool: SlotPool;
  let egress: Egress;
  let net: TestInternet;
  let proxy: EgressProxy;
  let stopServer = () => {};
  let base = "";
  const ca = EgressCa.generate();
  const secret = `vm-secret-${process.pid}-${Date.now()}`;
  const opts = () => ({ apiKey: KEY, apiUrl: base, sandboxUrl: base, requestTimeoutMs: 120_000 });
  const api = (method: string, path: string, body?: unknown) =>
    fetch(base + path, { method, headers: { "x-api-key": KEY, "content-type": "application/json" }, body: body === undefined ? undefined : JSON.stringify(body) });

  beforeAll(async () => {
    net = await startInternet();
    const secrets = new SecretStore(join(dir, "secrets"));
    await secrets.create("tok", secret);
    proxy = new EgressProxy({ resolvers: [net.ips[0]!], ca, secrets, upstreamCa: [net.certPem] }).listen();
    const parts = await nodeParts({ dir, runRoot: root, slotPrefix: `aon${tag}-`, slotCidr: `10.216.${process.pid % 250}.0/24` }, client, {
      egress: async (cfg) => {
        egress = new Egress(cfg, { alwaysDenied: DEFAULT_ALWAYS_DENIED, resolvers: [net.ips[0]!], uplinks: [net.uplink], proxyPort: proxy.port });
        proxy.use(egress);
        await egress.start();
        return egress;
      },
      caBundle: ca.certPem,
    });
    ({ orch, pool } = parts);
    const served = serveParts(orch, KEY);
    base = served.base;
    stopServer = served.stop;
  }, 300_000);

  afterAll(async () => {
    await orch?.killAll();
    orch?.close();
    stopServer();
    proxy?.stop();
    await pool?.destroy().catch(() => {});
    await net?.stop();
    rmrf(root);
  });

  /** An HTTP/1.0 request from inside the VM with busybox nc; what came back (or the exit code). */
  const httpFromVm = (s: Sandbox, ip: string, host: string) =>
    s.commands.run(`printf 'GET / HTTP/1.0\\r\\nHost: ${host}\\r\\n\\r\\n' | nc -w 5 ${ip} 80; echo " rc=$?"`).then((r) => r.stdout.trim());
  const echoFromVm = (s: Sandbox, ip: string) =>
    s.commands.run(`echo hello | nc -w 3 ${ip} 7; echo " rc=$?"`).then((r) => r.stdout.trim());

  test("create with domain and CIDR rules, replace them live, bad input keeps the old policy", async () => {
    const [a, b] = net.ips as [string, string];
    const r = await api("POST", "/v2/sandboxes", { templateID: "busybox", network: { allowOut: ["*.a.test"], denyOut: ["0.0.0.0/0"] } });
    expect(r.status).toBe(201);
    const id = ((await r.json()) as { sandboxID: string }).sandboxID;
    const s = await Sandbox.connect(id, opts());
    expect(await httpFromVm(s, a, "x.a.test")).toContain(`x.a.test@${a}`);
    expect(await httpFromVm(s, a, "b.test")).toContain("403 Forbidden");
    expect(await echoFromVm(s, a)).not.toContain("hello");

    // Malformed: 400 naming the field; the policy in force stays.
    const bad = await api("PUT", `/sandboxes/${id}/network`, { allowOut: ["1.2.3.4", "not a domain!"] });
    expect(bad.status).toBe(400);
    expect(((await bad.json()) as { message: string }).message).toContain("network.allowOut[1]");
    expect(await httpFromVm(s, a, "x.a.test")).toContain(`x.a.test@${a}`);
    expect((await api("PUT", "/sandboxes/nosuchsandbox/network", {})).status).toBe(404);

    // Replaced live: only b's address now (domains and the rest cleared).
    expect((await api("PUT", `/sandboxes/${id}/network`, { allowOut: [b], allow_internet_access: false })).status).toBe(204);
    expect(await echoFromVm(s, b)).toContain("hello");
    expect(await echoFromVm(s, a)).not.toContain("hello");
    const info = (await (await api("GET", `/sandboxes/${id}`)).json()) as { allowInternetAccess: boolean | null; network: { allowOut?: string[]; denyOut?: string[] } };
    expect(info.allowInternetAccess).toBe(false);
    expect(info.network.allowOut).toEqual([b]);
    expect(info.network.denyOut).toBeUndefined();

    // Internal ranges stay closed whatever is allowed.
    expect((await api("PUT", `/sandboxes/${id}/network`, { allowOut: ["0.0.0.0/0"] })).status).toBe(204);
    expect(await echoFromVm(s, net.internalIp)).not.toContain("hello");
    expect(await echoFromVm(s, a)).toContain("hello");

    const slot = (orch.store.get(id)!.runtime as { slot: { id: number } }).slot;
    expect(egress.get(slot)).toBeDefined();
    await s.kill();
    expect(egress.get(slot)).toBeUndefined();
  }, 300_000);

  test("a header rule's secret (E2B's placeholder) reaches the server and never the VM or the sandbox's record; the node's CA is in the guest's trust store", async () => {
    const [a] = net.ips as [string];
    const rules = { "x.a.test": [{ transform: { headers: { Authorization: "${e2b.secrets.tok}" } } }] };
    const r = await api("POST", "/v2/sandboxes", { templateID: "busybox", network: { allowOut: ["x.a.test"], denyOut: ["0.0.0.0/0"], rules } });
    expect(r.status).toBe(201);
    const id = ((await r.json()) as { sandboxID: string }).sandboxID;
    // GET /sandboxes/{id} answers the placeholder as it was given, never the value.
    const info = await (await api("GET", `/sandboxes/${id}`)).text();
    expect(JSON.parse(info).network.rules).toEqual(rules);
    expect(info).not.toContain(secret);
    const s = await Sandbox.connect(id, opts());
    const got = await s.commands.run(`printf 'GET /auth HTTP/1.0\\r\\nHost: x.a.test\\r\\n\\r\\n' | nc -w 5 ${a} 80`).then((x) => x.stdout);
    expect(got).toContain(createHash("sha256").update(secret).digest("hex"));
    expect(got).not.toContain(secret);
    const seen = await s.commands.run("env; cat /proc/[0-9]*/environ 2>/dev/null | tr '\\0' '\\n'; true").then((x) => x.stdout);
    expect(seen).toContain("E2B_SANDBOX_ID");
    expect(seen).not.toContain(secret);
    const bundle = await s.commands.run("cat /etc/ssl/certs/ca-certificates.crt /usr/local/share/ca-certificates/aenv-*.crt").then((x) => x.stdout);
    expect(bundle.split(ca.certPem.trim()).length - 1).toBe(2);
    // A rule naming a secret that is not a name: 400, the rules in force stay.
    const bad = await api("PUT", `/sandboxes/${id}/network`, { allowOut: ["x.a.test"], rules: { "x.a.test": [{ transform: { headers: { Authorization: "${e2b.secrets.sec_x}" } } }] } });
    expect(bad.status).toBe(400);
    expect(((await bad.json()) as { message: string }).message).toContain('network.rules["x.a.test"][0].transform.headers["Authorization"]');
    await s.kill();
  }, 300_000);

  test("create refuses a malformed policy naming the field", async () => {
    const before = orch.store.count();
    for (const [body, field] of [
      [{ templateID: "busybox", network: { denyOut: ["10.0.0.1/8"] } }, "network.denyOut[0]"],
      [{ templateID: "busybox", network: { maskRequestHost: "a b" } }, "network.maskRequestHost"],
      [{ templateID: "busybox", network: { httpsPorts: [70000] } }, "network.httpsPorts[0]"],
      [{ templateID: "busybox", network: { egressProxy: { address: "nowhere" } } }, "network.egressProxy.address"],
      [{ templateID: "busybox", network: { rules: { "a.test": [{ tls: "always" }] } } }, 'network.rules["a.test"][0].tls'],
    ] as const) {
      const r = await api("POST", "/v2/sandboxes", body);
      expect(r.status).toBe(400);
      expect(((await r.json()) as { message: string }).message).toContain(field);
    }
    expect(orch.store.count()).toBe(before);
  });

  test("inbound: maskRequestHost rewrites the Host a sandbox port sees, ${PORT} replaced", async () => {
    const r = await api("POST", "/v2/sandboxes", { templateID: "busybox", network: { maskRequestHost: "app.example:${PORT}" } });
    const id = ((await r.json()) as { sandboxID: string }).sandboxID;
    const s = await Sandbox.connect(id, opts());
    // A one-shot HTTP server in the VM that answers with the request head it got.
    await s.commands.run(`(printf 'HTTP/1.0 200 OK\\r\\n\\r\\n'; sleep 2) | nc -l -p 8080 > /tmp/req.txt`, { background: true });
    let got = "";
    for (let i = 0; i < 50 && !got.includes("app.example"); i++) {
      const res = await fetch(`${base}/proxy/${id}/8080/x`).catch(() => undefined);
      await res?.text();
      await Bun.sleep(200);
      got = (await s.commands.run("cat /tmp/req.txt")).stdout;
    }
    expect(got.toLowerCase()).toContain("host: app.example:8080");
    await s.kill();
  }, 180_000);
});
