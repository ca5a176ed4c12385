// Remote layers as data (an image config's lower, a blockd request) and as opened files.
//
// A lower is remote when it carries `remote` beside its `digest` and `size`:
//   { "digest": "sha256:…", "size": N, "remote": { "sources": [
//       { "kind": "http", "url": "http://reg/v2/x/blobs/sha256:…", "headers": { … }, "headersFile": "/…/auth.json" },
//       { "kind": "s3", "bucket": "b", "key": "k", "endpoint": "http://…", … } ],
//     "cache": { "dir": "/var/lib/aenv/remote", "capacity": 10737418240 },
//     "chunkSize": 1048576, "chunkDigests": [ … ], "download": true } }
// Its path (for stack keys) is the promoted local file once there, else `remote:sha256:<hex>`.
// Registry auth reaches another process (blockd) through `headersFile`, which the node keeps
// fresh. In-process callers (registry auth, peers) may register a layer with live
// ChunkSource objects instead, and name it `remote:sha256:<hex>`.

import { isAbsolute, join } from "node:path";
import { existsSync } from "node:fs";
import { RemoteSpecError } from "./errors.ts";
import type { S3RangeSourceOptions } from "./s3_source.ts";
import { isLayerDigest } from "./source.ts";

export const REMOTE_PREFIX = "remote:";
export const DEFAULT_CHUNK_SIZE = 1 << 20;

export type OriginSpec =
  | {
      kind: "http";
      url: string;
      headers?: Record<string, string>;
      /**
       * A JSON file `{"headers": {name: value}}` read before each request and added to `headers`
       * (a registry token the node renews; docs/storage.md, Registry auth). Missing: no headers;
       * while one is named, 401 and 403 count as retryable (the next try may carry a new token).
       */
      headersFile?: string;
      /** An absolute unix socket path the request goes to instead of the URL's host (the node's peer facade). */
      unix?: string;
    }
  | ({ kind: "s3" } & S3RangeSourceOptions);

/** What a config's lower carries under `remote`. */
export interface RemoteLayerSpec {
  sources: OriginSpec[];
  cache: { dir: string; capacity: number; high?: number; low?: number };
  chunkSize?: number;
  chunkDigests?: string[];
  /** Start the background download (and promotion) when opened (default true). */
  download?: boolean;
}

/** Checks a spec's fields; shared by RemoteFile and the config parser. */
export function checkRemoteShape(digest: unknown, size: unknown, chunkSize: unknown, chunkDigests: unknown, where: string): void {
  if (!isLayerDigest(digest)) throw new RemoteSpecError(`digest ${JSON.stringify(digest)} is not sha256:<64 hex>`, where);
  if (!Number.isSafeInteger(size) || (size as number) <= 0) throw new RemoteSpecError(`size ${size} is not a positive byte count`, where);
  const cs = chunkSize ?? DEFAULT_CHUNK_SIZE;
  if (!Number.isSafeInteger(cs) || (cs as number) < 4096 || ((cs as number) & ((cs as number) - 1)) !== 0)
    throw new RemoteSpecError(`chunkSize ${cs} is not a power of two of at least 4096`, where);
  if (chunkDigests !== undefined) {
    const want = Math.ceil((size as number) / (cs as number));
    if (!Array.isArray(chunkDigests) || chunkDigests.length !== want || !chunkDigests.every((d) => typeof d === "string" && /^[0-9a-f]{64}$/.test(d)))
      throw new RemoteSpecError(`chunkDigests must be ${want} sha256 hex strings (one per ${cs}-byte chunk)`, where);
  }
}

/** Validate the `remote` field of a lower (`where` names it in errors). */
export function parseRemoteSpec(raw: unknown, digest: unknown, size: unknown, where: string): RemoteLayerSpec {
  if (!raw || typeof raw !== "object" || Array.isArray(raw)) throw new RemoteSpecError(`${where}.remote must be an object`);
  const r = raw as Record<string, unknown>;
  checkRemoteShape(digest, size, r.chunkSize, r.chunkDigests, where);
  if (!Array.isArray(r.sources) || r.sources.length === 0) throw new RemoteSpecError(`${where}.remote.sources must be a non-empty array`);
  const sources = r.sources.map((s, i): OriginSpec => {
    const o = s as Record<string, unknown>;
    if (o?.kind === "http") {
      if (typeof o.url !== "string" || !URL.canParse(o.url)) throw new RemoteSpecError(`${where}.remote.sources[${i}].url must be a URL`);
      if (o.headers !== undefined && (typeof o.headers !== "object" || !Object.values(o.headers as object).every((v) => typeof v === "string")))
        throw new RemoteSpecError(`${where}.remote.sources[${i}].headers must map names to strings`);
      if (o.headersFile !== undefined && (typeof o.headersFile !== "string" || !isAbsolute(o.headersFile)))
        throw new RemoteSpecError(`${where}.remote.sources[${i}].headersFile must be an absolute path`);
      if (o.unix !== undefined && (typeof o.unix !== "string" || !isAbsolute(o.unix)))
        throw new RemoteSpecError(`${where}.remote.sources[${i}].unix must be an absolute path`);
      return { kind: "http", url: o.url, headers: o.headers as Record<string, string> | undefined, ...(o.headersFile ? { headersFile: o.headersFile as string } : {}), ...(o.unix ? { unix: o.unix as string } : {}) };
    }
    if (o?.kind === "s3") {
      if (typeof o.bucket !== "string" || !o.bucket || typeof o.key !== "string" || !o.key)
        throw new RemoteSpecError(`${where}.remote.sources[${i}] needs "bucket" and "key"`);
      for (const k of ["endpoint", "region", "accessKeyId", "secretAccessKey", "sessionToken"])
        if (o[k] !== undefined && typeof o[k] !== "string") throw new RemoteSpecError(`${where}.remote.sources[${i}].${k} must be a string`);
      return { ...(o as unknown as S3RangeSourceOptions), kind: "s3" };
    }
    throw new RemoteSpecError(`${where}.remote.sources[${i}].kind must be "http" or "s3"`);
  });
  const c = r.cache as Record<string, unknown> | undefined;
  if (!c || typeof c.dir !== "string" || !isAbsolute(c.dir) || !Number.isSafeInteger(c.capacity) || (c.capacity as number) <= 0)
    throw new RemoteSpecError(`${where}.remote.cache needs an absolute "dir" and a positive "capacity"`);
  const spec: RemoteLayerSpec = { sources, cache: { dir: c.dir, capacity: c.capacity as number } };
  if (typeof c.high === "number") spec.cache.high = c.high;
  if (typeof c.low === "number") spec.cache.low = c.low;
  if (r.chunkSize !== undefined) spec.chunkSize = r.chunkSize as number;
  if (r.chunkDigests !== undefined) spec.chunkDigests = r.chunkDigests as string[];
  if (r.download !== undefined) {
    if (typeof r.download !== "boolean") throw new RemoteSpecError(`${where}.remote.download must be true or false`);
    spec.download = r.download;
  }
  return spec;
}

/** The promoted local file of a remote lower when it is there, else `remote:<digest>`. */
export function remoteLayerPath(digest: string, spec: RemoteLayerSpec): string {
  const promoted = join(spec.cache.dir, "layers", digest.slice(7));
  return existsSync(promoted) ? promoted : REMOTE_PREFIX + digest;
}
