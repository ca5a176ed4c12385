// Memory layers are written on threads of their own (MEMORY_WRITERS), not on blockd's main
// thread: writeMemoryLayer's file I/O waits for each completion on the thread that issues it, and
// on the main thread those waits (a seal's fdatasync: up to 120 ms) held every other RPC,
// acquires included. Jobs beyond the threads queue (at most MEMORY_WRITES_QUEUED); each has a
// bound (MEMORY_WRITE_TIMEOUT_MS), past which its thread is retired and another takes its place.

import { rm } from "node:fs/promises";
import { type MemoryLayerResult, type MemorySource, memoryLayerScratch } from "./memory_layer.ts";
import { testTimeoutCap } from "./device.ts";
import { BlockdError } from "./protocol.ts";
import type { ZFileAlgorithm } from "../storage/zfile.ts";

/** Threads writing memory layers at once. */
export const MEMORY_WRITERS = 2;
/** Writes waiting for a thread, at most. */
export const MEMORY_WRITES_QUEUED = 256;
/** One write's bound: under the client's 120 s for memoryLayer (client.ts). */
export const MEMORY_WRITE_TIMEOUT_MS = 110_000;
/** The bound in force: AENV_BLOCKD_MEMORY_TIMEOUT_MS caps it (test-only, not a node setting). */
const WRITE_TIMEOUT_MS = Math.min(MEMORY_WRITE_TIMEOUT_MS, testTimeoutCap("AENV_BLOCKD_MEMORY_TIMEOUT_MS"));

export interface MemoryWriteJob {
  out: string;
  size: number;
  from: MemorySource;
  zfile?: ZFileAlgorithm;
}

interface Pending {
  job: MemoryWriteJob;
  resolve: (r: MemoryLayerResult) => void;
  reject: (e: Error) => void;
}

interface Writer {
  worker: Worker;
  job: Pending | undefined;
  timer: Timer | undefined;
}

export class MemoryWriter {
  private readonly idle: Writer[] = [];
  private readonly queue: Pending[] = [];
  private started = 0;

  write(job: MemoryWriteJob): Promise<MemoryLayerResult> {
    if (this.queue.length >= MEMORY_WRITES_QUEUED) return Promise.reject(new BlockdError("Busy", `${MEMORY_WRITES_QUEUED} memory layer writes are waiting already`));
    const p = Promise.withResolvers<MemoryLayerResult>();
    this.queue.push({ job, resolve: p.resolve, reject: p.reject });
    this.pump();
    return p.promise;
  }

  private pump(): void {
    while (this.queue.length) {
      const w = this.idle.pop() ?? (this.started < MEMORY_WRITERS ? this.spawn() : undefined);
      if (!w) return;
      const next = this.queue.shift()!;
      w.job = next;
      w.timer = setTimeout(() => this.timedOut(w), WRITE_TIMEOUT_MS);
      w.worker.postMessage(next.job);
    }
  }

  private spawn(): Writer {
    const worker = new Worker(new URL("./memory_writer_worker.ts", import.meta.url).href);
    worker.unref(); // an idle writer keeps no blockd alive
    const w: Writer = { worker, job: undefined, timer: undefined };
    this.started++;
    worker.onmessage = (ev: MessageEvent) => {
      const m = ev.data as { ok: true; result: MemoryLayerResult } | { ok: false; error: { code: string; message: string } };
      const job = this.finish(w);
      if (!job) return;
      if (m.ok) job.resolve(m.result);
      else job.reject(new BlockdError(m.error.code, m.error.message));
      this.idle.push(w);
      this.pump();
    };
    worker.onerror = (ev: ErrorEvent) => this.retire(w, "Io", `its thread failed: ${ev.message}`);
    return w;
  }

  private finish(w: Writer): Pending | undefined {
    clearTimeout(w.timer);
    w.timer = undefined;
    const job = w.job;
    w.job = undefined;
    return job;
  }

  /** A write past its bound: its caller hears so, its thread (maybe stuck in a syscall) is left to end. */
  private timedOut(w: Writer): void {
    const out = w.job?.job.out;
    this.retire(w, "Timeout", `did not finish within ${WRITE_TIMEOUT_MS} ms`);
    if (out) for (const f of Object.values(memoryLayerScratch(out))) void rm(f, { force: true }).catch(() => {});
  }

  private retire(w: Writer, code: "Io" | "Timeout", why: string): void {
    const job = this.finish(w);
    const at = this.idle.indexOf(w);
    if (at >= 0) this.idle.splice(at, 1);
    this.started--;
    w.worker.onmessage = null;
    w.worker.onerror = null;
    w.worker.terminate();
    job?.reject(new BlockdError(code, `memory layer ${job.job.out} ${why}`));
    this.pump();
  }
}
