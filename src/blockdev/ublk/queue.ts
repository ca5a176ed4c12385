// UblkQueue: serves one ublk hardware queue, copy mode, from INSIDE a Bun Worker. The driver binds a
// queue to the OS thread that issued its FETCH_REQs, so the ring, the FETCHes, every COMMIT and the
// loop all live on that one thread (until UBLK_F_PER_IO_DAEMON, which we do not use).

import { toArrayBuffer, type Pointer } from "bun:ffi";
import {
  IORING_ENTER_EXT_ARG,
  IORING_ENTER_GETEVENTS,
  IORING_SETUP_COOP_TASKRUN,
  IORING_SETUP_DEFER_TASKRUN,
  IORING_SETUP_SINGLE_ISSUER,
  IORING_SETUP_TASKRUN_FLAG,
  IORING_SQ_CQ_OVERFLOW,
  IORING_SQ_TASKRUN,
  IORING_OP_READ,
  IO_URING_SQE_SIZE,
  IoUring,
  encodeSqe,
  type CqeCallback,
} from "../../../ffi/io_uring.ts";
import { closeHeldFd, forgetHeldFd, heldFd } from "../fd_ledger.ts";
import {
  E,
  MAP_POPULATE,
  MAP_SHARED,
  O_CLOEXEC,
  O_RDWR,
  PROT_READ,
  SYS_io_uring_enter,
  SYS_prctl,
  SyscallError,
  allocAligned,
  errno,
  libc,
  mmap,
  munmap,
  open,
  syscall,
  type AlignedBuffer,
} from "../../../ffi/libc.ts";
import {
  IO_DESC_NR_SECTORS,
  IO_DESC_OP_FLAGS,
  IO_DESC_START_SECTOR,
  UBLKSRV_IO_DESC_SIZE,
  UBLK_F_AUTO_BUF_REG,
  UBLK_F_BATCH_IO,
  UBLK_F_CMD_IOCTL_ENCODE,
  UBLK_F_SHMEM_ZC,
  UBLK_F_SUPPORT_ZERO_COPY,
  UBLK_F_USER_COPY,
  UBLK_F_ZONED,
  UBLK_IO_COMMIT_AND_FETCH_REQ,
  UBLK_IO_FETCH_REQ,
  UBLK_IO_F_FUA,
  UBLK_IO_NEED_GET_DATA,
  UBLK_IO_OP_DISCARD,
  UBLK_IO_OP_FLUSH,
  UBLK_IO_OP_READ,
  UBLK_IO_OP_WRITE,
  UBLK_IO_OP_WRITE_ZEROES,
  UBLK_IO_RES_ABORT,
  UBLK_IO_RES_NEED_GET_DATA,
  UBLK_IO_RES_OK,
  UBLK_MAX_IO_BUF_BYTES,
  UBLK_MAX_NR_QUEUES,
  UBLK_MAX_QUEUE_DEPTH,
  UBLK_SECTOR_SHIFT,
  UBLK_U_IO_COMMIT_AND_FETCH_REQ,
  UBLK_U_IO_FETCH_REQ,
  UBLK_U_IO_NEED_GET_DATA,
  UblkError,
  UblkInvalidArgument,
  encodeUblkIoCmdSqe,
  ublkQueueDescLength,
  ublkQueueDescOffset,
} from "../../../ffi/ublk.ts";
import type { DeviceIo, WakeSource } from "../device_io.ts";
import { remoteWorkPending } from "../../storage/remote/pending.ts";

// ---------------------------------------------------------------------------------------------
// the ring seam: what the loop needs from the kernel side

/** The kernel-facing half of a queue; the real one wraps an IoUring, tests drive a fake. */
export interface UblkQueueRing {
  /** The SQE array; getSqe() returns byte offsets into it. */
  readonly sqes: DataView;
  /** Claim a zeroed 64-byte SQE slot. */
  getSqe(): number;
  /** Submit prepared SQEs and let finished completions post; with wait, sleep until a CQE is ready (timeoutMs > 0 bounds it). */
  flush(wait: boolean, timeoutMs: number): void;
  /** Reap every ready CQE. */
  reap(cb: CqeCallback): number;
  close(): void;
}

/** Setup flags tried in order for a queue ring: ublksrv's choice, then the 6.1 alternative, then plain. */
export const UBLK_QUEUE_RING_FLAGS: readonly number[] = [
  IORING_SETUP_COOP_TASKRUN | IORING_SETUP_TASKRUN_FLAG,
  IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN | IORING_SETUP_TASKRUN_FLAG,
  0,
];

const GETEVENTS_ARG_SIZE = 24; // struct io_uring_getevents_arg
const WAIT_TS_OFF = 32; // where the timespec lives in the wait buffer

/** UblkQueueRing over a real IoUring (never SQPOLL; SQEs never carry IOSQE_ASYNC). */
export class UringQueueRing implements UblkQueueRing {
  readonly sqes: DataView;
  private readonly taskrunFlag: boolean;
  // struct io_uring_getevents_arg @0 and the timespec it points to @32, in memory that never moves.
  private readonly waitMem: AlignedBuffer;
  private readonly waitDv: DataView;

  constructor(readonly ring: IoUring) {
    heldFd(ring.fd);
    this.sqes = ring.sqes;
    this.taskrunFlag = (ring.setupFlags & IORING_SETUP_TASKRUN_FLAG) !== 0;
    this.waitMem = allocAligned(64);
    this.waitDv = new DataView(this.waitMem.bytes.buffer);
    // {u64 sigmask = 0; u32 sigmask_sz = 0; u32 min_wait_usec = 0; u64 ts = &timespec}
    this.waitDv.setUint32(16, (this.waitMem.ptr + WAIT_TS_OFF) % 2 ** 32, true);
    this.waitDv.setUint32(20, Math.floor((this.waitMem.ptr + WAIT_TS_OFF) / 2 ** 32), true);
  }

  /** A ring sized for one command per tag plus the wake READ, with the first setup flags the kernel takes. */
  static open(queueDepth: number): UringQueueRing {
    const sq = queueDepth + 1;
    const cq = 2 ** Math.ceil(Math.log2(sq)) * 2;
    let last: unknown;
    for (const flags of UBLK_QUEUE_RING_FLAGS) {
      try {
        return new UringQueueRing(new IoUring(sq, { flags, cqEntries: cq }));
      } catch (e) {
        if (!(e instanceof SyscallError && e.errno === E.EINVAL)) throw e;
        last = e;
      }
    }
    throw last;
  }

  getSqe(): number {
    return this.ring.getSqe();
  }

  flush(wait: boolean, timeoutMs: number): void {
    const r = this.ring;
    if (wait && timeoutMs <= 0) {
      r.submitAndWait(1);
      return;
    }
    for (let guard = 0; r.sqPending() > 0 && guard < 1000; guard++) {
      if (r.submit() === 0 && r.cqReady() > 0) break; // EBUSY: reap first, submit on the next turn
    }
    if (wait) {
      if (r.cqReady() === 0) this.timedWait(timeoutMs);
      return;
    }
    // With COOP/DEFER, completions sit as task work until we enter with GETEVENTS; the flag says when.
    if (!this.taskrunFlag || r.sqFlags() & (IORING_SQ_TASKRUN | IORING_SQ_CQ_OVERFLOW)) {
      r.enter(0, 0, IORING_ENTER_GETEVENTS);
    }
  }

  private timedWait(ms: number): void {
    const whole = Math.floor(ms);
    this.waitDv.setUint32(WAIT_TS_OFF, Math.floor(whole / 1000), true); // tv_sec (small, high half stays 0)
    this.waitDv.setUint32(WAIT_TS_OFF + 8, (whole % 1000) * 1_000_000, true); // tv_nsec
    const rc = Number(
      libc.syscall(SYS_io_uring_enter, this.ring.fd, 0, 1, IORING_ENTER_GETEVENTS | IORING_ENTER_EXT_ARG, this.waitMem.ptr, GETEVENTS_ARG_SIZE),
    );
    if (rc < 0) {
      const e = errno();
      // ETIME is the timeout itself; the others just mean "look at the ring again".
      if (e !== E.ETIME && e !== E.EINTR && e !== E.EAGAIN && e !== E.EBUSY) throw new SyscallError("io_uring_enter", e);
    }
  }

  reap(cb: CqeCallback): number {
    return this.ring.reap(cb);
  }

  close(): void {
    forgetHeldFd(this.ring.fd);
    this.ring.close();
    this.waitMem.free();
  }
}

// ---------------------------------------------------------------------------------------------
// the queue

export interface UblkQueueOptions {
  devId: number;
  qId: number;
  /** dev_info.queue_depth as negotiated by ADD_DEV. */
  queueDepth: number;
  /** dev_info.max_io_buf_bytes as negotiated by ADD_DEV. */
  maxIoBufBytes: number;
  /** dev_info.flags as negotiated by ADD_DEV (picks encoded vs legacy opcodes, rejects non-copy modes). */
  flags: number;
  /** An open /dev/ublkcN to share (the node allows one opener; multi-queue devices must pass it). */
  charFd?: number;
  /** Bound, ms, on one idle sleep in io_uring_enter, so other JS in the worker gets turns. 0 = sleep until a request or wake. */
  idleWaitMs?: number;
  /** While requests are in flight, how often (ms) to look for new CQEs if none of them finishes. Default 1. */
  busyPollMs?: number;
  /** prctl(PR_SET_IO_FLUSHER) on this thread (needs CAP_SYS_RESOURCE; best effort). */
  ioFlusher?: boolean;
}

/** What the queue needs from outside once its ring and descriptor array exist (the test seam). */
export interface UblkQueueParts {
  ring: UblkQueueRing;
  /** The queue's descriptor array (read-only mmap of /dev/ublkcN). */
  desc: DataView;
  /** fd put in every I/O SQE. */
  charFd: number;
  /** Undo what produced ring/desc/charFd, after the ring is closed. */
  release?: () => void;
}

export type UblkQueueExitReason = "stopping" | "aborted" | "failed";

export interface UblkQueueExit {
  reason: UblkQueueExitReason;
  /** Requests served (committed or about to be). */
  served: number;
  /** For "failed": the error (a negative FETCH/COMMIT res or a failed wake READ). */
  error?: UblkError;
}

const PR_SET_IO_FLUSHER = 57;
const WAKE_USER_DATA = 2 ** 32; // io commands use tag | qId << 16, always below 2^28
const UNSUPPORTED_FLAGS = UBLK_F_USER_COPY | UBLK_F_SUPPORT_ZERO_COPY | UBLK_F_AUTO_BUF_REG | UBLK_F_BATCH_IO | UBLK_F_ZONED | UBLK_F_SHMEM_ZC;
// Errnos the block layer maps to a distinct status; anything else becomes -EIO.
const PASS_THROUGH_ERRNOS = new Set<number>([E.ENOSPC, E.EOPNOTSUPP, E.EROFS]);

/** The COMMIT result for an error thrown by DeviceIo: -ENOSPC/-EOPNOTSUPP/-EROFS when it says so, else -EIO. */
export function ublkResultForError(e: unknown): number {
  const n = typeof e === "object" && e !== null ? (e as { errno?: unknown }).errno : undefined;
  return typeof n === "number" && PASS_THROUGH_ERRNOS.has(n) ? -n : -E.EIO;
}

function checkOpt(field: string, v: number, min: number, max: number): void {
  if (!(Number.isInteger(v) && v >= min && v <= max)) throw new UblkInvalidArgument(field, v, `must be an integer in ${min}..${max}`);
}

export class UblkQueue {
  readonly devId: number;
  readonly qId: number;
  readonly queueDepth: number;
  readonly maxIoBufBytes: number;
  readonly charFd: number;

  private readonly ring: UblkQueueRing;
  private readonly desc: DataView;
  private readonly release?: () => void;
  private readonly opFetch: number;
  private readonly opCommit: number;
  private readonly opNeedGetData: number;
  private readonly idleWaitMs: number;
  private readonly busyPollMs: number;
  private readonly bufs: AlignedBuffer[] = [];
  /** Buffer address per tag (what FETCH/COMMIT pass as addr). */
  private readonly bufAddr: Float64Array;
  /** Last view handed to DeviceIo per tag; reused while the request length repeats. */
  private readonly views: Uint8Array[] = [];
  private readonly wakeBuf: AlignedBuffer;

  private io: DeviceIo | null = null;
  private readOnly = false;
  private wakeFd = -1;
  private primed = false;
  private running = false;
  private closed = false;
  private inflight = 0;
  private served = 0;
  private wakeFired = false;
  private wakeRes = 0;
  private aborted = false;
  private failure: UblkError | null = null;
  private parked: (() => void) | null = null;
  private parkTimer: ReturnType<typeof setTimeout> | null = null;

  /** Use UblkQueue.open() in a worker; this constructor is the seam for a fake kernel. */
  constructor(opts: UblkQueueOptions, parts: UblkQueueParts) {
    checkOpt("qId", opts.qId, 0, UBLK_MAX_NR_QUEUES - 1);
    checkOpt("queueDepth", opts.queueDepth, 1, UBLK_MAX_QUEUE_DEPTH);
    checkOpt("maxIoBufBytes", opts.maxIoBufBytes, 512, UBLK_MAX_IO_BUF_BYTES);
    if (opts.flags & UNSUPPORTED_FLAGS) {
      throw new UblkInvalidArgument("flags", `0x${opts.flags.toString(16)}`, "UblkQueue serves copy mode only (no USER_COPY, zero copy, batch, zoned)");
    }
    this.devId = opts.devId;
    this.qId = opts.qId;
    this.queueDepth = opts.queueDepth;
    this.maxIoBufBytes = opts.maxIoBufBytes;
    this.ring = parts.ring;
    this.desc = parts.desc;
    this.charFd = parts.charFd;
    this.release = parts.release;
    const encoded = (opts.flags & UBLK_F_CMD_IOCTL_ENCODE) !== 0;
    this.opFetch = encoded ? UBLK_U_IO_FETCH_REQ : UBLK_IO_FETCH_REQ;
    this.opCommit = encoded ? UBLK_U_IO_COMMIT_AND_FETCH_REQ : UBLK_IO_COMMIT_AND_FETCH_REQ;
    this.opNeedGetData = encoded ? UBLK_U_IO_NEED_GET_DATA : UBLK_IO_NEED_GET_DATA;
    this.idleWaitMs = opts.idleWaitMs ?? 0;
    this.busyPollMs = opts.busyPollMs ?? 1;
    if (this.desc.byteLength < this.queueDepth * UBLKSRV_IO_DESC_SIZE) {
      throw new UblkInvalidArgument("desc", this.desc.byteLength, `too small for ${this.queueDepth} descriptors`);
    }
    this.bufAddr = new Float64Array(this.queueDepth);
    try {
      // Copy mode: the driver pins these pages (GUP) on every FETCH/COMMIT, so they are ours for life.
      for (let tag = 0; tag < this.queueDepth; tag++) {
        const b = allocAligned(this.maxIoBufBytes);
        this.bufs.push(b);
        this.bufAddr[tag] = b.ptr;
        this.views.push(b.bytes);
      }
      this.wakeBuf = allocAligned(8);
    } catch (e) {
      for (const b of this.bufs) b.free();
      throw e;
    }
  }

  /**
   * Open queue qId in the calling thread: /dev/ublkcN (unless charFd is given), the read-only
   * descriptor mmap, per-tag buffers and a ring of its own. Call it in the worker that will run().
   */
  static open(opts: UblkQueueOptions): UblkQueue {
    checkOpt("devId", opts.devId, 0, 0xfffffffe);
    checkOpt("qId", opts.qId, 0, UBLK_MAX_NR_QUEUES - 1);
    checkOpt("queueDepth", opts.queueDepth, 1, UBLK_MAX_QUEUE_DEPTH);
    const ownFd = opts.charFd === undefined;
    const charFd = ownFd ? heldFd(open(`/dev/ublkc${opts.devId}`, O_RDWR | O_CLOEXEC)) : opts.charFd!;
    let descAddr = 0;
    const descLen = ublkQueueDescLength(opts.queueDepth);
    let ring: UringQueueRing | null = null;
    try {
      // PROT_WRITE would get EPERM: the driver writes the descriptors, we only read them.
      descAddr = mmap(0, descLen, PROT_READ, MAP_SHARED | MAP_POPULATE, charFd, ublkQueueDescOffset(opts.qId));
      const desc = new DataView(toArrayBuffer(descAddr as Pointer, 0, descLen));
      ring = UringQueueRing.open(opts.queueDepth);
      const addr = descAddr;
      const q = new UblkQueue(opts, {
        ring,
        desc,
        charFd,
        release: () => {
          munmap(addr, descLen);
          if (ownFd) closeHeldFd(charFd);
        },
      });
      if (opts.ioFlusher) {
        try {
          syscall(SYS_prctl, PR_SET_IO_FLUSHER, 1);
        } catch {
          // Without CAP_SYS_RESOURCE the queue still works; it just may deadlock under memory pressure.
        }
      }
      return q;
    } catch (e) {
      ring?.close();
      if (descAddr) munmap(descAddr, descLen);
      if (ownFd) closeHeldFd(charFd);
      throw e;
    }
  }

  /** The buffer of a tag (what the driver copies WRITE data into and READ data out of). */
  buffer(tag: number): Uint8Array {
    return this.bufs[tag]!.bytes;
  }

  /** Queue a FETCH_REQ for every tag and submit them; START_DEV / END_USER_RECOVERY may follow. */
  prime(): void {
    if (this.closed) throw new Error("UblkQueue: closed");
    if (this.primed) return;
    this.primed = true;
    for (let tag = 0; tag < this.queueDepth; tag++) this.queueIoCmd(this.opFetch, tag, 0);
    this.ring.flush(false, 0);
  }

  /**
   * Serve requests until wake.stopping(), the driver aborts the queue (STOP_DEV, or a dying
   * device), or a command fails. Requests run concurrently across tags; the ring is watched
   * between DeviceIo completions, and the worker sleeps in the kernel when nothing is in flight.
   */
  async run(io: DeviceIo, wake: WakeSource): Promise<UblkQueueExit> {
    if (this.closed) throw new Error("UblkQueue: closed");
    if (this.running) throw new Error("UblkQueue: already running");
    this.running = true;
    this.io = io;
    this.readOnly = io.readOnly;
    this.wakeFd = wake.fd;
    let reason: UblkQueueExitReason = "stopping";
    try {
      this.prime();
      if (!wake.stopping()) this.armWake();
      for (;;) {
        if (wake.stopping()) break;
        // A remote layer's download runs on the event loop with no request in flight: not idle then.
        const idle = this.inflight === 0 && remoteWorkPending() === 0;
        this.ring.flush(idle, this.idleWaitMs);
        this.ring.reap(this.onCqe);
        if (this.failure) {
          reason = "failed";
          break;
        }
        if (this.aborted) {
          reason = "aborted";
          break;
        }
        if (this.wakeFired) {
          this.wakeFired = false;
          if (this.wakeRes < 0) {
            this.failure = new UblkError("WAKE_READ", -this.wakeRes, this.devId, `eventfd ${this.wakeFd}`);
            reason = "failed";
            break;
          }
          await wake.onWake();
          if (!wake.stopping()) this.armWake();
          continue;
        }
        if (this.inflight > 0 || !idle) await this.park();
        else if (this.idleWaitMs > 0) await this.park(); // let timers and messages of the worker run
      }
      // Let started requests finish so their buffers stay valid and their results reach the driver.
      while (this.inflight > 0) await this.park();
      this.ring.flush(false, 0);
    } finally {
      this.running = false;
      this.io = null;
    }
    const exit: UblkQueueExit = { reason, served: this.served };
    if (this.failure) exit.error = this.failure;
    return exit;
  }

  /**
   * Close the ring (the kernel cancels outstanding FETCH/COMMITs), unmap the descriptors and free the
   * buffers. Call after run() returned, ideally after STOP_DEV so no request is mid-copy.
   */
  close(): void {
    if (this.closed) return;
    if (this.running) throw new Error("UblkQueue: close() while run() is active");
    this.closed = true;
    this.ring.close();
    this.release?.();
    for (const b of this.bufs) b.free();
    this.wakeBuf.free();
  }

  // --- loop internals -----------------------------------------------------------------------------

  private queueIoCmd(op: number, tag: number, result: number): void {
    const at = this.ring.getSqe();
    encodeUblkIoCmdSqe(this.ring.sqes, at, this.charFd, op, this.qId, tag, result, this.bufAddr[tag]!, tag + this.qId * 0x10000);
  }

  private armWake(): void {
    // An 8-byte READ of the eventfd counter into memory the kernel fills later; off -1 = "current position".
    encodeSqe(this.ring.sqes, this.ring.getSqe(), IO_URING_SQE_SIZE, IORING_OP_READ, this.wakeFd, -1, this.wakeBuf.ptr, 8, 0, WAKE_USER_DATA);
  }

  private readonly onCqe = (userData: number, res: number): void => {
    if (userData === WAKE_USER_DATA) {
      this.wakeFired = true;
      this.wakeRes = res;
      return;
    }
    const tag = userData & 0xffff;
    if (res === UBLK_IO_RES_OK) {
      this.inflight++;
      this.served++;
      void this.serve(tag);
    } else if (res === UBLK_IO_RES_NEED_GET_DATA) {
      // Two-step WRITE (UBLK_F_NEED_GET_DATA): hand the buffer over; the data arrives with the next CQE.
      this.queueIoCmd(this.opNeedGetData, tag, 0);
    } else if (res === UBLK_IO_RES_ABORT) {
      this.aborted = true; // the device is stopping or its server is going away: do not re-fetch
    } else if (!this.failure) {
      this.failure = new UblkError("FETCH_OR_COMMIT", -res, this.devId, `queue ${this.qId} tag ${tag}`);
    }
  };

  private async serve(tag: number): Promise<void> {
    let res: number;
    try {
      res = await this.handle(tag);
    } catch (e) {
      res = ublkResultForError(e);
    }
    this.inflight--;
    if (!this.closed) this.queueIoCmd(this.opCommit, tag, res);
    this.unpark();
  }

  /** One request: bytes done, 0 for FLUSH/DISCARD/WRITE_ZEROES, or -errno. */
  private async handle(tag: number): Promise<number> {
    const io = this.io!;
    const d = this.desc;
    const at = tag * UBLKSRV_IO_DESC_SIZE;
    const opFlags = d.getUint32(at + IO_DESC_OP_FLAGS, true);
    const nrSectors = d.getUint32(at + IO_DESC_NR_SECTORS, true);
    const startSector = d.getUint32(at + IO_DESC_START_SECTOR, true) + d.getUint32(at + IO_DESC_START_SECTOR + 4, true) * 2 ** 32;
    // Sectors are 512 bytes whatever the logical block size (blk_rq_pos / blk_rq_sectors).
    const offset = startSector * 2 ** UBLK_SECTOR_SHIFT;
    const len = nrSectors * 2 ** UBLK_SECTOR_SHIFT;
    const op = opFlags & 0xff;
    if (op !== UBLK_IO_OP_FLUSH && offset + len > io.size()) return -E.EIO;
    switch (op) {
      case UBLK_IO_OP_READ: {
        if (len > this.maxIoBufBytes) return -E.EIO;
        await io.read(this.viewFor(tag, len), offset);
        return len;
      }
      case UBLK_IO_OP_WRITE: {
        if (this.readOnly) return -E.EROFS;
        if (len > this.maxIoBufBytes) return -E.EIO;
        await io.write(this.viewFor(tag, len), offset);
        if (opFlags & UBLK_IO_F_FUA) await io.flush();
        return len;
      }
      case UBLK_IO_OP_FLUSH:
        await io.flush();
        return 0;
      case UBLK_IO_OP_DISCARD:
      case UBLK_IO_OP_WRITE_ZEROES:
        if (this.readOnly) return -E.EROFS;
        await io.discard(offset, len);
        return 0;
      default:
        return -E.EOPNOTSUPP;
    }
  }

  private viewFor(tag: number, len: number): Uint8Array {
    let v = this.views[tag]!;
    if (v.length !== len) {
      v = this.bufs[tag]!.bytes.subarray(0, len);
      this.views[tag] = v;
    }
    return v;
  }

  /** Wait until a request finishes or busyPollMs passes (new CQEs need a look at the ring). */
  private park(): Promise<void> {
    return new Promise<void>((resolve) => {
      this.parked = resolve;
      const ms = this.inflight > 0 ? this.busyPollMs : this.idleWaitMs > 0 ? 0 : this.busyPollMs;
      this.parkTimer = setTimeout(this.unpark, ms);
    });
  }

  private readonly unpark = (): void => {
    const p = this.parked;
    if (!p) return;
    this.parked = null;
    if (this.parkTimer) clearTimeout(this.parkTimer);
    this.parkTimer = null;
    p();
  };
}
