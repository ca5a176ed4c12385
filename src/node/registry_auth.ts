// Registry auth for blockd's range reads of remote layers (docs/storage.md, "Registry auth").
// blockd runs in its own process and speaks no registry protocol, so for each repository a remote
// layer reads from the node writes a headers file (`{"headers": {"authorization": …}}`, mode 0600,
// by rename) that the layer's http source names (`headersFile`), and keeps it fresh: a Bearer token
// is renewed at half its lifetime (a new token each time, at least RENEW_MIN_MS apart); a Basic
// header, or an anonymous registry's empty file, is written once. Credentials are those the pull
// was given (kept, mode 0600, in $AENV_HOME/secrets/registry/) or the node's Docker config. While
// the node is down nothing is renewed: once a token lapses, reads of chunks the block cache does
// not hold fail (EIO in the guest) until the node is back.

import { createHash } from "node:crypto";
import { chmodSync, closeSync, existsSync, mkdirSync, openSync, readFileSync, renameSync, writeSync } from "node:fs";
import { join } from "node:path";
import { blobRepository, type Credentials, formatImageRef, type ImageRef, parseImageRef, RegistryClient, type RegistryClientOptions } from "../template/registry.ts";

/** Repositories kept fresh at once; past it the least recently used one is no longer renewed. */
export const MAX_REPOSITORIES = 256;
/** Renewals of one repository's token are at least this far apart. */
export const RENEW_MIN_MS = 5_000;
/** After a failed renewal the next try is this much later. */
export const RETRY_MS = 5_000;
/** A caller waits at most this long for a repository's first file (then reads go without it). */
export const FIRST_WAIT_MS = 10_000;

interface Entry {
  path: string;
  ref: ImageRef;
  /** A blob of the repository: probes the registry's challenge. */
  digest: string;
  client: RegistryClient;
  first: Promise<void>;
  timer?: ReturnType<typeof setTimeout>;
  failing: boolean;
  stopped: boolean;
}

const keyOf = (ref: ImageRef) => createHash("sha256").update(`${ref.endpoint}/${ref.repository}`).digest("hex").slice(0, 24);

/** JSON to `path` by rename, mode 0600: a reader sees the old file or the new one. */
function writePrivate(path: string, value: unknown): void {
  const tmp = `${path}.tmp-${process.pid}-${Math.random().toString(36).slice(2)}`;
  const fd = openSync(tmp, "w", 0o600);
  try {
    writeSync(fd, JSON.stringify(value));
  } finally {
    closeSync(fd);
  }
  chmodSync(tmp, 0o600);
  renameSync(tmp, path);
}

export class RegistryAuthFiles {
  /** Map order is recency. */
  private readonly entries = new Map<string, Entry>();

  constructor(private readonly o: { dir: string; secretsDir: string; registry?: RegistryClientOptions }) {
    mkdirSync(o.dir, { recursive: true, mode: 0o700 });
  }

  /** Credentials a pull was given for `ref`'s repository: its headers file uses them from now on, after a restart too. */
  remember(ref: string, creds: Credentials): void {
    const r = parseImageRef(ref);
    const key = keyOf(r);
    mkdirSync(this.o.secretsDir, { recursive: true, mode: 0o700 });
    writePrivate(join(this.o.secretsDir, `${key}.json`), { registry: r.registry, repository: r.repository, username: creds.username, password: creds.password });
    const e = this.entries.get(key);
    if (e) {
      this.stop(e);
      this.entries.delete(key);
    }
  }

  /**
   * The headers file for a blob URL's repository, written (within FIRST_WAIT_MS) and kept fresh
   * from now on; undefined for a URL that is not a registry blob's.
   */
  async fileFor(url: string): Promise<string | undefined> {
    const blob = blobRepository(url);
    if (!blob) return undefined;
    const key = keyOf(blob.ref);
    let e = this.entries.get(key);
    if (e) this.entries.delete(key);
    else e = this.start(key, blob.ref, blob.digest);
    this.entries.set(key, e);
    while (this.entries.size > MAX_REPOSITORIES) {
      const [oldKey, old] = this.entries.entries().next().value!;
      this.stop(old);
      this.entries.delete(oldKey);
    }
    let timer: ReturnType<typeof setTimeout> | undefined;
    await Promise.race([e.first, new Promise<void>((r) => (timer = setTimeout(r, FIRST_WAIT_MS)))]);
    clearTimeout(timer);
    return e.path;
  }

  close(): void {
    for (const e of this.entries.values()) this.stop(e);
    this.entries.clear();
  }

  private credentials(key: string): Credentials | undefined {
    const p = join(this.o.secretsDir, `${key}.json`);
    if (!existsSync(p)) return undefined;
    try {
      const c = JSON.parse(readFileSync(p, "utf8")) as Partial<Credentials>;
      return typeof c.username === "string" && typeof c.password === "string" ? { username: c.username, password: c.password } : undefined;
    } catch (e) {
      console.error(`registry auth: ${p}: ${(e as Error).message}`);
      return undefined;
    }
  }

  private start(key: string, ref: ImageRef, digest: string): Entry {
    const creds = this.credentials(key);
    const client = new RegistryClient({ ...this.o.registry, ...(creds ? { credentials: { ...this.o.registry?.credentials, [ref.registry]: creds } } : {}) });
    const e: Entry = { path: join(this.o.dir, `${key}.json`), ref, digest, client, first: Promise.resolve(), failing: false, stopped: false };
    e.first = this.renew(e, false);
    return e;
  }

  private async renew(e: Entry, fresh: boolean): Promise<void> {
    if (e.stopped) return;
    let next: number | undefined;
    try {
      const a = await e.client.pullAuthorization(e.ref, e.digest, { fresh });
      if (e.stopped) return;
      writePrivate(e.path, { headers: a.value ? { authorization: a.value } : {}, ...(a.expiresAt ? { expiresAt: a.expiresAt } : {}) });
      if (a.expiresAt !== undefined) next = Math.max(RENEW_MIN_MS, (a.expiresAt - Date.now()) / 2);
      e.failing = false;
    } catch (err) {
      if (!e.failing) console.error(`registry auth for ${formatImageRef(e.ref)}: ${(err as Error).message}; trying again every ${RETRY_MS / 1000} s`);
      e.failing = true;
      next = RETRY_MS;
    }
    if (next === undefined || e.stopped) return;
    e.timer = setTimeout(() => void this.renew(e, true), next);
    e.timer.unref?.();
  }

  private stop(e: Entry): void {
    e.stopped = true;
    clearTimeout(e.timer);
  }
}
