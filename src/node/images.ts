// The node's fromImage parents: images pulled and converted by src/template into one layer cache
// under $AENV_HOME/image-layers, of the configured capacity (AENV_LAYER_CACHE_MB), collected
// between its watermarks before each pull. A layer a template or snapshot references (its stack or
// its checkpoint's), or a sandbox runs or resumes from, is never collected. An overlaybd image is
// not downloaded: its layers stay in the registry as remote layers that blockd's workers read by
// Range through the node's block cache ($AENV_HOME/block-cache, AENV_BLOCK_CACHE_MB), with the
// registry's Authorization from a headers file the node keeps fresh (registry_auth.ts). An
// `s3://bucket/prefix` image is an OCI image layout in S3 (src/template/s3_layout.ts), read and
// written with the node's S3 settings only, and only inside the buckets and prefixes of s3_buckets
// (403 elsewhere); an S3 origin outside them gets no credentials. Templates are pushed back as
// overlaybd images (src/template/push.ts), to a registry or to S3. Pulls refuse a layer above
// max_blob_mb and a disk above max_disk_size_mb.
import type { OriginSpec } from "../storage/remote/spec.ts";
import { mkdir, mkdtemp, rm } from "node:fs/promises";
import { join } from "node:path";
import type { BlockdClient } from "../blockdev/client.ts";
import type { ImageSource } from "../orchestrator/builder.ts";
import type { SandboxRuntime } from "../orchestrator/orchestrator.ts";
import type { SandboxStore } from "../orchestrator/store.ts";
import { layerKey, type RemoteLayer, type TemplateStore } from "../orchestrator/templates.ts";
import type { BlockCacheOptions } from "../storage/remote/block_cache.ts";
import { type ImageLocation, isS3Location, RegistryLocation } from "../template/image_location.ts";
import { LayerCache } from "../template/layer_cache.ts";
import { pullImage, type PulledLayer, type PullProgress } from "../template/pull.ts";
import { pushImage } from "../template/push.ts";
import { parseImageRef, RegistryClient, type RegistryClientOptions, RegistryError } from "../template/registry.ts";
import { parseS3Location, type S3Access, S3Layout } from "../template/s3_layout.ts";
import { inS3Scope } from "../storage/s3_url.ts";
import type { NodePeers } from "./peers.ts";
import type { RegistryAuthFiles } from "./registry_auth.ts";

/** Lazy pulls of overlaybd images: the node's block cache and the registry auth blockd reads. */
export interface NodeRemoteLayers {
  /** blockd's workers and this process share it (AENV_BLOCK_CACHE_DIR, AENV_BLOCK_CACHE_MB). */
  cache: BlockCacheOptions;
  /** Fetch whole layers in the background and promote them to local files (AENV_BLOCK_CACHE_DOWNLOAD). */
  download: boolean;
  auth: RegistryAuthFiles;
  /** Set: the node's peers, asked before each remote layer's origins (src/node/peers.ts). */
  peers?: NodePeers;
  /** In a cluster: a headers file with the cluster's API key, for reading layers from the other nodes directly. */
  clusterHeadersFile?: string;
  /** The node's S3 settings: an S3 origin's credentials, added at each use (never in a record). */
  s3?: S3Access;
  /** Buckets and prefixes (s3_buckets) whose S3 origins get the credentials [none]. */
  s3Buckets?: readonly string[];
}

/**
 * A remote layer as this node hands it to blockd, at each use: its block cache and download
 * setting as configured now, each registry source with the headers file the node keeps fresh, and
 * each S3 source with the node's S3 credentials (so a record carries no node's paths that matter,
 * and no secrets: a snapshot's layers imported from another node too).
 */
export async function remoteLayerView(l: RemoteLayer, r: NodeRemoteLayers): Promise<RemoteLayer> {
  // Peers first: the node puts its peer facade (an http source over a unix socket) ahead of the
  // origins at each use; records name origins only (views go to blockd, never into a record).
  const origins = await Promise.all(l.remote.sources.map(async (s) => {
    if (s.kind === "s3") return inS3Scope(r.s3Buckets ?? [], s.bucket, s.key) ? { ...s, ...s3Credentials(r.s3) } : s;
    const headersFile = await r.auth.fileFor(s.url);
    return headersFile ? { ...s, headersFile } : s;
  }));
  // In a cluster, the nodes that hold the layer come first (read directly, one hop), then the facade.
  const holders = r.peers && r.clusterHeadersFile ? await r.peers.clusterHolders(l.digest as `sha256:${string}`).catch(() => []) : [];
  const direct: OriginSpec[] = holders.map((url) => ({ kind: "http", url, headersFile: r.clusterHeadersFile }));
  const first = r.peers ? [...direct, r.peers.originFor(l.digest)] : [];
  return { ...l, remote: { ...l.remote, sources: [...first, ...origins], cache: { ...r.cache }, download: r.download } };
}

/** The node's S3 keys as an S3 source takes them (none when unset). */
function s3Credentials(a: S3Access | undefined): { accessKeyId?: string; secretAccessKey?: string; sessionToken?: string } {
  if (!a?.accessKeyId || !a.secretAccessKey) return {};
  return { accessKeyId: a.accessKeyId, secretAccessKey: a.secretAccessKey, ...(a.sessionToken ? { sessionToken: a.sessionToken } : {}) };
}

export interface NodeImagesOptions {
  /** The cache's folder ($AENV_HOME/image-layers). */
  dir: string;
  /** The cache's capacity in MiB (AENV_LAYER_CACHE_MB). */
  capacityMB: number;
  templates: TemplateStore;
  /** Sandboxes whose runtime layers (running, or paused to resume) stay. */
  sandboxes?: SandboxStore;
  blockd: BlockdClient;
  /** Registry client settings every pull starts from (a build's credentials are added). */
  registry?: RegistryClientOptions;
  /** Set: overlaybd images are pulled lazily (their layers stay remote). */
  remote?: NodeRemoteLayers;
  /** The node's S3 settings, for `s3://` images (a request may not bring other credentials). */
  s3?: S3Access;
  /** Buckets and prefixes (`bucket` or `bucket/prefix`, s3_buckets) an `s3://` image may be in; elsewhere 403 [none]. */
  s3Buckets?: readonly string[];
  /** A pulled layer above this is refused (max_blob_mb) [DEFAULT_MAX_BLOB_BYTES]. */
  maxBlobBytes?: number;
  /** A pulled image's disk above this is refused (max_disk_size_mb) [DEFAULT_MAX_DISK_SIZE_MB]. */
  maxDiskSizeMB?: number;
}

/** A progress line at most this often while a layer downloads or converts. */
const PROGRESS_EVERY_MS = 2000;

/** Layer paths that must stay: every template's and snapshot's, and every sandbox's. */
export function layersInUse(templates: TemplateStore, sandboxes?: SandboxStore): Set<string> {
  const used = templates.layersInUse();
  for (const r of sandboxes?.all() ?? []) {
    const rt = r.runtime as SandboxRuntime | null;
    for (const l of [...(rt?.layers ?? []), ...(rt?.paused?.layers ?? [])]) used.add(layerKey(l));
  }
  return used;
}

/** The build log's line for a pull's progress (`aenv pull` draws its bar from it). */
export function pullLine(p: PullProgress): string {
  const mib = (b: number) => (b / 2 ** 20).toFixed(1);
  return `pull ${p.phase}: ${p.layersDone}/${p.layersTotal} layers (${p.layersCached} cached), ${mib(p.bytesDownloaded)}/${mib(p.bytesTotal)} MiB, ${mib(p.bytesPerSecond)} MiB/s`;
}

export function nodeImages(o: NodeImagesOptions): { cache: LayerCache; source: ImageSource } {
  const cache = new LayerCache(o.dir, { capacityBytes: o.capacityMB * 2 ** 20, pinned: () => layersInUse(o.templates, o.sandboxes) });
  const registryFor = (ref: string, auth: { username: string; password: string } | undefined) =>
    new RegistryClient({ ...o.registry, ...(auth ? { credentials: { ...o.registry?.credentials, [parseImageRef(ref).registry]: auth } } : {}) });
  /** An `s3://` layout with the node's S3 settings, else the registry repository. */
  const locationOf = (ref: string, auth: { username: string; password: string } | undefined): ImageLocation => {
    if (!isS3Location(ref)) return new RegistryLocation(registryFor(ref, auth), ref);
    if (auth) throw new RegistryError("BadReference", `${ref}: an S3 image is read and written with the node's S3 settings; a request may not carry credentials for it`);
    const at = parseS3Location(ref);
    if (!inS3Scope(o.s3Buckets ?? [], at.bucket, at.prefix)) {
      throw new RegistryError("Forbidden", `${ref}: s3://${at.bucket}/${at.prefix} is not among the buckets and prefixes this node's S3 credentials may be used on (s3_buckets, AENV_S3_BUCKETS)`);
    }
    return S3Layout.open(ref, o.s3);
  };
  const source: ImageSource = {
    async pull(ref, auth, log) {
      const from = locationOf(ref, auth);
      // A line per phase and per layer done, when the downloads complete, else every PROGRESS_EVERY_MS.
      let said = 0;
      let last: PullProgress | undefined;
      const img = await pullImage(from, {
        cache, blockd: o.blockd, maxBlobBytes: o.maxBlobBytes, maxDiskSizeMB: o.maxDiskSizeMB,
        onProgress: (p) => {
          const downloaded = p.bytesTotal > 0 && p.bytesDownloaded === p.bytesTotal && last?.bytesDownloaded !== p.bytesDownloaded;
          const step = !last || p.phase !== last.phase || p.layersDone !== last.layersDone || downloaded;
          last = p;
          if (!step && Date.now() - said < PROGRESS_EVERY_MS) return;
          said = Date.now();
          log(pullLine(p));
        },
        ...(o.remote ? { remote: { cache: o.remote.cache, download: o.remote.download } } : {}),
        log,
      });
      // blockd's reads of remote layers carry the credentials this pull was given.
      if (auth && !isS3Location(ref) && img.layers.some((l) => typeof l !== "string")) o.remote?.auth.remember(ref, auth);
      const c = img.config;
      return {
        digest: img.manifestDigest, layers: img.layers, diskSizeMB: img.diskSizeMB, env: c.env, user: c.user, workdir: c.workingDir,
        entrypoint: c.entrypoint, cmd: c.cmd, exposedPorts: c.exposedPorts, labels: c.labels,
        ...(img.rootfsTrace ? { rootfsTrace: img.rootfsTrace } : {}),
      };
    },
    async push(ref, image, auth) {
      const to = locationOf(ref, auth);
      await mkdir(o.dir, { recursive: true });
      const work = await mkdtemp(join(o.dir, "push-"));
      try {
        // Remote layers are copied from their origins: registries with the node's Docker config, S3 with its settings.
        const registry = to instanceof RegistryLocation ? to.client : registryFor(ref, undefined);
        const pushed = await pushImage(to, image.layers as PulledLayer[], image.config, { registry, s3: o.s3, s3Buckets: o.s3Buckets ?? [], workDir: work, ...(image.rootfsTrace ? { rootfsTrace: image.rootfsTrace } : {}) });
        // Its local layer files hashed to these digests: peers may fetch them from this node.
        o.remote?.peers?.addPushed(pushed.layers.flatMap((l, i) => {
          const path = image.layers[i];
          return typeof path === "string" ? [{ digest: l.digest, path, size: l.size }] : [];
        }));
        return pushed;
      } finally {
        await rm(work, { recursive: true, force: true });
      }
    },
  };
  return { cache, source };
}
