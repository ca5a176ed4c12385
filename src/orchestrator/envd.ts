// The orchestrator's two calls into a sandbox's envd: wait until it answers, and /init (token,
// env, clock, entropy, the node's egress CA). Both are bounded in time; each attempt has its own short timeout.

/** envd's port in every sandbox (E2B's). */
export const ENVD_PORT = 49983;
/** The envd version this node's guest reports (semver: the SDK's compare-versions needs it). */
export const ENVD_VERSION = "0.6.13";

export class EnvdUnreachableError extends Error {
  constructor(message: string) { super(message); this.name = "EnvdUnreachableError"; }
}

/** Polls GET /health every 20 ms until it answers 204; `alive` false stops early (the VMM died). */
export async function waitEnvdReady(baseUrl: string, timeoutMs: number, alive: () => boolean): Promise<number> {
  const t0 = performance.now();
  let last = "no answer";
  for (;;) {
    try {
      const r = await fetch(`${baseUrl}/health`, { signal: AbortSignal.timeout(1000) });
      await r.arrayBuffer();
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
      const r = await fetch(`${baseUrl}/init`, {
        method: "POST",
        headers: { "content-type": "application/json", ...(proof ? { "x-access-token": proof } : {}) },
        body,
        signal: AbortSignal.timeout(2000),
      });
      const text = await r.text();
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
