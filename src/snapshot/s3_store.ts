// The snapshot store in S3 (or any S3-compatible service), through Bun's S3Client. Files are
// streamed up in 8 MiB parts (multipart) and down into the node's SnapshotCache; the record is
// written last, so a snapshot is visible only when complete. S3 has no rename: every put writes
// under its own nonce, and a put that finds another record under its id after writing (a racing
// put) takes its own files back and answers Exists.
//
//   <prefix>snapshots/<id>.json             the record (SnapshotRecord)
//   <prefix>data/<id>/<putId>/<name>        each file of one put
//   <prefix>blobs/<sha256>                  shared files, once
//   <prefix>refs/<sha256>/<id>.<putId>      one empty marker per snapshot holding a shared file
//   <prefix>attachments/<id>/<name>         small files added after the put (attach)
import type { S3Client } from "bun";
import type { SnapshotCache } from "./cache.ts";
import { Deadline, DEFAULT_LIMITS, type StoreLimits } from "./deadline.ts";
import { asStoreError, SnapshotStoreError } from "./errors.ts";
import { CHUNK_BYTES, randomSuffix, readChunks, writeFileDurable, type SparseWriter } from "./files.ts";
import {
  checkAttachment, checkFiles, checkId, checkMeta, DigestCache, LIMITS, parseRecord, readAttachment, sourceDigest, statSources,
  type Json, type Materialized, type SnapshotFile, type SnapshotRecord, type SnapshotStore, type Source, type StoredFile,
} from "./store.ts";

/** list() stops past this many snapshots (1000 keys per page). */
const MAX_LIST_PAGES = 100;

function s3Code(e: unknown): string | undefined {
  const c = (e as { code?: unknown })?.code;
  return typeof c === "string" ? c : undefined;
}

/** The key is not there (as S3, s3rver and Bun's client say it). */
function missingKey(e: unknown): boolean {
  return s3Code(e) === "NoSuchKey" || s3Code(e) === "NotFound" || ((e as { name?: string })?.name === "S3Error" && /not (exist|found)/i.test(String((e as Error).message)));
}

/**
 * Idempotent reads (HEAD, GET) are tried up to READ_TRIES times, READ_BACKOFF_MS × try apart, on
 * an error that is not a missing key or the deadline: S3 answers 500/503 now and then, and
 * s3rver fails a HEAD of an object another client is writing.
 */
const READ_TRIES = 3;
const READ_BACKOFF_MS = 50;
async function retryRead<T>(dl: Deadline, read: () => Promise<T>): Promise<T> {
  for (let tried = 1; ; tried++) {
    try {
      return await dl.race(read());
    } catch (e) {
      if (tried >= READ_TRIES || e instanceof SnapshotStoreError || missingKey(e)) throw e;
      await Bun.sleep(READ_BACKOFF_MS * tried);
    }
  }
}

export class S3SnapshotStore implements SnapshotStore {
  readonly kind = "s3" as const;
  private readonly digests = new DigestCache();

  constructor(
    private readonly client: S3Client,
    readonly bucket: string,
    /** "" or a key prefix ending in "/". */
    readonly prefix: string,
    readonly cache: SnapshotCache,
    private readonly limits: StoreLimits = DEFAULT_LIMITS,
  ) {
    if (prefix !== "" && !prefix.endsWith("/")) throw new SnapshotStoreError("BadConfig", `S3 prefix must end in '/', got ${JSON.stringify(prefix)}`);
  }

  get blobsDir(): string {
    return this.cache.blobsDir;
  }

  get location(): string {
    return `s3://${this.bucket}/${this.prefix}`;
  }

  private recordKey(id: string): string { return `${this.prefix}snapshots/${id}.json`; }
  private dataKey(id: string, putId: string, name: string): string { return `${this.prefix}data/${id}/${putId}/${name}`; }
  private blobKey(sha256: string): string { return `${this.prefix}blobs/${sha256}`; }
  private refPrefix(sha256: string): string { return `${this.prefix}refs/${sha256}/`; }
  private attachmentKey(id: string, name: string): string { return `${this.prefix}attachments/${id}/${name}`; }
  private fileKey(r: SnapshotRecord, name: string, f: StoredFile): string {
    return f.shared ? this.blobKey(f.sha256!) : this.dataKey(r.id, r.putId, name);
  }

  async put(id: string, files: SnapshotFile[], meta: Json): Promise<SnapshotRecord> {
    checkId(id);
    checkFiles(files);
    checkMeta(meta);
    const sources = await statSources(files);
    const dl = new Deadline(`put of snapshot '${id}'`, this.limits, sources.reduce((n, s) => n + s.size, 0));
    if (await this.exists(id, dl)) throw new SnapshotStoreError("Exists", `snapshot '${id}' exists`);
    const putId = randomSuffix();
    /** Keys this put wrote that no one else needs: removed when it fails. */
    const own: string[] = [];
    const uploadedBlobs: string[] = [];
    let recordWritten = false;
    try {
      const stored: Record<string, StoredFile> = {};
      for (const src of sources) {
        if (src.shared) {
          const sha256 = await sourceDigest(src, this.digests, dl);
          // The marker comes first: a delete that looks for holders of this blob from now on sees it.
          const ref = `${this.refPrefix(sha256)}${id}.${putId}`;
          own.push(ref);
          await dl.race(this.client.write(ref, ""));
          if (!(await retryRead(dl, () => this.client.exists(this.blobKey(sha256))))) {
            uploadedBlobs.push(sha256);
            await this.upload(this.blobKey(sha256), src, dl, sha256);
          }
          stored[src.name] = { size: src.size, sha256, shared: true };
        } else {
          const key = this.dataKey(id, putId, src.name);
          own.push(key);
          stored[src.name] = { size: src.size, sha256: await this.upload(key, src, dl), shared: false };
        }
      }
      if (await this.exists(id, dl)) throw new SnapshotStoreError("Exists", `snapshot '${id}' exists (another put took the id first)`);
      const record: SnapshotRecord = { format: 1, id, putId, createdAt: new Date().toISOString(), meta, files: stored };
      recordWritten = true;
      await dl.race(this.client.write(this.recordKey(id), JSON.stringify(record), { type: "application/json" }));
      // Last writer wins in S3: the put whose record is not the one there lost the race.
      const back = await this.readRecord(id, dl);
      if (back.putId !== putId) {
        recordWritten = false;
        throw new SnapshotStoreError("Exists", `snapshot '${id}' exists (another put took the id first)`);
      }
      // A delete that collected a shared blob between our check and our record: upload it again.
      for (const src of sources) {
        const f = stored[src.name]!;
        if (f.shared && !(await retryRead(dl, () => this.client.exists(this.blobKey(f.sha256!))))) await this.upload(this.blobKey(f.sha256!), src, dl, f.sha256);
      }
      return record;
    } catch (e) {
      await this.undoPut(id, putId, recordWritten, own, uploadedBlobs);
      throw asStoreError(e, `put of snapshot '${id}'`);
    }
  }

  /** Takes back what a failed put wrote (with a fresh deadline: the put's may be spent). */
  private async undoPut(id: string, putId: string, recordWritten: boolean, own: string[], uploadedBlobs: string[]): Promise<void> {
    const dl = new Deadline(`undo of put of snapshot '${id}'`, this.limits);
    const quietly = (p: Promise<unknown>) => dl.race(p).catch(() => {});
    if (recordWritten) {
      const r = await this.readRecord(id, dl).catch(() => undefined);
      if (r?.putId === putId) await quietly(this.client.delete(this.recordKey(id)));
    }
    for (const key of own) await quietly(this.client.delete(key));
    for (const sha256 of uploadedBlobs) await quietly(this.dropBlobIfUnheld(sha256, dl));
  }

  /**
   * Streams a file up (multipart, one 8 MiB part in flight) and returns its sha256; Io when it
   * is not `expect` or the file's size changed under it. A failed upload removes the key.
   */
  private async upload(key: string, src: Source, dl: Deadline, expect?: string): Promise<string> {
    const h = new Bun.CryptoHasher("sha256");
    const w = this.client.file(key).writer({ partSize: CHUNK_BYTES, queueSize: 1, retry: 3 });
    try {
      const n = await readChunks(src.path, dl, async (c) => {
        h.update(c);
        // The reader reuses its buffer: the part is flushed before the next read overwrites it.
        const r = w.write(c);
        if (typeof r !== "number") await dl.race(r);
        await dl.race(Promise.resolve(w.flush()));
      });
      await dl.race(Promise.resolve(w.end()));
      if (n !== src.size) throw new SnapshotStoreError("Io", `file '${src.name}': ${src.path} changed size while it was uploaded (${src.size} → ${n})`);
    } catch (e) {
      try { await Promise.resolve(w.end(e as Error)).catch(() => {}); } catch { /* ended already */ }
      await new Deadline(`remove ${key}`, this.limits).race(this.client.delete(key)).catch(() => {});
      throw e;
    }
    const sha256 = h.digest("hex");
    if (expect !== undefined && sha256 !== expect) {
      await this.client.delete(key).catch(() => {});
      throw new SnapshotStoreError("Io", `file '${src.name}': ${src.path} changed while it was uploaded (sha256 ${expect} → ${sha256})`);
    }
    return sha256;
  }

  /** Deletes a shared blob when no snapshot's marker names it any more. */
  private async dropBlobIfUnheld(sha256: string, dl: Deadline): Promise<void> {
    const held = await dl.race(this.client.list({ prefix: this.refPrefix(sha256), maxKeys: 1 }));
    if ((held.contents?.length ?? 0) === 0) await dl.race(this.client.delete(this.blobKey(sha256)));
  }

  private async readRecord(id: string, dl: Deadline): Promise<SnapshotRecord> {
    let text: string;
    try {
      const f = this.client.file(this.recordKey(id));
      const size = (await retryRead(dl, () => f.stat())).size;
      if (size > LIMITS.recordBytes) throw new SnapshotStoreError("Io", `snapshot '${id}': record is ${size} bytes, more than ${LIMITS.recordBytes}`);
      text = await retryRead(dl, () => f.text());
    } catch (e) {
      if (missingKey(e)) {
        throw new SnapshotStoreError("NotFound", `snapshot '${id}' not found`);
      }
      throw asStoreError(e, `snapshot '${id}': read its record`);
    }
    return parseRecord(text, id, this.location + this.recordKey(id).slice(this.prefix.length));
  }

  async get(id: string): Promise<Materialized> {
    checkId(id);
    const record = await this.readRecord(id, new Deadline(`get of snapshot '${id}'`, this.limits));
    const total = Object.values(record.files).reduce((n, f) => n + f.size, 0);
    const dl = new Deadline(`get of snapshot '${id}'`, this.limits, total);
    return this.cache.materialize(record, (name, f, w, d) => this.download(this.fileKey(record, name, f), w, d), dl);
  }

  /** Streams one object into `w`, checking the deadline between chunks. */
  private async download(key: string, w: SparseWriter, dl: Deadline): Promise<void> {
    const reader = this.client.file(key).stream().getReader();
    try {
      for (;;) {
        const { done, value } = await dl.race(reader.read());
        if (done) return;
        await w.write(value);
      }
    } catch (e) {
      await reader.cancel().catch(() => {});
      if (s3Code(e) === "NoSuchKey") throw new SnapshotStoreError("Io", `${key} is missing from the store`);
      throw e;
    } finally {
      reader.releaseLock();
    }
  }

  async attach(id: string, name: string, path: string): Promise<void> {
    const bytes = await readAttachment(id, name, path);
    const dl = new Deadline(`attachment '${name}' of snapshot '${id}'`, this.limits, bytes.length);
    if (!(await this.exists(id, dl))) throw new SnapshotStoreError("NotFound", `snapshot '${id}' not found`);
    try {
      await dl.race(this.client.write(this.attachmentKey(id, name), bytes));
    } catch (e) {
      throw asStoreError(e, `attachment '${name}' of snapshot '${id}'`);
    }
  }

  async attachment(id: string, name: string, dest: string): Promise<boolean> {
    checkAttachment(id, name);
    const dl = new Deadline(`attachment '${name}' of snapshot '${id}'`, this.limits);
    let bytes: ArrayBuffer;
    try {
      const f = this.client.file(this.attachmentKey(id, name));
      const size = (await retryRead(dl, () => f.stat())).size;
      if (size > LIMITS.attachmentBytes) throw new SnapshotStoreError("Io", `attachment '${name}' of snapshot '${id}' is ${size} bytes, more than ${LIMITS.attachmentBytes}`);
      bytes = await retryRead(dl, () => f.arrayBuffer());
    } catch (e) {
      if (missingKey(e)) return false;
      throw asStoreError(e, `attachment '${name}' of snapshot '${id}'`);
    }
    await writeFileDurable(dest, new Uint8Array(bytes)).catch((e) => { throw asStoreError(e, `attachment '${name}' of snapshot '${id}': write ${dest}`); });
    return true;
  }

  async exists(id: string, dl = new Deadline(`exists of snapshot '${id}'`, this.limits)): Promise<boolean> {
    checkId(id);
    try {
      return await retryRead(dl, () => this.client.exists(this.recordKey(id)));
    } catch (e) {
      throw asStoreError(e, `snapshot '${id}': exists`);
    }
  }

  /** Every key under `prefix` (past the store's prefix), page by page, at most MAX_LIST_PAGES pages. */
  private async *keys(prefix: string, dl: Deadline): AsyncGenerator<{ rest: string; lastModifiedMs: number }> {
    const full = `${this.prefix}${prefix}`;
    let token: string | undefined;
    for (let page = 0; ; page++) {
      if (page === MAX_LIST_PAGES) throw new SnapshotStoreError("Io", `${this.location}${prefix}: more than ${MAX_LIST_PAGES * 1000} keys`);
      const r = await dl.race(this.client.list({ prefix: full, maxKeys: 1000, continuationToken: token }));
      for (const o of r.contents ?? []) yield { rest: o.key.slice(full.length), lastModifiedMs: o.lastModified ? Date.parse(o.lastModified) : 0 };
      if (!r.isTruncated || !r.nextContinuationToken) return;
      token = r.nextContinuationToken;
    }
  }

  async list(): Promise<string[]> {
    const dl = new Deadline(`list of ${this.location}`, this.limits);
    const ids: string[] = [];
    try {
      for await (const { rest } of this.keys("snapshots/", dl)) if (rest.endsWith(".json") && !rest.includes("/")) ids.push(rest.slice(0, -5));
    } catch (e) {
      throw asStoreError(e, `list of ${this.location}`);
    }
    return ids.sort();
  }

  /**
   * Removes what crashed puts left (files and markers of a put whose record is not the one
   * there) and blobs no marker names, when older than `olderThanMs`: give in-flight puts of
   * other nodes longer than any put's deadline.
   */
  async sweep(olderThanMs: number): Promise<{ removed: number }> {
    const dl = new Deadline(`sweep of ${this.location}`, this.limits);
    const before = Date.now() - olderThanMs;
    const live = new Map<string, string>();
    let removed = 0;
    const drop = async (rest: string) => { await dl.race(this.client.delete(`${this.prefix}${rest}`)); removed++; };
    try {
      for (const id of await this.list()) {
        const r = await this.readRecord(id, dl).catch(() => undefined);
        if (r) live.set(id, r.putId);
      }
      for await (const k of this.keys("data/", dl)) {
        const [id, putId] = k.rest.split("/");
        if (k.lastModifiedMs < before && live.get(id!) !== putId) await drop(`data/${k.rest}`);
      }
      const held = new Set<string>();
      for await (const k of this.keys("refs/", dl)) {
        const [sha256, holder = ""] = k.rest.split("/");
        const dot = holder.lastIndexOf(".");
        if (live.get(holder.slice(0, dot)) === holder.slice(dot + 1) || k.lastModifiedMs >= before) held.add(sha256!);
        else await drop(`refs/${k.rest}`);
      }
      for await (const k of this.keys("blobs/", dl)) if (k.lastModifiedMs < before && !held.has(k.rest)) await drop(`blobs/${k.rest}`);
      // An attach that raced the snapshot's delete.
      for await (const k of this.keys("attachments/", dl)) if (k.lastModifiedMs < before && !live.has(k.rest.split("/")[0]!)) await drop(`attachments/${k.rest}`);
    } catch (e) {
      throw asStoreError(e, `sweep of ${this.location}`);
    }
    return { removed };
  }

  async delete(id: string): Promise<boolean> {
    checkId(id);
    const dl = new Deadline(`delete of snapshot '${id}'`, this.limits);
    let record: SnapshotRecord;
    try {
      record = await this.readRecord(id, dl);
    } catch (e) {
      if (e instanceof SnapshotStoreError && e.code === "NotFound") return false;
      throw e;
    }
    try {
      // The record first: from here on the snapshot is gone for every reader.
      await dl.race(this.client.delete(this.recordKey(id)));
      for (const [name, f] of Object.entries(record.files)) {
        if (!f.shared) { await dl.race(this.client.delete(this.dataKey(id, record.putId, name))); continue; }
        await dl.race(this.client.delete(`${this.refPrefix(f.sha256!)}${id}.${record.putId}`));
        await this.dropBlobIfUnheld(f.sha256!, dl);
      }
      for await (const k of this.keys(`attachments/${id}/`, dl)) await dl.race(this.client.delete(`${this.prefix}attachments/${id}/${k.rest}`));
    } catch (e) {
      throw asStoreError(e, `delete of snapshot '${id}'`);
    }
    return true;
  }
}
