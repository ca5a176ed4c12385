// Which node aenv talks to and with which key, the saved credentials of `aenv auth`, plain API calls
// for what the e2b SDK has no method for, and the translation of failures into one line that names
// the fix. Sandbox operations go through the stock e2b SDK with the node as both its API and its
// sandbox URL, so envd traffic passes through the node's proxy.

import { chmodSync, closeSync, mkdirSync, openSync, renameSync, writeSync } from "node:fs";
import { homedir } from "node:os";
import { dirname, join } from "node:path";
import { AuthenticationError, NotFoundError, Sandbox, type ConnectionOpts } from "e2b";
import { configuredApiKey, loadConfig } from "../node/config.ts";
import { UsageError, type ParsedArgs } from "./args.ts";
import type { Option } from "./verbs.ts";

/** Where a node listens when nothing says otherwise (`bun run node` on this machine). */
export const DEFAULT_URL = "http://127.0.0.1:3000";
/** One API request, a sandbox create (a restore under load) included. */
export const REQUEST_TIMEOUT_MS = 180_000;
/** Bound on the credentials file: a URL and a key. */
const CREDENTIALS_MAX_BYTES = 16 << 10;

/** The options every node verb takes. */
export const NODE_OPTIONS: Option[] = [
  { flag: "--url", value: "URL", common: true, help: `the node (default: AENV_URL, the saved credentials, ${DEFAULT_URL})` },
  { flag: "--api-key", value: "KEY", common: true, help: "API key (default: AENV_API_KEY, the saved credentials, a local node's key file)" },
];

export interface NodeTarget {
  url: string;
  apiKey: string;
  /** Where the key came from, for messages. */
  keyFrom: string;
}

/** A failure whose message already says what to do; exit 1. */
export class NodeError extends Error {
  constructor(name: string, message: string, readonly status?: number) {
    super(message);
    this.name = name;
  }
}

export const unreachable = (url: string) =>
  new NodeError("Unreachable", `cannot reach the node at ${url}: is \`bun run node\` running? (--url / AENV_URL)`);
export const keyRefused = (t: NodeTarget) =>
  new NodeError("KeyRefused", `the node refused the API key (from ${t.keyFrom}): run \`aenv auth\``, 401);

export type Subject = { kind: "sandbox" | "template" | "snapshot" | "node"; id: string };
const LISTED_BY: Record<Subject["kind"], string> = { sandbox: "aenv ls", template: "aenv template ls", snapshot: "aenv snapshot ls", node: "aenv node ls" };
export const unknown = (t: NodeTarget, s: Subject) =>
  new NodeError("NotFound", `no ${s.kind} ${s.id} on ${t.url}: \`${LISTED_BY[s.kind]}\` lists them`, 404);

// ---------------------------------------------------------------------------------------------
// credentials

export function credentialsPath(env: Record<string, string | undefined> = process.env): string {
  return join(env.XDG_CONFIG_HOME || join(env.HOME || homedir(), ".config"), "aenv", "credentials");
}

export interface Credentials { url: string; apiKey: string }

/** The saved URL and key, or null when `aenv auth` never ran. A damaged file is an error naming it. */
export async function readCredentials(path = credentialsPath()): Promise<Credentials | null> {
  const f = Bun.file(path);
  if (!(await f.exists())) return null;
  if (f.size > CREDENTIALS_MAX_BYTES) throw new NodeError("BadCredentials", `${path}: larger than ${CREDENTIALS_MAX_BYTES} bytes: run \`aenv auth\` to rewrite it`);
  let parsed: Record<string, unknown>;
  try {
    parsed = Bun.TOML.parse(await f.text()) as Record<string, unknown>;
  } catch (e) {
    throw new NodeError("BadCredentials", `${path}: ${(e as Error).message}: run \`aenv auth\` to rewrite it`);
  }
  if (typeof parsed.url !== "string" || typeof parsed.api_key !== "string")
    throw new NodeError("BadCredentials", `${path}: needs url and api_key: run \`aenv auth\` to rewrite it`);
  return { url: normalizeUrl(parsed.url, path), apiKey: parsed.api_key };
}

/** Written by rename (a crash leaves the old file or the new one), mode 0600 in a 0700 directory. */
export function writeCredentials(c: Credentials, path = credentialsPath()): void {
  mkdirSync(dirname(path), { recursive: true, mode: 0o700 });
  const tmp = `${path}.tmp-${process.pid}`;
  const fd = openSync(tmp, "w", 0o600);
  try {
    writeSync(fd, `url = ${JSON.stringify(c.url)}\napi_key = ${JSON.stringify(c.apiKey)}\n`);
  } finally {
    closeSync(fd);
  }
  chmodSync(tmp, 0o600);
  renameSync(tmp, path);
}

// ---------------------------------------------------------------------------------------------
// which node, which key

/** `http(s)://host[:port]` without a trailing slash; anything else is a usage error. */
export function normalizeUrl(raw: string, from: string): string {
  let u: URL;
  try {
    u = new URL(raw);
  } catch {
    throw new UsageError(`${from}: ${JSON.stringify(raw)} is not a URL (e.g. ${DEFAULT_URL})`);
  }
  if (u.protocol !== "http:" && u.protocol !== "https:") throw new UsageError(`${from}: ${raw}: expected http:// or https://`);
  return `${u.protocol}//${u.host}${u.pathname.replace(/\/+$/, "")}`;
}

const isLoopback = (url: string) => ["127.0.0.1", "localhost", "[::1]"].includes(new URL(url).hostname);

/**
 * The node and key for a verb. URL: --url, AENV_URL, the saved credentials, DEFAULT_URL. Key:
 * --api-key, AENV_API_KEY, the saved credentials when they are for this URL, and for a node on
 * loopback the key that node's settings name (AENV_HOME's key file, read as the node reads it).
 */
export async function resolveTarget(a: ParsedArgs, env: Record<string, string | undefined> = process.env): Promise<NodeTarget> {
  const saved = await readCredentials(credentialsPath(env));
  const flagUrl = a.value("url");
  const url = flagUrl !== undefined ? normalizeUrl(flagUrl, "--url")
    : env.AENV_URL ? normalizeUrl(env.AENV_URL, "AENV_URL")
    : saved?.url ?? DEFAULT_URL;
  const flagKey = a.value("api-key");
  if (flagKey !== undefined) return { url, apiKey: flagKey, keyFrom: "--api-key" };
  if (env.AENV_API_KEY) return { url, apiKey: env.AENV_API_KEY, keyFrom: "AENV_API_KEY" };
  if (saved && saved.url === url) return { url, apiKey: saved.apiKey, keyFrom: credentialsPath(env) };
  if (isLoopback(url)) {
    const local = localNodeKey(env);
    if (local) return { url, ...local };
  }
  throw new NodeError("NoApiKey", `no API key for ${url}: run \`aenv auth\` (or pass --api-key / set AENV_API_KEY)`);
}

/** The key of the node this machine's settings describe, when it has written one and we may read it. */
function localNodeKey(env: Record<string, string | undefined>): { apiKey: string; keyFrom: string } | null {
  try {
    const found = configuredApiKey(loadConfig(env));
    return found && { apiKey: found.key, keyFrom: found.path ?? "the node's settings" };
  } catch (e) {
    const code = (e as NodeJS.ErrnoException).code;
    if (code === "EACCES" || code === "EPERM") {
      throw new NodeError("NoApiKey", `cannot read the local node's API key (${(e as Error).message}): run as its user, or \`aenv auth\``);
    }
    throw e;
  }
}

/** The stock SDK pointed at the node: API and envd traffic (through the node's proxy) both go there. */
export function sdkOpts(t: NodeTarget): ConnectionOpts {
  return { apiKey: t.apiKey, apiUrl: t.url, sandboxUrl: t.url, requestTimeoutMs: REQUEST_TIMEOUT_MS };
}

// ---------------------------------------------------------------------------------------------
// failures

const NETWORK_CODES = new Set(["ECONNREFUSED", "ECONNRESET", "ENOTFOUND", "EHOSTUNREACH", "ENETUNREACH", "ETIMEDOUT", "EAI_AGAIN",
  "ConnectionRefused", "ConnectionClosed", "FailedToOpenSocket", "UnableToConnect"]);

function isNetworkError(e: unknown): boolean {
  for (let c = e as { code?: string; cause?: unknown } | undefined, depth = 0; c && depth < 5; c = c.cause as typeof c, depth++) {
    if (typeof c.code === "string" && NETWORK_CODES.has(c.code)) return true;
  }
  return false;
}

/** SDK errors carry the status as "404: message" where they have no class of their own. */
const statusOf = (e: unknown) => Number(/^(\d{3}): /.exec((e as Error)?.message ?? "")?.[1] ?? NaN);

/** A failure of a call to the node as the line a user acts on; anything else as it is. */
export function explain(e: unknown, t: NodeTarget, subject?: Subject): unknown {
  if (e instanceof NodeError || e instanceof UsageError) return e;
  if (isNetworkError(e)) return unreachable(t.url);
  if (e instanceof AuthenticationError || statusOf(e) === 401) return keyRefused(t);
  if (subject && (e instanceof NotFoundError || statusOf(e) === 404)) return unknown(t, subject);
  return e;
}

/** Run `fn` against the node, its failures explained. */
export async function onNode<T>(t: NodeTarget, subject: Subject | undefined, fn: () => Promise<T>): Promise<T> {
  try {
    return await fn();
  } catch (e) {
    throw explain(e, t, subject);
  }
}

// ---------------------------------------------------------------------------------------------
// plain API calls

/**
 * One JSON request to the node's E2B API. 401 and network failures are explained; a 404 is
 * `unknown(subject)` when a subject is given; any other non-2xx is a NodeError with the node's
 * message and status.
 */
export async function api<T = unknown>(t: NodeTarget, method: string, path: string, o: { body?: unknown; subject?: Subject; timeoutMs?: number } = {}): Promise<{ status: number; data: T; headers: Headers }> {
  let res: Response;
  try {
    res = await fetch(`${t.url}${path}`, {
      method,
      headers: { "x-api-key": t.apiKey, ...(o.body === undefined ? {} : { "content-type": "application/json" }) },
      body: o.body === undefined ? undefined : JSON.stringify(o.body),
      signal: AbortSignal.timeout(o.timeoutMs ?? REQUEST_TIMEOUT_MS),
    });
  } catch (e) {
    throw explain(e, t);
  }
  const text = await res.text();
  let data: unknown = undefined;
  try {
    data = text ? JSON.parse(text) : undefined;
  } catch {
    data = text;
  }
  if (res.ok) return { status: res.status, data: data as T, headers: res.headers };
  if (res.status === 401) throw keyRefused(t);
  if (res.status === 404 && o.subject) throw unknown(t, o.subject);
  const message = (data as { message?: string } | undefined)?.message ?? (text || res.statusText);
  throw new NodeError("NodeRefused", `${method} ${path}: the node answered ${res.status}: ${message}`, res.status);
}

/** What GET /sandboxes/{id} tells about one sandbox, the envd token included (the SDK's info leaves it out). */
interface SandboxDetail {
  sandboxID: string;
  state: "running" | "paused";
  envdVersion: string;
  envdAccessToken?: string;
  domain?: string | null;
}

/**
 * An SDK handle on an existing sandbox. A running one is used as it is (its TTL untouched); a
 * paused one is resumed by a connect, which gives it the node's default TTL.
 */
export async function openSandbox(t: NodeTarget, id: string): Promise<Sandbox> {
  const subject: Subject = { kind: "sandbox", id };
  const { data } = await api<SandboxDetail>(t, "GET", `/sandboxes/${encodeURIComponent(id)}`, { subject });
  if (data.state !== "running") return onNode(t, subject, () => Sandbox.connect(id, sdkOpts(t)));
  return new Sandbox({
    ...sdkOpts(t),
    sandboxId: data.sandboxID,
    sandboxDomain: data.domain ?? undefined,
    envdVersion: data.envdVersion,
    envdAccessToken: data.envdAccessToken,
  });
}

/** A sandbox id as the API takes it; anything else cannot name one (and would not fit the path). */
export function sandboxId(raw: string): string {
  if (!/^[a-z0-9]{1,64}$/.test(raw)) throw new UsageError(`${JSON.stringify(raw)} is not a sandbox ID (lowercase letters and digits; \`aenv ls\` lists them)`);
  return raw;
}
