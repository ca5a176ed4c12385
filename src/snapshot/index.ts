// The snapshot store (docs/snapshots.md): what the rest of the node imports.
export { SnapshotCache, type CacheOptions } from "./cache.ts";
export { DEFAULT_LIMITS, type StoreLimits } from "./deadline.ts";
export { DirSnapshotStore } from "./dir_store.ts";
export { SnapshotStoreError, type SnapshotStoreErrorCode } from "./errors.ts";
export { DEFAULT_CACHE_BYTES, openSnapshotStore, type OpenOptions, type S3Settings } from "./open.ts";
export { S3SnapshotStore } from "./s3_store.ts";
export type { Json, Materialized, SnapshotFile, SnapshotRecord, SnapshotStore, StoredFile } from "./store.ts";
