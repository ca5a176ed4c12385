// DeviceHandle: blockd's main-thread side of one device worker. Control calls are messages
// plus an eventfd write, because the worker sleeps in poll(2) on its frontend, not in its loop.
// Every call, the start included, has a bound; a worker that misses one is stuck, and is dealt
// with as a dead one: ended, its device failed, its fds closed.

import { eventfdSignal } from "../../ffi/libc.ts";
import type { ImageConfig, UpperRef } from "../storage/image_config.ts";
import type { ControlOp, WorkerInit } from "./device_worker.ts";
import { FdLedger } from "./fd_ledger.ts";
import { BlockdError } from "./protocol.ts";
import type { Trace } from "../storage/trace_file.ts";
import type { PrefetchStats } from "./trace.ts";

export type DeviceCall = ControlOp["op"] | "start";

/**
 * How long a worker has to answer each call (ms). stats and resize are bookkeeping; start and swap
 * open an image, attach and detach an upper (and lowers under it), extend opens lowers on top,
 * stop flushes and closes one, restack and flush seal or sync what the upper holds, which grows
 * with its index and the disk; the trace calls only start or end bookkeeping (a prefetch runs on
 * after its call is answered). Each stays under the client's bound of the RPC that makes it (30 s;
 * 120 s for create, acquire, restack, delete, ...: client.ts), with a cold acquire's start + swap
 * in one RPC, so the caller hears which device and call, not its own timeout.
 */
export const DEVICE_CALL_TIMEOUT_MS: Readonly<Record<DeviceCall, number>> = {
  start: 45_000,
  swap: 45_000,
  attach: 45_000,
  detach: 45_000,
  extend: 45_000,
  stop: 60_000,
  restack: 90_000,
  flush: 90_000,
  resize: 20_000,
  stats: 10_000,
  traceStart: 10_000,
  traceStop: 10_000,
  prefetch: 10_000,
};

/** AENV_BLOCKD_DEVICE_TIMEOUT_MS caps every bound above; test-only, not a node setting. */
const TIMEOUT_CAP = testTimeoutCap("AENV_BLOCKD_DEVICE_TIMEOUT_MS");

/** A test-only cap on a bound, from environment variable `name` (ms, 1..600000); unset, empty or malformed: none. */
export function testTimeoutCap(name: string): number {
  const v = process.env[name];
  if (v === undefined || v === "") return Infinity;
  const n = Number(v);
  if (Number.isInteger(n) && n >= 1 && n <= 600_000) return n;
  console.error(`blockd: ${name}=${v} is not an integer 1..600000; ignored`);
  return Infinity;
}

/** After stop is answered: how long the worker has to leave its loop, then its thread to end. */
const STOP_EXIT_MS = 5000;

export function deviceCallTimeout(call: DeviceCall): number {
  return Math.min(DEVICE_CALL_TIMEOUT_MS[call], TIMEOUT_CAP);
}

export class DeviceHandle {
  private seq = 0;
  private waiting = new Map<number, { resolve: (v: any) => void; reject: (e: Error) => void }>();
  private posted = new SharedArrayBuffer(4);
  private wakeFd = -1;
  /** The device's /dev/fuse fds (process-wide): its connection's, then its reader's clone; for the fd keeper. */
  fuseFds: number[] = [];
  private exited: Promise<void>;
  private markExited!: () => void;
  /** Resolves once the worker's thread has ended and its fds are closed. */
  private threadEnded: Promise<void>;
  private markThreadEnded!: () => void;
  size = 0;
  /** Set when the worker died on its own: every call, pending or later, fails with it at once. */
  failure: BlockdError | undefined;
  /** Told once when the worker dies after start (blockd marks the device failed). */
  onDeath: ((failure: BlockdError) => void) | undefined;
  private stopping = false;
  /** The fds the worker's thread holds: closed here once the thread has ended, however it ended. */
  private readonly ledger = new FdLedger();

  private constructor(
    readonly id: string,
    private worker: Worker | null,
  ) {
    this.exited = new Promise((r) => (this.markExited = r));
    this.threadEnded = new Promise((r) => (this.markThreadEnded = r));
  }

  /** Start a worker that opens the image and mounts the device at `path`. */
  static async start(init: Omit<WorkerInit, "posted" | "fdLedger">): Promise<DeviceHandle> {
    const worker = new Worker(new URL("./device_worker.ts", import.meta.url).href);
    const h = new DeviceHandle(init.id, worker);
    let started = false;
    const startMs = deviceCallTimeout("start");
    let timer: Timer | undefined;
    const ready = new Promise<void>((resolve, reject) => {
      // Before "ready" an end of the worker is a failed start; after it, a death (unless stopped).
      const ended = (why: string, code = "DeviceFailed") => {
        if (!started) {
          reject(new BlockdError(code, `device ${init.id}: ${why}`));
          worker.terminate();
          h.markExited();
        } else if (h.stopping) h.end(new BlockdError("DeviceFailed", `device ${init.id}: its worker ended while stopping: ${why}`));
        else h.die(`its worker died: ${why}`);
      };
      timer = setTimeout(() => ended(`its worker did not start within ${startMs} ms`, "Timeout"), startMs);
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
            h.die("its worker died: its device ended outside blockd (unmounted or aborted)");
          }
          h.stopping = true; // the close that follows is no death
          h.markExited();
        } else h.settle(m);
      };
      worker.onerror = (ev) => ended(ev.message);
      // Every end of the thread, a crash without a message included (process.exit, a native fault).
      worker.addEventListener("close", (ev) => {
        h.ledger.closeAll(); // nothing runs on the thread now: its fds are nobody's
        h.markThreadEnded();
        ended(`its thread ended (exit code ${(ev as CloseEvent).code})`);
      });
    });
    worker.postMessage({ type: "init", init: { ...init, posted: h.posted, fdLedger: h.ledger.buffer } });
    try {
      await ready;
    } finally {
      clearTimeout(timer);
    }
    return h;
  }

  /** A device with no worker (it could not be brought back): every call fails with `why`. */
  static failed(id: string, why: string): DeviceHandle {
    const h = new DeviceHandle(id, null);
    h.failure = new BlockdError("DeviceFailed", `device ${id} is failed: ${why}`);
    h.markExited();
    return h;
  }

  /** The worker died on its own or is stuck: end it, fail what waits on it, and tell blockd once. */
  private die(why: string): void {
    if (this.failure) return;
    this.failure = new BlockdError("DeviceFailed", `device ${this.id}: ${why}`);
    this.end(this.failure);
    this.onDeath?.(this.failure);
  }

  /** Call `seq` got no answer in time: it fails with Timeout, and the worker counts as dead. */
  private stuck(seq: number, op: DeviceCall, ms: number): void {
    const w = this.waiting.get(seq);
    if (!w) return;
    this.waiting.delete(seq);
    const why = `its worker did not answer ${op} within ${ms} ms`;
    w.reject(new BlockdError("Timeout", `device ${this.id}: ${why}`));
    this.die(why);
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
    const ms = deviceCallTimeout(body.op);
    return new Promise<T>((resolve, reject) => {
      const timer = setTimeout(() => this.stuck(seq, body.op, ms), ms);
      this.waiting.set(seq, {
        resolve: (v) => (clearTimeout(timer), resolve(v)),
        reject: (e) => (clearTimeout(timer), reject(e)),
      });
      Atomics.add(new Int32Array(this.posted), 0, 1);
      worker.postMessage({ seq, body });
      eventfdSignal(this.wakeFd);
    });
  }

  restack(layerPath: string): Promise<{ layerPath: string; config: ImageConfig }> {
    return this.call({ op: "restack", layerPath });
  }
  /**
   * `hold`: a fresh upper the worker opens now (makes, given a size) and keeps for the next attach
   * (a prepared device). `makeUpper`: the config's upper is made fresh, of that size, before it opens.
   */
  async swap(config: ImageConfig | null, readOnly: boolean, hold?: UpperRef & { size?: number }, makeUpper?: number): Promise<void> {
    const r = await this.call<{ size: number }>({ op: "swap", config, readOnly, hold, makeUpper });
    this.size = r.size;
  }
  /** A read-only image's lowers stay open and `above`'s go on top (an acquire onto a device its caller gives up). */
  async extend(above: ImageConfig): Promise<void> {
    const r = await this.call<{ size: number }>({ op: "extend", above });
    this.size = r.size;
  }
  /** The image's lowers stay open; `above`'s lowers, then `upper`, go on top (a prepared pool device being acquired). */
  async attach(upper: UpperRef, above?: ImageConfig): Promise<void> {
    const r = await this.call<{ size: number }>({ op: "attach", upper, above });
    this.size = r.size;
  }
  /** An attach undone: the upper held again at `upper` (its prepared place), the lowers past `keep` closed. */
  async detach(keep: number, upper: UpperRef): Promise<void> {
    const r = await this.call<{ size: number }>({ op: "detach", keep, upper });
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
  traceStart(granule: number, maxEntries: number, forMs: number): Promise<{ size: number; granule: number }> {
    return this.call({ op: "traceStart", granule, maxEntries, forMs });
  }
  traceStop(): Promise<Trace> {
    return this.call({ op: "traceStop" });
  }
  /** Starts replaying `trace` ahead of the guest; answered at once with where it stands. */
  prefetch(trace: Trace): Promise<PrefetchStats & { started: boolean }> {
    return this.call({ op: "prefetch", trace });
  }

  /**
   * Flush and close the image, unmount, end the worker. A dead worker has nothing left to stop, and
   * one that does not answer stop in time is ended as dead (failure says so; the caller unmounts).
   */
  async stop(): Promise<void> {
    if (this.failure) return;
    this.stopping = true;
    try {
      await this.call({ op: "stop" });
    } catch (e) {
      if (this.failure) return;
      throw e;
    }
    await Promise.race([this.exited, Bun.sleep(STOP_EXIT_MS)]);
    this.worker!.terminate();
    await Promise.race([this.threadEnded, Bun.sleep(STOP_EXIT_MS)]); // so a stopped device holds no fd
  }
}
