// Worker thread: one OCI layer blob streamed, decompressed, hashed (its diffID) and applied onto a
// mounted root with TarApplier. The file system calls are synchronous here, off the caller's
// event loop.
declare var self: Worker;

import { ConvertError } from "./convert_error.ts";
import { streamLayer, type Compression } from "./layer_stream.ts";
import { TarApplier, type ApplyStats } from "./tar_apply.ts";

export interface ApplyRequest {
  root: string;
  blob: string;
}

export type ApplyMessage =
  | { type: "progress"; blobBytes: number; tarBytes: number }
  | { type: "done"; diffId: string; compression: Compression; stats: ApplyStats; tarBytes: number }
  | { type: "error"; code: ConvertError["code"]; message: string; entry?: string };

/** A progress message at most every this many blob bytes. */
const PROGRESS_EVERY = 16 << 20;

async function apply(req: ApplyRequest): Promise<ApplyMessage> {
  const applier = new TarApplier(req.root);
  const hash = new Bun.CryptoHasher("sha256");
  let tarBytes = 0;
  let nextReport = PROGRESS_EVERY;
  try {
    const compression = await streamLayer(
      req.blob,
      (chunk) => {
        hash.update(chunk);
        tarBytes += chunk.length;
        applier.feed(chunk);
      },
      (blobBytes) => {
        if (blobBytes < nextReport) return;
        nextReport = blobBytes + PROGRESS_EVERY;
        self.postMessage({ type: "progress", blobBytes, tarBytes } satisfies ApplyMessage);
      },
    );
    const stats = applier.finish();
    return { type: "done", diffId: `sha256:${hash.digest("hex")}`, compression, stats, tarBytes };
  } finally {
    applier.close();
  }
}

self.onmessage = async (ev: MessageEvent<ApplyRequest>) => {
  let reply: ApplyMessage;
  try {
    reply = await apply(ev.data);
  } catch (e) {
    reply = e instanceof ConvertError
      ? { type: "error", code: e.code, message: e.message, entry: e.entry }
      : { type: "error", code: "ApplyFailed", message: (e as Error).message ?? String(e) };
  }
  self.postMessage(reply);
};
