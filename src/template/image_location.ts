// Where one image's manifest, config and blobs live, as pullImage and pushImage see it: a registry
// repository (the distribution API, RegistryClient) or an OCI image layout in S3 (s3_layout.ts).
// Both hold the same bytes under the same digests; only the transport differs.
import { RegistryRangeSource } from "../storage/remote/http_source.ts";
import type { ChunkSource, LayerDigest } from "../storage/remote/source.ts";
import type { OriginSpec } from "../storage/remote/spec.ts";
import type { FetchBlobOptions, FetchedBlob } from "./registry/blob_fetch.ts";
import type { LocatedImage, RegistryClient } from "./registry/client.ts";
import type { Descriptor, Platform } from "./registry/manifest.ts";
import { formatImageRef, type ImageRef, parseImageRef } from "./registry/reference.ts";

export interface ImageLocation {
  /** The location as the caller wrote it (`registry/repo:tag`, `s3://bucket/prefix`), for messages and answers. */
  readonly name: string;
  /** The platform's manifest, its config and layers; bounded and digest checked. */
  resolve(platform: Platform): Promise<LocatedImage>;
  /** A blob to `dest`, digest checked (only a verified file appears there). */
  fetchBlob(desc: Descriptor, dest: string, opts?: FetchBlobOptions): Promise<FetchedBlob>;
  /**
   * A blob read lazily: the origin a remote layer's record keeps (no credentials in it) and a live
   * source for this process's own reads (with them).
   */
  blobOrigin(digest: LayerDigest): Promise<{ origin: OriginSpec; source: ChunkSource }>;
  /** Whether the blob is there whole (a push skips it). */
  hasBlob(digest: string, size: number): Promise<boolean>;
  /** A blob (a file path or bytes) written, unless it is there; `known` when the caller hashed it already. */
  putBlob(source: string | Uint8Array, opts: { mediaType: string; known?: { digest: string; size: number } }): Promise<Descriptor>;
  /** The image's manifest, written after every blob it names: from then on readers see the image. */
  putManifest(manifest: object, mediaType: string): Promise<Descriptor>;
}

/** `s3://…` names an OCI image layout in S3; anything else is a registry reference. */
export function isS3Location(ref: string): boolean {
  return ref.startsWith("s3://");
}

/** A registry repository (the reference's tag or digest is where a push puts the manifest). */
export class RegistryLocation implements ImageLocation {
  readonly name: string;
  readonly ref: ImageRef;
  constructor(
    readonly client: RegistryClient,
    ref: ImageRef | string,
  ) {
    this.ref = typeof ref === "string" ? parseImageRef(ref) : ref;
    this.name = typeof ref === "string" ? ref : formatImageRef(ref);
  }

  async resolve(platform: Platform): Promise<LocatedImage> {
    const { ref: _, ...img } = await this.client.resolve(this.ref, { platform });
    return img;
  }

  fetchBlob(desc: Descriptor, dest: string, opts?: FetchBlobOptions): Promise<FetchedBlob> {
    return this.client.fetchBlob(this.ref, desc, dest, opts);
  }

  async blobOrigin(digest: LayerDigest): Promise<{ origin: OriginSpec; source: ChunkSource }> {
    const url = this.client.blobUrl(this.ref, digest);
    // This process's own reads carry the client's Authorization (a token lasts well past them);
    // blockd's carry the headers file the node adds at each use.
    const auth = await this.client.pullAuthorization(this.ref, digest);
    const headers: Record<string, string> = auth.value ? { authorization: auth.value } : {};
    return { origin: { kind: "http", url }, source: new RegistryRangeSource({ url, headers: () => headers }) };
  }

  hasBlob(digest: string): Promise<boolean> {
    return this.client.hasBlob(this.ref, digest, "pull,push");
  }

  putBlob(source: string | Uint8Array, opts: { mediaType: string; known?: { digest: string; size: number } }): Promise<Descriptor> {
    return this.client.pushBlob(this.ref, source, opts);
  }

  putManifest(manifest: object, mediaType: string): Promise<Descriptor> {
    return this.client.pushManifest(this.ref, manifest, mediaType);
  }
}
