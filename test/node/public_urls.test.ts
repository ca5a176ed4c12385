// Public sandbox URLs: a node with AENV_DOMAIN and a certificate (AENV_TLS_CERT/KEY) serves the
// API and the proxy over HTTPS on AENV_TLS_PORT, so the stock SDK works in its normal https mode:
// create and connect at the https API, envd at https://49983-{id}.{domain}, getHost(port) over
// https, signed upload/download URLs through the proxy (expired or tampered ones refused by envd).
// The CA and the wildcard certificate are made here with openssl; the SDK runs in its own process
// that trusts the CA through NODE_EXTRA_CA_CERTS. Bad HTTPS settings stop the start with one line.
import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { mkdirSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { routeOf } from "../../src/api/proxy.ts";
import { loadTls } from "../../src/node/tls.ts";
import { ConfigError } from "../../src/node/config.ts";
import { NODE_ENTRY } from "../../services/cluster/procs.ts";
import { scratchDir } from "../helpers/tmp.ts";
import { FIRST_START_MS, nodeSetup, nodeSkipReason, startNode, stopNode, type NodeProc } from "./harness.ts";

const ROOT = join(import.meta.dir, "../..");
const CLIENT = join(import.meta.dir, "public_urls_client.ts");
const KEY = "e2b_" + "7d".repeat(20);
/** A start that stops at a bad setting does so before anything else: seconds, not minutes. */
const BAD_START_MS = 30_000;

/** Runs openssl; throws with its output when it fails. */
async function openssl(args: string[], cwd: string): Promise<void> {
  const p = Bun.spawn(["openssl", ...args], { cwd, stdout: "pipe", stderr: "pipe" });
  const [err, code] = await Promise.all([new Response(p.stderr).text(), p.exited]);
  if (code !== 0) throw new Error(`openssl ${args.join(" ")}: ${err}`);
}

interface TestPki { dir: string; ca: string; cert: string; key: string; caKey: string }

/** A test CA and a leaf it signs for `names` (SANs), valid `days`; ECDSA P-256 keys. */
async function makePki(dir: string, names: string[], days = 2): Promise<TestPki> {
  mkdirSync(dir, { recursive: true });
  const ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"];
  await openssl(["req", "-x509", ...ec, "-keyout", "ca-key.pem", "-out", "ca.pem", "-days", String(days), "-subj", "/CN=aenv public-url test CA",
    "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign"], dir);
  await openssl(["req", ...ec, "-keyout", "key.pem", "-out", "leaf.csr", "-subj", `/CN=${names[0]}`], dir);
  writeFileSync(join(dir, "leaf.ext"), [
    `subjectAltName=${names.map((n) => (/^[\d.]+$/.test(n) ? `IP:${n}` : `DNS:${n}`)).join(",")}`,
    "basicConstraints=critical,CA:FALSE", "keyUsage=critical,digitalSignature", "extendedKeyUsage=serverAuth",
  ].join("\n") + "\n");
  await openssl(["x509", "-req", "-in", "leaf.csr", "-CA", "ca.pem", "-CAkey", "ca-key.pem", "-CAcreateserial", "-out", "cert.pem", "-days", String(days), "-extfile", "leaf.ext"], dir);
  return { dir, ca: join(dir, "ca.pem"), caKey: join(dir, "ca-key.pem"), cert: join(dir, "cert.pem"), key: join(dir, "key.pem") };
}

/** A TCP port free on loopback now (the node binds it a moment later). */
function freePort(): number {
  const probe = Bun.listen({ hostname: "127.0.0.1", port: 0, socket: { data() {} } });
  const port = probe.port;
  probe.stop(true);
  return port;
}

const req = (host: string) => new Request("http://127.0.0.1/x?y=1", { headers: { host } });
const route = (host: string, domain: string) => routeOf(req(host), new URL("http://127.0.0.1/x?y=1"), { domain });

describe("host routing for a sandbox domain (E2B's rule)", () => {
  test("the left-most label split on '-': part 0 the port, part 1 the ID, later parts ignored; the domain's port is not compared", () => {
    const d = "sbx.example.com:8443";
    expect(route("49983-abc123.sbx.example.com:8443", d)).toEqual({ id: "abc123", port: 49983, path: "/x?y=1" });
    expect(route("8000-abc123.sbx.example.com", d)).toEqual({ id: "abc123", port: 8000, path: "/x?y=1" });
    expect(route("8000-abc123-clientid.sbx.example.com:443", d)?.id).toBe("abc123");
    expect(route("8000-ABC123.SBX.Example.com.", d)?.id).toBe("abc123");
    // Not for a sandbox: another domain, a label with no '-' (the SDK's api.<domain>), a port that is not a number.
    expect(route("8000-abc123.other.com", d)).toBeUndefined();
    expect(route("api.sbx.example.com:8443", d)).toBeUndefined();
    expect(route("web-abc123.sbx.example.com", d)).toBeUndefined();
    expect(route("8000-abc123.a.sbx.example.com", d)).toBeUndefined();
    // Any domain when none is set.
    expect(route("3000-abc123.e2b.app", "")?.port).toBe(3000);
  });
});

describe("HTTPS settings (loadTls)", () => {
  const dir = scratchDir("tls-settings");
  let pki: TestPki;
  beforeAll(async () => {
    pki = await makePki(join(dir, "pki"), ["*.sbx.localhost", "localhost"]);
  });

  test("neither: no HTTPS; both: the pair, its names and a warning for a domain it does not cover", () => {
    expect(loadTls({ tlsCert: "", tlsKey: "", domain: "" })).toBeUndefined();
    const t = loadTls({ tlsCert: pki.cert, tlsKey: pki.key, domain: "sbx.localhost:8443" })!;
    expect(t.cert).toContain("BEGIN CERTIFICATE");
    expect(t.names).toContain("DNS:*.sbx.localhost");
    expect(t.warnings).toEqual([]);
    expect(loadTls({ tlsCert: pki.cert, tlsKey: pki.key, domain: "sbx.example.com" })!.warnings).toEqual([expect.stringMatching(/does not cover \*\.sbx\.example\.com/)]);
    expect(loadTls({ tlsCert: pki.cert, tlsKey: pki.key, domain: "" }, Date.now() + 10 * 86_400_000)!.warnings).toEqual([expect.stringMatching(/expired/)]);
  });

  test("one without the other, an unreadable or non-PEM file, a key of another certificate: ConfigErrors naming the setting", () => {
    const bad = (tlsCert: string, tlsKey: string) => () => loadTls({ tlsCert, tlsKey, domain: "" });
    expect(bad(pki.cert, "")).toThrow("AENV_TLS_CERT (tls_cert) is set but AENV_TLS_KEY (tls_key) is not");
    expect(bad("", pki.key)).toThrow("AENV_TLS_KEY (tls_key) is set but AENV_TLS_CERT (tls_cert) is not");
    expect(bad(join(dir, "missing.pem"), pki.key)).toThrow(`AENV_TLS_CERT=${join(dir, "missing.pem")}: cannot read it (ENOENT)`);
    expect(bad(pki.cert, dir)).toThrow(`AENV_TLS_KEY=${dir}: not a regular file`);
    expect(bad(pki.key, pki.key)).toThrow(/AENV_TLS_CERT=.*: not a PEM certificate/);
    expect(bad(pki.cert, pki.cert)).toThrow(/AENV_TLS_KEY=.*: not a PEM private key/);
    expect(bad(pki.cert, pki.caKey)).toThrow(/are not one pair/);
    expect(bad(pki.cert, "")).toThrow(ConfigError);
  });
});

const skip = nodeSkipReason();

describe("bad HTTPS settings stop `bun run node` at once with one line", () => {
  const dir = scratchDir("tls-bad");
  let pki: TestPki;
  beforeAll(async () => {
    pki = await makePki(join(dir, "pki"), ["*.sbx.localhost"]);
  });

  /** The node's exit code and stderr for these settings (home in the scratch directory). */
  async function start(extra: Record<string, string>): Promise<{ code: number; err: string }> {
    const p = Bun.spawn([process.execPath, NODE_ENTRY], {
      cwd: ROOT, env: { ...process.env, AENV_HOME: join(dir, "home"), HOST: "127.0.0.1", PORT: "0", ...extra }, stdout: "pipe", stderr: "pipe", timeout: BAD_START_MS,
    });
    const [err, code] = await Promise.all([new Response(p.stderr).text(), p.exited]);
    return { code, err };
  }

  test("a certificate without its key; a file that cannot be read", async () => {
    const a = await start({ AENV_TLS_CERT: pki.cert });
    expect(a.code).toBe(2);
    expect(a.err.trim()).toBe("aenv node: AENV_TLS_CERT (tls_cert) is set but AENV_TLS_KEY (tls_key) is not: HTTPS needs both a certificate and its key, or neither");
    const b = await start({ AENV_TLS_CERT: pki.cert, AENV_TLS_KEY: join(dir, "nope.pem") });
    expect(b.code).toBe(2);
    expect(b.err.trim()).toBe(`aenv node: AENV_TLS_KEY=${join(dir, "nope.pem")}: cannot read it (ENOENT)`);
  }, 2 * BAD_START_MS);
});

describe.skipIf(!!skip)("the stock SDK over https with AENV_DOMAIN and a certificate", () => {
  if (skip) return void test.skip(skip!, () => {});
  const dir = scratchDir("tls-node");
  const tlsPort = freePort();
  const domain = `sbx.localhost:${tlsPort}`;
  let pki: TestPki;
  let setup: ReturnType<typeof nodeSetup>;
  let node: NodeProc | undefined;
  let id = "";

  /** One step of the SDK client (public_urls_client.ts) in its own process trusting the test CA: its JSON result. */
  async function client(step: string, arg = "", timeoutMs = 300_000): Promise<Record<string, any>> {
    const env: Record<string, string | undefined> = { ...process.env, NODE_EXTRA_CA_CERTS: pki.ca, E2B_API_KEY: KEY, PUB_DOMAIN: domain, PUB_API_URL: `https://localhost:${tlsPort}` };
    for (const k of ["E2B_API_URL", "E2B_SANDBOX_URL", "E2B_DOMAIN", "E2B_DEBUG"]) delete env[k];
    const p = Bun.spawn([process.execPath, CLIENT, step, arg], { cwd: ROOT, env, stdout: "pipe", stderr: "pipe", timeout: timeoutMs });
    const [out, err, code] = await Promise.all([new Response(p.stdout).text(), new Response(p.stderr).text(), p.exited]);
    if (code !== 0) throw new Error(`client ${step} exited ${code}:\n${out}\n${err}`);
    return JSON.parse(out.trim().split("\n").at(-1)!);
  }

  beforeAll(async () => {
    pki = await makePki(join(dir, "pki"), ["*.sbx.localhost", "localhost", "127.0.0.1"]);
    setup = nodeSetup("pub", 247, KEY, { AENV_DOMAIN: domain, AENV_TLS_CERT: pki.cert, AENV_TLS_KEY: pki.key, AENV_TLS_PORT: String(tlsPort) });
    node = await startNode(setup.env, FIRST_START_MS);
  }, FIRST_START_MS + 60_000);

  afterAll(async () => {
    if (setup) await stopNode(node, setup);
  }, 180_000);

  test("the HTTPS listener: the start line names it; the CA is needed; plain HTTP stays on PORT", async () => {
    expect(node!.log.some((l) => l.includes(`HTTPS:    https://127.0.0.1:${tlsPort}`) && l.includes(`https://{port}-{id}.${domain}`))).toBe(true);
    const ca = await Bun.file(pki.ca).text();
    const health = await fetch(`https://localhost:${tlsPort}/health`, { tls: { ca } });
    expect(health.status).toBe(200);
    const untrusted = await fetch(`https://localhost:${tlsPort}/health`).then(() => "answered", (e: Error) => e.message);
    expect(untrusted).not.toBe("answered");
    expect((await fetch(`${node!.base}/health`)).status).toBe(200);
    // The API over https wants its key, as on the plain port.
    const noKey = await fetch(`https://api.${domain}/v2/sandboxes`, { tls: { ca } });
    expect(noKey.status).toBe(401);
  });

  test("create over the https API; commands and files through https://49983-{id}.{domain}; api.{domain} lists it", async () => {
    const r = await client("create");
    id = r.id;
    expect(r.domain).toBe(domain);
    expect(r.envdApiUrl).toBe(`https://49983-${id}.${domain}`);
    expect(r.stdout).toBe("hello 42\nuser\n");
    expect(r.read).toBe("written over https");
    expect(r.listedByDomain).toContain(id);
  }, 300_000);

  test("getHost(port): https://8000-{id}.{domain} reaches a server in the sandbox", async () => {
    const r = await client("host", id);
    expect(r.host).toBe(`8000-${id}.${domain}`);
    expect(r.status).toBe(200);
    expect(r.body).toBe("written over https");
  }, 300_000);

  test("signed upload and download URLs through the TLS proxy; tampered, re-pointed or expired ones: 401", async () => {
    const r = await client("signed", id);
    expect(r.upUrl.startsWith(`https://49983-${id}.${domain}/files?`)).toBe(true);
    expect(r.downUrl).toContain("signature_expiration=");
    expect(r.upload.status).toBe(200);
    expect(r.uploaded).toBe("uploaded through a signed url");
    expect(r.download).toEqual({ status: 200, body: "written over https" });
    for (const refused of [r.tampered, r.wrongPath, r.uploadLater]) {
      expect(refused.status).toBe(401);
      expect(JSON.parse(refused.body)).toEqual({ code: 401, message: "invalid signature" });
    }
    expect(r.afterRefused).toBe("uploaded through a signed url");
    expect(r.expired.status).toBe(401);
    expect(JSON.parse(r.expired.body)).toEqual({ code: 401, message: "signature is already expired" });
  }, 300_000);

  test("kill over the https API", async () => {
    expect((await client("kill", id)).killed).toBe(true);
    const ca = await Bun.file(pki.ca).text();
    const gone = await fetch(`https://49983-${id}.${domain}/health`, { tls: { ca } });
    expect(gone.status).toBe(502);
    expect(((await gone.json()) as { message: string }).message).toBe("The sandbox was not found");
  }, 120_000);
});
