// AENV_SNAPSHOT_STORE → a SnapshotStore. A directory (absolute path; local disk or a shared
// filesystem, the same code) or s3://bucket/prefix, with S3's endpoint, region and credentials
// from the caller (the node's s3_* settings, docs/node.md).
import { S3Client } from "bun";
import { join } from "node:path";
import { S3UrlError, parseS3Url } from "../storage/s3_url.ts";
import { type BlobFromPeers, SnapshotCache } from "./cache.ts";
import { DEFAULT_LIMITS, type StoreLimits } from "./deadline.ts";
import { DirSnapshotStore } from "./dir_store.ts";
import { SnapshotStoreError } from "./errors.ts";
import { S3SnapshotStore } from "./s3_store.ts";
import type { SnapshotStore } from "./store.ts";

export interface OpenOptions {
  /** $AENV_HOME: the default store is `<home>/snapshots`, the default cache `<home>/snapshot-cache`. */
  home: string;
  /** S3 only: endpoint, region and credentials. */
  s3?: S3Settings;
  /** S3 only: the local cache of downloaded snapshots and its bound in bytes (default 32 GiB). */
  cacheDir?: string;
  cacheBytes?: number;
  limits?: StoreLimits;
  /** S3 only: shared files are asked of the node's peers first. */
  fromPeers?: BlobFromPeers;
}

/** Empty strings count as unset: the node's settings default to "". */
export interface S3Settings {
  /** http(s)://host[:port]; unset: AWS itself, in the region. */
  endpoint?: string;
  /** Default us-east-1. */
  region?: string;
  accessKeyId?: string;
  secretAccessKey?: string;
  sessionToken?: string;
}

/** What an S3 endpoint looks like: http(s)://host[:port][/path]. */
export const S3_ENDPOINT = /^https?:\/\/[^\s/]+(\/.*)?$/;

export const DEFAULT_CACHE_BYTES = 32 * 1024 ** 3;

/** The store a setting names; BadConfig when the setting or S3's credentials are wrong. */
export function openSnapshotStore(setting: string | undefined, o: OpenOptions): SnapshotStore {
  const limits = o.limits ?? DEFAULT_LIMITS;
  const s = (setting ?? "").trim();
  if (s === "") return new DirSnapshotStore(join(o.home, "snapshots"), limits);
  if (s.startsWith("/")) {
    if (s.split("/").includes("..")) throw new SnapshotStoreError("BadConfig", `AENV_SNAPSHOT_STORE=${s}: no '..' in the path`);
    return new DirSnapshotStore(s, limits);
  }
  if (!s.startsWith("s3://")) throw new SnapshotStoreError("BadConfig", `AENV_SNAPSHOT_STORE=${s}: expected an absolute directory or s3://bucket/prefix`);
  let bucket: string;
  let path: string[];
  try {
    ({ bucket, parts: path } = parseS3Url(s));
  } catch (e) {
    throw e instanceof S3UrlError ? new SnapshotStoreError("BadConfig", `AENV_SNAPSHOT_STORE=${s}: ${e.message}`) : e;
  }
  const prefix = path.length === 0 ? "" : `${path.join("/")}/`;
  const { accessKeyId, secretAccessKey } = o.s3 ?? {};
  if (!accessKeyId || !secretAccessKey) throw new SnapshotStoreError("BadConfig", `AENV_SNAPSHOT_STORE=${s}: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY must be set`);
  const region = o.s3?.region || "us-east-1";
  const endpoint = o.s3?.endpoint || undefined;
  if (endpoint !== undefined && !S3_ENDPOINT.test(endpoint)) throw new SnapshotStoreError("BadConfig", `AENV_S3_ENDPOINT=${endpoint}: expected http(s)://host[:port]`);
  const client = new S3Client({
    bucket, region, accessKeyId, secretAccessKey, sessionToken: o.s3?.sessionToken || undefined,
    // Without an endpoint: AWS itself, in the region.
    endpoint: endpoint ?? `https://s3.${region}.amazonaws.com`,
  });
  const cache = new SnapshotCache({ root: o.cacheDir ?? join(o.home, "snapshot-cache"), maxBytes: o.cacheBytes ?? DEFAULT_CACHE_BYTES, fromPeers: o.fromPeers });
  return new S3SnapshotStore(client, bucket, prefix, cache, limits);
}
