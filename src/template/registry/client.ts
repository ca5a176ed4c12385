// The registry client: resolve an image reference to its platform's manifest, config and layers;
// fetch blobs to files; push blobs and manifests (tests, and later image publish).
import { stat } from "node:fs/promises";
import { type FetchBlobOptions, type FetchedBlob, fetchBlobToFile } from "./blob_fetch.ts";
import { RegistryError } from "./errors.ts";
import {
  classifyLayers,
  type Descriptor,
  formatPlatform,
  MANIFEST_ACCEPT,
  MAX_CONFIG_BYTES,
  MAX_INDEX_DEPTH,
  MAX_MANIFEST_BYTES,
  MEDIA,
  type OciImageConfig,
  parseImageConfig,
  parseManifest,
  parsePlatform,
  type Platform,
  selectPlatform,
} from "./manifest.ts";
import { formatImageRef, type ImageRef, manifestReference, parseImageRef, SHA256_DIGEST, withReference } from "./reference.ts";
import { type Answer, Retryable, Transport, type TransportOptions } from "./transport.ts";

export interface RegistryClientOptions extends TransportOptions {
  /** Blobs up to this size are pushed in one PUT; larger ones in PATCH chunks of this size [16 MiB]. */
  chunkSize?: number;
}

export const DEFAULT_CHUNK_SIZE = 16 << 20;

export interface ResolvedImage extends LocatedImage {
  /** The image pinned to its platform manifest's digest (the tag kept when one was given). */
  ref: ImageRef;
}

/** An image's platform manifest, config and layers, wherever it was read from (a registry, an OCI image layout). */
export interface LocatedImage {
  manifestDigest: string;
  mediaType: string;
  /** The index the manifest was chosen from, when the reference named one. */
  indexDigest?: string;
  platform: Platform;
  config: OciImageConfig;
  configDigest: string;
  layers: Descriptor[];
  /** Every layer is an overlaybd blob (used as it is); false: every layer is a tar to convert. */
  overlaybdNative: boolean;
  /** The platform manifest's annotations, when it has any. */
  annotations?: Record<string, string>;
}

export interface ManifestBytes {
  bytes: Uint8Array;
  mediaType: string | null;
  digest: string;
}

/** How resolveManifests reads what a manifest names: a manifest by its descriptor (digest checked), a config's bytes (bounded, digest checked). */
export interface ManifestReader {
  manifest(d: Descriptor): Promise<ManifestBytes>;
  config(d: Descriptor): Promise<Uint8Array>;
}

/**
 * The image for a platform from its first manifest: an index is followed to the platform's
 * manifest (at most MAX_INDEX_DEPTH indexes deep), the config is read and checked, the layers
 * classified. `where` names the image in errors.
 */
export async function resolveManifests(first: ManifestBytes, read: ManifestReader, platform: Platform, where: string): Promise<LocatedImage> {
  let m = first;
  let indexDigest: string | undefined;
  for (let depth = 0; ; depth++) {
    const parsed = parseManifest(m.bytes, m.mediaType, where);
    if (parsed.kind === "index") {
      if (depth >= MAX_INDEX_DEPTH) throw new RegistryError("Protocol", `${where}: indexes nested deeper than ${MAX_INDEX_DEPTH}`);
      const pick = selectPlatform(parsed.manifests, platform);
      if (!pick) {
        const offered = parsed.manifests.filter((d) => d.platform).map((d) => formatPlatform(d.platform!));
        throw new RegistryError("NotFound", `${where}: no ${formatPlatform(platform)} image in its index (it has ${offered.join(", ") || "no platforms"})`);
      }
      indexDigest ??= m.digest;
      m = await read.manifest(pick);
      continue;
    }
    const cfgType = parsed.config.mediaType;
    if (cfgType !== MEDIA.ociConfig && cfgType !== MEDIA.dockerConfig) {
      throw new RegistryError("UnsupportedMediaType", `${where}: config media type ${cfgType} is not an image config (an artifact, not a container image)`);
    }
    const overlaybdNative = classifyLayers(parsed, where);
    const config = parseImageConfig(await read.config(parsed.config), `${where} config ${parsed.config.digest}`);
    if (config.architecture && config.os && (config.os !== platform.os || config.architecture !== platform.architecture)) {
      throw new RegistryError("NotFound", `${where}: is ${config.os}/${config.architecture}, not ${formatPlatform(platform)}`);
    }
    const out: LocatedImage = { manifestDigest: m.digest, mediaType: parsed.mediaType, platform, config, configDigest: parsed.config.digest, layers: parsed.layers, overlaybdNative };
    if (indexDigest) out.indexDigest = indexDigest;
    if (parsed.annotations) out.annotations = parsed.annotations;
    return out;
  }
}

const sha256Hex = (b: Uint8Array | string) => new Bun.CryptoHasher("sha256").update(b).digest("hex");

function asRef(ref: ImageRef | string): ImageRef {
  return typeof ref === "string" ? parseImageRef(ref) : ref;
}

export class RegistryClient {
  private readonly t: Transport;
  private readonly chunkSize: number;

  constructor(opts: RegistryClientOptions = {}) {
    this.t = new Transport(opts);
    this.chunkSize = Math.max(1, opts.chunkSize ?? DEFAULT_CHUNK_SIZE);
  }

  /** One manifest's bytes as served; its sha256 checked against the digest asked for, or the registry's header. */
  async getManifest(refIn: ImageRef | string): Promise<ManifestBytes> {
    const ref = asRef(refIn);
    const reference = manifestReference(ref);
    const what = `manifest ${reference} of ${formatImageRef(ref)}`;
    const a = await this.t.send({
      ref,
      method: "GET",
      path: `manifests/${reference}`,
      headers: { accept: MANIFEST_ACCEPT },
      actions: "pull",
      what,
      expect: [200],
      readBody: MAX_MANIFEST_BYTES,
    });
    const bytes = a.body!;
    const digest = `sha256:${sha256Hex(bytes)}`;
    const pinned = SHA256_DIGEST.test(reference) ? reference : undefined;
    const header = a.res.headers.get("docker-content-digest");
    const expected = pinned ?? (header && SHA256_DIGEST.test(header) ? header : undefined);
    if (expected && expected !== digest) {
      throw new RegistryError("DigestMismatch", `${what}: registry ${ref.endpoint} sent a manifest whose digest is ${digest}, not ${expected}`);
    }
    return { bytes, mediaType: a.res.headers.get("content-type"), digest };
  }

  /**
   * The image for a platform [linux/amd64]: an index is followed to the platform's manifest (at
   * most MAX_INDEX_DEPTH indexes deep), the config is fetched and checked, the layers classified.
   */
  async resolve(refIn: ImageRef | string, opts: { platform?: string | Platform } = {}): Promise<ResolvedImage> {
    const ref = asRef(refIn);
    const platform = parsePlatform(opts.platform ?? "linux/amd64");
    const first = await this.getManifest(ref);
    const img = await resolveManifests(first, {
      manifest: (d) => this.getManifest(withReference(ref, d.digest)),
      config: (d) => this.readBlob(ref, d, MAX_CONFIG_BYTES),
    }, platform, `image ${formatImageRef(ref)}`);
    return { ref: { ...ref, digest: img.manifestDigest }, ...img };
  }

  /** A small blob's bytes (a config), at most maxBytes, digest checked. */
  async readBlob(refIn: ImageRef | string, desc: Descriptor, maxBytes = MAX_CONFIG_BYTES): Promise<Uint8Array> {
    const ref = asRef(refIn);
    const what = `blob ${desc.digest} of ${formatImageRef(ref)}`;
    if (desc.size > maxBytes) throw new RegistryError("TooLarge", `${what}: ${desc.size} bytes, more than ${maxBytes}`);
    const a = await this.t.send({ ref, method: "GET", path: `blobs/${desc.digest}`, actions: "pull", what, expect: [200], readBody: maxBytes });
    const got = `sha256:${sha256Hex(a.body!)}`;
    if (got !== desc.digest || a.body!.length !== desc.size) {
      throw new RegistryError("DigestMismatch", `${what}: registry ${ref.endpoint} sent ${a.body!.length} bytes whose digest is ${got}`);
    }
    return a.body!;
  }

  /** A blob to destPath, verified (see blob_fetch.ts for the partial file, resume and races). */
  fetchBlob(refIn: ImageRef | string, desc: Descriptor, destPath: string, opts: FetchBlobOptions = {}): Promise<FetchedBlob> {
    return fetchBlobToFile(this.t, asRef(refIn), desc, destPath, opts);
  }

  /** The URL a blob is read from (by HTTP Range, outside this client). */
  blobUrl(refIn: ImageRef | string, digest: string): string {
    return `${this.t.baseUrl(asRef(refIn))}blobs/${digest}`;
  }

  /**
   * The Authorization header a read of the repository's blobs needs now (undefined: anonymous)
   * and, for a Bearer token, when it expires; `fresh` fetches a new token. `digest` names a blob
   * to probe the registry's challenge with when this client has none yet.
   */
  pullAuthorization(refIn: ImageRef | string, digest: string, o: { fresh?: boolean } = {}): Promise<{ value?: string; expiresAt?: number }> {
    return this.t.pullAuthorization(asRef(refIn), `blobs/${digest}`, o);
  }

  /** Whether the repository holds a blob (HEAD). */
  async hasBlob(refIn: ImageRef | string, digest: string, actions: "pull" | "pull,push" = "pull"): Promise<boolean> {
    const ref = asRef(refIn);
    const a = await this.t.send({ ref, method: "HEAD", path: `blobs/${digest}`, actions, what: `blob ${digest} of ${formatImageRef(ref)}`, expect: [200, 404] });
    await a.res.body?.cancel().catch(() => {});
    return a.res.status === 200;
  }

  /**
   * Upload a blob (a file path or bytes) unless the repository has it already. Up to chunkSize it
   * goes in one PUT, larger in PATCH chunks; a failed upload starts a fresh session on the next try.
   */
  async pushBlob(refIn: ImageRef | string, source: string | Uint8Array, opts: { mediaType?: string; known?: { digest: string; size: number } } = {}): Promise<Descriptor> {
    const ref = asRef(refIn);
    let size: number;
    let digest: string;
    if (opts.known) {
      // The caller hashed it already (the registry checks the digest on the upload's last PUT).
      ({ size, digest } = opts.known);
    } else {
      const hasher = new Bun.CryptoHasher("sha256");
      if (typeof source === "string") {
        size = (await stat(source)).size;
        for await (const chunk of Bun.file(source).stream()) hasher.update(chunk);
      } else {
        size = source.length;
        hasher.update(source);
      }
      digest = `sha256:${hasher.digest("hex")}`;
    }
    const desc: Descriptor = { mediaType: opts.mediaType ?? "application/octet-stream", digest, size };
    if (await this.hasBlob(ref, digest, "pull,push")) return desc;
    const slice = (start: number, end: number): Bun.BodyInit => (typeof source === "string" ? Bun.file(source).slice(start, end) : source.subarray(start, end));
    const what = `upload of blob ${digest} to ${formatImageRef(ref)}`;
    for (let n = 1; ; n++) {
      try {
        await this.uploadOnce(ref, digest, size, slice, what);
        return desc;
      } catch (e) {
        if (!(e instanceof Retryable)) throw e;
        if (n >= this.t.tries) throw e.error;
        await new Promise((r) => setTimeout(r, this.t.backoffMs(n, e.retryAfterMs)));
      }
    }
  }

  private async uploadOnce(ref: ImageRef, digest: string, size: number, slice: (s: number, e: number) => Bun.BodyInit, what: string): Promise<void> {
    const next = async (a: Answer): Promise<string> => {
      const loc = a.res.headers.get("location");
      if (!loc) throw new RegistryError("Protocol", `${what}: registry ${ref.endpoint} answered ${a.res.status} without a Location`);
      const u = new URL(loc, a.url);
      if (u.origin !== new URL(a.url).origin) await this.t.checkDestination(u, `${what}: upload Location`);
      return u.href;
    };
    const started = await this.t.attempt({ ref, method: "POST", path: "blobs/uploads/", actions: "pull,push", what, expect: [202], body: () => undefined });
    let location = await next(started);
    if (size > this.chunkSize) {
      for (let start = 0; start < size; start += this.chunkSize) {
        const end = Math.min(size, start + this.chunkSize);
        const a = await this.t.attempt({
          ref,
          method: "PATCH",
          url: location,
          headers: { "content-type": "application/octet-stream", "content-range": `${start}-${end - 1}`, "content-length": String(end - start) },
          body: () => slice(start, end),
          actions: "pull,push",
          what,
          expect: [202],
        });
        location = await next(a);
      }
    }
    const put = new URL(location);
    put.searchParams.set("digest", digest);
    const whole = size <= this.chunkSize;
    const done = await this.t.attempt({
      ref,
      method: "PUT",
      url: put.href,
      headers: whole ? { "content-type": "application/octet-stream", "content-length": String(size) } : { "content-length": "0" },
      body: () => (whole ? slice(0, size) : undefined),
      actions: "pull,push",
      what,
      expect: [201],
    });
    const header = done.res.headers.get("docker-content-digest");
    await done.res.body?.cancel().catch(() => {});
    if (header && header !== digest) throw new RegistryError("DigestMismatch", `${what}: registry ${ref.endpoint} stored it as ${header}`);
  }

  /** Put a manifest under ref's tag (or digest); returns its descriptor. */
  async pushManifest(refIn: ImageRef | string, manifest: object | string | Uint8Array, mediaType: string): Promise<Descriptor> {
    const ref = asRef(refIn);
    const bytes = manifest instanceof Uint8Array ? manifest : new TextEncoder().encode(typeof manifest === "string" ? manifest : JSON.stringify(manifest));
    const digest = `sha256:${sha256Hex(bytes)}`;
    const reference = manifestReference(ref);
    const what = `manifest ${reference} of ${formatImageRef(ref)}`;
    if (SHA256_DIGEST.test(reference) && reference !== digest) throw new RegistryError("DigestMismatch", `${what}: the manifest's digest is ${digest}`);
    const a = await this.t.send({
      ref,
      method: "PUT",
      path: `manifests/${reference}`,
      headers: { "content-type": mediaType },
      body: () => bytes,
      actions: "pull,push",
      what,
      expect: [201],
    });
    await a.res.body?.cancel().catch(() => {});
    const header = a.res.headers.get("docker-content-digest");
    if (header && header !== digest) throw new RegistryError("DigestMismatch", `${what}: registry ${ref.endpoint} stored it as ${header}`);
    return { mediaType, digest, size: bytes.length };
  }
}

