// Named errors of remote layers: each says which layer, which range, and why.

import { StorageError } from "../errors.ts";

/** One source's failed try at a chunk. */
export interface SourceAttempt {
  source: string;
  error: string;
}

/**
 * Every source was tried (with retries) for a range of a remote layer and none answered with
 * the right bytes: the read fails (a guest sees EIO), nothing is cached.
 */
export class RemoteReadError extends StorageError {
  override name = "RemoteReadError";
  constructor(
    readonly digest: string,
    readonly rangeOffset: number,
    readonly rangeLength: number,
    readonly attempts: SourceAttempt[],
  ) {
    super(
      `bytes ${rangeOffset}+${rangeLength}: every source failed (${attempts.map((a) => `${a.source}: ${a.error}`).join("; ") || "no sources"})`,
      digest,
      rangeOffset,
    );
  }
}

/** A whole downloaded layer does not hash to its digest: it was discarded, not promoted. */
export class LayerDigestError extends StorageError {
  override name = "LayerDigestError";
  constructor(
    readonly digest: string,
    readonly actual: string,
  ) {
    super(`downloaded layer hashes to sha256:${actual}; discarded`, digest);
  }
}

/** A remote layer descriptor that cannot be used (bad digest, size, source spec, chunk list). */
export class RemoteSpecError extends StorageError {
  override name = "RemoteSpecError";
}
