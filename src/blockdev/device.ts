// DeviceHandle: blockd's main-thread side of one device worker. Control calls are messages
// plus an eventfd write, because the worker sleeps in poll(2) on its frontend, not in its loop.

import { eventfdSignal } from "../../ffi/libc.ts";
import type { ImageConfig } from "../storage/image_config.ts";
import type { ControlOp, WorkerInit } from "./device_worker.ts";
import { BlockdError } from "./protocol.ts";

export class DeviceHandle {
  private seq = 0;
  private waiting = new Map<number, { resolve: (v: any) => void; reject: (e: Error) => void }>();
  private posted = new SharedArrayBuffer(4);
  private wakeFd = -1;
  /** The device's /dev/fuse fds (process-wide): its connection's, then its reader's clone; for the fd keeper. */
  fuseFds: number[] = [];
  private exited: Promise<void>;
  private markExited!: () => void;
  size = 0;
  /** Set when the worker died on its own: every call, pending or later, fails with it at once. */
  failure: BlockdError | undefined;
  /** Told once when the worker dies after start (blockd marks the device failed). */
  onDeath: ((failure: BlockdError) => void) | undefined;
  private stopping = false;

  private constructor(
    readonly id: string,
    private worker: Worker | null,
  ) {
    this.exited = new Promise((r) => (this.markExited = r));
  }

  /** Start a worker that opens the image and mounts the device at `path`. */
  static async start(init: Omit<WorkerInit, "posted">): Promise<DeviceHandle> {
    const worker = new Worker(new URL("./device_worker.ts", import.meta.url).href);
    const h = new DeviceHandle(init.id, worker);
    let started = false;
    const ready = new Promise<void>((resolve, reject) => {
      // Before "ready" an end of the worker is a failed start; after it, a death (unless stopped).
      const ended = (why: string) => {
        if (!started) {
          reject(new BlockdError("DeviceFailed", `${init.id}: ${why}`));
          worker.terminate();
          h.markExited();
        } else if (h.stopping) h.end(new BlockdError("DeviceFailed", `device ${init.id}: its worker ended while stopping: ${why}`));
        else h.die(why);
      };
      worker.onmessage = (ev: MessageEvent) => {
        const m = ev.data;
        if (m.type === "ready") {
          h.wakeFd = m.wakeFd;
          h.fuseFds = m.fuseFds;
          h.size = m.size;
          started = true;
          resolve();
        } else if (m.type === "failed") ended(`${m.error.name}: ${m.error.message}`);
        else if (m.type === "exited") {
          // Not asked to stop: its device went away under it (unmounted, aborted); its fds are closed.
          if (!h.stopping) {
            h.fuseFds = [];
            h.die("its device ended outside blockd (unmounted or aborted)");
          }
          h.stopping = true; // the close that follows is no death
          h.markExited();
        } else h.settle(m);
      };
      worker.onerror = (ev) => ended(ev.message);
      // Every end of the thread, a crash without a message included (process.exit, a native fault).
      worker.addEventListener("close", (ev) => ended(`its thread ended (exit code ${(ev as CloseEvent).code})`));
    });
    worker.postMessage({ type: "init", init: { ...init, posted: h.posted } });
    await ready;
    return h;
  }

  /** A device with no worker (it could not be brought back): every call fails with `why`. */
  static failed(id: string, why: string): DeviceHandle {
    const h = new DeviceHandle(id, null);
    h.failure = new BlockdError("DeviceFailed", `device ${id} is failed: ${why}`);
    h.markExited();
    return h;
  }

  /** The worker died on its own: fail what waits on it, and tell blockd once. */
  private die(why: string): void {
    if (this.failure) return;
    this.failure = new BlockdError("DeviceFailed", `device ${this.id}: its worker died: ${why}`);
    this.end(this.failure);
    this.onDeath?.(this.failure);
  }

  /** The worker is gone: no call waits for it any more. */
  private end(err: BlockdError): void {
    for (const w of this.waiting.values()) w.reject(err);
    this.waiting.clear();
    this.markExited();
    this.worker?.terminate();
  }

  private settle(m: { seq: number; ok: boolean; result?: unknown; error?: { name: string; message: string } }): void {
    const w = this.waiting.get(m.seq);
    if (!w) return;
    this.waiting.delete(m.seq);
    if (m.ok) w.resolve(m.result);
    else w.reject(new BlockdError(m.error!.name, m.error!.message));
  }

  call<T = unknown>(body: ControlOp): Promise<T> {
    if (this.failure) return Promise.reject(this.failure);
    const worker = this.worker!;
    const seq = ++this.seq;
    return new Promise<T>((resolve, reject) => {
      this.waiting.set(seq, { resolve, reject });
      Atomics.add(new Int32Array(this.posted), 0, 1);
      worker.postMessage({ seq, body });
      eventfdSignal(this.wakeFd);
    });
  }

  restack(layerPath: string): Promise<{ layerPath: string; config: ImageConfig }> {
    return this.call({ op: "restack", layerPath });
  }
  async swap(config: ImageConfig | null, readOnly: boolean): Promise<void> {
    const r = await this.call<{ size: number }>({ op: "swap", config, readOnly });
    this.size = r.size;
  }
  async resize(size: number): Promise<void> {
    const r = await this.call<{ size: number }>({ op: "resize", size });
    this.size = r.size;
  }
  flush(): Promise<void> {
    return this.call({ op: "flush" });
  }
  stats(): Promise<Record<string, number>> {
    return this.call({ op: "stats" });
  }

  /** Flush and close the image, unmount, end the worker. A dead worker has nothing left to stop. */
  async stop(): Promise<void> {
    if (this.failure) return;
    this.stopping = true;
    await this.call({ op: "stop" });
    await Promise.race([this.exited, Bun.sleep(5000)]);
    this.worker!.terminate();
  }
}
