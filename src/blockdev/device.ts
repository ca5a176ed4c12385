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

  private constructor(private worker: Worker) {
    this.exited = new Promise((r) => (this.markExited = r));
  }

  /** Start a worker that opens the image and mounts the device at `path`. */
  static async start(init: Omit<WorkerInit, "posted">): Promise<DeviceHandle> {
    const worker = new Worker(new URL("./device_worker.ts", import.meta.url).href);
    const h = new DeviceHandle(worker);
    const ready = new Promise<void>((resolve, reject) => {
      worker.onmessage = (ev: MessageEvent) => {
        const m = ev.data;
        if (m.type === "ready") {
          h.wakeFd = m.wakeFd;
          h.fuseFds = m.fuseFds;
          h.size = m.size;
          resolve();
        } else if (m.type === "failed") {
          reject(new BlockdError("DeviceFailed", `${init.id}: ${m.error.name}: ${m.error.message}`));
          worker.terminate();
          h.markExited();
        } else if (m.type === "exited") {
          h.markExited();
        } else h.settle(m);
      };
      worker.onerror = (ev) => {
        reject(new BlockdError("DeviceFailed", `${init.id}: ${ev.message}`));
        h.markExited();
      };
    });
    worker.postMessage({ type: "init", init: { ...init, posted: h.posted } });
    await ready;
    return h;
  }

  private settle(m: { seq: number; ok: boolean; result?: unknown; error?: { name: string; message: string } }): void {
    const w = this.waiting.get(m.seq);
    if (!w) return;
    this.waiting.delete(m.seq);
    if (m.ok) w.resolve(m.result);
    else w.reject(new BlockdError(m.error!.name, m.error!.message));
  }

  call<T = unknown>(body: ControlOp): Promise<T> {
    const seq = ++this.seq;
    return new Promise<T>((resolve, reject) => {
      this.waiting.set(seq, { resolve, reject });
      Atomics.add(new Int32Array(this.posted), 0, 1);
      this.worker.postMessage({ seq, body });
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

  /** Flush and close the image, unmount, end the worker. */
  async stop(): Promise<void> {
    await this.call({ op: "stop" });
    await Promise.race([this.exited, Bun.sleep(5000)]);
    this.worker.terminate();
  }
}
