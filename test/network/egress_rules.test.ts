// The parts of header rules and egress proxies that need no namespace: their input, the request
// rewriter, the proxy handshakes, the node's CA and the secret store. egress_upstream.test.ts runs
// them on real slots.
import { describe, expect, test } from "bun:test";
import { X509Certificate } from "node:crypto";
import { chmodSync, existsSync, mkdirSync, readdirSync, statSync, writeFileSync } from "node:fs";
import tls from "node:tls";
import { join } from "node:path";
import {
  EgressCa, MAX_HEADER_VALUE, MAX_HEADERS_PER_RULE, MAX_PLACEHOLDERS_PER_VALUE, MAX_RULE_HOSTS, MAX_SECRETS, RequestRewriter, SecretStore, Tunnel,
  loadOrCreateCa, parseEgressPolicy, redirectedPorts, rulesFor, type HeadDecision, type RequestHead,
} from "../../src/network/index.ts";
import { scratchDir } from "../helpers/tmp.ts";
import { policyErrorField } from "./harness.ts";

const field = policyErrorField;

describe("rules and egressProxy input", () => {
  test("become a policy: headers by host, secrets by name, the proxy's kind and credentials", () => {
    const p = parseEgressPolicy(true, {
      rules: {
        "API.a.test": [{ transform: { headers: { Authorization: "secret:tok", "X-A": "1" } } }, { transform: { headers: { "x-a": "2" } }, tls: "terminate" }],
        "*.a.test": [{ transform: { headers: { "X-B": "b" } } }],
      },
      egressProxy: { address: "proxy.example.com:1080", username: "u", password: "p" },
    });
    expect(p.rules).toEqual([
      { pattern: "api.a.test", headers: [{ name: "Authorization", secret: "tok" }, { name: "x-a", value: "2" }], terminateTls: true },
      { pattern: "*.a.test", headers: [{ name: "X-B", value: "b" }], terminateTls: false },
    ]);
    expect(p.upstream).toEqual({ kind: "socks5", host: "proxy.example.com", port: 1080, username: "u", password: "p" });
    // E2B's placeholders (Secret.fill) anywhere in a value, names lower-cased; `secret:NAME` names the same secrets.
    const ph = parseEgressPolicy(true, { rules: { "a.test": [{ transform: { headers: { A: "Bearer ${e2b.secrets.OpenAI-Key}", B: "${e2b.secrets.x}:${e2b.secrets.y}/${e2b.secrets.x}", C: "secret:API-key", D: "${e2b.identity.x}" } } }] } });
    expect(ph.rules[0]!.headers).toEqual([
      { name: "A", value: "Bearer ${e2b.secrets.OpenAI-Key}", placeholders: ["openai-key"] },
      { name: "B", value: "${e2b.secrets.x}:${e2b.secrets.y}/${e2b.secrets.x}", placeholders: ["x", "y"] },
      { name: "C", secret: "api-key" },
      { name: "D", value: "${e2b.identity.x}" },
    ]);
    expect(parseEgressPolicy(true, { egressProxy: { address: "http://198.18.0.5:3128" } }).upstream).toEqual({ kind: "http", host: "198.18.0.5", port: 3128 });
    expect(parseEgressPolicy(true, { egressProxy: { address: "socks5://198.18.0.5:1080" } }).upstream?.kind).toBe("socks5");
    expect(parseEgressPolicy(true, { egressProxy: null, rules: null })).toMatchObject({ upstream: undefined, rules: [] });
    // The most specific key wins, rule sets are not merged; the apex is not below its wildcard.
    expect(rulesFor(p.rules, "api.a.test")?.pattern).toBe("api.a.test");
    expect(rulesFor(p.rules, "x.y.a.test")?.pattern).toBe("*.a.test");
    expect(rulesFor(p.rules, "a.test")).toBeUndefined();
    // What reaches the domain proxy: every TCP port with an egress proxy, the proxied ports with rules.
    expect(redirectedPorts(p)).toBe("all");
    expect(redirectedPorts(parseEgressPolicy(true, { rules: { "a.test": [] } }))).toEqual([80, 443]);
    expect(redirectedPorts(parseEgressPolicy(true, { allowOut: ["1.2.3.4"] }))).toBeUndefined();
  });

  test("malformed rules and proxy addresses are refused naming the field", () => {
    const r = (rules: unknown) => field(() => parseEgressPolicy(true, { rules }));
    expect(r([])).toBe("network.rules");
    expect(r({ "bad host!": [] })).toBe('network.rules["bad host!"]');
    expect(r({ "*": [] })).toBe('network.rules["*"]');
    expect(r({ "a.test": {} })).toBe('network.rules["a.test"]');
    expect(r({ "a.test": [], "A.test": [] })).toBe('network.rules["A.test"]');
    expect(r({ "a.test": ["x"] })).toBe('network.rules["a.test"][0]');
    expect(r({ "a.test": [{ transform: [] }] })).toBe('network.rules["a.test"][0].transform');
    expect(r({ "a.test": [{ tls: "yes" }] })).toBe('network.rules["a.test"][0].tls');
    expect(r({ "a.test": [{ transform: { headers: "x" } }] })).toBe('network.rules["a.test"][0].transform.headers');
    const h = (headers: Record<string, unknown>) => r({ "a.test": [{ transform: { headers } }] });
    expect(h({ "Bad Name": "v" })).toBe('network.rules["a.test"][0].transform.headers["Bad Name"]');
    expect(h({ Host: "evil.test" })).toBe('network.rules["a.test"][0].transform.headers["Host"]');
    expect(h({ "Content-Length": "1" })).toBe('network.rules["a.test"][0].transform.headers["Content-Length"]');
    expect(h({ X: 1 })).toBe('network.rules["a.test"][0].transform.headers["X"]');
    expect(h({ X: "a\r\nInjected: 1" })).toBe('network.rules["a.test"][0].transform.headers["X"]');
    expect(h({ X: "v".repeat(MAX_HEADER_VALUE + 1) })).toBe('network.rules["a.test"][0].transform.headers["X"]');
    // Secret names as the store takes them: not empty, no braces or control characters, not sec_.
    for (const bad of ["secret:", "secret:sec_x", "secret:a{b", "${e2b.secrets.}", "${e2b.secrets.sec_x}", "Bearer ${e2b.secrets.tok", "${e2b.secrets.a\tb}",
      `\${e2b.secrets.${"n".repeat(257)}}`, "${e2b.secrets.a}".repeat(MAX_PLACEHOLDERS_PER_VALUE + 1)]) {
      expect(h({ X: bad })).toBe('network.rules["a.test"][0].transform.headers["X"]');
    }
    expect(h(Object.fromEntries(Array.from({ length: MAX_HEADERS_PER_RULE + 1 }, (_, i) => [`h${i}`, "v"])))).toBe('network.rules["a.test"][0].transform.headers');
    expect(r(Object.fromEntries(Array.from({ length: MAX_RULE_HOSTS + 1 }, (_, i) => [`h${i}.test`, []])))).toBe("network.rules");

    const e = (egressProxy: unknown) => field(() => parseEgressPolicy(true, { egressProxy }));
    expect(e("1.2.3.4:1080")).toBe("network.egressProxy");
    expect(e({})).toBe("network.egressProxy.address");
    for (const address of ["1.2.3.4", "1.2.3.4:0", "1.2.3.4:70000", "300.1.1.1:1080", "ftp://1.2.3.4:21", "[::1]:1080", "*.a.test:1080", "a b:1", "u:p@1.2.3.4:1080"]) {
      expect(e({ address })).toBe("network.egressProxy.address");
    }
    expect(e({ address: "1.2.3.4:1080", username: "u".repeat(256) })).toBe("network.egressProxy.username");
    expect(e({ address: "1.2.3.4:1080", username: "u", password: 5 })).toBe("network.egressProxy.password");
    expect(e({ address: "1.2.3.4:1080", password: "p" })).toBe("network.egressProxy.username");
    expect(e({ address: "http://1.2.3.4:3128", username: "a:b" })).toBe("network.egressProxy.username");
  });
});

/** Runs `input` (in the given pieces) through a rewriter; what came out and how it failed. */
async function rewrite(pieces: string[], decide: (h: RequestHead) => HeadDecision = () => ({ set: [{ name: "Authorization", value: "Bearer s" }] })) {
  let out = "";
  let failed: string | undefined;
  const heads: RequestHead[] = [];
  const rw = new RequestRewriter((h) => (heads.push(h), decide(h)), (b) => (out += b.toString("latin1")), (status, reason) => (failed = `${status} ${reason}`));
  for (const p of pieces) {
    rw.push(Buffer.from(p, "latin1"));
    await Bun.sleep(0);
  }
  await Bun.sleep(1);
  return { out, failed, heads, requests: rw.requests };
}

describe("the request rewriter", () => {
  test("every request of a keep-alive connection gets the headers, bodies pass as framed", async () => {
    const a = "POST /a HTTP/1.1\r\nHost: a.test\r\nauthorization: mine\r\nContent-Length: 5\r\n\r\nhello";
    const b = "POST /b HTTP/1.1\r\nHost: a.test\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\nT: 1\r\n\r\n";
    const c = "GET /c HTTP/1.1\r\nHost: a.test\r\n\r\n";
    const whole = a + b + "\r\n" + c;
    for (const pieces of [[whole], whole.match(/[^]{1,7}/g)!]) {
      const r = await rewrite(pieces);
      expect(r.failed).toBeUndefined();
      expect(r.requests).toBe(3);
      expect(r.out).toBe(
        "POST /a HTTP/1.1\r\nHost: a.test\r\nContent-Length: 5\r\nAuthorization: Bearer s\r\n\r\nhello" +
        "POST /b HTTP/1.1\r\nHost: a.test\r\nTransfer-Encoding: chunked\r\nAuthorization: Bearer s\r\n\r\n3\r\nabc\r\n0\r\nT: 1\r\n\r\n" +
        "GET /c HTTP/1.1\r\nHost: a.test\r\nAuthorization: Bearer s\r\n\r\n",
      );
    }
    // A body that looks like a request is a body, not a request.
    const smuggle = await rewrite(["POST / HTTP/1.1\r\nHost: a.test\r\nContent-Length: 34\r\n\r\nGET /x HTTP/1.1\r\nHost: b.test\r\n\r\n"]);
    expect(smuggle.heads.map((h) => h.host)).toEqual(["a.test"]);
    // After an Upgrade the bytes pass untouched.
    const up = await rewrite(["GET / HTTP/1.1\r\nHost: a.test\r\nUpgrade: websocket\r\n\r\n", "GET / HTTP/1.1\r\nHost: b.test\r\n\r\n"]);
    expect(up.requests).toBe(1);
    expect(up.out.endsWith("GET / HTTP/1.1\r\nHost: b.test\r\n\r\n")).toBe(true);
  });

  test("smuggling shapes, oversized heads and refused hosts fail with a status", async () => {
    const fails = async (s: string, decide?: (h: RequestHead) => HeadDecision) => (await rewrite([s], decide)).failed?.split(" ")[0];
    expect(await fails("GET / HTTP/1.1\r\nHost: a\r\nContent-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n")).toBe("400");
    expect(await fails("GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n")).toBe("400");
    expect(await fails("GET / HTTP/1.1\r\nHost: a\r\n folded\r\n\r\n")).toBe("400");
    expect(await fails("GET / HTTP/1.1\r\nHost: a\r\nContent-Length: 1, 2\r\n\r\n")).toBe("400");
    expect(await fails("GET / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked, gzip\r\n\r\n")).toBe("400");
    expect(await fails("POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n")).toBe("400");
    expect(await fails("GET http://b.test/ HTTP/1.1\r\nHost: a.test\r\n\r\n")).toBe("400");
    expect(await fails("NOT HTTP\r\n\r\n")).toBe("400");
    expect(await fails("GET / HTTP/1.1\r\nX: " + "v".repeat(70_000))).toBe("431");
    expect(await fails("GET / HTTP/1.1\r\nHost: b.test\r\n\r\n", (h) => (h.host === "a.test" ? { set: [] } : { refuse: 421, reason: "other host" }))).toBe("421");
  });
});

describe("egress proxy handshakes", () => {
  test("SOCKS5 with a username, by name; HTTP CONNECT with Basic; refusals named", () => {
    const s = new Tunnel({ kind: "socks5", host: "p", port: 1, username: "u", password: "pw" }, { host: "a.test", port: 443 });
    expect([...s.start()]).toEqual([5, 2, 0, 2]);
    const auth = s.feed(Buffer.from([5, 2]));
    expect(auth.kind === "more" && [...auth.send!]).toEqual([1, 1, 117, 2, 112, 119]);
    const req = s.feed(Buffer.from([1, 0]));
    expect(req.kind === "more" && [...req.send!]).toEqual([5, 1, 0, 3, 6, ...Buffer.from("a.test"), 1, 187]);
    expect(s.feed(Buffer.from([5, 0, 0, 1, 0, 0]))).toEqual({ kind: "more" });
    const open = s.feed(Buffer.from([0, 0, 0, 0, 0x16]));
    expect(open.kind === "open" && [...open.rest]).toEqual([0x16]);

    const byIp = new Tunnel({ kind: "socks5", host: "p", port: 1 }, { host: "1.2.3.4", port: 7 });
    expect([...byIp.start()]).toEqual([5, 1, 0]);
    const r = byIp.feed(Buffer.from([5, 0]));
    expect(r.kind === "more" && [...r.send!]).toEqual([5, 1, 0, 1, 1, 2, 3, 4, 0, 7]);
    expect(byIp.feed(Buffer.from([5, 5, 0, 1, 0, 0, 0, 0, 0, 0]))).toEqual({ kind: "failed", reason: "the proxy answered: connection refused" });

    const h = new Tunnel({ kind: "http", host: "p", port: 1, username: "u", password: "p w" }, { host: "a.test", port: 80 });
    expect(h.start().toString()).toBe(`CONNECT a.test:80 HTTP/1.1\r\nHost: a.test:80\r\nProxy-Authorization: Basic ${btoa("u:p w")}\r\n\r\n`);
    expect(h.feed(Buffer.from("HTTP/1.1 200 OK\r\n"))).toEqual({ kind: "more" });
    const ho = h.feed(Buffer.from("\r\nfirst"));
    expect(ho.kind === "open" && ho.rest.toString()).toBe("first");
    const refused = new Tunnel({ kind: "http", host: "p", port: 1 }, { host: "a.test", port: 80 });
    refused.start();
    expect(refused.feed(Buffer.from("HTTP/1.1 407 Proxy Authentication Required\r\n\r\n"))).toEqual({ kind: "failed", reason: "the proxy answered 407 Proxy Authentication Required" });
  });
});

describe("the node's CA and secrets", () => {
  test("a leaf per host verifies against the CA (openssl -x509_strict and node:tls), cached", async () => {
    const ca = EgressCa.generate();
    const leaf = ca.leaf("api.a.test");
    expect(ca.leaf("api.a.test")).toBe(leaf);
    const dir = scratchDir("egress-ca");
    writeFileSync(join(dir, "ca.pem"), ca.certPem);
    writeFileSync(join(dir, "leaf.pem"), leaf.certPem);
    const v = Bun.spawnSync(["openssl", "verify", "-x509_strict", "-purpose", "sslserver", "-CAfile", join(dir, "ca.pem"), join(dir, "leaf.pem")], { stdout: "pipe", stderr: "pipe" });
    expect(v.stdout.toString() + v.stderr.toString()).toContain("leaf.pem: OK");
    expect(new X509Certificate(leaf.certPem).checkHost("api.a.test")).toBe("api.a.test");
    expect(new X509Certificate(ca.certPem).ca).toBe(true);
    const srv = tls.createServer({ cert: leaf.certPem, key: leaf.keyPem }, (s) => s.end("ok"));
    await new Promise<void>((r) => srv.listen(0, "127.0.0.1", r));
    const port = (srv.address() as { port: number }).port;
    const talk = (servername: string) => new Promise<string>((resolve) => {
      const c = tls.connect({ host: "127.0.0.1", port, servername, ca: ca.certPem });
      c.on("data", (d) => resolve(String(d)));
      c.on("error", (e) => resolve((e as NodeJS.ErrnoException).code ?? e.message));
    });
    expect(await talk("api.a.test")).toBe("ok");
    expect(await talk("other.a.test")).toBe("ERR_TLS_CERT_ALTNAME_INVALID");
    srv.close();
    expect(() => ca.leaf("bad name")).toThrow();
  });

  test("the CA is made once with a 0600 key; a key readable by others is refused", () => {
    const dir = join(scratchDir("egress-ca-home"), "egress-ca");
    const a = loadOrCreateCa(dir);
    expect(statSync(join(dir, "ca-key.pem")).mode & 0o777).toBe(0o600);
    expect(loadOrCreateCa(dir).certPem).toBe(a.certPem);
    chmodSync(join(dir, "ca-key.pem"), 0o644);
    expect(() => loadOrCreateCa(dir)).toThrow(/0600/);
  });

  test("secrets: made through the store, 0600 files in <dir>/user, resolved by name; the node's own files never reached", async () => {
    const dir = scratchDir("egress-secrets");
    mkdirSync(dir, { recursive: true, mode: 0o755 });
    // The node's own files beside the user secrets.
    writeFileSync(join(dir, "api-key"), "node-key", { mode: 0o600 });
    writeFileSync(join(dir, "cluster-headers.json"), '{"headers":{"x-api-key":"node-key"}}', { mode: 0o600 });
    const s = new SecretStore(dir);
    const err = async (p: Promise<unknown>) => (await p.then(() => "no error", (e: Error & { status?: number }) => `${e.status ?? ""} ${e.message}`)) as string;
    expect(await err(s.get("api-key"))).toBe(" secret api-key does not exist");
    expect(await err(s.get("cluster-headers.json"))).toBe(" secret cluster-headers.json does not exist");
    const a = await s.create("Tok", "s3cret-value", { team: "a" });
    expect(a.id).toMatch(/^sec_[a-z0-9]{24}$/);
    expect([a.name, a.version, a.metadata]).toEqual(["tok", 1, { team: "a" }]);
    expect(statSync(dir).mode & 0o777).toBe(0o700);
    expect(statSync(s.userDir).mode & 0o777).toBe(0o700);
    expect(statSync(join(s.userDir, `${a.id}.json`)).mode & 0o777).toBe(0o600);
    expect(await s.get("TOK")).toBe("s3cret-value");
    // A user secret named like a node file is the user's; the node's file stays as it was.
    await s.create("api-key", "user-value");
    expect(await s.get("api-key")).toBe("user-value");
    expect(await Bun.file(join(dir, "api-key")).text()).toBe("node-key");
    // An update applies to the next read; the resolved header replaces each placeholder once.
    expect(await s.update(a.id, "rotated")).toMatchObject({ version: 2, metadata: { team: "a" } });
    expect(await s.get("tok")).toBe("rotated");
    await s.create("self", "${e2b.secrets.tok}");
    expect(await s.resolve({ name: "A", value: "Bearer ${e2b.secrets.TOK}|${e2b.secrets.self}|${e2b.secrets.tok}", placeholders: ["tok", "self"] })).toBe("Bearer rotated|${e2b.secrets.tok}|rotated");
    expect(await s.resolve({ name: "A", secret: "tok" })).toBe("rotated");
    expect(await s.resolve({ name: "A", value: "lit" })).toBe("lit");
    // Refused at the boundary with their status; no message carries a value.
    expect(await err(s.create("TOK", "x"))).toBe("409 a secret named tok exists");
    expect(await err(s.create("sec_a", "x"))).toStartWith("400 ");
    expect(await err(s.create("a}", "x"))).toStartWith("400 ");
    expect(await err(s.create("n", "a\nb"))).toStartWith("400 ");
    expect(await err(s.create("n", "v".repeat(MAX_HEADER_VALUE + 1)))).toStartWith("400 ");
    expect(await err(s.create("n", "v", { k: "v".repeat(1025) }))).toStartWith("400 ");
    expect(await err(s.create("n", "v", { ["k".repeat(129)]: "v" }))).toStartWith("400 ");
    expect(await err(s.create("n", "v", Object.fromEntries(Array.from({ length: 33 }, (_, i) => [`k${i}`, "v"]))))).toStartWith("400 ");
    expect(await err(s.create("n", "v", Object.fromEntries(Array.from({ length: 9 }, (_, i) => [`k${i}`, "v".repeat(1000)]))))).toStartWith("400 ");
    expect(await err(s.update("missing", "x"))).toBe("404 secret missing not found");
    expect(await err(s.get("missing"))).toBe(" secret missing does not exist");
    // A file changed behind the store's back is refused by name only.
    const file = join(s.userDir, `${a.id}.json`);
    chmodSync(file, 0o644);
    expect(await err(s.get("tok"))).toContain("0600");
    writeFileSync(file, "not json: rotated", { mode: 0o600 });
    chmodSync(file, 0o600);
    expect(await err(s.get("tok"))).toBe(" secret tok's file does not parse");
    await s.update("tok", "again");
    expect(await s.get("tok")).toBe("again");
    // Another store on the same directory (a restart) finds them; a crash's temporary file goes, a stray file is left out.
    writeFileSync(join(s.userDir, ".tmp-sec_x-1"), "half");
    writeFileSync(join(s.userDir, "stray"), "x", { mode: 0o600 });
    const again = new SecretStore(dir);
    expect((await again.list()).map((x) => x.name).sort()).toEqual(["api-key", "self", "tok"]);
    expect(await again.get("tok")).toBe("again");
    expect(readdirSync(s.userDir).filter((f) => f.startsWith(".tmp-"))).toEqual([]);
    expect(await again.remove("tok")).toBe(true);
    expect(await again.remove("tok")).toBe(false);
    expect(await err(again.get("tok"))).toBe(" secret tok does not exist");
    expect(existsSync(file)).toBe(false);
    // Two creates of one name racing: exactly one wins.
    const raced = await Promise.allSettled([again.create("race", "1"), again.create("RACE", "2")]);
    expect(raced.map((r) => r.status).sort()).toEqual(["fulfilled", "rejected"]);
  });

  test("secrets: at most MAX_SECRETS on a node (429 past it)", async () => {
    const s = new SecretStore(scratchDir("egress-secrets-full"));
    // In waves of 200: more writes than MAX_WAITING_WRITES (256) waiting at once are refused.
    for (let i = 0; i < MAX_SECRETS; i += 200) await Promise.all(Array.from({ length: 200 }, (_, j) => s.create(`s${i + j}`, "v")));
    expect((await s.list()).length).toBe(MAX_SECRETS);
    expect(await s.create("one-more", "v").catch((e: Error & { status?: number }) => e.status)).toBe(429);
    await s.remove("s0");
    expect((await s.create("one-more", "v")).name).toBe("one-more");
  }, 60_000);
});
