// An object in S3 (or an S3-compatible store) read by ranged GET through Bun's S3Client.

import { S3Client, type S3Options } from "bun";
import { type ChunkSource, type LayerDigest, SourceError } from "./source.ts";
import { retryableStatus } from "./http_source.ts";

export interface S3RangeSourceOptions extends Pick<S3Options, "endpoint" | "region" | "accessKeyId" | "secretAccessKey" | "sessionToken"> {
  bucket: string;
  key: string;
}

export class S3RangeSource implements ChunkSource {
  readonly name: string;
  private readonly client: S3Client;
  constructor(private readonly opts: S3RangeSourceOptions) {
    this.name = `s3 ${opts.bucket}/${opts.key}`;
    this.client = new S3Client({ ...opts });
  }

  async read(_digest: LayerDigest, offset: number, length: number, signal: AbortSignal): Promise<Uint8Array> {
    signal.throwIfAborted();
    // Bun's S3 calls take no signal: the caller's timeout abandons the answer instead.
    const aborted = new Promise<never>((_, reject) => signal.addEventListener("abort", () => reject(signal.reason), { once: true }));
    let body: ArrayBuffer;
    try {
      body = await Promise.race([this.client.file(this.opts.key).slice(offset, offset + length).arrayBuffer(), aborted]);
    } catch (e) {
      if (signal.aborted) throw e;
      const err = e as { code?: string; status?: number; message?: string };
      const status = typeof err.status === "number" ? err.status : err.code === "NoSuchKey" ? 404 : undefined;
      throw new SourceError(`${err.code ?? "error"}: ${err.message ?? String(e)}`, status === undefined ? true : retryableStatus(status), status);
    }
    if (body.byteLength !== length) throw new SourceError(`answered ${body.byteLength} of ${length} bytes`, true);
    return new Uint8Array(body);
  }
}
