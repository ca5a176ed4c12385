// One HTTP exchange with a registry, with everything around it: the URL (https; plain http, and
// loopback, link-local or this machine's own addresses, only for the registries listed insecure),
// authorization (Basic, or a Bearer token from the realm a 401 names, cached per scope until it
// expires), redirects followed by hand (the Authorization header never leaves the registry's
// origin; a hop, a token realm or an upload Location elsewhere is held to the same destination
// rule, src/storage/remote/destination.ts), a timeout per try, retries with
// exponential backoff for what may pass (network errors, timeouts, 408, 429, 5xx), and every
// other answer turned into a RegistryError that names the image and the registry.
import {
  basicAuthorization,
  type CachedToken,
  type Challenge,
  CredentialStore,
  type Credentials,
  DEFAULT_TOKEN_SECONDS,
  defaultDockerConfigPath,
  MAX_CACHED_TOKENS,
  parseChallenges,
  TOKEN_RENEW_MARGIN_MS,
} from "./auth.ts";
import { RegistryError, type RegistryErrorCode } from "./errors.ts";
import { type ImageRef } from "./reference.ts";
import { describeInternal, destinationRefusal, InsecureHosts, internalAddressOf } from "../../storage/remote/destination.ts";

export interface TransportOptions {
  /** Credentials per registry name (`docker.io`, `127.0.0.1:5000`); they win over Docker's config file. */
  credentials?: Record<string, Credentials>;
  /** Docker's config file; null reads none. Default `$DOCKER_CONFIG/config.json` or `~/.docker/config.json`. */
  dockerConfigPath?: string | null;
  /**
   * Registries (`host` for any port, `host:port`) spoken to over plain http and allowed at loopback,
   * link-local or this machine's own addresses (the node's insecure_registries); any other is https
   * and public, and so is every redirect, token realm and upload Location that leaves its origin.
   */
  insecureRegistries?: readonly string[];
  /** A blob larger than this is refused, by its descriptor or its Content-Length [DEFAULT_MAX_BLOB_BYTES]. */
  maxBlobBytes?: number;
  /** Tries per request, the first included [5]. */
  tries?: number;
  /** First backoff; each further one doubles, with jitter, up to retryMaxMs [500 ms]. */
  retryBaseMs?: number;
  retryMaxMs?: number;
  /** Per try: until the response's headers (and, for manifests, configs and tokens, its body) [30 s]. */
  timeoutMs?: number;
}

export const DEFAULT_TRIES = 5;
export const DEFAULT_RETRY_BASE_MS = 500;
export const DEFAULT_RETRY_MAX_MS = 8_000;
export const DEFAULT_TIMEOUT_MS = 30_000;
/** 10 GiB: above the largest layers of common images (CUDA, ML runtimes: 3-6 GiB), far below a disk's worth. */
export const DEFAULT_MAX_BLOB_BYTES = 10 * 2 ** 30;
/** Redirect hops followed per request. */
const MAX_REDIRECTS = 5;
/** Bytes of an error body or a token answer read at most. */
const MAX_ERROR_BODY = 64 << 10;
const MAX_TOKEN_BODY = 1 << 20;

export type Actions = "pull" | "pull,push";

export interface RequestSpec {
  ref: ImageRef;
  method: "GET" | "HEAD" | "POST" | "PUT" | "PATCH" | "DELETE";
  /** Under `/v2/<repository>/`, e.g. `manifests/latest`; or `url`, absolute (an upload's Location). */
  path?: string;
  url?: string;
  headers?: Record<string, string>;
  /** Made again for each try. */
  body?: () => Bun.BodyInit | undefined;
  actions: Actions;
  /** Names the thing in messages: `manifest latest of 127.0.0.1:5000/app`. */
  what: string;
  /** Statuses that are an answer; anything else becomes an error. */
  expect: number[];
  /** Read the body (at most this many bytes, or TooLarge) within the try's timeout. */
  readBody?: number;
  /** This try's limit instead of the transport's timeoutMs. */
  timeoutMs?: number;
}

export interface Answer {
  res: Response;
  /** The body, when readBody was asked for. */
  body?: Uint8Array;
  /** Aborts the exchange (a streaming reader's idle timeout uses it). */
  controller: AbortController;
  /** The URL that answered, after redirects. */
  url: string;
}

/** A failure another try may fix. */
export class Retryable extends Error {
  constructor(
    readonly error: RegistryError,
    readonly retryAfterMs?: number,
  ) {
    super(error.message);
  }
}

const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

/** Read a body to its end, at most max bytes; past it the stream is cancelled and TooLarge thrown. */
export async function readBounded(res: Response, max: number, what: string): Promise<Uint8Array> {
  const declared = Number(res.headers.get("content-length") ?? "NaN");
  if (Number.isFinite(declared) && declared > max) {
    await res.body?.cancel().catch(() => {});
    throw new RegistryError("TooLarge", `${what}: ${declared} bytes, more than ${max}`);
  }
  if (!res.body) return new Uint8Array(0);
  const reader = res.body.getReader();
  const chunks: Uint8Array[] = [];
  let n = 0;
  for (;;) {
    const { done, value } = await reader.read();
    if (done) break;
    n += value.length;
    if (n > max) {
      await reader.cancel().catch(() => {});
      throw new RegistryError("TooLarge", `${what}: more than ${max} bytes`);
    }
    chunks.push(value);
  }
  return Buffer.concat(chunks);
}

interface RegistryErrorBody {
  code?: string;
  message?: string;
}

function describeErrorBody(body: Uint8Array): string {
  try {
    const doc = JSON.parse(new TextDecoder().decode(body)) as { errors?: RegistryErrorBody[] };
    const e = doc.errors?.[0];
    if (e?.code) return ` (${e.code}${e.message ? `: ${e.message}` : ""})`;
  } catch {
    /* not the registry's JSON */
  }
  return "";
}

/** Network and abort errors of fetch as Timeout or Unreachable, retryable. */
function networkError(e: unknown, what: string, host: string, timedOut: boolean): Retryable {
  if (e instanceof RegistryError) return new Retryable(e);
  if (timedOut) return new Retryable(new RegistryError("Timeout", `${what}: registry ${host} did not answer in time`));
  const err = e as { code?: string; message?: string };
  return new Retryable(new RegistryError("Unreachable", `${what}: registry ${host} unreachable (${err.code ?? err.message ?? String(e)})`));
}

export class Transport {
  readonly tries: number;
  readonly retryBaseMs: number;
  readonly retryMaxMs: number;
  readonly timeoutMs: number;
  private readonly creds: CredentialStore;
  readonly maxBlobBytes: number;
  private readonly insecure: InsecureHosts;
  /** Each endpoint's check (an internal address needs listing), made once per client: one entry per registry it speaks to. */
  private readonly endpointChecks = new Map<string, Promise<void>>();
  /** The challenge each endpoint answered last, so later requests carry authorization up front. */
  private readonly challenges = new Map<string, Challenge>();
  private readonly tokens = new Map<string, CachedToken>();
  private readonly tokenFetches = new Map<string, Promise<CachedToken>>();

  constructor(opts: TransportOptions = {}) {
    this.tries = Math.max(1, opts.tries ?? DEFAULT_TRIES);
    this.retryBaseMs = opts.retryBaseMs ?? DEFAULT_RETRY_BASE_MS;
    this.retryMaxMs = opts.retryMaxMs ?? DEFAULT_RETRY_MAX_MS;
    this.timeoutMs = opts.timeoutMs ?? DEFAULT_TIMEOUT_MS;
    this.creds = new CredentialStore(opts.credentials, opts.dockerConfigPath === undefined ? defaultDockerConfigPath() : opts.dockerConfigPath);
    this.maxBlobBytes = opts.maxBlobBytes ?? DEFAULT_MAX_BLOB_BYTES;
    this.insecure = new InsecureHosts(opts.insecureRegistries);
  }

  /** Plain http only for the registries listed insecure. */
  allowsHttp(hostPort: string): boolean {
    return this.insecure.hasHostPort(hostPort);
  }

  /** Forbidden when the registry is at an internal address (loopback, link-local, this machine's) and not listed insecure. */
  checkEndpoint(ref: ImageRef, what: string): Promise<void> {
    let check = this.endpointChecks.get(ref.endpoint);
    if (!check) {
      check = (async () => {
        if (this.allowsHttp(ref.endpoint)) return;
        const internal = await internalAddressOf(new URL(`https://${ref.endpoint}`).hostname);
        if (!internal) return;
        throw new RegistryError("Forbidden", `registry ${ref.endpoint} is ${describeInternal(internal)}: the node reaches such a registry only when it is listed in insecure_registries (AENV_INSECURE_REGISTRIES)`);
      })();
      this.endpointChecks.set(ref.endpoint, check);
    }
    return check.catch((e: RegistryError) => {
      throw new RegistryError(e.code, `${what}: ${e.message}`);
    });
  }

  baseUrl(ref: ImageRef): string {
    return `${this.allowsHttp(ref.endpoint) ? "http" : "https"}://${ref.endpoint}/v2/${ref.repository}/`;
  }

  /** The wait before try n+1 (n ≥ 1): base·2^(n-1), halved at random, at most retryMaxMs; Retry-After when longer. */
  backoffMs(n: number, retryAfterMs?: number): number {
    const exp = Math.min(this.retryMaxMs, this.retryBaseMs * 2 ** (n - 1));
    const jittered = exp / 2 + (Math.random() * exp) / 2;
    return Math.min(this.retryMaxMs, Math.max(jittered, retryAfterMs ?? 0));
  }

  /** A request with retries: the answer whose status is in spec.expect, or the last try's error. */
  async send(spec: RequestSpec): Promise<Answer> {
    for (let n = 1; ; n++) {
      try {
        return await this.attempt(spec);
      } catch (e) {
        if (!(e instanceof Retryable)) throw e;
        if (n >= this.tries) {
          e.error.message += ` (after ${n} tries)`;
          throw e.error;
        }
        await sleep(this.backoffMs(n, e.retryAfterMs));
      }
    }
  }

  /** One try: fetch with authorization, answering a 401 challenge once, following redirects. */
  async attempt(spec: RequestSpec): Promise<Answer> {
    const controller = new AbortController();
    let timedOut = false;
    const timer = setTimeout(() => {
      timedOut = true;
      controller.abort();
    }, spec.timeoutMs ?? this.timeoutMs);
    const host = spec.ref.endpoint;
    try {
      await this.checkEndpoint(spec.ref, spec.what);
      const start = spec.url ?? this.baseUrl(spec.ref) + (spec.path ?? "");
      let auth = await this.authorization(spec.ref, spec.actions, undefined);
      let answer = await this.follow(spec, start, auth, controller);
      if (answer.res.status === 401) {
        const challenge = this.pickChallenge(answer.res);
        await answer.res.body?.cancel().catch(() => {});
        if (!challenge) throw new RegistryError("Unauthorized", `${spec.what}: registry ${host} answered 401 without a Basic or Bearer challenge`);
        this.challenges.set(host, challenge);
        let next = await this.authorization(spec.ref, spec.actions, challenge);
        if (next !== undefined && next === auth && challenge.scheme === "bearer") {
          // The cached token was refused (expired early, or the registry restarted): one fresh token.
          this.dropTokens(challenge);
          next = await this.authorization(spec.ref, spec.actions, challenge);
        }
        if (next === undefined) {
          throw new RegistryError("Unauthorized", `${spec.what}: registry ${host} needs credentials and none are configured for ${spec.ref.registry}`);
        }
        if (next === auth) throw await this.refused(spec);
        auth = next;
        answer = await this.follow(spec, start, auth, controller);
        if (answer.res.status === 401) {
          await answer.res.body?.cancel().catch(() => {});
          this.dropTokens(challenge);
          throw await this.refused(spec);
        }
      }
      const res = answer.res;
      if (!spec.expect.includes(res.status)) throw await this.statusError(res, spec);
      if (spec.readBody !== undefined) answer.body = await readBounded(res, spec.readBody, spec.what);
      return answer;
    } catch (e) {
      if (e instanceof RegistryError || e instanceof Retryable) {
        if (timedOut && e instanceof RegistryError && e.code !== "TooLarge") throw networkError(e, spec.what, host, true);
        throw e;
      }
      throw networkError(e, spec.what, host, timedOut);
    } finally {
      clearTimeout(timer);
    }
  }

  private async follow(spec: RequestSpec, start: string, auth: string | undefined, controller: AbortController): Promise<Answer> {
    const origin = new URL(start).origin;
    let url = start;
    let method: string = spec.method;
    for (let hop = 0; ; hop++) {
      // identity: a registry or CDN that compressed on the fly would have fetch hash other bytes than the blob's.
      const headers: Record<string, string> = { "accept-encoding": "identity", ...spec.headers };
      if (auth && new URL(url).origin === origin) headers.authorization = auth;
      const res = await fetch(url, {
        method,
        headers,
        body: method === "GET" || method === "HEAD" ? undefined : spec.body?.(),
        redirect: "manual",
        signal: controller.signal,
      });
      if (![301, 302, 303, 307, 308].includes(res.status)) return { res, controller, url };
      await res.body?.cancel().catch(() => {});
      const location = res.headers.get("location");
      if (!location || hop >= MAX_REDIRECTS) {
        throw new RegistryError("Protocol", `${spec.what}: registry ${spec.ref.endpoint} redirected ${hop + 1} times or without a Location`);
      }
      const next = new URL(location, url);
      if (next.origin !== origin) await this.checkDestination(next, spec.what);
      url = next.href;
      if (res.status === 303) method = "GET";
    }
  }

  /** The error for a second 401: the credentials were wrong, or there were none and anonymous access is not enough. */
  private async refused(spec: RequestSpec): Promise<RegistryError> {
    const creds = await this.creds.get(spec.ref.registry);
    const host = spec.ref.endpoint;
    return new RegistryError(
      "Unauthorized",
      creds
        ? `${spec.what}: registry ${host} rejected the credentials of ${creds.username} for ${spec.ref.registry}`
        : `${spec.what}: registry ${host} refused anonymous access; it needs credentials and none are configured for ${spec.ref.registry}`,
    );
  }

  /** A redirect, realm or upload Location may go to a listed registry, or over https to a host with no internal address; else Forbidden. */
  async checkDestination(u: URL, what: string): Promise<void> {
    if (u.protocol !== "https:" && u.protocol !== "http:") throw new RegistryError("Protocol", `${what}: refusing ${u.protocol}//${u.host} (not http or https)`);
    const why = await destinationRefusal(u, this.insecure);
    if (why) throw new RegistryError("Forbidden", `${what}: refusing ${u.origin}: ${why}`);
  }

  private pickChallenge(res: Response): Challenge | undefined {
    const all = parseChallenges(res.headers.get("www-authenticate"));
    return all.find((c) => c.scheme === "bearer") ?? all.find((c) => c.scheme === "basic");
  }

  /** The scope a request needs: the challenge's when it names one, else this repository's. */
  private scopeFor(ref: ImageRef, actions: Actions, challenge: Challenge | undefined): string {
    return challenge?.params.scope || `repository:${ref.repository}:${actions}`;
  }

  /** The Authorization header for a request, from the endpoint's last challenge; undefined when anonymous. */
  private async authorization(ref: ImageRef, actions: Actions, fresh: Challenge | undefined): Promise<string | undefined> {
    const challenge = fresh ?? this.challenges.get(ref.endpoint);
    if (!challenge) return undefined;
    const creds = await this.creds.get(ref.registry);
    if (challenge.scheme === "basic") return creds ? basicAuthorization(creds) : undefined;
    // A remembered challenge's scope named another repository: ask for ours.
    const scope = fresh ? this.scopeFor(ref, actions, fresh) : `repository:${ref.repository}:${actions}`;
    const token = await this.token(ref, challenge, scope, creds);
    return `Bearer ${token.token}`;
  }

  /**
   * The Authorization a pull from ref's repository carries now (none: anonymous), for a reader
   * outside this client (blockd's range reads); a Bearer token comes with its expiry and, with
   * `fresh`, is a new one. A registry whose challenge is unknown yet is asked once (HEAD `probe`).
   */
  async pullAuthorization(ref: ImageRef, probe: string, o: { fresh?: boolean } = {}): Promise<{ value?: string; expiresAt?: number }> {
    if (!this.challenges.has(ref.endpoint)) {
      const a = await this.send({ ref, method: "HEAD", path: probe, actions: "pull", what: `${probe} of ${ref.repository} on ${ref.endpoint}`, expect: [200, 404] });
      await a.res.body?.cancel().catch(() => {});
    }
    const challenge = this.challenges.get(ref.endpoint);
    if (!challenge) return {};
    const creds = await this.creds.get(ref.registry);
    if (challenge.scheme === "basic") return creds ? { value: basicAuthorization(creds) } : {};
    const scope = `repository:${ref.repository}:pull`;
    if (o.fresh) this.tokens.delete(this.tokenKey(challenge, scope, creds));
    const t = await this.token(ref, challenge, scope, creds);
    return { value: `Bearer ${t.token}`, expiresAt: t.expiresAt };
  }

  private tokenKey(challenge: Challenge, scope: string, creds: Credentials | undefined): string {
    return JSON.stringify([challenge.params.realm, challenge.params.service ?? "", scope, creds?.username ?? ""]);
  }

  /** A token the registry refused is not offered again: the realm's tokens are fetched anew. */
  private dropTokens(challenge: Challenge): void {
    if (challenge.scheme !== "bearer") return;
    for (const k of [...this.tokens.keys()]) if ((JSON.parse(k) as string[])[0] === challenge.params.realm) this.tokens.delete(k);
  }

  /** A token for scope: cached until TOKEN_RENEW_MARGIN_MS before it expires; concurrent askers share one fetch. */
  private async token(ref: ImageRef, challenge: Challenge, scope: string, creds: Credentials | undefined): Promise<CachedToken> {
    const key = this.tokenKey(challenge, scope, creds);
    const cached = this.tokens.get(key);
    if (cached && cached.expiresAt - TOKEN_RENEW_MARGIN_MS > Date.now()) return cached;
    let pending = this.tokenFetches.get(key);
    if (!pending) {
      pending = this.fetchToken(ref, challenge, scope, creds).finally(() => this.tokenFetches.delete(key));
      this.tokenFetches.set(key, pending);
    }
    const t = await pending;
    this.tokens.delete(key);
    this.tokens.set(key, t);
    while (this.tokens.size > MAX_CACHED_TOKENS) this.tokens.delete(this.tokens.keys().next().value!);
    return t;
  }

  private async fetchToken(ref: ImageRef, challenge: Challenge, scope: string, creds: Credentials | undefined): Promise<CachedToken> {
    const what = `token for ${scope} on ${ref.registry}`;
    const realm = challenge.params.realm;
    if (!realm) throw new RegistryError("Protocol", `${what}: Bearer challenge of ${ref.endpoint} names no realm`);
    let url: URL;
    try {
      url = new URL(realm);
    } catch {
      throw new RegistryError("Protocol", `${what}: realm ${JSON.stringify(realm)} is not a URL`);
    }
    await this.checkDestination(url, what);
    if (challenge.params.service) url.searchParams.set("service", challenge.params.service);
    url.searchParams.set("scope", scope);
    const headers: Record<string, string> = {};
    if (creds) headers.authorization = basicAuthorization(creds);
    const controller = new AbortController();
    let timedOut = false;
    const timer = setTimeout(() => {
      timedOut = true;
      controller.abort();
    }, this.timeoutMs);
    let res: Response;
    let body: Uint8Array;
    try {
      // Not followed: a realm's redirect would carry the credentials elsewhere.
      res = await fetch(url, { headers, signal: controller.signal, redirect: "manual" });
      body = await readBounded(res, res.ok ? MAX_TOKEN_BODY : MAX_ERROR_BODY, what);
    } catch (e) {
      throw networkError(e, what, url.host, timedOut);
    } finally {
      clearTimeout(timer);
    }
    if (res.status === 401) {
      throw new RegistryError("Unauthorized", creds ? `${what}: realm ${url.host} rejected the credentials of ${creds.username}` : `${what}: realm ${url.host} needs credentials and none are configured for ${ref.registry}`);
    }
    if (res.status === 403) throw new RegistryError("Denied", `${what}: realm ${url.host} denied access${describeErrorBody(body)}`);
    if (res.status === 429 || res.status >= 500) throw new Retryable(new RegistryError("Unreachable", `${what}: realm ${url.host} answered ${res.status}`));
    if (res.status !== 200) throw new RegistryError("Protocol", `${what}: realm ${url.host} answered ${res.status}${describeErrorBody(body)}`);
    let doc: { token?: unknown; access_token?: unknown; expires_in?: unknown };
    try {
      doc = JSON.parse(new TextDecoder().decode(body));
    } catch {
      throw new RegistryError("Protocol", `${what}: realm ${url.host} answered something other than JSON`);
    }
    const token = typeof doc.token === "string" && doc.token ? doc.token : typeof doc.access_token === "string" ? doc.access_token : "";
    if (!token) throw new RegistryError("Protocol", `${what}: realm ${url.host} answered no token`);
    const seconds = typeof doc.expires_in === "number" && doc.expires_in > 0 ? doc.expires_in : DEFAULT_TOKEN_SECONDS;
    return { token, expiresAt: Date.now() + seconds * 1000 };
  }

  /** The error for an answer outside spec.expect. */
  private async statusError(res: Response, spec: RequestSpec): Promise<RegistryError | Retryable> {
    let body: Uint8Array = new Uint8Array(0);
    if (spec.method !== "HEAD") body = await readBounded(res, MAX_ERROR_BODY, spec.what).catch(() => new Uint8Array(0));
    else await res.body?.cancel().catch(() => {});
    const detail = describeErrorBody(body);
    const host = spec.ref.endpoint;
    const s = res.status;
    const err = (code: RegistryErrorCode, why: string) => new RegistryError(code, `${spec.what}: ${why}${detail}`);
    if (s === 404) return err("NotFound", `not found on registry ${host}`);
    if (s === 403) return err("Denied", `registry ${host} denied access`);
    if (s === 401) return err("Unauthorized", `registry ${host} answered 401`);
    if (s === 406 || s === 415) return err("UnsupportedMediaType", `registry ${host} answered ${s}`);
    if (s === 413) return err("TooLarge", `registry ${host} answered 413`);
    if (s === 408) return new Retryable(err("Timeout", `registry ${host} answered 408`));
    if (s === 429 || s >= 500) {
      const ra = Number(res.headers.get("retry-after"));
      return new Retryable(err("Unreachable", `registry ${host} answered ${s}`), Number.isFinite(ra) && ra > 0 ? ra * 1000 : undefined);
    }
    return err("Protocol", `registry ${host} answered ${s}`);
  }
}
