// A memory writer thread (memory_writer.ts): one writeMemoryLayer at a time, its result or its
// error (code and message, as blockd would send it) posted back.

import { writeMemoryLayer } from "./memory_layer.ts";
import { errorOf } from "./protocol.ts";
import type { MemoryWriteJob } from "./memory_writer.ts";

declare const self: Worker;

self.onmessage = async (ev: MessageEvent) => {
  const job = ev.data as MemoryWriteJob;
  try {
    self.postMessage({ ok: true, result: await writeMemoryLayer(job.out, job.size, job.from, job.zfile) });
  } catch (e) {
    self.postMessage({ ok: false, error: errorOf(e) });
  }
};
