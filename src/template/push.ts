// pushImage: a template's rootfs layers (sealed overlaybd layer files, base first) to a registry or
// an OCI image layout in S3 (any ImageLocation) as an overlaybd image, laid out as accelerated-container-image pushes one and as pullImage reads
// one back without converting: one blob per layer (the OCI tar media type, annotations blob-digest
// = the blob's own digest, blob-size, blob-fs-type ext4), a config whose diff_ids are the blobs'
// digests and whose run config is the template's Env, WorkingDir, User (and Entrypoint, Cmd,
// ExposedPorts, Labels when it has them), and the manifest under the reference (in S3: index.json,
// last). A blob the location has already (HEAD) is not sent again. A layer that is itself remote is
// sent from the block cache's promoted copy when there is one, else copied from its origin (a
// registry blob, an S3 object) through a verified file. A boot trace (`rootfsTrace`, prefetch_trace.ts)
// goes up as one more blob named by two manifest annotations; without one the manifest is as before.

import { rm } from "node:fs/promises";
import { existsSync } from "node:fs";
import { join } from "node:path";
import { type ImageLocation, RegistryLocation } from "./image_location.ts";
import { RegistryError } from "./registry/errors.ts";
import { MEDIA, OVERLAYBD_ANNOTATION, type Descriptor } from "./registry/manifest.ts";
import { blobRepository } from "./registry/reference.ts";
import type { RegistryClient } from "./registry/client.ts";
import { type S3Access, S3Layout } from "./s3_layout.ts";
import { inS3Scope } from "../storage/s3_url.ts";
import type { PulledLayer, RemoteLayerRef } from "./pull.ts";
import { PREFETCH_ROOTFS_ANNOTATION, PREFETCH_ROOTFS_SIZE_ANNOTATION, PREFETCH_TRACE_MEDIA, traceForPush } from "./prefetch_trace.ts";

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
  /** The registry a reference is pushed to, and that remote layers with registry origins are copied from. */
  registry?: RegistryClient;
  /** S3 settings remote layers with S3 origins are copied with (the layout's keys). */
  s3?: S3Access;
  /** Set: only S3 origins inside these buckets and prefixes (`bucket`, `bucket/prefix`) are copied with s3. */
  s3Buckets?: readonly string[];
  /** Where copies of remote layers are made (removed after). */
  workDir: string;
  onProgress?: (message: string) => void;
  /** The template's boot trace file: pushed with the image when it is there and a trace of at most 1 MiB. */
  rootfsTrace?: string;
}

export interface PushedLayer {
  digest: string;
  size: number;
  /** false: the location had the blob (HEAD), nothing was sent. */
  uploaded: boolean;
}

export interface PushedTemplate {
  ref: string;
  manifestDigest: string;
  configDigest: string;
  layers: PushedLayer[];
  /** The boot trace's blob, when the image carries one. */
  trace?: PushedLayer;
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

/**
 * Where a remote layer can be copied from: a registry blob (`…/v2/<name>/blobs/<digest>`, with
 * opts.registry) or an S3 layout's blob (`<prefix>/blobs/sha256/<hex>`, with opts.s3). Peers are
 * not asked (a push copies from an origin).
 */
function originOf(l: RemoteLayerRef, opts: PushOptions): ImageLocation {
  for (const s of l.remote.sources) {
    if (s.kind === "http" && !s.unix && opts.registry) {
      const blob = blobRepository(s.url);
      if (blob?.digest === l.digest) return new RegistryLocation(opts.registry, blob.ref);
    }
    const usable = s.kind === "s3" && opts.s3 && (!opts.s3Buckets || inS3Scope(opts.s3Buckets, s.bucket, s.key));
    const layout = s.kind === "s3" && usable ? S3Layout.ofBlob(s, l.digest, opts.s3!) : undefined;
    if (layout) return layout;
  }
  throw new RegistryError("NotFound", `remote layer ${l.digest} names no registry blob or S3 layout blob to copy from`);
}

export async function pushImage(to: string | ImageLocation, layers: PulledLayer[], config: PushConfig, opts: PushOptions): Promise<PushedTemplate> {
  const refIn = typeof to === "string" ? to : to.name;
  if (typeof to === "string" && !opts.registry) throw new RegistryError("BadReference", `${to}: a registry reference needs a registry client`);
  const dest = typeof to === "string" ? new RegistryLocation(opts.registry!, to) : to;
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
    const uploaded = !(await dest.hasBlob(known.digest, known.size));
    try {
      if (uploaded) {
        if (!path) {
          // A remote layer the cache does not hold whole: copied from its origin, verified, then sent.
          copy = join(opts.workDir, `layer-${i}.blob`);
          await originOf(l as RemoteLayerRef, opts).fetchBlob({ mediaType: MEDIA.ociLayerTar, ...known }, copy);
          path = copy;
        }
        await dest.putBlob(path, { mediaType: MEDIA.ociLayerTar, known });
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
  const cfg = await dest.putBlob(new TextEncoder().encode(JSON.stringify(imageConfig)), { mediaType: MEDIA.ociConfig });
  const manifest: Record<string, unknown> = { schemaVersion: 2, mediaType: MEDIA.ociManifest, config: { mediaType: MEDIA.ociConfig, digest: cfg.digest, size: cfg.size }, layers: descs };
  let trace: PushedLayer | undefined;
  const traceBytes = await traceForPush(opts.rootfsTrace, say);
  if (traceBytes) {
    const digest = `sha256:${new Bun.CryptoHasher("sha256").update(traceBytes).digest("hex")}`;
    const uploaded = !(await dest.hasBlob(digest, traceBytes.length));
    if (uploaded) await dest.putBlob(traceBytes, { mediaType: PREFETCH_TRACE_MEDIA, known: { digest, size: traceBytes.length } });
    trace = { digest, size: traceBytes.length, uploaded };
    manifest.annotations = { [PREFETCH_ROOTFS_ANNOTATION]: digest, [PREFETCH_ROOTFS_SIZE_ANNOTATION]: String(traceBytes.length) };
    say(`push prefetch trace ${digest} (${traceBytes.length} bytes): ${uploaded ? "uploaded" : "already there"}`);
  }
  const m = await dest.putManifest(manifest, MEDIA.ociManifest);
  say(`push done: ${refIn} is ${m.digest}`);
  return { ref: refIn, manifestDigest: m.digest, configDigest: cfg.digest, layers: pushed, ...(trace ? { trace } : {}) };
}
