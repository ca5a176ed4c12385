// Registry credentials and challenges. Credentials come from the caller (per registry, e.g. an
// API request's username and password) or from Docker's config file (`$DOCKER_CONFIG/config.json`,
// else `~/.docker/config.json`, `auths[registry].auth` = base64 "user:password"). The caller's win.
// A 401 carries a `WWW-Authenticate` challenge: `Basic realm=…` or `Bearer realm=…,service=…,scope=…`.
import { readFile } from "node:fs/promises";
import { homedir } from "node:os";
import { join } from "node:path";
import { RegistryError } from "./errors.ts";
import { canonicalRegistry } from "./reference.ts";

export interface Credentials {
  username: string;
  password: string;
}

export interface Challenge {
  scheme: "basic" | "bearer";
  params: Record<string, string>;
}

/**
 * Docker's config file: `<dir>/config.json`, else `~/.docker/config.json`. `dir` is DOCKER_CONFIG's
 * meaning; the node passes its docker_config setting, other callers get this process's DOCKER_CONFIG.
 */
export function defaultDockerConfigPath(dir = process.env.DOCKER_CONFIG): string {
  return join(dir || join(homedir(), ".docker"), "config.json");
}

/** The config file is read once per client; one larger than this is refused. */
const MAX_DOCKER_CONFIG = 1 << 20;

/**
 * Parse Docker's config file into credentials per canonical registry name. Keys may carry a scheme
 * and path (`https://index.docker.io/v1/`). An entry with no `auth` (and no `username`/`password`)
 * is skipped: credential helpers (`credsStore`, `credHelpers`) are not run.
 */
export function parseDockerConfig(text: string, path: string): Map<string, Credentials> {
  let doc: unknown;
  try {
    doc = JSON.parse(text);
  } catch (e) {
    throw new RegistryError("Unauthorized", `docker config ${path}: not JSON (${(e as Error).message})`);
  }
  const out = new Map<string, Credentials>();
  const auths = (doc as { auths?: unknown })?.auths;
  if (!auths || typeof auths !== "object") return out;
  for (const [key, entry] of Object.entries(auths as Record<string, unknown>)) {
    if (!entry || typeof entry !== "object") continue;
    const e = entry as { auth?: unknown; username?: unknown; password?: unknown };
    let creds: Credentials | undefined;
    if (typeof e.auth === "string" && e.auth) {
      const plain = Buffer.from(e.auth, "base64").toString("utf8");
      const colon = plain.indexOf(":");
      if (colon <= 0) throw new RegistryError("Unauthorized", `docker config ${path}: auths[${JSON.stringify(key)}].auth is not base64 "user:password"`);
      creds = { username: plain.slice(0, colon), password: plain.slice(colon + 1) };
    } else if (typeof e.username === "string" && typeof e.password === "string") {
      creds = { username: e.username, password: e.password };
    }
    if (creds) out.set(canonicalRegistry(key), creds);
  }
  return out;
}

/** Credentials for registries, looked up by canonical registry name; the config file is read lazily, once. */
export class CredentialStore {
  private fromFile: Promise<Map<string, Credentials>> | undefined;
  private readonly given = new Map<string, Credentials>();

  constructor(
    given: Record<string, Credentials> | undefined,
    private readonly dockerConfigPath: string | null,
  ) {
    for (const [k, v] of Object.entries(given ?? {})) this.given.set(canonicalRegistry(k), v);
  }

  async get(registry: string): Promise<Credentials | undefined> {
    const key = canonicalRegistry(registry);
    const mine = this.given.get(key);
    if (mine) return mine;
    if (this.dockerConfigPath === null) return undefined;
    this.fromFile ??= this.readFile(this.dockerConfigPath);
    return (await this.fromFile).get(key);
  }

  private async readFile(path: string): Promise<Map<string, Credentials>> {
    let text: string;
    try {
      const buf = await readFile(path);
      if (buf.length > MAX_DOCKER_CONFIG) throw new RegistryError("Unauthorized", `docker config ${path}: larger than ${MAX_DOCKER_CONFIG} bytes`);
      text = buf.toString("utf8");
    } catch (e) {
      if (e instanceof RegistryError) throw e;
      if ((e as { code?: string }).code === "ENOENT") return new Map();
      throw new RegistryError("Unauthorized", `docker config ${path}: ${(e as Error).message}`);
    }
    return parseDockerConfig(text, path);
  }
}

export function basicAuthorization(c: Credentials): string {
  return `Basic ${Buffer.from(`${c.username}:${c.password}`, "utf8").toString("base64")}`;
}

/**
 * The challenges of a `WWW-Authenticate` header (RFC 7235: `scheme k=v, k="v"` lists, several
 * challenges in one header). Schemes other than Basic and Bearer are dropped.
 */
export function parseChallenges(header: string | null): Challenge[] {
  if (!header) return [];
  const out: Challenge[] = [];
  let i = 0;
  const n = header.length;
  const skipWs = () => {
    while (i < n && (header[i] === " " || header[i] === "\t" || header[i] === ",")) i++;
  };
  let current: Challenge | undefined;
  while (i < n) {
    skipWs();
    const start = i;
    while (i < n && /[A-Za-z0-9!#$%&'*+.^_`|~-]/.test(header[i]!)) i++;
    const token = header.slice(start, i);
    if (!token) {
      i++;
      continue;
    }
    let j = i;
    while (j < n && header[j] === " ") j++;
    if (header[j] === "=") {
      // An auth-param of the current challenge.
      i = j + 1;
      while (i < n && header[i] === " ") i++;
      let value = "";
      if (header[i] === '"') {
        i++;
        while (i < n && header[i] !== '"') {
          if (header[i] === "\\" && i + 1 < n) i++;
          value += header[i];
          i++;
        }
        i++;
      } else {
        const vs = i;
        while (i < n && header[i] !== "," && header[i] !== " ") i++;
        value = header.slice(vs, i);
      }
      if (current) current.params[token.toLowerCase()] = value;
    } else {
      const scheme = token.toLowerCase();
      current = scheme === "basic" || scheme === "bearer" ? { scheme, params: {} } : undefined;
      if (current) out.push(current);
    }
  }
  return out;
}

/** A token the realm answered with, cached per (realm, service, scope, user) until it expires. */
export interface CachedToken {
  token: string;
  expiresAt: number;
}

/** The spec's default lifetime when the realm names none. */
export const DEFAULT_TOKEN_SECONDS = 60;
/** A token is renewed this long before it expires, so no request carries one that lapses in flight. */
export const TOKEN_RENEW_MARGIN_MS = 10_000;
/** Tokens kept per client; the oldest goes first. */
export const MAX_CACHED_TOKENS = 256;
