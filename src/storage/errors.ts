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
