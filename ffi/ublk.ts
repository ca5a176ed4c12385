// ublk UAPI (include/uapi/linux/ublk_cmd.h) for bun:ffi: command numbers, struct layouts and pure
// encoders/decoders; kernel versions are given where a feature depends on one. Nothing here touches the kernel.

import { IO_URING_SQE128_SIZE, IO_URING_SQE_SIZE, SQE_CMD, encodeUringCmd, getU64, setU64 } from "./io_uring.ts";
import { PAGE_SIZE, errnoName, strerror } from "./libc.ts";

// ---------------------------------------------------------------------------------------------
// named errors

/** An argument that cannot be encoded into a ublk structure (wrong range, wrong type, kernel rule). */
export class UblkInvalidArgument extends Error {
  override name = "UblkInvalidArgument";
  constructor(
    readonly field: string,
    readonly value: unknown,
    why: string,
  ) {
    super(`ublk ${field} = ${String(value)}: ${why}`);
  }
}

/** Kernel-internal ENOTSUPP (524), which early ublk drivers return for unknown commands. */
export const ENOTSUPP = 524;

/** errnoName() plus ENOTSUPP, which libc does not know. */
export function ublkErrnoName(n: number): string {
  return n === ENOTSUPP ? "ENOTSUPP" : errnoName(n);
}

/** A ublk control or I/O command that the driver answered with a negative CQE res. */
export class UblkError extends Error {
  override name = "UblkError";
  /** Errno name, e.g. "EINVAL". */
  readonly code: string;
  constructor(
    /** Command name without prefix, e.g. "ADD_DEV", "FETCH_REQ". */
    readonly command: string,
    /** Positive errno (the CQE carried -errno). */
    readonly errno: number,
    /** The device the command was for (-1 when none). */
    readonly devId: number = -1,
    /** Extra context shown after the errno text. */
    readonly detail: string = "",
  ) {
    const code = ublkErrnoName(errno);
    const text = errno === ENOTSUPP ? "Operation not supported by this driver" : strerror(errno);
    super(`ublk ${command}${devId >= 0 ? ` dev ${devId}` : ""}: ${code} (${text})${detail ? `; ${detail}` : ""}`);
    this.code = code;
  }
}

// ---------------------------------------------------------------------------------------------
// ioctl number encoding (asm-generic/ioctl.h, which x86_64 uses)

export const _IOC_NRBITS = 8;
export const _IOC_TYPEBITS = 8;
export const _IOC_SIZEBITS = 14;
export const _IOC_DIRBITS = 2;
export const _IOC_NRSHIFT = 0;
export const _IOC_TYPESHIFT = _IOC_NRSHIFT + _IOC_NRBITS;
export const _IOC_SIZESHIFT = _IOC_TYPESHIFT + _IOC_TYPEBITS;
export const _IOC_DIRSHIFT = _IOC_SIZESHIFT + _IOC_SIZEBITS;
export const _IOC_NONE = 0;
export const _IOC_WRITE = 1;
export const _IOC_READ = 2;

function iocType(type: number | string): number {
  const t = typeof type === "string" ? (type.length === 1 ? type.charCodeAt(0) : -1) : type;
  if (!Number.isInteger(t) || t < 0 || t >= 1 << _IOC_TYPEBITS) throw new UblkInvalidArgument("ioctl type", type, "must be one byte");
  return t;
}

/** _IOC(dir, type, nr, size) as an unsigned 32-bit number (bit 31 set for _IOR/_IOWR). */
export function _IOC(dir: number, type: number | string, nr: number, size: number): number {
  if (!Number.isInteger(dir) || dir < 0 || dir > 3) throw new UblkInvalidArgument("ioctl dir", dir, "must be 0..3");
  if (!Number.isInteger(nr) || nr < 0 || nr >= 1 << _IOC_NRBITS) throw new UblkInvalidArgument("ioctl nr", nr, "must be 0..255");
  if (!Number.isInteger(size) || size < 0 || size >= 1 << _IOC_SIZEBITS) throw new UblkInvalidArgument("ioctl size", size, "must be < 16384");
  // Multiply the direction in: `dir << 30` would go negative for _IOC_READ.
  return dir * 2 ** _IOC_DIRSHIFT + ((size << _IOC_SIZESHIFT) | (iocType(type) << _IOC_TYPESHIFT) | (nr << _IOC_NRSHIFT));
}
export function _IO(type: number | string, nr: number): number {
  return _IOC(_IOC_NONE, type, nr, 0);
}
export function _IOR(type: number | string, nr: number, size: number): number {
  return _IOC(_IOC_READ, type, nr, size);
}
export function _IOW(type: number | string, nr: number, size: number): number {
  return _IOC(_IOC_WRITE, type, nr, size);
}
export function _IOWR(type: number | string, nr: number, size: number): number {
  return _IOC(_IOC_READ | _IOC_WRITE, type, nr, size);
}
export function _IOC_DIR(cmd: number): number {
  return Math.floor(cmd / 2 ** _IOC_DIRSHIFT) & 3;
}
export function _IOC_TYPE(cmd: number): number {
  return (cmd >>> _IOC_TYPESHIFT) & 0xff;
}
export function _IOC_NR(cmd: number): number {
  return (cmd >>> _IOC_NRSHIFT) & 0xff;
}
export function _IOC_SIZE(cmd: number): number {
  return (cmd >>> _IOC_SIZESHIFT) & ((1 << _IOC_SIZEBITS) - 1);
}

// ---------------------------------------------------------------------------------------------
// struct sizes and offsets (x86_64)

export const UBLKSRV_CTRL_CMD_SIZE = 32;
export const UBLKSRV_CTRL_DEV_INFO_SIZE = 64;
export const UBLKSRV_IO_CMD_SIZE = 16;
export const UBLKSRV_IO_DESC_SIZE = 24;
export const UBLK_BATCH_IO_SIZE = 16;
export const UBLK_FEATURES_LEN = 8;

/** struct ublksrv_ctrl_cmd (copied to SQE offset 48 of a 128-byte SQE). */
export const CTRL_CMD_DEV_ID = 0; // u32
export const CTRL_CMD_QUEUE_ID = 4; // u16
export const CTRL_CMD_LEN = 6; // u16
export const CTRL_CMD_ADDR = 8; // u64
export const CTRL_CMD_DATA = 16; // u64 data[0]
export const CTRL_CMD_DEV_PATH_LEN = 24; // u16
export const CTRL_CMD_PAD = 26; // u16
export const CTRL_CMD_RESERVED = 28; // u32

/** struct ublksrv_ctrl_dev_info. */
export const DEV_INFO_NR_HW_QUEUES = 0; // u16
export const DEV_INFO_QUEUE_DEPTH = 2; // u16
export const DEV_INFO_STATE = 4; // u16
export const DEV_INFO_PAD0 = 6; // u16
export const DEV_INFO_MAX_IO_BUF_BYTES = 8; // u32
export const DEV_INFO_DEV_ID = 12; // u32
export const DEV_INFO_UBLKSRV_PID = 16; // s32
export const DEV_INFO_PAD1 = 20; // u32
export const DEV_INFO_FLAGS = 24; // u64
export const DEV_INFO_UBLKSRV_FLAGS = 32; // u64
export const DEV_INFO_OWNER_UID = 40; // u32
export const DEV_INFO_OWNER_GID = 44; // u32
export const DEV_INFO_RESERVED1 = 48; // u64
export const DEV_INFO_RESERVED2 = 56; // u64

/** struct ublksrv_io_cmd (at SQE offset 48 of a 64-byte SQE). */
export const IO_CMD_Q_ID = 0; // u16
export const IO_CMD_TAG = 2; // u16
export const IO_CMD_RESULT = 4; // s32
export const IO_CMD_ADDR = 8; // u64 (addr / zone_append_lba)

/** struct ublksrv_io_desc (one per tag in the mmapped array). */
export const IO_DESC_OP_FLAGS = 0; // u32
export const IO_DESC_NR_SECTORS = 4; // u32 (nr_zones for REPORT_ZONES)
export const IO_DESC_START_SECTOR = 8; // u64
export const IO_DESC_ADDR = 16; // u64

/** struct ublk_params: header and the offset of each sub-struct. */
export const UBLK_PARAMS_SIZE = 152;
export const PARAMS_LEN = 0; // u32
export const PARAMS_TYPES = 4; // u32
export const PARAMS_BASIC = 8;
export const PARAMS_DISCARD = 40;
export const PARAMS_DEVT = 60;
export const PARAMS_ZONED = 80;
export const PARAMS_DMA = 112;
export const PARAMS_SEG = 120;
export const PARAMS_INTEGRITY = 136;
export const UBLK_PARAM_BASIC_SIZE = 32;
export const UBLK_PARAM_DISCARD_SIZE = 20;
export const UBLK_PARAM_DEVT_SIZE = 16;
export const UBLK_PARAM_ZONED_SIZE = 32;
export const UBLK_PARAM_DMA_ALIGN_SIZE = 8;
export const UBLK_PARAM_SEGMENT_SIZE = 16;
export const UBLK_PARAM_INTEGRITY_SIZE = 16;

// ---------------------------------------------------------------------------------------------
// commands

/** Legacy control opcodes (plain numbers; 6.0–6.3 or CONFIG_BLKDEV_UBLK_LEGACY_OPCODES). */
export const UBLK_CMD_GET_QUEUE_AFFINITY = 0x01;
export const UBLK_CMD_GET_DEV_INFO = 0x02;
export const UBLK_CMD_ADD_DEV = 0x04;
export const UBLK_CMD_DEL_DEV = 0x05;
export const UBLK_CMD_START_DEV = 0x06;
export const UBLK_CMD_STOP_DEV = 0x07;
export const UBLK_CMD_SET_PARAMS = 0x08;
export const UBLK_CMD_GET_PARAMS = 0x09;
export const UBLK_CMD_START_USER_RECOVERY = 0x10;
export const UBLK_CMD_END_USER_RECOVERY = 0x11;
export const UBLK_CMD_GET_DEV_INFO2 = 0x12;

const U = "u";
/** ioctl-encoded control opcodes (sqe.cmd_op on /dev/ublk-control). */
export const UBLK_U_CMD_GET_QUEUE_AFFINITY = _IOR(U, UBLK_CMD_GET_QUEUE_AFFINITY, UBLKSRV_CTRL_CMD_SIZE);
export const UBLK_U_CMD_GET_DEV_INFO = _IOR(U, UBLK_CMD_GET_DEV_INFO, UBLKSRV_CTRL_CMD_SIZE);
export const UBLK_U_CMD_ADD_DEV = _IOWR(U, UBLK_CMD_ADD_DEV, UBLKSRV_CTRL_CMD_SIZE);
export const UBLK_U_CMD_DEL_DEV = _IOWR(U, UBLK_CMD_DEL_DEV, UBLKSRV_CTRL_CMD_SIZE);
export const UBLK_U_CMD_START_DEV = _IOWR(U, UBLK_CMD_START_DEV, UBLKSRV_CTRL_CMD_SIZE);
export const UBLK_U_CMD_STOP_DEV = _IOWR(U, UBLK_CMD_STOP_DEV, UBLKSRV_CTRL_CMD_SIZE);
export const UBLK_U_CMD_SET_PARAMS = _IOWR(U, UBLK_CMD_SET_PARAMS, UBLKSRV_CTRL_CMD_SIZE);
export const UBLK_U_CMD_GET_PARAMS = _IOR(U, UBLK_CMD_GET_PARAMS, UBLKSRV_CTRL_CMD_SIZE);
export const UBLK_U_CMD_START_USER_RECOVERY = _IOWR(U, UBLK_CMD_START_USER_RECOVERY, UBLKSRV_CTRL_CMD_SIZE);
export const UBLK_U_CMD_END_USER_RECOVERY = _IOWR(U, UBLK_CMD_END_USER_RECOVERY, UBLKSRV_CTRL_CMD_SIZE);
export const UBLK_U_CMD_GET_DEV_INFO2 = _IOR(U, UBLK_CMD_GET_DEV_INFO2, UBLKSRV_CTRL_CMD_SIZE);
export const UBLK_U_CMD_GET_FEATURES = _IOR(U, 0x13, UBLKSRV_CTRL_CMD_SIZE);
export const UBLK_U_CMD_DEL_DEV_ASYNC = _IOR(U, 0x14, UBLKSRV_CTRL_CMD_SIZE);
export const UBLK_U_CMD_UPDATE_SIZE = _IOWR(U, 0x15, UBLKSRV_CTRL_CMD_SIZE);
export const UBLK_U_CMD_QUIESCE_DEV = _IOWR(U, 0x16, UBLKSRV_CTRL_CMD_SIZE);
export const UBLK_U_CMD_TRY_STOP_DEV = _IOWR(U, 0x17, UBLKSRV_CTRL_CMD_SIZE);
export const UBLK_U_CMD_REG_BUF = _IOWR(U, 0x18, UBLKSRV_CTRL_CMD_SIZE);
export const UBLK_U_CMD_UNREG_BUF = _IOWR(U, 0x19, UBLKSRV_CTRL_CMD_SIZE);

/** Legacy I/O opcodes. */
export const UBLK_IO_FETCH_REQ = 0x20;
export const UBLK_IO_COMMIT_AND_FETCH_REQ = 0x21;
export const UBLK_IO_NEED_GET_DATA = 0x22;

/** ioctl-encoded I/O opcodes (sqe.cmd_op on /dev/ublkcN). */
export const UBLK_U_IO_FETCH_REQ = _IOWR(U, UBLK_IO_FETCH_REQ, UBLKSRV_IO_CMD_SIZE);
export const UBLK_U_IO_COMMIT_AND_FETCH_REQ = _IOWR(U, UBLK_IO_COMMIT_AND_FETCH_REQ, UBLKSRV_IO_CMD_SIZE);
export const UBLK_U_IO_NEED_GET_DATA = _IOWR(U, UBLK_IO_NEED_GET_DATA, UBLKSRV_IO_CMD_SIZE);
export const UBLK_U_IO_REGISTER_IO_BUF = _IOWR(U, 0x23, UBLKSRV_IO_CMD_SIZE);
export const UBLK_U_IO_UNREGISTER_IO_BUF = _IOWR(U, 0x24, UBLKSRV_IO_CMD_SIZE);
export const UBLK_U_IO_PREP_IO_CMDS = _IOWR(U, 0x25, UBLK_BATCH_IO_SIZE);
export const UBLK_U_IO_COMMIT_IO_CMDS = _IOWR(U, 0x26, UBLK_BATCH_IO_SIZE);
export const UBLK_U_IO_FETCH_IO_CMDS = _IOWR(U, 0x27, UBLK_BATCH_IO_SIZE);

/** CQE res of FETCH/COMMIT (only ABORT means "do not re-fetch"). */
export const UBLK_IO_RES_OK = 0;
export const UBLK_IO_RES_NEED_GET_DATA = 1;
export const UBLK_IO_RES_ABORT = -19; // -ENODEV

const CMD_NAMES = new Map<number, string>();
for (const [name, nr, encoded] of [
  ["GET_QUEUE_AFFINITY", UBLK_CMD_GET_QUEUE_AFFINITY, UBLK_U_CMD_GET_QUEUE_AFFINITY],
  ["GET_DEV_INFO", UBLK_CMD_GET_DEV_INFO, UBLK_U_CMD_GET_DEV_INFO],
  ["ADD_DEV", UBLK_CMD_ADD_DEV, UBLK_U_CMD_ADD_DEV],
  ["DEL_DEV", UBLK_CMD_DEL_DEV, UBLK_U_CMD_DEL_DEV],
  ["START_DEV", UBLK_CMD_START_DEV, UBLK_U_CMD_START_DEV],
  ["STOP_DEV", UBLK_CMD_STOP_DEV, UBLK_U_CMD_STOP_DEV],
  ["SET_PARAMS", UBLK_CMD_SET_PARAMS, UBLK_U_CMD_SET_PARAMS],
  ["GET_PARAMS", UBLK_CMD_GET_PARAMS, UBLK_U_CMD_GET_PARAMS],
  ["START_USER_RECOVERY", UBLK_CMD_START_USER_RECOVERY, UBLK_U_CMD_START_USER_RECOVERY],
  ["END_USER_RECOVERY", UBLK_CMD_END_USER_RECOVERY, UBLK_U_CMD_END_USER_RECOVERY],
  ["GET_DEV_INFO2", UBLK_CMD_GET_DEV_INFO2, UBLK_U_CMD_GET_DEV_INFO2],
  ["GET_FEATURES", -1, UBLK_U_CMD_GET_FEATURES],
  ["DEL_DEV_ASYNC", -1, UBLK_U_CMD_DEL_DEV_ASYNC],
  ["UPDATE_SIZE", -1, UBLK_U_CMD_UPDATE_SIZE],
  ["QUIESCE_DEV", -1, UBLK_U_CMD_QUIESCE_DEV],
  ["TRY_STOP_DEV", -1, UBLK_U_CMD_TRY_STOP_DEV],
  ["REG_BUF", -1, UBLK_U_CMD_REG_BUF],
  ["UNREG_BUF", -1, UBLK_U_CMD_UNREG_BUF],
  ["FETCH_REQ", UBLK_IO_FETCH_REQ, UBLK_U_IO_FETCH_REQ],
  ["COMMIT_AND_FETCH_REQ", UBLK_IO_COMMIT_AND_FETCH_REQ, UBLK_U_IO_COMMIT_AND_FETCH_REQ],
  ["NEED_GET_DATA", UBLK_IO_NEED_GET_DATA, UBLK_U_IO_NEED_GET_DATA],
  ["REGISTER_IO_BUF", -1, UBLK_U_IO_REGISTER_IO_BUF],
  ["UNREGISTER_IO_BUF", -1, UBLK_U_IO_UNREGISTER_IO_BUF],
  ["PREP_IO_CMDS", -1, UBLK_U_IO_PREP_IO_CMDS],
  ["COMMIT_IO_CMDS", -1, UBLK_U_IO_COMMIT_IO_CMDS],
  ["FETCH_IO_CMDS", -1, UBLK_U_IO_FETCH_IO_CMDS],
] as const) {
  CMD_NAMES.set(encoded, name);
  if (nr >= 0) CMD_NAMES.set(nr, name);
}

/** "ADD_DEV" for UBLK_U_CMD_ADD_DEV or legacy 0x04; "CMD_0x…" for an unknown opcode. */
export function ublkCmdName(cmdOp: number): string {
  return CMD_NAMES.get(cmdOp >>> 0) ?? `CMD_0x${(cmdOp >>> 0).toString(16)}`;
}

/** The legacy plain number for an ioctl-encoded opcode, or -1 where none exists (0x13 and later). */
export function ublkLegacyOp(cmdOp: number): number {
  const nr = _IOC_NR(cmdOp);
  if (_IOC_TYPE(cmdOp) !== U.charCodeAt(0)) return -1;
  return nr <= UBLK_CMD_GET_DEV_INFO2 || (nr >= UBLK_IO_FETCH_REQ && nr <= UBLK_IO_NEED_GET_DATA) ? nr : -1;
}

// ---------------------------------------------------------------------------------------------
// flags, states, ops

/** UBLK_F_* (dev_info.flags; GET_FEATURES mask). All below bit 32, so plain numbers work. */
export const UBLK_F_SUPPORT_ZERO_COPY = 1 << 0;
export const UBLK_F_URING_CMD_COMP_IN_TASK = 1 << 1;
export const UBLK_F_NEED_GET_DATA = 1 << 2;
export const UBLK_F_USER_RECOVERY = 1 << 3;
export const UBLK_F_USER_RECOVERY_REISSUE = 1 << 4;
export const UBLK_F_UNPRIVILEGED_DEV = 1 << 5;
export const UBLK_F_CMD_IOCTL_ENCODE = 1 << 6;
export const UBLK_F_USER_COPY = 1 << 7;
export const UBLK_F_ZONED = 1 << 8;
export const UBLK_F_USER_RECOVERY_FAIL_IO = 1 << 9;
export const UBLK_F_UPDATE_SIZE = 1 << 10;
export const UBLK_F_AUTO_BUF_REG = 1 << 11;
export const UBLK_F_QUIESCE = 1 << 12;
export const UBLK_F_PER_IO_DAEMON = 1 << 13;
export const UBLK_F_BUF_REG_OFF_DAEMON = 1 << 14;
export const UBLK_F_BATCH_IO = 1 << 15;
export const UBLK_F_INTEGRITY = 1 << 16;
export const UBLK_F_SAFE_STOP_DEV = 1 << 17;
export const UBLK_F_NO_AUTO_PART_SCAN = 1 << 18;
export const UBLK_F_SHMEM_ZC = 1 << 19;

/** What a driver without GET_FEATURES (before 6.5) is assumed to support: the 6.0/6.1 set. */
export const UBLK_FEATURES_BASELINE =
  UBLK_F_URING_CMD_COMP_IN_TASK | UBLK_F_NEED_GET_DATA | UBLK_F_USER_RECOVERY | UBLK_F_USER_RECOVERY_REISSUE;

/** dev_info.state */
export const UBLK_S_DEV_DEAD = 0;
export const UBLK_S_DEV_LIVE = 1;
export const UBLK_S_DEV_QUIESCED = 2;
export const UBLK_S_DEV_FAIL_IO = 3;

/** ublksrv_io_desc op (op_flags bits 0–7). */
export const UBLK_IO_OP_READ = 0;
export const UBLK_IO_OP_WRITE = 1;
export const UBLK_IO_OP_FLUSH = 2;
export const UBLK_IO_OP_DISCARD = 3;
export const UBLK_IO_OP_WRITE_SAME = 4;
export const UBLK_IO_OP_WRITE_ZEROES = 5;
export const UBLK_IO_OP_ZONE_OPEN = 10;
export const UBLK_IO_OP_ZONE_CLOSE = 11;
export const UBLK_IO_OP_ZONE_FINISH = 12;
export const UBLK_IO_OP_ZONE_APPEND = 13;
export const UBLK_IO_OP_ZONE_RESET_ALL = 14;
export const UBLK_IO_OP_ZONE_RESET = 15;
export const UBLK_IO_OP_REPORT_ZONES = 18;

/** ublksrv_io_desc flags: already in op_flags bit positions (test op_flags & FLAG, never >> 8 first). */
export const UBLK_IO_F_FAILFAST_DEV = 1 << 8;
export const UBLK_IO_F_FAILFAST_TRANSPORT = 1 << 9;
export const UBLK_IO_F_FAILFAST_DRIVER = 1 << 10;
export const UBLK_IO_F_META = 1 << 11;
export const UBLK_IO_F_FUA = 1 << 13;
export const UBLK_IO_F_NOUNMAP = 1 << 15;
export const UBLK_IO_F_SWAP = 1 << 16;
export const UBLK_IO_F_NEED_REG_BUF = 1 << 17;
export const UBLK_IO_F_INTEGRITY = 1 << 18;
export const UBLK_IO_F_SHMEM_ZC = 1 << 19;

/** ublk_param_basic.attrs */
export const UBLK_ATTR_READ_ONLY = 1 << 0;
export const UBLK_ATTR_ROTATIONAL = 1 << 1;
export const UBLK_ATTR_VOLATILE_CACHE = 1 << 2;
export const UBLK_ATTR_FUA = 1 << 3;

/** ublk_params.types */
export const UBLK_PARAM_TYPE_BASIC = 1 << 0;
export const UBLK_PARAM_TYPE_DISCARD = 1 << 1;
export const UBLK_PARAM_TYPE_DEVT = 1 << 2;
export const UBLK_PARAM_TYPE_ZONED = 1 << 3;
export const UBLK_PARAM_TYPE_DMA_ALIGN = 1 << 4;
export const UBLK_PARAM_TYPE_SEGMENT = 1 << 5;
export const UBLK_PARAM_TYPE_INTEGRITY = 1 << 6;

export const UBLK_AUTO_BUF_REG_FALLBACK = 1 << 0;
export const UBLK_MIN_SEGMENT_SIZE = 4096;

// ---------------------------------------------------------------------------------------------
// limits and mmap/pread offsets

export const UBLK_MAX_QUEUE_DEPTH = 4096;
export const UBLK_MAX_NR_QUEUES = 4096;
export const UBLK_IO_BUF_BITS = 25;
export const UBLK_TAG_OFF = UBLK_IO_BUF_BITS;
export const UBLK_TAG_BITS = 16;
export const UBLK_QID_OFF = UBLK_TAG_OFF + UBLK_TAG_BITS;
export const UBLK_QID_BITS = 12;
/** Largest per-I/O buffer the driver accepts (32 MiB). */
export const UBLK_MAX_IO_BUF_BYTES = 2 ** UBLK_IO_BUF_BITS;
/** mmap offset of the descriptor arrays on /dev/ublkcN. */
export const UBLKSRV_CMD_BUF_OFFSET = 0;
/** pread/pwrite base offset of request data on /dev/ublkcN (USER_COPY). */
export const UBLKSRV_IO_BUF_OFFSET = 0x80000000;
/** The 512-byte sector unit of start_sector, nr_sectors, dev_sectors and max_sectors. */
export const UBLK_SECTOR_SHIFT = 9;

function roundUp(n: number, to: number): number {
  return Math.ceil(n / to) * to;
}

function checkPageSize(pageSize: number): void {
  if (!Number.isInteger(pageSize) || pageSize < 4096 || (pageSize & (pageSize - 1)) !== 0) {
    throw new UblkInvalidArgument("pageSize", pageSize, "must be a power of two ≥ 4096");
  }
}

/** Per-queue stride of the descriptor mmap: round_up(UBLK_MAX_QUEUE_DEPTH * 24, PAGE_SIZE). */
export function ublkMaxCmdBufSize(pageSize = PAGE_SIZE): number {
  checkPageSize(pageSize);
  return roundUp(UBLK_MAX_QUEUE_DEPTH * UBLKSRV_IO_DESC_SIZE, pageSize);
}

/** mmap offset of queue qId's descriptor array. */
export function ublkQueueDescOffset(qId: number, pageSize = PAGE_SIZE): number {
  checkInt("q_id", qId, 0, UBLK_MAX_NR_QUEUES - 1);
  return UBLKSRV_CMD_BUF_OFFSET + qId * ublkMaxCmdBufSize(pageSize);
}

/** mmap length of one queue's descriptor array; the driver demands exactly this size. */
export function ublkQueueDescLength(queueDepth: number, pageSize = PAGE_SIZE): number {
  checkInt("queue_depth", queueDepth, 1, UBLK_MAX_QUEUE_DEPTH);
  checkPageSize(pageSize);
  return roundUp(queueDepth * UBLKSRV_IO_DESC_SIZE, pageSize);
}

/** USER_COPY file position for (queue, tag, byte offset); a bigint because qid bits reach 2^53. */
export function ublkUserCopyOffset(qId: number, tag: number, byteOffset = 0): bigint {
  checkInt("q_id", qId, 0, UBLK_MAX_NR_QUEUES - 1);
  checkInt("tag", tag, 0, 2 ** UBLK_TAG_BITS - 1);
  checkInt("byte offset", byteOffset, 0, UBLK_MAX_IO_BUF_BYTES - 1);
  return (
    BigInt(UBLKSRV_IO_BUF_OFFSET) + (BigInt(qId) << BigInt(UBLK_QID_OFF)) + (BigInt(tag) << BigInt(UBLK_TAG_OFF)) + BigInt(byteOffset)
  );
}

/** sqe.addr for UBLK_F_AUTO_BUF_REG: index bits 0–15, flags bits 16–23, reserved zero. */
export function ublkAutoBufRegToSqeAddr(index: number, flags = 0): number {
  checkInt("auto_buf_reg.index", index, 0, 0xffff);
  checkInt("auto_buf_reg.flags", flags, 0, 0xff);
  return index | (flags << 16);
}

// ---------------------------------------------------------------------------------------------
// field checks

const U64_MAX_NUMBER = Number.MAX_SAFE_INTEGER;

function checkInt(field: string, v: number, min: number, max: number): void {
  if (typeof v !== "number" || !Number.isInteger(v) || v < min || v > max) {
    throw new UblkInvalidArgument(field, v, `must be an integer in ${min}..${max}`);
  }
}

function checkU64(field: string, v: number | bigint): void {
  if (typeof v === "bigint") {
    if (v < 0n || v > 0xffff_ffff_ffff_ffffn) throw new UblkInvalidArgument(field, v, "must fit in u64");
    return;
  }
  checkInt(field, v, 0, U64_MAX_NUMBER);
}

/** u32 ids where -1 means "all ones" (dev_id 0xFFFFFFFF = allocate / none). */
function u32OrAllOnes(field: string, v: number): number {
  if (v === -1) return 0xffffffff;
  checkInt(field, v, 0, 0xffffffff);
  return v;
}

// ---------------------------------------------------------------------------------------------
// struct ublksrv_ctrl_cmd

export interface UblksrvCtrlCmd {
  /** -1 (0xFFFFFFFF) for "allocate" (ADD_DEV) or "no device" (GET_FEATURES). */
  devId: number;
  /** 0xFFFF (or -1) unless the command concerns one queue; ADD_DEV requires 0xFFFF. */
  queueId?: number;
  /** Length of the buffer at addr (u16). */
  len?: number;
  addr?: number;
  /** data[0]: pid for START_DEV/END_USER_RECOVERY, qid for GET_QUEUE_AFFINITY. */
  data?: number | bigint;
  /** Length (with NUL) of the "/dev/ublkcN" path that precedes the payload at addr. */
  devPathLen?: number;
}

export function encodeUblksrvCtrlCmd(dv: DataView, at: number, c: UblksrvCtrlCmd): void {
  const devId = u32OrAllOnes("ctrl_cmd.dev_id", c.devId);
  const queueId = c.queueId === undefined || c.queueId === -1 ? 0xffff : c.queueId;
  checkInt("ctrl_cmd.queue_id", queueId, 0, 0xffff);
  const len = c.len ?? 0;
  checkInt("ctrl_cmd.len", len, 0, 0xffff);
  const addr = c.addr ?? 0;
  checkU64("ctrl_cmd.addr", addr);
  const data = c.data ?? 0;
  checkU64("ctrl_cmd.data[0]", data);
  const devPathLen = c.devPathLen ?? 0;
  checkInt("ctrl_cmd.dev_path_len", devPathLen, 0, 0xffff);
  if (devPathLen > len) throw new UblkInvalidArgument("ctrl_cmd.dev_path_len", devPathLen, `exceeds len ${len}`);
  dv.setUint32(at + CTRL_CMD_DEV_ID, devId, true);
  dv.setUint16(at + CTRL_CMD_QUEUE_ID, queueId, true);
  dv.setUint16(at + CTRL_CMD_LEN, len, true);
  setU64(dv, at + CTRL_CMD_ADDR, addr);
  setU64(dv, at + CTRL_CMD_DATA, data);
  dv.setUint16(at + CTRL_CMD_DEV_PATH_LEN, devPathLen, true);
  dv.setUint16(at + CTRL_CMD_PAD, 0, true);
  dv.setUint32(at + CTRL_CMD_RESERVED, 0, true);
}

export function decodeUblksrvCtrlCmd(dv: DataView, at: number): Required<UblksrvCtrlCmd> {
  return {
    devId: dv.getUint32(at + CTRL_CMD_DEV_ID, true),
    queueId: dv.getUint16(at + CTRL_CMD_QUEUE_ID, true),
    len: dv.getUint16(at + CTRL_CMD_LEN, true),
    addr: getU64(dv, at + CTRL_CMD_ADDR),
    data: getU64(dv, at + CTRL_CMD_DATA),
    devPathLen: dv.getUint16(at + CTRL_CMD_DEV_PATH_LEN, true),
  };
}

/** Zero a 128-byte SQE and fill it as a control URING_CMD: opcode 46, cmd_op @8, ctrl_cmd @48. */
export function encodeUblkCtrlCmdSqe(
  dv: DataView,
  at: number,
  ctrlFd: number,
  cmdOp: number,
  cmd: UblksrvCtrlCmd,
  userData: number,
): void {
  // Validate before touching the slot so a bad argument leaves no half-written SQE behind.
  const tmp = new DataView(new ArrayBuffer(UBLKSRV_CTRL_CMD_SIZE));
  encodeUblksrvCtrlCmd(tmp, 0, cmd);
  encodeUringCmd(dv, at, IO_URING_SQE128_SIZE, ctrlFd, cmdOp, new Uint8Array(tmp.buffer), userData);
}

// ---------------------------------------------------------------------------------------------
// struct ublksrv_ctrl_dev_info

export interface UblksrvCtrlDevInfo {
  nrHwQueues: number;
  queueDepth: number;
  /** UBLK_S_DEV_* */
  state: number;
  maxIoBufBytes: number;
  /** -1 / 0xFFFFFFFF in ADD_DEV asks the driver to pick. */
  devId: number;
  ublksrvPid: number;
  /** UBLK_F_*: requested on input, negotiated on output. */
  flags: number;
  /** Opaque to the kernel. */
  ublksrvFlags: number;
  ownerUid: number;
  ownerGid: number;
}

export function encodeUblksrvCtrlDevInfo(dv: DataView, at: number, i: Partial<UblksrvCtrlDevInfo> & { devId: number }): void {
  const nrHwQueues = i.nrHwQueues ?? 0;
  checkInt("dev_info.nr_hw_queues", nrHwQueues, 0, UBLK_MAX_NR_QUEUES);
  const queueDepth = i.queueDepth ?? 0;
  checkInt("dev_info.queue_depth", queueDepth, 0, UBLK_MAX_QUEUE_DEPTH);
  const state = i.state ?? 0;
  checkInt("dev_info.state", state, 0, 0xffff);
  const maxIoBufBytes = i.maxIoBufBytes ?? 0;
  checkInt("dev_info.max_io_buf_bytes", maxIoBufBytes, 0, 0xffffffff);
  const devId = u32OrAllOnes("dev_info.dev_id", i.devId);
  const pid = i.ublksrvPid ?? 0;
  checkInt("dev_info.ublksrv_pid", pid, -(2 ** 31), 2 ** 31 - 1);
  const flags = i.flags ?? 0;
  checkU64("dev_info.flags", flags);
  const ublksrvFlags = i.ublksrvFlags ?? 0;
  checkU64("dev_info.ublksrv_flags", ublksrvFlags);
  const uid = i.ownerUid ?? 0;
  checkInt("dev_info.owner_uid", uid, 0, 0xffffffff);
  const gid = i.ownerGid ?? 0;
  checkInt("dev_info.owner_gid", gid, 0, 0xffffffff);
  for (let k = 0; k < UBLKSRV_CTRL_DEV_INFO_SIZE; k += 4) dv.setUint32(at + k, 0, true);
  dv.setUint16(at + DEV_INFO_NR_HW_QUEUES, nrHwQueues, true);
  dv.setUint16(at + DEV_INFO_QUEUE_DEPTH, queueDepth, true);
  dv.setUint16(at + DEV_INFO_STATE, state, true);
  dv.setUint32(at + DEV_INFO_MAX_IO_BUF_BYTES, maxIoBufBytes, true);
  dv.setUint32(at + DEV_INFO_DEV_ID, devId, true);
  dv.setInt32(at + DEV_INFO_UBLKSRV_PID, pid, true);
  setU64(dv, at + DEV_INFO_FLAGS, flags);
  setU64(dv, at + DEV_INFO_UBLKSRV_FLAGS, ublksrvFlags);
  dv.setUint32(at + DEV_INFO_OWNER_UID, uid, true);
  dv.setUint32(at + DEV_INFO_OWNER_GID, gid, true);
}

export function decodeUblksrvCtrlDevInfo(dv: DataView, at: number): UblksrvCtrlDevInfo {
  return {
    nrHwQueues: dv.getUint16(at + DEV_INFO_NR_HW_QUEUES, true),
    queueDepth: dv.getUint16(at + DEV_INFO_QUEUE_DEPTH, true),
    state: dv.getUint16(at + DEV_INFO_STATE, true),
    maxIoBufBytes: dv.getUint32(at + DEV_INFO_MAX_IO_BUF_BYTES, true),
    devId: dv.getUint32(at + DEV_INFO_DEV_ID, true),
    ublksrvPid: dv.getInt32(at + DEV_INFO_UBLKSRV_PID, true),
    flags: getU64(dv, at + DEV_INFO_FLAGS),
    ublksrvFlags: getU64(dv, at + DEV_INFO_UBLKSRV_FLAGS),
    ownerUid: dv.getUint32(at + DEV_INFO_OWNER_UID, true),
    ownerGid: dv.getUint32(at + DEV_INFO_OWNER_GID, true),
  };
}

// ---------------------------------------------------------------------------------------------
// struct ublk_params

export interface UblkParamBasic {
  /** UBLK_ATTR_* */
  attrs: number;
  /** 9..12 (PAGE_SHIFT). */
  logicalBsShift: number;
  /** ≥ logicalBsShift. */
  physicalBsShift: number;
  ioOptShift: number;
  ioMinShift: number;
  /** In 512-byte sectors; the driver wants ≤ max_io_buf_bytes >> 9. */
  maxSectors: number;
  chunkSectors: number;
  /** Capacity in 512-byte sectors, whatever the logical block size. */
  devSectors: number;
  virtBoundaryMask: number;
}

export interface UblkParamDiscard {
  discardAlignment: number;
  /** Must not be 0. */
  discardGranularity: number;
  maxDiscardSectors: number;
  maxWriteZeroesSectors: number;
  /** Must be 1 when maxDiscardSectors ≠ 0. */
  maxDiscardSegments: number;
}

/** Read-only: filled by GET_PARAMS (disk numbers only after START_DEV); SET_PARAMS rejects it. */
export interface UblkParamDevt {
  charMajor: number;
  charMinor: number;
  diskMajor: number;
  diskMinor: number;
}

export interface UblkParamZoned {
  maxOpenZones: number;
  maxActiveZones: number;
  maxZoneAppendSectors: number;
}

export interface UblkParamDmaAlign {
  alignment: number;
}

export interface UblkParamSegment {
  segBoundaryMask: number;
  maxSegmentSize: number;
  maxSegments: number;
}

export interface UblkParamIntegrity {
  flags: number;
  maxIntegritySegments: number;
  intervalExp: number;
  metadataSize: number;
  piOffset: number;
  csumType: number;
  tagSize: number;
}

export interface UblkParams {
  /** sizeof what is passed; defaults to UBLK_PARAMS_SIZE (older drivers read their own prefix). */
  len?: number;
  /** UBLK_PARAM_TYPE_*; defaults to the bits of the sub-structs present. */
  types?: number;
  basic?: UblkParamBasic;
  discard?: UblkParamDiscard;
  devt?: UblkParamDevt;
  zoned?: UblkParamZoned;
  dma?: UblkParamDmaAlign;
  seg?: UblkParamSegment;
  integrity?: UblkParamIntegrity;
}

function typesOf(p: UblkParams): number {
  let t = 0;
  if (p.basic) t |= UBLK_PARAM_TYPE_BASIC;
  if (p.discard) t |= UBLK_PARAM_TYPE_DISCARD;
  if (p.devt) t |= UBLK_PARAM_TYPE_DEVT;
  if (p.zoned) t |= UBLK_PARAM_TYPE_ZONED;
  if (p.dma) t |= UBLK_PARAM_TYPE_DMA_ALIGN;
  if (p.seg) t |= UBLK_PARAM_TYPE_SEGMENT;
  if (p.integrity) t |= UBLK_PARAM_TYPE_INTEGRITY;
  return t;
}

const PARAM_TYPE_STRUCTS: [number, keyof UblkParams][] = [
  [UBLK_PARAM_TYPE_BASIC, "basic"],
  [UBLK_PARAM_TYPE_DISCARD, "discard"],
  [UBLK_PARAM_TYPE_DEVT, "devt"],
  [UBLK_PARAM_TYPE_ZONED, "zoned"],
  [UBLK_PARAM_TYPE_DMA_ALIGN, "dma"],
  [UBLK_PARAM_TYPE_SEGMENT, "seg"],
  [UBLK_PARAM_TYPE_INTEGRITY, "integrity"],
];

/** Zero UBLK_PARAMS_SIZE bytes and fill struct ublk_params; checks the rules SET_PARAMS enforces on the struct alone. */
export function encodeUblkParams(dv: DataView, at: number, p: UblkParams): void {
  const len = p.len ?? UBLK_PARAMS_SIZE;
  checkInt("params.len", len, 9, UBLK_PARAMS_SIZE);
  const types = p.types ?? typesOf(p);
  checkInt("params.types", types, 0, 0x7f);
  for (const [bit, key] of PARAM_TYPE_STRUCTS) {
    if (types & bit && !p[key]) throw new UblkInvalidArgument("params.types", types, `has the ${key} bit but no ${key} struct`);
  }
  const b = p.basic;
  if (b) {
    checkInt("basic.attrs", b.attrs, 0, 0xffffffff);
    checkInt("basic.logical_bs_shift", b.logicalBsShift, 9, 12);
    checkInt("basic.physical_bs_shift", b.physicalBsShift, b.logicalBsShift, 31);
    checkInt("basic.io_opt_shift", b.ioOptShift, 0, 31);
    checkInt("basic.io_min_shift", b.ioMinShift, 0, 31);
    checkInt("basic.max_sectors", b.maxSectors, 0, 0xffffffff);
    checkInt("basic.chunk_sectors", b.chunkSectors, 0, 0xffffffff);
    checkU64("basic.dev_sectors", b.devSectors);
    checkU64("basic.virt_boundary_mask", b.virtBoundaryMask);
  }
  const d = p.discard;
  if (d) {
    checkInt("discard.discard_alignment", d.discardAlignment, 0, 0xffffffff);
    checkInt("discard.discard_granularity", d.discardGranularity, 1, 0xffffffff);
    checkInt("discard.max_discard_sectors", d.maxDiscardSectors, 0, 0xffffffff);
    checkInt("discard.max_write_zeroes_sectors", d.maxWriteZeroesSectors, 0, 0xffffffff);
    checkInt("discard.max_discard_segments", d.maxDiscardSegments, 0, 0xffff);
    if (d.maxDiscardSectors !== 0 && d.maxDiscardSegments !== 1) {
      throw new UblkInvalidArgument("discard.max_discard_segments", d.maxDiscardSegments, "must be 1 when max_discard_sectors ≠ 0");
    }
  }
  const s = p.seg;
  if (s) {
    checkU64("seg.seg_boundary_mask", s.segBoundaryMask);
    checkInt("seg.max_segment_size", s.maxSegmentSize, UBLK_MIN_SEGMENT_SIZE, 0xffffffff);
    checkInt("seg.max_segments", s.maxSegments, 1, 0xffff);
    const span = s.segBoundaryMask + 1;
    if (span < UBLK_MIN_SEGMENT_SIZE || 2 ** Math.round(Math.log2(span)) !== span) {
      throw new UblkInvalidArgument("seg.seg_boundary_mask", s.segBoundaryMask, "mask + 1 must be a power of two ≥ 4096");
    }
  }
  for (let k = 0; k < UBLK_PARAMS_SIZE; k += 4) dv.setUint32(at + k, 0, true);
  dv.setUint32(at + PARAMS_LEN, len, true);
  dv.setUint32(at + PARAMS_TYPES, types, true);
  if (b) {
    const o = at + PARAMS_BASIC;
    dv.setUint32(o + 0, b.attrs, true);
    dv.setUint8(o + 4, b.logicalBsShift);
    dv.setUint8(o + 5, b.physicalBsShift);
    dv.setUint8(o + 6, b.ioOptShift);
    dv.setUint8(o + 7, b.ioMinShift);
    dv.setUint32(o + 8, b.maxSectors, true);
    dv.setUint32(o + 12, b.chunkSectors, true);
    setU64(dv, o + 16, b.devSectors);
    setU64(dv, o + 24, b.virtBoundaryMask);
  }
  if (d) {
    const o = at + PARAMS_DISCARD;
    dv.setUint32(o + 0, d.discardAlignment, true);
    dv.setUint32(o + 4, d.discardGranularity, true);
    dv.setUint32(o + 8, d.maxDiscardSectors, true);
    dv.setUint32(o + 12, d.maxWriteZeroesSectors, true);
    dv.setUint16(o + 16, d.maxDiscardSegments, true);
  }
  const t = p.devt;
  if (t) {
    const o = at + PARAMS_DEVT;
    dv.setUint32(o + 0, t.charMajor >>> 0, true);
    dv.setUint32(o + 4, t.charMinor >>> 0, true);
    dv.setUint32(o + 8, t.diskMajor >>> 0, true);
    dv.setUint32(o + 12, t.diskMinor >>> 0, true);
  }
  const z = p.zoned;
  if (z) {
    const o = at + PARAMS_ZONED;
    dv.setUint32(o + 0, z.maxOpenZones >>> 0, true);
    dv.setUint32(o + 4, z.maxActiveZones >>> 0, true);
    dv.setUint32(o + 8, z.maxZoneAppendSectors >>> 0, true);
  }
  if (p.dma) dv.setUint32(at + PARAMS_DMA, p.dma.alignment >>> 0, true);
  if (s) {
    const o = at + PARAMS_SEG;
    setU64(dv, o + 0, s.segBoundaryMask);
    dv.setUint32(o + 8, s.maxSegmentSize, true);
    dv.setUint16(o + 12, s.maxSegments, true);
  }
  const g = p.integrity;
  if (g) {
    const o = at + PARAMS_INTEGRITY;
    dv.setUint32(o + 0, g.flags >>> 0, true);
    dv.setUint16(o + 4, g.maxIntegritySegments & 0xffff, true);
    dv.setUint8(o + 6, g.intervalExp & 0xff);
    dv.setUint8(o + 7, g.metadataSize & 0xff);
    dv.setUint8(o + 8, g.piOffset & 0xff);
    dv.setUint8(o + 9, g.csumType & 0xff);
    dv.setUint8(o + 10, g.tagSize & 0xff);
  }
}

/** Decode struct ublk_params; sub-structs appear only when their type bit is set. */
export function decodeUblkParams(dv: DataView, at: number): UblkParams & { len: number; types: number } {
  const len = dv.getUint32(at + PARAMS_LEN, true);
  const types = dv.getUint32(at + PARAMS_TYPES, true);
  const out: UblkParams & { len: number; types: number } = { len, types };
  if (types & UBLK_PARAM_TYPE_BASIC) {
    const o = at + PARAMS_BASIC;
    out.basic = {
      attrs: dv.getUint32(o + 0, true),
      logicalBsShift: dv.getUint8(o + 4),
      physicalBsShift: dv.getUint8(o + 5),
      ioOptShift: dv.getUint8(o + 6),
      ioMinShift: dv.getUint8(o + 7),
      maxSectors: dv.getUint32(o + 8, true),
      chunkSectors: dv.getUint32(o + 12, true),
      devSectors: getU64(dv, o + 16),
      virtBoundaryMask: getU64(dv, o + 24),
    };
  }
  if (types & UBLK_PARAM_TYPE_DISCARD) {
    const o = at + PARAMS_DISCARD;
    out.discard = {
      discardAlignment: dv.getUint32(o + 0, true),
      discardGranularity: dv.getUint32(o + 4, true),
      maxDiscardSectors: dv.getUint32(o + 8, true),
      maxWriteZeroesSectors: dv.getUint32(o + 12, true),
      maxDiscardSegments: dv.getUint16(o + 16, true),
    };
  }
  if (types & UBLK_PARAM_TYPE_DEVT) {
    const o = at + PARAMS_DEVT;
    out.devt = {
      charMajor: dv.getUint32(o + 0, true),
      charMinor: dv.getUint32(o + 4, true),
      diskMajor: dv.getUint32(o + 8, true),
      diskMinor: dv.getUint32(o + 12, true),
    };
  }
  if (types & UBLK_PARAM_TYPE_ZONED) {
    const o = at + PARAMS_ZONED;
    out.zoned = {
      maxOpenZones: dv.getUint32(o + 0, true),
      maxActiveZones: dv.getUint32(o + 4, true),
      maxZoneAppendSectors: dv.getUint32(o + 8, true),
    };
  }
  if (types & UBLK_PARAM_TYPE_DMA_ALIGN) out.dma = { alignment: dv.getUint32(at + PARAMS_DMA, true) };
  if (types & UBLK_PARAM_TYPE_SEGMENT) {
    const o = at + PARAMS_SEG;
    out.seg = {
      segBoundaryMask: getU64(dv, o + 0),
      maxSegmentSize: dv.getUint32(o + 8, true),
      maxSegments: dv.getUint16(o + 12, true),
    };
  }
  if (types & UBLK_PARAM_TYPE_INTEGRITY) {
    const o = at + PARAMS_INTEGRITY;
    out.integrity = {
      flags: dv.getUint32(o + 0, true),
      maxIntegritySegments: dv.getUint16(o + 4, true),
      intervalExp: dv.getUint8(o + 6),
      metadataSize: dv.getUint8(o + 7),
      piOffset: dv.getUint8(o + 8),
      csumType: dv.getUint8(o + 9),
      tagSize: dv.getUint8(o + 10),
    };
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// struct ublksrv_io_cmd

export interface UblksrvIoCmd {
  qId: number;
  tag: number;
  /** COMMIT only: bytes done or -errno. */
  result: number;
  /** Copy mode: the tag's buffer address; 0 with USER_COPY / ZERO_COPY / AUTO_BUF_REG. */
  addr: number;
}

/** Write struct ublksrv_io_cmd (16 bytes); scalar arguments so the hot loop allocates nothing. */
export function encodeUblksrvIoCmd(dv: DataView, at: number, qId: number, tag: number, result: number, addr: number): void {
  if (!(qId >= 0 && qId < UBLK_MAX_NR_QUEUES && qId === (qId | 0))) checkInt("io_cmd.q_id", qId, 0, UBLK_MAX_NR_QUEUES - 1);
  if (!(tag >= 0 && tag < UBLK_MAX_QUEUE_DEPTH && tag === (tag | 0))) checkInt("io_cmd.tag", tag, 0, UBLK_MAX_QUEUE_DEPTH - 1);
  if (result !== (result | 0)) checkInt("io_cmd.result", result, -(2 ** 31), 2 ** 31 - 1);
  if (!(addr >= 0 && addr <= U64_MAX_NUMBER && Number.isInteger(addr))) checkU64("io_cmd.addr", addr);
  dv.setUint16(at + IO_CMD_Q_ID, qId, true);
  dv.setUint16(at + IO_CMD_TAG, tag, true);
  dv.setInt32(at + IO_CMD_RESULT, result, true);
  setU64(dv, at + IO_CMD_ADDR, addr);
}

export function decodeUblksrvIoCmd(dv: DataView, at: number): UblksrvIoCmd {
  return {
    qId: dv.getUint16(at + IO_CMD_Q_ID, true),
    tag: dv.getUint16(at + IO_CMD_TAG, true),
    result: dv.getInt32(at + IO_CMD_RESULT, true),
    addr: getU64(dv, at + IO_CMD_ADDR),
  };
}

/** Zero a 64-byte SQE and fill it as an I/O URING_CMD (FETCH / COMMIT_AND_FETCH / NEED_GET_DATA). */
export function encodeUblkIoCmdSqe(
  dv: DataView,
  at: number,
  charFd: number,
  cmdOp: number,
  qId: number,
  tag: number,
  result: number,
  addr: number,
  userData: number,
  sqeFlags = 0,
): void {
  encodeUringCmd(dv, at, IO_URING_SQE_SIZE, charFd, cmdOp, null, userData, sqeFlags);
  encodeUblksrvIoCmd(dv, at + SQE_CMD, qId, tag, result, addr);
}

// ---------------------------------------------------------------------------------------------
// struct ublksrv_io_desc

export interface UblksrvIoDesc {
  opFlags: number;
  /** UBLK_IO_OP_* (op_flags bits 0–7). */
  op: number;
  /** UBLK_IO_F_* bits, in op_flags positions (op bits cleared). */
  flags: number;
  /** 512-byte sectors (nr_zones for REPORT_ZONES). */
  nrSectors: number;
  /** 512-byte sectors. */
  startSector: number;
  addr: number;
}

/** ublksrv_get_op(): the op of an op_flags word. */
export function ublksrvGetOp(opFlags: number): number {
  return opFlags & 0xff;
}

/** The UBLK_IO_F_* bits of an op_flags word, left in place so `& UBLK_IO_F_FUA` works. */
export function ublksrvGetFlags(opFlags: number): number {
  return (opFlags & ~0xff) >>> 0;
}

/** Decode desc[tag] of a queue's descriptor array. */
export function decodeUblksrvIoDesc(dv: DataView, tag: number): UblksrvIoDesc {
  const at = tag * UBLKSRV_IO_DESC_SIZE;
  const opFlags = dv.getUint32(at + IO_DESC_OP_FLAGS, true);
  return {
    opFlags,
    op: ublksrvGetOp(opFlags),
    flags: ublksrvGetFlags(opFlags),
    nrSectors: dv.getUint32(at + IO_DESC_NR_SECTORS, true),
    startSector: getU64(dv, at + IO_DESC_START_SECTOR),
    addr: getU64(dv, at + IO_DESC_ADDR),
  };
}

/** Encode desc[tag] (the kernel's side; for tests and fakes). */
export function encodeUblksrvIoDesc(
  dv: DataView,
  tag: number,
  d: { op: number; flags?: number; nrSectors: number; startSector: number; addr?: number },
): void {
  checkInt("io_desc.op", d.op, 0, 0xff);
  const at = tag * UBLKSRV_IO_DESC_SIZE;
  dv.setUint32(at + IO_DESC_OP_FLAGS, (d.op | ((d.flags ?? 0) & ~0xff)) >>> 0, true);
  dv.setUint32(at + IO_DESC_NR_SECTORS, d.nrSectors >>> 0, true);
  setU64(dv, at + IO_DESC_START_SECTOR, d.startSector);
  setU64(dv, at + IO_DESC_ADDR, d.addr ?? 0);
}
