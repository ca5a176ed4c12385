// pullImage: an OCI image from a registry as a stack of sealed overlaybd layers (lowest first) and
// the parts of its config a sandbox inherits. Tar layers are converted onto the cached empty ext4
// layer, each result cached by chain ID, the download of layer i+1 overlapping the conversion of
// layer i; overlaybd-native layers are used as they are (digest verified, opened as a layer, no
// conversion), the disk their virtual size. With `remote`, overlaybd-native layers are not
// downloaded at all: they become remote refs that blockd's workers read by Range (a lazy pull).
// The image comes from a registry (a reference and `registry`) or any ImageLocation (an OCI
// image layout in S3). A lazy pull of an image whose manifest names a boot trace brings its bytes
// along (prefetch_trace.ts): the build VM over the remote layers replays it. A layer larger than
// maxBlobBytes is refused before anything is downloaded, and a disk larger than maxDiskSizeMB (a
// converted image's size asked for, a native layer's virtual size) as soon as it is known.

import { rm } from "node:fs/promises";
import { join } from "node:path";
import type { BlockdClient } from "../blockdev/client.ts";
import { convertLayer, DEFAULT_DISK_BYTES, emptyExt4Layer, initCache, type ConvertContext, type ConvertedLayer } from "./convert.ts";
import { ConvertError } from "./convert_error.ts";
import { chainId, type LayerCache } from "./layer_cache.ts";
import { type ImageLocation, RegistryLocation } from "./image_location.ts";
import { DEFAULT_MAX_BLOB_BYTES, type Descriptor, formatImageRef, type ImageRef, type LocatedImage, type OciImageConfig, parsePlatform, type RegistryClient, RegistryError } from "./registry.ts";
import { openLayerFile, unwrap } from "../storage/open_layer.ts";
import { RemoteReadError } from "../storage/remote/errors.ts";
import { ReadOnlyLayer } from "../storage/lsmt/readonly_layer.ts";
import { BlockCache, type BlockCacheOptions } from "../storage/remote/block_cache.ts";
import { RemoteFile } from "../storage/remote/remote_file.ts";
import type { LayerDigest } from "../storage/remote/source.ts";
import type { RemoteLayerSpec } from "../storage/remote/spec.ts";
import { fetchTrace, traceDescriptor } from "./prefetch_trace.ts";

/** 64 GiB: the node's largest disk, the same bound a template definition's diskSizeMB has. */
export const DEFAULT_MAX_DISK_SIZE_MB = 65536;

/** A layer left at its origin (a registry blob, an S3 object): blockd's workers read it by range through the block cache. */
export interface RemoteLayerRef {
  digest: LayerDigest;
  size: number;
  remote: RemoteLayerSpec;
}

/** A pulled layer: a sealed layer file's path, or a layer left at its origin. */
export type PulledLayer = string | RemoteLayerRef;

/**
 * Lazy pulls of overlaybd-native images (docs/templates.md, Pulling). The refs carry no registry
 * auth and no S3 credentials: the node adds its own at each use (src/node/images.ts remoteLayerView).
 */
export interface RemotePullOptions {
  /** The node's block cache (the folder blockd's workers share). */
  cache: BlockCacheOptions;
  /** Fetch whole layers in the background and promote them to local files [true]. */
  download?: boolean;
}

export interface PullProgress {
  /** resolving: reading manifests and config; layers: downloading and converting; done. */
  phase: "resolving" | "layers" | "done";
  layersDone: number;
  layersTotal: number;
  /** Layers found converted in the cache (no download). */
  layersCached: number;
  /** Blob bytes downloaded so far, of the blobs this pull needs. */
  bytesDownloaded: number;
  bytesTotal: number;
  /** Downloaded bytes per second since the pull started. */
  bytesPerSecond: number;
  /** Tar bytes applied in the layer being converted. */
  bytesApplied: number;
  elapsedMs: number;
}

/** What a sandbox of the image inherits from its config. */
export interface ImageRunConfig {
  /** Env entries as a map (`KEY=value` split at the first `=`). */
  env: Record<string, string>;
  workingDir: string;
  user: string;
  entrypoint: string[];
  cmd: string[];
  /** `"8080/tcp"` keys. */
  exposedPorts: string[];
  labels: Record<string, string>;
}

export interface PulledImage {
  /** The image pinned to its manifest digest: `registry/repo:tag@sha256:…`, `s3://bucket/prefix@sha256:…`. */
  ref: string;
  manifestDigest: string;
  /** Sealed overlaybd layer files, lowest first (the empty ext4 layer first for converted images); remote refs for a lazy pull. */
  layers: PulledLayer[];
  config: ImageRunConfig;
  /** The sandbox's disk: a converted image's size, or a native image's largest layer virtual size (whole MiB, rounded up). */
  diskSizeMB: number;
  overlaybdNative: boolean;
  /** Layers this pull converted (or took as native blobs), and layers it found in the cache. */
  converted: number;
  cached: number;
  /** A lazy pull's boot trace (a whole AETRACE1 file), when the manifest names one that could be read. */
  rootfsTrace?: Uint8Array;
}

export interface PullOptions {
  /** The registry a reference is pulled from (unused when the image is given as an ImageLocation). */
  registry?: RegistryClient;
  cache: LayerCache;
  blockd: BlockdClient;
  /** Virtual disk size of a converted image [20480 MiB]; the sandbox's disk. */
  diskSizeMB?: number;
  /** [linux/amd64] */
  platform?: string;
  onProgress?: (p: PullProgress) => void;
  /** Set: an overlaybd-native image is not downloaded, its layers stay at their origin (remote refs). */
  remote?: RemotePullOptions;
  /** What the pull leaves out and goes on without (a bad prefetch trace) [console.error]. */
  log?: (message: string) => void;
  /** A layer whose descriptor names more bytes is refused before any download [DEFAULT_MAX_BLOB_BYTES]. */
  maxBlobBytes?: number;
  /** A disk larger than this is refused [DEFAULT_MAX_DISK_SIZE_MB]. */
  maxDiskSizeMB?: number;
}

/** TooLarge when a disk of `bytes` is past the pull's maxDiskSizeMB. */
function checkDiskSize(bytes: number, opts: PullOptions, where: string): void {
  const max = opts.maxDiskSizeMB ?? DEFAULT_MAX_DISK_SIZE_MB;
  if (bytes > max * 2 ** 20) throw new RegistryError("TooLarge", `${where}: a disk of ${Math.ceil(bytes / 2 ** 20)} MiB, more than this node's max_disk_size_mb (${max} MiB)`);
}

/** Without `remote` every layer is a local file. */
export function pullImage(ref: string | ImageRef | ImageLocation, opts: PullOptions & { remote?: undefined }): Promise<PulledImage & { layers: string[] }>;
export function pullImage(ref: string | ImageRef | ImageLocation, opts: PullOptions): Promise<PulledImage>;
export async function pullImage(ref: string | ImageRef | ImageLocation, opts: PullOptions): Promise<PulledImage> {
  const started = performance.now();
  const diskBytes = opts.diskSizeMB !== undefined ? opts.diskSizeMB * 2 ** 20 : DEFAULT_DISK_BYTES;
  const p: PullProgress = { phase: "resolving", layersDone: 0, layersTotal: 0, layersCached: 0, bytesDownloaded: 0, bytesTotal: 0, bytesPerSecond: 0, bytesApplied: 0, elapsedMs: 0 };
  const say = () => {
    p.elapsedMs = Math.round(performance.now() - started);
    p.bytesPerSecond = p.elapsedMs > 0 ? Math.round((p.bytesDownloaded * 1000) / p.elapsedMs) : 0;
    try {
      opts.onProgress?.({ ...p });
    } catch {} // a progress callback's failure is the caller's
  };
  say();
  const from = locationOf(ref, opts.registry);
  const image: Pulled = { ...(await from.resolve(parsePlatform(opts.platform ?? "linux/amd64"))), from };
  const descs = image.layers;
  const maxBlob = opts.maxBlobBytes ?? DEFAULT_MAX_BLOB_BYTES;
  for (const d of descs) {
    if (d.size > maxBlob) throw new RegistryError("TooLarge", `image ${from.name}: layer ${d.digest} is ${d.size} bytes, more than this node's max_blob_mb (${maxBlob} bytes)`);
  }
  if (!image.overlaybdNative) checkDiskSize(diskBytes, opts, `image ${from.name}`);
  if (!image.overlaybdNative && image.config.diffIds.length !== descs.length) {
    throw new ConvertError("CorruptLayer", `image config lists ${image.config.diffIds.length} diff_ids for ${descs.length} layers`);
  }
  if (image.overlaybdNative && opts.remote) return remoteLayers(image, opts, opts.remote, p, say);
  const ctx: ConvertContext = { cache: opts.cache, blockd: opts.blockd };
  await initCache(ctx);
  await opts.cache.gc(); // room first: what this pull makes is the most recently used

  // The chain of every layer, known before anything is downloaded.
  const bottom = image.overlaybdNative ? undefined : await emptyExt4Layer(ctx, diskBytes);
  const chains: string[] = [];
  for (let i = 0; i < descs.length; i++) {
    const id = image.overlaybdNative ? descs[i]!.digest : image.config.diffIds[i]!;
    chains.push(i === 0 && !bottom ? id : chainId(i === 0 ? bottom!.chain : chains[i - 1]!, id));
  }
  // Every layer of this image is kept from GC while the pull runs.
  opts.cache.hold(chains);
  try {
    return await pullLayers(image, chains, bottom, diskBytes, ctx, opts, p, say);
  } finally {
    opts.cache.release(chains);
  }
}

/** A resolved image and where its blobs are. */
type Pulled = LocatedImage & { from: ImageLocation };

function locationOf(ref: string | ImageRef | ImageLocation, registry: RegistryClient | undefined): ImageLocation {
  if (typeof ref === "object" && "resolve" in ref) return ref;
  if (!registry) throw new RegistryError("BadReference", `${typeof ref === "string" ? ref : formatImageRef(ref)}: a registry reference needs a registry client`);
  return new RegistryLocation(registry, ref);
}

/** The pinned name a pulled image answers with. */
function pinnedName(image: Pulled): string {
  return `${image.from.name.replace(/@sha256:[0-9a-f]{64}$/, "")}@${image.manifestDigest}`;
}

async function pullLayers(image: Pulled, chains: string[], bottom: ConvertedLayer | undefined, diskBytes: number, ctx: ConvertContext, opts: PullOptions, p: PullProgress, say: () => void): Promise<PulledImage> {
  const descs = image.layers;
  const needed = await Promise.all(chains.map(async (c) => !(await Bun.file(opts.cache.layerPath(c)).exists())));
  p.phase = "layers";
  p.layersTotal = descs.length;
  p.layersCached = needed.filter((n) => !n).length;
  p.bytesTotal = descs.reduce((s, d, i) => s + (needed[i] ? d.size : 0), 0);
  say();

  const work = await opts.cache.workDir();
  const fetched = new Map<number, Promise<string>>();
  const fetchLayer = (i: number): Promise<string> => {
    let f = fetched.get(i);
    if (!f) {
      const d: Descriptor = descs[i]!;
      let last = 0;
      f = image.from.fetchBlob(d, join(work, `${i}.blob`), {
        onProgress: (bytes) => {
          p.bytesDownloaded += bytes - last;
          last = bytes;
          say();
        },
      }).then((b) => b.path);
      f.catch(() => {}); // awaited where it is used; a prefetch nobody reaches must not go unhandled
      fetched.set(i, f);
    }
    return f;
  };
  const stack: ConvertedLayer[] = bottom ? [bottom] : [];
  let converted = 0;
  /** A native image's disk: the largest virtual size of its layers. */
  let virtualBytes = 0;
  try {
    for (let i = 0; i < descs.length; i++) {
      const next = needed.indexOf(true, i + 1);
      const blob = async () => {
        if (next >= 0) void fetchLayer(next); // the next download runs while this layer converts
        return fetchLayer(i);
      };
      let layer: ConvertedLayer;
      if (image.overlaybdNative) {
        // A blob is cached only once it opens as an overlaybd layer (its digest alone says nothing of that).
        const r = await opts.cache.get(chains[i]!, async () => {
          const path = await blob();
          await nativeVirtualSize(path, descs[i]!.digest);
          return path;
        });
        layer = { chain: chains[i]!, path: r.path, converted: r.made };
        virtualBytes = Math.max(virtualBytes, await nativeVirtualSize(r.path, descs[i]!.digest));
        checkDiskSize(virtualBytes, opts, `image ${image.from.name}: layer ${descs[i]!.digest}`);
      } else {
        layer = await convertLayer(ctx, stack, { blob, diffId: image.config.diffIds[i]!, digest: descs[i]!.digest }, diskBytes, (lp) => {
          p.bytesApplied = lp.tarBytes;
          say();
        });
      }
      if (layer.converted) converted++;
      stack.push(layer);
      const file = fetched.get(i);
      if (file) await rm(await file.catch(() => ""), { force: true }).catch(() => {});
      p.layersDone = i + 1;
      p.bytesApplied = 0;
      say();
    }
  } finally {
    await rm(work, { recursive: true, force: true }).catch(() => {});
  }
  p.phase = "done";
  say();
  return {
    ref: pinnedName(image),
    manifestDigest: image.manifestDigest,
    layers: stack.map((l) => l.path),
    config: runConfig(image.config),
    diskSizeMB: Math.ceil((image.overlaybdNative ? virtualBytes : diskBytes) / 2 ** 20),
    overlaybdNative: image.overlaybdNative,
    converted,
    cached: descs.length - converted,
  };
}

/**
 * A lazy pull: each layer becomes a remote ref (its blob at the origin by range, the node's block cache)
 * and nothing is downloaded whole. Each blob's header and index are read here through the same
 * cache folder: it must open as an overlaybd layer (else CorruptLayer), and the chunks read are in
 * the cache for blockd's workers after. The disk is the layers' largest virtual size.
 */
async function remoteLayers(image: Pulled, opts: PullOptions, r: RemotePullOptions, p: PullProgress, say: () => void): Promise<PulledImage> {
  const descs = image.layers;
  p.phase = "layers";
  p.layersTotal = descs.length;
  say();
  const cache = await BlockCache.shared(r.cache);
  // The trace's round trips run beside the layers' header reads.
  const tracing = pulledTrace(image, opts).catch((e) => void console.error(`pull: prefetch trace: ${(e as Error).message}`));
  const layers: RemoteLayerRef[] = [];
  let virtualBytes = 0;
  for (const [i, d] of descs.entries()) {
    const digest = d.digest as LayerDigest;
    const { origin, source } = await image.from.blobOrigin(digest);
    let file: RemoteFile;
    try {
      file = RemoteFile.open({ digest, size: d.size, sources: [source], cache });
    } catch (e) {
      throw new ConvertError("CorruptLayer", `layer ${i}: ${(e as Error).message}`, undefined, d.digest);
    }
    virtualBytes = Math.max(virtualBytes, await remoteVirtualSize(file, d.digest));
    checkDiskSize(virtualBytes, opts, `image ${image.from.name}: layer ${d.digest}`);
    layers.push({ digest, size: d.size, remote: { sources: [origin], cache: { ...r.cache }, ...(r.download === false ? { download: false } : {}) } });
    p.layersDone = i + 1;
    say();
  }
  const rootfsTrace = await tracing;
  p.phase = "done";
  say();
  return {
    ref: pinnedName(image), manifestDigest: image.manifestDigest, layers, config: runConfig(image.config),
    diskSizeMB: Math.ceil(virtualBytes / 2 ** 20), overlaybdNative: true, converted: 0, cached: 0,
    ...(rootfsTrace ? { rootfsTrace } : {}),
  };
}

/** The boot trace the manifest names, or undefined: one that cannot be read or is no trace is logged, never a failed pull. */
async function pulledTrace(image: Pulled, opts: PullOptions): Promise<Uint8Array | undefined> {
  const log = (m: string) => {
    try {
      (opts.log ?? ((x: string) => console.error(`pull: ${x}`)))(m);
    } catch {} // the caller's
  };
  const desc = traceDescriptor(image.annotations, log);
  if (!desc) return undefined;
  const work = await opts.cache.workDir();
  try {
    return await fetchTrace(image.from, desc, work, log);
  } finally {
    await rm(work, { recursive: true, force: true }).catch(() => {});
  }
}

/** A remote blob's virtual size once it opens as an overlaybd layer; CorruptLayer when it does not, Unreachable when it cannot be read. */
async function remoteVirtualSize(file: RemoteFile, digest: string): Promise<number> {
  return virtualSizeOf(async () => {
    try {
      return await ReadOnlyLayer.open((await unwrap(file)).file);
    } catch (e) {
      await file.close();
      if (e instanceof RemoteReadError) throw new RegistryError("Unreachable", `layer ${digest}: ${e.message}`);
      throw e;
    }
  }, digest);
}

/** An overlaybd blob's virtual size, once it opens as a layer (tar or ZFile wrapped, or bare LSMT); else CorruptLayer. */
function nativeVirtualSize(path: string, digest: string): Promise<number> {
  return virtualSizeOf(() => openLayerFile(path), digest);
}

/** The virtual size of the layer `open` gives, which must be > 0; a layer that does not open is CorruptLayer (RegistryErrors pass). */
async function virtualSizeOf(open: () => Promise<{ virtualSize: number; close(): Promise<void> }>, digest: string): Promise<number> {
  let layer;
  try {
    layer = await open();
  } catch (e) {
    if (e instanceof RegistryError) throw e;
    throw new ConvertError("CorruptLayer", `the blob is not an overlaybd layer: ${(e as Error).message}`, undefined, digest);
  }
  try {
    if (!(layer.virtualSize > 0)) throw new ConvertError("CorruptLayer", "the overlaybd layer has a virtual size of 0", undefined, digest);
    return layer.virtualSize;
  } finally {
    await layer.close();
  }
}

function runConfig(c: OciImageConfig): ImageRunConfig {
  const env: Record<string, string> = {};
  for (const kv of c.Env) {
    const eq = kv.indexOf("=");
    if (eq > 0) env[kv.slice(0, eq)] = kv.slice(eq + 1);
  }
  return { env, workingDir: c.WorkingDir, user: c.User, entrypoint: c.Entrypoint ?? [], cmd: c.Cmd ?? [], exposedPorts: c.ExposedPorts, labels: c.Labels };
}
