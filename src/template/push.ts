// pushImage: a template's rootfs layers (sealed overlaybd layer files, base first) to a registry as
// an overlaybd image, laid out as accelerated-container-image pushes one and as pullImage reads
// one back without converting: one blob per layer (the OCI tar media type, annotations blob-digest
// = the blob's own digest, blob-size, blob-fs-type ext4), a config whose diff_ids are the blobs'
// digests and whose run config is the template's Env, WorkingDir, User (and Entrypoint, Cmd,
// ExposedPorts, Labels when it has them), and the manifest under the reference. A blob the
// repository has already (HEAD) is not sent again. A layer that is itself remote is sent from the
// block cache's promoted copy when there is one, else copied from its registry through a file.

import { rm } from "node:fs/promises";
import { existsSync } from "node:fs";
import { join } from "node:path";
import { RegistryError } from "./registry/errors.ts";
import { MEDIA, OVERLAYBD_ANNOTATION, type Descriptor } from "./registry/manifest.ts";
import { parseImageRef } from "./registry/reference.ts";
import type { RegistryClient } from "./registry/client.ts";
import type { PulledLayer, RemoteLayerRef } from "./pull.ts";

/** The image's run config (OCI config fields). */
export interface PushConfig {
  env: Record<string, string>;
  user: string;
  workdir: string;
  entrypoint?: string[];
  cmd?: string[];
  exposed?: string[];
  labels?: Record<string, string>;
}

export interface PushOptions {
  registry: RegistryClient;
  /** Where copies of remote layers are made (removed after). */
  workDir: string;
  onProgress?: (message: string) => void;
}

export interface PushedLayer {
  digest: string;
  size: number;
  /** false: the repository had the blob (HEAD), nothing was sent. */
  uploaded: boolean;
}

export interface PushedTemplate {
  ref: string;
  manifestDigest: string;
  configDigest: string;
  layers: PushedLayer[];
}

/** overlaybd stacks at most 255 lowers (8-bit tags). */
export const MAX_PUSH_LAYERS = 255;

/** sha256 and size of a file, read in a stream. */
async function digestOf(path: string): Promise<{ digest: string; size: number }> {
  const hasher = new Bun.CryptoHasher("sha256");
  let size = 0;
  for await (const chunk of Bun.file(path).stream()) {
    hasher.update(chunk);
    size += chunk.length;
  }
  return { digest: `sha256:${hasher.digest("hex")}`, size };
}

/** The repository a remote layer's http source reads from (`…/v2/<name>/blobs/<digest>`). */
function sourceOf(l: RemoteLayerRef): { ref: string; url: string } {
  for (const s of l.remote.sources) {
    if (s.kind !== "http") continue;
    const u = new URL(s.url);
    const m = /^\/v2\/(.+)\/blobs\/(sha256:[0-9a-f]{64})$/.exec(u.pathname);
    if (m && m[2] === l.digest) return { ref: `${u.host}/${m[1]}@${l.digest}`, url: s.url };
  }
  throw new RegistryError("NotFound", `remote layer ${l.digest} names no registry blob to copy from`);
}

export async function pushImage(refIn: string, layers: PulledLayer[], config: PushConfig, opts: PushOptions): Promise<PushedTemplate> {
  const ref = parseImageRef(refIn);
  if (layers.length === 0) throw new RegistryError("BadReference", `a template with no layers cannot be pushed to ${refIn}`);
  if (layers.length > MAX_PUSH_LAYERS) throw new RegistryError("TooLarge", `${layers.length} layers: an overlaybd image holds at most ${MAX_PUSH_LAYERS}`);
  const say = (m: string) => {
    try {
      opts.onProgress?.(m);
    } catch {} // the caller's
  };
  const pushed: PushedLayer[] = [];
  const descs: Descriptor[] = [];
  for (const [i, l] of layers.entries()) {
    let path: string | undefined;
    let known: { digest: string; size: number };
    let copy: string | undefined;
    if (typeof l === "string") {
      path = l;
      known = await digestOf(l);
    } else {
      known = { digest: l.digest, size: l.size };
      const promoted = join(l.remote.cache.dir, "layers", l.digest.slice(7));
      if (existsSync(promoted)) path = promoted;
    }
    const uploaded = !(await opts.registry.hasBlob(ref, known.digest, "pull,push"));
    try {
      if (uploaded) {
        if (!path) {
          // A remote layer the cache does not hold whole: copied from its registry, verified, then sent.
          const src = sourceOf(l as RemoteLayerRef);
          copy = join(opts.workDir, `layer-${i}.blob`);
          await opts.registry.fetchBlob(src.ref, { mediaType: MEDIA.ociLayerTar, ...known }, copy);
          path = copy;
        }
        await opts.registry.pushBlob(ref, path, { mediaType: MEDIA.ociLayerTar, known });
      }
    } finally {
      if (copy) await rm(copy, { force: true });
    }
    pushed.push({ ...known, uploaded });
    descs.push({
      mediaType: MEDIA.ociLayerTar, ...known,
      annotations: { [OVERLAYBD_ANNOTATION.blobDigest]: known.digest, [OVERLAYBD_ANNOTATION.blobSize]: String(known.size), [OVERLAYBD_ANNOTATION.fsType]: "ext4" },
    });
    say(`push layer ${i + 1}/${layers.length} ${known.digest} (${known.size} bytes): ${uploaded ? "uploaded" : "already there"}`);
  }
  const run: Record<string, unknown> = {
    Env: Object.entries(config.env).map(([k, v]) => `${k}=${v}`),
    WorkingDir: config.workdir,
    User: config.user,
  };
  if (config.entrypoint?.length) run.Entrypoint = config.entrypoint;
  if (config.cmd?.length) run.Cmd = config.cmd;
  if (config.exposed?.length) run.ExposedPorts = Object.fromEntries(config.exposed.map((p) => [p, {}]));
  if (config.labels && Object.keys(config.labels).length) run.Labels = config.labels;
  const imageConfig = {
    architecture: "amd64",
    os: "linux",
    config: run,
    rootfs: { type: "layers", diff_ids: descs.map((d) => d.digest) },
    history: descs.map(() => ({ created_by: "aenv push" })),
  };
  const cfg = await opts.registry.pushBlob(ref, new TextEncoder().encode(JSON.stringify(imageConfig)), { mediaType: MEDIA.ociConfig });
  const manifest = { schemaVersion: 2, mediaType: MEDIA.ociManifest, config: { mediaType: MEDIA.ociConfig, digest: cfg.digest, size: cfg.size }, layers: descs };
  const m = await opts.registry.pushManifest(ref, manifest, MEDIA.ociManifest);
  say(`push done: ${refIn} is ${m.digest}`);
  return { ref: refIn, manifestDigest: m.digest, configDigest: cfg.digest, layers: pushed };
}
