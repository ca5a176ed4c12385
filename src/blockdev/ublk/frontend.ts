// One ublk device, tied together: ADD_DEV + SET_PARAMS from a size, the char node, the start order,
// stop/delete, and user recovery. The queue workers themselves are the caller's (they own DeviceIo).
//
// Start order (the driver's, privileged copy mode):
//   1. UblkDevice.create()            ADD_DEV, open /dev/ublkcN, SET_PARAMS
//   2. one Worker per queue           UblkQueue.open(dev.queueSpec(q)); queue.prime()  (FETCH every tag)
//                                     then tell the main thread "ready", then queue.run(io, wake)
//   3. dev.start(allReady)            START_DEV after every worker is ready (the driver waits for every
//                                     tag's FETCH anyway; submitting it last keeps failures attributable)
// Stop order: close every user of /dev/ublkbN → dev.stop() (FETCH/COMMITs end with ABORT, run()
// returns "aborted") → workers queue.close() → dev.remove() (closes /dev/ublkcN, then DEL_DEV).
//
// User recovery (device added with recovery ≠ "none"): in the new process
//   1. UblkDevice.recover(ctrl, id)   state must be QUIESCED or FAIL_IO; START_USER_RECOVERY, retried
//                                     on EBUSY until the dead server's /dev/ublkcN is released
//   2. new queue workers              as in step 2 above (FETCH every tag again)
//   3. dev.start(allReady)            sends END_USER_RECOVERY instead of START_DEV

import { E, O_CLOEXEC, O_RDWR, SyscallError, close as closeFd, open } from "../../../ffi/libc.ts";
import {
  UBLK_ATTR_FUA,
  UBLK_ATTR_READ_ONLY,
  UBLK_ATTR_VOLATILE_CACHE,
  UBLK_F_USER_RECOVERY,
  UBLK_F_USER_RECOVERY_FAIL_IO,
  UBLK_F_USER_RECOVERY_REISSUE,
  UBLK_PARAM_TYPE_BASIC,
  UBLK_PARAM_TYPE_DISCARD,
  UBLK_SECTOR_SHIFT,
  UBLK_S_DEV_FAIL_IO,
  UBLK_S_DEV_QUIESCED,
  UblkError,
  UblkInvalidArgument,
  type UblkParams,
  type UblksrvCtrlDevInfo,
} from "../../../ffi/ublk.ts";
import { UblkControl, ublkBlockPath, ublkCharPath } from "./control.ts";
import type { UblkQueueOptions } from "./queue.ts";

/** What a user-recovery-capable device does with I/O while no server is attached. */
export type UblkRecoveryMode =
  | "none" // server death stops the device
  | "requeue" // USER_RECOVERY: in-flight I/O fails, new I/O waits for the next server
  | "reissue" // + REISSUE: in-flight I/O is resent to the next server (idempotent backends only)
  | "fail-io"; // + FAIL_IO: all I/O fails until recovery

export function ublkRecoveryFlags(mode: UblkRecoveryMode): number {
  switch (mode) {
    case "none":
      return 0;
    case "requeue":
      return UBLK_F_USER_RECOVERY;
    case "reissue":
      return UBLK_F_USER_RECOVERY | UBLK_F_USER_RECOVERY_REISSUE;
    case "fail-io":
      return UBLK_F_USER_RECOVERY | UBLK_F_USER_RECOVERY_FAIL_IO;
    default:
      throw new UblkInvalidArgument("recovery", mode, "must be none, requeue, reissue or fail-io");
  }
}

export interface UblkGeometry {
  /** Device size in bytes; a multiple of logicalBs. */
  sizeBytes: number;
  /** 512 (default) .. 4096. */
  logicalBs?: number;
  /** ≥ logicalBs; default 4096. */
  physicalBs?: number;
  /** Per-request buffer size (dev_info.max_io_buf_bytes, after ADD_DEV rounding). */
  maxIoBufBytes: number;
  readOnly?: boolean;
  /** Advertise DISCARD and WRITE_ZEROES (served by DeviceIo.discard). Default true unless read-only. */
  discard?: boolean;
  /** Discard granularity in bytes; default physicalBs. */
  discardGranularity?: number;
  /** Largest DISCARD / WRITE_ZEROES request, bytes; default 1 GiB. */
  maxDiscardBytes?: number;
  /** The kernel sends FLUSH only with a volatile cache. Default true. */
  volatileCache?: boolean;
  /** Let writes carry FUA (served as write + flush). Default false. */
  fua?: boolean;
}

function log2Exact(field: string, v: number, min: number, max: number): number {
  const s = Math.log2(v);
  if (!Number.isInteger(s) || s < min || s > max) {
    throw new UblkInvalidArgument(field, v, `must be a power of two in ${2 ** min}..${2 ** max}`);
  }
  return s;
}

/** SET_PARAMS contents for a plain disk of the given geometry (sectors always 512 bytes). */
export function ublkParamsFor(g: UblkGeometry): UblkParams {
  const logicalShift = log2Exact("logicalBs", g.logicalBs ?? 512, 9, 12);
  const physicalShift = log2Exact("physicalBs", g.physicalBs ?? 4096, logicalShift, 20);
  if (!(Number.isSafeInteger(g.sizeBytes) && g.sizeBytes > 0 && g.sizeBytes % 2 ** logicalShift === 0)) {
    throw new UblkInvalidArgument("sizeBytes", g.sizeBytes, `must be a positive multiple of ${2 ** logicalShift}`);
  }
  if (!(Number.isInteger(g.maxIoBufBytes) && g.maxIoBufBytes >= 2 ** logicalShift)) {
    throw new UblkInvalidArgument("maxIoBufBytes", g.maxIoBufBytes, "must hold at least one logical block");
  }
  const readOnly = g.readOnly ?? false;
  let attrs = 0;
  if (readOnly) attrs |= UBLK_ATTR_READ_ONLY;
  if (g.volatileCache ?? true) attrs |= UBLK_ATTR_VOLATILE_CACHE;
  if (g.fua) attrs |= UBLK_ATTR_FUA;
  const params: UblkParams = {
    types: UBLK_PARAM_TYPE_BASIC,
    basic: {
      attrs,
      logicalBsShift: logicalShift,
      physicalBsShift: physicalShift,
      ioMinShift: logicalShift,
      ioOptShift: physicalShift,
      maxSectors: Math.floor(g.maxIoBufBytes / 2 ** UBLK_SECTOR_SHIFT),
      chunkSectors: 0,
      devSectors: g.sizeBytes / 2 ** UBLK_SECTOR_SHIFT,
      virtBoundaryMask: 0,
    },
  };
  if (g.discard ?? !readOnly) {
    const gran = g.discardGranularity ?? 2 ** physicalShift;
    log2Exact("discardGranularity", gran, logicalShift, 30);
    const maxBytes = g.maxDiscardBytes ?? 2 ** 30;
    if (!(Number.isInteger(maxBytes) && maxBytes >= gran && maxBytes % 512 === 0 && maxBytes / 512 <= 0xffffffff)) {
      throw new UblkInvalidArgument("maxDiscardBytes", maxBytes, "must be a multiple of 512 ≥ the granularity");
    }
    params.types! |= UBLK_PARAM_TYPE_DISCARD;
    params.discard = {
      discardAlignment: 0,
      discardGranularity: gran,
      maxDiscardSectors: maxBytes / 512,
      maxWriteZeroesSectors: maxBytes / 512,
      maxDiscardSegments: 1,
    };
  }
  return params;
}

export interface UblkDeviceOptions extends Omit<UblkGeometry, "maxIoBufBytes"> {
  /** -1 (default) lets the driver pick. */
  devId?: number;
  nrHwQueues?: number;
  queueDepth?: number;
  /** Default 512 KiB. */
  maxIoBufBytes?: number;
  recovery?: UblkRecoveryMode;
  /** More UBLK_F_* to request (copy mode only: UblkQueue rejects the zero-copy family). */
  flags?: number;
  /** How long to wait for udev/devtmpfs to create /dev/ublkcN, ms. Default 5000. */
  nodeTimeoutMs?: number;
}

/** What a queue worker needs (plain data: postMessage it to the worker). */
export type UblkQueueSpec = Pick<UblkQueueOptions, "devId" | "qId" | "queueDepth" | "maxIoBufBytes" | "flags" | "charFd">;

/** Open a device node, retrying while udev/devtmpfs creates it or fixes its permissions. */
export async function openUblkNode(path: string, flags: number, timeoutMs: number): Promise<number> {
  const deadline = Date.now() + timeoutMs;
  for (;;) {
    try {
      return open(path, flags);
    } catch (e) {
      const retry = e instanceof SyscallError && (e.errno === E.ENOENT || e.errno === E.EACCES || e.errno === E.ENXIO);
      if (!retry || Date.now() >= deadline) throw e;
      await Bun.sleep(10);
    }
  }
}

export class UblkDevice {
  private constructor(
    readonly ctrl: UblkControl,
    /** dev_info as negotiated (dev_id, flags, depth, buffer size). */
    readonly info: UblksrvCtrlDevInfo,
    /** The one open /dev/ublkcN, shared with every queue worker by fd number. */
    public charFd: number,
    /** True between START_USER_RECOVERY and END_USER_RECOVERY. */
    private recovering: boolean,
  ) {}

  get devId(): number {
    return this.info.devId;
  }
  get charPath(): string {
    return ublkCharPath(this.info.devId);
  }
  get blockPath(): string {
    return ublkBlockPath(this.info.devId);
  }

  /** ADD_DEV, open /dev/ublkcN, SET_PARAMS from the size. On failure the device is deleted again. */
  static async create(ctrl: UblkControl, o: UblkDeviceOptions): Promise<UblkDevice> {
    const info = await ctrl.addDev({
      devId: o.devId ?? -1,
      nrHwQueues: o.nrHwQueues ?? 1,
      queueDepth: o.queueDepth ?? 64,
      maxIoBufBytes: o.maxIoBufBytes ?? 512 * 1024,
      flags: (o.flags ?? 0) | ublkRecoveryFlags(o.recovery ?? "none"),
    });
    let charFd = -1;
    try {
      charFd = await openUblkNode(ublkCharPath(info.devId), O_RDWR | O_CLOEXEC, o.nodeTimeoutMs ?? 5000);
      await ctrl.setParams(info.devId, ublkParamsFor({ ...o, maxIoBufBytes: info.maxIoBufBytes }));
      return new UblkDevice(ctrl, info, charFd, false);
    } catch (e) {
      if (charFd >= 0) closeFd(charFd);
      await ctrl.delDev(info.devId).catch(() => {});
      throw e;
    }
  }

  /**
   * Adopt a device whose server died: check it is recoverable, START_USER_RECOVERY (EBUSY until the
   * old /dev/ublkcN is released), then open the char node. Follow with queue workers and start().
   */
  static async recover(ctrl: UblkControl, devId: number, o: { timeoutMs?: number; nodeTimeoutMs?: number } = {}): Promise<UblkDevice> {
    const info = await ctrl.getDevInfo(devId);
    if (info.state !== UBLK_S_DEV_QUIESCED && info.state !== UBLK_S_DEV_FAIL_IO) {
      throw new UblkError("START_USER_RECOVERY", E.EINVAL, devId, `state ${info.state} is not QUIESCED or FAIL_IO`);
    }
    const deadline = Date.now() + (o.timeoutMs ?? 30_000);
    for (;;) {
      try {
        await ctrl.startUserRecovery(devId);
        break;
      } catch (e) {
        if (!(e instanceof UblkError && e.errno === E.EBUSY) || Date.now() >= deadline) throw e;
        await Bun.sleep(100);
      }
    }
    const charFd = await openUblkNode(ublkCharPath(devId), O_RDWR | O_CLOEXEC, o.nodeTimeoutMs ?? 5000);
    return new UblkDevice(ctrl, info, charFd, true);
  }

  /** The options queue worker q passes to UblkQueue.open(). */
  queueSpec(qId: number): UblkQueueSpec {
    if (!(Number.isInteger(qId) && qId >= 0 && qId < this.info.nrHwQueues)) {
      throw new UblkInvalidArgument("qId", qId, `must be below nr_hw_queues ${this.info.nrHwQueues}`);
    }
    return {
      devId: this.info.devId,
      qId,
      queueDepth: this.info.queueDepth,
      maxIoBufBytes: this.info.maxIoBufBytes,
      flags: this.info.flags,
      charFd: this.charFd,
    };
  }

  /** After every queue worker has primed its FETCHes: START_DEV, or END_USER_RECOVERY when recovering. */
  async start(queuesReady: Promise<unknown> = Promise.resolve(), daemonPid: number = process.pid): Promise<void> {
    await queuesReady;
    if (this.recovering) {
      await this.ctrl.endUserRecovery(this.devId, daemonPid);
      this.recovering = false;
    } else {
      await this.ctrl.startDev(this.devId, daemonPid);
    }
  }

  /** STOP_DEV; a device that is already gone (ENODEV) counts as stopped. */
  async stop(): Promise<void> {
    try {
      await this.ctrl.stopDev(this.devId);
    } catch (e) {
      if (!(e instanceof UblkError && e.errno === E.ENODEV)) throw e;
    }
  }

  /**
   * Close /dev/ublkcN (queue rings must be closed already), then DEL_DEV. wait: false sends
   * DEL_DEV_ASYNC (6.9+), which does not wait for the last reference (a dead queue thread's mapping).
   */
  async remove(opts: { wait?: boolean } = {}): Promise<void> {
    if (this.charFd >= 0) {
      closeFd(this.charFd);
      this.charFd = -1;
    }
    try {
      await (opts.wait === false ? this.ctrl.delDevAsync(this.devId) : this.ctrl.delDev(this.devId));
    } catch (e) {
      if (!(e instanceof UblkError && e.errno === E.ENODEV)) throw e;
    }
  }
}
