// The one error class of OCI layer conversion and image pulls: a code that says what went wrong,
// the layer (digest) and tar entry it concerns, and the HTTP status an API answers it with.

export type ConvertErrorCode =
  | "UnsafePath" // a tar entry whose name has a `..` component or runs through a symlink
  | "CorruptLayer" // a compressed stream or tar that does not decode (bad gzip/zstd, checksum, cut short)
  | "Unsupported" // an entry type the converter does not apply (GNU sparse files, multi-volume)
  | "DigestMismatch" // the uncompressed layer's sha256 is not the diffID the image's config names
  | "ApplyFailed" // a file system call failed while applying an entry (ENOSPC, a hard link to nothing)
  | "MountFailed" // mkfs, mount or umount of the layer's file system failed
  | "Timeout" // a layer's conversion ran past its limit
  | "CacheCorrupt"; // a cache entry that cannot be read back or replaced

/** Problems of the image itself are the caller's (400); the rest are the node's (500). */
const STATUS: Record<ConvertErrorCode, number> = {
  UnsafePath: 400, CorruptLayer: 400, Unsupported: 400, DigestMismatch: 400,
  ApplyFailed: 500, MountFailed: 500, Timeout: 500, CacheCorrupt: 500,
};

export class ConvertError extends Error {
  override name = "ConvertError";
  readonly status: number;
  constructor(
    readonly code: ConvertErrorCode,
    message: string,
    /** The tar entry (as a UTF-8 string) the error is about, when there is one. */
    readonly entry?: string,
    /** The layer (its digest or diffID) being converted, when known. */
    readonly layer?: string,
  ) {
    super(`${layer ? `layer ${layer}: ` : ""}${message}`);
    this.status = STATUS[code];
  }
}
