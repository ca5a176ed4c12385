// The snapshot store: where a sandbox's snapshots (VMM state, memory image, rootfs layers) live
// so that they outlive their sandbox and start sandboxes on any node that reaches the store.
// One interface, two implementations: a directory (local disk or a shared filesystem, written by
// any number of nodes at once) and S3. Docs: docs/snapshots.md.
import { stat } from "node:fs/promises";
import type { Deadline } from "./deadline.ts";
import { asStoreError, fsCode, SnapshotStoreError } from "./errors.ts";
import { readSmallBytes, sha256File } from "./files.ts";

export type Json = null | boolean | number | string | Json[] | { [key: string]: Json };

/** One file of a snapshot to store. */
export interface SnapshotFile {
  /** Its name within the snapshot (`mem`, `vmstate`, `layer-0`, …). */
  name: string;
  /** A regular file that is never written again (a sealed checkpoint file). */
  path: string;
  /**
   * A file other snapshots may hold too (a rootfs layer): stored once by its sha256 and
   * shared by every snapshot that lists it.
   */
  shared?: boolean;
}

/** What the store keeps of one file. */
export interface StoredFile {
  size: number;
  /** sha256 (hex): always for shared files (their content address), and for every file in S3. */
  sha256?: string;
  shared: boolean;
}

/** A complete snapshot as the store describes it; written last, so its presence means complete. */
export interface SnapshotRecord {
  format: 1;
  id: string;
  /** The put that wrote it (a random nonce): S3 keys and cache entries are named by it. */
  putId: string;
  createdAt: string;
  meta: Json;
  files: Record<string, StoredFile>;
}

/** A snapshot ready to use on this node: every file at a local path. */
export interface Materialized {
  record: SnapshotRecord;
  meta: Json;
  /** Name → local path. Valid until the snapshot is deleted (directory) or its cache entry evicted (S3). */
  paths: Record<string, string>;
}

export interface SnapshotStore {
  readonly kind: "dir" | "s3";
  /** A local folder of shared files named by their sha256 (hex): what this node may serve to its peers. */
  readonly blobsDir: string;
  /** Where it is (a directory or `s3://bucket/prefix`), for logs. */
  readonly location: string;
  /** Stores `files` and `meta` under `id`; visible only once complete. Exists when `id` is taken. */
  put(id: string, files: SnapshotFile[], meta: Json): Promise<SnapshotRecord>;
  /** The snapshot's files at local paths; NotFound when there is none. */
  get(id: string): Promise<Materialized>;
  /** Ids of the complete snapshots, sorted. */
  list(): Promise<string[]>;
  /** true when it removed the snapshot, false when there was none. */
  delete(id: string): Promise<boolean>;
  exists(id: string): Promise<boolean>;
  /**
   * Removes what crashed puts and deletes left, and shared files no snapshot holds, when older
   * than `olderThanMs` (longer than any put's deadline: another node's put may be in flight).
   */
  sweep(olderThanMs: number): Promise<{ removed: number }>;
  /**
   * Adds (or replaces) a small file to a complete snapshot, after its put: what a node learns from
   * using it (a start's prefetch trace). At most LIMITS.attachmentBytes; NotFound without the
   * snapshot. Not in the record: a reader takes whatever version it finds, and the snapshot's
   * delete takes its attachments.
   */
  attach(id: string, name: string, path: string): Promise<void>;
  /** The attachment `name` of snapshot `id` written to `dest` (durably); false when it has none. */
  attachment(id: string, name: string, dest: string): Promise<boolean>;
}

/** Ids and file names: one path component of safe characters (E2B ids, aliases, template ids). */
const NAME_RE = /^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$/;
export const LIMITS = { files: 256, metaBytes: 1 << 20, recordBytes: 2 << 20, attachmentBytes: 1 << 20 };

export function checkId(id: string): void {
  if (typeof id !== "string" || !NAME_RE.test(id)) throw new SnapshotStoreError("BadConfig", `bad snapshot id ${JSON.stringify(id)}: 1-128 of [A-Za-z0-9._-], starting alphanumeric`);
}

export function checkFiles(files: SnapshotFile[]): void {
  if (!Array.isArray(files) || files.length > LIMITS.files) throw new SnapshotStoreError("BadConfig", `a snapshot holds 0..${LIMITS.files} files`);
  const seen = new Set<string>();
  for (const f of files) {
    if (typeof f?.name !== "string" || !NAME_RE.test(f.name) || f.name.endsWith(".json")) throw new SnapshotStoreError("BadConfig", `bad file name ${JSON.stringify(f?.name)}: 1-128 of [A-Za-z0-9._-], not *.json`);
    if (seen.has(f.name)) throw new SnapshotStoreError("BadConfig", `file name '${f.name}' given twice`);
    if (typeof f.path !== "string" || !f.path.startsWith("/")) throw new SnapshotStoreError("BadConfig", `file '${f.name}': path must be absolute, got ${JSON.stringify(f.path)}`);
    seen.add(f.name);
  }
}

/** A snapshot id and an attachment name (named as files are). */
export function checkAttachment(id: string, name: string): void {
  checkId(id);
  if (typeof name !== "string" || !NAME_RE.test(name) || name.endsWith(".json")) throw new SnapshotStoreError("BadConfig", `bad attachment name ${JSON.stringify(name)}: 1-128 of [A-Za-z0-9._-], not *.json`);
}

/** An attachment's bytes, read whole: BadConfig past LIMITS.attachmentBytes. */
export async function readAttachment(id: string, name: string, path: string): Promise<Uint8Array> {
  checkAttachment(id, name);
  try {
    return await readSmallBytes(path, LIMITS.attachmentBytes);
  } catch (e) {
    throw fsCode(e) ? asStoreError(e, `attachment '${name}' of snapshot '${id}': read ${path}`) : new SnapshotStoreError("BadConfig", `attachment '${name}' of snapshot '${id}': ${(e as Error).message}`);
  }
}

/** The meta as JSON text, refused past LIMITS.metaBytes or when it is not plain JSON. */
export function checkMeta(meta: Json): void {
  let text: string | undefined;
  try {
    text = JSON.stringify(meta);
  } catch (e) {
    throw new SnapshotStoreError("BadConfig", `meta is not JSON: ${(e as Error).message}`);
  }
  if (text === undefined) throw new SnapshotStoreError("BadConfig", "meta is not JSON");
  if (text.length > LIMITS.metaBytes) throw new SnapshotStoreError("BadConfig", `meta is ${text.length} bytes of JSON, more than ${LIMITS.metaBytes}`);
}

/** Parses a stored record and checks its shape; Io when it is not one of ours. */
export function parseRecord(text: string, id: string, where: string): SnapshotRecord {
  let r: SnapshotRecord;
  try {
    r = JSON.parse(text) as SnapshotRecord;
  } catch (e) {
    throw new SnapshotStoreError("Io", `${where}: record is not JSON: ${(e as Error).message}`);
  }
  const ok = r?.format === 1 && r.id === id && typeof r.putId === "string" && NAME_RE.test(r.putId) && r.files !== null && typeof r.files === "object"
    && Object.entries(r.files).every(([n, f]) => NAME_RE.test(n) && Number.isSafeInteger(f?.size) && f.size >= 0
      && (f.sha256 === undefined || /^[0-9a-f]{64}$/.test(f.sha256)) && (!f.shared || f.sha256 !== undefined));
  if (!ok) throw new SnapshotStoreError("Io", `${where}: not a snapshot record of '${id}'`);
  return r;
}

/**
 * sha256 of source files by (device, inode, size, mtime, ctime): the template's layers and
 * earlier checkpoints' layers are put again with every snapshot and hashed once. 4096 entries.
 */
export class DigestCache {
  private readonly map = new Map<string, string>();
  constructor(private readonly max = 4096) {}

  static key(st: { dev: number; ino: number; size: number; mtimeMs: number; ctimeMs: number }): string {
    return `${st.dev}:${st.ino}:${st.size}:${st.mtimeMs}:${st.ctimeMs}`;
  }
  get(key: string): string | undefined {
    const v = this.map.get(key);
    if (v !== undefined) { this.map.delete(key); this.map.set(key, v); }
    return v;
  }
  set(key: string, sha256: string): void {
    this.map.delete(key);
    this.map.set(key, sha256);
    while (this.map.size > this.max) this.map.delete(this.map.keys().next().value!);
  }
}

/** A file to put, with what stat said of it. */
export interface Source extends SnapshotFile {
  size: number;
  /** DigestCache key of the file as stat saw it. */
  key: string;
}

/** stat of every file to put: regular files only; NotFound names the missing one. */
export async function statSources(files: SnapshotFile[]): Promise<Source[]> {
  return Promise.all(files.map(async (f) => {
    let st;
    try {
      st = await stat(f.path);
    } catch (e) {
      if (fsCode(e) === "ENOENT") throw new SnapshotStoreError("NotFound", `file '${f.name}': ${f.path} does not exist`);
      throw asStoreError(e, `file '${f.name}': stat ${f.path}`);
    }
    if (!st.isFile()) throw new SnapshotStoreError("BadConfig", `file '${f.name}': ${f.path} is not a regular file`);
    return { ...f, size: st.size, key: DigestCache.key(st) };
  }));
}

/** The sha256 of a source, from the cache when stat says it is the file already hashed. */
export async function sourceDigest(src: Source, cache: DigestCache, dl: Deadline): Promise<string> {
  const known = cache.get(src.key);
  if (known !== undefined) return known;
  const { sha256, size } = await sha256File(src.path, dl);
  if (size !== src.size) throw new SnapshotStoreError("Io", `file '${src.name}': ${src.path} changed size while it was read (${src.size} → ${size})`);
  cache.set(src.key, sha256);
  return sha256;
}
