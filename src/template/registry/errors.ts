// The registry client's one error type: a code the caller branches on, the HTTP status the API
// answers with, and a message that names the image, the tag or digest, and the registry.

export type RegistryErrorCode =
  | "BadReference"
  | "NotFound"
  | "Unauthorized"
  | "Denied"
  | "DigestMismatch"
  | "UnsupportedMediaType"
  | "Unreachable"
  | "Timeout"
  | "TooLarge"
  | "Protocol"
  | "NoCredentials"
  | "Forbidden";

/** The status the API returns for each code: the caller's fault is 4xx, the registry's is 502/504. */
export const REGISTRY_ERROR_STATUS: Record<RegistryErrorCode, number> = {
  BadReference: 400,
  NotFound: 404,
  Unauthorized: 401,
  Denied: 403,
  DigestMismatch: 502,
  UnsupportedMediaType: 415,
  Unreachable: 502,
  Timeout: 504,
  TooLarge: 502,
  Protocol: 502,
  NoCredentials: 400,
  /** The node's own rule refused it (an unlisted internal registry, an S3 bucket not in s3_buckets). */
  Forbidden: 403,
};

export class RegistryError extends Error {
  readonly status: number;
  constructor(
    readonly code: RegistryErrorCode,
    message: string,
  ) {
    super(message);
    this.name = `RegistryError(${code})`;
    this.status = REGISTRY_ERROR_STATUS[code];
  }
}
