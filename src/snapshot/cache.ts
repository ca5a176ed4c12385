// The node's local copy of snapshots that live in S3: a directory bounded in bytes. A get
// downloads a snapshot once (sparse: all-zero blocks stay holes) and later gets use the copy.
// Entries are named by snapshot id and put nonce, so a re-put id never serves old bytes; shared
// files are kept once by sha256 and linked into each entry. Least recently used entries go first
// when room is needed, but never one handed out in the last `holdMs` (its user may not have
// opened its files yet; an opened file outlives its unlink).
//
//   <root>/entries/<id>.<putId>/<name>   complete entries (renamed in whole)
//   <root>/blobs/<sha256>                shared files
//   <root>/tmp/                          downloads in flight, evictions in progress
import { mkdir, readdir, rename, rm, stat, utimes } from "node:fs/promises";
import { join } from "node:path";
import type { Deadline } from "./deadline.ts";
import { asStoreError, fsCode, SnapshotStoreError } from "./errors.ts";
import { dropUnlinked, linkBlob, pathExists, randomSuffix, SparseWriter, syncDir } from "./files.ts";
import type { Materialized, SnapshotRecord, StoredFile } from "./store.ts";

/** Writes the stored bytes of file `name` into `w` (the cache checks length and sha256). */
export type Fetch = (name: string, file: StoredFile, w: SparseWriter, dl: Deadline) => Promise<void>;

/**
 * Brings a shared file from the node's peers to `dest`, verified against its sha256 (hex) before
 * it appears there; false when no peer could (the store is asked then). Set by the node.
 */
export type BlobFromPeers = (sha256: string, size: number, dest: string, signal: AbortSignal) => Promise<boolean>;

export interface CacheOptions {
  root: string;
  /** Bound on the bytes the cache holds on disk (allocated blocks, so holes cost nothing). */
  maxBytes: number;
  /** An entry handed out this recently is not evicted. */
  holdMs?: number;
  /** Downloads of distinct snapshots at once. */
  maxDownloads?: number;
  /** Shared files (layers, memory layers) are asked of the peers before the store. */
  fromPeers?: BlobFromPeers;
}

export class SnapshotCache {
  private readonly entries: string;
  private readonly blobs: string;
  private readonly tmp: string;
  private readonly holdMs: number;
  private readonly maxDownloads: number;
  private readonly inflight = new Map<string, Promise<Materialized>>();
  /** Bytes of downloads in flight, counted against the bound before they land. */
  private reserved = 0;
  private cleaned: Promise<void> | undefined;
  private roomTurn: Promise<void> = Promise.resolve();
  /** Bytes fetched from the store since start (tests read that a second get fetched none). */
  fetchedBytes = 0;
  /** Bytes of shared files that came from peers instead. */
  peerBytes = 0;

  constructor(private readonly o: CacheOptions) {
    if (!o.root.startsWith("/")) throw new SnapshotStoreError("BadConfig", `snapshot cache directory must be absolute, got ${JSON.stringify(o.root)}`);
    if (!Number.isSafeInteger(o.maxBytes) || o.maxBytes <= 0) throw new SnapshotStoreError("BadConfig", `snapshot cache bound must be a positive byte count, got ${o.maxBytes}`);
    this.entries = join(o.root, "entries");
    this.blobs = join(o.root, "blobs");
    this.tmp = join(o.root, "tmp");
    this.holdMs = o.holdMs ?? 600_000;
    this.maxDownloads = o.maxDownloads ?? 16;
  }

  /** Shared files by sha256 (hex), each verified when it arrived. */
  get blobsDir(): string {
    return this.blobs;
  }

  /** The record's files at local paths: the cached entry, or one fetched now. */
  materialize(record: SnapshotRecord, fetch: Fetch, dl: Deadline): Promise<Materialized> {
    const key = `${record.id}.${record.putId}`;
    const running = this.inflight.get(key);
    if (running) return dl.race(running);
    if (this.inflight.size >= this.maxDownloads) return Promise.reject(new SnapshotStoreError("Io", `snapshot cache: ${this.maxDownloads} downloads in flight already`));
    const p = this.lookupOrFetch(key, record, fetch, dl).finally(() => this.inflight.delete(key));
    this.inflight.set(key, p);
    return p;
  }

  private async lookupOrFetch(key: string, record: SnapshotRecord, fetch: Fetch, dl: Deadline): Promise<Materialized> {
    await (this.cleaned ??= this.clean().catch((e) => { this.cleaned = undefined; throw e; }));
    const dir = join(this.entries, key);
    const out = (): Materialized => {
      const paths: Record<string, string> = {};
      for (const name of Object.keys(record.files)) paths[name] = join(dir, name);
      return { record, meta: record.meta, paths };
    };
    if (await pathExists(dir)) {
      await utimes(dir, new Date(), new Date()).catch(() => {});
      return out();
    }
    let need = 0;
    for (const f of Object.values(record.files)) if (!f.shared || !(await pathExists(join(this.blobs, f.sha256!)))) need += f.size;
    // One room-making at a time, so two downloads cannot both count the same free bytes.
    const turn = this.roomTurn.then(() => this.makeRoom(need, key)).then(() => { this.reserved += need; });
    this.roomTurn = turn.catch(() => {});
    await turn;
    const work = join(this.tmp, `get-${key}.${randomSuffix()}`);
    try {
      await mkdir(work);
      for (const [name, file] of Object.entries(record.files)) {
        if (file.shared) await this.linkBlob(name, file, join(work, name), fetch, dl);
        else await this.download(name, file, join(work, name), fetch, dl);
      }
      try {
        await rename(work, dir);
      } catch (e) {
        // Another process of this node cached it first: theirs is complete, ours goes.
        if (fsCode(e) !== "ENOTEMPTY" && fsCode(e) !== "EEXIST") throw e;
        await rm(work, { recursive: true, force: true });
      }
      await syncDir(this.entries);
      return out();
    } catch (e) {
      await rm(work, { recursive: true, force: true }).catch(() => {});
      throw asStoreError(e, `snapshot '${record.id}': download into the cache`);
    } finally {
      this.reserved -= need;
    }
  }

  /** Makes the directories and removes what a crashed process left in tmp/ (this node's cache is its own). */
  private async clean(): Promise<void> {
    for (const d of [this.entries, this.blobs, this.tmp]) await mkdir(d, { recursive: true });
    for (const n of await readdir(this.tmp)) await rm(join(this.tmp, n), { recursive: true, force: true });
    await this.dropUnusedBlobs();
  }

  /** Fetches one file into `dest`, checking its length and (when the record has it) sha256. */
  private async download(name: string, file: StoredFile, dest: string, fetch: Fetch, dl: Deadline): Promise<void> {
    const w = await SparseWriter.create(dest, { hash: file.sha256 !== undefined });
    let sha256: string | undefined;
    try {
      await fetch(name, file, w, dl);
      this.fetchedBytes += w.written;
      const got = w.written;
      sha256 = await w.finish();
      if (got !== file.size) throw new SnapshotStoreError("Io", `file '${name}': fetched ${got} bytes, the record says ${file.size}`);
    } catch (e) {
      await w.abandon();
      await rm(dest, { force: true });
      throw e;
    }
    if (file.sha256 !== undefined && sha256 !== file.sha256) {
      await rm(dest, { force: true });
      throw new SnapshotStoreError("Io", `file '${name}': fetched bytes hash to ${sha256}, the record says ${file.sha256}`);
    }
  }

  private async linkBlob(name: string, file: StoredFile, dest: string, fetch: Fetch, dl: Deadline): Promise<void> {
    await linkBlob(join(this.blobs, file.sha256!), this.tmp, dest, async (tmp) => {
      const peers = this.o.fromPeers;
      if (peers && (await peers(file.sha256!, file.size, tmp, AbortSignal.timeout(Math.max(1, dl.leftMs))).catch(() => false))) {
        this.peerBytes += file.size;
        return;
      }
      await this.download(name, file, tmp, fetch, dl);
    });
  }

  /**
   * Evicts least recently used entries (not held) until `need` more bytes fit under the bound;
   * Io when they cannot.
   */
  private async makeRoom(need: number, forKey: string): Promise<void> {
    if (need > this.o.maxBytes) throw new SnapshotStoreError("Io", `snapshot cache: ${need} bytes do not fit its bound of ${this.o.maxBytes}`);
    const { used, entries } = await this.usage();
    let free = this.o.maxBytes - used - this.reserved;
    if (free >= need) return;
    const heldAfter = Date.now() - this.holdMs;
    for (const e of entries.sort((a, b) => a.lastUsedMs - b.lastUsedMs)) {
      if (free >= need) break;
      if (e.lastUsedMs > heldAfter || e.name === forKey) continue;
      const aside = join(this.tmp, `evict-${e.name}.${randomSuffix()}`);
      try {
        await rename(join(this.entries, e.name), aside);
      } catch { continue; }
      await rm(aside, { recursive: true, force: true });
      await this.dropUnusedBlobs();
      free = this.o.maxBytes - (await this.usage()).used - this.reserved;
    }
    if (free < need) throw new SnapshotStoreError("Io", `snapshot cache: ${need} bytes do not fit (${this.o.maxBytes - free} of ${this.o.maxBytes} used by entries handed out in the last ${this.holdMs} ms)`);
  }

  /** Blobs no entry links to any more. */
  private async dropUnusedBlobs(): Promise<void> {
    await dropUnlinked((await readdir(this.blobs).catch(() => [] as string[])).map((b) => join(this.blobs, b)));
  }

  /** Allocated bytes of every file (each inode once) and the entries by last use. */
  async usage(): Promise<{ used: number; entries: { name: string; lastUsedMs: number }[] }> {
    const seen = new Set<string>();
    let used = 0;
    const count = async (path: string) => {
      const st = await stat(path).catch(() => undefined);
      if (!st) return;
      const k = `${st.dev}:${st.ino}`;
      if (!seen.has(k)) { seen.add(k); used += st.blocks * 512; }
    };
    const entries: { name: string; lastUsedMs: number }[] = [];
    for (const name of await readdir(this.entries).catch(() => [] as string[])) {
      const dir = join(this.entries, name);
      const st = await stat(dir).catch(() => undefined);
      if (!st) continue;
      entries.push({ name, lastUsedMs: st.mtimeMs });
      for (const f of await readdir(dir).catch(() => [] as string[])) await count(join(dir, f));
    }
    for (const b of await readdir(this.blobs).catch(() => [] as string[])) await count(join(this.blobs, b));
    return { used, entries };
  }
}
