// The kernel relay's thread (splice_relay.ts): waits in epoll_wait on the sockets of the slots it
// runs (edge-triggered) and on the wake eventfd, and moves each direction's bytes with splice(2):
// socket → its pipe → the other socket. A direction whose source ended is shut down on its
// destination once its pipe is empty; a slot whose two directions are shut down is "done".

import { E, close, errnoName, read as readFd } from "../../ffi/libc.ts";
import {
  EPOLLET,
  EPOLLIN,
  EPOLLOUT,
  EPOLLRDHUP,
  EPOLL_CTL_ADD,
  EPOLL_CTL_DEL,
  EPOLL_EVENT_SIZE,
  SHUT_WR,
  SPLICE_F_MOVE,
  SPLICE_F_NONBLOCK,
  epollCreate,
  epollCtl,
  epollWait,
  pipe,
  setPipeSize,
  shutdown,
  splice,
} from "../../ffi/socket.ts";
import { CTL, ENDED_AB, ENDED_BA, S, SLOT, bitmapWords, slotAt, type RelayInit } from "./splice_relay.ts";

declare const self: Worker;

/**
 * Bytes in flight per direction (the pipe's size), as the JavaScript relay's 1 MiB high-water mark;
 * a 64 MiB download then takes about 60 wake-ups, near 1 MiB per splice.
 */
const PIPE_BYTES = 1 << 20;
/** Events taken per epoll_wait. */
const MAX_EVENTS = 256;
/** The wake eventfd's tag; a socket's is its slot. */
const WAKE = 0xffffffff;
/** Idle slots are looked for this often. */
const IDLE_CHECK_MS = 1000;

interface Dir {
  from: number;
  to: number;
  r: number;
  w: number;
  inPipe: number;
  eof: boolean;
  shut: boolean;
}

interface Relay {
  slot: number;
  a: number;
  b: number;
  ab: Dir;
  ba: Dir;
  last: number;
}

self.onmessage = (ev: MessageEvent) => {
  const init = ev.data as RelayInit;
  let reason = "stopped";
  try {
    run(init);
  } catch (e) {
    reason = `failed: ${(e as Error).message}`;
  }
  self.postMessage({ type: "exited", reason });
};

function run(init: RelayInit): void {
  const ctl = new Int32Array(init.ctl);
  const relays: (Relay | undefined)[] = new Array(init.slots).fill(undefined);
  let running = 0;
  const ep = epollCreate();
  const events = new Uint8Array(MAX_EVENTS * EPOLL_EVENT_SIZE);
  const ev = new DataView(events.buffer);
  const counter = new Uint8Array(8);
  let lastIdleCheck = Date.now();

  /** Lets the slot go: out of epoll (Bun's fds keep the sockets, and their registrations, alive), its fds closed, one message to main. */
  const end = (slot: number, reason: string) => {
    const at = slotAt(init.slots, slot);
    const r = relays[slot];
    if (r) {
      relays[slot] = undefined;
      running--;
      for (const fd of [r.a, r.b]) {
        try {
          epollCtl(ep, EPOLL_CTL_DEL, fd);
        } catch {} // never added (start failed there)
      }
      for (const fd of [r.ab.r, r.ab.w, r.ba.r, r.ba.w]) close(fd);
    }
    // Asked to drop meanwhile: main closed the connection, whatever ended it here.
    if (Atomics.exchange(ctl, at + SLOT.state, S.ended) === S.drop) reason = "dropped";
    // "done": the duplicates are main's to close once Bun let its own fds go (SpliceRelay.release).
    if (reason !== "done") {
      close(ctl[at + SLOT.a]!);
      close(ctl[at + SLOT.b]!);
    }
    self.postMessage({ type: "ended", slot, reason });
  };

  const start = (slot: number) => {
    const at = slotAt(init.slots, slot);
    const a = ctl[at + SLOT.a]!;
    const b = ctl[at + SLOT.b]!;
    const ab = (ctl[at + SLOT.ended]! & ENDED_AB) !== 0;
    const ba = (ctl[at + SLOT.ended]! & ENDED_BA) !== 0;
    const pipes: number[] = [];
    try {
      for (let i = 0; i < 2; i++) {
        const [r, w] = pipe();
        pipes.push(r, w);
        try {
          setPipeSize(w, PIPE_BYTES);
        } catch {} // the default 64 KiB still relays, in more calls
      }
    } catch (e) {
      for (const fd of pipes) close(fd);
      return end(slot, `pipe: ${(e as Error).message}`);
    }
    const r: Relay = {
      slot, a, b, last: Date.now(),
      ab: { from: a, to: b, r: pipes[0]!, w: pipes[1]!, inPipe: 0, eof: ab, shut: ab },
      ba: { from: b, to: a, r: pipes[2]!, w: pipes[3]!, inPipe: 0, eof: ba, shut: ba },
    };
    relays[slot] = r;
    running++;
    try {
      epollCtl(ep, EPOLL_CTL_ADD, a, EPOLLIN | EPOLLOUT | EPOLLRDHUP | EPOLLET, slot);
      epollCtl(ep, EPOLL_CTL_ADD, b, EPOLLIN | EPOLLOUT | EPOLLRDHUP | EPOLLET, slot);
    } catch (e) {
      return end(slot, (e as Error).message);
    }
    pump(r);
  };

  /** Moves what each direction can now; ends the slot when both are shut down or one fails. */
  const pump = (r: Relay) => {
    const failed = move(r.ab) ?? move(r.ba);
    if (failed) return end(r.slot, failed);
    r.last = Date.now();
    if (r.ab.shut && r.ba.shut) end(r.slot, "done");
  };

  /** Looks at the slots main marked dirty. */
  const scan = () => {
    for (let w = 0; w < bitmapWords(init.slots); w++) {
      let bits = Atomics.exchange(ctl, CTL.header + w, 0);
      while (bits) {
        const bit = 31 - Math.clz32(bits);
        bits &= ~(1 << bit);
        const slot = w * 32 + bit;
        const state = Atomics.load(ctl, slotAt(init.slots, slot) + SLOT.state);
        if (state === S.add && !relays[slot]) {
          if (Atomics.compareExchange(ctl, slotAt(init.slots, slot) + SLOT.state, S.add, S.running) === S.add) start(slot);
          else end(slot, "dropped");
        } else if (state === S.drop) end(slot, "dropped");
      }
    }
  };

  epollCtl(ep, EPOLL_CTL_ADD, init.wake, EPOLLIN, WAKE);
  self.postMessage({ type: "ready" });
  try {
    while (!Atomics.load(ctl, CTL.stop)) {
      const n = epollWait(ep, events, MAX_EVENTS, running ? IDLE_CHECK_MS : -1);
      let woken = false;
      for (let i = 0; i < n; i++) {
        const tag = ev.getUint32(i * EPOLL_EVENT_SIZE + 4, true);
        if (tag === WAKE) {
          woken = true;
          continue;
        }
        const r = relays[tag];
        if (r) pump(r);
      }
      if (woken) {
        readFd(init.wake, counter);
        scan();
      }
      const now = Date.now();
      if (running && now - lastIdleCheck >= IDLE_CHECK_MS) {
        lastIdleCheck = now;
        for (const r of relays) if (r && now - r.last > init.idleMs) end(r.slot, "idle");
      }
    }
  } finally {
    for (let slot = 0; slot < init.slots; slot++) {
      const state = Atomics.load(ctl, slotAt(init.slots, slot) + SLOT.state);
      if (state !== S.add && state !== S.running && state !== S.drop) continue;
      try {
        end(slot, "stopped");
      } catch {} // the others still get theirs
    }
    close(ep);
  }
}

/** One direction: the pipe into the destination, the source into the pipe, until neither moves; an error's text, else undefined. */
function move(d: Dir): string | undefined {
  for (;;) {
    let moved = false;
    if (d.inPipe > 0) {
      const n = splice(d.r, d.to, d.inPipe, SPLICE_F_MOVE | SPLICE_F_NONBLOCK);
      if (n > 0) {
        d.inPipe -= n;
        moved = true;
      } else if (n !== -E.EAGAIN) return `writing: ${errnoName(-n)}`;
    }
    if (!d.eof && d.inPipe < PIPE_BYTES) {
      const n = splice(d.from, d.w, PIPE_BYTES - d.inPipe, SPLICE_F_MOVE | SPLICE_F_NONBLOCK);
      if (n > 0) {
        d.inPipe += n;
        moved = true;
      } else if (n === 0) {
        d.eof = true;
        moved = true;
      } else if (n !== -E.EAGAIN) return `reading: ${errnoName(-n)}`;
    }
    if (!moved) break;
  }
  if (d.eof && d.inPipe === 0 && !d.shut) {
    d.shut = true;
    const e = shutdown(d.to, SHUT_WR);
    if (e < 0) return `shutdown: ${errnoName(-e)}`;
  }
  return undefined;
}
