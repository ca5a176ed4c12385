// The URLs COPY archives are PUT to. The SDK sends no API key with that PUT, so the URL is the
// credential: it names the template, the files hash and an expiry, and carries an HMAC-SHA256 of
// them and the method under a secret the node draws at start (so a restart voids its URLs).
import { createHmac } from "node:crypto";
import { ApiError } from "./errors.ts";
import { secretMatches } from "./secret.ts";

/** An upload URL's lifetime when none is configured (E2B's signed upload URLs last 1 hour). */
export const UPLOAD_URL_TTL_S = 3600;
/** An expiry as the URL carries it: unix seconds. */
const EXPIRES = /^\d{1,12}$/;
const SECRET_BYTES = 32;

const refused = (why: string) => new ApiError(403, `upload URL ${why}: ask GET /templates/{templateID}/files/{hash} for a new one`);

export class UploadUrls {
  private readonly secret = crypto.getRandomValues(new Uint8Array(SECRET_BYTES));

  constructor(private readonly ttlS: number = UPLOAD_URL_TTL_S) {}

  /** The path and query to PUT `hash`'s archive of `templateId` to, valid ttlS seconds from `nowMs`. */
  pathFor(templateId: string, hash: string, nowMs = Date.now()): string {
    const path = uploadPath(templateId, hash);
    const expires = String(Math.floor(nowMs / 1000) + this.ttlS);
    return `${path}?${new URLSearchParams({ expires, signature: this.sign(path, hash, expires) })}`;
  }

  /** Throws 403 unless `signature` is this node's over this upload and `expires` is still ahead of `nowMs`. */
  check(templateId: string, hash: string, expires: string | undefined, signature: string | undefined, nowMs = Date.now()): void {
    if (expires === undefined || !EXPIRES.test(expires)) throw refused("has no valid expiry");
    if (!secretMatches(signature, this.sign(uploadPath(templateId, hash), hash, expires))) throw refused("signature does not match");
    if (Number(expires) * 1000 <= nowMs) throw refused(`expired at ${new Date(Number(expires) * 1000).toISOString()}`);
  }

  private sign(path: string, hash: string, expires: string): string {
    return createHmac("sha256", this.secret).update(`PUT\n${path}\n${hash}\n${expires}`).digest("hex");
  }
}

function uploadPath(templateId: string, hash: string): string {
  return `/templates/${templateId}/files/${hash}`;
}
