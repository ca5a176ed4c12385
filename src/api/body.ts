// Request bodies of API routes are read with a bound: the SDK sends JSON chunked (no
// Content-Length), so the bound is counted while reading, not taken from a header.
import { badRequest, tooLarge } from "./errors.ts";

export async function readBoundedText(request: Request, limit: number): Promise<string> {
  const declared = Number(request.headers.get("content-length") ?? "NaN");
  if (declared > limit) throw tooLarge(limit);
  if (!request.body) return "";
  const chunks: Uint8Array[] = [];
  let total = 0;
  const reader = request.body.getReader();
  try {
    for (;;) {
      const { done, value } = await reader.read();
      if (done) break;
      total += value.byteLength;
      if (total > limit) throw tooLarge(limit);
      chunks.push(value);
    }
  } finally {
    reader.releaseLock();
  }
  return Buffer.concat(chunks, total).toString("utf8");
}

/** JSON body of an API route: empty means `{}` (the SDK sends `{}` or nothing for optional bodies). */
export async function readBoundedJson(request: Request, limit: number): Promise<unknown> {
  const text = await readBoundedText(request, limit);
  if (text.trim() === "") return {};
  try {
    return JSON.parse(text);
  } catch (e) {
    throw badRequest(`malformed JSON body: ${(e as Error).message}`);
  }
}
