// Envd's plain HTTP endpoints: /health, /init (token, env, default user/workdir, clock, CA bundle,
// the report of what envd supplies for the image), /envs, /metrics.
import { createHash } from "node:crypto";
import { appendFile, mkdir, readFile, statfs, writeFile } from "node:fs/promises";
import { join } from "node:path";
import { cpus } from "node:os";
import { BodyTooLarge, readBounded } from "./body.ts";
import { httpError, tokenMatches } from "./files.ts";
import { ENVD_VERSION, type EnvdState } from "./state.ts";
import { reseedRandom, setClock } from "./sys.ts";

const NO_STORE = { "Cache-Control": "no-store" };
export const UNAUTHORIZED = "unauthorized access, please provide a valid access token or method signing if supported";
/** An /init body is a token, a few names and the sandbox's env vars: 1 MiB holds thousands of them. */
const MAX_INIT_BODY = 1024 * 1024;
/** Certificates an /init caBundle may carry (the node's egress CA is one). */
const MAX_CA_CERTS = 16;
const PEM_CERT = /-----BEGIN CERTIFICATE-----\r?\n[A-Za-z0-9+/=\r\n]{64,16384}-----END CERTIFICATE-----/g;

export function health(): Response {
  return new Response(null, { status: 204, headers: NO_STORE });
}

function isStringMap(v: unknown): v is Record<string, string> {
  return typeof v === "object" && v !== null && !Array.isArray(v) && Object.values(v).every((x) => typeof x === "string");
}

/** Marker files E2B templates expect under /run/e2b (guest mode only). */
export async function writeMarkers(state: EnvdState) {
  if (!state.opts.guest) return;
  try {
    await mkdir("/run/e2b", { recursive: true });
    await writeFile("/run/e2b/.E2B_SANDBOX", "true");
    for (const k of ["E2B_SANDBOX_ID", "E2B_TEMPLATE_ID"]) {
      const v = state.envVars[k];
      if (v) await writeFile(`/run/e2b/.${k}`, v);
    }
  } catch {
    // read-only /run: the env vars still carry the same facts
  }
}

/**
 * Adds the bundle's certificates to the guest's trust store under `root`: one file each in
 * usr/local/share/ca-certificates (what update-ca-certificates reads) and appended to
 * etc/ssl/certs/ca-certificates.crt (what OpenSSL, curl, Python and Go read) unless already there.
 */
export async function trustCertificates(root: string, certs: string[]): Promise<void> {
  const dir = join(root, "usr/local/share/ca-certificates");
  const bundle = join(root, "etc/ssl/certs/ca-certificates.crt");
  await mkdir(dir, { recursive: true });
  await mkdir(join(root, "etc/ssl/certs"), { recursive: true });
  const have = await readFile(bundle, "utf8").catch(() => "");
  const body = (pem: string) => pem.replace(/-----[A-Z ]+-----|\s/g, "");
  const known = new Set((have.match(PEM_CERT) ?? []).map(body));
  for (const pem of certs) {
    await writeFile(join(dir, `aenv-${createHash("sha256").update(body(pem)).digest("hex").slice(0, 16)}.crt`), pem + "\n");
    if (!known.has(body(pem))) await appendFile(bundle, `${have && !have.endsWith("\n") ? "\n" : ""}${pem}\n`);
  }
}

export async function init(req: Request, state: EnvdState): Promise<Response> {
  const headers = { ...NO_STORE, "X-Envd-Version": ENVD_VERSION };
  // A token in the header is checked before a byte of the body is read; without one the body
  // (bounded) may still prove the current token by repeating it.
  const given = req.headers.get("x-access-token");
  if (state.accessToken && given !== null && !tokenMatches(given, state.accessToken)) return httpError(401, UNAUTHORIZED);
  let text: string;
  try {
    text = new TextDecoder().decode(await readBounded(req, MAX_INIT_BODY));
  } catch (e) {
    if (e instanceof BodyTooLarge) return httpError(413, e.message);
    throw e;
  }
  let body: Record<string, unknown> = {};
  if (text.trim()) {
    try {
      body = JSON.parse(text);
    } catch {
      return httpError(400, "invalid JSON body");
    }
    if (typeof body !== "object" || body === null || Array.isArray(body)) return httpError(400, "body must be a JSON object");
  }
  const newToken = typeof body.accessToken === "string" ? body.accessToken : undefined;
  // Changing or clearing an existing token needs proof of the current one (header or the same value again).
  if (state.accessToken && given === null && newToken !== state.accessToken) return httpError(401, UNAUTHORIZED);
  if (body.envVars !== undefined && !isStringMap(body.envVars)) return httpError(400, "envVars must map strings to strings");
  if (body.envVars !== undefined && Object.entries(body.envVars).some(([k, v]) => k.includes("\0") || v.includes("\0"))) {
    return httpError(400, "envVars must not contain NUL bytes");
  }
  for (const k of ["defaultUser", "defaultWorkdir", "timestamp"]) {
    if (body[k] !== undefined && body[k] !== null && typeof body[k] !== "string") return httpError(400, `${k} must be a string`);
    if (typeof body[k] === "string" && body[k].includes("\0")) return httpError(400, `${k} must not contain NUL bytes`);
  }
  // Our extension (E2B's envd ignores unknown fields): fresh entropy for a restored guest.
  let entropy: Uint8Array | undefined;
  if (body.aenvEntropy !== undefined) {
    if (typeof body.aenvEntropy !== "string") return httpError(400, "aenvEntropy must be base64");
    entropy = Buffer.from(body.aenvEntropy, "base64");
    if (entropy.length < 16 || entropy.length > 4096) return httpError(400, "aenvEntropy must carry 16 to 4096 bytes");
  }
  let certs: string[] = [];
  if (body.caBundle !== undefined && body.caBundle !== null && body.caBundle !== "") {
    if (typeof body.caBundle !== "string") return httpError(400, "caBundle must be PEM certificates");
    certs = body.caBundle.match(PEM_CERT) ?? [];
    if (certs.length === 0 || certs.length > MAX_CA_CERTS) return httpError(400, `caBundle must hold 1 to ${MAX_CA_CERTS} PEM certificates`);
  }
  let ts: number | undefined;
  if (typeof body.timestamp === "string" && body.timestamp) {
    ts = Date.parse(body.timestamp);
    if (Number.isNaN(ts)) return httpError(400, "timestamp must be RFC 3339");
    if (ts <= state.lastInitTimestamp) return new Response(null, { status: 204, headers }); // stale or replayed
    state.lastInitTimestamp = ts;
  }

  state.accessToken = newToken || undefined;
  if (body.envVars !== undefined) state.envVars = { ...(body.envVars as Record<string, string>) };
  if (typeof body.defaultUser === "string" && body.defaultUser) state.defaultUser = body.defaultUser;
  if (typeof body.defaultWorkdir === "string") state.defaultWorkdir = body.defaultWorkdir || undefined;
  if (ts !== undefined && state.opts.guest) {
    const skew = ts - Date.now();
    if (skew > 50 || skew < -5000) {
      try {
        setClock(ts); // a restored snapshot wakes up with the clock of its pause
      } catch (e) {
        console.error(`envd: clock sync failed: ${(e as Error).message}`);
      }
    }
  }
  if (entropy && state.opts.guest) {
    try {
      reseedRandom(entropy);
    } catch (e) {
      console.error(`envd: reseeding the CRNG failed: ${(e as Error).message}`);
    }
  }
  if (certs.length && state.opts.trustRoot) {
    try {
      await trustCertificates(state.opts.trustRoot, certs);
    } catch (e) {
      console.error(`envd: adding the CA bundle to the trust store failed: ${(e as Error).message}`);
    }
  }
  await writeMarkers(state);
  // Each sandbox start and resume posts /init: the sandbox's logs (its console) say what envd supplies.
  await state.toolbox.announce(state.users, true);
  return new Response(null, { status: 204, headers });
}

export function envs(state: EnvdState): Response {
  return Response.json(state.defaultEnv());
}

let lastCpu: { total: number; idle: number } | undefined;

async function readCpu(): Promise<{ total: number; idle: number }> {
  try {
    const f = (await readFile("/proc/stat", "utf8")).split("\n")[0]!.trim().split(/\s+/).slice(1, 9).map(Number);
    return { total: f.reduce((a, b) => a + b, 0), idle: f[3]! + f[4]! };
  } catch {
    return { total: 0, idle: 0 };
  }
}

async function meminfo(): Promise<Record<string, number>> {
  const out: Record<string, number> = {};
  try {
    for (const line of (await readFile("/proc/meminfo", "utf8")).split("\n")) {
      const m = /^(\w+):\s+(\d+)/.exec(line);
      if (m) out[m[1]!] = Number(m[2]) * 1024;
    }
  } catch {
    // not Linux
  }
  return out;
}

/** The CPU share is measured since the previous call (the first call: since boot). */
export async function metrics(): Promise<Response> {
  const now = await readCpu();
  const since = lastCpu ?? { total: 0, idle: 0 };
  const dt = now.total - since.total;
  const pct = dt > 0 ? Math.round((1 - (now.idle - since.idle) / dt) * 10000) / 100 : 0;
  lastCpu = now;
  const mem = await meminfo();
  const memTotal = mem.MemTotal ?? 0;
  const memUsed = memTotal - (mem.MemAvailable ?? mem.MemFree ?? 0);
  let diskTotal = 0;
  let diskUsed = 0;
  try {
    const fs = await statfs("/");
    diskTotal = fs.blocks * fs.bsize;
    diskUsed = (fs.blocks - fs.bfree) * fs.bsize;
  } catch {
    // no statfs
  }
  return Response.json({
    ts: Math.floor(Date.now() / 1000),
    cpu_count: cpus().length,
    cpu_used_pct: pct,
    mem_total: memTotal,
    mem_used: memUsed,
    mem_cache: mem.Cached ?? 0,
    mem_total_mib: Math.floor(memTotal / 2 ** 20),
    mem_used_mib: Math.floor(memUsed / 2 ** 20),
    disk_used: diskUsed,
    disk_total: diskTotal,
  });
}
