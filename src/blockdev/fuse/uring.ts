// FuseRing: FUSE requests taken and answered over io_uring (FUSE_OVER_IO_URING) instead of read
// and write on /dev/fuse. Each entry is lent to the kernel with REGISTER (a header buffer and a
// payload buffer) and comes back as a completion holding one request; the reply goes out with
// COMMIT_AND_FETCH, which lends the entry again. Replies of a tick share one io_uring_enter, and a
// request costs no read(2) or write(2).
//
// The kernel routes a request to the queue of the CPU its caller runs on (one queue per possible
// CPU) and turns the connection over to the ring only once every queue has an entry. Once it has,
// the connection stays on the ring; FORGET and INTERRUPT (which we ignore) and requests resent by
// FUSE_NOTIFY_RESEND still come through /dev/fuse.

import { readFileSync, writeFileSync } from "node:fs";
import {
  IoUring,
  IORING_CQE_F_MORE,
  IORING_OP_URING_CMD,
  IORING_SETUP_COOP_TASKRUN,
  IORING_SETUP_SINGLE_ISSUER,
  SQE_ADDR,
  SQE_CMD,
  SQE_CMD_OP,
  SQE_FD,
  SQE_LEN,
  SQE_OPCODE,
  SQE_USER_DATA,
} from "../../../ffi/io_uring.ts";
import { E, POLLIN, errnoName, type AlignedBuffer } from "../../../ffi/libc.ts";
import * as F from "../../../ffi/fuse.ts";
import { forgetHeldFd, heldFd } from "../fd_ledger.ts";
import { FuseRequest } from "./request.ts";

/** Entries across all queues: requests served at once (as MAX_SLOTS for /dev/fuse). */
const ENTRIES = 64;
/** Each queue gets at least this many, however many CPUs: one caller's QD per CPU is bounded by it. */
const MIN_PER_QUEUE = 2;
/** Header buffer stride (fuse_uring_req_header is 288 bytes; the iovec pair follows it). */
const HEADER_STRIDE = 512;
const IOVEC_AT = 384;
/** user_data of a poll this ring keeps armed for the serve loop: POLL_TAG + the caller's tag. */
const POLL_TAG = 1 << 20;

/** Why the ring is not used ("" when it can be): the module parameter, checked and set if we may. */
export function uringUnavailable(): string {
  let v: string;
  try {
    v = readFileSync(F.FUSE_ENABLE_URING_PARAM, "utf8").trim();
  } catch {
    return `${F.FUSE_ENABLE_URING_PARAM} is missing (a kernel without CONFIG_FUSE_IO_URING)`;
  }
  if (v === "Y" || v === "1") return "";
  try {
    writeFileSync(F.FUSE_ENABLE_URING_PARAM, "Y");
    return "";
  } catch (e) {
    return `${F.FUSE_ENABLE_URING_PARAM} is ${v} and could not be set (${(e as Error).message})`;
  }
}

/** Queues the kernel makes for a connection: one per possible CPU (num_possible_cpus). */
export function possibleCpus(): number {
  const text = readFileSync("/sys/devices/system/cpu/possible", "utf8").trim();
  let n = 0;
  for (const part of text.split(",")) {
    const [a, b] = part.split("-").map(Number);
    n += b === undefined ? 1 : b! - a! + 1;
  }
  if (!(n >= 1 && n <= 4096)) throw new Error(`/sys/devices/system/cpu/possible: cannot read "${text}"`);
  return n;
}

/**
 * One entry's buffers: the request's header and argument struct, and its payload. WRITE data
 * arrives in the payload and READ data and reply arguments leave from it; the reply's
 * fuse_out_header goes where the fuse_in_header was.
 */
export class RingEntry extends FuseRequest {
  /** struct fuse_uring_ent_in_out. */
  readonly inOut: DataView;
  /** Lent to the kernel (a REGISTER or COMMIT_AND_FETCH in flight). */
  lent = false;
  constructor(
    readonly index: number,
    readonly qid: number,
    mem: Uint8Array,
    headerAt: number,
    payloadAt: number,
    payloadLen: number,
    readonly iovecPtr: number,
  ) {
    const ab = mem.buffer;
    const base = mem.byteOffset;
    const head = new DataView(ab, base + headerAt, F.FUSE_URING_OP_IN);
    const payload = mem.subarray(payloadAt, payloadAt + payloadLen);
    const payloadView = new DataView(ab, base + payloadAt, payloadLen);
    super(head, new DataView(ab, base + headerAt + F.FUSE_URING_OP_IN, F.FUSE_URING_OP_IN), payload, head, payload, payloadView);
    this.inOut = new DataView(ab, base + headerAt + F.FUSE_URING_ENT_IN_OUT, 32);
  }
}

export interface RingLayout {
  queues: number;
  perQueue: number;
  /** Bytes of the caller's memory the entries use (see place()). */
  bytes: number;
}

/** How many entries per queue, and the memory they take (payloads page-aligned, then the headers). */
export function ringLayout(queues: number, payloadLen: number): RingLayout {
  const perQueue = Math.max(MIN_PER_QUEUE, Math.min(32, Math.ceil(ENTRIES / queues)));
  const n = queues * perQueue;
  return { queues, perQueue, bytes: n * payloadLen + Math.ceil((n * HEADER_STRIDE) / 4096) * 4096 };
}

export class FuseRing {
  readonly entries: RingEntry[] = [];
  private readonly ring: IoUring;
  private closed = false;
  /** Entries whose command failed: no longer lent, not served. */
  dead = 0;
  lastError = "";

  /** Entries laid out in mem[at, at + layout.bytes) (memory that outlives the ring: see close()). */
  constructor(
    readonly fuseFd: number,
    readonly layout: RingLayout,
    mem: AlignedBuffer,
    at: number,
    payloadLen: number,
  ) {
    const n = layout.queues * layout.perQueue;
    let sq = 1;
    while (sq < n) sq *= 2;
    // userMemory: if this thread dies without close(), closing its fd (the fd ledger does) ends the
    // ring and so the commands it holds; a mapping of the ring would keep them, and the connection, alive.
    // COOP_TASKRUN: a request copied into an entry (task work) does not interrupt this thread with
    // an IPI while it runs; it is done at its next kernel entry, or wakes it where it waits
    // (blockd CPU per 4 KiB read 4.0 → 3.6 µs). DEFER_TASKRUN saved as much but ends requests
    // routed to a dead thread's ring with ECANCELED rather than ECONNABORTED.
    const opts = { sqe128: true, cqEntries: 2 * Math.max(sq, 8), userMemory: true };
    try {
      this.ring = new IoUring(Math.max(sq, 8), { ...opts, flags: IORING_SETUP_COOP_TASKRUN | IORING_SETUP_SINGLE_ISSUER });
    } catch {
      this.ring = new IoUring(Math.max(sq, 8), opts); // SINGLE_ISSUER needs Linux 6.0
    }
    heldFd(this.ring.fd);
    const headersAt = at + n * payloadLen;
    for (let i = 0; i < n; i++) {
      const payloadAt = at + i * payloadLen;
      const headerAt = headersAt + i * HEADER_STRIDE;
      const iov = new DataView(mem.bytes.buffer, mem.bytes.byteOffset + headerAt + IOVEC_AT, 32);
      setPtr(iov, 0, mem.ptr + headerAt);
      setPtr(iov, 8, F.FUSE_URING_HEADER_SIZE);
      setPtr(iov, 16, mem.ptr + payloadAt);
      setPtr(iov, 24, payloadLen);
      this.entries.push(new RingEntry(i, Math.floor(i / layout.perQueue), mem.bytes, headerAt, payloadAt, payloadLen, mem.ptr + headerAt + IOVEC_AT));
    }
  }

  /** Keep a poll for POLLIN on `fd` armed on this ring: reap() reports `tag` when it fires. */
  watch(fd: number, tag: number): void {
    this.ring.prepPollMultishot(fd, POLLIN, POLL_TAG + tag);
  }

  /** Send what is prepared (replies) and wait until something comes back, or `timeoutMs` (-1: no bound). */
  wait(timeoutMs: number): void {
    this.ring.submitAndWaitFor(1, timeoutMs);
  }

  /** Lend every entry to the kernel (after INIT is answered: the kernel needs max_write first). */
  registerAll(): void {
    for (const e of this.entries) this.prep(e, F.FUSE_IO_URING_CMD_REGISTER);
    this.submit();
  }

  /** Answer e's request (its reply is in e's buffers, payload_sz set) and lend e again; sent at submit(). */
  commit(e: RingEntry, commitLo: number, commitHi: number): void {
    const sqe = this.prep(e, F.FUSE_IO_URING_CMD_COMMIT_AND_FETCH);
    this.ring.sqes.setUint32(sqe + SQE_CMD + F.FUSE_URING_CMD_COMMIT_ID, commitLo, true);
    this.ring.sqes.setUint32(sqe + SQE_CMD + F.FUSE_URING_CMD_COMMIT_ID + 4, commitHi, true);
  }

  private prep(e: RingEntry, cmd: number): number {
    const sqe = this.ring.getSqe();
    const s = this.ring.sqes;
    s.setUint8(sqe + SQE_OPCODE, IORING_OP_URING_CMD);
    s.setInt32(sqe + SQE_FD, this.fuseFd, true);
    s.setUint32(sqe + SQE_CMD_OP, cmd, true);
    if (cmd === F.FUSE_IO_URING_CMD_REGISTER) {
      setPtr(s, sqe + SQE_ADDR, e.iovecPtr);
      s.setUint32(sqe + SQE_LEN, 2, true);
    }
    s.setUint32(sqe + SQE_USER_DATA, e.index, true);
    s.setUint16(sqe + SQE_CMD + F.FUSE_URING_CMD_QID, e.qid, true);
    e.lent = true;
    return sqe;
  }

  /** Send the commands prepared since the last call (one io_uring_enter). */
  submit(): void {
    if (this.ring.sqPending() > 0) this.ring.submit();
  }

  /**
   * Entries that came back: each holds a request (cb), or its command failed (-ENOTCONN when the
   * connection ends; the entry is dead from then on).
   */
  reap(cb: (e: RingEntry) => void, onPoll: (tag: number, rearm: boolean) => void): void {
    this.ring.reap((ud, res, flags) => {
      if (ud >= POLL_TAG) return onPoll(ud - POLL_TAG, (flags & IORING_CQE_F_MORE) === 0);
      const e = this.entries[ud]!;
      e.lent = false;
      if (res === 0) return cb(e);
      this.dead++;
      if (res !== -E.ENOTCONN && res !== -E.ECONNABORTED && res !== -E.ECANCELED) this.lastError = errnoName(-res);
    });
  }

  /** Entries lent to the kernel now. */
  lentCount(): number {
    let n = 0;
    for (const e of this.entries) if (e.lent) n++;
    return n;
  }

  /**
   * Close the ring. The kernel may still write a request into an entry it holds until the
   * connection ends or the ring's commands are cancelled, so the entries' memory must stay
   * mapped until the connection is aborted (FuseDisk.unmount does) or it is gone.
   */
  close(): void {
    if (this.closed) return;
    this.closed = true;
    forgetHeldFd(this.ring.fd);
    this.ring.close();
  }
}

function setPtr(dv: DataView, at: number, v: number): void {
  dv.setUint32(at, v >>> 0, true);
  dv.setUint32(at + 4, Math.floor(v / 0x1_0000_0000) >>> 0, true);
}
