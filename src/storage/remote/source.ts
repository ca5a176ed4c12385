// The seam every remote byte comes through: a ChunkSource reads a range of a layer named by its
// content digest. Origins (registry blob by HTTP Range, S3 ranged GET) and peers implement it;
// RemoteFile asks an ordered list of them, one chunk at a time, and checks every answer's length.

/** A layer digest as the OCI spec writes it: `sha256:` and 64 lowercase hex digits. */
export type LayerDigest = `sha256:${string}`;

export const DIGEST_RE = /^sha256:[0-9a-f]{64}$/;

export function isLayerDigest(s: unknown): s is LayerDigest {
  return typeof s === "string" && DIGEST_RE.test(s);
}

/**
 * One place a layer's bytes can come from.
 *
 * Contract (RemoteFile relies on each point):
 * - `read` resolves to exactly `length` bytes of the layer `digest` starting at `offset`
 *   (RemoteFile never asks past the layer's end). A shorter or longer answer is treated as a
 *   failure of this source, never as data.
 * - It rejects (any Error; `SourceError` below when it can say why, with `retryable` false for
 *   answers that will not change, e.g. 404 or "this peer does not have the layer") when it
 *   cannot answer; RemoteFile then retries with backoff or moves on to the next source.
 * - It stops and rejects promptly when `signal` aborts (RemoteFile's per-request timeout).
 * - It does not cache: caching, retries, timeouts and the I/O budget belong to RemoteFile.
 * - A source may hold per-layer state (a peer it learned has the layer); it must be safe to call
 *   concurrently for different ranges of the same and of different layers.
 */
export interface ChunkSource {
  /** Short, for error messages and counters: "registry 127.0.0.1:5000", "s3 bucket/key", "peer <id>". */
  readonly name: string;
  read(digest: LayerDigest, offset: number, length: number, signal: AbortSignal): Promise<Uint8Array>;
}

/** A source's own failure, with whether trying the same source again could help. */
export class SourceError extends Error {
  override name = "SourceError";
  constructor(
    message: string,
    /** false: asking again gives the same answer (404, wrong size, not held by this peer). */
    readonly retryable: boolean,
    /** HTTP status where the source speaks HTTP. */
    readonly status?: number,
  ) {
    super(message);
  }
}
