// The snapshot store in a directory: local disk, or a shared filesystem (NFS, CephFS, …) that
// several nodes write at once. Nothing assumes a single writer: a put builds the snapshot under
// a temporary name and renames the whole directory into place (rename is atomic, and refuses a
// name already taken, so of two racing puts of one id exactly one wins); a delete renames the
// directory away first. Shared files (rootfs layers) are copied once into blobs/, named by sha256,
// and hard-linked into each snapshot, so the link count is their reference count and no delete
// can take a file from a snapshot that holds a link to it. Other files are linked from the source
// when it is on the same filesystem (no bytes move), else copied with their holes.
//
//   <root>/snapshots/<id>/record.json   the record (SnapshotRecord)
//   <root>/snapshots/<id>/<name>        each file (a link to blobs/<sha256> when shared)
//   <root>/blobs/<sha256>               shared files, one inode each
//   <root>/attachments/<id>/<name>      small files added after the put (attach)
//   <root>/tmp/                         puts in flight, deletes in progress
import { mkdir, readdir, rename, rm, stat, unlink } from "node:fs/promises";
import { join } from "node:path";
import { Deadline, DEFAULT_LIMITS, type StoreLimits } from "./deadline.ts";
import { asStoreError, fsCode, SnapshotStoreError } from "./errors.ts";
import { copySparse, dropUnlinked, linkBlob, linkOrCopy, pathExists, randomSuffix, readSmallBytes, readSmallFile, syncDir, writeFileDurable } from "./files.ts";
import {
  checkAttachment, checkFiles, checkId, checkMeta, DigestCache, LIMITS, parseRecord, readAttachment, sourceDigest, statSources,
  type Json, type Materialized, type SnapshotFile, type SnapshotRecord, type SnapshotStore, type Source, type StoredFile,
} from "./store.ts";

const RECORD = "record.json";

export class DirSnapshotStore implements SnapshotStore {
  readonly kind = "dir" as const;
  private readonly snapshots: string;
  private readonly blobs: string;
  private readonly tmp: string;
  private readonly attachments: string;
  private readonly digests = new DigestCache();
  private made: Promise<void> | undefined;

  constructor(
    readonly root: string,
    private readonly limits: StoreLimits = DEFAULT_LIMITS,
  ) {
    if (!root.startsWith("/")) throw new SnapshotStoreError("BadConfig", `snapshot store directory must be absolute, got ${JSON.stringify(root)}`);
    this.snapshots = join(root, "snapshots");
    this.blobs = join(root, "blobs");
    this.tmp = join(root, "tmp");
    this.attachments = join(root, "attachments");
  }

  get blobsDir(): string {
    return this.blobs;
  }

  get location(): string {
    return this.root;
  }

  private ready(): Promise<void> {
    this.made ??= (async () => {
      for (const d of [this.snapshots, this.blobs, this.tmp, this.attachments]) await mkdir(d, { recursive: true });
    })().catch((e) => {
      this.made = undefined;
      throw asStoreError(e, `snapshot store ${this.root}: create its directories`);
    });
    return this.made;
  }

  async put(id: string, files: SnapshotFile[], meta: Json): Promise<SnapshotRecord> {
    checkId(id);
    checkFiles(files);
    checkMeta(meta);
    await this.ready();
    const sources = await statSources(files);
    const dl = new Deadline(`put of snapshot '${id}'`, this.limits, sources.reduce((n, s) => n + s.size, 0));
    const final = join(this.snapshots, id);
    if (await pathExists(final)) throw new SnapshotStoreError("Exists", `snapshot '${id}' exists`);
    const putId = randomSuffix();
    const work = join(this.tmp, `put-${id}.${putId}`);
    const madeBlobs: string[] = [];
    try {
      await mkdir(work);
      const stored: Record<string, StoredFile> = {};
      for (const src of sources) {
        if (src.shared) {
          const sha256 = await sourceDigest(src, this.digests, dl);
          await this.linkBlob(sha256, src, join(work, src.name), dl, madeBlobs);
          stored[src.name] = { size: src.size, sha256, shared: true };
        } else {
          await linkOrCopy(src.path, join(work, src.name), dl);
          stored[src.name] = { size: src.size, shared: false };
        }
        dl.check();
      }
      const record: SnapshotRecord = { format: 1, id, putId, createdAt: new Date().toISOString(), meta, files: stored };
      await writeFileDurable(join(work, RECORD), JSON.stringify(record));
      dl.check();
      try {
        await rename(work, final);
      } catch (e) {
        const c = fsCode(e);
        if (c === "ENOTEMPTY" || c === "EEXIST") throw new SnapshotStoreError("Exists", `snapshot '${id}' exists (another put took the id first)`);
        throw e;
      }
      await syncDir(this.snapshots);
      return record;
    } catch (e) {
      await rm(work, { recursive: true, force: true }).catch(() => {});
      await dropUnlinked(madeBlobs);
      throw asStoreError(e, `put of snapshot '${id}'`);
    }
  }

  /**
   * `dest` becomes a link to blobs/<sha256>, copied from `src` when the pool has none (a copy,
   * never a link to the source: a blob's link count must count snapshots only).
   */
  private async linkBlob(sha256: string, src: Source, dest: string, dl: Deadline, made: string[]): Promise<void> {
    const blob = join(this.blobs, sha256);
    const fresh = await linkBlob(blob, this.tmp, dest, async (tmp) => {
      const got = await copySparse(src.path, tmp, dl, { hash: true });
      if (got !== sha256) throw new SnapshotStoreError("Io", `file '${src.name}': ${src.path} changed since it was hashed (sha256 ${sha256} → ${got})`);
    });
    if (fresh) made.push(blob);
  }

  async get(id: string): Promise<Materialized> {
    checkId(id);
    const dir = join(this.snapshots, id);
    const record = await this.readRecord(id, dir);
    const paths: Record<string, string> = {};
    for (const name of Object.keys(record.files)) paths[name] = join(dir, name);
    return { record, meta: record.meta, paths };
  }

  private async readRecord(id: string, dir: string): Promise<SnapshotRecord> {
    let text: string;
    try {
      text = await readSmallFile(join(dir, RECORD), LIMITS.recordBytes);
    } catch (e) {
      if (fsCode(e) === "ENOENT" || fsCode(e) === "ENOTDIR") throw new SnapshotStoreError("NotFound", `snapshot '${id}' not found`);
      throw asStoreError(e, `snapshot '${id}': read its record`);
    }
    return parseRecord(text, id, join(dir, RECORD));
  }

  async attach(id: string, name: string, path: string): Promise<void> {
    const bytes = await readAttachment(id, name, path);
    await this.ready();
    if (!(await this.exists(id))) throw new SnapshotStoreError("NotFound", `snapshot '${id}' not found`);
    try {
      await mkdir(join(this.attachments, id), { recursive: true });
      await writeFileDurable(join(this.attachments, id, name), bytes);
    } catch (e) {
      throw asStoreError(e, `attachment '${name}' of snapshot '${id}'`);
    }
  }

  async attachment(id: string, name: string, dest: string): Promise<boolean> {
    checkAttachment(id, name);
    let bytes: Uint8Array;
    try {
      bytes = await readSmallBytes(join(this.attachments, id, name), LIMITS.attachmentBytes);
    } catch (e) {
      if (fsCode(e) === "ENOENT") return false;
      throw asStoreError(e, `attachment '${name}' of snapshot '${id}'`);
    }
    await writeFileDurable(dest, bytes).catch((e) => { throw asStoreError(e, `attachment '${name}' of snapshot '${id}': write ${dest}`); });
    return true;
  }

  async exists(id: string): Promise<boolean> {
    checkId(id);
    try {
      return await pathExists(join(this.snapshots, id, RECORD));
    } catch (e) {
      throw asStoreError(e, `snapshot '${id}': exists`);
    }
  }

  async list(): Promise<string[]> {
    try {
      await this.ready();
      return (await readdir(this.snapshots)).filter((n) => !n.startsWith(".")).sort();
    } catch (e) {
      throw asStoreError(e, `snapshot store ${this.root}: list`);
    }
  }

  async delete(id: string): Promise<boolean> {
    checkId(id);
    await this.ready();
    const trash = join(this.tmp, `del-${id}.${randomSuffix()}`);
    try {
      // One rename makes it invisible at once; of two racing deletes, one finds it gone.
      await rename(join(this.snapshots, id), trash);
    } catch (e) {
      if (fsCode(e) === "ENOENT") return false;
      throw asStoreError(e, `delete of snapshot '${id}'`);
    }
    const shared: string[] = [];
    try {
      const record = parseRecord(await readSmallFile(join(trash, RECORD), LIMITS.recordBytes), id, trash);
      for (const f of Object.values(record.files)) if (f.shared) shared.push(join(this.blobs, f.sha256!));
    } catch { /* a damaged record: its blobs wait for sweep() */ }
    try {
      await rm(trash, { recursive: true, force: true });
      await rm(join(this.attachments, id), { recursive: true, force: true });
    } catch (e) {
      throw asStoreError(e, `delete of snapshot '${id}': remove its files`);
    }
    await dropUnlinked(shared);
    return true;
  }

  /** Removes what crashed puts and deletes left in tmp/ and blobs no snapshot links to (SnapshotStore.sweep). */
  async sweep(olderThanMs: number): Promise<{ removed: number }> {
    await this.ready();
    const before = Date.now() - olderThanMs;
    let removed = 0;
    const old = async (p: string, nlinkOne: boolean) => {
      try {
        const st = await stat(p);
        return st.mtimeMs < before && (!nlinkOne || (st.isFile() && st.nlink === 1));
      } catch {
        return false;
      }
    };
    for (const n of await readdir(this.tmp)) {
      const p = join(this.tmp, n);
      if (await old(p, false)) { await rm(p, { recursive: true, force: true }); removed++; }
    }
    for (const n of await readdir(this.attachments)) {
      const p = join(this.attachments, n);
      if (!(await pathExists(join(this.snapshots, n))) && (await old(p, false))) { await rm(p, { recursive: true, force: true }); removed++; }
    }
    for (const n of await readdir(this.blobs)) {
      const p = join(this.blobs, n);
      if (await old(p, true)) { await unlink(p).catch(() => {}); removed++; }
    }
    return { removed };
  }
}
