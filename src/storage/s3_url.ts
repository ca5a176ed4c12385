// s3://bucket/prefix, as the snapshot store and image layouts in S3 name their place: one grammar
// for the bucket and the key prefix, checked before any request goes out.

/** S3's bucket names: 3-63 of [a-z0-9.-], a letter or digit at each end. */
const BUCKET_RE = /^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$/;
/** Prefix parts: 1-128 of [A-Za-z0-9._-], never `.` or `..`. */
const PREFIX_PART_RE = /^[A-Za-z0-9._-]{1,128}$/;

/** A string that is not an s3://bucket/prefix location; the message says which part is wrong. */
export class S3UrlError extends Error {
  override name = "S3UrlError";
}

export interface S3Url {
  bucket: string;
  /** The key prefix's parts, empty ones dropped (none: the bucket's root). */
  parts: string[];
}

/** `s3://bucket[/part/…]` → its bucket and prefix parts; S3UrlError for anything else. */
export function parseS3Url(s: string): S3Url {
  if (!s.startsWith("s3://")) throw new S3UrlError("it does not start with s3://");
  const [bucket = "", ...rest] = s.slice(5).split("/");
  if (!BUCKET_RE.test(bucket)) throw new S3UrlError(`bucket '${bucket.slice(0, 80)}' is not 3-63 of [a-z0-9.-]`);
  const parts = rest.filter((p) => p !== "");
  if (!parts.every((p) => PREFIX_PART_RE.test(p) && p !== "." && p !== "..")) throw new S3UrlError("prefix parts are 1-128 of [A-Za-z0-9._-], never . or ..");
  return { bucket, parts };
}

/**
 * Whether an object key (or key prefix) of `bucket` is inside one of `scopes`, each `bucket` (all
 * of it) or `bucket/prefix` (keys under prefix/), as the node's s3_buckets lists them. A key with a
 * `.` or `..` part is inside none.
 */
export function inS3Scope(scopes: readonly string[], bucket: string, key: string): boolean {
  const parts = key.split("/").filter((p) => p !== "");
  if (parts.some((p) => p === "." || p === "..")) return false;
  return scopes.some((scope) => {
    const s = parseS3Url(`s3://${scope}`);
    return s.bucket === bucket && s.parts.every((p, i) => parts[i] === p);
  });
}
