// Remote layers opened in this thread: a config's remote lower (spec.ts) or a layer registered
// with live ChunkSource objects (registry auth, peers), both named `remote:sha256:<hex>`.

import type { ReadableFile } from "../file.ts";
import type { IoLimiter } from "../io_limiter.ts";
import { BlockCache, type BlockCacheOptions } from "./block_cache.ts";
import { RemoteSpecError } from "./errors.ts";
import { RegistryRangeSource, fileHeaders } from "./http_source.ts";
import { RemoteFile } from "./remote_file.ts";
import { S3RangeSource } from "./s3_source.ts";
import { type OriginSpec, REMOTE_PREFIX, type RemoteLayerSpec, checkRemoteShape } from "./spec.ts";
import type { ChunkSource, LayerDigest } from "./source.ts";

/** A remote layer with live sources, registered in this thread by in-process callers. */
export interface RemoteLayerHandle {
  digest: LayerDigest;
  size: number;
  sources: ChunkSource[];
  cache: BlockCache;
  chunkSize?: number;
  chunkDigests?: string[];
  download?: boolean;
}

const known = new Map<string, RemoteLayerHandle>();

/** Make `remote:<digest>` openable in this thread. */
export function registerRemoteLayer(h: RemoteLayerHandle): string {
  checkRemoteShape(h.digest, h.size, h.chunkSize, h.chunkDigests, "registerRemoteLayer");
  known.set(h.digest, h);
  return REMOTE_PREFIX + h.digest;
}

export function unregisterRemoteLayer(digest: string): void {
  known.delete(digest);
}

export function originSource(s: OriginSpec): ChunkSource {
  if (s.kind === "http") {
    const headers = s.headers;
    const unix = s.unix ? { unix: s.unix } : {};
    if (!s.headersFile) return new RegistryRangeSource({ url: s.url, headers: headers ? () => headers : undefined, ...unix });
    const fromFile = fileHeaders(s.headersFile);
    return new RegistryRangeSource({ url: s.url, headers: async (signal) => ({ ...headers, ...(await fromFile(signal)) }), retryUnauthorized: true, ...unix });
  }
  const { kind: _, ...o } = s;
  return new S3RangeSource(o);
}

/** A config lower's remote spec as a registered handle (its cache shared within this thread). */
export async function handleFromSpec(digest: LayerDigest, size: number, spec: RemoteLayerSpec): Promise<RemoteLayerHandle> {
  const cache = await BlockCache.shared(spec.cache as BlockCacheOptions);
  return { digest, size, sources: spec.sources.map(originSource), cache, chunkSize: spec.chunkSize, chunkDigests: spec.chunkDigests, download: spec.download };
}

/** Open `remote:<digest>` (registered in this thread) as a RemoteFile. */
export function openRemoteFile(path: string, opts: { remoteIo?: IoLimiter; onDownloadError?: (e: Error) => void } = {}): ReadableFile {
  const digest = path.slice(REMOTE_PREFIX.length);
  const h = known.get(digest);
  if (!h) throw new RemoteSpecError(`no remote layer ${digest} is registered in this process`, path);
  const f = RemoteFile.open({
    digest: h.digest,
    size: h.size,
    sources: h.sources,
    cache: h.cache,
    limiter: opts.remoteIo,
    chunkSize: h.chunkSize,
    chunkDigests: h.chunkDigests,
  });
  if ((h.download ?? true) && !f.localPath && h.size <= h.cache.lowBytes)
    f.download().catch((e: Error) => f.isClosed || (opts.onDownloadError ?? ((err) => console.error(`remote layer ${digest}: background download failed: ${err.message}`)))(e));
  return f;
}
