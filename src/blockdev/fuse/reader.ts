// FuseReader: a Bun Worker that takes FUSE requests off a cloned /dev/fuse fd into its share of
// the device's slots and hands them to the device worker, which serves them and replies on the
// same fd (the kernel matches a reply to the fd its request came from). Taking a WRITE request
// is the kernel's copy of its payload; doing it here leaves the device worker's thread to the
// image, which is what bounds a device's sequential write throughput (profiled: the copy was
// half of that thread's time).
//
// Hand-off: two single-producer rings of slot numbers in a SharedArrayBuffer (taken: reader →
// device worker, woken by an eventfd it polls; free: device worker → reader, Atomics.wait).

import { eventfdSignal, poll, read, viewAt, POLLIN, type SyscallError } from "../../../ffi/libc.ts";
import { RING, ringNext, type ReaderInit } from "./reader_link.ts";
import { crashThread, faultArg } from "../fault.ts";

declare const self: Worker;

self.onmessage = (ev: MessageEvent) => {
  const init = ev.data as ReaderInit;
  let reason = "stopped";
  try {
    reason = run(init);
  } catch (e) {
    reason = `failed: ${(e as Error).message}`;
  }
  const ctl = new Int32Array(init.ctl);
  Atomics.store(ctl, RING.exited, 1);
  eventfdSignal(init.takenFd); // the device worker may be asleep in poll
  self.postMessage({ type: "exited", reason });
};

function run(init: ReaderInit): string {
  const ctl = new Int32Array(init.ctl);
  const n = init.reqAt.length;
  const mem = viewAt(init.arena, init.arenaLen);
  const reqs = init.reqAt.map((at) => mem.subarray(at, at + init.reqLen));
  const taken = RING.header;
  const free = RING.header + n;
  const crashAfter = Number(faultArg("reader-exit") ?? 0); // tests: die holding a request (fault.ts)
  let takenCount = 0;
  const pollfds = new Uint8Array(16);
  const pv = new DataView(pollfds.buffer);
  pv.setInt32(0, init.fd, true);
  pv.setInt16(4, POLLIN, true);
  pv.setInt32(8, init.stopFd, true);
  pv.setInt16(12, POLLIN, true);
  for (;;) {
    if (Atomics.load(ctl, RING.stop)) return "stopped";
    // Paused (no large WRITE lately): small requests are cheaper read by the device worker itself.
    if (Atomics.load(ctl, RING.paused)) {
      Atomics.wait(ctl, RING.paused, 1, 1000);
      continue;
    }
    // A free slot first: with none, wait for the device worker to hand one back.
    const head = Atomics.load(ctl, RING.freeHead);
    if (head === Atomics.load(ctl, RING.freeTail)) {
      Atomics.wait(ctl, RING.freeTail, head, 1000);
      continue;
    }
    const slot = Atomics.load(ctl, free + (head % n));
    pv.setInt16(6, 0, true);
    pv.setInt16(14, 0, true);
    if (poll(pollfds, 2, -1) <= 0) continue;
    if (pv.getInt16(14, true) !== 0) return "stopped";
    if (Atomics.load(ctl, RING.paused)) continue; // paused while it waited: the request is the device worker's
    let got: number;
    try {
      got = read(init.fd, reqs[slot]!);
    } catch (e) {
      const code = (e as SyscallError).code;
      if (code === "EAGAIN" || code === "ENOENT") continue; // the device worker took it first / interrupted
      if (code === "ENODEV" || code === "ECONNABORTED") return "gone";
      throw e;
    }
    if (got <= 0) continue;
    if (++takenCount === crashAfter) crashThread(`a FUSE reader, after taking request ${takenCount}`);
    Atomics.store(ctl, RING.freeHead, ringNext(head, n));
    const tail = Atomics.load(ctl, RING.takenTail);
    Atomics.store(ctl, taken + (tail % n), slot);
    Atomics.store(ctl, RING.takenTail, ringNext(tail, n));
    eventfdSignal(init.takenFd);
  }
}
