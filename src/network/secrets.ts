// The node's user secrets: made through the E2B API (`/secrets`, src/api/secrets.ts) and read by
// header rules when a sandbox's request leaves (`secret:NAME` and `${e2b.secrets.NAME}` name the
// same secret). They live in <dir>/user (dir: $AENV_HOME/secrets, mode 0700), one file per secret,
// `<id>.json` of mode 0600 holding its value and metadata, written to a temporary name, synced and
// renamed (a crash leaves the old secret or the new one). The node's own files in <dir> (api-key,
// cluster-headers.json, registry/) are never reached: a secret is found by name in the index of
// <dir>/user only. Values are write-only: no answer carries one, and errors and logs name the secret
// only. A value is read when a request needs it (an update applies to the next request); a file
// that is not a regular one, is readable by group or others, or does not parse is refused.

import { chmod, lstat, mkdir, open, readdir, readFile, rename, rm, unlink } from "node:fs/promises";
import { join } from "node:path";
import { NetworkError } from "./command.ts";
import { MAX_HEADER_VALUE, SECRET_PLACEHOLDER, secretNameProblem, type HeaderValue } from "./policy.ts";

/** Secrets one node holds: 1000 × (8 KiB value + 8 KiB metadata) stays under 20 MiB on disk. */
export const MAX_SECRETS = 1000;
/** E2B's metadata bounds: entries, bytes of a key, of a value, and of all keys and values together. */
export const SECRET_METADATA_LIMITS = { entries: 32, keyBytes: 128, valueBytes: 1024, totalBytes: 8192 } as const;
/** A secret file: a value, metadata and a name at their bounds, JSON-escaped, stay below this. */
const MAX_FILE_BYTES = 128 * 1024;
/** Values kept in memory (by ID, checked against the file's identity on every use): every secret. */
const CACHE_ENTRIES = MAX_SECRETS;
/** Writes (create, update, delete) waiting their turn; more are refused (429). */
const MAX_WAITING_WRITES = 256;
const ID_FILE = /^(sec_[a-z0-9]{24})\.json$/;
const TEMP_PREFIX = ".tmp-";

/** What the API shows of a secret: never its value. */
export interface SecretInfo {
  id: string;
  name: string;
  version: number;
  metadata: Record<string, string>;
  /** Unix ms. */
  createdAt: number;
  updatedAt: number;
}

interface StoredSecret extends SecretInfo {
  value: string;
}

/** A request the store refuses: `status` is the HTTP answer (400 bad input, 404, 409 name taken, 429 full). */
export class SecretStoreError extends NetworkError {
  constructor(readonly status: 400 | 404 | 409 | 429, message: string) {
    super("BadSecret", message);
    this.name = "SecretStoreError";
  }
}

/** `sec_` and 24 characters of [a-z0-9]. */
function secretId(): string {
  const alphabet = "abcdefghijklmnopqrstuvwxyz0123456789";
  let s = "sec_";
  for (const b of crypto.getRandomValues(new Uint8Array(24))) s += alphabet[b % 36];
  return s;
}

/** Why `value` cannot be a secret's value (it is sent as a header value), or undefined. */
function valueProblem(value: string): string | undefined {
  if (Buffer.byteLength(value) > MAX_HEADER_VALUE) return `a secret's value is at most ${MAX_HEADER_VALUE} bytes`;
  if (/[\r\n\0]/.test(value)) return "a secret's value cannot contain CR, LF or NUL (it is sent as a header value)";
  return undefined;
}

function metadataProblem(m: Record<string, string>): string | undefined {
  const { entries, keyBytes, valueBytes, totalBytes } = SECRET_METADATA_LIMITS;
  const all = Object.entries(m);
  if (all.length > entries) return `metadata: at most ${entries} entries`;
  let total = 0;
  for (const [k, v] of all) {
    if (typeof v !== "string") return `metadata.${k}: must be a string`;
    const kb = Buffer.byteLength(k);
    const vb = Buffer.byteLength(v);
    if (kb > keyBytes) return `metadata: a key is at most ${keyBytes} bytes`;
    if (vb > valueBytes) return `metadata.${k}: a value is at most ${valueBytes} bytes`;
    total += kb + vb;
  }
  if (total > totalBytes) return `metadata: at most ${totalBytes} bytes of keys and values together`;
  return undefined;
}

const shown = ({ value: _, ...rest }: StoredSecret): SecretInfo => ({ ...rest, metadata: { ...rest.metadata } });

/** A parsed secret file, or undefined when it is not one (its content is never shown). */
function parseStored(text: string, id: string): StoredSecret | undefined {
  let r: StoredSecret;
  try {
    r = JSON.parse(text) as StoredSecret;
  } catch {
    return undefined;
  }
  const ok = r !== null && typeof r === "object" && r.id === id && typeof r.name === "string" && secretNameProblem(r.name) === undefined &&
    r.name === r.name.toLowerCase() && Number.isSafeInteger(r.version) && r.version >= 1 && typeof r.value === "string" && valueProblem(r.value) === undefined &&
    r.metadata !== null && typeof r.metadata === "object" && !Array.isArray(r.metadata) && metadataProblem(r.metadata) === undefined &&
    Number.isFinite(r.createdAt) && Number.isFinite(r.updatedAt);
  return ok ? r : undefined;
}

interface Index {
  byId: Map<string, SecretInfo>;
  byName: Map<string, string>;
  /** The newest createdAt: a new secret's is one past it when they share a millisecond, so the list's order is the creates' order. */
  newest: number;
}

export class SecretStore {
  /** Where the user secrets live: apart from the node's own files in `dir`. */
  readonly userDir: string;
  private loaded: Promise<Index> | undefined;
  private readonly cache = new Map<string, { stamp: string; value: string }>();
  private writes: Promise<unknown> = Promise.resolve();
  private waitingWrites = 0;

  constructor(readonly dir: string) {
    this.userDir = join(dir, "user");
  }

  /** A new secret: 409 when its name (lower-cased) is taken, 400 on a bad name, value or metadata, 429 past MAX_SECRETS. */
  create(name: string, value: string, metadata: Record<string, string> = {}): Promise<SecretInfo> {
    const canonical = name.toLowerCase();
    const problem = secretNameProblem(canonical) ?? valueProblem(value) ?? metadataProblem(metadata);
    if (problem) return Promise.reject(new SecretStoreError(400, problem));
    return this.serial(async (idx) => {
      if (idx.byName.has(canonical)) throw new SecretStoreError(409, `a secret named ${canonical} exists`);
      if (idx.byId.size >= MAX_SECRETS) throw new SecretStoreError(429, `this node holds ${MAX_SECRETS} secrets: delete one first`);
      const now = Math.max(Date.now(), idx.newest + 1);
      const rec: StoredSecret = { id: secretId(), name: canonical, version: 1, metadata: { ...metadata }, createdAt: now, updatedAt: now, value };
      await this.write(rec);
      idx.newest = now;
      idx.byId.set(rec.id, shown(rec));
      idx.byName.set(canonical, rec.id);
      return shown(rec);
    });
  }

  /** Every secret, newest first (then by ID). */
  async list(): Promise<SecretInfo[]> {
    const idx = await this.index();
    return [...idx.byId.values()].sort((a, b) => b.createdAt - a.createdAt || (a.id < b.id ? -1 : 1)).map((s) => ({ ...s, metadata: { ...s.metadata } }));
  }

  /** A secret by its ID (`sec_…`) or its name (any case); undefined when there is none. */
  async info(ref: string): Promise<SecretInfo | undefined> {
    const s = this.find(await this.index(), ref);
    return s && { ...s, metadata: { ...s.metadata } };
  }

  /** A new value (its version + 1), and new metadata when given: 404 when there is no such secret. */
  update(ref: string, value: string, metadata?: Record<string, string>): Promise<SecretInfo> {
    const problem = valueProblem(value) ?? (metadata ? metadataProblem(metadata) : undefined);
    if (problem) return Promise.reject(new SecretStoreError(400, problem));
    return this.serial(async (idx) => {
      const old = this.find(idx, ref);
      if (!old) throw new SecretStoreError(404, `secret ${ref} not found`);
      const rec: StoredSecret = { ...old, version: old.version + 1, metadata: { ...(metadata ?? old.metadata) }, updatedAt: Math.max(Date.now(), old.updatedAt), value };
      await this.write(rec);
      idx.byId.set(rec.id, shown(rec));
      return shown(rec);
    });
  }

  /** Removes a secret and its value: false when there is no such secret. */
  remove(ref: string): Promise<boolean> {
    return this.serial(async (idx) => {
      const s = this.find(idx, ref);
      if (!s) return false;
      await unlink(join(this.userDir, `${s.id}.json`)).catch((e: NodeJS.ErrnoException) => {
        if (e.code !== "ENOENT") throw e;
      });
      idx.byId.delete(s.id);
      idx.byName.delete(s.name);
      this.cache.delete(s.id);
      return true;
    });
  }

  /** The value of the secret named `name` (any case); NetworkError `BadSecret` naming it when it cannot be used. */
  async get(name: string): Promise<string> {
    const canonical = name.toLowerCase();
    const id = (await this.index()).byName.get(canonical);
    if (!id) throw new NetworkError("BadSecret", `secret ${canonical} does not exist`);
    const path = join(this.userDir, `${id}.json`);
    let st;
    try {
      st = await lstat(path);
    } catch {
      throw new NetworkError("BadSecret", `secret ${canonical} does not exist`);
    }
    if (!st.isFile()) throw new NetworkError("BadSecret", `secret ${canonical} is not a regular file`);
    if (st.mode & 0o077) throw new NetworkError("BadSecret", `secret ${canonical} is readable by group or others (mode ${(st.mode & 0o777).toString(8)}); it must be 0600`);
    if (st.size > MAX_FILE_BYTES) throw new NetworkError("BadSecret", `secret ${canonical}'s file is larger than ${MAX_FILE_BYTES} bytes`);
    const stamp = `${st.ino}:${st.size}:${st.mtimeMs}`;
    const hit = this.cache.get(id);
    if (hit?.stamp === stamp) return hit.value;
    const rec = parseStored(await readFile(path, "utf8"), id);
    if (!rec || rec.name !== canonical) throw new NetworkError("BadSecret", `secret ${canonical}'s file does not parse`);
    if (this.cache.size >= CACHE_ENTRIES) this.cache.delete(this.cache.keys().next().value!);
    this.cache.set(id, { stamp, value: rec.value });
    return rec.value;
  }

  /**
   * A rule's header value with its secrets in: `secret:NAME`'s value, or the text with each
   * `${e2b.secrets.NAME}` replaced (once: a value that holds a placeholder is not read again).
   */
  async resolve(h: HeaderValue): Promise<string> {
    if (h.secret !== undefined) return this.get(h.secret);
    if (!h.placeholders) return h.value ?? "";
    const values = new Map<string, string>();
    for (const n of h.placeholders) values.set(n, await this.get(n));
    return h.value!.replace(SECRET_PLACEHOLDER, (_, n: string) => values.get(n.toLowerCase())!);
  }

  private find(idx: Index, ref: string): SecretInfo | undefined {
    if (ref.startsWith("sec_")) return idx.byId.get(ref);
    const id = idx.byName.get(ref.toLowerCase());
    return id === undefined ? undefined : idx.byId.get(id);
  }

  /** Runs the writes one at a time, each on the index as the ones before it left it. */
  private serial<T>(fn: (idx: Index) => Promise<T>): Promise<T> {
    if (this.waitingWrites >= MAX_WAITING_WRITES) return Promise.reject(new SecretStoreError(429, `${MAX_WAITING_WRITES} secret writes are waiting: try again`));
    this.waitingWrites++;
    const run = this.writes.then(async () => fn(await this.index())).finally(() => this.waitingWrites--);
    this.writes = run.catch(() => {});
    return run;
  }

  /** The file of `rec`, replaced whole: a temporary file (0600, synced), renamed, the directory synced. */
  private async write(rec: StoredSecret): Promise<void> {
    const path = join(this.userDir, `${rec.id}.json`);
    const tmp = join(this.userDir, `${TEMP_PREFIX}${rec.id}-${process.pid}`);
    await rm(tmp, { force: true });
    const f = await open(tmp, "wx", 0o600);
    try {
      await f.writeFile(JSON.stringify(rec));
      await f.sync();
    } finally {
      await f.close();
    }
    try {
      await rename(tmp, path);
    } catch (e) {
      await rm(tmp, { force: true });
      throw e;
    }
    const d = await open(this.userDir, "r");
    try {
      await d.sync();
    } finally {
      await d.close();
    }
  }

  private index(): Promise<Index> {
    this.loaded ??= this.load().catch((e) => {
      this.loaded = undefined; // tried again on the next use
      throw e;
    });
    return this.loaded;
  }

  /** The index of <dir>/user, made 0700 (with <dir>); a crash's temporary files removed; files that are not secrets left out, named in the log. */
  private async load(): Promise<Index> {
    await mkdir(this.userDir, { recursive: true, mode: 0o700 });
    for (const d of [this.dir, this.userDir]) if (((await lstat(d)).mode & 0o077) !== 0) await chmod(d, 0o700);
    const idx: Index = { byId: new Map(), byName: new Map(), newest: 0 };
    for (const entry of await readdir(this.userDir)) {
      const path = join(this.userDir, entry);
      if (entry.startsWith(TEMP_PREFIX)) {
        await rm(path, { force: true });
        continue;
      }
      const id = ID_FILE.exec(entry)?.[1];
      const st = await lstat(path);
      const rec = id && st.isFile() && (st.mode & 0o077) === 0 && st.size <= MAX_FILE_BYTES ? parseStored(await readFile(path, "utf8"), id) : undefined;
      if (!rec || idx.byName.has(rec.name) || idx.byId.size >= MAX_SECRETS) {
        console.error(`secrets: ${path} is left out: not a 0600 secret file of this node, or its name is taken`);
        continue;
      }
      idx.byId.set(rec.id, shown(rec));
      idx.byName.set(rec.name, rec.id);
      idx.newest = Math.max(idx.newest, rec.createdAt);
    }
    return idx;
  }
}
