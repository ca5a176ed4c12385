// The OCI distribution client for template pulls (docs/templates.md, "Pulling images").
export { RegistryError, REGISTRY_ERROR_STATUS, type RegistryErrorCode } from "./registry/errors.ts";
export {
  blobRepository,
  canonicalRegistry,
  DOCKER_HUB,
  DOCKER_HUB_ENDPOINT,
  formatImageRef,
  type ImageRef,
  manifestReference,
  parseImageRef,
  withReference,
} from "./registry/reference.ts";
export { type Credentials, defaultDockerConfigPath, parseDockerConfig } from "./registry/auth.ts";
export {
  classifyLayers,
  type Descriptor,
  formatPlatform,
  type LayerCompression,
  layerCompression,
  MAX_INDEX_DEPTH,
  MAX_LAYERS,
  MEDIA,
  type OciImageConfig,
  OVERLAYBD_ANNOTATION,
  parsePlatform,
  type Platform,
  selectPlatform,
} from "./registry/manifest.ts";
export { type FetchBlobOptions, type FetchedBlob } from "./registry/blob_fetch.ts";
export { DEFAULT_CHUNK_SIZE, type LocatedImage, type ManifestBytes, type ManifestReader, RegistryClient, type RegistryClientOptions, type ResolvedImage, resolveManifests } from "./registry/client.ts";
export { DEFAULT_MAX_BLOB_BYTES, DEFAULT_RETRY_BASE_MS, DEFAULT_TIMEOUT_MS, DEFAULT_TRIES } from "./registry/transport.ts";
