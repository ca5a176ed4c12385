// FdLedger: the fds a device worker's thread holds, kept in shared memory its parent reads once the
// thread is gone. Fds are process-wide, so a worker that crashes or is ended leaves its eventfds,
// I/O ring, layer files and /dev/fuse fds open for blockd's life unless blockd closes them. It does,
// and only after the thread has ended: closing a number a live thread still uses could hand that
// number to another device's file.
//
// One writer (the thread, through heldFd/closeHeldFd), one reader (blockd, after the thread ended).
// An fd leaves the ledger before it is closed, so a crash between the two leaks it: never closes a
// number that belongs to someone else.

import { close } from "../../ffi/libc.ts";
import { watchLocalFds } from "../storage/local_file.ts";

/** Fds one worker may hold: 255 lowers + an upper's two files per image, two images during a swap, and the rest. */
export const FD_LEDGER_SLOTS = 1024;

export class FdLedger {
  /** fd + 1 per slot; 0 = free. */
  private readonly slots: Int32Array;
  private warnedFull = false;

  constructor(readonly buffer = new SharedArrayBuffer(FD_LEDGER_SLOTS * 4)) {
    this.slots = new Int32Array(buffer);
  }

  hold(fd: number): void {
    if (!Number.isInteger(fd) || fd < 0) throw new Error(`fd ledger: ${fd} is not an fd`);
    const at = this.slots.indexOf(0);
    if (at < 0) {
      if (!this.warnedFull) console.error(`blockd: fd ledger full (${FD_LEDGER_SLOTS}): fd ${fd} and later ones stay open if this thread dies`);
      this.warnedFull = true;
      return;
    }
    Atomics.store(this.slots, at, fd + 1);
  }

  release(fd: number): void {
    const at = this.slots.indexOf(fd + 1);
    if (at >= 0) Atomics.store(this.slots, at, 0);
  }

  held(): number[] {
    const fds: number[] = [];
    for (let i = 0; i < this.slots.length; i++) {
      const v = Atomics.load(this.slots, i);
      if (v) fds.push(v - 1);
    }
    return fds;
  }

  /** The thread is gone: close every fd it still held and empty the ledger. Returns how many. */
  closeAll(): number {
    const fds = this.held();
    for (const fd of fds) {
      this.release(fd);
      try {
        close(fd);
      } catch (e) {
        console.error(`blockd: closing fd ${fd} of an ended worker: ${(e as Error).message}`);
      }
    }
    return fds.length;
  }
}

// This thread's ledger: a device worker installs one; blockd's main thread has none.
let current: FdLedger | undefined;

/** Record this thread's fds in `ledger` from now on, its local files' and I/O ring's included. */
export function installFdLedger(ledger: FdLedger): void {
  current = ledger;
  watchLocalFds(ledger);
}

/** `fd`, recorded as this thread's (a no-op on a thread without a ledger). */
export function heldFd(fd: number): number {
  current?.hold(fd);
  return fd;
}

/** Take `fd` off this thread's ledger, just before something else closes it. */
export function forgetHeldFd(fd: number): void {
  current?.release(fd);
}

/** Close one of this thread's fds, taking it off the ledger first. */
export function closeHeldFd(fd: number): void {
  forgetHeldFd(fd);
  close(fd);
}
