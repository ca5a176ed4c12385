// The devices blockd serves, and what every part of it shares about them: the devices by id (the
// table on disk is written from them), the ids with an operation in flight, the names calls are
// setting up, and the making, ending and death of one device. The parts (pool.ts, prepared.ts,
// lender.ts, recovery.ts, traces.ts, server.ts) are given this one set.

import { rm, writeFile } from "node:fs/promises";
import { join } from "node:path";
import { umount2, MNT_DETACH, SyscallError } from "../../ffi/libc.ts";
import { loopAttach, loopDetach } from "../../ffi/loop.ts";
import type { ImageConfig } from "../storage/image_config.ts";
import { Image } from "../storage/image.ts";
import { IoLimiter } from "../storage/io_limiter.ts";
import { DeviceHandle } from "./device.ts";
import { type DeviceRecord, TableWriter, fuseDevicePath } from "./device_table.ts";
import type { KeeperClient } from "./keeper_client.ts";
import { BlockdError } from "./protocol.ts";
import { UblkControl } from "./ublk/control.ts";
import { UblkDevice } from "./ublk/frontend.ts";

export interface Device {
  rec: DeviceRecord;
  handle: DeviceHandle;
  ublk?: UblkDevice;
  /** Pool devices: when it was last released (a count), so acquire hands out the latest first. */
  releasedAt?: number;
  /** Pool devices: when it last became plain idle (ms), for the surplus trim. */
  idleSince?: number;
  /** A prepared pool device: the key of the stack it holds (stackKey), ready for acquire. */
  prepared?: string;
  /** A prepared device just acquired: until its table entry is written and its crumb removed. */
  committing?: Promise<void>;
  /** The recording traceStart began last on it: a traceStop naming another is refused (its id was given back and reused since). */
  recording?: number;
}

export type DeviceView = ReturnType<DeviceSet["view"]>;

export class DeviceSet {
  readonly byId = new Map<string, Device>();
  readonly busy = new Set<string>(); // ids with an operation in flight
  private claims = new Set<string>(); // see claim()
  private serial = 0;
  /** Set by shutdown: nothing new is started (pool fills, refills, a dead idle device's replacement). */
  closing = false;
  /** The fd keeper, reached once at start (Blockd.start) before any device is. */
  keeper!: KeeperClient;
  private readonly table: TableWriter;
  private readonly remoteIo: IoLimiter;
  private ublkCtrl: UblkControl | undefined;

  /**
   * idleGone: an idle pool device whose worker died has been ended and dropped from the set; the
   * pool and the prepared targets make up for it.
   */
  constructor(
    readonly stateDir: string,
    readonly frontend: "fuse" | "ublk",
    remoteIo: number,
    private readonly idleGone: (gone: Device) => void,
  ) {
    this.table = new TableWriter(join(stateDir, "devices.json"), () => [...this.byId.values()].map((d) => d.rec));
    this.remoteIo = IoLimiter.create(remoteIo);
  }

  get tablePath(): string {
    return this.table.path;
  }
  devPath(id: string): string {
    return fuseDevicePath(this.stateDir, id);
  }
  /** A prepared device's own folder: its fresh upper (`upper/`), then the crumb of its acquire. */
  preparedDir(id: string): string {
    return join(this.stateDir, "prepared", id);
  }

  newId(prefix: string): string {
    return `${prefix}-${++this.serial}`;
  }
  /** An id the table names (recovery): newId numbers past it. */
  noteId(id: string): void {
    const n = Number(/-(\d+)$/.exec(id)?.[1] ?? 0);
    if (Number.isSafeInteger(n) && n > this.serial) this.serial = n;
  }

  /** The table as it is now, on disk (TableWriter: atomic, off the event loop, bursts coalesced). */
  saveTable(): Promise<void> {
    return this.table.save();
  }

  /**
   * An acquire committed by its crumb is recorded in the table once its reply has gone out
   * (setImmediate runs after the microtasks that send it), then its folder goes; release and
   * remove wait for that.
   */
  commitLater(dev: Device): void {
    const id = dev.rec.id;
    const committing = afterReply()
      .then(() => this.saveTable())
      .then(() => rm(this.preparedDir(id), { recursive: true, force: true }))
      .catch((e) => console.error(`blockd: recording the acquire of ${id}: ${(e as Error).message}; its crumb stays`))
      .finally(() => {
        if (dev.committing === committing) dev.committing = undefined;
      });
    dev.committing = committing;
  }

  /** Hear of the worker's death once its device is in the table (register() covers the time before). */
  private watch(id: string, handle: DeviceHandle): void {
    handle.onDeath = (failure) => {
      const d = this.byId.get(id);
      if (d?.handle === handle) void this.workerDied(d, failure);
    };
  }

  /** Put a device in the table; one whose worker died before this is handled as dead now. */
  register(dev: Device): void {
    this.byId.set(dev.rec.id, dev);
    if (dev.handle.failure && dev.rec.state !== "failed") void this.workerDied(dev, dev.handle.failure);
  }

  /**
   * A device whose worker died is failed; the other devices keep serving. Its connection is ended
   * (FUSE: every fd of it closed; ublk: STOP_DEV), so what has it open gets errors instead of
   * waiting for a server that is gone. An idle pool device is replaced instead.
   */
  private async workerDied(d: Device, failure: BlockdError): Promise<void> {
    console.error(`blockd: ${failure.message}; device ${d.rec.id} is failed until deleted`);
    d.rec.state = "failed";
    d.rec.reason = failure.message;
    try {
      // FUSE: the worker's own fds are closed by its handle once its thread has ended (FdLedger).
      if (d.ublk) await d.ublk.stop();
      else await this.keeper.drop(d.rec.id);
    } catch (e) {
      console.error(`blockd: ending ${d.rec.id}'s connection: ${(e as Error).message}`);
    }
    if (this.closing) return;
    if (d.rec.kind === "pool" && !d.rec.acquired && !this.busy.has(d.rec.id)) {
      await this.exclusive(d.rec.id, () => this.teardown(d)).catch((e) => console.error(`blockd: retiring ${d.rec.id}: ${e.message}`));
      this.byId.delete(d.rec.id);
      if (d.prepared) await rm(this.preparedDir(d.rec.id), { recursive: true, force: true }).catch(() => {});
      this.idleGone(d);
    }
    await this.saveTable().catch((e) => console.error(`blockd: saving the device table: ${e.message}`));
  }

  /**
   * A ublk device: ADD_DEV + SET_PARAMS here, the queue worker FETCHes, then START_DEV. After a
   * crash (recover), the kernel kept the device: START/END_USER_RECOVERY re-attach a new worker.
   */
  async startUblk(rec: DeviceRecord, recover = false): Promise<{ handle: DeviceHandle; ublk: UblkDevice; replaced: boolean }> {
    this.ublkCtrl ??= new UblkControl();
    let ublk: UblkDevice | undefined;
    let replaced = false; // an old device was there and could not be recovered
    if (recover && rec.ublkId !== undefined) {
      try {
        ublk = await UblkDevice.recover(this.ublkCtrl, rec.ublkId);
      } catch (e) {
        console.error(`blockd: ublk ${rec.ublkId} not recoverable (${(e as Error).message}); adding it anew`);
        replaced = await endStaleUblk(this.ublkCtrl, rec.ublkId);
      }
    }
    // "reissue": I/O in flight when a blockd dies is sent again to the next one (writes are idempotent).
    ublk ??= await UblkDevice.create(this.ublkCtrl, { sizeBytes: rec.size!, readOnly: rec.readOnly, recovery: "reissue" });
    rec.ublkId = ublk.devId;
    rec.path = ublk.blockPath;
    try {
      const handle = await DeviceHandle.start({
        id: rec.id,
        frontend: "ublk",
        ublk: ublk.queueSpec(0),
        path: rec.path,
        readOnly: rec.readOnly,
        config: rec.config,
        remoteIo: this.remoteIo.shared,
      });
      this.watch(rec.id, handle);
      await ublk.start();
      return { handle, ublk, replaced };
    } catch (e) {
      await ublk.stop().catch(() => {});
      await ublk.remove().catch(() => {});
      throw e;
    }
  }

  /** adopt: the fds the keeper kept of a live connection (its own, then its reader's clone). */
  async startWorker(rec: DeviceRecord, adopt?: number[]): Promise<DeviceHandle> {
    if (adopt === undefined) await writeFile(rec.path, "", { flag: "a" }); // the mount point: made if missing, kept if there
    const handle = await DeviceHandle.start({
      id: rec.id,
      frontend: "fuse",
      path: rec.path,
      readOnly: rec.readOnly,
      config: rec.config,
      adoptFd: adopt?.[0],
      adoptCloneFd: adopt?.[1],
      remoteIo: this.remoteIo.shared,
    });
    this.watch(rec.id, handle);
    try {
      await this.keeper.hold(rec.id, handle.fuseFds); // the connection now outlives us
    } catch (e) {
      await handle.stop().catch(() => {});
      throw e;
    }
    return handle;
  }

  async addDevice(rec: DeviceRecord, loop: boolean): Promise<DeviceRecord> {
    if (this.frontend === "ublk" && rec.kind !== "pool") {
      rec.frontend = "ublk";
      rec.size ??= await imageSize(rec.config!);
      const { handle, ublk } = await this.startUblk(rec);
      this.register({ rec, handle, ublk });
      await this.saveTable();
      return rec; // already a block device: no loop needed
    }
    rec.frontend = "fuse";
    let handle: DeviceHandle;
    try {
      handle = await this.startWorker(rec);
    } catch (e) {
      // A new device's mount (a worker that mounted, then failed or missed its start bound) and
      // file: a failed start leaves nothing.
      try {
        unmountDead(rec.path);
      } catch (u) {
        console.error(`blockd: unmounting ${rec.path} after a failed start: ${(u as Error).message}`);
      }
      await rm(rec.path, { force: true }).catch(() => {});
      throw e;
    }
    this.register({ rec, handle });
    try {
      if (loop) rec.loop = loopAttach(rec.path, { readOnly: rec.readOnly }).path;
    } catch (e) {
      await this.keeper.drop(rec.id);
      await handle.stop();
      this.byId.delete(rec.id);
      throw e;
    }
    await this.saveTable();
    return rec;
  }

  device(id: unknown): Device {
    if (typeof id !== "string") throw new BlockdError("BadRequest", `"id" must be a string`);
    const d = this.byId.get(id);
    if (!d) throw new BlockdError("NotFound", `no device ${id}`);
    return d;
  }

  /** One operation per device at a time; a second one is told the device is busy. */
  async exclusive<T>(id: string, fn: () => Promise<T>): Promise<T> {
    if (this.busy.has(id)) throw new BlockdError("Busy", `device ${id} has an operation in flight`);
    this.busy.add(id);
    try {
      return await fn();
    } finally {
      this.busy.delete(id);
    }
  }

  view(rec: DeviceRecord, size?: number) {
    return {
      id: rec.id,
      kind: rec.kind,
      path: rec.path,
      loop: rec.loop ?? null,
      readOnly: rec.readOnly,
      refs: rec.refs,
      size,
      config: rec.config,
      /** "live", or "lost" / "failed" with the reason (DeviceRecord.state). */
      state: rec.state ?? "live",
      reason: rec.reason ?? null,
      /** A pool device handed out by acquire (until release). */
      acquired: rec.acquired ?? false,
    };
  }

  /**
   * Claim names a call is setting up (a device id, an upper's data file) before its first await,
   * so a racing call is told Exists instead of building the same thing twice. Returns the unclaim.
   */
  private claim(key: string, taken: () => boolean, what: string): () => void {
    if (this.claims.has(key) || taken()) throw new BlockdError("Exists", what);
    this.claims.add(key);
    return () => this.claims.delete(key);
  }
  claimId(id: string): () => void {
    return this.claim(`dev:${id}`, () => this.byId.has(id), `device ${id} exists`);
  }
  /** Two devices over one upper would corrupt it. */
  claimUpper(data: string): () => void {
    const used = () => [...this.byId.values()].some((d) => d.rec.config?.upper?.data === data);
    return this.claim(`upper:${data}`, used, `${data} is the upper of another device`);
  }

  async teardown(d: Device): Promise<void> {
    if (d.ublk) {
      await d.handle.stop();
      await d.ublk.stop();
      await d.ublk.remove({ wait: !d.handle.failure }); // a dead queue thread may still map the device
      return;
    }
    await this.keeper.drop(d.rec.id);
    if (d.rec.loop) {
      try {
        loopDetach(d.rec.loop);
      } catch {}
    }
    await d.handle.stop();
    if (d.handle.failure) unmountDead(d.rec.path); // no worker was left to unmount it
    await rm(d.rec.path, { force: true });
  }

  /** Flush and stop every device at shutdown; the table stays, so a later start brings them back. */
  async stopAll(): Promise<void> {
    for (const d of this.byId.values()) {
      try {
        if (d.rec.loop) loopDetach(d.rec.loop);
      } catch {}
      try {
        if (d.ublk) {
          await d.handle.stop();
          await d.ublk.stop();
          await d.ublk.remove({ wait: !d.handle.failure });
          continue;
        }
        await this.keeper.drop(d.rec.id);
        await d.handle.stop();
        if (d.handle.failure) unmountDead(d.rec.path);
      } catch (e) {
        console.error(`blockd: stopping ${d.rec.id}: ${(e as Error).message}`);
      }
    }
    await this.keeper.exitIfEmpty();
    await this.table.idle(); // a table write under way lands before the process ends
  }
}

/** After the current macrotask's microtasks (a reply being sent among them). */
export function afterReply(): Promise<void> {
  return new Promise((r) => setImmediate(r));
}

/** The virtual size a config's stack has (ublk sets the device size before a worker opens it). */
async function imageSize(config: ImageConfig): Promise<number> {
  const image = await Image.open(config);
  try {
    return image.virtualSize;
  } finally {
    await image.close();
  }
}

/** Unmount a device whose worker is gone (its mount is dead); one not mounted is fine. */
function unmountDead(path: string): void {
  try {
    umount2(path, MNT_DETACH);
  } catch (e) {
    if (!(e instanceof SyscallError && (e.code === "EINVAL" || e.code === "ENOENT"))) throw e;
  }
}

/**
 * After a failed recovery, what is left of the old ublk device: STOP_DEV fails the I/O waiting on
 * it (with "reissue" it would wait for a server forever), then it is deleted. True when there was
 * one; a device that a live process serves is someone else's and is left alone.
 */
async function endStaleUblk(ctrl: UblkControl, devId: number): Promise<boolean> {
  let info;
  try {
    info = await ctrl.getDevInfo(devId);
  } catch {
    return false; // gone: blockd stopped it cleanly, or the host rebooted
  }
  if (info.ublksrvPid > 0 && info.ublksrvPid !== process.pid && processAlive(info.ublksrvPid)) return false;
  try {
    await ctrl.stopDev(devId);
    await ctrl.delDevAsync(devId);
  } catch (e) {
    console.error(`blockd: ending stale ublk ${devId}: ${(e as Error).message}`);
  }
  return true;
}

function processAlive(pid: number): boolean {
  try {
    process.kill(pid, 0);
    return true;
  } catch (e) {
    return (e as { code?: string }).code === "EPERM";
  }
}
