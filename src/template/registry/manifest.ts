// Manifests, indexes, layer media types and image configs as the OCI image spec and Docker's
// schema 2 write them: parsing and checking what a registry sent, platform selection in an index,
// and telling converted-on-pull images from overlaybd-native ones.
import { RegistryError } from "./errors.ts";
import { SHA256_DIGEST } from "./reference.ts";

export const MEDIA = {
  ociIndex: "application/vnd.oci.image.index.v1+json",
  ociManifest: "application/vnd.oci.image.manifest.v1+json",
  dockerList: "application/vnd.docker.distribution.manifest.list.v2+json",
  dockerManifest: "application/vnd.docker.distribution.manifest.v2+json",
  ociConfig: "application/vnd.oci.image.config.v1+json",
  dockerConfig: "application/vnd.docker.container.image.v1+json",
  ociLayerTar: "application/vnd.oci.image.layer.v1.tar",
  ociLayerGzip: "application/vnd.oci.image.layer.v1.tar+gzip",
  ociLayerZstd: "application/vnd.oci.image.layer.v1.tar+zstd",
  dockerLayerTar: "application/vnd.docker.image.rootfs.diff.tar",
  dockerLayerGzip: "application/vnd.docker.image.rootfs.diff.tar.gzip",
  dockerLayerZstd: "application/vnd.docker.image.rootfs.diff.tar.zstd",
} as const;

/** What a manifest GET accepts, most preferred first. */
export const MANIFEST_ACCEPT = [MEDIA.ociIndex, MEDIA.ociManifest, MEDIA.dockerList, MEDIA.dockerManifest].join(", ");

export type LayerCompression = "none" | "gzip" | "zstd";

const LAYER_COMPRESSION: Record<string, LayerCompression> = {
  [MEDIA.ociLayerTar]: "none",
  [MEDIA.ociLayerGzip]: "gzip",
  [MEDIA.ociLayerZstd]: "zstd",
  [MEDIA.dockerLayerTar]: "none",
  [MEDIA.dockerLayerGzip]: "gzip",
  [MEDIA.dockerLayerZstd]: "zstd",
};

/** The compression of a tar layer's media type; undefined for anything that is not a plain tar layer. */
export function layerCompression(mediaType: string): LayerCompression | undefined {
  return LAYER_COMPRESSION[mediaType];
}

/** Annotations accelerated-container-image puts on the layers of an overlaybd image. */
export const OVERLAYBD_ANNOTATION = {
  blobDigest: "containerd.io/snapshot/overlaybd/blob-digest",
  blobSize: "containerd.io/snapshot/overlaybd/blob-size",
  fsType: "containerd.io/snapshot/overlaybd/blob-fs-type",
  version: "containerd.io/snapshot/overlaybd/version",
  turboPrefix: "containerd.io/snapshot/overlaybd/turbo-oci/",
} as const;
const TURBO_ARTIFACT_TYPE = "application/vnd.containerd.overlaybd.turbo.v1+json";

/** Bounds on what a registry may send: the distribution spec's 4 MiB manifest limit, and ours. */
export const MAX_MANIFEST_BYTES = 4 << 20;
export const MAX_CONFIG_BYTES = 8 << 20;
/** overlaybd stacks at most 255 lowers (8-bit tags), so an image with more layers cannot become a template. */
export const MAX_LAYERS = 255;
/** Indexes that point at indexes are followed this deep. */
export const MAX_INDEX_DEPTH = 4;
/** Entries of one index we look at. */
const MAX_INDEX_ENTRIES = 1024;

export interface Platform {
  os: string;
  architecture: string;
  variant?: string;
}

export interface Descriptor {
  mediaType: string;
  digest: string;
  size: number;
  annotations?: Record<string, string>;
  platform?: Platform;
  urls?: string[];
}

export type ParsedManifest =
  | { kind: "index"; mediaType: string; manifests: Descriptor[] }
  | { kind: "manifest"; mediaType: string; config: Descriptor; layers: Descriptor[]; artifactType?: string; annotations?: Record<string, string> };

/** `linux/amd64`, `linux/arm64/v8` → a Platform; BadReference for anything else. */
export function parsePlatform(p: string | Platform): Platform {
  if (typeof p !== "string") return p;
  const parts = p.split("/");
  if (parts.length < 2 || parts.length > 3 || parts.some((x) => !/^[a-z0-9_.-]+$/.test(x))) {
    throw new RegistryError("BadReference", `platform ${JSON.stringify(p)} is not os/architecture[/variant]`);
  }
  const out: Platform = { os: parts[0]!, architecture: parts[1]! };
  if (parts[2]) out.variant = parts[2];
  return out;
}

export function formatPlatform(p: Platform): string {
  return `${p.os}/${p.architecture}${p.variant ? `/${p.variant}` : ""}`;
}

/** The variant a platform means when it names none (containerd's defaults for arm). */
function normalVariant(p: Platform): string {
  if (p.variant) return p.variant;
  if (p.architecture === "arm64") return "v8";
  if (p.architecture === "arm") return "v7";
  return "";
}

/**
 * The index entry for `want`: same os and architecture; with a variant asked for, that variant
 * (arm64 without one is v8, arm is v7); with none asked for, an entry without a variant first.
 */
export function selectPlatform(entries: Descriptor[], want: Platform): Descriptor | undefined {
  const same = entries.filter((d) => d.platform && d.platform.os === want.os && d.platform.architecture === want.architecture);
  if (want.variant || want.architecture === "arm64" || want.architecture === "arm") {
    const v = normalVariant(want);
    return same.find((d) => normalVariant(d.platform!) === v);
  }
  return same.find((d) => !d.platform!.variant) ?? same[0];
}

function protocol(where: string, why: string): RegistryError {
  return new RegistryError("Protocol", `${where}: ${why}`);
}

function str(v: unknown): v is string {
  return typeof v === "string";
}

function stringMap(v: unknown, where: string): Record<string, string> | undefined {
  if (v === undefined || v === null) return undefined;
  if (typeof v !== "object" || Array.isArray(v)) throw protocol(where, "annotations are not an object");
  const out: Record<string, string> = {};
  for (const [k, x] of Object.entries(v as Record<string, unknown>)) {
    if (!str(x)) throw protocol(where, `annotation ${JSON.stringify(k)} is not a string`);
    out[k] = x;
  }
  return out;
}

/** A descriptor checked field by field: sha256 digests only, sizes as safe integers. */
export function parseDescriptor(v: unknown, where: string): Descriptor {
  if (!v || typeof v !== "object") throw protocol(where, "descriptor is not an object");
  const o = v as Record<string, unknown>;
  if (!str(o.mediaType) || !o.mediaType) throw protocol(where, "descriptor has no mediaType");
  if (!str(o.digest) || !SHA256_DIGEST.test(o.digest)) {
    throw protocol(where, `descriptor digest ${JSON.stringify(o.digest)} is not sha256:<64 hex> (other algorithms are not supported)`);
  }
  if (!Number.isSafeInteger(o.size) || (o.size as number) < 0) throw protocol(where, `descriptor ${o.digest} has no valid size`);
  const d: Descriptor = { mediaType: o.mediaType, digest: o.digest, size: o.size as number };
  const ann = stringMap(o.annotations, where);
  if (ann) d.annotations = ann;
  if (o.platform && typeof o.platform === "object") {
    const p = o.platform as Record<string, unknown>;
    if (str(p.os) && str(p.architecture)) {
      d.platform = { os: p.os, architecture: p.architecture };
      if (str(p.variant) && p.variant) d.platform.variant = p.variant;
    }
  }
  if (Array.isArray(o.urls)) d.urls = o.urls.filter(str);
  return d;
}

/**
 * A manifest body as an index or an image manifest. The media type is the response's
 * Content-Type, else the body's `mediaType`, else guessed from the shape (`manifests` vs `layers`).
 * Schema 1 and anything that is neither → UnsupportedMediaType.
 */
export function parseManifest(body: Uint8Array, contentType: string | null, where: string): ParsedManifest {
  let doc: Record<string, unknown>;
  try {
    doc = JSON.parse(new TextDecoder().decode(body));
  } catch {
    throw protocol(where, "manifest is not JSON");
  }
  if (!doc || typeof doc !== "object" || Array.isArray(doc)) throw protocol(where, "manifest is not a JSON object");
  const header = (contentType ?? "").split(";")[0]!.trim().toLowerCase();
  const known = [MEDIA.ociIndex, MEDIA.ociManifest, MEDIA.dockerList, MEDIA.dockerManifest] as string[];
  let mediaType = known.includes(header) ? header : str(doc.mediaType) && doc.mediaType ? doc.mediaType : "";
  if (!mediaType && doc.schemaVersion === 2) mediaType = Array.isArray(doc.manifests) ? MEDIA.ociIndex : Array.isArray(doc.layers) ? MEDIA.ociManifest : "";
  if (!mediaType && doc.schemaVersion === 1) mediaType = "application/vnd.docker.distribution.manifest.v1+json";
  if (mediaType === MEDIA.ociIndex || mediaType === MEDIA.dockerList) {
    if (!Array.isArray(doc.manifests)) throw protocol(where, "index has no manifests array");
    if (doc.manifests.length > MAX_INDEX_ENTRIES) throw new RegistryError("TooLarge", `${where}: index lists ${doc.manifests.length} manifests, more than ${MAX_INDEX_ENTRIES}`);
    return { kind: "index", mediaType, manifests: doc.manifests.map((m, i) => parseDescriptor(m, `${where} manifests[${i}]`)) };
  }
  if (mediaType === MEDIA.ociManifest || mediaType === MEDIA.dockerManifest) {
    if (!Array.isArray(doc.layers)) throw protocol(where, "manifest has no layers array");
    if (doc.layers.length > MAX_LAYERS) throw new RegistryError("TooLarge", `${where}: ${doc.layers.length} layers, more than ${MAX_LAYERS}`);
    const m: ParsedManifest = {
      kind: "manifest",
      mediaType,
      config: parseDescriptor(doc.config, `${where} config`),
      layers: doc.layers.map((l, i) => parseDescriptor(l, `${where} layers[${i}]`)),
    };
    if (str(doc.artifactType)) m.artifactType = doc.artifactType;
    const ann = stringMap(doc.annotations, where);
    if (ann) m.annotations = ann;
    return m;
  }
  throw new RegistryError("UnsupportedMediaType", `${where}: manifest media type ${JSON.stringify(mediaType || header || "(none)")} is not an OCI or Docker schema 2 manifest or index`);
}

/** The parts of an image's config a sandbox inherits. */
export interface OciImageConfig {
  os: string;
  architecture: string;
  variant?: string;
  Env: string[];
  WorkingDir: string;
  User: string;
  Entrypoint: string[] | null;
  Cmd: string[] | null;
  /** `"8080/tcp"` keys of the config's ExposedPorts. */
  ExposedPorts: string[];
  /** Keys of the config's Volumes. */
  Volumes: string[];
  Labels: Record<string, string>;
  /** `rootfs.diff_ids`: the digests of the uncompressed layers, in order. */
  diffIds: string[];
}

function stringList(v: unknown, where: string, field: string): string[] | null {
  if (v === undefined || v === null) return null;
  if (!Array.isArray(v) || !v.every(str)) throw protocol(where, `config.${field} is not a list of strings`);
  return v;
}

function keysOf(v: unknown): string[] {
  return v && typeof v === "object" && !Array.isArray(v) ? Object.keys(v) : [];
}

export function parseImageConfig(body: Uint8Array, where: string): OciImageConfig {
  let doc: Record<string, unknown>;
  try {
    doc = JSON.parse(new TextDecoder().decode(body));
  } catch {
    throw protocol(where, "image config is not JSON");
  }
  if (!doc || typeof doc !== "object" || Array.isArray(doc)) throw protocol(where, "image config is not a JSON object");
  const c = (doc.config && typeof doc.config === "object" ? doc.config : {}) as Record<string, unknown>;
  const labels: Record<string, string> = {};
  for (const [k, v] of Object.entries((c.Labels && typeof c.Labels === "object" ? c.Labels : {}) as Record<string, unknown>)) {
    if (str(v)) labels[k] = v;
  }
  const rootfs = (doc.rootfs && typeof doc.rootfs === "object" ? doc.rootfs : {}) as Record<string, unknown>;
  const out: OciImageConfig = {
    os: str(doc.os) ? doc.os : "",
    architecture: str(doc.architecture) ? doc.architecture : "",
    Env: stringList(c.Env, where, "Env") ?? [],
    WorkingDir: str(c.WorkingDir) ? c.WorkingDir : "",
    User: str(c.User) ? c.User : "",
    Entrypoint: stringList(c.Entrypoint, where, "Entrypoint"),
    Cmd: stringList(c.Cmd, where, "Cmd"),
    ExposedPorts: keysOf(c.ExposedPorts),
    Volumes: keysOf(c.Volumes),
    Labels: labels,
    diffIds: stringList(rootfs.diff_ids, where, "rootfs.diff_ids") ?? [],
  };
  if (str(doc.variant) && doc.variant) out.variant = doc.variant;
  return out;
}

/** True for media types of the overlaybd family (`…overlaybd…`, `…zfile…` at a component boundary). */
function isOverlaybdMediaType(t: string): boolean {
  return /[./+](overlaybd|zfile)/.test(t);
}

/**
 * Classify an image's layers: every layer a plain tar (tar, tar+gzip, tar+zstd) → converted on
 * pull (false); every layer an overlaybd blob → used as it is (true). An overlaybd blob is a layer
 * with an overlaybd media type, or a tar media type whose `blob-digest` annotation is the layer's
 * own digest. Turbo-OCI layers, tar-wrapped overlaybd blobs (`blob-digest` naming another blob),
 * a mix of both kinds, foreign or non-distributable layers and unknown types → UnsupportedMediaType.
 */
export function classifyLayers(m: Extract<ParsedManifest, { kind: "manifest" }>, where: string): boolean {
  const unsupported = (why: string) => new RegistryError("UnsupportedMediaType", `${where}: ${why}`);
  if (m.artifactType === TURBO_ARTIFACT_TYPE) throw unsupported(`turbo-OCI images (artifactType ${TURBO_ARTIFACT_TYPE}) are not supported`);
  let native = 0;
  m.layers.forEach((l, i) => {
    const ann = l.annotations ?? {};
    if (Object.keys(ann).some((k) => k.startsWith(OVERLAYBD_ANNOTATION.turboPrefix)) || (ann[OVERLAYBD_ANNOTATION.version] ?? "").includes("turbo")) {
      throw unsupported(`layer ${i} (${l.digest}) is a turbo-OCI layer, which is not supported`);
    }
    if (isOverlaybdMediaType(l.mediaType)) {
      native++;
      return;
    }
    if (layerCompression(l.mediaType) === undefined) {
      throw unsupported(`layer ${i} (${l.digest}) has media type ${l.mediaType}; supported: tar, tar+gzip, tar+zstd (OCI and Docker names)`);
    }
    const blob = ann[OVERLAYBD_ANNOTATION.blobDigest];
    if (blob === undefined) return;
    if (blob !== l.digest) throw unsupported(`layer ${i} (${l.digest}) wraps overlaybd blob ${blob} in a tar, which is not supported`);
    native++;
  });
  if (native > 0 && native < m.layers.length) {
    throw unsupported(`${native} of ${m.layers.length} layers are overlaybd blobs and the rest are tars; an image must be all one kind`);
  }
  return native > 0;
}
