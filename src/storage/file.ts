// One random-access file interface for every backend (local file through io_uring, ZFile and tar
// views, and later registry ranges, S3 and peers). Layers only ever see this interface.

export interface ReadableFile {
  /** Path or URL, for error messages. */
  readonly name: string;
  /** Logical size in bytes. */
  size(): number;
  /**
   * Read up to buf.length bytes at offset into buf; resolves to the count read, short only at EOF.
   * The buffer must stay referenced until the promise settles.
   */
  pread(buf: Uint8Array, offset: number): Promise<number>;
  /**
   * pread without a promise of its own, for a caller that settles one promise over several reads
   * (Image): the outcome goes to `waiter`, once, possibly before preadTo returns; it never throws.
   */
  preadTo?(buf: Uint8Array, offset: number, waiter: ReadWaiter): void;
  close(): Promise<void>;
}

/** Told how one preadTo ended: the count read (short only at EOF), or the error. */
export interface ReadWaiter {
  readDone(n: number): void;
  readFailed(e: unknown): void;
}

export interface WritableFile extends ReadableFile {
  /** Write all of buf at offset (extends the file when past EOF). */
  pwrite(buf: Uint8Array, offset: number): Promise<void>;
  /** Persist written data (and the size) to stable storage. */
  fdatasync(): Promise<void>;
  truncate(size: number): Promise<void>;
  /** Punch a hole (keeps size): later reads of the range return zeros. */
  punchHole(offset: number, length: number): Promise<void>;
}

/** Read exactly buf.length bytes at offset; a short read is zero-filled (a hole at EOF). */
export async function preadFull(f: ReadableFile, buf: Uint8Array, offset: number): Promise<number> {
  const n = await f.pread(buf, offset);
  if (n < buf.length) buf.fill(0, n);
  return n;
}
