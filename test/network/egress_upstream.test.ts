// Egress proxies and header rules on real slots: a fake guest (harness.ts) behind a slot talks to
// the test "internet" (internet.ts), whose namespace also runs the upstream egress proxy (SOCKS5 and
// HTTP CONNECT) that prints every tunnel it opens. Nothing leaves for the host's real networks.
import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { createHash, randomBytes } from "node:crypto";
import {
  Egress, EgressCa, EgressProxy, SecretStore, parseEgressPolicy, type EgressProxyOptions, type Slot,
} from "../../src/network/index.ts";
import { scratchDir } from "../helpers/tmp.ts";
import { canRun, slotSuite, egressSlot, slotTestScaffold } from "./harness.ts";
import { fromGuest, startInternet, type TestInternet } from "./internet.ts";

const b64 = (s: string) => Buffer.from(s).toString("base64");

describe.skipIf(!canRun)(slotSuite("egress proxies and header rules"), () => {
  const t = slotTestScaffold();
  let net: TestInternet;
  const ca = EgressCa.generate();
  const secrets = new SecretStore(scratchDir("egress-secrets"));
  const secret = `tok-${randomBytes(12).toString("hex")}`;
  const want = createHash("sha256").update(secret).digest("hex");

  beforeAll(async () => {
    net = await startInternet();
    await secrets.create("tok", secret);
  });
  afterAll(async () => {
    await net?.stop();
  });

  async function setup(o: Partial<EgressProxyOptions> = {}): Promise<{ egress: Egress; proxy: EgressProxy; slot: Slot; guest: string }> {
    const proxy = new EgressProxy({ resolvers: [net.ips[0]!], ca, secrets, upstreamCa: [net.certPem], ...o }).listen();
    t.after(() => proxy.stop());
    return { ...(await egressSlot(t, net, proxy)), proxy };
  }

  test("every allowed TCP connection leaves through the egress proxy: SOCKS5 by name or address, HTTP CONNECT with Basic", async () => {
    const { egress, proxy, slot, guest } = await setup();
    const [a, b, c] = net.ips as [string, string, string];
    await egress.apply(slot, "sbxu", parseEgressPolicy(true, {
      allowOut: ["*.a.test"], denyOut: [c], egressProxy: { address: net.proxyAddress, username: "u1", password: "p1" },
    }));
    const before = net.proxied().length;
    const out = await fromGuest(guest, [
      { op: "http", ip: a, port: 80, host: "x.a.test" }, // allowed by name: tunnelled by name
      { op: "https", ip: a, port: 443, servername: "x.a.test" },
      { op: "http", ip: b, port: 80, host: "h" }, // the internet default: by address
      { op: "raw", ip: a, port: 7, chunks: [b64("hello")] }, // not a proxied port: by address, nothing sniffed
      { op: "http", ip: c, port: 80, host: "h" }, // denyOut
      { op: "dns", server: a, name: "two.test" }, // DNS to the node's resolver stays direct
      { op: "dns", server: b, name: "a.test" }, // any other UDP is refused: nothing leaves but through the proxy
    ]);
    expect(out.slice(0, 5)).toEqual([`x.a.test@${a}`, `x.a.test@${a}`, `h@${b}`, "hello", "status 403"]);
    expect(out[5]).toEqual(net.zone["two.test"]);
    expect(Array.isArray(out[6])).toBe(false);
    const tunnels = net.proxied().slice(before);
    expect(tunnels.map((x) => x.target).sort()).toEqual([`${a}:7`, `${b}:80`, "x.a.test:443", "x.a.test:80"]);
    expect(tunnels.every((x) => x.kind === "socks5" && x.user === "u1" && x.pass === "p1")).toBe(true);

    await egress.apply(slot, "sbxu", parseEgressPolicy(true, { egressProxy: { address: `http://${net.proxyAddress}`, username: "u2", password: "p w2" } }));
    expect(await fromGuest(guest, [{ op: "http", ip: b, port: 80, host: "h" }])).toEqual([`h@${b}`]);
    expect(net.proxied().at(-1)).toEqual({ kind: "http", target: `${b}:80`, user: "u2", pass: "p w2" });

    // A proxy in an always-denied range would let the sandbox reach the node's networks.
    await egress.apply(slot, "sbxu", parseEgressPolicy(true, { egressProxy: { address: `${net.internalIp}:1080` } }));
    expect(await fromGuest(guest, [{ op: "http", ip: b, port: 80, host: "h" }])).toEqual(["status 403"]);
    expect(proxy.statsOf("sbxu").recent.at(-1)?.reason).toContain("always-denied");
  }, 90_000);

  test("header rules: every HTTP request to the host gets the secret, HTTPS when a rule terminates TLS; the sandbox never sees it", async () => {
    const { egress, slot, guest } = await setup();
    const [a] = net.ips as [string];
    const logged: string[] = [];
    const error = console.error;
    console.error = (...args: unknown[]) => void logged.push(args.join(" "));
    t.after(() => (console.error = error));
    const rules = {
      "x.a.test": [{ transform: { headers: { Authorization: "secret:tok", "X-Extra": "lit" } }, tls: "terminate" }],
      "a.test": [{ transform: { headers: { Authorization: "secret:tok" } } }],
      "c.other.test": [{ transform: { headers: { Authorization: "secret:tok" } } }],
      "b.test": [{ transform: { headers: { Authorization: "secret:missing" } } }],
    };
    await egress.apply(slot, "sbxh", parseEgressPolicy(true, { allowOut: ["*.a.test"], rules }));
    const auth = (s: unknown) => JSON.parse(s as string) as { auth: string | null; extra: string | null };
    const req = (host: string) => `GET /auth HTTP/1.1\r\nHost: ${host}\r\n\r\n`;
    const out = await fromGuest(guest, [
      { op: "http", ip: a, port: 80, host: "x.a.test", path: "/auth", headers: { Authorization: "the guest's own" } },
      { op: "https", ip: a, port: 443, servername: "x.a.test", path: "/auth", ca: ca.certPem }, // the leaf checks against the node's CA
      { op: "https", ip: a, port: 443, servername: "a.test", path: "/auth" }, // no tls: "terminate": passes as it is
      { op: "http", ip: a, port: 80, host: "a.test", path: "/auth" },
      { op: "http", ip: a, port: 80, host: "c.other.test", path: "/auth" }, // a rule's host must own the address
      { op: "http", ip: a, port: 80, host: "b.test", path: "/auth" }, // its secret is missing
      // Keep-alive: each request gets the headers; another host on the connection is refused.
      { op: "raw", ip: a, port: 80, chunks: [b64(req("x.a.test")), b64(req("x.a.test")), b64(req("b.test"))], gapMs: 300 },
    ]);
    expect(auth(out[0])).toEqual({ auth: want, extra: "lit" });
    expect(auth(out[1])).toEqual({ auth: want, extra: "lit" });
    expect(auth(out[2])).toEqual({ auth: null, extra: null });
    expect(auth(out[3])).toEqual({ auth: want, extra: null });
    expect(out.slice(4, 6)).toEqual(["status 403", "status 502"]);
    const raw = out[6] as string;
    expect(raw.split(want).length - 1).toBe(2);
    expect(raw).toContain("421 Misdirected Request");
    // The secret reached the server only: not one byte the guest got, not one line logged.
    expect(JSON.stringify(out)).not.toContain(secret);
    expect(logged.join("\n")).toContain("secret missing does not exist");
    expect(logged.join("\n")).not.toContain(secret);

    // Terminated TLS through an egress proxy: the tunnel by name, the headers inside.
    await egress.apply(slot, "sbxh", parseEgressPolicy(true, { allowOut: ["*.a.test"], rules, egressProxy: { address: net.proxyAddress } }));
    const via = await fromGuest(guest, [{ op: "https", ip: a, port: 443, servername: "x.a.test", path: "/auth", ca: ca.certPem }]);
    expect(auth(via[0])).toEqual({ auth: want, extra: "lit" });
    expect(net.proxied().at(-1)?.target).toBe("x.a.test:443");
  }, 90_000);

  test("E2B placeholders: ${e2b.secrets.NAME} in a header reaches the server as the secret's value, an update on the next request, a deleted one is a 502", async () => {
    const { egress, proxy, slot, guest } = await setup();
    const [a] = net.ips as [string];
    const first = `e2b-${randomBytes(12).toString("hex")}`;
    const second = `e2b-${randomBytes(12).toString("hex")}`;
    const made = await secrets.create("OpenAI-Key", first);
    t.after(() => secrets.remove(made.id).then(() => {}));
    const sha = (v: string) => createHash("sha256").update(v).digest("hex");
    const rules = { "x.a.test": [{ transform: { headers: { Authorization: "Bearer ${e2b.secrets.openai-key}", "X-Extra": "lit" } }, tls: "terminate" }] };
    const policy = parseEgressPolicy(true, { allowOut: ["*.a.test"], rules });
    await egress.apply(slot, "sbxp", policy);
    // The policy holds the placeholder's text, never a value.
    expect(JSON.stringify(policy)).not.toContain(first);
    const auth = (s: unknown) => JSON.parse(s as string) as { auth: string | null; extra: string | null };
    const req = (close = "") => `GET /auth HTTP/1.1\r\nHost: x.a.test\r\n${close}\r\n`;
    const ops = [
      { op: "http", ip: a, port: 80, host: "x.a.test", path: "/auth" },
      { op: "https", ip: a, port: 443, servername: "x.a.test", path: "/auth", ca: ca.certPem },
    ] as const;
    const before = await fromGuest(guest, [...ops]);
    expect(before.map(auth)).toEqual([{ auth: sha(`Bearer ${first}`), extra: "lit" }, { auth: sha(`Bearer ${first}`), extra: "lit" }]);
    // One keep-alive connection: the update lands between its two requests (2.5 s apart, the update
    // 0.8 s after the proxy let the connection through), and the second carries the new value.
    const allowed = proxy.statsOf("sbxp").allowed;
    const keepAlive = fromGuest(guest, [{ op: "raw", ip: a, port: 80, chunks: [b64(req()), b64(req("Connection: close\r\n"))], gapMs: 2500 }]);
    for (const until = Date.now() + 20_000; proxy.statsOf("sbxp").allowed === allowed && Date.now() < until;) await Bun.sleep(20);
    await Bun.sleep(800);
    await secrets.update("openai-key", second);
    const rotated = await keepAlive;
    const raw = rotated[0] as string;
    expect(raw.indexOf(sha(`Bearer ${first}`))).toBeGreaterThanOrEqual(0);
    expect(raw.indexOf(sha(`Bearer ${second}`))).toBeGreaterThan(raw.indexOf(sha(`Bearer ${first}`)));
    expect(auth((await fromGuest(guest, [ops[0]]))[0])).toEqual({ auth: sha(`Bearer ${second}`), extra: "lit" });
    await secrets.remove("openai-key");
    expect(await fromGuest(guest, [ops[0]])).toEqual(["status 502"]);
    expect(JSON.stringify([before, rotated])).not.toContain(first);
    expect(JSON.stringify([before, rotated])).not.toContain(second);
  }, 90_000);

  test("a terminated connection checks the server's certificate: an untrusted one is refused before the sandbox's handshake", async () => {
    const { egress, proxy, slot, guest } = await setup({ upstreamCa: [] });
    const [a] = net.ips as [string];
    await egress.apply(slot, "sbxt", parseEgressPolicy(true, { rules: { "x.a.test": [{ transform: { headers: { "X-Extra": "v" } }, tls: "terminate" }] } }));
    const out = await fromGuest(guest, [{ op: "https", ip: a, port: 443, servername: "x.a.test", path: "/auth", ca: ca.certPem }]);
    expect(String(out[0])).not.toContain("{");
    expect(proxy.statsOf("sbxt").recent.at(-1)?.reason).toContain("TLS to x.a.test");
  }, 60_000);
});
