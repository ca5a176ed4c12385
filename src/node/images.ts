// The node's fromImage parents: images pulled and converted by src/template into one layer cache
// under $AENV_HOME/image-layers, of the configured capacity (AENV_LAYER_CACHE_MB), collected
// between its watermarks before each pull. A layer a template or snapshot references (its stack or
// its checkpoint's), or a sandbox runs or resumes from, is never collected. An overlaybd image is
// not downloaded: its layers stay in the registry as remote layers that blockd's workers read by
// Range through the node's block cache ($AENV_HOME/block-cache, AENV_BLOCK_CACHE_MB), with the
// registry's Authorization from a headers file the node keeps fresh (registry_auth.ts). Templates
// are pushed back as overlaybd images (src/template/push.ts).
import { mkdir, mkdtemp, rm } from "node:fs/promises";
import { join } from "node:path";
import type { BlockdClient } from "../blockdev/client.ts";
import type { ImageSource } from "../orchestrator/builder.ts";
import type { SandboxRuntime } from "../orchestrator/orchestrator.ts";
import type { SandboxStore } from "../orchestrator/store.ts";
import { layerKey, type RemoteLayer, type TemplateStore } from "../orchestrator/templates.ts";
import type { BlockCacheOptions } from "../storage/remote/block_cache.ts";
import { LayerCache } from "../template/layer_cache.ts";
import { pullImage, type PulledLayer, type PullProgress } from "../template/pull.ts";
import { pushImage } from "../template/push.ts";
import { parseImageRef, RegistryClient, type RegistryClientOptions } from "../template/registry.ts";
import type { RegistryAuthFiles } from "./registry_auth.ts";

/** Lazy pulls of overlaybd images: the node's block cache and the registry auth blockd reads. */
export interface NodeRemoteLayers {
  /** blockd's workers and this process share it (AENV_BLOCK_CACHE_DIR, AENV_BLOCK_CACHE_MB). */
  cache: BlockCacheOptions;
  /** Fetch whole layers in the background and promote them to local files (AENV_BLOCK_CACHE_DOWNLOAD). */
  download: boolean;
  auth: RegistryAuthFiles;
}

/**
 * A remote layer as this node hands it to blockd, at each use: its block cache and download
 * setting as configured now, and each registry source with the headers file the node keeps fresh
 * (so a record carries no node's paths that matter: a snapshot's layers imported from another node too).
 */
export async function remoteLayerView(l: RemoteLayer, r: NodeRemoteLayers): Promise<RemoteLayer> {
  const sources = await Promise.all(l.remote.sources.map(async (s) => {
    if (s.kind !== "http") return s;
    const headersFile = await r.auth.fileFor(s.url);
    return headersFile ? { ...s, headersFile } : s;
  }));
  return { ...l, remote: { ...l.remote, sources, cache: { ...r.cache }, download: r.download } };
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
  const source: ImageSource = {
    async pull(ref, auth, log) {
      const registry = new RegistryClient({ ...o.registry, ...(auth ? { credentials: { ...o.registry?.credentials, [parseImageRef(ref).registry]: auth } } : {}) });
      // A line per phase and per layer done, when the downloads complete, else every PROGRESS_EVERY_MS.
      let said = 0;
      let last: PullProgress | undefined;
      const img = await pullImage(ref, {
        registry, cache, blockd: o.blockd,
        onProgress: (p) => {
          const downloaded = p.bytesTotal > 0 && p.bytesDownloaded === p.bytesTotal && last?.bytesDownloaded !== p.bytesDownloaded;
          const step = !last || p.phase !== last.phase || p.layersDone !== last.layersDone || downloaded;
          last = p;
          if (!step && Date.now() - said < PROGRESS_EVERY_MS) return;
          said = Date.now();
          log(pullLine(p));
        },
        ...(o.remote ? { remote: { cache: o.remote.cache, download: o.remote.download } } : {}),
      });
      // blockd's reads of remote layers carry the credentials this pull was given.
      if (auth && img.layers.some((l) => typeof l !== "string")) o.remote?.auth.remember(ref, auth);
      const c = img.config;
      return {
        digest: img.manifestDigest, layers: img.layers, diskSizeMB: img.diskSizeMB, env: c.env, user: c.user, workdir: c.workingDir,
        entrypoint: c.entrypoint, cmd: c.cmd, exposedPorts: c.exposedPorts, labels: c.labels,
      };
    },
    async push(ref, image, auth) {
      const registry = new RegistryClient({ ...o.registry, ...(auth ? { credentials: { ...o.registry?.credentials, [parseImageRef(ref).registry]: auth } } : {}) });
      await mkdir(o.dir, { recursive: true });
      const work = await mkdtemp(join(o.dir, "push-"));
      try {
        return await pushImage(ref, image.layers as PulledLayer[], image.config, { registry, workDir: work });
      } finally {
        await rm(work, { recursive: true, force: true });
      }
    },
  };
  return { cache, source };
}
