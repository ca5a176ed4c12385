// A layer blob read as its tar stream: plain, gzip or zstd, told apart by the blob's first bytes
// (media types lie more often than magic numbers), decompressed with Bun's native zlib and zstd.

import { createReadStream } from "node:fs";
import { open } from "node:fs/promises";
import { pipeline } from "node:stream/promises";
import { createGunzip, createZstdDecompress } from "node:zlib";
import { ConvertError } from "./convert_error.ts";

export type Compression = "gzip" | "zstd" | "none";

const READ_CHUNK = 1 << 20;

export async function sniffCompression(path: string): Promise<Compression> {
  const fh = await open(path, "r");
  try {
    const b = new Uint8Array(4);
    const { bytesRead } = await fh.read(b, 0, 4, 0);
    if (bytesRead >= 2 && b[0] === 0x1f && b[1] === 0x8b) return "gzip";
    if (bytesRead === 4 && b[0] === 0x28 && b[1] === 0xb5 && b[2] === 0x2f && b[3] === 0xfd) return "zstd";
    return "none";
  } finally {
    await fh.close();
  }
}

/**
 * Every chunk of the blob's tar, in order, to `each` (which may throw to stop); `onBlobBytes`
 * hears the blob bytes read so far. A stream that does not decode is ConvertError CorruptLayer.
 */
export async function streamLayer(path: string, each: (chunk: Uint8Array) => void, onBlobBytes?: (n: number) => void): Promise<Compression> {
  const compression = await sniffCompression(path);
  const src = createReadStream(path, { highWaterMark: READ_CHUNK });
  if (onBlobBytes) {
    let n = 0;
    src.on("data", (c) => onBlobBytes((n += c.length)));
  }
  const sink = async (source: AsyncIterable<Uint8Array>) => {
    for await (const chunk of source) each(chunk);
  };
  if (compression === "none") {
    await pipeline(src, sink);
    return compression;
  }
  const dec = compression === "gzip" ? createGunzip({ chunkSize: READ_CHUNK }) : createZstdDecompress({ chunkSize: READ_CHUNK });
  try {
    await pipeline(src, dec, sink);
  } catch (e) {
    const err = e as Error & { code?: string };
    if (err instanceof ConvertError) throw err;
    // zlib's and zstd's errors (Z_DATA_ERROR, Z_BUF_ERROR "unexpected end of file", …): a damaged stream.
    if (err.code?.startsWith("Z_") || err.code?.startsWith("ZSTD_") || err.code?.startsWith("ERR_ZLIB") || err.code?.startsWith("ERR_ZSTD")) {
      throw new ConvertError("CorruptLayer", `${compression} stream does not decode: ${err.message}`);
    }
    throw err;
  }
  return compression;
}

/** sha256 of a blob's uncompressed tar (what an image config's diff_ids list), for tars that come without a config. */
export async function diffIdOf(blob: string): Promise<string> {
  const hash = new Bun.CryptoHasher("sha256");
  await streamLayer(blob, (c) => hash.update(c));
  return `sha256:${hash.digest("hex")}`;
}
