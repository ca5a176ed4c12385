// The domain proxy's kernel relay: a connection carried as it is ("pass") moves, once it has
// carried SPLICE_AFTER bytes, to one Worker (splice_worker.ts) that passes its bytes with splice(2)
// through a pipe per direction: socket to pipe to socket, no copy into or out of user memory and
// none through the JavaScript thread. Through JavaScript each read is a copy out of the kernel, a
// fresh Buffer (page faults included) and a copy back in: the proxy spends 0.64 ms of CPU per MB
// relayed that way, 0.34 ms this way (bench/network's downloads, where the client and the server
// share the machine's 2 cores with it).
//
// Hand-over: Bun keeps its sockets, paused (it reads nothing, not even the FIN, while paused); the
// worker gets duplicates of their fds. The table of slots lives in a SharedArrayBuffer: a slot's
// state, its two fds; a dirty bitmap says which slots changed, an eventfd wakes the worker. The
// worker posts one message per slot when it lets the slot go (`ended`), and only then is it free.

import { close, eventfd, eventfdSignal } from "../../ffi/libc.ts";
import { dupFd, lingerOff } from "../../ffi/socket.ts";

/**
 * Bytes a connection carries through JavaScript before it moves to the kernel relay: the hand-over
 * (~20 system calls, two thread hops) costs a new connection 0.08 ms (bench/network's GET / p50
 * 0.39 ms when every connection moves, 0.31 ms with this), which a short exchange does not win back.
 */
export const SPLICE_AFTER = 256 << 10;

/** Int32 fields of the shared table: stop, then the dirty bitmap, then SLOT_INTS per slot. */
export const CTL = { stop: 0, header: 4 } as const;
export const SLOT_INTS = 4;
/** A slot: its state, the two fds, and which directions already ended (ENDED_AB: a's FIN passed on to b, ENDED_BA). */
export const SLOT = { state: 0, a: 1, b: 2, ended: 3 } as const;
export const ENDED_AB = 1;
export const ENDED_BA = 2;
/** A slot's states: main writes FREE → ADD and ADD|RUNNING → DROP; the worker ADD → RUNNING and any → ENDED. */
export const S = { free: 0, add: 1, running: 2, drop: 3, ended: 4 } as const;

export const bitmapWords = (slots: number) => Math.ceil(slots / 32);
export const slotAt = (slots: number, slot: number) => CTL.header + bitmapWords(slots) + slot * SLOT_INTS;

export interface RelayInit {
  ctl: SharedArrayBuffer;
  slots: number;
  wake: number;
  /** A relayed connection idle this long is ended. */
  idleMs: number;
}

/** Why the worker let a slot go: "done" (both directions ended and shut down), else an error, "idle", "dropped" or "stopped"; the owner closes the connection's sockets before it returns. */
export type RelayEnd = (reason: string) => void;

export class SpliceRelay {
  private readonly ctl: Int32Array;
  private readonly wake = eventfd(0);
  private readonly worker: Worker;
  private readonly owners: (RelayEnd | undefined)[];
  /** Free slot numbers: at most `slots`. */
  private readonly free: number[];
  private ready = false;
  /** Takes no more: stopping, or its thread is gone. */
  private closed = false;
  /** The worker exited or died. */
  private dead = false;

  constructor(private readonly slots: number, idleMs: number) {
    this.ctl = new Int32Array(new SharedArrayBuffer((CTL.header + bitmapWords(slots) + slots * SLOT_INTS) * 4));
    this.owners = new Array(slots).fill(undefined);
    this.free = Array.from({ length: slots }, (_, i) => slots - 1 - i);
    this.worker = new Worker(new URL("./splice_worker.ts", import.meta.url).href);
    this.worker.unref();
    this.worker.addEventListener("message", (ev: MessageEvent) => {
      const m = ev.data as { type: "ready" } | { type: "ended"; slot: number; reason: string } | { type: "exited"; reason: string };
      if (m.type === "ready") this.ready = true;
      else if (m.type === "ended") this.release(m.slot, m.reason);
      else this.gone(m.reason);
    });
    this.worker.addEventListener("error", (ev: ErrorEvent) => this.gone(`failed: ${ev.message}`));
    this.worker.addEventListener("close", () => this.gone("its thread ended"));
    const init: RelayInit = { ctl: this.ctl.buffer as SharedArrayBuffer, slots, wake: this.wake, idleMs };
    this.worker.postMessage(init);
  }

  /** Whether take() can succeed now. */
  get available(): boolean {
    return this.ready && !this.closed && this.free.length > 0;
  }

  /**
   * Relays the sockets `a` and `b` (their fds; the caller has paused both and written all it read)
   * from now on, but for the directions in `ended` (ENDED_AB, ENDED_BA: their FIN passed on already);
   * `onEnd` is called once when the relay lets them go. Returns the slot, or -1 when the relay
   * cannot take them (not started yet, failed, every slot taken): carry on in JavaScript.
   */
  take(a: number, b: number, ended: number, onEnd: RelayEnd): number {
    if (!this.available) return -1;
    let da = -1;
    let db = -1;
    try {
      da = dupFd(a);
      db = dupFd(b);
    } catch {
      if (da >= 0) close(da);
      return -1;
    }
    const slot = this.free.pop()!;
    const at = slotAt(this.slots, slot);
    this.ctl[at + SLOT.a] = da;
    this.ctl[at + SLOT.b] = db;
    this.ctl[at + SLOT.ended] = ended;
    this.owners[slot] = onEnd;
    Atomics.store(this.ctl, at + SLOT.state, S.add);
    this.poke(slot);
    return slot;
  }

  /** Ends the relay of `slot` (its onEnd is then called with "dropped" unless it ended first). */
  drop(slot: number): void {
    const at = slotAt(this.slots, slot) + SLOT.state;
    if (Atomics.compareExchange(this.ctl, at, S.add, S.drop) === S.add || Atomics.compareExchange(this.ctl, at, S.running, S.drop) === S.running) this.poke(slot);
  }

  /** Takes no more; the worker ends every slot ("stopped") and exits. */
  stop(): void {
    if (this.closed) return; // stopped, or the worker is gone (and the eventfd closed)
    this.closed = true;
    Atomics.store(this.ctl, CTL.stop, 1);
    eventfdSignal(this.wake);
  }

  private poke(slot: number): void {
    Atomics.or(this.ctl, CTL.header + (slot >> 5), 1 << (slot & 31));
    eventfdSignal(this.wake);
  }

  /**
   * The worker let `slot` go. After "done" its duplicates are ours: closed once the owner has closed
   * Bun's sockets (terminate() sets SO_LINGER to reset), with the linger off, so the last close
   * sends what the kernel still holds rather than a reset that drops it.
   */
  private release(slot: number, reason: string): void {
    const at = slotAt(this.slots, slot);
    const onEnd = this.owners[slot];
    this.owners[slot] = undefined;
    try {
      onEnd?.(reason);
    } finally {
      if (reason === "done") {
        for (const fd of [this.ctl[at + SLOT.a]!, this.ctl[at + SLOT.b]!]) {
          try {
            lingerOff(fd);
          } catch {} // the socket is gone already: close it all the same
          try {
            close(fd);
          } catch {}
        }
      }
      Atomics.store(this.ctl, at + SLOT.state, S.free);
      this.free.push(slot);
    }
  }

  /**
   * The worker exited (having ended its slots) or died: a slot it still held gets its fds closed
   * here (one it had ended, they are closed or lost with it), and its connection ended.
   */
  private gone(why: string): void {
    if (this.dead) return;
    if (!this.closed) console.error(`egress: the splice relay stopped (${why}); connections are relayed in JavaScript`);
    this.dead = this.closed = true;
    for (let slot = 0; slot < this.slots; slot++) {
      if (!this.owners[slot]) continue;
      const at = slotAt(this.slots, slot);
      if (Atomics.load(this.ctl, at + SLOT.state) !== S.ended) {
        for (const fd of [this.ctl[at + SLOT.a]!, this.ctl[at + SLOT.b]!]) {
          try {
            close(fd);
          } catch {}
        }
      }
      this.release(slot, why);
    }
    close(this.wake);
    void this.worker.terminate(); // its loop has returned, or it died
  }
}
