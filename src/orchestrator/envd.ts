// The orchestrator's calls into a sandbox's envd: wait until it answers, /init (token, env, clock,
// entropy, the node's egress CA) and /metrics. Each is bounded in time (each attempt has its own
// short timeout) and every answer body in size (readBounded, the one reader of guest-served bodies).

/** envd's port in every sandbox (E2B's). */
export const ENVD_PORT = 49983;
/** The envd version this node's guest reports (semver: the SDK's compare-versions needs it). */
export const ENVD_VERSION = "0.6.13";

export class EnvdUnreachableError extends Error {
  constructor(message: string) { super(message); this.name = "EnvdUnreachableError"; }
}

/** A guest's answer longer than its bound; its stream was cancelled. */
export class GuestAnswerTooLargeError extends Error {
  constructor(message: string) { super(message); this.name = "GuestAnswerTooLargeError"; }
}
/** A guest's answer not read to its end in time; its stream was cancelled. */
export class GuestAnswerTimeoutError extends Error {
  constructor(message: string) { super(message); this.name = "GuestAnswerTimeoutError"; }
}

/** /health answers 204 with no body: 4 KiB is plenty. */
export const ENVD_HEALTH_MAX_BYTES = 4 << 10;
/** /init answers 204, or an error text: 64 KiB at most. */
export const ENVD_INIT_ANSWER_MAX_BYTES = 64 << 10;
/** /metrics is one small JSON object: 64 KiB at most. */
export const ENVD_METRICS_MAX_BYTES = 64 << 10;
/** A /metrics request, answer included, gets 5 s. */
export const ENVD_METRICS_TIMEOUT_MS = 5000;
/** A /health poll, answer included, gets 1 s. */
const ENVD_HEALTH_TIMEOUT_MS = 1000;
/** An /init attempt, answer included, gets 2 s. */
const ENVD_INIT_TIMEOUT_MS = 2000;

/**
 * Every body a guest serves the node is read through this: to its end, at most `maxBytes` (past
 * it GuestAnswerTooLargeError), and before `signal` aborts (GuestAnswerTimeoutError); either way
 * the stream is cancelled. A declared Content-Length past the bound is refused before reading.
 */
export async function readBounded(res: Response, maxBytes: number, what: string, signal?: AbortSignal): Promise<Uint8Array> {
  const declared = Number(res.headers.get("content-length") ?? "NaN");
  if (Number.isFinite(declared) && declared > maxBytes) {
    await res.body?.cancel().catch(() => {});
    throw new GuestAnswerTooLargeError(`${what}: ${declared} bytes, more than ${maxBytes}`);
  }
  if (!res.body) return new Uint8Array(0);
  const reader = res.body.getReader();
  const chunks: Uint8Array[] = [];
  let total = 0;
  let onAbort: (() => void) | undefined;
  const aborted = new Promise<never>((_, reject) => {
    onAbort = () => reject(new GuestAnswerTimeoutError(`${what}: the answer was not read within its time (${total} bytes so far)`));
    if (signal?.aborted) onAbort();
    else signal?.addEventListener("abort", onAbort, { once: true });
  });
  aborted.catch(() => {});
  try {
    for (;;) {
      const { done, value } = await Promise.race([reader.read(), aborted]);
      if (done) break;
      total += value.byteLength;
      if (total > maxBytes) throw new GuestAnswerTooLargeError(`${what}: more than ${maxBytes} bytes`);
      chunks.push(value);
    }
  } catch (e) {
    await reader.cancel().catch(() => {});
    // fetch's own signal ends the read with its abort reason: the same timeout, said as ours.
    if (signal?.aborted && !(e instanceof GuestAnswerTooLargeError)) throw new GuestAnswerTimeoutError(`${what}: the answer was not read within its time (${total} bytes so far)`);
    throw e;
  } finally {
    if (onAbort) signal?.removeEventListener("abort", onAbort);
    reader.releaseLock();
  }
  return Buffer.concat(chunks, total);
}

/** A guest-served body as text, through readBounded. */
export async function readBoundedText(res: Response, maxBytes: number, what: string, signal?: AbortSignal): Promise<string> {
  return new TextDecoder().decode(await readBounded(res, maxBytes, what, signal));
}

/** Polls GET /health every 20 ms until it answers 204; `alive` false stops early (the VMM died). */
export async function waitEnvdReady(baseUrl: string, timeoutMs: number, alive: () => boolean): Promise<number> {
  const t0 = performance.now();
  let last = "no answer";
  for (;;) {
    try {
      const signal = AbortSignal.timeout(ENVD_HEALTH_TIMEOUT_MS);
      const r = await fetch(`${baseUrl}/health`, { signal });
      await readBounded(r, ENVD_HEALTH_MAX_BYTES, `envd ${baseUrl}/health`, signal);
      if (r.status === 204) return performance.now() - t0;
      last = `HTTP ${r.status}`;
    } catch (e) {
      last = (e as Error).message;
    }
    if (!alive()) throw new EnvdUnreachableError(`envd at ${baseUrl}: the VM exited (${last})`);
    if (performance.now() - t0 > timeoutMs) throw new EnvdUnreachableError(`envd at ${baseUrl} did not answer within ${timeoutMs} ms (${last})`);
    await Bun.sleep(20);
  }
}

export interface EnvdInit {
  accessToken: string;
  /** The token envd holds now (restored from a checkpoint), if any: it authorises the change. */
  currentToken: string | null;
  envVars: Record<string, string>;
  defaultUser?: string;
  defaultWorkdir?: string;
  /** PEM certificates envd adds to the guest's trust store (the node's egress CA). */
  caBundle?: string;
}

/**
 * POST /init; retried for up to `timeoutMs` while envd is busy or unreachable. An attempt whose
 * answer was lost may have taken effect: once one has, the token that proves the change is the
 * new one, so a 401 after a lost answer is retried once with the new token before it counts.
 */
export async function initEnvd(baseUrl: string, init: EnvdInit, timeoutMs: number): Promise<void> {
  const t0 = performance.now();
  const entropy = Buffer.from(crypto.getRandomValues(new Uint8Array(64))).toString("base64");
  let last = "no answer";
  let proof = init.currentToken;
  let answerLost = false;
  for (;;) {
    const body = JSON.stringify({
      accessToken: init.accessToken,
      envVars: init.envVars,
      defaultUser: init.defaultUser ?? "user",
      ...(init.defaultWorkdir ? { defaultWorkdir: init.defaultWorkdir } : {}),
      ...(init.caBundle ? { caBundle: init.caBundle } : {}),
      timestamp: new Date().toISOString(),
      aenvEntropy: entropy,
    });
    try {
      const signal = AbortSignal.timeout(ENVD_INIT_TIMEOUT_MS);
      const r = await fetch(`${baseUrl}/init`, {
        method: "POST",
        headers: { "content-type": "application/json", ...(proof ? { "x-access-token": proof } : {}) },
        body,
        signal,
      });
      const text = await readBoundedText(r, ENVD_INIT_ANSWER_MAX_BYTES, `envd ${baseUrl}/init`, signal);
      if (r.status === 204 || r.status === 200) return;
      last = `HTTP ${r.status} ${text.slice(0, 200)}`;
      if (r.status === 401 && answerLost && proof !== init.accessToken) {
        proof = init.accessToken;
        answerLost = false;
        continue;
      }
      if (r.status === 401 || r.status === 400) throw new EnvdUnreachableError(`envd /init refused: ${last}`);
    } catch (e) {
      if (e instanceof EnvdUnreachableError) throw e;
      last = (e as Error).message;
      answerLost = true;
    }
    if (performance.now() - t0 > timeoutMs) throw new EnvdUnreachableError(`envd /init at ${baseUrl} did not succeed within ${timeoutMs} ms (${last})`);
    await Bun.sleep(20);
  }
}

/** The numbers of one /metrics answer (envd's field names); every other field, and a value that is not a finite number, left out. */
export type EnvdMetrics = Partial<Record<"ts" | "cpu_count" | "cpu_used_pct" | "mem_used" | "mem_total" | "mem_cache" | "disk_used" | "disk_total", number>>;
const METRIC_FIELDS = ["ts", "cpu_count", "cpu_used_pct", "mem_used", "mem_total", "mem_cache", "disk_used", "disk_total"] as const;

/**
 * GET /metrics of a sandbox's envd: at most ENVD_METRICS_MAX_BYTES within ENVD_METRICS_TIMEOUT_MS;
 * undefined when it does not answer 200 with a JSON object (a failure of the guest is no failure of
 * the node). `ts` must be a time in seconds a Date can hold, or it is left out.
 */
export async function envdMetrics(baseUrl: string, accessToken: string | null): Promise<EnvdMetrics | undefined> {
  try {
    const signal = AbortSignal.timeout(ENVD_METRICS_TIMEOUT_MS);
    const r = await fetch(`${baseUrl}/metrics`, { headers: accessToken ? { "x-access-token": accessToken } : {}, signal });
    const text = await readBoundedText(r, ENVD_METRICS_MAX_BYTES, `envd ${baseUrl}/metrics`, signal);
    if (!r.ok) return undefined;
    const doc = JSON.parse(text) as unknown;
    if (doc === null || typeof doc !== "object" || Array.isArray(doc)) return undefined;
    const out: EnvdMetrics = {};
    for (const k of METRIC_FIELDS) {
      const v = (doc as Record<string, unknown>)[k];
      if (typeof v === "number" && Number.isFinite(v)) out[k] = v;
    }
    // Date holds ±8.64e15 ms: a `ts` past it would make the sample's time throw.
    if (out.ts !== undefined && !(Math.abs(out.ts) <= 8.64e12)) delete out.ts;
    return out;
  } catch {
    return undefined;
  }
}
