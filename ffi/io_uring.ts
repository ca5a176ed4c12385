// io_uring by hand through syscall(2), one ring per thread; layouts and ordering as include/uapi/linux/io_uring.h and io_uring(7) give them.

import { ptr, toArrayBuffer, type Pointer } from "bun:ffi";
import {
  E,
  MADV_DONTFORK,
  MAP_POPULATE,
  MAP_SHARED,
  PROT_READ,
  PROT_WRITE,
  SYS_io_uring_enter,
  SYS_io_uring_register,
  SYS_io_uring_setup,
  SyscallError,
  allocAligned,
  type AlignedBuffer,
  close as closeFd,
  errno,
  libc,
  madvise,
  mmap,
  munmap,
} from "./libc.ts";

// ---------------------------------------------------------------------------------------------
// UAPI constants

export const IORING_OP_NOP = 0;
export const IORING_OP_READV = 1;
export const IORING_OP_WRITEV = 2;
export const IORING_OP_FSYNC = 3;
export const IORING_OP_READ_FIXED = 4;
export const IORING_OP_WRITE_FIXED = 5;
export const IORING_OP_POLL_ADD = 6;
export const IORING_OP_POLL_REMOVE = 7;
export const IORING_OP_SYNC_FILE_RANGE = 8;
export const IORING_OP_TIMEOUT = 11;
export const IORING_OP_ASYNC_CANCEL = 14;
export const IORING_OP_FALLOCATE = 17;
export const IORING_OP_OPENAT = 18;
export const IORING_OP_CLOSE = 19;
export const IORING_OP_FILES_UPDATE = 20;
export const IORING_OP_STATX = 21;
export const IORING_OP_READ = 22;
export const IORING_OP_WRITE = 23;
export const IORING_OP_FADVISE = 24;
export const IORING_OP_MADVISE = 25;
export const IORING_OP_URING_CMD = 46;

export const IORING_SETUP_IOPOLL = 1 << 0;
export const IORING_SETUP_SQPOLL = 1 << 1;
export const IORING_SETUP_SQ_AFF = 1 << 2;
export const IORING_SETUP_CQSIZE = 1 << 3;
export const IORING_SETUP_CLAMP = 1 << 4;
export const IORING_SETUP_ATTACH_WQ = 1 << 5;
export const IORING_SETUP_R_DISABLED = 1 << 6;
export const IORING_SETUP_SUBMIT_ALL = 1 << 7;
export const IORING_SETUP_COOP_TASKRUN = 1 << 8;
export const IORING_SETUP_TASKRUN_FLAG = 1 << 9;
export const IORING_SETUP_SQE128 = 1 << 10;
export const IORING_SETUP_CQE32 = 1 << 11;
export const IORING_SETUP_SINGLE_ISSUER = 1 << 12;
export const IORING_SETUP_DEFER_TASKRUN = 1 << 13;
export const IORING_SETUP_NO_MMAP = 1 << 14;
export const IORING_SETUP_REGISTERED_FD_ONLY = 1 << 15;
export const IORING_SETUP_NO_SQARRAY = 1 << 16;

export const IORING_FEAT_SINGLE_MMAP = 1 << 0;
export const IORING_FEAT_NODROP = 1 << 1;
export const IORING_FEAT_SUBMIT_STABLE = 1 << 2;
export const IORING_FEAT_RW_CUR_POS = 1 << 3;
export const IORING_FEAT_CUR_PERSONALITY = 1 << 4;
export const IORING_FEAT_FAST_POLL = 1 << 5;
export const IORING_FEAT_POLL_32BITS = 1 << 6;
export const IORING_FEAT_SQPOLL_NONFIXED = 1 << 7;
export const IORING_FEAT_EXT_ARG = 1 << 8;
export const IORING_FEAT_NATIVE_WORKERS = 1 << 9;
export const IORING_FEAT_RSRC_TAGS = 1 << 10;
export const IORING_FEAT_CQE_SKIP = 1 << 11;
export const IORING_FEAT_LINKED_FILE = 1 << 12;

export const IORING_ENTER_GETEVENTS = 1 << 0;
export const IORING_ENTER_SQ_WAKEUP = 1 << 1;
export const IORING_ENTER_SQ_WAIT = 1 << 2;
export const IORING_ENTER_EXT_ARG = 1 << 3;
export const IORING_ENTER_REGISTERED_RING = 1 << 4;

export const IOSQE_FIXED_FILE = 1 << 0;
export const IOSQE_IO_DRAIN = 1 << 1;
export const IOSQE_IO_LINK = 1 << 2;
export const IOSQE_IO_HARDLINK = 1 << 3;
export const IOSQE_ASYNC = 1 << 4;
export const IOSQE_BUFFER_SELECT = 1 << 5;
export const IOSQE_CQE_SKIP_SUCCESS = 1 << 6;

export const IORING_SQ_NEED_WAKEUP = 1 << 0;
export const IORING_SQ_CQ_OVERFLOW = 1 << 1;
export const IORING_SQ_TASKRUN = 1 << 2;

export const IORING_CQE_F_BUFFER = 1 << 0;
export const IORING_CQE_F_MORE = 1 << 1;
export const IORING_CQE_F_SOCK_NONEMPTY = 1 << 2;
export const IORING_CQE_F_NOTIF = 1 << 3;
export const IORING_CQE_BUFFER_SHIFT = 16;

export const IORING_FSYNC_DATASYNC = 1 << 0;
export const IORING_URING_CMD_FIXED = 1 << 0;
/** POLL_ADD: keep the poll armed, one CQE (with IORING_CQE_F_MORE) per readiness; sqe.len carries it. */
export const IORING_POLL_ADD_MULTI = 1 << 0;
/** struct io_uring_getevents_arg (IORING_ENTER_EXT_ARG): sigmask u64, sigmask_sz u32, pad u32, ts u64. */
export const GETEVENTS_ARG_SIZE = 24;

export const IORING_OFF_SQ_RING = 0;
export const IORING_OFF_CQ_RING = 0x8000000;
export const IORING_OFF_SQES = 0x10000000;

export const IORING_REGISTER_BUFFERS = 0;
export const IORING_UNREGISTER_BUFFERS = 1;
export const IORING_REGISTER_FILES = 2;
export const IORING_UNREGISTER_FILES = 3;
export const IORING_REGISTER_EVENTFD = 4;
export const IORING_UNREGISTER_EVENTFD = 5;
export const IORING_REGISTER_FILES_UPDATE = 6;
export const IORING_REGISTER_PROBE = 8;
export const IORING_REGISTER_FILES2 = 13;
export const IORING_REGISTER_FILES_UPDATE2 = 14;
export const IORING_REGISTER_BUFFERS2 = 15;
export const IORING_REGISTER_BUFFERS_UPDATE = 16;

// ---------------------------------------------------------------------------------------------
// layouts

export const IO_URING_SQE_SIZE = 64;
export const IO_URING_SQE128_SIZE = 128;
export const IO_URING_CQE_SIZE = 16;
export const IO_URING_CQE32_SIZE = 32;
export const IO_URING_PARAMS_SIZE = 120;

/** struct io_uring_sqe field offsets. */
export const SQE_OPCODE = 0; // u8
export const SQE_FLAGS = 1; // u8, IOSQE_*
export const SQE_IOPRIO = 2; // u16
export const SQE_FD = 4; // s32
export const SQE_OFF = 8; // u64 (off / addr2)
export const SQE_CMD_OP = 8; // u32 (URING_CMD), __pad1 u32 @12
export const SQE_ADDR = 16; // u64
export const SQE_LEN = 24; // u32
export const SQE_OP_FLAGS = 28; // u32: rw_flags, fsync_flags, uring_cmd_flags, ...
export const SQE_USER_DATA = 32; // u64
export const SQE_BUF_INDEX = 40; // u16
export const SQE_PERSONALITY = 42; // u16
export const SQE_FILE_INDEX = 44; // u32 (splice_fd_in / file_index)
export const SQE_ADDR3 = 48; // u64
export const SQE_CMD = 48; // URING_CMD payload: 16 bytes, or 80 with SQE128

/** struct io_uring_cqe field offsets. */
export const CQE_USER_DATA = 0; // u64
export const CQE_RES = 8; // s32
export const CQE_FLAGS = 12; // u32

/** struct io_uring_params field offsets. */
export const PARAMS_SQ_ENTRIES = 0;
export const PARAMS_CQ_ENTRIES = 4;
export const PARAMS_FLAGS = 8;
export const PARAMS_SQ_THREAD_CPU = 12;
export const PARAMS_SQ_THREAD_IDLE = 16;
export const PARAMS_FEATURES = 20;
export const PARAMS_WQ_FD = 24;
export const PARAMS_SQ_OFF = 40;
export const PARAMS_CQ_OFF = 80;

/** struct io_sqring_offsets field offsets (relative to PARAMS_SQ_OFF). */
export const SQ_OFF_HEAD = 0;
export const SQ_OFF_TAIL = 4;
export const SQ_OFF_RING_MASK = 8;
export const SQ_OFF_RING_ENTRIES = 12;
export const SQ_OFF_FLAGS = 16;
export const SQ_OFF_DROPPED = 20;
export const SQ_OFF_ARRAY = 24;
export const SQ_OFF_USER_ADDR = 32;

/** struct io_cqring_offsets field offsets (relative to PARAMS_CQ_OFF). */
export const CQ_OFF_HEAD = 0;
export const CQ_OFF_TAIL = 4;
export const CQ_OFF_RING_MASK = 8;
export const CQ_OFF_RING_ENTRIES = 12;
export const CQ_OFF_OVERFLOW = 16;
export const CQ_OFF_CQES = 20;
export const CQ_OFF_FLAGS = 24;
export const CQ_OFF_USER_ADDR = 32;

// ---------------------------------------------------------------------------------------------
// pure encoding (no kernel needed; unit-testable)

const TWO32 = 0x1_0000_0000;

/** Store a u64 given as a number (0..2^53, or -1 for all ones) or a bigint, little-endian. */
export function setU64(dv: DataView, at: number, v: number | bigint): void {
  if (typeof v === "bigint") {
    dv.setBigUint64(at, BigInt.asUintN(64, v), true);
  } else if (v === -1) {
    dv.setUint32(at, 0xffffffff, true);
    dv.setUint32(at + 4, 0xffffffff, true);
  } else {
    dv.setUint32(at, v >>> 0, true);
    dv.setUint32(at + 4, Math.floor(v / TWO32) >>> 0, true);
  }
}

/** Load a u64 as a number (exact below 2^53). */
export function getU64(dv: DataView, at: number): number {
  return dv.getUint32(at, true) + dv.getUint32(at + 4, true) * TWO32;
}

/** Zero sqeSize bytes of an SQE (stale bytes in the cmd area break ublk). */
export function zeroSqe(dv: DataView, at: number, sqeSize: number): void {
  for (let i = 0; i < sqeSize; i += 4) dv.setUint32(at + i, 0, true);
}

/** Zero then fill one SQE; off/addr/len/opFlags mean what the opcode says (io_uring_enter(2)). */
export function encodeSqe(
  dv: DataView,
  at: number,
  sqeSize: number,
  opcode: number,
  fd: number,
  off: number | bigint,
  addr: number | bigint,
  len: number,
  opFlags: number,
  userData: number | bigint,
  sqeFlags = 0,
): void {
  zeroSqe(dv, at, sqeSize);
  dv.setUint8(at + SQE_OPCODE, opcode);
  dv.setUint8(at + SQE_FLAGS, sqeFlags);
  dv.setInt32(at + SQE_FD, fd, true);
  setU64(dv, at + SQE_OFF, off);
  setU64(dv, at + SQE_ADDR, addr);
  dv.setUint32(at + SQE_LEN, len >>> 0, true);
  dv.setUint32(at + SQE_OP_FLAGS, opFlags >>> 0, true);
  setU64(dv, at + SQE_USER_DATA, userData);
}

/** Zero then fill a URING_CMD SQE: cmd_op @8, pad @12 zero, payload (≤16 B, ≤80 B with SQE128) @48. */
export function encodeUringCmd(
  dv: DataView,
  at: number,
  sqeSize: number,
  fd: number,
  cmdOp: number,
  payload: Uint8Array | null,
  userData: number | bigint,
  sqeFlags = 0,
  uringCmdFlags = 0,
  addr: number | bigint = 0,
): void {
  const room = sqeSize - SQE_CMD;
  if (payload && payload.length > room) {
    throw new RangeError(`URING_CMD payload of ${payload.length} bytes exceeds ${room} (SQE ${sqeSize})`);
  }
  encodeSqe(dv, at, sqeSize, IORING_OP_URING_CMD, fd, 0, addr, 0, uringCmdFlags, userData, sqeFlags);
  dv.setUint32(at + SQE_CMD_OP, cmdOp >>> 0, true);
  if (payload) {
    for (let i = 0; i < payload.length; i++) dv.setUint8(at + SQE_CMD + i, payload[i]!);
  }
}

export interface SqeFields {
  opcode: number;
  flags: number;
  ioprio: number;
  fd: number;
  off: number;
  addr: number;
  len: number;
  opFlags: number;
  userData: number;
  bufIndex: number;
  personality: number;
  fileIndex: number;
  addr3: number;
}

/** Decode an SQE (for tests and debugging). */
export function decodeSqe(dv: DataView, at: number): SqeFields {
  return {
    opcode: dv.getUint8(at + SQE_OPCODE),
    flags: dv.getUint8(at + SQE_FLAGS),
    ioprio: dv.getUint16(at + SQE_IOPRIO, true),
    fd: dv.getInt32(at + SQE_FD, true),
    off: getU64(dv, at + SQE_OFF),
    addr: getU64(dv, at + SQE_ADDR),
    len: dv.getUint32(at + SQE_LEN, true),
    opFlags: dv.getUint32(at + SQE_OP_FLAGS, true),
    userData: getU64(dv, at + SQE_USER_DATA),
    bufIndex: dv.getUint16(at + SQE_BUF_INDEX, true),
    personality: dv.getUint16(at + SQE_PERSONALITY, true),
    fileIndex: dv.getUint32(at + SQE_FILE_INDEX, true),
    addr3: getU64(dv, at + SQE_ADDR3),
  };
}

/** Decode one CQE (for tests and debugging; the ring reaps without allocating). */
export function decodeCqe(dv: DataView, at: number): { userData: number; res: number; flags: number } {
  return {
    userData: getU64(dv, at + CQE_USER_DATA),
    res: dv.getInt32(at + CQE_RES, true),
    flags: dv.getUint32(at + CQE_FLAGS, true),
  };
}

export interface SetupParams {
  flags?: number;
  cqEntries?: number;
  sqThreadCpu?: number;
  sqThreadIdle?: number;
  wqFd?: number;
}

/** Zero then fill the input fields of struct io_uring_params (120 bytes). */
export function encodeParams(dv: DataView, p: SetupParams): void {
  for (let i = 0; i < IO_URING_PARAMS_SIZE; i += 4) dv.setUint32(i, 0, true);
  dv.setUint32(PARAMS_CQ_ENTRIES, p.cqEntries ?? 0, true);
  dv.setUint32(PARAMS_FLAGS, p.flags ?? 0, true);
  dv.setUint32(PARAMS_SQ_THREAD_CPU, p.sqThreadCpu ?? 0, true);
  dv.setUint32(PARAMS_SQ_THREAD_IDLE, p.sqThreadIdle ?? 0, true);
  dv.setUint32(PARAMS_WQ_FD, p.wqFd ?? 0, true);
}

export interface SqringOffsets {
  head: number;
  tail: number;
  ringMask: number;
  ringEntries: number;
  flags: number;
  dropped: number;
  array: number;
  userAddr: number;
}

export interface CqringOffsets {
  head: number;
  tail: number;
  ringMask: number;
  ringEntries: number;
  overflow: number;
  cqes: number;
  flags: number;
  userAddr: number;
}

export interface IoUringParams {
  sqEntries: number;
  cqEntries: number;
  flags: number;
  sqThreadCpu: number;
  sqThreadIdle: number;
  features: number;
  wqFd: number;
  sqOff: SqringOffsets;
  cqOff: CqringOffsets;
}

/** Decode struct io_uring_params as filled in by io_uring_setup. */
export function decodeParams(dv: DataView): IoUringParams {
  const u = (o: number) => dv.getUint32(o, true);
  const s = PARAMS_SQ_OFF;
  const c = PARAMS_CQ_OFF;
  return {
    sqEntries: u(PARAMS_SQ_ENTRIES),
    cqEntries: u(PARAMS_CQ_ENTRIES),
    flags: u(PARAMS_FLAGS),
    sqThreadCpu: u(PARAMS_SQ_THREAD_CPU),
    sqThreadIdle: u(PARAMS_SQ_THREAD_IDLE),
    features: u(PARAMS_FEATURES),
    wqFd: u(PARAMS_WQ_FD),
    sqOff: {
      head: u(s + SQ_OFF_HEAD),
      tail: u(s + SQ_OFF_TAIL),
      ringMask: u(s + SQ_OFF_RING_MASK),
      ringEntries: u(s + SQ_OFF_RING_ENTRIES),
      flags: u(s + SQ_OFF_FLAGS),
      dropped: u(s + SQ_OFF_DROPPED),
      array: u(s + SQ_OFF_ARRAY),
      userAddr: getU64(dv, s + SQ_OFF_USER_ADDR),
    },
    cqOff: {
      head: u(c + CQ_OFF_HEAD),
      tail: u(c + CQ_OFF_TAIL),
      ringMask: u(c + CQ_OFF_RING_MASK),
      ringEntries: u(c + CQ_OFF_RING_ENTRIES),
      overflow: u(c + CQ_OFF_OVERFLOW),
      cqes: u(c + CQ_OFF_CQES),
      flags: u(c + CQ_OFF_FLAGS),
      userAddr: getU64(dv, c + CQ_OFF_USER_ADDR),
    },
  };
}

// ---------------------------------------------------------------------------------------------
// the ring

export interface IoUringOptions {
  /** IORING_SETUP_* bits. */
  flags?: number;
  /** CQ size (sets IORING_SETUP_CQSIZE); default 2 × SQ. */
  cqEntries?: number;
  /** 128-byte SQEs (IORING_SETUP_SQE128), needed for ublk control commands. */
  sqe128?: boolean;
  /** 32-byte CQEs (IORING_SETUP_CQE32). */
  cqe32?: boolean;
  sqThreadCpu?: number;
  sqThreadIdle?: number;
  wqFd?: number;
  /** madvise(MADV_DONTFORK) the ring mappings, for processes that fork. */
  dontFork?: boolean;
  /**
   * Rings and SQEs in memory of ours (IORING_SETUP_NO_MMAP, Linux 6.5) instead of mappings of the
   * ring's fd: closing the fd then releases the ring even when its memory stays mapped (a thread
   * that died without close()), which cancels the commands it had in flight.
   */
  userMemory?: boolean;
}

/** Bytes of user memory for the rings region (io_rings + CQEs + SQ array) of a NO_MMAP ring. */
function userRingsBytes(sqEntries: number, cqEntries: number, cqeSize: number): number {
  const bytes = 4096 + cqEntries * cqeSize + sqEntries * 4; // struct io_rings is well under a page
  return Math.ceil(bytes / 4096) * 4096;
}

/** Called once per reaped CQE. userData is exact in its low 53 bits. */
export type CqeCallback = (userData: number, res: number, flags: number) => void;

const ENTER_BUSY_RETRIES = 100;

export class IoUring {
  readonly fd: number;
  readonly params: IoUringParams;
  readonly sqEntries: number;
  readonly cqEntries: number;
  readonly features: number;
  readonly setupFlags: number;
  readonly sqeSize: number;
  readonly cqeSize: number;
  /** The SQE array; slot i is at byte i * sqeSize. */
  readonly sqes: DataView;

  private readonly maps: { addr: number; len: number; ab: ArrayBuffer }[] = [];
  private readonly sq: Uint32Array;
  private readonly cq: Uint32Array;
  private readonly cqI32: Int32Array;
  private readonly sqHeadIdx: number;
  private readonly sqTailIdx: number;
  private readonly sqFlagsIdx: number;
  private readonly sqDroppedIdx: number;
  private readonly sqMask: number;
  private readonly cqHeadIdx: number;
  private readonly cqTailIdx: number;
  private readonly cqOverflowIdx: number;
  private readonly cqMask: number;
  private readonly cqesIdx: number;
  private readonly cqeWords: number;
  private sqTail = 0; // local copy: the app is the only writer
  private cqHead = 0; // local copy: the app is the only writer
  private closed = false;

  constructor(entries: number, opts: IoUringOptions = {}) {
    let flags = opts.flags ?? 0;
    if (opts.sqe128) flags |= IORING_SETUP_SQE128;
    if (opts.cqe32) flags |= IORING_SETUP_CQE32;
    if (opts.cqEntries !== undefined) flags |= IORING_SETUP_CQSIZE;

    const pbuf = new Uint8Array(IO_URING_PARAMS_SIZE);
    const pdv = new DataView(pbuf.buffer);
    let user: { rings: AlignedBuffer; sqes: AlignedBuffer } | undefined;
    if (opts.userMemory) {
      // The kernel rounds entries up to a power of two; size for that, and for the CQ it will make.
      let sq = 1;
      while (sq < entries) sq *= 2;
      const cq = opts.cqEntries ?? 2 * sq;
      flags |= IORING_SETUP_NO_MMAP;
      user = {
        rings: allocAligned(userRingsBytes(sq, cq, flags & IORING_SETUP_CQE32 ? IO_URING_CQE32_SIZE : IO_URING_CQE_SIZE)),
        sqes: allocAligned(sq * (flags & IORING_SETUP_SQE128 ? IO_URING_SQE128_SIZE : IO_URING_SQE_SIZE)),
      };
    }
    encodeParams(pdv, { ...opts, flags });
    if (user) {
      setU64(pdv, PARAMS_SQ_OFF + SQ_OFF_USER_ADDR, user.sqes.ptr);
      setU64(pdv, PARAMS_CQ_OFF + CQ_OFF_USER_ADDR, user.rings.ptr);
    }
    const fd = Number(libc.syscall(SYS_io_uring_setup, entries, ptr(pbuf), 0, 0, 0, 0));
    if (fd < 0) {
      const e = errno();
      user?.rings.free();
      user?.sqes.free();
      throw new SyscallError("io_uring_setup", e);
    }
    this.fd = fd;
    this.userMem = user;

    try {
      const p = decodeParams(pdv);
      this.params = p;
      this.sqEntries = p.sqEntries;
      this.cqEntries = p.cqEntries;
      this.features = p.features;
      this.setupFlags = flags;
      this.sqeSize = flags & IORING_SETUP_SQE128 ? IO_URING_SQE128_SIZE : IO_URING_SQE_SIZE;
      this.cqeSize = flags & IORING_SETUP_CQE32 ? IO_URING_CQE32_SIZE : IO_URING_CQE_SIZE;

      const sqLen = p.sqOff.array + p.sqEntries * 4;
      const cqLen = p.cqOff.cqes + p.cqEntries * this.cqeSize;
      let sqRing: ArrayBuffer, cqRing: ArrayBuffer, sqesMap: ArrayBuffer;
      if (user) {
        // NO_MMAP: both rings are in the one region we gave, the SQEs in the other.
        if (Math.max(sqLen, cqLen) > user.rings.length) throw new RangeError(`io_uring: rings need ${Math.max(sqLen, cqLen)} bytes, ${user.rings.length} given`);
        sqRing = cqRing = user.rings.bytes.buffer as ArrayBuffer;
        sqesMap = user.sqes.bytes.buffer as ArrayBuffer;
      } else {
        const single = (p.features & IORING_FEAT_SINGLE_MMAP) !== 0;
        sqRing = this.map(single ? Math.max(sqLen, cqLen) : sqLen, IORING_OFF_SQ_RING, opts.dontFork);
        // With FEAT_SINGLE_MMAP both rings live in one mapping and the CQ offsets refer to it.
        cqRing = single ? sqRing : this.map(cqLen, IORING_OFF_CQ_RING, opts.dontFork);
        sqesMap = this.map(p.sqEntries * this.sqeSize, IORING_OFF_SQES, opts.dontFork);
      }

      this.sq = new Uint32Array(sqRing);
      this.cq = new Uint32Array(cqRing);
      this.cqI32 = new Int32Array(cqRing);
      this.sqes = new DataView(sqesMap);

      this.sqHeadIdx = p.sqOff.head >> 2;
      this.sqTailIdx = p.sqOff.tail >> 2;
      this.sqFlagsIdx = p.sqOff.flags >> 2;
      this.sqDroppedIdx = p.sqOff.dropped >> 2;
      this.sqMask = this.sq[p.sqOff.ringMask >> 2]!;
      this.cqHeadIdx = p.cqOff.head >> 2;
      this.cqTailIdx = p.cqOff.tail >> 2;
      this.cqOverflowIdx = p.cqOff.overflow >> 2;
      this.cqMask = this.cq[p.cqOff.ringMask >> 2]!;
      this.cqesIdx = p.cqOff.cqes >> 2;
      this.cqeWords = this.cqeSize >> 2;
      this.sqTail = Atomics.load(this.sq, this.sqTailIdx);
      this.cqHead = Atomics.load(this.cq, this.cqHeadIdx);

      // Identity SQ array (liburing's scheme): the SQE for tail t always lives in slot t & mask.
      if (!(flags & IORING_SETUP_NO_SQARRAY)) {
        const arrIdx = p.sqOff.array >> 2;
        for (let i = 0; i < p.sqEntries; i++) this.sq[arrIdx + i] = i;
      }
    } catch (e) {
      this.unmapAll();
      closeFd(fd);
      this.freeUserMem();
      throw e;
    }
  }

  /** NO_MMAP memory: freed after the fd is closed (the kernel keeps its own pin until it lets go). */
  private readonly userMem: { rings: AlignedBuffer; sqes: AlignedBuffer } | undefined;

  private freeUserMem(): void {
    this.userMem?.rings.free();
    this.userMem?.sqes.free();
  }

  private map(len: number, offset: number, dontFork?: boolean): ArrayBuffer {
    const addr = mmap(0, len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, this.fd, offset);
    const ab = toArrayBuffer(addr as Pointer, 0, len);
    this.maps.push({ addr, len, ab });
    if (dontFork) madvise(addr, len, MADV_DONTFORK);
    return ab;
  }

  private unmapAll(): void {
    for (const m of this.maps.splice(0)) {
      // Detach first so a stale view reads as empty instead of faulting on unmapped memory.
      m.ab.transfer(0);
      munmap(m.addr, m.len);
    }
  }

  // --- submission queue -----------------------------------------------------------------------

  /** SQEs prepared (or published) that the kernel has not consumed yet. */
  sqPending(): number {
    return (this.sqTail - Atomics.load(this.sq, this.sqHeadIdx)) >>> 0;
  }

  /** Free SQ slots. */
  sqSpace(): number {
    return this.sqEntries - this.sqPending();
  }

  /** Kernel-written SQ flags (IORING_SQ_*). */
  sqFlags(): number {
    return Atomics.load(this.sq, this.sqFlagsIdx);
  }

  /** Count of invalid SQEs the kernel skipped. */
  sqDropped(): number {
    return Atomics.load(this.sq, this.sqDroppedIdx);
  }

  /** Claim the next SQE slot, zeroed, for a hand-filled SQE; byte offset in `sqes`; throws when full. */
  getSqe(): number {
    const at = this.claim();
    zeroSqe(this.sqes, at, this.sqeSize);
    return at;
  }

  /** Next slot, not zeroed (encodeSqe zeroes); publication happens in submit*. */
  private claim(): number {
    if (this.closed) throw new Error("io_uring: ring is closed");
    if (this.sqPending() >= this.sqEntries) throw new RangeError("io_uring: submission queue full");
    const at = (this.sqTail & this.sqMask) * this.sqeSize;
    this.sqTail = (this.sqTail + 1) >>> 0;
    return at;
  }

  private prep(opcode: number, fd: number, off: number, addr: number, len: number, opFlags: number, userData: number, sqeFlags: number): void {
    encodeSqe(this.sqes, this.claim(), this.sqeSize, opcode, fd, off, addr, len, opFlags, userData, sqeFlags);
  }

  prepNop(userData: number, sqeFlags = 0): void {
    this.prep(IORING_OP_NOP, -1, 0, 0, 0, 0, userData, sqeFlags);
  }

  /** IORING_OP_READ of len bytes at file offset (-1 = file position) into memory at addr. */
  prepRead(fd: number, addr: number, len: number, offset: number, userData: number, rwFlags = 0, sqeFlags = 0): void {
    this.prep(IORING_OP_READ, fd, offset, addr, len, rwFlags, userData, sqeFlags);
  }

  /** IORING_OP_WRITE of len bytes from memory at addr to file offset (-1 = file position). */
  prepWrite(fd: number, addr: number, len: number, offset: number, userData: number, rwFlags = 0, sqeFlags = 0): void {
    this.prep(IORING_OP_WRITE, fd, offset, addr, len, rwFlags, userData, sqeFlags);
  }

  /** IORING_OP_READV: iovAddr points at nrVecs 16-byte {u64 base; u64 len}. */
  prepReadv(fd: number, iovAddr: number, nrVecs: number, offset: number, userData: number, rwFlags = 0, sqeFlags = 0): void {
    this.prep(IORING_OP_READV, fd, offset, iovAddr, nrVecs, rwFlags, userData, sqeFlags);
  }

  prepWritev(fd: number, iovAddr: number, nrVecs: number, offset: number, userData: number, rwFlags = 0, sqeFlags = 0): void {
    this.prep(IORING_OP_WRITEV, fd, offset, iovAddr, nrVecs, rwFlags, userData, sqeFlags);
  }

  /** IORING_OP_FSYNC of the whole file; fsyncFlags IORING_FSYNC_DATASYNC for fdatasync. */
  prepFsync(fd: number, userData: number, fsyncFlags = 0, sqeFlags = 0): void {
    this.prep(IORING_OP_FSYNC, fd, 0, 0, 0, fsyncFlags, userData, sqeFlags);
  }

  /** IORING_OP_FALLOCATE: the UAPI puts the length in addr and the mode in len. */
  prepFallocate(fd: number, mode: number, offset: number, len: number, userData: number, sqeFlags = 0): void {
    this.prep(IORING_OP_FALLOCATE, fd, offset, len, mode, 0, userData, sqeFlags);
  }

  /** IORING_OP_URING_CMD: payload up to 16 bytes, or 80 with SQE128. */
  prepUringCmd(fd: number, cmdOp: number, payload: Uint8Array | null, userData: number, sqeFlags = 0, uringCmdFlags = 0, addr = 0): void {
    const room = this.sqeSize - SQE_CMD;
    if (payload && payload.length > room) {
      throw new RangeError(`URING_CMD payload of ${payload.length} bytes exceeds ${room} (SQE ${this.sqeSize})`);
    }
    encodeUringCmd(this.sqes, this.claim(), this.sqeSize, fd, cmdOp, payload, userData, sqeFlags, uringCmdFlags, addr);
  }

  /** IORING_OP_POLL_ADD, multishot: a CQE each time fd becomes ready for `events` (POLLIN...). */
  prepPollMultishot(fd: number, events: number, userData: number): void {
    this.prep(IORING_OP_POLL_ADD, fd, 0, 0, IORING_POLL_ADD_MULTI, events, userData, 0);
  }

  // --- enter ----------------------------------------------------------------------------------

  /** The getevents argument and its timespec, in memory that does not move (lazily made). */
  private waitArg: AlignedBuffer | undefined;

  /**
   * Submit what is prepared and wait until `minComplete` CQEs are ready or `timeoutMs` passes
   * (-1: no bound). Returns when the wait ends, however it ended (timeout, signal, or a CQ that
   * must be reaped first): the caller reaps what is there and decides.
   */
  submitAndWaitFor(minComplete: number, timeoutMs: number): void {
    this.publish();
    let flags = IORING_ENTER_GETEVENTS | this.submitFlags();
    let arg = 0;
    let argSize = 0;
    if (timeoutMs >= 0) {
      this.waitArg ??= allocAligned(GETEVENTS_ARG_SIZE + 16);
      const dv = new DataView(this.waitArg.bytes.buffer);
      const ts = this.waitArg.ptr + GETEVENTS_ARG_SIZE;
      setU64(dv, GETEVENTS_ARG_SIZE, Math.floor(timeoutMs / 1000));
      setU64(dv, GETEVENTS_ARG_SIZE + 8, (timeoutMs % 1000) * 1_000_000);
      setU64(dv, 16, ts); // sigmask 0, sigmask_sz 0: no mask change
      flags |= IORING_ENTER_EXT_ARG;
      arg = this.waitArg.ptr;
      argSize = GETEVENTS_ARG_SIZE;
    }
    const r = Number(libc.syscall(SYS_io_uring_enter, this.fd, this.sqPending(), minComplete, flags, arg, argSize));
    if (r >= 0) return;
    const e = errno();
    if (e === E.ETIME || e === E.EINTR || e === E.EAGAIN || e === E.EBUSY) return;
    throw new SyscallError("io_uring_enter", e);
  }

  /** Raw io_uring_enter (no sigmask); retries EINTR, throws SyscallError otherwise. */
  enter(toSubmit: number, minComplete: number, flags: number): number {
    for (;;) {
      const r = Number(libc.syscall(SYS_io_uring_enter, this.fd, toSubmit, minComplete, flags, 0, 0));
      if (r >= 0) return r;
      const e = errno();
      if (e !== E.EINTR) throw new SyscallError("io_uring_enter", e);
    }
  }

  /** Publish the tail: SQE stores must be visible before it (Atomics.store is seq-cst). */
  private publish(): void {
    Atomics.store(this.sq, this.sqTailIdx, this.sqTail);
  }

  private submitFlags(): number {
    if (!(this.setupFlags & IORING_SETUP_SQPOLL)) return 0;
    return Atomics.load(this.sq, this.sqFlagsIdx) & IORING_SQ_NEED_WAKEUP ? IORING_ENTER_SQ_WAKEUP : 0;
  }

  /** Submit prepared SQEs without waiting; returns the number consumed. */
  submit(): number {
    return this.submitAndWait(0);
  }

  /** Submit and wait for minComplete CQEs; returns SQEs consumed (may be fewer: call again; 0 on EBUSY with CQEs to reap). */
  submitAndWait(minComplete: number): number {
    this.publish();
    let busy = 0;
    for (;;) {
      const toSubmit = this.sqPending();
      let flags = this.submitFlags();
      if (minComplete > 0) flags |= IORING_ENTER_GETEVENTS;
      if (toSubmit === 0 && flags === 0) return 0;
      const r = Number(libc.syscall(SYS_io_uring_enter, this.fd, toSubmit, minComplete, flags, 0, 0));
      if (r >= 0) return r;
      const e = errno();
      if (e === E.EINTR) continue;
      if (e === E.EAGAIN || e === E.EBUSY) {
        if (this.cqReady() > 0) return 0;
        if (++busy < ENTER_BUSY_RETRIES) {
          Bun.sleepSync(1);
          continue;
        }
      }
      throw new SyscallError("io_uring_enter", e);
    }
  }

  // --- completion queue -----------------------------------------------------------------------

  /** CQEs ready to reap. */
  cqReady(): number {
    return (Atomics.load(this.cq, this.cqTailIdx) - this.cqHead) >>> 0;
  }

  /** CQEs the kernel dropped (only without FEAT_NODROP). */
  cqOverflow(): number {
    return Atomics.load(this.cq, this.cqOverflowIdx);
  }

  /** Reap up to max ready CQEs, calling cb for each; returns the count. Does not allocate. */
  reap(cb: CqeCallback, max = 0xffffffff): number {
    const tail = Atomics.load(this.cq, this.cqTailIdx); // load-acquire before reading entries
    const cq = this.cq;
    let head = this.cqHead;
    let n = 0;
    try {
      while (head !== tail && n < max) {
        const i = this.cqesIdx + (head & this.cqMask) * this.cqeWords;
        const userData = cq[i]! + cq[i + 1]! * TWO32;
        const res = this.cqI32[i + 2]!;
        const flags = cq[i + 3]!;
        head = (head + 1) >>> 0;
        n++;
        cb(userData, res, flags);
      }
    } finally {
      this.cqHead = head;
      Atomics.store(cq, this.cqHeadIdx, head); // release the slots after the reads
    }
    return n;
  }

  /** Reap up to the arrays' length (or max) CQEs into preallocated arrays; returns the count. */
  reapInto(userData: Float64Array, res: Int32Array, flags: Uint32Array | null = null, max = userData.length): number {
    const tail = Atomics.load(this.cq, this.cqTailIdx);
    const cq = this.cq;
    let head = this.cqHead;
    let n = 0;
    const lim = Math.min(max, userData.length, res.length);
    while (head !== tail && n < lim) {
      const i = this.cqesIdx + (head & this.cqMask) * this.cqeWords;
      userData[n] = cq[i]! + cq[i + 1]! * TWO32;
      res[n] = this.cqI32[i + 2]!;
      if (flags) flags[n] = cq[i + 3]!;
      head = (head + 1) >>> 0;
      n++;
    }
    this.cqHead = head;
    Atomics.store(cq, this.cqHeadIdx, head);
    return n;
  }

  // --- misc -----------------------------------------------------------------------------------

  /** io_uring_register(fd, opcode, arg, nrArgs); arg is an address (0 for none). */
  register(opcode: number, arg: number, nrArgs: number): number {
    for (;;) {
      const r = Number(libc.syscall(SYS_io_uring_register, this.fd, opcode, arg, nrArgs, 0, 0));
      if (r >= 0) return r;
      const e = errno();
      if (e !== E.EINTR) throw new SyscallError("io_uring_register", e);
    }
  }

  get isClosed(): boolean {
    return this.closed;
  }

  /** Unmap the rings and close the fd; in-flight requests are cancelled by the kernel. */
  close(): void {
    if (this.closed) return;
    this.closed = true;
    this.unmapAll();
    closeFd(this.fd);
    this.freeUserMem();
    this.waitArg?.free();
  }
}
