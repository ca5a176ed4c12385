// The node's fromImage parents: images pulled and converted by src/template into one layer cache
// under $AENV_HOME/image-layers, of the configured capacity (AENV_LAYER_CACHE_MB), collected
// between its watermarks before each pull. A layer a template or snapshot references (its stack or
// its checkpoint's), or a sandbox runs or resumes from, is never collected.
import type { BlockdClient } from "../blockdev/client.ts";
import type { ImageSource } from "../orchestrator/builder.ts";
import type { SandboxRuntime } from "../orchestrator/orchestrator.ts";
import type { SandboxStore } from "../orchestrator/store.ts";
import type { TemplateStore } from "../orchestrator/templates.ts";
import { LayerCache } from "../template/layer_cache.ts";
import { pullImage, type PullProgress } from "../template/pull.ts";
import { parseImageRef, RegistryClient, type RegistryClientOptions } from "../template/registry.ts";

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
}

/** A progress line at most this often while a layer downloads or converts. */
const PROGRESS_EVERY_MS = 2000;

/** Layer paths that must stay: every template's and snapshot's, and every sandbox's. */
export function layersInUse(templates: TemplateStore, sandboxes?: SandboxStore): Set<string> {
  const used = templates.layersInUse();
  for (const r of sandboxes?.all() ?? []) {
    const rt = r.runtime as SandboxRuntime | null;
    for (const l of [...(rt?.layers ?? []), ...(rt?.paused?.layers ?? [])]) used.add(l);
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
      });
      const c = img.config;
      return {
        digest: img.manifestDigest, layers: img.layers, diskSizeMB: img.diskSizeMB, env: c.env, user: c.user, workdir: c.workingDir,
        entrypoint: c.entrypoint, cmd: c.cmd, exposedPorts: c.exposedPorts, labels: c.labels,
      };
    },
  };
  return { cache, source };
}
