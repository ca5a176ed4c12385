// The raw FUSE kernel protocol (fuse_kernel.h, protocol 7.x): opcodes, INIT flags, and the
// structs a block-image server needs, as offsets into DataViews. No libfuse.

export const FUSE_KERNEL_VERSION = 7;
/** The minor we speak: ≥ 36 so flags2 (INIT_EXT) works, ≥ 40 for NOTIFY_RESEND. */
export const FUSE_KERNEL_MINOR_VERSION = 40;
export const FUSE_ROOT_ID = 1;

export const FUSE_LOOKUP = 1;
export const FUSE_FORGET = 2;
export const FUSE_GETATTR = 3;
export const FUSE_SETATTR = 4;
export const FUSE_OPEN = 14;
export const FUSE_READ = 15;
export const FUSE_WRITE = 16;
export const FUSE_STATFS = 17;
export const FUSE_RELEASE = 18;
export const FUSE_FSYNC = 20;
export const FUSE_GETXATTR = 22;
export const FUSE_LISTXATTR = 23;
export const FUSE_FLUSH = 25;
export const FUSE_INIT = 26;
export const FUSE_OPENDIR = 27;
export const FUSE_READDIR = 28;
export const FUSE_RELEASEDIR = 29;
export const FUSE_FSYNCDIR = 30;
export const FUSE_ACCESS = 34;
export const FUSE_INTERRUPT = 36;
export const FUSE_DESTROY = 38;
export const FUSE_BATCH_FORGET = 42;
export const FUSE_FALLOCATE = 43;
export const FUSE_LSEEK = 46;
export const FUSE_STATX = 52;

// INIT flags (low word) and flags2 (high word, bit numbers minus 32).
export const FUSE_ASYNC_READ = 1 << 0;
export const FUSE_BIG_WRITES = 1 << 5;
export const FUSE_ASYNC_DIO = 1 << 15;
export const FUSE_WRITEBACK_CACHE = 1 << 16;
export const FUSE_PARALLEL_DIROPS = 1 << 18;
export const FUSE_MAX_PAGES = 1 << 22;
export const FUSE_INIT_EXT = 1 << 30;
export const FUSE2_HAS_RESEND = 1 << (39 - 32); // flags2 bit 7
/** Requests and replies over io_uring (FUSE_OVER_IO_URING, protocol 7.42): flags2 bit 9. */
export const FUSE2_OVER_IO_URING = 1 << (41 - 32);

export const FOPEN_DIRECT_IO = 1;
export const FOPEN_KEEP_CACHE = 2;
export const FOPEN_PARALLEL_DIRECT_WRITES = 64;

export const FATTR_SIZE = 8;

export const FUSE_NOTIFY_INVAL_INODE = 2;
export const FUSE_NOTIFY_RESEND = 7;
export const FUSE_UNIQUE_RESEND = 1n << 63n;

export const FUSE_DEV_IOC_CLONE = 0x8004e500;

// FUSE over io_uring (include/uapi/linux/fuse.h, fs/fuse/dev_uring.c): IORING_OP_URING_CMD on
// /dev/fuse with 128-byte SQEs. REGISTER lends the kernel one entry (a header buffer and a payload
// buffer, as a 2-iovec array in sqe.addr/len) on queue `qid` and completes when a request is in it;
// COMMIT_AND_FETCH answers the entry's request and lends it again. One queue per possible CPU; a
// request goes to the queue of the CPU its caller runs on, and the connection switches from
// read/write of /dev/fuse to the ring once every queue has an entry.
export const FUSE_IO_URING_CMD_REGISTER = 1;
export const FUSE_IO_URING_CMD_COMMIT_AND_FETCH = 2;
/** struct fuse_uring_req_header: in_out[128] (fuse_in_header / fuse_out_header), op_in[128], ring_ent_in_out. */
export const FUSE_URING_OP_IN = 128;
export const FUSE_URING_ENT_IN_OUT = 256;
export const FUSE_URING_HEADER_SIZE = 288;
/** struct fuse_uring_ent_in_out: flags u64 @0, commit_id u64 @8, payload_sz u32 @16. */
export const FUSE_URING_COMMIT_ID = FUSE_URING_ENT_IN_OUT + 8;
export const FUSE_URING_PAYLOAD_SZ = FUSE_URING_ENT_IN_OUT + 16;
/** struct fuse_uring_cmd_req in the SQE's command area: flags u64 @0, commit_id u64 @8, qid u16 @16. */
export const FUSE_URING_CMD_COMMIT_ID = 8;
export const FUSE_URING_CMD_QID = 16;
/** The module parameter that lets connections use the ring (off by default; root may set it). */
export const FUSE_ENABLE_URING_PARAM = "/sys/module/fuse/parameters/enable_uring";

/** Each read of /dev/fuse returns one request; the buffer must hold max_write + headers. */
export const FUSE_MIN_READ_BUFFER = 8192;
export const FUSE_IN_HEADER = 40;
export const FUSE_OUT_HEADER = 16;
export const FUSE_ATTR_SIZE = 88;
export const FUSE_ENTRY_OUT_SIZE = 128;
export const FUSE_ATTR_OUT_SIZE = 104;
export const FUSE_OPEN_OUT_SIZE = 16;
export const FUSE_INIT_OUT_SIZE = 64;
export const FUSE_WRITE_OUT_SIZE = 8;
export const FUSE_KSTATFS_SIZE = 80;
/** WRITE data starts after fuse_in_header (40) + fuse_write_in (40). */
export const FUSE_WRITE_DATA_OFFSET = 80;

export const S_IFREG = 0o100000;
export const S_IFDIR = 0o040000;

export interface FuseInHeader {
  len: number;
  opcode: number;
  unique: bigint;
  nodeid: number;
  uid: number;
  gid: number;
  pid: number;
}

export function decodeInHeader(dv: DataView): FuseInHeader {
  return {
    len: dv.getUint32(0, true),
    opcode: dv.getUint32(4, true),
    unique: dv.getBigUint64(8, true),
    nodeid: Number(dv.getBigUint64(16, true)),
    uid: dv.getUint32(24, true),
    gid: dv.getUint32(28, true),
    pid: dv.getUint32(32, true),
  };
}

/** fuse_out_header at 0: len, error (0 or −errno), unique. */
export function encodeOutHeader(dv: DataView, len: number, error: number, unique: bigint): void {
  dv.setUint32(0, len, true);
  dv.setInt32(4, error, true);
  dv.setBigUint64(8, unique, true);
}

export interface FuseAttr {
  ino: number;
  size: number;
  mode: number;
  nlink: number;
  uid: number;
  gid: number;
  blksize: number;
  mtimeSec: number;
}

export function encodeAttr(dv: DataView, at: number, a: FuseAttr): void {
  for (let i = 0; i < FUSE_ATTR_SIZE; i += 4) dv.setUint32(at + i, 0, true);
  dv.setBigUint64(at + 0, BigInt(a.ino), true);
  dv.setBigUint64(at + 8, BigInt(a.size), true);
  dv.setBigUint64(at + 16, BigInt(Math.ceil(a.size / 512)), true);
  for (const off of [24, 32, 40]) dv.setBigUint64(at + off, BigInt(a.mtimeSec), true);
  dv.setUint32(at + 60, a.mode, true);
  dv.setUint32(at + 64, a.nlink, true);
  dv.setUint32(at + 68, a.uid, true);
  dv.setUint32(at + 72, a.gid, true);
  dv.setUint32(at + 80, a.blksize, true);
}

/** fuse_entry_out: nodeid, generation, entry/attr validity, then the attr. */
export function encodeEntryOut(dv: DataView, at: number, nodeid: number, validSec: number, a: FuseAttr): void {
  dv.setBigUint64(at + 0, BigInt(nodeid), true);
  dv.setBigUint64(at + 8, 0n, true);
  dv.setBigUint64(at + 16, BigInt(validSec), true);
  dv.setBigUint64(at + 24, BigInt(validSec), true);
  dv.setUint32(at + 32, 0, true);
  dv.setUint32(at + 36, 0, true);
  encodeAttr(dv, at + 40, a);
}

export function encodeAttrOut(dv: DataView, at: number, validSec: number, a: FuseAttr): void {
  dv.setBigUint64(at + 0, BigInt(validSec), true);
  dv.setUint32(at + 8, 0, true);
  dv.setUint32(at + 12, 0, true);
  encodeAttr(dv, at + 16, a);
}

export interface FuseInitIn {
  major: number;
  minor: number;
  maxReadahead: number;
  flags: number;
  flags2: number;
}

export function decodeInitIn(dv: DataView, at: number): FuseInitIn {
  return {
    major: dv.getUint32(at, true),
    minor: dv.getUint32(at + 4, true),
    maxReadahead: dv.getUint32(at + 8, true),
    flags: dv.getUint32(at + 12, true),
    flags2: dv.getUint32(at + 16, true),
  };
}

export interface FuseInitOut {
  major: number;
  minor: number;
  maxReadahead: number;
  flags: number;
  maxBackground: number;
  congestionThreshold: number;
  maxWrite: number;
  timeGran: number;
  maxPages: number;
  flags2: number;
}

export function encodeInitOut(dv: DataView, at: number, o: FuseInitOut): void {
  for (let i = 0; i < FUSE_INIT_OUT_SIZE; i += 4) dv.setUint32(at + i, 0, true);
  dv.setUint32(at + 0, o.major, true);
  dv.setUint32(at + 4, o.minor, true);
  dv.setUint32(at + 8, o.maxReadahead, true);
  dv.setUint32(at + 12, o.flags >>> 0, true);
  dv.setUint16(at + 16, o.maxBackground, true);
  dv.setUint16(at + 18, o.congestionThreshold, true);
  dv.setUint32(at + 20, o.maxWrite, true);
  dv.setUint32(at + 24, o.timeGran, true);
  dv.setUint16(at + 28, o.maxPages, true);
  dv.setUint32(at + 32, o.flags2 >>> 0, true);
}

/** fuse_read_in / fuse_write_in: fh @0, offset @8, size @16. */
export function decodeRwIn(dv: DataView, at: number): { fh: number; offset: number; size: number } {
  return { fh: Number(dv.getBigUint64(at, true)), offset: Number(dv.getBigUint64(at + 8, true)), size: dv.getUint32(at + 16, true) };
}

/** fuse_fallocate_in: fh @0, offset @8, length @16, mode @24. */
export function decodeFallocateIn(dv: DataView, at: number): { offset: number; length: number; mode: number } {
  return { offset: Number(dv.getBigUint64(at + 8, true)), length: Number(dv.getBigUint64(at + 16, true)), mode: dv.getUint32(at + 24, true) };
}

/** fuse_setattr_in: valid @0, size @16. */
export function decodeSetattrIn(dv: DataView, at: number): { valid: number; size: number } {
  return { valid: dv.getUint32(at, true), size: Number(dv.getBigUint64(at + 16, true)) };
}

export function encodeOpenOut(dv: DataView, at: number, fh: number, openFlags: number): void {
  dv.setBigUint64(at, BigInt(fh), true);
  dv.setUint32(at + 8, openFlags, true);
  dv.setInt32(at + 12, 0, true);
}

export function encodeStatfs(dv: DataView, at: number, blocks: number, bsize: number): void {
  for (let i = 0; i < FUSE_KSTATFS_SIZE; i += 4) dv.setUint32(at + i, 0, true);
  dv.setBigUint64(at + 0, BigInt(blocks), true);
  dv.setUint32(at + 40, bsize, true);
  dv.setUint32(at + 44, 255, true);
  dv.setUint32(at + 48, bsize, true);
}

/** The mount(2) data string libfuse builds, plus our options. */
export function mountOptions(fd: number, rootmode: number, uid: number, gid: number, extra: string[] = []): string {
  return [`fd=${fd}`, `rootmode=${rootmode.toString(8)}`, `user_id=${uid}`, `group_id=${gid}`, ...extra].join(",");
}
