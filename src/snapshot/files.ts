// Streaming file work of the snapshot store: chunked reads with a fixed buffer (a multi-GiB
// memory image never sits in memory), sha256 while reading, sparse writes (all-zero blocks stay
// holes), durable small files (temp name, fsync, rename) and the link-else-copy of a put.
import { constants } from "node:fs";
import { link, open, rename, rm, stat, unlink, type FileHandle } from "node:fs/promises";
import { basename, dirname, join } from "node:path";
import type { Deadline } from "./deadline.ts";
import { fsCode, SnapshotStoreError } from "./errors.ts";

/** Read and transfer unit: 8 MiB per chunk bounds a transfer's memory (and is an S3 part size). */
export const CHUNK_BYTES = 8 << 20;
/** Hole granularity of sparse writes: an all-zero 64 KiB block is skipped, not written. */
export const HOLE_BYTES = 64 << 10;
const ZERO_BLOCK = new Uint8Array(HOLE_BYTES);

export function randomSuffix(): string {
  return Buffer.from(crypto.getRandomValues(new Uint8Array(8))).toString("hex");
}

/**
 * Calls `each` on successive chunks of the file at `path` (one reused buffer: `each` must be done
 * with a chunk when its promise resolves) and returns the bytes read; checks `dl` between chunks.
 */
export async function readChunks(path: string, dl: Deadline, each: (chunk: Uint8Array) => Promise<void> | void): Promise<number> {
  const fh = await open(path, "r");
  try {
    const buf = new Uint8Array(CHUNK_BYTES);
    let pos = 0;
    for (;;) {
      dl.check();
      let n = 0;
      // Fill the whole buffer unless the file ends, so chunks are whole parts for S3.
      while (n < buf.length) {
        const { bytesRead } = await fh.read(buf, n, buf.length - n, pos + n);
        if (bytesRead === 0) break;
        n += bytesRead;
      }
      if (n === 0) return pos;
      pos += n;
      await each(buf.subarray(0, n));
      if (n < buf.length) return pos;
    }
  } finally {
    await fh.close();
  }
}

/** sha256 (hex) and length of a file, read in chunks. */
export async function sha256File(path: string, dl: Deadline): Promise<{ sha256: string; size: number }> {
  const h = new Bun.CryptoHasher("sha256");
  const size = await readChunks(path, dl, (c) => { h.update(c); });
  return { sha256: h.digest("hex"), size };
}

function isZero(b: Uint8Array): boolean {
  return b.length === HOLE_BYTES ? Buffer.from(b.buffer, b.byteOffset, b.length).equals(ZERO_BLOCK)
    : Buffer.from(b.buffer, b.byteOffset, b.length).equals(ZERO_BLOCK.subarray(0, b.length));
}

/**
 * Writes a byte stream into a new file, leaving every all-zero HOLE_BYTES block (aligned to the
 * file offset) as a hole; `finish` sets the length, fsyncs and closes. Optionally hashes.
 */
export class SparseWriter {
  private pos = 0;
  private readonly hasher: Bun.CryptoHasher | null;

  private constructor(private readonly fh: FileHandle, hash: boolean) {
    this.hasher = hash ? new Bun.CryptoHasher("sha256") : null;
  }

  /** A new file at `path` (refused if it exists). */
  static async create(path: string, o: { hash?: boolean } = {}): Promise<SparseWriter> {
    const fh = await open(path, constants.O_WRONLY | constants.O_CREAT | constants.O_EXCL, 0o644);
    return new SparseWriter(fh, o.hash ?? false);
  }

  get written(): number {
    return this.pos;
  }

  async write(chunk: Uint8Array): Promise<void> {
    this.hasher?.update(chunk);
    let i = 0;
    while (i < chunk.length) {
      // One block: up to the next HOLE_BYTES boundary of the file offset.
      const blockEnd = Math.min(chunk.length, i + HOLE_BYTES - ((this.pos + i) % HOLE_BYTES));
      if (isZero(chunk.subarray(i, blockEnd))) { i = blockEnd; continue; }
      // A run of non-zero blocks goes out in one write.
      let runEnd = blockEnd;
      while (runEnd < chunk.length) {
        const next = Math.min(chunk.length, runEnd + HOLE_BYTES);
        if (isZero(chunk.subarray(runEnd, next))) break;
        runEnd = next;
      }
      let off = i;
      while (off < runEnd) {
        const { bytesWritten } = await this.fh.write(chunk, off, runEnd - off, this.pos + off);
        off += bytesWritten;
      }
      i = runEnd;
    }
    this.pos += chunk.length;
  }

  /** Sets the length (trailing holes included), fsyncs, closes; returns the sha256 when hashing. */
  async finish(): Promise<string | undefined> {
    try {
      await this.fh.truncate(this.pos);
      await this.fh.datasync();
    } finally {
      await this.fh.close();
    }
    return this.hasher?.digest("hex");
  }

  /** Closes without finishing (the caller removes the file). */
  async abandon(): Promise<void> {
    await this.fh.close().catch(() => {});
  }
}

/** Copies `src` to the new file `dest` in chunks, holes kept as holes; fsynced. Returns the sha256 when asked. */
export async function copySparse(src: string, dest: string, dl: Deadline, o: { hash?: boolean } = {}): Promise<string | undefined> {
  const w = await SparseWriter.create(dest, o);
  try {
    await readChunks(src, dl, (c) => w.write(c));
    return await w.finish();
  } catch (e) {
    await w.abandon();
    await rm(dest, { force: true });
    throw e;
  }
}

/**
 * `dest` becomes `src`'s content: a hard link when both are on one filesystem (no bytes move;
 * the file must never be written again), else a sparse copy.
 */
export async function linkOrCopy(src: string, dest: string, dl: Deadline): Promise<"linked" | "copied"> {
  try {
    await link(src, dest);
    return "linked";
  } catch (e) {
    const c = fsCode(e);
    if (c !== "EXDEV" && c !== "EPERM" && c !== "EMLINK" && c !== "ENOTSUP" && c !== "EOPNOTSUPP") throw e;
  }
  await copySparse(src, dest, dl);
  return "copied";
}

/** fsync of a directory, so the names created or renamed in it survive a crash. */
export async function syncDir(dir: string): Promise<void> {
  const fh = await open(dir, "r");
  try {
    await fh.sync();
  } finally {
    await fh.close();
  }
}

/** Writes `data` to `path` whole or not at all: temp name beside it, fsync, rename, fsync dir. */
export async function writeFileDurable(path: string, data: string | Uint8Array): Promise<void> {
  const tmp = `${path}.tmp-${randomSuffix()}`;
  try {
    const fh = await open(tmp, constants.O_WRONLY | constants.O_CREAT | constants.O_EXCL, 0o644);
    try {
      await fh.writeFile(data);
      await fh.datasync();
    } finally {
      await fh.close();
    }
    await rename(tmp, path);
  } catch (e) {
    await rm(tmp, { force: true });
    throw e;
  }
  await syncDir(dirname(path));
}

/** A small file (a record, an attachment) read whole, refused past `maxBytes`. */
export async function readSmallBytes(path: string, maxBytes: number): Promise<Uint8Array> {
  const fh = await open(path, "r");
  try {
    const st = await fh.stat();
    if (st.size > maxBytes) throw new Error(`${path} is ${st.size} bytes, more than ${maxBytes}`);
    return new Uint8Array(await fh.readFile());
  } finally {
    await fh.close();
  }
}

/** readSmallBytes as UTF-8 text. */
export async function readSmallFile(path: string, maxBytes: number): Promise<string> {
  return new TextDecoder().decode(await readSmallBytes(path, maxBytes));
}

export async function pathExists(path: string): Promise<boolean> {
  try {
    await stat(path);
    return true;
  } catch (e) {
    if (fsCode(e) === "ENOENT") return false;
    throw e;
  }
}

/**
 * `dest` becomes a hard link to the content-addressed file `blob`. When there is none, `make(tmp)`
 * writes it at a temporary path in `tmpDir` that is then renamed in (over one a racing writer made:
 * same bytes, and its holders keep their links). A blob removed between the rename and the link
 * (a racing delete or eviction) is made again. Returns whether this call made it.
 */
export async function linkBlob(blob: string, tmpDir: string, dest: string, make: (tmp: string) => Promise<void>): Promise<boolean> {
  let made = false;
  for (let attempt = 0; attempt < 3; attempt++) {
    try {
      await link(blob, dest);
      return made;
    } catch (e) {
      if (fsCode(e) !== "ENOENT") throw e;
    }
    const tmp = join(tmpDir, `blob-${basename(blob)}.${randomSuffix()}`);
    try {
      await make(tmp);
      await rename(tmp, blob);
    } catch (e) {
      await rm(tmp, { force: true });
      throw e;
    }
    made = true;
  }
  throw new SnapshotStoreError("Io", `blob ${blob} vanished three times while it was linked`);
}

/** Removes the blobs no one links to any more (link count 1: only the pool's own name). */
export async function dropUnlinked(blobs: Iterable<string>): Promise<void> {
  for (const b of new Set(blobs)) {
    try {
      // A holder that links it after this stat keeps its link: the inode lives on with it.
      if ((await stat(b)).nlink === 1) await unlink(b);
    } catch { /* gone already */ }
  }
}
