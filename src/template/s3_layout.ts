// An image in S3 as an OCI image layout (the OCI image-layout spec) under `s3://bucket/prefix`:
//
//   <prefix>/oci-layout              {"imageLayoutVersion":"1.0.0"}
//   <prefix>/index.json              an OCI index naming one manifest (ref.name annotation = the tag, if any)
//   <prefix>/blobs/sha256/<hex>      the manifest, the config and each layer, as a registry holds them
//
// through Bun's S3Client with the node's S3 settings. A push writes blobs first (a blob there with
// its size is skipped), index.json last: a reader never sees an index naming missing blobs. A
// layout holds one image; a push replaces its index. Lazily pulled layers are S3 origins
// (`{kind: "s3", bucket, key, endpoint, region}`) that carry no credentials: the node adds its own
// at each use.
import { S3Client } from "bun";
import { open, rename, rm } from "node:fs/promises";
import { S3RangeSource } from "../storage/remote/s3_source.ts";
import type { ChunkSource, LayerDigest } from "../storage/remote/source.ts";
import type { OriginSpec } from "../storage/remote/spec.ts";
import { S3UrlError, parseS3Url } from "../storage/s3_url.ts";
import type { ImageLocation } from "./image_location.ts";
import type { FetchBlobOptions, FetchedBlob } from "./registry/blob_fetch.ts";
import { type LocatedImage, type ManifestBytes, resolveManifests } from "./registry/client.ts";
import { RegistryError } from "./registry/errors.ts";
import { type Descriptor, formatPlatform, MAX_CONFIG_BYTES, MAX_MANIFEST_BYTES, MEDIA, parseManifest, type Platform, selectPlatform } from "./registry/manifest.ts";
import { SHA256_DIGEST } from "./registry/reference.ts";

/** The node's S3 settings (AENV_S3_ENDPOINT, AWS_REGION, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN); "" counts as unset. */
export interface S3Access {
  /** http(s)://host[:port]; unset: AWS itself, in the region. */
  endpoint?: string;
  /** [us-east-1] */
  region?: string;
  accessKeyId?: string;
  secretAccessKey?: string;
  sessionToken?: string;
}

export interface S3LayoutRef {
  bucket: string;
  /** Key prefix without a trailing `/`; "" is the bucket's root. */
  prefix: string;
  tag?: string;
}

export const OCI_LAYOUT_FILE = "oci-layout";
export const OCI_LAYOUT_VERSION = "1.0.0";
export const REF_NAME_ANNOTATION = "org.opencontainers.image.ref.name";

/** A registry's tag grammar. */
const TAG_RE = /^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$/;
/** A location is at most this long (the API's bound on a reference). */
const MAX_LOCATION = 1024;

/** Each S3 request waits this long for its answer (a blob download: for each piece of its body). */
const REQUEST_TIMEOUT_MS = 30_000;
/** Reads are tried this often on a dropped connection, a timeout or a 5xx, 100 ms · 2ⁿ apart. */
const READ_TRIES = 3;
const BACKOFF_MS = 100;
/** Files go up in parts of this size, one in flight, each part tried 3 times by Bun's writer. */
const PART_BYTES = 8 << 20;
/** The oci-layout file is a few bytes; more is not a layout. */
const MAX_LAYOUT_FILE = 4 << 10;

/** `s3://bucket/prefix[:tag]` → its parts; BadReference for anything else. */
export function parseS3Location(s: string): S3LayoutRef {
  const bad = (why: string) => new RegistryError("BadReference", `${JSON.stringify(s.slice(0, 200))} is not an S3 image location (s3://bucket/prefix[:tag]): ${why}`);
  if (s.length > MAX_LOCATION) throw bad(`longer than ${MAX_LOCATION} characters`);
  // The tag ends the last prefix part (`…/name:tag`, trailing slashes aside).
  const trimmed = s.replace(/\/+$/, "");
  const lastPart = trimmed.lastIndexOf("/");
  const at = trimmed.lastIndexOf(":");
  let tag: string | undefined;
  let location = s;
  if (s.startsWith("s3://") && lastPart > 4 && at > lastPart) { // a part after the bucket ends in :tag
    tag = trimmed.slice(at + 1);
    if (!TAG_RE.test(tag)) throw bad(`tag '${tag}' is not [A-Za-z0-9_][A-Za-z0-9_.-]{0,127}`);
    location = trimmed.slice(0, at);
  }
  try {
    const { bucket, parts } = parseS3Url(location);
    return { bucket, prefix: parts.join("/"), ...(tag !== undefined ? { tag } : {}) };
  } catch (e) {
    throw e instanceof S3UrlError ? bad(e.message) : e;
  }
}

const sha256Hex = (b: Uint8Array) => new Bun.CryptoHasher("sha256").update(b).digest("hex");

function s3Code(e: unknown): string {
  const c = (e as { code?: unknown })?.code;
  return typeof c === "string" ? c : "";
}

/** NotFound errors that say the bucket is missing (not just one key). */
const missingBuckets = new WeakSet<RegistryError>();
const noSuchKey = (e: unknown) => e instanceof RegistryError && e.code === "NotFound" && !missingBuckets.has(e);

/** S3's answer as a RegistryError: missing → NotFound, refused → Denied, the rest → Unreachable. */
function asError(e: unknown, what: string): RegistryError {
  if (e instanceof RegistryError) return e;
  const code = s3Code(e);
  const msg = `${what}: ${code || "error"}: ${(e as Error)?.message ?? String(e)}`;
  if (code === "NoSuchBucket") {
    const err = new RegistryError("NotFound", `${what}: the bucket does not exist`);
    missingBuckets.add(err);
    return err;
  }
  if (code === "NoSuchKey" || code === "NotFound") return new RegistryError("NotFound", `${what}: not there`);
  if (/^(AccessDenied|Forbidden|InvalidAccessKeyId|SignatureDoesNotMatch|ExpiredToken|InvalidToken)$/.test(code)) return new RegistryError("Denied", msg);
  return new RegistryError("Unreachable", msg);
}

/** Whether trying again could help: not for a missing object, a refusal, or wrong bytes. */
function retryable(e: RegistryError): boolean {
  return e.code === "Unreachable" || e.code === "Timeout";
}

/** `p`, or Timeout after `ms` (Bun's S3 calls take no signal: the late answer is dropped). */
function timed<T>(p: Promise<T>, ms: number, what: string): Promise<T> {
  let timer: Timer | undefined;
  const late = new Promise<never>((_, reject) => {
    timer = setTimeout(() => reject(new RegistryError("Timeout", `${what}: no answer in ${ms / 1000} s`)), ms);
  });
  p.catch(() => {});
  return Promise.race([p, late]).finally(() => clearTimeout(timer));
}

export class S3Layout implements ImageLocation {
  readonly name: string;
  readonly endpoint: string;
  readonly region: string;
  private readonly client: S3Client;
  private readonly access: S3Access;

  /** The layout a location names, with the node's S3 settings; NoCredentials when they lack keys. */
  static open(location: string, access: S3Access | undefined): S3Layout {
    return new S3Layout(parseS3Location(location), access ?? {}, location);
  }

  /** The layout whose blob `digest` an S3 origin names (blobKey's `<prefix>/blobs/sha256/<hex>`), or undefined for another key. */
  static ofBlob(o: { bucket: string; key: string; endpoint?: string; region?: string }, digest: string, access: S3Access): S3Layout | undefined {
    const m = /^(?:(.*)\/)?blobs\/sha256\/([0-9a-f]{64})$/.exec(o.key);
    if (!m || `sha256:${m[2]}` !== digest) return undefined;
    return new S3Layout({ bucket: o.bucket, prefix: m[1] ?? "" }, { ...access, endpoint: o.endpoint ?? access.endpoint, region: o.region ?? access.region });
  }

  constructor(
    readonly ref: S3LayoutRef,
    access: S3Access,
    name?: string,
  ) {
    this.name = name ?? `s3://${ref.bucket}/${ref.prefix}${ref.tag !== undefined ? `:${ref.tag}` : ""}`;
    if (!access.accessKeyId || !access.secretAccessKey)
      throw new RegistryError("NoCredentials", `${this.name}: this node has no S3 credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and AENV_S3_ENDPOINT, AWS_REGION, AWS_SESSION_TOKEN as needed)`);
    this.region = access.region || "us-east-1";
    // Without an endpoint: AWS itself, in the region.
    this.endpoint = access.endpoint || `https://s3.${this.region}.amazonaws.com`;
    this.access = { accessKeyId: access.accessKeyId, secretAccessKey: access.secretAccessKey, ...(access.sessionToken ? { sessionToken: access.sessionToken } : {}) };
    this.client = new S3Client({ bucket: ref.bucket, endpoint: this.endpoint, region: this.region, ...this.access });
  }

  /** The object key of a file of the layout. */
  key(rest: string): string {
    return this.ref.prefix ? `${this.ref.prefix}/${rest}` : rest;
  }

  blobKey(digest: string): string {
    if (!SHA256_DIGEST.test(digest)) throw new RegistryError("BadReference", `${this.name}: ${digest} is not sha256:<64 hex>`);
    return this.key(`blobs/sha256/${digest.slice(7)}`);
  }

  private where(rest: string): string {
    return `s3://${this.ref.bucket}/${this.key(rest)}`;
  }

  /** An idempotent request, tried READ_TRIES times on what may pass. */
  private async retry<T>(what: string, call: () => Promise<T>): Promise<T> {
    for (let n = 1; ; n++) {
      try {
        return await timed(call(), REQUEST_TIMEOUT_MS, what);
      } catch (e) {
        const err = asError(e, what);
        if (n >= READ_TRIES || !retryable(err)) throw err;
        await Bun.sleep(BACKOFF_MS * 2 ** (n - 1));
      }
    }
  }

  /** At most `max` bytes of an object (one ranged GET); TooLarge when it holds more. */
  private async readSmall(key: string, max: number, what: string): Promise<Uint8Array> {
    const bytes = new Uint8Array(await this.retry(what, () => this.client.file(key).slice(0, max + 1).arrayBuffer()));
    if (bytes.length > max) throw new RegistryError("TooLarge", `${what}: more than ${max} bytes`);
    return bytes;
  }

  /** A small blob (manifest, config): its size bounded, its bytes hashed against the descriptor. */
  private async readBlob(d: Descriptor, max: number): Promise<Uint8Array> {
    const what = `blob ${d.digest} of ${this.name} (${this.where(`blobs/sha256/${d.digest.slice(7)}`)})`;
    if (d.size > max) throw new RegistryError("TooLarge", `${what}: ${d.size} bytes, more than ${max}`);
    const bytes = await this.readSmall(this.blobKey(d.digest), max, what);
    const got = `sha256:${sha256Hex(bytes)}`;
    if (got !== d.digest || bytes.length !== d.size) throw new RegistryError("DigestMismatch", `${what}: ${bytes.length} bytes whose digest is ${got}`);
    return bytes;
  }

  private async readManifest(d: Descriptor): Promise<ManifestBytes> {
    return { bytes: await this.readBlob(d, MAX_MANIFEST_BYTES), mediaType: d.mediaType, digest: d.digest };
  }

  async resolve(platform: Platform): Promise<LocatedImage> {
    const where = `image ${this.name}`;
    const layout = await this.readSmall(this.key(OCI_LAYOUT_FILE), MAX_LAYOUT_FILE, `${where}: ${this.where(OCI_LAYOUT_FILE)}`).catch((e: RegistryError) => {
      throw noSuchKey(e) ? new RegistryError("NotFound", `${where}: no image there (${this.where(OCI_LAYOUT_FILE)} is missing)`) : e;
    });
    let version: unknown;
    try {
      version = (JSON.parse(new TextDecoder().decode(layout)) as { imageLayoutVersion?: unknown })?.imageLayoutVersion;
    } catch {}
    if (version !== OCI_LAYOUT_VERSION) throw new RegistryError("Protocol", `${where}: ${OCI_LAYOUT_FILE} is not {"imageLayoutVersion":"${OCI_LAYOUT_VERSION}"}`);
    const idx = await this.readSmall(this.key("index.json"), MAX_MANIFEST_BYTES, `${where}: ${this.where("index.json")}`);
    const parsed = parseManifest(idx, MEDIA.ociIndex, `${where} index.json`);
    if (parsed.kind !== "index") throw new RegistryError("Protocol", `${where}: index.json is not an OCI index`);
    const tag = this.ref.tag;
    const entries = tag === undefined ? parsed.manifests : parsed.manifests.filter((d) => d.annotations?.[REF_NAME_ANNOTATION] === tag);
    if (entries.length === 0) {
      const tags = parsed.manifests.map((d) => d.annotations?.[REF_NAME_ANNOTATION]).filter((t) => t !== undefined);
      throw new RegistryError("NotFound", `${where}: index.json names ${tag === undefined ? "no manifest" : `no manifest tagged '${tag}' (it has ${tags.join(", ") || "no tags"})`}`);
    }
    const pick = entries.length === 1 ? entries[0] : selectPlatform(entries, platform);
    if (!pick) throw new RegistryError("NotFound", `${where}: no ${formatPlatform(platform)} image in index.json`);
    return resolveManifests(await this.readManifest(pick), { manifest: (d) => this.readManifest(d), config: (d) => this.readBlob(d, MAX_CONFIG_BYTES) }, platform, where);
  }

  /**
   * A blob to `dest`: streamed to `<dest>.partial`, hashed as it comes, at most the descriptor's
   * size, renamed only when its digest matches; a dropped or silent (REQUEST_TIMEOUT_MS) stream
   * starts over, READ_TRIES times in all.
   */
  async fetchBlob(desc: Descriptor, dest: string, opts: FetchBlobOptions = {}): Promise<FetchedBlob> {
    const key = this.blobKey(desc.digest);
    const what = `blob ${desc.digest} of ${this.name}`;
    const partial = `${dest}.partial`;
    const idleMs = opts.idleTimeoutMs ?? REQUEST_TIMEOUT_MS;
    for (let n = 1; ; n++) {
      const fh = await open(partial, "w");
      const h = new Bun.CryptoHasher("sha256");
      let size = 0;
      try {
        const reader = this.client.file(key).stream().getReader();
        try {
          for (;;) {
            const { done, value } = await timed(reader.read(), idleMs, what);
            if (done) break;
            size += value.length;
            if (size > desc.size) throw new RegistryError("TooLarge", `${what}: more than its ${desc.size} bytes`);
            h.update(value);
            await fh.write(value);
            opts.onProgress?.(size, desc.size);
          }
        } finally {
          reader.cancel().catch(() => {});
        }
        await fh.close();
        const got = `sha256:${h.digest("hex")}`;
        if (got !== desc.digest || size !== desc.size) throw new RegistryError("DigestMismatch", `${what}: ${size} bytes whose digest is ${got}`);
        await rename(partial, dest);
        return { path: dest, digest: desc.digest, size, downloaded: size };
      } catch (e) {
        await fh.close().catch(() => {});
        await rm(partial, { force: true });
        const err = asError(e, what);
        if (n >= READ_TRIES || !retryable(err)) throw err;
        await Bun.sleep(BACKOFF_MS * 2 ** (n - 1));
      }
    }
  }

  async blobOrigin(digest: LayerDigest): Promise<{ origin: OriginSpec; source: ChunkSource }> {
    const o = { bucket: this.ref.bucket, key: this.blobKey(digest), endpoint: this.endpoint, region: this.region };
    return { origin: { kind: "s3", ...o }, source: new S3RangeSource({ ...o, ...this.access }) };
  }

  /** HEAD: the object is there with this size. */
  async hasBlob(digest: string, size: number): Promise<boolean> {
    const what = `blob ${digest} of ${this.name}`;
    try {
      return (await this.retry(what, () => this.client.file(this.blobKey(digest)).stat())).size === size;
    } catch (e) {
      if (noSuchKey(e)) return false;
      throw e;
    }
  }

  async putBlob(source: string | Uint8Array, opts: { mediaType: string; known?: { digest: string; size: number } }): Promise<Descriptor> {
    let known = opts.known;
    if (!known) {
      const h = new Bun.CryptoHasher("sha256");
      let size = 0;
      if (typeof source === "string") for await (const c of Bun.file(source).stream()) { h.update(c); size += c.length; }
      else { h.update(source); size = source.length; }
      known = { digest: `sha256:${h.digest("hex")}`, size };
    }
    const desc: Descriptor = { mediaType: opts.mediaType, ...known };
    if (await this.hasBlob(known.digest, known.size)) return desc;
    const key = this.blobKey(known.digest);
    const what = `upload of blob ${known.digest} to ${this.name}`;
    if (typeof source !== "string") {
      if (`sha256:${sha256Hex(source)}` !== known.digest) throw new RegistryError("DigestMismatch", `${what}: the bytes do not hash to it`);
      await this.retry(what, () => this.client.write(key, source));
      return desc;
    }
    // A file goes up in parts, hashed on the way: bytes that changed since it was hashed are taken back.
    const w = this.client.file(key).writer({ partSize: PART_BYTES, queueSize: 1, retry: 3 });
    const h = new Bun.CryptoHasher("sha256");
    let size = 0;
    try {
      for await (const c of Bun.file(source).stream()) {
        h.update(c);
        size += c.length;
        const r = w.write(c);
        if (typeof r !== "number") await timed(r, REQUEST_TIMEOUT_MS * 2, what);
      }
      await timed(Promise.resolve(w.end()), REQUEST_TIMEOUT_MS * 2, what);
      const got = `sha256:${h.digest("hex")}`;
      if (got !== known.digest || size !== known.size) throw new RegistryError("DigestMismatch", `${what}: ${source} changed while it was sent (${size} bytes, ${got})`);
    } catch (e) {
      try { await Promise.resolve(w.end(e as Error)).catch(() => {}); } catch { /* ended already */ }
      await timed(this.client.delete(key), REQUEST_TIMEOUT_MS, what).catch(() => {});
      throw await this.writeError(e, what);
    }
    return desc;
  }

  /**
   * A failed upload's error. A multipart upload that cannot start says no more than that, so a
   * LIST of the bucket tells a missing bucket (NotFound) from the rest.
   */
  private async writeError(e: unknown, what: string): Promise<RegistryError> {
    const err = asError(e, what);
    if (err.code !== "Unreachable") return err;
    const probe = await timed(this.client.list({ maxKeys: 1 }), REQUEST_TIMEOUT_MS, what).then(() => undefined, (x: unknown) => asError(x, what));
    return probe && missingBuckets.has(probe) ? probe : err;
  }

  /** The manifest's blob, then oci-layout, then index.json (last: from then on the image is there). */
  async putManifest(manifest: object, mediaType: string): Promise<Descriptor> {
    const bytes = new TextEncoder().encode(JSON.stringify(manifest));
    const desc = await this.putBlob(bytes, { mediaType });
    const index = {
      schemaVersion: 2,
      mediaType: MEDIA.ociIndex,
      manifests: [{ mediaType, digest: desc.digest, size: desc.size, ...(this.ref.tag !== undefined ? { annotations: { [REF_NAME_ANNOTATION]: this.ref.tag } } : {}) }],
    };
    const what = `write of ${this.name}`;
    await this.retry(what, () => this.client.write(this.key(OCI_LAYOUT_FILE), JSON.stringify({ imageLayoutVersion: OCI_LAYOUT_VERSION }), { type: "application/json" }));
    await this.retry(what, () => this.client.write(this.key("index.json"), JSON.stringify(index), { type: MEDIA.ociIndex }));
    return desc;
  }
}
