// Named errors of the storage engine. Each one says which file, which offset, what is wrong,
// so a bad layer is reported, never read as wrong bytes.

export class StorageError extends Error {
  override name = "StorageError";
  constructor(
    message: string,
    readonly file: string = "",
    readonly offset: number = -1,
  ) {
    super(file ? `${file}${offset >= 0 ? ` @${offset}` : ""}: ${message}` : message);
  }
}

/** The bytes on disk do not follow the format (bad magic, impossible size, broken index). */
export class FormatError extends StorageError {
  override name = "FormatError";
}

/** A checksum did not match: the data is corrupt. */
export class ChecksumError extends StorageError {
  override name = "ChecksumError";
}

/** The file ends before the format says it should. */
export class TruncatedError extends StorageError {
  override name = "TruncatedError";
}

/** An I/O request the layer cannot serve as asked (unaligned, out of range, read-only). */
export class IoRangeError extends StorageError {
  override name = "IoRangeError";
}

/** An image config that cannot name a stack. */
export class ConfigError extends StorageError {
  override name = "ConfigError";
}

/** A header field holds a value the format does not allow: names the field and the value. */
export class FieldError extends FormatError {
  override name = "FieldError";
  constructor(
    readonly field: string,
    readonly value: number | string,
    problem: string,
    file = "",
    offset = -1,
  ) {
    super(`${field} ${value} ${problem}`, file, offset);
  }
}

/** The path is not a regular file (a FIFO, a device, a directory, a socket): refused before it is opened. */
export class FileTypeError extends StorageError {
  override name = "FileTypeError";
}

/**
 * What is wrong with a format's two-part magic at the start of `b`: "" when both parts match,
 * else which part differs and what it holds, so one flipped byte reads as "damaged X", not "unknown".
 */
export function magicMismatch(b: Uint8Array, parts: readonly (readonly number[])[]): string {
  let at = 0;
  for (let i = 0; i < parts.length; i++) {
    const want = parts[i]!;
    const got = b.subarray(at, at + want.length);
    if (got.length < want.length || want.some((x, j) => got[j] !== x))
      return `magic${i} at bytes ${at}..${at + want.length} is ${hexBytes(got)}, expected ${hexBytes(want)}`;
    at += want.length;
  }
  return "";
}

/** How many parts of a two-part magic match (2: all; 1: one part damaged; 0: not this format). */
export function magicPartsMatching(b: Uint8Array, parts: readonly (readonly number[])[]): number {
  let at = 0;
  let n = 0;
  for (const want of parts) {
    if (want.every((x, j) => b[at + j] === x)) n++;
    at += want.length;
  }
  return n;
}

export function hexBytes(b: ArrayLike<number>): string {
  return Array.from(b, (x) => x.toString(16).padStart(2, "0")).join(" ");
}
