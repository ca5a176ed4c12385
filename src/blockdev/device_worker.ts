// The device worker: one Bun Worker per device. It owns the device's Image and runs the
// frontend's serve loop on its own thread; blockd's main thread sends it control work (restack,
// swap, resize, stop) as messages and wakes it through an eventfd the loop polls.

import { eventfd } from "../../ffi/libc.ts";
import { Image } from "../storage/image.ts";
import type { ImageConfig, UpperRef } from "../storage/image_config.ts";
import { WritableLayer } from "../storage/lsmt/writable_layer.ts";
import type { DeviceIo, WakeSource } from "./device_io.ts";
import { FuseDisk } from "./fuse/server.ts";
import { UblkQueue } from "./ublk/queue.ts";
import type { UblkQueueSpec } from "./ublk/frontend.ts";
import { IoRangeError } from "../storage/errors.ts";
import { IoLimiter } from "../storage/io_limiter.ts";
import { crashThread, faultArg, hangThread } from "./fault.ts";
import { FdLedger, closeHeldFd, heldFd, installFdLedger } from "./fd_ledger.ts";
import { type Trace, TraceError } from "../storage/trace_file.ts";
import { Prefetcher, type PrefetchStats, TraceRecorder } from "./trace.ts";

declare const self: Worker;

export interface WorkerInit {
  id: string;
  frontend: "fuse" | "ublk";
  /** ublk: the queue this worker serves (the device is made by blockd's main thread). */
  ublk?: UblkQueueSpec;
  path: string;
  readOnly: boolean;
  config: ImageConfig | null; // null: an empty pool device, size 0 until acquired
  /** SharedArrayBuffer Int32[1]: how many control messages main has posted. */
  posted: SharedArrayBuffer;
  /** FdLedger.buffer: every fd this thread holds, for blockd to close once the thread is gone. */
  fdLedger: SharedArrayBuffer;
  /** The node-wide remote-I/O budget (IoLimiter.shared), separate from this device's own work. */
  remoteIo: SharedArrayBuffer;
  /** A live FUSE connection to serve (taken back from the fd keeper) instead of mounting anew. */
  adoptFd?: number;
  /** With adoptFd: the dead server's reader clone on that connection, if it had one. */
  adoptCloneFd?: number;
}

export type ControlOp =
  | { op: "restack"; layerPath: string }
  | { op: "swap"; config: ImageConfig | null; readOnly: boolean; hold?: UpperRef & { size?: number }; makeUpper?: number }
  | { op: "attach"; upper: UpperRef; above?: ImageConfig }
  | { op: "detach"; keep: number; upper: UpperRef }
  | { op: "extend"; above: ImageConfig }
  | { op: "resize"; size: number }
  | { op: "flush" }
  | { op: "traceStart"; granule: number; maxEntries: number; forMs: number }
  | { op: "traceStop" }
  | { op: "prefetch"; trace: Trace }
  | { op: "stats" }
  | { op: "stop" };

/** The device as a frontend sees it: the current image, or an empty disk while pooled. */
class ImageIo implements DeviceIo {
  /** A trace being recorded of the guest's first reads (traceStart..traceStop). */
  recorder: TraceRecorder | undefined;
  /** A trace being replayed ahead of the guest, and what the last one of this image did. */
  prefetcher: Prefetcher | undefined;
  lastPrefetch: PrefetchStats | undefined;
  /** Set while either is: the read path's one extra test otherwise. */
  private watched = false;
  private readonly guestDone = () => {
    const p = this.prefetcher;
    if (p && --p.guestInFlight >= 0) p.pump();
  };

  constructor(
    public image: Image | null,
    public readOnly: boolean,
  ) {}
  size(): number {
    return this.image?.virtualSize ?? 0;
  }
  read(buf: Uint8Array, offset: number): Promise<void> {
    if (!this.image) return Promise.reject(new IoRangeError("no image attached", "device", offset));
    if (!this.watched) return this.image.read(buf, offset);
    if (this.recorder && !this.recorder.note(offset, buf.length)) this.watch();
    const p = this.prefetcher;
    if (p && !p.stats.active) {
      // It has ended: what it did stays for stats, and reads are not watched for it any more.
      this.lastPrefetch = p.stats;
      this.prefetcher = undefined;
      this.watch();
    }
    if (!p?.stats.active) return this.image.read(buf, offset);
    p.guestRead(offset, buf.length);
    p.guestInFlight++;
    const r = this.image.read(buf, offset);
    r.then(this.guestDone, this.guestDone);
    return r;
  }
  /** Recompute whether reads are watched (a recorder that ended stays, for traceStop to collect). */
  watch(): void {
    this.watched = !!(this.recorder && !this.recorder.ended) || !!this.prefetcher?.stats.active;
  }
  /** Reads through the image for prefetch: not the guest's, so neither recorded nor counted. */
  readonly prefetchRead = (buf: Uint8Array, offset: number): Promise<void> =>
    this.image ? this.image.read(buf, offset) : Promise.reject(new IoRangeError("no image attached", "device", offset));
  /** Before the image closes or changes: prefetch stops (its reads settle), a recording is dropped. */
  async unwatch(): Promise<void> {
    this.recorder = undefined;
    const p = this.prefetcher;
    this.prefetcher = undefined;
    this.lastPrefetch = undefined;
    this.watch();
    await p?.stop();
  }
  write(buf: Uint8Array, offset: number): Promise<void> {
    if (!this.image || this.readOnly) return Promise.reject(new IoRangeError("device is read-only", "device", offset));
    return this.image.write(buf, offset);
  }
  flush(): Promise<void> {
    return this.image && !this.readOnly ? this.image.flush() : Promise.resolve();
  }
  discard(offset: number, length: number): Promise<void> {
    if (!this.image || this.readOnly) return Promise.reject(new IoRangeError("device is read-only", "device", offset));
    return this.image.discard(offset, length);
  }
}

let init: WorkerInit;
let io: ImageIo;
let disk: FuseDisk | undefined; // FUSE frontend only
let stopping = false;
let remoteIo: IoLimiter;
/**
 * A prepared device's fresh upper, made and put over the lowers at prepare time, so an acquire of
 * exactly that stack only renames its folder (the worker learns the new paths after the fact: it
 * writes through the open files, and later control ops queue behind the news).
 */
let heldUpper: WritableLayer | undefined;
let received = 0;
const queue: { seq: number; body: ControlOp }[] = [];

async function runControl(body: ControlOp): Promise<unknown> {
  switch (body.op) {
    case "restack": {
      if (!io.image) throw new IoRangeError("no image attached", init.id);
      const layerPath = await io.image.restack(body.layerPath);
      return { layerPath, config: io.image.config() };
    }
    case "swap": {
      await io.unwatch(); // a trace is of one image
      const old = io.image;
      if (heldUpper && old?.upper !== heldUpper) await heldUpper.close(); // an attached one closes with the image
      heldUpper = undefined;
      // makeUpper: the config's upper is made fresh, of that size, first (here, not on blockd's loop).
      const up = body.config?.upper;
      if (body.makeUpper && up) await (await WritableLayer.create(up.data, up.index, { virtualSize: body.makeUpper, sparse: false })).close();
      io.image = body.config ? await Image.open(body.config, { remoteIo }) : null;
      io.readOnly = body.readOnly;
      if (old) await old.close();
      // With a size the upper is made here: its file creations block this thread, not blockd's.
      const hold = body.hold;
      if (hold && io.image) {
        heldUpper = hold.size ? await WritableLayer.create(hold.data, hold.index, { virtualSize: hold.size, sparse: false }) : await WritableLayer.open(hold.data, hold.index);
        io.image.attachUpper(heldUpper);
        io.readOnly = false; // nobody has the device before its acquire
      }
      disk?.invalidate();
      if (!io.image) {
        // Back in the pool: what its requests and its image's heap held goes back (docs/blockd.md, Shape).
        disk?.trimIdle();
        Bun.gc(true);
      }
      return { size: io.size() };
    }
    case "attach": {
      // A prepared pool device being acquired: its held upper (over its lowers since prepare) is
      // at `upper`'s paths now; `above`'s lowers (if any) go between. A failure leaves the image as it was.
      const image = io.image;
      const held = heldUpper;
      if (!image || !held || image.upper !== held) throw new IoRangeError("attach needs a prepared device (lowers and its held upper)", init.id);
      const keep = image.lowers.length;
      const heldAt = [held.dataPath, held.indexPath] as const;
      const above = body.above ? await Image.openLowers(body.above, 0, { remoteIo }) : [];
      try {
        if (above.length) {
          image.detachUpper(keep);
          try {
            image.attachUpper(held, above); // checks before it changes anything
          } catch (e) {
            image.attachUpper(held);
            throw e;
          }
        }
        held.moved(body.upper.data, body.upper.index);
        heldUpper = undefined;
      } catch (e) {
        held.moved(...heldAt);
        for (const l of above) await l.close();
        throw e;
      }
      disk?.invalidate();
      return { size: io.size() };
    }
    case "detach": {
      // An attach undone (its acquire did not go on): the upper is held again at `upper`'s paths,
      // still over the lowers; those it stacked above the first `keep` are closed: a prepared device again.
      if (!io.image) throw new IoRangeError("no image attached", init.id);
      const { upper, above } = io.image.detachUpper(body.keep);
      io.image.attachUpper(upper);
      upper.moved(body.upper.data, body.upper.index);
      heldUpper = upper;
      for (const l of above) await l.close();
      disk?.invalidate();
      return { size: io.size() };
    }
    case "extend": {
      // A read-only image nobody maps grows by `above`'s lowers on top (an acquire onto it). A
      // failure leaves it as it was.
      const image = io.image;
      if (!image || !io.readOnly || image.upper) throw new IoRangeError("extend needs a read-only image", init.id);
      const above = await Image.openLowers(body.above, 0, { remoteIo });
      try {
        image.addLowers(above);
      } catch (e) {
        for (const l of above) await l.close();
        throw e;
      }
      await io.unwatch(); // a trace is of one image
      disk?.invalidate();
      return { size: io.size() };
    }
    case "resize":
      if (!io.image || io.readOnly) throw new IoRangeError("device is read-only", init.id);
      await io.image.resize(body.size);
      disk?.invalidate();
      return { size: io.size() };
    case "flush":
      await io.flush();
      return {};
    case "traceStart": {
      if (!io.image) throw new IoRangeError("no image attached", init.id);
      if (io.recorder && !io.recorder.ended) throw new TraceError(`device ${init.id} is recording a trace already`);
      io.recorder = new TraceRecorder(io.size(), body.granule, body.maxEntries, body.forMs);
      io.watch();
      return { size: io.size(), granule: body.granule };
    }
    case "traceStop": {
      const r = io.recorder;
      if (!r) throw new TraceError(`device ${init.id} records no trace`);
      io.recorder = undefined;
      io.watch();
      return r.trace();
    }
    case "prefetch": {
      if (!io.image) throw new IoRangeError("no image attached", init.id);
      if (body.trace.size !== io.size()) throw new TraceError(`the trace is of a ${body.trace.size}-byte device, device ${init.id} has ${io.size()} bytes`);
      // Once per image: the pages and chunks it brought in stay until the image changes (a swap).
      if (io.prefetcher || io.lastPrefetch) return { started: false, ...(io.prefetcher?.stats ?? io.lastPrefetch) };
      const p = new Prefetcher(body.trace, io.prefetchRead, io.size(), (line) => console.error(`blockd: device ${init.id}: ${line}`));
      io.prefetcher = p;
      io.watch();
      p.start();
      return { started: true, ...p.stats };
    }
    case "stats": {
      const pf = io.prefetcher?.stats ?? io.lastPrefetch;
      const prefetch = pf ? { prefetchPlanned: pf.planned, prefetchFetched: pf.fetched, prefetchSkipped: pf.skipped, prefetchBytes: pf.bytes, prefetchErrors: pf.errors, prefetchActive: pf.active ? 1 : 0 } : {};
      return { ...(disk?.stats ?? {}), size: io.size(), ...prefetch, ...(io.recorder ? { traceEntries: io.recorder.entries } : {}) };
    }
    case "stop":
      await io.unwatch();
      stopping = true;
      if (heldUpper && io.image?.upper !== heldUpper) await heldUpper.close(); // an attached one closes with the image
      heldUpper = undefined;
      if (io.image) await io.image.close();
      io.image = null;
      return {};
  }
}

async function drainControl(): Promise<void> {
  // Messages posted before the eventfd write may still be on their way to onmessage. One turn of
  // the event loop delivers them; a timer would also wait out the serve loop's 1 ms poll on every
  // control call (a stats round trip: 0.07 ms this way, 1.16 ms with Bun.sleep(0)).
  const posted = new Int32Array(init.posted);
  while (received < Atomics.load(posted, 0)) await new Promise<void>((r) => setImmediate(r));
  while (queue.length) {
    const { seq, body } = queue.shift()!;
    if (faultArg("worker-exit") === `${init.id}:${body.op}`) crashThread(`device ${init.id}'s worker, asked for ${body.op}`);
    if (faultArg("worker-hang") === `${init.id}:${body.op}`) hangThread(`device ${init.id}'s worker, asked for ${body.op}`);
    try {
      self.postMessage({ seq, ok: true, result: await runControl(body) });
    } catch (e) {
      const err = e as Error;
      self.postMessage({ seq, ok: false, error: { name: err.name, message: err.message } });
    }
  }
}

self.onmessage = async (ev: MessageEvent) => {
  const msg = ev.data;
  if (msg.type === "init") {
    init = msg.init as WorkerInit;
    installFdLedger(new FdLedger(init.fdLedger));
    for (const fd of [init.adoptFd, init.adoptCloneFd]) if (fd !== undefined) heldFd(fd);
    try {
      remoteIo = IoLimiter.attach(init.remoteIo);
      const image = init.config ? await Image.open(init.config, { remoteIo }) : null;
      io = new ImageIo(image, init.readOnly);
      const wakeFd = heldFd(eventfd(0));
      const wake: WakeSource = { fd: wakeFd, onWake: drainControl, stopping: () => stopping };
      if (init.frontend === "ublk") {
        // The kernel binds a ublk queue to the thread that fetched it: this one, for its life.
        const queue = UblkQueue.open(init.ublk!);
        queue.prime();
        self.postMessage({ type: "ready", wakeFd, fuseFds: [], size: io.size() });
        const exit = await queue.run(io, wake);
        queue.close();
        if (exit.reason === "failed") throw exit.error;
      } else {
        const opts = { path: init.path, readOnly: init.readOnly };
        if (init.adoptFd !== undefined) {
          disk = FuseDisk.adopt(init.adoptFd, opts, init.adoptCloneFd);
          disk.resend();
        } else disk = FuseDisk.mount(opts);
        const fuseFds = disk.cloneFd >= 0 ? [disk.fd, disk.cloneFd] : [disk.fd];
        if (faultArg("worker-hang") === `${init.id}:start`) hangThread(`device ${init.id}'s worker, mounted and about to say ready`);
        self.postMessage({ type: "ready", wakeFd, fuseFds, size: io.size() });
        await disk.serve(io, wake);
        disk.unmount();
        disk.close();
      }
      closeHeldFd(wakeFd);
      self.postMessage({ type: "exited" });
    } catch (e) {
      // An adopted connection that no disk took is nobody's: close it (blockd drops the keeper's copy).
      if (!disk && init.adoptFd !== undefined) for (const fd of [init.adoptFd, init.adoptCloneFd]) if (fd !== undefined) closeHeldFd(fd);
      const err = e as Error;
      self.postMessage({ type: "failed", error: { name: err.name, message: err.message } });
    }
    return;
  }
  received++;
  queue.push(msg);
};

