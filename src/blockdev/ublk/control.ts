// UblkControl: ublk control commands (ADD/SET_PARAMS/START/STOP/DEL/recovery) over /dev/ublk-control,
// one SQE128 io_uring of its own. Commands are async: the driver punts them to io-wq, and START_DEV /
// END_USER_RECOVERY / DEL_DEV complete only after other threads act, so CQEs are polled, never awaited
// in a blocking io_uring_enter that would freeze the event loop.

import { IORING_ENTER_GETEVENTS, IoUring } from "../../../ffi/io_uring.ts";
import { E, O_CLOEXEC, O_RDWR, allocAligned, close as closeFd, open, type AlignedBuffer } from "../../../ffi/libc.ts";
import {
  ENOTSUPP,
  UBLKSRV_CTRL_DEV_INFO_SIZE,
  UBLK_F_CMD_IOCTL_ENCODE,
  UBLK_F_UNPRIVILEGED_DEV,
  UBLK_FEATURES_BASELINE,
  UBLK_FEATURES_LEN,
  UBLK_MAX_IO_BUF_BYTES,
  UBLK_MAX_NR_QUEUES,
  UBLK_MAX_QUEUE_DEPTH,
  UBLK_PARAMS_SIZE,
  UBLK_PARAM_TYPE_BASIC,
  UBLK_PARAM_TYPE_DEVT,
  UBLK_SECTOR_SHIFT,
  UBLK_U_CMD_ADD_DEV,
  UBLK_U_CMD_DEL_DEV,
  UBLK_U_CMD_DEL_DEV_ASYNC,
  UBLK_U_CMD_END_USER_RECOVERY,
  UBLK_U_CMD_GET_DEV_INFO,
  UBLK_U_CMD_GET_DEV_INFO2,
  UBLK_U_CMD_GET_FEATURES,
  UBLK_U_CMD_GET_PARAMS,
  UBLK_U_CMD_GET_QUEUE_AFFINITY,
  UBLK_U_CMD_SET_PARAMS,
  UBLK_U_CMD_START_DEV,
  UBLK_U_CMD_START_USER_RECOVERY,
  UBLK_U_CMD_STOP_DEV,
  UblkError,
  UblkInvalidArgument,
  decodeUblkParams,
  decodeUblksrvCtrlDevInfo,
  encodeUblkCtrlCmdSqe,
  encodeUblkParams,
  encodeUblksrvCtrlDevInfo,
  ublkLegacyOp,
  type UblkParams,
  type UblksrvCtrlDevInfo,
} from "../../../ffi/ublk.ts";

export const UBLK_CONTROL_PATH = "/dev/ublk-control";

/** "/dev/ublkcN": the per-device char node (I/O commands, descriptor mmap). */
export function ublkCharPath(devId: number): string {
  return `/dev/ublkc${devId}`;
}

/** "/dev/ublkbN": the block device START_DEV creates. */
export function ublkBlockPath(devId: number): string {
  return `/dev/ublkb${devId}`;
}

/** What one submitted control command looked like (for tests and debugging). */
export interface UblkControlTrace {
  command: string;
  cmdOp: number;
  /** Copy of the 128-byte SQE as submitted. */
  sqe: Uint8Array;
  /** Copy of the addr buffer as submitted (path prefix included), or null. */
  buf: Uint8Array | null;
}

export interface UblkControlOptions {
  /** Control node; tests point it elsewhere. Default /dev/ublk-control. */
  path?: string;
  /** Ring size = most commands in flight at once. Default 16. */
  entries?: number;
  /** Longest sleep between CQ polls while a command is pending, ms. Default 10. */
  maxPollMs?: number;
  /** Called with a copy of every SQE (and its buffer) just before submission. */
  trace?: (t: UblkControlTrace) => void;
}

export interface AddDevOptions {
  /** -1 (default) lets the driver pick N. */
  devId?: number;
  nrHwQueues: number;
  queueDepth: number;
  /** Per-I/O buffer size; the driver rounds it down to a page and caps it at 32 MiB. */
  maxIoBufBytes: number;
  /** UBLK_F_* requested; UBLK_F_CMD_IOCTL_ENCODE is always added. */
  flags?: number;
  /** Opaque to the kernel (dev_info.ublksrv_flags). */
  ublksrvFlags?: number;
}

/** How the driver takes control opcodes: ioctl-encoded (6.4+), legacy plain numbers, or not yet known. */
export type UblkOpcodeStyle = "unknown" | "ioctl" | "legacy";

interface CmdSpec {
  cmdOp: number;
  devId: number;
  queueId?: number;
  data?: number;
  /** Bytes the kernel reads and/or writes at addr (after any dev path prefix). */
  payload?: number;
  /** Fill the payload before submission. */
  fill?: (dv: DataView, at: number) => void;
  /** Prefix "/dev/ublkcN\0" (unprivileged devices, GET_DEV_INFO2). */
  withPath?: boolean;
  /** Errnos after which the command is simply resubmitted (EINTR for the waiting commands). */
  retry?: number[];
}

interface Waiter {
  done: boolean;
  res: number;
}

const POLL_BACKOFF_MS = [0, 0, 0, 1, 1, 2, 4, 8];
const RETRY_LIMIT = 50;

export class UblkControl {
  readonly fd: number;
  readonly ring: IoUring;
  /** Learned from the first command the driver answers: encoded opcodes or legacy numbers. */
  opcodeStyle: UblkOpcodeStyle = "unknown";

  private readonly maxPollMs: number;
  private readonly trace?: (t: UblkControlTrace) => void;
  private readonly waiters = new Map<number, Waiter>();
  private readonly infos = new Map<number, UblksrvCtrlDevInfo>();
  private readonly unprivileged = new Set<number>();
  private nextSeq = 1;
  private closed = false;

  constructor(opts: UblkControlOptions = {}) {
    const entries = opts.entries ?? 16;
    if (!Number.isInteger(entries) || entries < 1 || entries > 4096) {
      throw new UblkInvalidArgument("control ring entries", entries, "must be 1..4096");
    }
    this.maxPollMs = opts.maxPollMs ?? 10;
    this.trace = opts.trace;
    this.fd = open(opts.path ?? UBLK_CONTROL_PATH, O_RDWR | O_CLOEXEC);
    try {
      // SQE128: ublksrv_ctrl_cmd is 32 bytes, and the driver rejects control commands without it.
      this.ring = new IoUring(entries, { sqe128: true });
    } catch (e) {
      closeFd(this.fd);
      throw e;
    }
  }

  /** True when /dev/ublk-control exists (the driver is loaded); says nothing about permission. */
  static available(path = UBLK_CONTROL_PATH): boolean {
    try {
      closeFd(open(path, O_RDWR | O_CLOEXEC));
      return true;
    } catch {
      return false;
    }
  }

  // --- commands ---------------------------------------------------------------------------------

  /** GET_FEATURES (6.5+): the UBLK_F_* mask this driver supports. Throws UblkError on older drivers. */
  async getFeatures(): Promise<number> {
    let mask = 0;
    await this.command("GET_FEATURES", {
      cmdOp: UBLK_U_CMD_GET_FEATURES,
      devId: -1,
      payload: UBLK_FEATURES_LEN,
      fill: () => {},
    }, (dv, at) => {
      mask = dv.getUint32(at, true) + dv.getUint32(at + 4, true) * 2 ** 32;
    });
    return mask;
  }

  /** GET_FEATURES, or UBLK_FEATURES_BASELINE when the driver predates it (EOPNOTSUPP/EINVAL). */
  async supportedFeatures(): Promise<{ features: number; probed: boolean }> {
    try {
      return { features: await this.getFeatures(), probed: true };
    } catch (e) {
      if (e instanceof UblkError && (e.errno === E.EOPNOTSUPP || e.errno === ENOTSUPP || e.errno === E.EINVAL)) {
        return { features: UBLK_FEATURES_BASELINE, probed: false };
      }
      throw e;
    }
  }

  /** ADD_DEV: returns dev_info as the driver rewrote it (assigned dev_id, negotiated flags, rounded buffer). */
  async addDev(o: AddDevOptions): Promise<UblksrvCtrlDevInfo> {
    const devId = o.devId ?? -1;
    if (devId !== -1 && !(Number.isInteger(devId) && devId >= 0 && devId < 0xffffffff)) {
      throw new UblkInvalidArgument("devId", devId, "must be -1 (auto) or a device number");
    }
    checkRange("nrHwQueues", o.nrHwQueues, 1, UBLK_MAX_NR_QUEUES);
    checkRange("queueDepth", o.queueDepth, 1, UBLK_MAX_QUEUE_DEPTH);
    checkRange("maxIoBufBytes", o.maxIoBufBytes, 4096, UBLK_MAX_IO_BUF_BYTES);
    const flags = (o.flags ?? 0) | UBLK_F_CMD_IOCTL_ENCODE;
    let info: UblksrvCtrlDevInfo | undefined;
    await this.command("ADD_DEV", {
      cmdOp: UBLK_U_CMD_ADD_DEV,
      devId,
      // The driver insists on queue_id 0xFFFF and dev_id == dev_info.dev_id for ADD_DEV.
      queueId: 0xffff,
      payload: UBLKSRV_CTRL_DEV_INFO_SIZE,
      fill: (dv, at) =>
        encodeUblksrvCtrlDevInfo(dv, at, {
          devId,
          nrHwQueues: o.nrHwQueues,
          queueDepth: o.queueDepth,
          maxIoBufBytes: o.maxIoBufBytes,
          flags,
          ublksrvFlags: o.ublksrvFlags ?? 0,
        }),
    }, (dv, at) => {
      info = decodeUblksrvCtrlDevInfo(dv, at);
    });
    const out = info!;
    this.infos.set(out.devId, out);
    if (out.flags & UBLK_F_UNPRIVILEGED_DEV) this.unprivileged.add(out.devId);
    return out;
  }

  /** SET_PARAMS (before START_DEV only). DEVT is read-only and refused here, as the driver would. */
  async setParams(devId: number, params: UblkParams): Promise<void> {
    checkDevId(devId);
    if (params.devt || (params.types ?? 0) & UBLK_PARAM_TYPE_DEVT) {
      throw new UblkInvalidArgument("params.devt", "set", "is read-only (filled by GET_PARAMS)");
    }
    if (!params.basic) throw new UblkInvalidArgument("params.basic", "missing", "BASIC is required by SET_PARAMS");
    if (params.types !== undefined && !(params.types & UBLK_PARAM_TYPE_BASIC)) {
      throw new UblkInvalidArgument("params.types", params.types, "must include UBLK_PARAM_TYPE_BASIC");
    }
    const info = this.infos.get(devId);
    if (info && params.basic.maxSectors > info.maxIoBufBytes >> UBLK_SECTOR_SHIFT) {
      throw new UblkInvalidArgument(
        "params.basic.max_sectors",
        params.basic.maxSectors,
        `exceeds max_io_buf_bytes ${info.maxIoBufBytes} >> 9 of dev ${devId}`,
      );
    }
    await this.command("SET_PARAMS", {
      cmdOp: UBLK_U_CMD_SET_PARAMS,
      devId,
      payload: UBLK_PARAMS_SIZE,
      fill: (dv, at) => encodeUblkParams(dv, at, params),
    });
  }

  /** GET_PARAMS: the params as the driver holds them (DEVT included once known). */
  async getParams(devId: number): Promise<UblkParams & { len: number; types: number }> {
    checkDevId(devId);
    let out: (UblkParams & { len: number; types: number }) | undefined;
    await this.command("GET_PARAMS", {
      cmdOp: UBLK_U_CMD_GET_PARAMS,
      devId,
      payload: UBLK_PARAMS_SIZE,
      // The driver reads params.len first to learn how much the caller can take.
      fill: (dv, at) => dv.setUint32(at, UBLK_PARAMS_SIZE, true),
    }, (dv, at) => {
      out = decodeUblkParams(dv, at);
    });
    return out!;
  }

  /** GET_DEV_INFO. */
  async getDevInfo(devId: number): Promise<UblksrvCtrlDevInfo> {
    checkDevId(devId);
    let info: UblksrvCtrlDevInfo | undefined;
    await this.command("GET_DEV_INFO", {
      cmdOp: UBLK_U_CMD_GET_DEV_INFO,
      devId,
      payload: UBLKSRV_CTRL_DEV_INFO_SIZE,
      fill: () => {},
    }, (dv, at) => {
      info = decodeUblksrvCtrlDevInfo(dv, at);
    });
    this.infos.set(devId, info!);
    return info!;
  }

  /** GET_DEV_INFO2 (6.3+): like GET_DEV_INFO, with the char-dev path checked by the driver. */
  async getDevInfo2(devId: number): Promise<UblksrvCtrlDevInfo> {
    checkDevId(devId);
    let info: UblksrvCtrlDevInfo | undefined;
    await this.command("GET_DEV_INFO2", {
      cmdOp: UBLK_U_CMD_GET_DEV_INFO2,
      devId,
      payload: UBLKSRV_CTRL_DEV_INFO_SIZE,
      withPath: true,
      fill: () => {},
    }, (dv, at) => {
      info = decodeUblksrvCtrlDevInfo(dv, at);
    });
    this.infos.set(devId, info!);
    return info!;
  }

  /** GET_QUEUE_AFFINITY: the CPUs the driver maps queue qId to (for pinning its worker). */
  async getQueueAffinity(devId: number, qId: number): Promise<number[]> {
    checkDevId(devId);
    checkRange("qId", qId, 0, UBLK_MAX_NR_QUEUES - 1);
    const MASK_BYTES = 512; // 4096 CPUs; the driver wants ≥ nr_cpu_ids/8 and a multiple of 8
    const cpus: number[] = [];
    await this.command("GET_QUEUE_AFFINITY", {
      cmdOp: UBLK_U_CMD_GET_QUEUE_AFFINITY,
      devId,
      data: qId,
      payload: MASK_BYTES,
      fill: () => {},
    }, (dv, at) => {
      for (let i = 0; i < MASK_BYTES; i++) {
        const b = dv.getUint8(at + i);
        for (let bit = 0; b && bit < 8; bit++) if (b & (1 << bit)) cpus.push(i * 8 + bit);
      }
    });
    return cpus;
  }

  /** START_DEV: completes once every queue has FETCHed every tag; creates /dev/ublkbN. */
  async startDev(devId: number, daemonPid: number = process.pid): Promise<void> {
    checkDevId(devId);
    checkRange("daemonPid", daemonPid, 1, 2 ** 31 - 1);
    await this.command("START_DEV", { cmdOp: UBLK_U_CMD_START_DEV, devId, data: daemonPid, retry: [E.EINTR] });
  }

  /** STOP_DEV: removes /dev/ublkbN; every pending FETCH/COMMIT completes with UBLK_IO_RES_ABORT. */
  async stopDev(devId: number): Promise<void> {
    checkDevId(devId);
    await this.command("STOP_DEV", { cmdOp: UBLK_U_CMD_STOP_DEV, devId });
  }

  /** DEL_DEV: waits until the device is fully released (close /dev/ublkcN and the queue rings first). */
  async delDev(devId: number): Promise<void> {
    checkDevId(devId);
    await this.command("DEL_DEV", { cmdOp: UBLK_U_CMD_DEL_DEV, devId, retry: [E.EINTR] });
    this.forget(devId);
  }

  /** DEL_DEV_ASYNC (6.9+): delete without waiting for the last reference. */
  async delDevAsync(devId: number): Promise<void> {
    checkDevId(devId);
    await this.command("DEL_DEV_ASYNC", { cmdOp: UBLK_U_CMD_DEL_DEV_ASYNC, devId });
    this.forget(devId);
  }

  /** START_USER_RECOVERY: EBUSY until the old server's /dev/ublkcN is released (callers retry). */
  async startUserRecovery(devId: number): Promise<void> {
    checkDevId(devId);
    await this.command("START_USER_RECOVERY", { cmdOp: UBLK_U_CMD_START_USER_RECOVERY, devId });
  }

  /** END_USER_RECOVERY: completes once every queue of the new server has FETCHed every tag. */
  async endUserRecovery(devId: number, daemonPid: number = process.pid): Promise<void> {
    checkDevId(devId);
    checkRange("daemonPid", daemonPid, 1, 2 ** 31 - 1);
    await this.command("END_USER_RECOVERY", { cmdOp: UBLK_U_CMD_END_USER_RECOVERY, devId, data: daemonPid, retry: [E.EINTR] });
  }

  /** Mark a device as unprivileged (its commands carry the char path), e.g. one adopted after a restart. */
  markUnprivileged(devId: number): void {
    checkDevId(devId);
    this.unprivileged.add(devId);
  }

  /** Close the ring and the control fd. Pending commands reject; their buffers are leaked on purpose. */
  close(): void {
    if (this.closed) return;
    this.closed = true;
    this.ring.close();
    closeFd(this.fd);
  }

  // --- machinery --------------------------------------------------------------------------------

  private forget(devId: number): void {
    this.infos.delete(devId);
    this.unprivileged.delete(devId);
  }

  /** Run one control command: encode through the pure encoders, submit, await the CQE, map res. */
  private async command(name: string, spec: CmdSpec, read?: (dv: DataView, at: number) => void): Promise<void> {
    if (this.closed) throw new Error(`ublk ${name}: control is closed`);
    // Unprivileged devices name their char node in every command but ADD_DEV (the driver checks it).
    const withPath = spec.withPath || (spec.cmdOp !== UBLK_U_CMD_ADD_DEV && spec.devId >= 0 && this.unprivileged.has(spec.devId));
    const path = withPath ? Buffer.from(ublkCharPath(spec.devId) + "\0", "utf8") : null;
    const pathLen = path ? path.length : 0;
    const payload = spec.payload ?? 0;
    const total = pathLen + payload;
    if (total > 0xffff) throw new UblkInvalidArgument(`${name} buffer`, total, "exceeds the u16 len field");
    // The driver reads and writes this buffer from an io-wq worker after submit returns: own it.
    const buf: AlignedBuffer | null = total > 0 ? allocAligned(total) : null;
    try {
      if (buf) {
        if (path) buf.bytes.set(path, 0);
        spec.fill?.(new DataView(buf.bytes.buffer), pathLen);
      }
      let cmdOp = this.opcodeStyle === "legacy" ? legacyOrSame(spec.cmdOp) : spec.cmdOp;
      for (let attempt = 0; ; attempt++) {
        const res = await this.submitOne(name, spec, cmdOp, buf, pathLen);
        if (res >= 0) {
          if (this.opcodeStyle === "unknown") this.opcodeStyle = cmdOp === spec.cmdOp ? "ioctl" : "legacy";
          if (buf && read) read(new DataView(buf.bytes.buffer), pathLen);
          return;
        }
        const err = -res;
        // Drivers without CMD_IOCTL_ENCODE (6.0–6.3) reject encoded opcodes; try the legacy number once.
        const legacy = ublkLegacyOp(cmdOp);
        if (this.opcodeStyle === "unknown" && cmdOp === spec.cmdOp && legacy >= 0 && (err === E.EOPNOTSUPP || err === ENOTSUPP)) {
          cmdOp = legacy;
          continue;
        }
        if (spec.retry?.includes(err) && attempt < RETRY_LIMIT) continue;
        throw new UblkError(name, err, spec.devId);
      }
    } finally {
      if (buf && !this.closed) buf.free();
    }
  }

  private async submitOne(name: string, spec: CmdSpec, cmdOp: number, buf: AlignedBuffer | null, pathLen: number): Promise<number> {
    while (this.waiters.size >= this.ring.sqEntries) await Bun.sleep(1);
    if (this.closed) throw new Error(`ublk ${name}: control is closed`);
    const seq = this.nextSeq++;
    const at = this.ring.getSqe();
    encodeUblkCtrlCmdSqe(this.ring.sqes, at, this.fd, cmdOp, {
      devId: spec.devId,
      queueId: spec.queueId ?? 0xffff,
      len: buf ? buf.length : 0,
      addr: buf ? buf.ptr : 0,
      data: spec.data ?? 0,
      devPathLen: pathLen,
    }, seq);
    if (this.trace) {
      const sqe = new Uint8Array(this.ring.sqes.buffer, this.ring.sqes.byteOffset + at, this.ring.sqeSize).slice();
      this.trace({ command: name, cmdOp, sqe, buf: buf ? buf.bytes.slice() : null });
    }
    const w: Waiter = { done: false, res: 0 };
    this.waiters.set(seq, w);
    try {
      this.ring.submit();
    } catch (e) {
      this.waiters.delete(seq);
      throw e;
    }
    await this.pollUntil(w);
    return w.res;
  }

  private readonly onCqe = (userData: number, res: number): void => {
    const w = this.waiters.get(userData);
    if (!w) return;
    this.waiters.delete(userData);
    w.done = true;
    w.res = res;
  };

  /** Reap CQEs (for every waiter) until w is done, sleeping with backoff in between. */
  private async pollUntil(w: Waiter): Promise<void> {
    let idle = 0;
    for (;;) {
      if (this.closed) {
        for (const x of this.waiters.values()) {
          x.done = true;
          x.res = -E.ECANCELED;
        }
        this.waiters.clear();
      }
      if (w.done) return;
      if (this.ring.reap(this.onCqe) === 0) {
        // io-wq posts most CQEs directly, but a GETEVENTS enter also runs any task work queued to us.
        this.ring.enter(0, 0, IORING_ENTER_GETEVENTS);
        this.ring.reap(this.onCqe);
      }
      if (w.done) return;
      const ms = Math.min(POLL_BACKOFF_MS[Math.min(idle++, POLL_BACKOFF_MS.length - 1)]!, this.maxPollMs);
      await Bun.sleep(ms);
    }
  }
}

function legacyOrSame(cmdOp: number): number {
  const l = ublkLegacyOp(cmdOp);
  return l >= 0 ? l : cmdOp;
}

function checkDevId(devId: number): void {
  if (!(Number.isInteger(devId) && devId >= 0 && devId < 0xffffffff)) {
    throw new UblkInvalidArgument("devId", devId, "must be a device number ≥ 0");
  }
}

function checkRange(field: string, v: number, min: number, max: number): void {
  if (!(Number.isInteger(v) && v >= min && v <= max)) throw new UblkInvalidArgument(field, v, `must be an integer in ${min}..${max}`);
}
