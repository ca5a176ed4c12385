// Request bodies held in memory, always under a bound: a declared length past it is refused before
// a byte is read, an undeclared one as soon as the bytes that arrived pass it, and inflating a
// gzip body stops at the same bound.
import { gunzip } from "node:zlib";

export class BodyTooLarge extends Error {
  constructor(readonly limit: number) {
    super(`request body is larger than the limit of ${limit} bytes`);
  }
}

export class BadGzip extends Error {}

/** The whole request body, or BodyTooLarge once it is known to pass `limit` bytes. */
export async function readBounded(req: Request, limit: number): Promise<Uint8Array> {
  const declared = req.headers.get("content-length");
  if (declared !== null && Number(declared) > limit) {
    req.body?.cancel().catch(() => {});
    throw new BodyTooLarge(limit);
  }
  if (!req.body) return new Uint8Array(0);
  const chunks: Uint8Array[] = [];
  let total = 0;
  const reader = req.body.getReader();
  for (;;) {
    const { done, value } = await reader.read();
    if (done) break;
    total += value.length;
    if (total > limit) {
      reader.cancel().catch(() => {});
      throw new BodyTooLarge(limit);
    }
    chunks.push(value);
  }
  if (chunks.length === 1) return chunks[0]!;
  const out = new Uint8Array(total);
  let off = 0;
  for (const c of chunks) {
    out.set(c, off);
    off += c.length;
  }
  return out;
}

/** Inflates gzip data off the event loop; output past `limit` bytes is BodyTooLarge, corrupt input BadGzip. */
export function gunzipBounded(data: Uint8Array, limit: number): Promise<Uint8Array> {
  return new Promise((resolve, reject) => {
    gunzip(data, { maxOutputLength: limit }, (err, out) => {
      if (!err) resolve(new Uint8Array(out.buffer, out.byteOffset, out.byteLength));
      else if ((err as { code?: string }).code === "ERR_BUFFER_TOO_LARGE") reject(new BodyTooLarge(limit));
      else reject(new BadGzip(`invalid gzip payload: ${err.message}`));
    });
  });
}
