import { afterAll, describe, expect, test } from "bun:test";
import { existsSync } from "node:fs";
import { ptr, toArrayBuffer, type Pointer } from "bun:ffi";
import { IORING_OP_READ, IORING_OP_URING_CMD, decodeSqe, type CqeCallback } from "../../ffi/io_uring.ts";
import {
  E,
  O_CLOEXEC,
  O_DIRECT,
  O_RDWR,
  SYS_eventfd2,
  SyscallError,
  allocAligned,
  close,
  fsync,
  open,
  pread,
  pwrite,
  syscall,
  write,
} from "../../ffi/libc.ts";
import {
  ENOTSUPP,
  UBLKSRV_CTRL_CMD_SIZE,
  UBLKSRV_CTRL_DEV_INFO_SIZE,
  UBLKSRV_IO_BUF_OFFSET,
  UBLKSRV_IO_CMD_SIZE,
  UBLKSRV_IO_DESC_SIZE,
  UBLK_ATTR_FUA,
  UBLK_ATTR_READ_ONLY,
  UBLK_ATTR_ROTATIONAL,
  UBLK_ATTR_VOLATILE_CACHE,
  UBLK_CMD_ADD_DEV,
  UBLK_F_CMD_IOCTL_ENCODE,
  UBLK_F_NEED_GET_DATA,
  UBLK_F_USER_COPY,
  UBLK_F_USER_RECOVERY,
  UBLK_F_USER_RECOVERY_FAIL_IO,
  UBLK_F_USER_RECOVERY_REISSUE,
  UBLK_FEATURES_BASELINE,
  UBLK_IO_COMMIT_AND_FETCH_REQ,
  UBLK_IO_FETCH_REQ,
  UBLK_IO_F_FUA,
  UBLK_IO_F_NOUNMAP,
  UBLK_IO_OP_DISCARD,
  UBLK_IO_OP_FLUSH,
  UBLK_IO_OP_READ,
  UBLK_IO_OP_WRITE,
  UBLK_IO_OP_WRITE_SAME,
  UBLK_IO_OP_WRITE_ZEROES,
  UBLK_IO_RES_ABORT,
  UBLK_IO_RES_NEED_GET_DATA,
  UBLK_PARAMS_SIZE,
  UBLK_PARAM_TYPE_BASIC,
  UBLK_PARAM_TYPE_DEVT,
  UBLK_PARAM_TYPE_DISCARD,
  UBLK_PARAM_TYPE_SEGMENT,
  UBLK_S_DEV_LIVE,
  UBLK_U_CMD_ADD_DEV,
  UBLK_U_CMD_DEL_DEV,
  UBLK_U_CMD_DEL_DEV_ASYNC,
  UBLK_U_CMD_END_USER_RECOVERY,
  UBLK_U_CMD_GET_DEV_INFO,
  UBLK_U_CMD_GET_DEV_INFO2,
  UBLK_U_CMD_GET_FEATURES,
  UBLK_U_CMD_GET_PARAMS,
  UBLK_U_CMD_GET_QUEUE_AFFINITY,
  UBLK_U_CMD_QUIESCE_DEV,
  UBLK_U_CMD_REG_BUF,
  UBLK_U_CMD_SET_PARAMS,
  UBLK_U_CMD_START_DEV,
  UBLK_U_CMD_START_USER_RECOVERY,
  UBLK_U_CMD_STOP_DEV,
  UBLK_U_CMD_TRY_STOP_DEV,
  UBLK_U_CMD_UNREG_BUF,
  UBLK_U_CMD_UPDATE_SIZE,
  UBLK_U_IO_COMMIT_AND_FETCH_REQ,
  UBLK_U_IO_COMMIT_IO_CMDS,
  UBLK_U_IO_FETCH_IO_CMDS,
  UBLK_U_IO_FETCH_REQ,
  UBLK_U_IO_NEED_GET_DATA,
  UBLK_U_IO_PREP_IO_CMDS,
  UBLK_U_IO_REGISTER_IO_BUF,
  UBLK_U_IO_UNREGISTER_IO_BUF,
  UblkError,
  UblkInvalidArgument,
  _IOC,
  _IOC_DIR,
  _IOC_NR,
  _IOC_SIZE,
  _IOC_TYPE,
  _IOR,
  _IOWR,
  decodeUblkParams,
  decodeUblksrvCtrlCmd,
  decodeUblksrvCtrlDevInfo,
  decodeUblksrvIoCmd,
  decodeUblksrvIoDesc,
  encodeUblkCtrlCmdSqe,
  encodeUblkIoCmdSqe,
  encodeUblkParams,
  encodeUblksrvCtrlCmd,
  encodeUblksrvCtrlDevInfo,
  encodeUblksrvIoDesc,
  ublkAutoBufRegToSqeAddr,
  ublkCmdName,
  ublkLegacyOp,
  ublkMaxCmdBufSize,
  ublkQueueDescLength,
  ublkQueueDescOffset,
  ublkUserCopyOffset,
  ublksrvGetFlags,
  ublksrvGetOp,
} from "../../ffi/ublk.ts";
import type { DeviceIo, WakeSource } from "../../src/blockdev/device_io.ts";
import { until } from "./harness.ts";
import { UblkControl, ublkBlockPath, ublkCharPath, type UblkControlTrace } from "../../src/blockdev/ublk/control.ts";
import { UblkDevice, openUblkNode, ublkParamsFor, ublkRecoveryFlags } from "../../src/blockdev/ublk/frontend.ts";
import { UBLK_QUEUE_RING_FLAGS, UblkQueue, UringQueueRing, ublkResultForError, type UblkQueueRing } from "../../src/blockdev/ublk/queue.ts";

const bytesOf = (dv: DataView) => new Uint8Array(dv.buffer, dv.byteOffset, dv.byteLength);

// ---------------------------------------------------------------------------------------------
// ioctl numbers

describe("ioctl-encoded opcodes", () => {
  // _IOR/_IOWR('u', nr, struct) of include/uapi/linux/ublk_cmd.h, computed from the C header.
  const table: [string, number, number, "R" | "WR", number, number][] = [
    ["GET_QUEUE_AFFINITY", UBLK_U_CMD_GET_QUEUE_AFFINITY, 0x80207501, "R", 0x01, 32],
    ["GET_DEV_INFO", UBLK_U_CMD_GET_DEV_INFO, 0x80207502, "R", 0x02, 32],
    ["ADD_DEV", UBLK_U_CMD_ADD_DEV, 0xc0207504, "WR", 0x04, 32],
    ["DEL_DEV", UBLK_U_CMD_DEL_DEV, 0xc0207505, "WR", 0x05, 32],
    ["START_DEV", UBLK_U_CMD_START_DEV, 0xc0207506, "WR", 0x06, 32],
    ["STOP_DEV", UBLK_U_CMD_STOP_DEV, 0xc0207507, "WR", 0x07, 32],
    ["SET_PARAMS", UBLK_U_CMD_SET_PARAMS, 0xc0207508, "WR", 0x08, 32],
    ["GET_PARAMS", UBLK_U_CMD_GET_PARAMS, 0x80207509, "R", 0x09, 32],
    ["START_USER_RECOVERY", UBLK_U_CMD_START_USER_RECOVERY, 0xc0207510, "WR", 0x10, 32],
    ["END_USER_RECOVERY", UBLK_U_CMD_END_USER_RECOVERY, 0xc0207511, "WR", 0x11, 32],
    ["GET_DEV_INFO2", UBLK_U_CMD_GET_DEV_INFO2, 0x80207512, "R", 0x12, 32],
    ["GET_FEATURES", UBLK_U_CMD_GET_FEATURES, 0x80207513, "R", 0x13, 32],
    ["DEL_DEV_ASYNC", UBLK_U_CMD_DEL_DEV_ASYNC, 0x80207514, "R", 0x14, 32],
    ["UPDATE_SIZE", UBLK_U_CMD_UPDATE_SIZE, 0xc0207515, "WR", 0x15, 32],
    ["QUIESCE_DEV", UBLK_U_CMD_QUIESCE_DEV, 0xc0207516, "WR", 0x16, 32],
    ["TRY_STOP_DEV", UBLK_U_CMD_TRY_STOP_DEV, 0xc0207517, "WR", 0x17, 32],
    ["REG_BUF", UBLK_U_CMD_REG_BUF, 0xc0207518, "WR", 0x18, 32],
    ["UNREG_BUF", UBLK_U_CMD_UNREG_BUF, 0xc0207519, "WR", 0x19, 32],
    ["FETCH_REQ", UBLK_U_IO_FETCH_REQ, 0xc0107520, "WR", 0x20, 16],
    ["COMMIT_AND_FETCH_REQ", UBLK_U_IO_COMMIT_AND_FETCH_REQ, 0xc0107521, "WR", 0x21, 16],
    ["NEED_GET_DATA", UBLK_U_IO_NEED_GET_DATA, 0xc0107522, "WR", 0x22, 16],
    ["REGISTER_IO_BUF", UBLK_U_IO_REGISTER_IO_BUF, 0xc0107523, "WR", 0x23, 16],
    ["UNREGISTER_IO_BUF", UBLK_U_IO_UNREGISTER_IO_BUF, 0xc0107524, "WR", 0x24, 16],
    ["PREP_IO_CMDS", UBLK_U_IO_PREP_IO_CMDS, 0xc0107525, "WR", 0x25, 16],
    ["COMMIT_IO_CMDS", UBLK_U_IO_COMMIT_IO_CMDS, 0xc0107526, "WR", 0x26, 16],
    ["FETCH_IO_CMDS", UBLK_U_IO_FETCH_IO_CMDS, 0xc0107527, "WR", 0x27, 16],
  ];

  test.each(table)("UBLK_U_*_%s matches the reference and its parts", (name, value, ref, dir, nr, size) => {
    expect(value).toBe(ref);
    // Recompute by hand: dir in bits 30-31, size in 16-29, type 'u' in 8-15, nr in 0-7.
    const d = dir === "R" ? 2 : 3;
    expect(d * 2 ** 30 + size * 2 ** 16 + 0x75 * 2 ** 8 + nr).toBe(value);
    expect(_IOC_DIR(value)).toBe(d);
    expect(_IOC_TYPE(value)).toBe("u".charCodeAt(0));
    expect(_IOC_NR(value)).toBe(nr);
    expect(_IOC_SIZE(value)).toBe(size);
    expect(ublkCmdName(value)).toBe(name);
    expect(value).toBeGreaterThan(2 ** 31); // bit 31 set: must travel as an unsigned u32
  });

  test("struct sizes used in the encodings", () => {
    expect(UBLKSRV_CTRL_CMD_SIZE).toBe(0x20);
    expect(UBLKSRV_IO_CMD_SIZE).toBe(0x10);
  });

  test("helpers: _IOR/_IOWR/_IOC agree, reject out-of-range parts", () => {
    expect(_IOR("u", 2, 32)).toBe(_IOC(2, 0x75, 2, 32));
    expect(_IOWR(0x75, 4, 32)).toBe(0xc0207504);
    expect(() => _IOC(4, "u", 1, 1)).toThrow(UblkInvalidArgument);
    expect(() => _IOR("uu", 1, 1)).toThrow(UblkInvalidArgument);
    expect(() => _IOR("u", 256, 1)).toThrow(UblkInvalidArgument);
    expect(() => _IOR("u", 1, 1 << 14)).toThrow(UblkInvalidArgument);
  });

  test("legacy numbers: control 0x01..0x12 and io 0x20..0x22 have one, later ops do not", () => {
    expect(ublkLegacyOp(UBLK_U_CMD_ADD_DEV)).toBe(UBLK_CMD_ADD_DEV);
    expect(ublkLegacyOp(UBLK_U_CMD_GET_DEV_INFO2)).toBe(0x12);
    expect(ublkLegacyOp(UBLK_U_CMD_GET_FEATURES)).toBe(-1);
    expect(ublkLegacyOp(UBLK_U_IO_FETCH_REQ)).toBe(UBLK_IO_FETCH_REQ);
    expect(ublkLegacyOp(UBLK_U_IO_COMMIT_AND_FETCH_REQ)).toBe(UBLK_IO_COMMIT_AND_FETCH_REQ);
    expect(ublkLegacyOp(UBLK_U_IO_REGISTER_IO_BUF)).toBe(-1);
    expect(ublkCmdName(UBLK_CMD_ADD_DEV)).toBe("ADD_DEV");
    expect(ublkCmdName(0x12345)).toBe("CMD_0x12345");
  });
});

// ---------------------------------------------------------------------------------------------
// struct layouts

describe("struct ublksrv_ctrl_cmd and the control SQE", () => {
  test("fields at their offsets; -1 ids are all ones", () => {
    const dv = new DataView(new ArrayBuffer(32));
    bytesOf(dv).fill(0xee);
    encodeUblksrvCtrlCmd(dv, 0, { devId: -1, len: 64, addr: 0x7f12_3456_7000, data: 4242, devPathLen: 12 });
    expect(dv.getUint32(0, true)).toBe(0xffffffff); // dev_id @0
    expect(dv.getUint16(4, true)).toBe(0xffff); // queue_id @4 defaults to 0xFFFF
    expect(dv.getUint16(6, true)).toBe(64); // len @6
    expect(dv.getBigUint64(8, true)).toBe(0x7f12_3456_7000n); // addr @8
    expect(dv.getBigUint64(16, true)).toBe(4242n); // data[0] @16
    expect(dv.getUint16(24, true)).toBe(12); // dev_path_len @24
    expect(dv.getUint16(26, true)).toBe(0); // pad @26
    expect(dv.getUint32(28, true)).toBe(0); // reserved @28
    expect(decodeUblksrvCtrlCmd(dv, 0)).toEqual({ devId: 0xffffffff, queueId: 0xffff, len: 64, addr: 0x7f12_3456_7000, data: 4242, devPathLen: 12 });
  });

  test("bad fields are named errors", () => {
    const dv = new DataView(new ArrayBuffer(32));
    expect(() => encodeUblksrvCtrlCmd(dv, 0, { devId: -2 })).toThrow(UblkInvalidArgument);
    expect(() => encodeUblksrvCtrlCmd(dv, 0, { devId: 1, len: 0x10000 })).toThrow(/ctrl_cmd.len/);
    expect(() => encodeUblksrvCtrlCmd(dv, 0, { devId: 1, queueId: 0x10000 })).toThrow(/queue_id/);
    expect(() => encodeUblksrvCtrlCmd(dv, 0, { devId: 1, len: 4, devPathLen: 12 })).toThrow(/dev_path_len/);
    expect(() => encodeUblksrvCtrlCmd(dv, 0, { devId: 1, addr: -5 })).toThrow(UblkInvalidArgument);
  });

  test("128-byte SQE: URING_CMD, cmd_op @8, ctrl_cmd @48, bytes 80..127 zero", () => {
    const dv = new DataView(new ArrayBuffer(256));
    bytesOf(dv).fill(0xff); // stale bytes must be cleared
    encodeUblkCtrlCmdSqe(dv, 128, 9, UBLK_U_CMD_START_DEV, { devId: 3, data: 1234 }, 77);
    const s = new Uint8Array(dv.buffer, 128, 128);
    expect(s[0]).toBe(IORING_OP_URING_CMD);
    expect(s[1]).toBe(0); // no IOSQE flags
    expect(dv.getInt32(128 + 4, true)).toBe(9);
    expect(dv.getUint32(128 + 8, true)).toBe(0xc0207506);
    expect(dv.getUint32(128 + 12, true)).toBe(0); // __pad1
    expect(dv.getBigUint64(128 + 16, true)).toBe(0n); // sqe.addr unused by control cmds
    expect(dv.getUint32(128 + 24, true)).toBe(0);
    expect(dv.getBigUint64(128 + 32, true)).toBe(77n);
    expect(decodeUblksrvCtrlCmd(dv, 128 + 48)).toMatchObject({ devId: 3, queueId: 0xffff, data: 1234, len: 0, addr: 0 });
    for (let i = 80; i < 128; i++) expect(s[i]).toBe(0);
    expect(new Uint8Array(dv.buffer, 0, 128).every((b) => b === 0xff)).toBe(true); // neighbour untouched
  });
});

describe("struct ublksrv_ctrl_dev_info (64 bytes)", () => {
  test("offsets and round trip", () => {
    const dv = new DataView(new ArrayBuffer(UBLKSRV_CTRL_DEV_INFO_SIZE));
    bytesOf(dv).fill(0xaa);
    encodeUblksrvCtrlDevInfo(dv, 0, {
      nrHwQueues: 4,
      queueDepth: 128,
      state: UBLK_S_DEV_LIVE,
      maxIoBufBytes: 524288,
      devId: -1,
      ublksrvPid: 4321,
      flags: UBLK_F_CMD_IOCTL_ENCODE | UBLK_F_USER_RECOVERY,
      ublksrvFlags: 2 ** 40 + 7,
      ownerUid: 1000,
      ownerGid: 100,
    });
    expect(dv.getUint16(0, true)).toBe(4);
    expect(dv.getUint16(2, true)).toBe(128);
    expect(dv.getUint16(4, true)).toBe(1);
    expect(dv.getUint16(6, true)).toBe(0); // pad0
    expect(dv.getUint32(8, true)).toBe(524288);
    expect(dv.getUint32(12, true)).toBe(0xffffffff);
    expect(dv.getInt32(16, true)).toBe(4321);
    expect(dv.getUint32(20, true)).toBe(0); // pad1
    expect(dv.getBigUint64(24, true)).toBe(BigInt(UBLK_F_CMD_IOCTL_ENCODE | UBLK_F_USER_RECOVERY));
    expect(dv.getBigUint64(32, true)).toBe(2n ** 40n + 7n);
    expect(dv.getUint32(40, true)).toBe(1000);
    expect(dv.getUint32(44, true)).toBe(100);
    expect(dv.getBigUint64(48, true)).toBe(0n);
    expect(dv.getBigUint64(56, true)).toBe(0n);
    expect(decodeUblksrvCtrlDevInfo(dv, 0)).toEqual({
      nrHwQueues: 4,
      queueDepth: 128,
      state: 1,
      maxIoBufBytes: 524288,
      devId: 0xffffffff,
      ublksrvPid: 4321,
      flags: UBLK_F_CMD_IOCTL_ENCODE | UBLK_F_USER_RECOVERY,
      ublksrvFlags: 2 ** 40 + 7,
      ownerUid: 1000,
      ownerGid: 100,
    });
  });

  test("limits", () => {
    const dv = new DataView(new ArrayBuffer(64));
    expect(() => encodeUblksrvCtrlDevInfo(dv, 0, { devId: 0, queueDepth: 4097 })).toThrow(/queue_depth/);
    expect(() => encodeUblksrvCtrlDevInfo(dv, 0, { devId: 0, nrHwQueues: 5000 })).toThrow(/nr_hw_queues/);
  });
});

describe("struct ublk_params (152 bytes, len + types)", () => {
  const basic = {
    attrs: UBLK_ATTR_VOLATILE_CACHE | UBLK_ATTR_FUA,
    logicalBsShift: 9,
    physicalBsShift: 12,
    ioOptShift: 12,
    ioMinShift: 9,
    maxSectors: 1024,
    chunkSectors: 0,
    devSectors: 2 ** 33 + 8,
    virtBoundaryMask: 0xfff,
  };
  const discard = { discardAlignment: 0, discardGranularity: 4096, maxDiscardSectors: 1 << 21, maxWriteZeroesSectors: 1 << 20, maxDiscardSegments: 1 };

  test("basic + discard at the UAPI offsets; types derived; the rest zero", () => {
    const dv = new DataView(new ArrayBuffer(UBLK_PARAMS_SIZE));
    bytesOf(dv).fill(0x5a);
    encodeUblkParams(dv, 0, { basic, discard });
    expect(dv.getUint32(0, true)).toBe(152); // len
    expect(dv.getUint32(4, true)).toBe(UBLK_PARAM_TYPE_BASIC | UBLK_PARAM_TYPE_DISCARD); // types
    expect(dv.getUint32(8, true)).toBe(UBLK_ATTR_VOLATILE_CACHE | UBLK_ATTR_FUA); // basic.attrs
    expect([dv.getUint8(12), dv.getUint8(13), dv.getUint8(14), dv.getUint8(15)]).toEqual([9, 12, 12, 9]);
    expect(dv.getUint32(16, true)).toBe(1024); // max_sectors
    expect(dv.getUint32(20, true)).toBe(0); // chunk_sectors
    expect(dv.getBigUint64(24, true)).toBe(2n ** 33n + 8n); // dev_sectors
    expect(dv.getBigUint64(32, true)).toBe(0xfffn); // virt_boundary_mask
    expect(dv.getUint32(40, true)).toBe(0); // discard_alignment
    expect(dv.getUint32(44, true)).toBe(4096); // discard_granularity
    expect(dv.getUint32(48, true)).toBe(1 << 21); // max_discard_sectors
    expect(dv.getUint32(52, true)).toBe(1 << 20); // max_write_zeroes_sectors
    expect(dv.getUint16(56, true)).toBe(1); // max_discard_segments
    expect(dv.getUint16(58, true)).toBe(0);
    for (let i = 60; i < 152; i++) expect(dv.getUint8(i)).toBe(0);
    expect(decodeUblkParams(dv, 0)).toEqual({ len: 152, types: 3, basic, discard });
  });

  test("devt, dma, seg, zoned, integrity sub-structs land at 60/112/120/80/136", () => {
    const dv = new DataView(new ArrayBuffer(UBLK_PARAMS_SIZE));
    const p = {
      basic,
      devt: { charMajor: 240, charMinor: 3, diskMajor: 259, diskMinor: 7 },
      zoned: { maxOpenZones: 5, maxActiveZones: 6, maxZoneAppendSectors: 7 },
      dma: { alignment: 511 },
      seg: { segBoundaryMask: 0xffffffff, maxSegmentSize: 65536, maxSegments: 128 },
      integrity: { flags: 1, maxIntegritySegments: 2, intervalExp: 9, metadataSize: 8, piOffset: 0, csumType: 1, tagSize: 2 },
    };
    encodeUblkParams(dv, 0, p);
    expect(dv.getUint32(4, true)).toBe(0x7d); // BASIC|DEVT|ZONED|DMA|SEG|INTEGRITY
    expect(dv.getUint32(60, true)).toBe(240);
    expect(dv.getUint32(72, true)).toBe(7);
    expect(dv.getUint32(80, true)).toBe(5);
    expect(dv.getUint32(112, true)).toBe(511);
    expect(dv.getBigUint64(120, true)).toBe(0xffffffffn);
    expect(dv.getUint32(128, true)).toBe(65536);
    expect(dv.getUint16(132, true)).toBe(128);
    expect(dv.getUint32(136, true)).toBe(1);
    expect(dv.getUint8(143)).toBe(8);
    expect(decodeUblkParams(dv, 0)).toEqual({ len: 152, types: 0x7d, ...p });
  });

  test("explicit len and types are sent as given", () => {
    const dv = new DataView(new ArrayBuffer(UBLK_PARAMS_SIZE));
    encodeUblkParams(dv, 0, { len: 80, types: UBLK_PARAM_TYPE_BASIC, basic, discard });
    expect(dv.getUint32(0, true)).toBe(80);
    expect(dv.getUint32(4, true)).toBe(UBLK_PARAM_TYPE_BASIC);
    expect(decodeUblkParams(dv, 0).discard).toBeUndefined(); // decode follows types
  });

  test("kernel rules are checked before anything is written", () => {
    const dv = new DataView(new ArrayBuffer(UBLK_PARAMS_SIZE));
    expect(() => encodeUblkParams(dv, 0, { basic: { ...basic, logicalBsShift: 13 } })).toThrow(/logical_bs_shift/);
    expect(() => encodeUblkParams(dv, 0, { basic: { ...basic, logicalBsShift: 8 } })).toThrow(UblkInvalidArgument);
    expect(() => encodeUblkParams(dv, 0, { basic: { ...basic, physicalBsShift: 9, logicalBsShift: 12 } })).toThrow(/physical_bs_shift/);
    expect(() => encodeUblkParams(dv, 0, { basic, discard: { ...discard, maxDiscardSegments: 2 } })).toThrow(/max_discard_segments/);
    expect(() => encodeUblkParams(dv, 0, { basic, discard: { ...discard, discardGranularity: 0 } })).toThrow(/granularity/);
    expect(() => encodeUblkParams(dv, 0, { types: UBLK_PARAM_TYPE_BASIC | UBLK_PARAM_TYPE_DISCARD, basic })).toThrow(/discard struct/);
    expect(() => encodeUblkParams(dv, 0, { basic, seg: { segBoundaryMask: 0x1000, maxSegmentSize: 4096, maxSegments: 1 } })).toThrow(
      /seg_boundary_mask/,
    );
    expect(() => encodeUblkParams(dv, 0, { len: 200, basic })).toThrow(/params.len/);
    expect(UBLK_PARAM_TYPE_SEGMENT).toBe(32);
  });
});

describe("struct ublksrv_io_cmd and the I/O SQE", () => {
  test("64-byte SQE: URING_CMD, cmd_op @8, q_id/tag/result/addr @48..63", () => {
    const dv = new DataView(new ArrayBuffer(64));
    bytesOf(dv).fill(0xff);
    encodeUblkIoCmdSqe(dv, 0, 5, UBLK_U_IO_COMMIT_AND_FETCH_REQ, 3, 4095, -E.EIO, 0x7f00_0020_0000, 3 * 65536 + 4095);
    const s = bytesOf(dv);
    expect(s[0]).toBe(IORING_OP_URING_CMD);
    expect(s[1]).toBe(0); // never IOSQE_ASYNC on ublk I/O commands
    expect(dv.getInt32(4, true)).toBe(5);
    expect(dv.getUint32(8, true)).toBe(0xc0107521);
    expect(dv.getUint32(12, true)).toBe(0);
    expect(dv.getBigUint64(16, true)).toBe(0n); // sqe.addr: only AUTO_BUF_REG uses it
    expect(dv.getUint32(24, true)).toBe(0);
    expect(dv.getUint32(28, true)).toBe(0);
    expect(dv.getBigUint64(32, true)).toBe(BigInt(3 * 65536 + 4095));
    for (let i = 40; i < 48; i++) expect(s[i]).toBe(0);
    expect(dv.getUint16(48, true)).toBe(3); // q_id
    expect(dv.getUint16(50, true)).toBe(4095); // tag
    expect(dv.getInt32(52, true)).toBe(-5); // result
    expect(dv.getBigUint64(56, true)).toBe(0x7f00_0020_0000n); // addr
    expect(decodeUblksrvIoCmd(dv, 48)).toEqual({ qId: 3, tag: 4095, result: -5, addr: 0x7f00_0020_0000 });
  });

  test("out-of-range q_id / tag / result are named errors", () => {
    const dv = new DataView(new ArrayBuffer(64));
    expect(() => encodeUblkIoCmdSqe(dv, 0, 5, UBLK_U_IO_FETCH_REQ, 4096, 0, 0, 0, 0)).toThrow(/q_id/);
    expect(() => encodeUblkIoCmdSqe(dv, 0, 5, UBLK_U_IO_FETCH_REQ, 0, 4096, 0, 0, 0)).toThrow(/tag/);
    expect(() => encodeUblkIoCmdSqe(dv, 0, 5, UBLK_U_IO_FETCH_REQ, 0, 0, 2 ** 31, 0, 0)).toThrow(/result/);
    expect(() => encodeUblkIoCmdSqe(dv, 0, 5, UBLK_U_IO_FETCH_REQ, 0, 0, 0, 1.5, 0)).toThrow(/addr/);
  });

  test("auto-buf-reg sqe.addr packing", () => {
    expect(ublkAutoBufRegToSqeAddr(7, 1)).toBe(0x10007);
    expect(() => ublkAutoBufRegToSqeAddr(0x10000)).toThrow(UblkInvalidArgument);
  });
});

describe("struct ublksrv_io_desc (24 bytes per tag)", () => {
  test("op_flags splits into op (bits 0-7) and flags left in place", () => {
    const dv = new DataView(new ArrayBuffer(24 * 4));
    const at = 2 * 24;
    dv.setUint32(at + 0, UBLK_IO_OP_WRITE | UBLK_IO_F_FUA, true);
    dv.setUint32(at + 4, 16, true);
    dv.setBigUint64(at + 8, 2n ** 40n + 5n, true);
    dv.setBigUint64(at + 16, 0x7f00_0000_1000n, true);
    const d = decodeUblksrvIoDesc(dv, 2);
    expect(d).toEqual({
      opFlags: UBLK_IO_OP_WRITE | UBLK_IO_F_FUA,
      op: UBLK_IO_OP_WRITE,
      flags: UBLK_IO_F_FUA,
      nrSectors: 16,
      startSector: 2 ** 40 + 5,
      addr: 0x7f00_0000_1000,
    });
    expect(d.flags & UBLK_IO_F_FUA).toBeTruthy(); // already shifted: no >> 8
    expect(ublksrvGetOp(0x2005)).toBe(UBLK_IO_OP_WRITE_ZEROES);
    expect(ublksrvGetFlags(UBLK_IO_OP_WRITE_ZEROES | UBLK_IO_F_NOUNMAP)).toBe(UBLK_IO_F_NOUNMAP);
    encodeUblksrvIoDesc(dv, 3, { op: UBLK_IO_OP_DISCARD, nrSectors: 8, startSector: 99 });
    expect(decodeUblksrvIoDesc(dv, 3)).toMatchObject({ op: UBLK_IO_OP_DISCARD, flags: 0, nrSectors: 8, startSector: 99 });
    expect(UBLKSRV_IO_DESC_SIZE).toBe(24);
  });
});

describe("descriptor mmap and USER_COPY offsets", () => {
  test("per-queue stride round_up(4096*24, PAGE_SIZE); length round_up(depth*24, PAGE_SIZE)", () => {
    expect(ublkMaxCmdBufSize()).toBe(0x18000);
    expect(ublkQueueDescOffset(0)).toBe(0);
    expect(ublkQueueDescOffset(1)).toBe(0x18000);
    expect(ublkQueueDescOffset(3)).toBe(3 * 98304);
    expect(ublkQueueDescLength(1)).toBe(4096);
    expect(ublkQueueDescLength(128)).toBe(4096); // 3072 rounded up
    expect(ublkQueueDescLength(171)).toBe(8192); // 4104 rounded up
    expect(ublkQueueDescLength(4096)).toBe(98304);
    // Larger pages change the rounding (64 KiB pages: stride 128 KiB).
    expect(ublkMaxCmdBufSize(65536)).toBe(131072);
    expect(ublkQueueDescOffset(2, 65536)).toBe(262144);
    expect(ublkQueueDescLength(128, 16384)).toBe(16384);
    expect(() => ublkQueueDescLength(0)).toThrow(UblkInvalidArgument);
    expect(() => ublkQueueDescOffset(4096)).toThrow(UblkInvalidArgument);
    expect(() => ublkMaxCmdBufSize(3000)).toThrow(UblkInvalidArgument);
  });

  test("USER_COPY position = 0x80000000 + qid<<41 + tag<<25 + offset", () => {
    expect(UBLKSRV_IO_BUF_OFFSET).toBe(0x80000000);
    expect(ublkUserCopyOffset(1, 2, 3)).toBe(0x80000000n + (1n << 41n) + (2n << 25n) + 3n);
    expect(ublkUserCopyOffset(4095, 65535, 2 ** 25 - 1)).toBe(0x80000000n + (4095n << 41n) + (65535n << 25n) + (2n ** 25n - 1n));
    expect(() => ublkUserCopyOffset(0, 0, 2 ** 25)).toThrow(UblkInvalidArgument);
  });
});

describe("errors", () => {
  test("UblkError names the command, device and errno", () => {
    const e = new UblkError("ADD_DEV", E.EPERM, 3);
    expect(e.name).toBe("UblkError");
    expect(e.code).toBe("EPERM");
    expect(e.command).toBe("ADD_DEV");
    expect(e.message).toBe("ublk ADD_DEV dev 3: EPERM (Operation not permitted)");
    expect(new UblkError("GET_FEATURES", ENOTSUPP).code).toBe("ENOTSUPP");
    expect(new UblkError("GET_FEATURES", ENOTSUPP).message).toStartWith("ublk GET_FEATURES: ENOTSUPP");
    expect(new UblkInvalidArgument("x", 1, "why").name).toBe("UblkInvalidArgument");
  });

  test("DeviceIo errors become COMMIT results", () => {
    expect(ublkResultForError(new Error("boom"))).toBe(-E.EIO);
    expect(ublkResultForError(new SyscallError("pwrite", E.ENOSPC))).toBe(-E.ENOSPC);
    expect(ublkResultForError(new SyscallError("pread", E.EBADF))).toBe(-E.EIO);
    expect(ublkResultForError(Object.assign(new Error("ro"), { errno: E.EROFS }))).toBe(-E.EROFS);
    expect(ublkResultForError("string")).toBe(-E.EIO);
    expect(UBLK_IO_RES_ABORT).toBe(-E.ENODEV);
  });
});

// ---------------------------------------------------------------------------------------------
// UblkControl against stand-in nodes: /dev/null accepts every URING_CMD (res 0, buffers untouched);
// /dev/zero rejects every one with EOPNOTSUPP. That runs the real SQE128 ring path without ublk_drv.

describe("UblkControl (real ring, stand-in node)", () => {
  const opened: UblkControl[] = [];
  afterAll(() => opened.forEach((c) => c.close()));
  const make = (path: string) => {
    const traces: UblkControlTrace[] = [];
    const c = new UblkControl({ path, trace: (t) => traces.push(t) });
    opened.push(c);
    return { c, traces };
  };
  const sqeView = (t: UblkControlTrace) => new DataView(t.sqe.buffer, t.sqe.byteOffset, t.sqe.byteLength);
  const cmdOf = (t: UblkControlTrace) => decodeUblksrvCtrlCmd(sqeView(t), 48);

  function expectCommonSqe(c: UblkControl, t: UblkControlTrace, cmdOp: number) {
    const dv = sqeView(t);
    expect(t.sqe.length).toBe(128);
    expect(t.sqe[0]).toBe(IORING_OP_URING_CMD);
    expect(t.sqe[1]).toBe(0);
    expect(dv.getInt32(4, true)).toBe(c.fd);
    expect(dv.getUint32(8, true)).toBe(cmdOp);
    expect(dv.getUint32(12, true)).toBe(0);
    for (let i = 80; i < 128; i++) expect(t.sqe[i]).toBe(0);
    const cmd = cmdOf(t);
    if (cmd.len > 0) {
      expect(cmd.addr % 4096).toBe(0); // allocAligned: owned memory the io-wq worker may use later
      expect(t.buf!.length).toBe(cmd.len);
    } else {
      expect(cmd.addr).toBe(0);
    }
    return cmd;
  }

  test.skipIf(existsSync("/dev/ublk-control"))("the default node is absent here: a SyscallError names it (skipped: this host has ublk_drv)", () => {
    expect(UblkControl.available()).toBe(false);
    expect(() => new UblkControl()).toThrow(SyscallError);
    expect(() => new UblkControl()).toThrow(/\/dev\/ublk-control/);
  });

  test("every command's SQE and buffer, byte for byte", async () => {
    const { c, traces } = make("/dev/null");
    expect(UblkControl.available("/dev/null")).toBe(true);

    expect(await c.getFeatures()).toBe(0);
    let cmd = expectCommonSqe(c, traces.at(-1)!, UBLK_U_CMD_GET_FEATURES);
    expect(cmd).toMatchObject({ devId: 0xffffffff, queueId: 0xffff, len: 8, data: 0, devPathLen: 0 });
    expect(c.opcodeStyle).toBe("ioctl");

    const info = await c.addDev({ devId: 7, nrHwQueues: 2, queueDepth: 64, maxIoBufBytes: 65536, flags: UBLK_F_USER_RECOVERY });
    cmd = expectCommonSqe(c, traces.at(-1)!, UBLK_U_CMD_ADD_DEV);
    expect(cmd).toMatchObject({ devId: 7, queueId: 0xffff, len: 64 });
    const sent = decodeUblksrvCtrlDevInfo(new DataView(traces.at(-1)!.buf!.buffer), 0);
    expect(sent).toMatchObject({ devId: 7, nrHwQueues: 2, queueDepth: 64, maxIoBufBytes: 65536, flags: UBLK_F_USER_RECOVERY | UBLK_F_CMD_IOCTL_ENCODE });
    expect(info).toEqual(sent); // /dev/null leaves the buffer as sent; the decode reads it back

    const params = ublkParamsFor({ sizeBytes: 1 << 30, maxIoBufBytes: 65536 });
    await c.setParams(7, params);
    cmd = expectCommonSqe(c, traces.at(-1)!, UBLK_U_CMD_SET_PARAMS);
    expect(cmd).toMatchObject({ devId: 7, len: 152 });
    expect(decodeUblkParams(new DataView(traces.at(-1)!.buf!.buffer), 0)).toEqual({ len: 152, ...params } as never);

    await c.getParams(7);
    cmd = expectCommonSqe(c, traces.at(-1)!, UBLK_U_CMD_GET_PARAMS);
    expect(cmd.len).toBe(152);
    expect(new DataView(traces.at(-1)!.buf!.buffer).getUint32(0, true)).toBe(152); // params.len preset

    await c.getDevInfo(7);
    expect(expectCommonSqe(c, traces.at(-1)!, UBLK_U_CMD_GET_DEV_INFO)).toMatchObject({ devId: 7, len: 64, devPathLen: 0 });

    await c.getDevInfo2(7);
    cmd = expectCommonSqe(c, traces.at(-1)!, UBLK_U_CMD_GET_DEV_INFO2);
    expect(cmd).toMatchObject({ devId: 7, len: 12 + 64, devPathLen: 12 });
    expect(new TextDecoder().decode(traces.at(-1)!.buf!.subarray(0, 12))).toBe("/dev/ublkc7\0");

    expect(await c.getQueueAffinity(7, 1)).toEqual([]);
    cmd = expectCommonSqe(c, traces.at(-1)!, UBLK_U_CMD_GET_QUEUE_AFFINITY);
    expect(cmd).toMatchObject({ devId: 7, data: 1, len: 512 });
    expect(cmd.len % 8).toBe(0);

    await c.startDev(7, 4321);
    expect(expectCommonSqe(c, traces.at(-1)!, UBLK_U_CMD_START_DEV)).toMatchObject({ devId: 7, data: 4321, len: 0 });
    await c.startDev(7);
    expect(cmdOf(traces.at(-1)!).data).toBe(process.pid);
    await c.stopDev(7);
    expect(expectCommonSqe(c, traces.at(-1)!, UBLK_U_CMD_STOP_DEV)).toMatchObject({ devId: 7, data: 0, len: 0 });
    await c.startUserRecovery(7);
    expect(expectCommonSqe(c, traces.at(-1)!, UBLK_U_CMD_START_USER_RECOVERY)).toMatchObject({ devId: 7, data: 0 });
    await c.endUserRecovery(7, 999);
    expect(expectCommonSqe(c, traces.at(-1)!, UBLK_U_CMD_END_USER_RECOVERY)).toMatchObject({ devId: 7, data: 999 });
    await c.delDev(7);
    expect(expectCommonSqe(c, traces.at(-1)!, UBLK_U_CMD_DEL_DEV)).toMatchObject({ devId: 7, len: 0 });
    await c.delDevAsync(8);
    expect(expectCommonSqe(c, traces.at(-1)!, UBLK_U_CMD_DEL_DEV_ASYNC)).toMatchObject({ devId: 8 });
    // Distinct user_data per command, so concurrent commands cannot be confused.
    const uds = traces.map((t) => sqeView(t).getBigUint64(32, true));
    expect(new Set(uds).size).toBe(uds.length);
  });

  test("concurrent commands each get their own CQE and buffer", async () => {
    const { c, traces } = make("/dev/null");
    const infos = await Promise.all([1, 2, 3, 4, 5].map((id) => c.addDev({ devId: id, nrHwQueues: 1, queueDepth: 8, maxIoBufBytes: 4096 })));
    expect(infos.map((i) => i.devId)).toEqual([1, 2, 3, 4, 5]);
    expect(new Set(traces.map((t) => cmdOf(t).addr)).size).toBe(5);
  });

  test("unprivileged devices carry '/dev/ublkcN\\0' before the payload", async () => {
    const { c, traces } = make("/dev/null");
    c.markUnprivileged(12);
    await c.getDevInfo(12);
    const cmd = cmdOf(traces.at(-1)!);
    expect(cmd).toMatchObject({ devId: 12, devPathLen: 13, len: 13 + 64 });
    expect(new TextDecoder().decode(traces.at(-1)!.buf!.subarray(0, 13))).toBe("/dev/ublkc12\0");
    await c.stopDev(12);
    expect(cmdOf(traces.at(-1)!)).toMatchObject({ devPathLen: 13, len: 13 });
  });

  test("negative res → UblkError; encoded then legacy opcode on EOPNOTSUPP", async () => {
    const { c, traces } = make("/dev/zero");
    const e1 = await c.getFeatures().catch((e) => e);
    expect(e1).toBeInstanceOf(UblkError);
    expect(e1).toMatchObject({ command: "GET_FEATURES", code: "EOPNOTSUPP", errno: E.EOPNOTSUPP });
    expect(traces.length).toBe(1); // GET_FEATURES has no legacy number
    expect(await c.supportedFeatures()).toEqual({ features: UBLK_FEATURES_BASELINE, probed: false });

    traces.length = 0;
    const e2 = await c.addDev({ nrHwQueues: 1, queueDepth: 16, maxIoBufBytes: 65536 }).catch((e) => e);
    expect(e2).toBeInstanceOf(UblkError);
    expect(e2.message).toBe("ublk ADD_DEV: EOPNOTSUPP (Operation not supported)");
    expect(traces.map((t) => sqeView(t).getUint32(8, true))).toEqual([UBLK_U_CMD_ADD_DEV, UBLK_CMD_ADD_DEV]);
    expect(cmdOf(traces[0]!)).toMatchObject({ devId: 0xffffffff, queueId: 0xffff, len: 64 });
    expect(c.opcodeStyle).toBe("unknown");

    const e3 = await c.startDev(4).catch((e) => e);
    expect(e3).toMatchObject({ name: "UblkError", command: "START_DEV", devId: 4, code: "EOPNOTSUPP" });
    expect(e3.message).toContain("dev 4");
  });

  test("bad input is refused before anything is submitted", async () => {
    const { c, traces } = make("/dev/null");
    await expect(c.addDev({ nrHwQueues: 0, queueDepth: 1, maxIoBufBytes: 4096 })).rejects.toThrow(UblkInvalidArgument);
    await expect(c.addDev({ nrHwQueues: 1, queueDepth: 4097, maxIoBufBytes: 4096 })).rejects.toThrow(/queueDepth/);
    await expect(c.addDev({ nrHwQueues: 1, queueDepth: 1, maxIoBufBytes: 64 << 20 })).rejects.toThrow(/maxIoBufBytes/);
    await expect(c.startDev(-1)).rejects.toThrow(/devId/);
    await expect(c.startDev(1, 0)).rejects.toThrow(/daemonPid/);
    const p = ublkParamsFor({ sizeBytes: 1 << 20, maxIoBufBytes: 1 << 20 });
    await expect(c.setParams(1, { ...p, devt: { charMajor: 1, charMinor: 1, diskMajor: 1, diskMinor: 1 } })).rejects.toThrow(/read-only/);
    await expect(c.setParams(1, { ...p, types: UBLK_PARAM_TYPE_DEVT })).rejects.toThrow(UblkInvalidArgument);
    await expect(c.setParams(1, { discard: p.discard })).rejects.toThrow(/BASIC/);
    expect(traces.length).toBe(0);
    // max_sectors is checked against the negotiated buffer of a device this control added.
    await c.addDev({ devId: 1, nrHwQueues: 1, queueDepth: 1, maxIoBufBytes: 65536 });
    await expect(c.setParams(1, p)).rejects.toThrow(/max_sectors/);
  });

  test("close() rejects later commands", async () => {
    const c = new UblkControl({ path: "/dev/null" });
    c.close();
    c.close();
    await expect(c.getFeatures()).rejects.toThrow(/closed/);
  });
});

describe("frontend helpers", () => {
  test("params from a size: 512-byte sectors, max_sectors from the buffer, discard, attrs", () => {
    const p = ublkParamsFor({ sizeBytes: 10 * 2 ** 30, maxIoBufBytes: 512 * 1024 });
    expect(p.types).toBe(UBLK_PARAM_TYPE_BASIC | UBLK_PARAM_TYPE_DISCARD);
    expect(p.basic).toEqual({
      attrs: UBLK_ATTR_VOLATILE_CACHE,
      logicalBsShift: 9,
      physicalBsShift: 12,
      ioMinShift: 9,
      ioOptShift: 12,
      maxSectors: 1024,
      chunkSectors: 0,
      devSectors: (10 * 2 ** 30) / 512,
      virtBoundaryMask: 0,
    });
    expect(p.discard).toEqual({ discardAlignment: 0, discardGranularity: 4096, maxDiscardSectors: 1 << 21, maxWriteZeroesSectors: 1 << 21, maxDiscardSegments: 1 });
    // 4 KiB logical blocks: dev_sectors still counts 512-byte sectors.
    expect(ublkParamsFor({ sizeBytes: 1 << 20, logicalBs: 4096, maxIoBufBytes: 65536 }).basic!.devSectors).toBe(2048);
    const ro = ublkParamsFor({ sizeBytes: 1 << 20, maxIoBufBytes: 65536, readOnly: true, volatileCache: false });
    expect(ro.basic!.attrs).toBe(UBLK_ATTR_READ_ONLY);
    expect(ro.discard).toBeUndefined();
    expect(ublkParamsFor({ sizeBytes: 1 << 20, maxIoBufBytes: 65536, fua: true }).basic!.attrs).toBe(UBLK_ATTR_VOLATILE_CACHE | UBLK_ATTR_FUA);
    expect(UBLK_ATTR_ROTATIONAL).toBe(2);
    expect(() => ublkParamsFor({ sizeBytes: 1000, maxIoBufBytes: 65536 })).toThrow(/sizeBytes/);
    expect(() => ublkParamsFor({ sizeBytes: 8192, logicalBs: 1000, maxIoBufBytes: 65536 })).toThrow(/logicalBs/);
    expect(() => ublkParamsFor({ sizeBytes: 8192, logicalBs: 4096, physicalBs: 512, maxIoBufBytes: 65536 })).toThrow(/physicalBs/);
    // Whatever the helper builds, the encoder accepts.
    encodeUblkParams(new DataView(new ArrayBuffer(UBLK_PARAMS_SIZE)), 0, p);
  });

  test("recovery modes map to the accepted flag combinations", () => {
    expect(ublkRecoveryFlags("none")).toBe(0);
    expect(ublkRecoveryFlags("requeue")).toBe(UBLK_F_USER_RECOVERY);
    expect(ublkRecoveryFlags("reissue")).toBe(UBLK_F_USER_RECOVERY | UBLK_F_USER_RECOVERY_REISSUE);
    expect(ublkRecoveryFlags("fail-io")).toBe(UBLK_F_USER_RECOVERY | UBLK_F_USER_RECOVERY_FAIL_IO);
    expect(() => ublkRecoveryFlags("x" as never)).toThrow(UblkInvalidArgument);
  });

  test("UblkDevice.create deletes the device again when /dev/ublkcN never appears", async () => {
    const traces: UblkControlTrace[] = [];
    const c = new UblkControl({ path: "/dev/null", trace: (t) => traces.push(t) });
    try {
      const err = await UblkDevice.create(c, { devId: 4000, sizeBytes: 1 << 20, nodeTimeoutMs: 20, recovery: "reissue" }).catch((e) => e);
      expect(err).toBeInstanceOf(SyscallError);
      expect(err.message).toContain("/dev/ublkc4000");
      expect(traces.map((t) => t.command)).toEqual(["ADD_DEV", "DEL_DEV"]);
      const sent = decodeUblksrvCtrlDevInfo(new DataView(traces[0]!.buf!.buffer), 0);
      expect(sent).toMatchObject({
        devId: 4000,
        nrHwQueues: 1,
        queueDepth: 64,
        maxIoBufBytes: 512 * 1024,
        flags: UBLK_F_CMD_IOCTL_ENCODE | UBLK_F_USER_RECOVERY | UBLK_F_USER_RECOVERY_REISSUE,
      });
      expect(decodeUblksrvCtrlCmd(new DataView(traces[1]!.sqe.buffer), 48).devId).toBe(4000);
    } finally {
      c.close();
    }
  });

  test("UblkDevice.recover refuses a device that is not QUIESCED / FAIL_IO", async () => {
    const c = new UblkControl({ path: "/dev/null" }); // GET_DEV_INFO leaves state 0 = DEAD
    try {
      const err = await UblkDevice.recover(c, 3).catch((e) => e);
      expect(err).toMatchObject({ name: "UblkError", command: "START_USER_RECOVERY", code: "EINVAL", devId: 3 });
      expect(err.message).toContain("not QUIESCED or FAIL_IO");
    } finally {
      c.close();
    }
  });

  test.skipIf(existsSync("/dev/ublkc4000"))("the e2e queue worker loads and reports an open failure by name (skipped: /dev/ublkc4000 exists)", async () => {
    const w = new Worker(new URL("./ublk_e2e_worker.ts", import.meta.url).href);
    try {
      const msg = await new Promise<{ type: string; message: string }>((resolve) => {
        w.onmessage = (ev) => resolve(ev.data);
        w.postMessage({ spec: { devId: 4000, qId: 0, queueDepth: 2, maxIoBufBytes: 4096, flags: 0 }, wakeFd: -1, sizeBytes: 4096 });
      });
      expect(msg.type).toBe("error");
      expect(msg.message).toStartWith("SyscallError: open /dev/ublkc4000: ENOENT");
    } finally {
      w.terminate();
    }
  });

  test("node paths; openUblkNode gives up with the SyscallError after its timeout", async () => {
    expect(ublkCharPath(3)).toBe("/dev/ublkc3");
    expect(ublkBlockPath(3)).toBe("/dev/ublkb3");
    const t0 = Date.now();
    await expect(openUblkNode("/dev/ublkc-none", O_RDWR, 50)).rejects.toThrow(SyscallError);
    expect(Date.now() - t0).toBeGreaterThanOrEqual(45);
  });
});

// ---------------------------------------------------------------------------------------------
// UblkQueue loop against a fake kernel. The fake decodes the SQEs the queue writes (so the bytes are
// checked), plays the driver's part (descriptors, copy into/out of the tag buffers, CQEs), and
// resolves each scripted request with its COMMIT result.

interface FakeReq {
  op: number;
  flags?: number;
  startSector: number;
  nrSectors: number;
  data?: Uint8Array;
}
interface FakeDone {
  result: number;
  data: Uint8Array | null;
}

class FakeUblkKernel implements UblkQueueRing {
  readonly sqes = new DataView(new ArrayBuffer(64 * 1024));
  readonly desc: DataView;
  readonly log: { cmdOp: number; qId: number; tag: number; result: number; addr: number; userData: number; fd: number }[] = [];
  fetchRes = 0; // res for FETCHes (negative to simulate a rejected FETCH)
  needGetData = false; // WRITEs first complete with UBLK_IO_RES_NEED_GET_DATA
  /** Work released one batch at a time whenever the queue would sleep; then the device stops. */
  phases: (() => void)[] = [];
  onIdle: () => void = () => {
    const next = this.phases.shift();
    if (next) next();
    else this.stop();
  };
  wakeReads = 0;
  closed = false;
  private slot = 0;
  private pending: number[] = [];
  private cqes: [number, number][] = [];
  private waiting = new Map<number, { addr: number; userData: number }>();
  private active = new Map<number, { req: FakeReq; resolve: (d: FakeDone) => void }>();
  private queue: { req: FakeReq; resolve: (d: FakeDone) => void }[] = [];
  private wakeArmed: number | null = null;
  private wakeWanted = 0;

  constructor(readonly depth: number) {
    this.desc = new DataView(new ArrayBuffer(ublkQueueDescLength(depth)));
  }

  submit(req: FakeReq): Promise<FakeDone> {
    return new Promise((resolve) => this.queue.push({ req, resolve }));
  }
  wake(): void {
    this.wakeWanted++;
  }
  stop(): void {
    for (const [, w] of this.waiting) this.cqes.push([w.userData, UBLK_IO_RES_ABORT]);
    this.waiting.clear();
  }

  getSqe(): number {
    const at = (this.slot++ % 1024) * 64;
    for (let i = 0; i < 64; i++) this.sqes.setUint8(at + i, 0);
    this.pending.push(at);
    return at;
  }

  flush(wait: boolean): void {
    for (const at of this.pending.splice(0)) this.consume(at);
    this.deliver();
    if (wait && this.cqes.length === 0) {
      this.onIdle();
      this.deliver();
      if (this.cqes.length === 0) throw new Error("fake kernel: the queue would sleep forever");
    }
  }

  reap(cb: CqeCallback): number {
    const batch = this.cqes.splice(0);
    for (const [ud, res] of batch) cb(ud, res, 0);
    return batch.length;
  }

  close(): void {
    this.closed = true;
  }

  private consume(at: number): void {
    const s = decodeSqe(this.sqes, at);
    if (s.opcode === IORING_OP_READ) {
      expect(s.len).toBe(8);
      this.wakeArmed = s.userData;
      this.wakeReads++;
      return;
    }
    expect(s.opcode).toBe(IORING_OP_URING_CMD);
    expect(s.flags).toBe(0);
    expect(this.sqes.getUint32(at + 12, true)).toBe(0);
    const cmdOp = this.sqes.getUint32(at + 8, true);
    const c = decodeUblksrvIoCmd(this.sqes, at + 48);
    this.log.push({ cmdOp, ...c, userData: s.userData, fd: s.fd });
    const nr = _IOC_NR(cmdOp);
    if (nr === UBLK_IO_FETCH_REQ) {
      if (this.fetchRes < 0) this.cqes.push([s.userData, this.fetchRes]);
      else this.waiting.set(c.tag, { addr: c.addr, userData: s.userData });
    } else if (nr === UBLK_IO_COMMIT_AND_FETCH_REQ) {
      const a = this.active.get(c.tag)!;
      this.active.delete(c.tag);
      // Copy mode READ: the driver copies `result` bytes out of the tag buffer at commit time.
      const data = a.req.op === UBLK_IO_OP_READ && c.result > 0 ? new Uint8Array(toArrayBuffer(c.addr as Pointer, 0, c.result)).slice() : null;
      a.resolve({ result: c.result, data });
      this.waiting.set(c.tag, { addr: c.addr, userData: s.userData });
    } else if (nr === 0x22) {
      const a = this.active.get(c.tag)!;
      new Uint8Array(toArrayBuffer(c.addr as Pointer, 0, a.req.data!.length)).set(a.req.data!);
      this.cqes.push([s.userData, 0]);
    }
  }

  private deliver(): void {
    if (this.wakeWanted > 0 && this.wakeArmed !== null) {
      this.wakeWanted--;
      this.cqes.push([this.wakeArmed, 8]);
      this.wakeArmed = null;
    }
    for (const [tag, w] of [...this.waiting]) {
      const next = this.queue.shift();
      if (!next) break;
      this.waiting.delete(tag);
      this.active.set(tag, next);
      encodeUblksrvIoDesc(this.desc, tag, { ...next.req, addr: w.addr });
      if (next.req.op === UBLK_IO_OP_WRITE && this.needGetData) {
        this.cqes.push([w.userData, UBLK_IO_RES_NEED_GET_DATA]);
        continue;
      }
      // Copy mode WRITE: the data is in the tag buffer before the CQE.
      if (next.req.data) new Uint8Array(toArrayBuffer(w.addr as Pointer, 0, next.req.data.length)).set(next.req.data);
      this.cqes.push([w.userData, 0]);
    }
  }
}

class MemDisk implements DeviceIo {
  readonly store: Uint8Array;
  inflight = 0;
  maxInflight = 0;
  flushes = 0;
  discards: [number, number][] = [];
  delayMs = 0;
  /** While set, every request waits for it (a request held in flight on purpose). */
  gate: Promise<void> | null = null;
  failNext: unknown = null;
  constructor(
    size: number,
    readonly readOnly = false,
  ) {
    this.store = new Uint8Array(size);
  }
  size() {
    return this.store.length;
  }
  private async enter<T>(f: () => T): Promise<T> {
    this.inflight++;
    this.maxInflight = Math.max(this.maxInflight, this.inflight);
    try {
      if (this.delayMs) await Bun.sleep(this.delayMs);
      if (this.gate) await this.gate;
      if (this.failNext) {
        const e = this.failNext;
        this.failNext = null;
        throw e;
      }
      return f();
    } finally {
      this.inflight--;
    }
  }
  read(buf: Uint8Array, off: number) {
    return this.enter(() => void buf.set(this.store.subarray(off, off + buf.length)));
  }
  write(buf: Uint8Array, off: number) {
    return this.enter(() => void this.store.set(buf, off));
  }
  flush() {
    return this.enter(() => void this.flushes++);
  }
  discard(off: number, len: number) {
    return this.enter(() => {
      this.discards.push([off, len]);
      this.store.fill(0, off, off + len);
    });
  }
}

function wakeSource(stopAfter = Infinity): WakeSource & { wakes: number } {
  const w = {
    fd: 99,
    wakes: 0,
    async onWake() {
      w.wakes++;
    },
    stopping: () => w.wakes >= stopAfter,
  };
  return w;
}

function pattern(len: number, seed: number): Uint8Array {
  const b = new Uint8Array(len);
  for (let i = 0; i < len; i++) b[i] = (i * 31 + seed) & 0xff;
  return b;
}

const queues: UblkQueue[] = [];
afterAll(() => queues.forEach((q) => q.close()));
function fakeQueue(depth: number, flags = UBLK_F_CMD_IOCTL_ENCODE, extra: { maxIoBufBytes?: number; busyPollMs?: number } = {}) {
  const k = new FakeUblkKernel(depth);
  const q = new UblkQueue(
    { devId: 5, qId: 2, queueDepth: depth, maxIoBufBytes: extra.maxIoBufBytes ?? 65536, flags, busyPollMs: extra.busyPollMs },
    { ring: k, desc: k.desc, charFd: 42 },
  );
  queues.push(q);
  return { k, q };
}

describe("UblkQueue loop (fake kernel)", () => {
  test("ring setup flags: COOP_TASKRUN|TASKRUN_FLAG first, then SINGLE_ISSUER|DEFER_TASKRUN; never SQPOLL", () => {
    expect(UBLK_QUEUE_RING_FLAGS).toEqual([(1 << 8) | (1 << 9), (1 << 12) | (1 << 13) | (1 << 9), 0]);
    for (const f of UBLK_QUEUE_RING_FLAGS) expect(f & (1 << 1)).toBe(0);
  });

  test("FETCH every tag with its buffer; write, read back, flush, discard, write-zeroes; abort ends run()", async () => {
    const { k, q } = fakeQueue(4);
    const disk = new MemDisk(1 << 20);
    const w = k.submit({ op: UBLK_IO_OP_WRITE, startSector: 8, nrSectors: 16, data: pattern(8192, 1) });
    const f = k.submit({ op: UBLK_IO_OP_FLUSH, startSector: 0, nrSectors: 0 });
    let r!: Promise<FakeDone>, dz!: Promise<FakeDone>[];
    k.phases.push(() => (r = k.submit({ op: UBLK_IO_OP_READ, startSector: 9, nrSectors: 2 })));
    k.phases.push(() => {
      dz = [
        k.submit({ op: UBLK_IO_OP_DISCARD, startSector: 8, nrSectors: 8 }),
        k.submit({ op: UBLK_IO_OP_WRITE_ZEROES, flags: UBLK_IO_F_NOUNMAP, startSector: 16, nrSectors: 8 }),
      ];
    });
    const exit = await q.run(disk, wakeSource());
    expect(exit).toEqual({ reason: "aborted", served: 5 });
    expect(await w).toEqual({ result: 8192, data: null });
    expect(await f).toEqual({ result: 0, data: null });
    expect(await r).toEqual({ result: 1024, data: pattern(8192, 1).subarray(512, 1536) });
    expect((await Promise.all(dz)).map((d) => d.result)).toEqual([0, 0]);
    expect(disk.discards).toEqual([
      [4096, 4096],
      [8192, 4096],
    ]);
    expect(disk.flushes).toBe(1);
    expect(disk.store.subarray(4096, 12288).every((b) => b === 0)).toBe(true);

    const fetches = k.log.filter((l) => l.cmdOp === UBLK_U_IO_FETCH_REQ);
    expect(fetches.map((l) => l.tag)).toEqual([0, 1, 2, 3]);
    for (const l of k.log) {
      expect(l.qId).toBe(2);
      expect(l.fd).toBe(42);
      expect(l.userData).toBe(l.tag + 2 * 65536);
      expect(l.addr).toBe(ptr(q.buffer(l.tag))); // copy mode: the tag's own page-aligned buffer
      expect(l.addr % 4096).toBe(0);
    }
    const commits = k.log.filter((l) => l.cmdOp === UBLK_U_IO_COMMIT_AND_FETCH_REQ);
    expect(commits.map((l) => l.result).sort((a, b) => a - b)).toEqual([0, 0, 0, 1024, 8192]);
    expect(new Set(fetches.map((l) => l.addr)).size).toBe(4);
  });

  test("requests run concurrently across tags, and more requests than tags all complete", async () => {
    const { k, q } = fakeQueue(4, UBLK_F_CMD_IOCTL_ENCODE, { busyPollMs: 1 });
    const disk = new MemDisk(1 << 20);
    disk.delayMs = 5;
    let idleCalls = 0;
    k.onIdle = () => {
      idleCalls++;
      k.stop();
    };
    const reqs = Array.from({ length: 10 }, (_, i) => k.submit({ op: UBLK_IO_OP_WRITE, startSector: i * 8, nrSectors: 8, data: pattern(4096, i) }));
    const exit = await q.run(disk, wakeSource());
    expect(exit).toEqual({ reason: "aborted", served: 10 });
    const res = await Promise.all(reqs);
    expect(res.every((r) => r.result === 4096)).toBe(true);
    expect(disk.maxInflight).toBe(4);
    for (let i = 0; i < 10; i++) expect(disk.store.subarray(i * 4096, (i + 1) * 4096)).toEqual(pattern(4096, i));
    expect(idleCalls).toBe(1); // the loop slept in the kernel only once nothing was in flight
  });

  test("results: EROFS on read-only writes/discards, EIO on errors and out-of-range, ENOSPC passed, EOPNOTSUPP for odd ops, FUA flushes", async () => {
    const { k, q } = fakeQueue(2);
    const disk = new MemDisk(64 * 1024);
    const got: Promise<FakeDone>[] = [];
    const one = (before: () => void, req: FakeReq) =>
      k.phases.push(() => {
        before();
        got.push(k.submit(req));
      });
    one(() => (disk.failNext = new Error("backend broke")), { op: UBLK_IO_OP_READ, startSector: 0, nrSectors: 8 });
    one(() => (disk.failNext = new SyscallError("pwrite", E.ENOSPC)), { op: UBLK_IO_OP_WRITE, startSector: 0, nrSectors: 1, data: pattern(512, 3) });
    one(() => {}, { op: UBLK_IO_OP_READ, startSector: 127, nrSectors: 2 }); // past the end
    one(() => {}, { op: UBLK_IO_OP_READ, startSector: 0, nrSectors: 129 }); // bigger than the buffer
    one(() => {}, { op: UBLK_IO_OP_WRITE_SAME, startSector: 0, nrSectors: 1 });
    one(() => {}, { op: 18, startSector: 0, nrSectors: 1 });
    one(() => {}, { op: UBLK_IO_OP_WRITE, flags: UBLK_IO_F_FUA, startSector: 2, nrSectors: 1, data: pattern(512, 4) });
    expect((await q.run(disk, wakeSource())).reason).toBe("aborted");
    expect((await Promise.all(got)).map((d) => d.result)).toEqual([-E.EIO, -E.ENOSPC, -E.EIO, -E.EIO, -E.EOPNOTSUPP, -E.EOPNOTSUPP, 512]);
    expect(disk.flushes).toBe(1); // the FUA write

    const ro = fakeQueue(2);
    const rodisk = new MemDisk(64 * 1024, true);
    const rs = [
      ro.k.submit({ op: UBLK_IO_OP_WRITE, startSector: 0, nrSectors: 1, data: pattern(512, 5) }),
      ro.k.submit({ op: UBLK_IO_OP_DISCARD, startSector: 0, nrSectors: 8 }),
      ro.k.submit({ op: UBLK_IO_OP_WRITE_ZEROES, startSector: 0, nrSectors: 8 }),
      ro.k.submit({ op: UBLK_IO_OP_READ, startSector: 0, nrSectors: 1 }),
    ];
    expect((await ro.q.run(rodisk, wakeSource())).reason).toBe("aborted");
    expect((await Promise.all(rs)).map((d) => d.result)).toEqual([-E.EROFS, -E.EROFS, -E.EROFS, 512]);
    expect(rodisk.store.every((b) => b === 0)).toBe(true);
  });

  test("wake: the eventfd READ stays armed, onWake runs, stopping() ends the loop after in-flight requests commit", async () => {
    const { k, q } = fakeQueue(2, UBLK_F_CMD_IOCTL_ENCODE, { busyPollMs: 1 });
    const wake = wakeSource(2);
    let step = 0;
    k.onIdle = () => {
      step++;
      k.wake();
    };
    const exit = await q.run(new MemDisk(64 * 1024), wake);
    expect(exit).toEqual({ reason: "stopping", served: 0 });
    expect(wake.wakes).toBe(2);
    expect(k.wakeReads).toBe(2); // armed at start, re-armed after the first wake only
    expect(step).toBe(2);

    // A request in flight when stopping() turns true still finishes and commits before run() returns.
    const b = fakeQueue(2, UBLK_F_CMD_IOCTL_ENCODE, { busyPollMs: 1 });
    const d2 = new MemDisk(64 * 1024);
    let release!: () => void;
    d2.gate = new Promise<void>((r) => (release = r));
    const ws = wakeSource(1);
    const pending = b.k.submit({ op: UBLK_IO_OP_WRITE, startSector: 0, nrSectors: 1, data: pattern(512, 9) });
    const runP = b.q.run(d2, ws);
    await until(() => d2.inflight === 1, "the write to be in flight");
    b.k.wake();
    await until(() => ws.stopping(), "the loop to take the wake"); // stopping, the write still held
    expect(d2.inflight).toBe(1);
    release();
    expect((await runP).reason).toBe("stopping");
    expect((await pending).result).toBe(512);
    expect(b.k.log.filter((l) => l.cmdOp === UBLK_U_IO_COMMIT_AND_FETCH_REQ).length).toBe(1);
  });

  test("a rejected FETCH ends run() with a UblkError", async () => {
    const { k, q } = fakeQueue(2);
    k.fetchRes = -E.EINVAL;
    const exit = await q.run(new MemDisk(4096), wakeSource());
    expect(exit.reason).toBe("failed");
    expect(exit.error).toBeInstanceOf(UblkError);
    expect(exit.error!.code).toBe("EINVAL");
    expect(exit.error!.message).toContain("queue 2 tag 0");
  });

  test("legacy opcodes without CMD_IOCTL_ENCODE; NEED_GET_DATA two-step writes", async () => {
    const { k, q } = fakeQueue(2, UBLK_F_NEED_GET_DATA);
    k.needGetData = true;
    const disk = new MemDisk(64 * 1024);
    const w = k.submit({ op: UBLK_IO_OP_WRITE, startSector: 4, nrSectors: 2, data: pattern(1024, 7) });
    await q.run(disk, wakeSource());
    expect((await w).result).toBe(1024);
    expect(disk.store.subarray(2048, 3072)).toEqual(pattern(1024, 7));
    const ops = k.log.map((l) => l.cmdOp);
    expect(ops.slice(0, 2)).toEqual([UBLK_IO_FETCH_REQ, UBLK_IO_FETCH_REQ]);
    expect(ops).toContain(0x22); // legacy NEED_GET_DATA, with the tag buffer
    expect(ops).toContain(UBLK_IO_COMMIT_AND_FETCH_REQ);
    const ngd = k.log.find((l) => l.cmdOp === 0x22)!;
    expect(ngd.addr).toBe(k.log.find((l) => l.cmdOp === UBLK_IO_FETCH_REQ && l.tag === ngd.tag)!.addr);
  });

  test("view reuse: repeated request sizes hand DeviceIo the same view object", async () => {
    const { k, q } = fakeQueue(1);
    const seen: Uint8Array[] = [];
    const io: DeviceIo = {
      size: () => 64 * 1024,
      readOnly: false,
      read: async (b) => void seen.push(b),
      write: async () => {},
      flush: async () => {},
      discard: async () => {},
    };
    for (const [s0, n] of [
      [0, 8],
      [1, 8],
      [2, 8],
      [0, 4],
    ]) {
      k.phases.push(() => void k.submit({ op: UBLK_IO_OP_READ, startSector: s0!, nrSectors: n! }));
    }
    await q.run(io, wakeSource());
    expect(seen.length).toBe(4);
    expect(seen[0]).toBe(seen[1]!);
    expect(seen[1]).toBe(seen[2]!);
    expect(seen[0]!.length).toBe(4096);
    expect(seen[3]!.length).toBe(2048);
  });

  test("copy mode only, named errors for bad options; close() releases once", () => {
    const k = new FakeUblkKernel(2);
    expect(() => new UblkQueue({ devId: 0, qId: 0, queueDepth: 2, maxIoBufBytes: 4096, flags: UBLK_F_USER_COPY }, { ring: k, desc: k.desc, charFd: 1 })).toThrow(
      UblkInvalidArgument,
    );
    expect(() => new UblkQueue({ devId: 0, qId: 0, queueDepth: 0, maxIoBufBytes: 4096, flags: 0 }, { ring: k, desc: k.desc, charFd: 1 })).toThrow(/queueDepth/);
    expect(() => new UblkQueue({ devId: 0, qId: 0, queueDepth: 500, maxIoBufBytes: 4096, flags: 0 }, { ring: k, desc: k.desc, charFd: 1 })).toThrow(/desc/);
    let released = 0;
    const q = new UblkQueue({ devId: 0, qId: 0, queueDepth: 2, maxIoBufBytes: 4096, flags: 0 }, { ring: k, desc: k.desc, charFd: 1, release: () => released++ });
    const buf = q.buffer(0);
    expect(buf.length).toBe(4096);
    q.close();
    q.close();
    expect(released).toBe(1);
    expect(k.closed).toBe(true);
    expect(buf.length).toBe(0); // freed memory reads as empty, never as a dangling view
  });

  // Real io_uring, stand-in char fd: /dev/null completes every FETCH/COMMIT at once with res 0 ("a
  // request is ready"), /dev/zero fails each with EOPNOTSUPP. The wake READ is a real eventfd.
  test("real ring: serve, then a real eventfd wake stops the loop", async () => {
    const nullFd = open("/dev/null", O_RDWR | O_CLOEXEC);
    const efd = syscall(SYS_eventfd2, 0, O_CLOEXEC);
    const ring = UringQueueRing.open(4);
    try {
      expect(UBLK_QUEUE_RING_FLAGS).toContain(ring.ring.setupFlags & ~(1 << 3)); // minus CQSIZE
      const desc = new DataView(new ArrayBuffer(4096));
      for (let t = 0; t < 4; t++) encodeUblksrvIoDesc(desc, t, { op: UBLK_IO_OP_FLUSH, nrSectors: 0, startSector: 0 });
      const q = new UblkQueue({ devId: 1, qId: 0, queueDepth: 4, maxIoBufBytes: 4096, flags: UBLK_F_CMD_IOCTL_ENCODE }, { ring, desc, charFd: nullFd });
      queues.push(q);
      let flushes = 0;
      const io: DeviceIo = {
        size: () => 1 << 20,
        readOnly: false,
        read: async () => {},
        write: async () => {},
        flush: async () => {
          if (++flushes === 50) write(efd, new Uint8Array(new BigUint64Array([1n]).buffer));
        },
        discard: async () => {},
      };
      let wakes = 0;
      const exit = await q.run(io, { fd: efd, onWake: async () => void wakes++, stopping: () => wakes > 0 });
      expect(exit.reason).toBe("stopping");
      expect(wakes).toBe(1);
      expect(exit.served).toBeGreaterThanOrEqual(50);
    } finally {
      close(nullFd);
      close(efd);
    }
  });

  test("real ring: rejected FETCHes end run() as failed; a timed idle wait returns", async () => {
    const zeroFd = open("/dev/zero", O_RDWR | O_CLOEXEC);
    try {
      const q = new UblkQueue(
        { devId: 1, qId: 0, queueDepth: 2, maxIoBufBytes: 4096, flags: UBLK_F_CMD_IOCTL_ENCODE },
        { ring: UringQueueRing.open(2), desc: new DataView(new ArrayBuffer(4096)), charFd: zeroFd },
      );
      queues.push(q);
      const exit = await q.run(new MemDisk(4096), wakeSource());
      expect(exit.reason).toBe("failed");
      expect(exit.error).toMatchObject({ name: "UblkError", code: "EOPNOTSUPP" });
    } finally {
      close(zeroFd);
    }
    const r = UringQueueRing.open(2);
    try {
      const t0 = performance.now();
      r.flush(true, 30); // nothing outstanding: EXT_ARG timeout (ETIME) must bring it back
      expect(performance.now() - t0).toBeGreaterThanOrEqual(25);
      expect(r.reap(() => {})).toBe(0);
    } finally {
      r.close();
    }
  });

  test.skipIf(existsSync("/dev/ublkc4000"))("UblkQueue.open on a missing /dev/ublkcN is a SyscallError naming the node (skipped: /dev/ublkc4000 exists)", () => {
    expect(() => UblkQueue.open({ devId: 4000, qId: 0, queueDepth: 2, maxIoBufBytes: 4096, flags: 0 })).toThrow(/\/dev\/ublkc4000/);
  });
});

// ---------------------------------------------------------------------------------------------
// end to end (needs ublk_drv and root)

const ublkReason = !existsSync("/dev/ublk-control")
  ? "/dev/ublk-control does not exist (kernel without ublk_drv / CONFIG_BLK_DEV_UBLK)"
  : process.getuid?.() !== 0
    ? "not root (ADD_DEV needs CAP_SYS_ADMIN)"
    : "";
if (ublkReason) console.log(`ublk e2e skipped: ${ublkReason}`);

test.skipIf(ublkReason !== "")(
  "e2e: a ublk device over an in-memory DeviceIo: write, read /dev/ublkbN, stop, delete",
  async () => {
    const SIZE = 64 << 20;
    const ctrl = new UblkControl();
    let dev: UblkDevice | null = null;
    let worker: Worker | null = null;
    let workerDone: Promise<unknown> = Promise.resolve();
    const wakeFd = syscall(SYS_eventfd2, 0, O_CLOEXEC);
    try {
      const feats = await ctrl.supportedFeatures();
      console.log(`ublk features 0x${feats.features.toString(16)} (probed: ${feats.probed})`);
      dev = await UblkDevice.create(ctrl, { sizeBytes: SIZE, queueDepth: 16, maxIoBufBytes: 256 * 1024 });
      const w = new Worker(new URL("./ublk_e2e_worker.ts", import.meta.url).href);
      worker = w;
      let onReady!: () => void;
      let onFail!: (e: Error) => void;
      const ready = new Promise<void>((res, rej) => ((onReady = res), (onFail = rej)));
      const exited = new Promise<{ reason: string; served: number; error?: string }>((resolve) => {
        w.onmessage = (ev) => {
          if (ev.data.type === "ready") onReady();
          else if (ev.data.type === "exit") resolve(ev.data);
          else if (ev.data.type === "error") onFail(new Error(ev.data.message));
        };
      });
      workerDone = exited;
      w.postMessage({ spec: dev.queueSpec(0), wakeFd, sizeBytes: SIZE });
      await dev.start(ready);

      const fd = await openUblkNode(dev.blockPath, O_RDWR | O_DIRECT | O_CLOEXEC, 30_000);
      const out = allocAligned(1 << 20);
      const back = allocAligned(1 << 20);
      try {
        out.bytes.set(pattern(1 << 20, 11));
        expect(pwrite(fd, out.bytes, 4 << 20)).toBe(1 << 20);
        fsync(fd);
        expect(pread(fd, back.bytes, 4 << 20)).toBe(1 << 20);
        expect(Buffer.compare(back.bytes, out.bytes)).toBe(0);
        expect(pread(fd, back.bytes, 16 << 20)).toBe(1 << 20);
        expect(back.bytes.every((b) => b === 0)).toBe(true);
      } finally {
        close(fd);
        out.free();
        back.free();
      }

      const info = await ctrl.getDevInfo(dev.devId);
      expect(info.state).toBe(UBLK_S_DEV_LIVE);
      await dev.stop();
      const exit = await exited;
      expect(exit.reason).toBe("aborted");
      expect(exit.served).toBeGreaterThan(0);
      await dev.remove();
      dev = null;
    } finally {
      if (dev) {
        write(wakeFd, new Uint8Array(new BigUint64Array([1n]).buffer)); // tell the worker to stop
        await dev.stop().catch(() => {});
        await Promise.race([workerDone, Bun.sleep(10_000)]); // its queue is closed once it says "exit"
        await dev.remove().catch(() => {});
      }
      worker?.terminate();
      close(wakeFd);
      ctrl.close();
    }
  },
  60_000,
);
