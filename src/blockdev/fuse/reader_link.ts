// The device worker's side of a FuseReader (reader.ts): the cloned fd, the hand-off rings, the
// Worker. Requests the reader takes are served by the device worker and replied on the clone.

import { eventfd, eventfdSignal, ioctl, open, O_CLOEXEC, O_NONBLOCK, O_RDWR } from "../../../ffi/libc.ts";
import { FUSE_DEV_IOC_CLONE } from "../../../ffi/fuse.ts";
import { closeHeldFd, heldFd } from "../fd_ledger.ts";

/** Int32 fields of the hand-off buffer; the two rings follow. */
export const RING = { takenHead: 0, takenTail: 1, freeHead: 2, freeTail: 3, stop: 4, exited: 5, paused: 6, header: 8 } as const;

/** Ring positions run modulo 2 × slots: equal = empty, and a ring never holds more than every slot. */
export const ringNext = (i: number, slots: number) => (i + 1) % (2 * slots);

export interface ReaderInit {
  /** The cloned, non-blocking /dev/fuse fd. */
  fd: number;
  /** eventfd the device worker polls: "requests taken". */
  takenFd: number;
  /** eventfd this reader polls beside the fuse fd: "stop". */
  stopFd: number;
  /** The slots' memory (the device worker's arena) and where each slot's request buffer is. */
  arena: number;
  arenaLen: number;
  reqAt: number[];
  reqLen: number;
  /** Int32: RING fields, taken ring [slots], free ring [slots]. */
  ctl: SharedArrayBuffer;
}

export function ringBytes(slots: number): number {
  return (RING.header + 2 * slots) * 4;
}

/** The device worker's handle on one reader: slots it lends out, slots it gets back taken. */
export class ReaderLink {
  readonly ctl: Int32Array;
  readonly takenFd = heldFd(eventfd(0));
  private readonly stopFd = heldFd(eventfd(0));
  private readonly worker: Worker;
  private readonly n: number;
  exitReason: string | undefined;
  /**
   * The reader's thread ended without passing through its own exit (a crash): a request it had
   * read may sit in a slot it never handed over, and only a FUSE_NOTIFY_RESEND brings it back.
   */
  stranded = false;

  /** Start a reader on cloneFd (see cloneFd()) lending it the slots whose requests start at reqAt. */
  constructor(
    readonly cloneFd: number,
    arena: { ptr: number; length: number },
    reqAt: number[],
    reqLen: number,
  ) {
    this.n = reqAt.length;
    this.ctl = new Int32Array(new SharedArrayBuffer(ringBytes(this.n)));
    for (let i = 0; i < this.n; i++) this.ctl[RING.header + this.n + i] = i; // every slot starts free
    this.ctl[RING.freeTail] = this.n;
    this.worker = new Worker(new URL("./reader.ts", import.meta.url).href);
    this.worker.addEventListener("message", (ev: MessageEvent) => {
      if (ev.data?.type !== "exited") return;
      this.exitReason = ev.data.reason;
      // The device keeps working on the device worker alone; say why it lost its reader.
      if (this.exitReason?.startsWith("failed")) console.error(`fuse reader on fd ${cloneFd}: ${this.exitReason}`);
    });
    // A reader that never ran (its script failed) must not keep the device worker waiting for it.
    this.worker.addEventListener("error", (ev: ErrorEvent) => {
      this.exitReason = `failed: ${ev.message}`;
      Atomics.store(this.ctl, RING.exited, 1);
      eventfdSignal(this.takenFd);
    });
    // Every end of the thread; one that did not mark itself exited crashed mid-stream.
    this.worker.addEventListener("close", (ev) => {
      if (Atomics.load(this.ctl, RING.exited) === 1) return;
      this.stranded = true;
      this.exitReason = `died (exit code ${(ev as CloseEvent).code})`;
      console.error(`fuse reader on fd ${cloneFd}: ${this.exitReason}; its requests are resent to the device worker`);
      Atomics.store(this.ctl, RING.exited, 1);
      eventfdSignal(this.takenFd);
    });
    const init: ReaderInit = { fd: cloneFd, takenFd: this.takenFd, stopFd: this.stopFd, arena: arena.ptr, arenaLen: arena.length, reqAt, reqLen, ctl: this.ctl.buffer as SharedArrayBuffer };
    this.worker.postMessage(init);
  }

  /** A new fd on the connection of `fuseFd` (FUSE_DEV_IOC_CLONE), non-blocking like it. */
  static cloneFd(fuseFd: number): number {
    const fd = heldFd(open("/dev/fuse", O_RDWR | O_CLOEXEC | O_NONBLOCK));
    try {
      ioctl(fd, FUSE_DEV_IOC_CLONE, new Uint32Array([fuseFd]), "FUSE_DEV_IOC_CLONE");
    } catch (e) {
      closeHeldFd(fd);
      throw e;
    }
    return fd;
  }

  /** Slot numbers the reader has taken requests into since the last call, in order. */
  drainTaken(into: (slot: number) => void): void {
    const ctl = this.ctl;
    let head = Atomics.load(ctl, RING.takenHead);
    const tail = Atomics.load(ctl, RING.takenTail);
    while (head !== tail) {
      into(Atomics.load(ctl, RING.header + (head % this.n)));
      head = ringNext(head, this.n);
    }
    Atomics.store(ctl, RING.takenHead, head);
  }

  /** Lend a served slot back to the reader. */
  giveBack(slot: number): void {
    const ctl = this.ctl;
    const tail = Atomics.load(ctl, RING.freeTail);
    Atomics.store(ctl, RING.header + this.n + (tail % this.n), slot);
    Atomics.store(ctl, RING.freeTail, ringNext(tail, this.n));
    Atomics.notify(ctl, RING.freeTail);
  }

  /** Ask the reader to take no request until resume() (it leaves the rest to the device worker). */
  pause(): void {
    Atomics.store(this.ctl, RING.paused, 1);
  }

  resume(): void {
    Atomics.store(this.ctl, RING.paused, 0);
    Atomics.notify(this.ctl, RING.paused);
  }

  get exited(): boolean {
    return Atomics.load(this.ctl, RING.exited) === 1;
  }

  /** Ask the reader to stop taking requests; `exited` turns true (and takenFd fires) once it has. */
  stop(): void {
    Atomics.store(this.ctl, RING.stop, 1);
    Atomics.notify(this.ctl, RING.freeTail);
    Atomics.notify(this.ctl, RING.paused);
    eventfdSignal(this.stopFd);
  }

  /** After `exited`: release the worker and the eventfds (the clone fd is the caller's). */
  close(): void {
    void this.worker.terminate();
    closeHeldFd(this.takenFd);
    closeHeldFd(this.stopFd);
  }
}
