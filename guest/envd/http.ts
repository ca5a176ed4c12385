// Envd's plain HTTP endpoints: /health, /init (token, env, default user/workdir, clock), /envs, /metrics.
import { mkdirSync, readFileSync, statfsSync, writeFileSync } from "node:fs";
import { cpus } from "node:os";
import { httpError, tokenMatches } from "./files.ts";
import { ENVD_VERSION, type EnvdState } from "./state.ts";
import { reseedRandom, setClock } from "./sys.ts";

const NO_STORE = { "Cache-Control": "no-store" };

export function health(): Response {
  return new Response(null, { status: 204, headers: NO_STORE });
}

function isStringMap(v: unknown): v is Record<string, string> {
  return typeof v === "object" && v !== null && !Array.isArray(v) && Object.values(v).every((x) => typeof x === "string");
}

/** Marker files E2B templates expect under /run/e2b (guest mode only). */
export function writeMarkers(state: EnvdState) {
  if (!state.opts.guest) return;
  try {
    mkdirSync("/run/e2b", { recursive: true });
    writeFileSync("/run/e2b/.E2B_SANDBOX", "true");
    for (const k of ["E2B_SANDBOX_ID", "E2B_TEMPLATE_ID"]) {
      const v = state.envVars[k];
      if (v) writeFileSync(`/run/e2b/.${k}`, v);
    }
  } catch {
    // read-only /run: the env vars still carry the same facts
  }
}

export async function init(req: Request, state: EnvdState): Promise<Response> {
  const headers = { ...NO_STORE, "X-Envd-Version": ENVD_VERSION };
  let body: Record<string, unknown> = {};
  const text = await req.text();
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
  if (state.accessToken && !tokenMatches(req.headers.get("x-access-token"), state.accessToken) && newToken !== state.accessToken) {
    return httpError(401, "unauthorized access, please provide a valid access token or method signing if supported");
  }
  if (body.envVars !== undefined && !isStringMap(body.envVars)) return httpError(400, "envVars must map strings to strings");
  for (const k of ["defaultUser", "defaultWorkdir", "timestamp"]) {
    if (body[k] !== undefined && body[k] !== null && typeof body[k] !== "string") return httpError(400, `${k} must be a string`);
  }
  // Our extension (E2B's envd ignores unknown fields): fresh entropy for a restored guest.
  let entropy: Uint8Array | undefined;
  if (body.aenvEntropy !== undefined) {
    if (typeof body.aenvEntropy !== "string") return httpError(400, "aenvEntropy must be base64");
    entropy = Buffer.from(body.aenvEntropy, "base64");
    if (entropy.length < 16 || entropy.length > 4096) return httpError(400, "aenvEntropy must carry 16 to 4096 bytes");
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
  writeMarkers(state);
  return new Response(null, { status: 204, headers });
}

export function envs(state: EnvdState): Response {
  return Response.json(state.defaultEnv());
}

let lastCpu = readCpu();

function readCpu(): { total: number; idle: number } {
  try {
    const f = readFileSync("/proc/stat", "utf8").split("\n")[0]!.trim().split(/\s+/).slice(1, 9).map(Number);
    return { total: f.reduce((a, b) => a + b, 0), idle: f[3]! + f[4]! };
  } catch {
    return { total: 0, idle: 0 };
  }
}

function meminfo(): Record<string, number> {
  const out: Record<string, number> = {};
  try {
    for (const line of readFileSync("/proc/meminfo", "utf8").split("\n")) {
      const m = /^(\w+):\s+(\d+)/.exec(line);
      if (m) out[m[1]!] = Number(m[2]) * 1024;
    }
  } catch {
    // not Linux
  }
  return out;
}

export function metrics(): Response {
  const now = readCpu();
  const dt = now.total - lastCpu.total;
  const pct = dt > 0 ? Math.round((1 - (now.idle - lastCpu.idle) / dt) * 10000) / 100 : 0;
  lastCpu = now;
  const mem = meminfo();
  const memTotal = mem.MemTotal ?? 0;
  const memUsed = memTotal - (mem.MemAvailable ?? mem.MemFree ?? 0);
  let diskTotal = 0;
  let diskUsed = 0;
  try {
    const fs = statfsSync("/");
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
