// The snapshot store's one error type: a code the caller branches on and a message that names
// the snapshot, the file or the key, and what went wrong.

export type SnapshotStoreErrorCode = "NotFound" | "Exists" | "Io" | "Timeout" | "BadConfig";

export class SnapshotStoreError extends Error {
  constructor(
    readonly code: SnapshotStoreErrorCode,
    message: string,
  ) {
    super(message);
    this.name = `SnapshotStoreError(${code})`;
  }
}

/** `e` as a SnapshotStoreError: ours pass through, anything else is Io about `what`. */
export function asStoreError(e: unknown, what: string): SnapshotStoreError {
  if (e instanceof SnapshotStoreError) return e;
  const err = e as { code?: unknown; message?: unknown };
  const code = typeof err?.code === "string" ? ` (${err.code})` : "";
  return new SnapshotStoreError("Io", `${what}: ${String(err?.message ?? e)}${code}`);
}

/** The errno-style code of a node:fs error, or undefined. */
export function fsCode(e: unknown): string | undefined {
  const c = (e as { code?: unknown })?.code;
  return typeof c === "string" ? c : undefined;
}
