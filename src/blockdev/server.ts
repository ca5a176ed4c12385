// blockd: the one long-lived process that owns every block device on a node. It keeps a device
// table on disk, runs one worker per device, and answers the node's RPCs on a unix socket.

import { existsSync, mkdirSync, readFileSync, readdirSync, readlinkSync, renameSync, rmSync, symlinkSync, writeFileSync } from "node:fs";
import { mkdir, open, rename, rm, stat, symlink, writeFile } from "node:fs/promises";
import { dirname, isAbsolute, join, resolve } from "node:path";
import type { Socket } from "bun";
import { umount2, MNT_DETACH, SyscallError } from "../../ffi/libc.ts";
import { loopAttach, loopDetach } from "../../ffi/loop.ts";
import { type ImageConfig, type LayerRef, parseImageConfig, resolveLayerPath } from "../storage/image_config.ts";
import type { MemorySource } from "./memory_layer.ts";
import { MemoryWriter } from "./memory_writer.ts";
import { WRITABLE_DATA, WRITABLE_INDEX, WritableLayer } from "../storage/lsmt/writable_layer.ts";
import { DeviceHandle } from "./device.ts";
import { ID_RE, TableWriter, fuseDevicePath, loadDeviceTable } from "./device_table.ts";
import { detachLoop, isMountPoint, loopBackingFile, loopsBackedBy } from "./leftovers.ts";
import { lockState } from "./state_lock.ts";
import { KeeperClient } from "./keeper_client.ts";
import { IoLimiter } from "../storage/io_limiter.ts";
import { Image } from "../storage/image.ts";
import { UblkControl } from "./ublk/control.ts";
import { UblkDevice } from "./ublk/frontend.ts";
import { TRACE_MAX_ENTRIES, TRACE_MAX_FILE, TraceError, checkGranule, decodeTrace, encodeTrace } from "../storage/trace_file.ts";
import { TRACE_DEFAULT_MS, TRACE_GRANULE, TRACE_MAX_MS } from "./trace.ts";
import { BlockdError, FrameReader, FrameWriter, PROTOCOL_VERSION, encodeFrame, errorOf, type Reply, type Request } from "./protocol.ts";


export interface BlockdOptions {
  stateDir: string;
  /** Ready devices kept for acquire (0 = none). */
  pool?: number;
  /** Remote-layer reads in flight across all devices (default 32). */
  remoteIo?: number;
  /** "auto" (default): ublk when /dev/ublk-control exists, FUSE otherwise. */
  frontend?: "auto" | "fuse" | "ublk";
}

/** What the table on disk keeps of a device: enough to bring it back after a crash. */
export interface DeviceRecord {
  id: string;
  kind: "rw" | "ro" | "pool";
  path: string;
  config: ImageConfig | null;
  readOnly: boolean;
  refs: number;
  /** Key of a shared read-only device (its lowers). */
  key?: string;
  loop?: string;
  /** Pool devices: true while handed out by acquire. */
  acquired?: boolean;
  frontend?: "fuse" | "ublk";
  /** ublk device id (the device is /dev/ublkb<id>). */
  ublkId?: number;
  /** Device size in bytes (ublk needs it before the image is open). */
  size?: number;
  /**
   * Absent while the device serves as it always has. "lost": it serves again, but its connection
   * died once (blockd and the fd keeper both gone, or its worker), so what had it open got errors.
   * "failed": it does not serve (its worker died, or it could not be brought back). Both stay
   * until the device is deleted; `reason` says what happened.
   */
  state?: "lost" | "failed";
  reason?: string;
}

interface Device {
  rec: DeviceRecord;
  handle: DeviceHandle;
  ublk?: UblkDevice;
  /** Pool devices: when it was last released (a count), so acquire hands out the latest first. */
  releasedAt?: number;
  /** A prepared pool device: the key of the stack it holds (stackKey), ready for acquire. */
  prepared?: string;
  /** A prepared device just acquired: until its table entry is written and its crumb removed. */
  committing?: Promise<void>;
  /** The recording traceStart began last on it: a traceStop naming another is refused (its id was given back and reused since). */
  recording?: number;
}

/** What `prepare` keeps ready: `count` pool devices with this stack's lowers open and a fresh upper of `size`. */
interface PrepareTarget {
  lowers: LayerRef[];
  size: number;
  count: number;
  /** Acquires of this stack the target still serves (a fork's children); each takes one, and at 0 the target ends. None: it stays. */
  acquires?: number;
  /** The last refill of this target that failed, and why: it is not retried for PREPARE_RETRY_MS. */
  failedAt?: number;
  error?: Error;
}

export class Blockd {
  private devices = new Map<string, Device>();
  private serial = 0;
  private busy = new Set<string>(); // ids with an operation in flight
  private claims = new Set<string>(); // see claim()
  private roMaking = new Map<string, Promise<DeviceRecord>>(); // read-only devices being made, by key
  private releases = 0;
  /** traceStart's numbers: from the clock, so a number from before a blockd restart is not handed out again. */
  private recordings = Date.now();
  private filling: Promise<void> | undefined;
  private targets = new Map<string, PrepareTarget>(); // prepare's, by stackKey
  private refilling: Promise<void> | undefined;
  private refillQueued: Promise<void> | undefined;
  private running = new Set<Promise<unknown>>(); // RPCs under way, which shutdown lets finish
  private server: ReturnType<typeof Bun.listen> | undefined;
  private closing = false;
  private keeper!: KeeperClient;
  private remoteIo: IoLimiter;
  readonly socketPath: string;
  readonly frontend: "fuse" | "ublk";
  private ublkCtrl: UblkControl | undefined;
  private readonly table: TableWriter;
  private readonly memoryWriter = new MemoryWriter();

  private constructor(readonly opts: BlockdOptions) {
    this.socketPath = join(opts.stateDir, "blockd.sock");
    this.table = new TableWriter(join(opts.stateDir, "devices.json"), () => [...this.devices.values()].map((d) => d.rec));
    this.remoteIo = IoLimiter.create(opts.remoteIo ?? 32);
    // AENV_BLOCKD_FRONTEND: one of blockd's own settings (BlockdSettings in client.ts).
    const want = opts.frontend ?? process.env.AENV_BLOCKD_FRONTEND ?? "auto";
    if (want !== "auto" && want !== "fuse" && want !== "ublk") throw new Error(`AENV_BLOCKD_FRONTEND=${want}: expected auto, fuse or ublk`);
    this.frontend = want === "auto" ? (UblkControl.available() ? "ublk" : "fuse") : want;
  }

  private get tablePath(): string {
    return this.table.path;
  }
  private devPath(id: string): string {
    return fuseDevicePath(this.opts.stateDir, id);
  }
  /** The warm-up's sealed stack (base, top), once made. */
  private warmUpLayers: Promise<string[]> | undefined;
  /** Pool workers' warm-up scratch. */
  private get warmUpDir(): string {
    return join(this.opts.stateDir, "warm-up");
  }
  /** A prepared device's own folder: its fresh upper (`upper/`), then the crumb of its acquire. */
  private preparedDir(id: string): string {
    return join(this.opts.stateDir, "prepared", id);
  }

  /** Start: re-export every device in the table, fill the pool, listen. */
  static async start(opts: BlockdOptions): Promise<Blockd> {
    const b = new Blockd({ ...opts, stateDir: resolve(opts.stateDir) });
    mkdirSync(join(b.opts.stateDir, "dev"), { recursive: true });
    mkdirSync(join(b.opts.stateDir, "prepared"), { recursive: true });
    lockState(b.opts.stateDir); // held (its fd open) until this process ends; before the keeper, which only we start
    // Scratch of pool devices' warm-up: what a blockd that died left is nobody's.
    rmSync(b.warmUpDir, { recursive: true, force: true });
    mkdirSync(b.warmUpDir, { recursive: true });
    b.keeper = await KeeperClient.ensure(b.opts.stateDir);
    try {
      await b.recover();
      await b.fillPool();
      b.listen();
      writeFileSync(join(b.opts.stateDir, "blockd.pid"), String(process.pid));
    } catch (e) {
      await b.keeper.exitIfEmpty().catch(() => {}); // a keeper holding nothing must not outlive a failed start
      throw e;
    }
    return b;
  }

  /** The table as it is now, on disk (TableWriter: atomic, off the event loop, bursts coalesced). */
  private saveTable(): Promise<void> {
    return this.table.save();
  }

  /**
   * After a crash or a stop. The table is checked entry by entry: a bad entry is reported and left
   * out (the file as it was is set aside), the good devices come back. A FUSE device whose
   * connection the keeper still holds is served again as it is: same mount, same loop, open files
   * keep working, and requests the dead blockd had taken are resent. Otherwise its old mount, if
   * one is there, is dead: its loop is detached, it is mounted afresh at its path and marked lost.
   * A device that cannot be brought back is kept as failed. What the table does not name (a bad
   * entry's connection in the keeper, its mount, its loop) is ended, so nothing waits on it.
   */
  private async recover(): Promise<void> {
    const table = loadDeviceTable(this.tablePath, this.opts.stateDir);
    for (const p of table.problems) console.error(`blockd: ${p}; left out`);
    if (table.setAside) console.error(`blockd: ${this.tablePath} as it was is kept in ${table.setAside}`);
    for (const rec of table.records) {
      const n = Number(/-(\d+)$/.exec(rec.id)?.[1] ?? 0);
      if (Number.isSafeInteger(n) && n > this.serial) this.serial = n;
      this.settlePrepared(rec);
      let dev: Device;
      try {
        dev = await this.bringBack(rec);
      } catch (e) {
        const why = (e as Error).message;
        console.error(`blockd: could not bring back ${rec.id}: ${why}`);
        if (rec.kind === "pool" && !rec.acquired) continue; // holds nothing: endUnnamed clears it, fillPool replaces it
        rec.state = "failed";
        rec.reason = `not brought back at start: ${why}`;
        dev = { rec, handle: DeviceHandle.failed(rec.id, rec.reason) };
      }
      this.register(dev);
    }
    await this.endUnnamed();
    await this.saveTable();
    // Only now that the table names every acquired device: what prepared devices left is blockd's own scratch.
    const prepared = join(this.opts.stateDir, "prepared");
    for (const name of readdirSync(prepared)) rmSync(join(prepared, name), { recursive: true, force: true });
  }

  /**
   * A pool entry that was prepared (lowers, no upper, not acquired) comes back as an idle device,
   * unless an acquire had taken it before its table entry was written: its fresh upper is then gone
   * from the device's prepared folder, renamed to the caller's upperDir, and the crumb there names
   * where. The rename is what an acquire commits on, so such a device comes back acquired.
   */
  private settlePrepared(rec: DeviceRecord): void {
    if (rec.kind !== "pool") return;
    // An acquired read-only entry with a crumb: an acquire onto it that the table write did not follow (acquireOnto).
    if (rec.acquired) return void (rec.readOnly && this.settleAcquired(rec));
    if (!rec.config) return this.settleAcquired(rec);
    if (rec.config.upper) return;
    const dir = this.preparedDir(rec.id);
    let upperDir: string | undefined;
    if (!existsSync(join(dir, PREPARED_UPPER))) {
      try {
        upperDir = readlinkSync(join(dir, ACQUIRED_CRUMB));
      } catch {}
    }
    if (upperDir !== undefined && isAbsolute(upperDir)) {
      let above: LayerRef[] = [];
      try {
        const text = readFileSync(join(dir, ABOVE_LOWERS), "utf8");
        above = text.trim() ? parseImageConfig(JSON.parse(text)).lowers : []; // blank: as prepared (writeAbove)
      } catch (e) {
        if ((e as NodeJS.ErrnoException).code !== "ENOENT") throw new Error(`prepared device ${rec.id}: its ${ABOVE_LOWERS} is unreadable: ${(e as Error).message}`);
      }
      rec.config = { lowers: [...rec.config.lowers, ...above], upper: { data: join(upperDir, WRITABLE_DATA), index: join(upperDir, WRITABLE_INDEX) } };
      rec.acquired = true;
      rec.readOnly = false;
      console.error(`blockd: prepared device ${rec.id} had been acquired with its upper in ${upperDir}; it comes back acquired`);
    } else {
      rec.config = null;
      rec.readOnly = true;
    }
  }

  /**
   * A plain pool entry (no image) that an acquire had taken before its table entry was written, or
   * a read-only one an acquire grew (acquireOnto): the crumb in its folder (writeAcquiredCrumb)
   * holds the image it was given, so it comes back acquired with it. A crumb outlives no table
   * write, so it is never older than the entry. One that cannot be read comes back failed: a VM
   * may be reading it.
   */
  private settleAcquired(rec: DeviceRecord): void {
    let text: string;
    try {
      text = readFileSync(join(this.preparedDir(rec.id), ACQUIRED_IMAGE), "utf8");
    } catch {
      return;
    }
    try {
      const crumb = JSON.parse(text) as { config: unknown; readOnly: unknown };
      if (typeof crumb.readOnly !== "boolean") throw new Error(`"readOnly" is not a boolean`);
      rec.config = parseImageConfig(crumb.config);
      rec.readOnly = crumb.readOnly;
      rec.acquired = true;
      console.error(`blockd: pool device ${rec.id} had been acquired (its crumb says so); it comes back acquired`);
    } catch (e) {
      rec.state = "failed";
      rec.reason = `its acquire's crumb ${ACQUIRED_IMAGE} is unreadable: ${(e as Error).message}`;
      rec.acquired = true;
    }
  }

  /** One checked record served again (see recover). */
  private async bringBack(rec: DeviceRecord): Promise<Device> {
    const wasFailed = rec.state === "failed" ? rec.reason : undefined;
    if ((rec.frontend ?? "fuse") === "ublk") {
      const { handle, ublk, replaced } = await this.startUblk(rec, true);
      if (replaced) this.markLost(rec, `its ublk device could not be recovered and was added anew as ${rec.path}`);
      else if (wasFailed) this.markLost(rec, wasFailed);
      return { rec, handle, ublk };
    }
    const live = await this.keeper.take(rec.id);
    let ended: string | undefined;
    if (live?.length) {
      try {
        const handle = await this.startWorker(rec, live);
        if (wasFailed) this.markLost(rec, wasFailed);
        return { rec, handle };
      } catch (e) {
        // Nobody will serve this connection: end it, so its users get errors instead of a wait
        // (the worker that failed closed our copies of its fds).
        await this.keeper.drop(rec.id);
        // A connection served over io_uring cannot be taken over (fuse/server.ts): ended, it is mounted afresh below.
        if (!(e as Error).message.includes("FuseRingAdoptError")) throw e;
        ended = "its FUSE connection was served over io_uring, which a restarted blockd cannot take over";
      }
    }
    // The connection died with blockd and the keeper (or with its worker). A mount still there is
    // the dead one, and whatever had it open has seen errors: the device is lost, though its
    // acknowledged data is all in its layers. No mount: it was stopped cleanly (or the host rebooted).
    const wasMounted = isMountPoint(rec.path);
    const loop = rec.loop;
    rec.loop = undefined;
    if (loop && loopBackingFile(loop) === rec.path) detachLoop(loop);
    if (wasMounted) umount2(rec.path, MNT_DETACH);
    const handle = await this.startWorker(rec);
    let loopLost = "";
    if (loop) {
      try {
        rec.loop = loopAttach(rec.path, { readOnly: rec.readOnly }).path;
      } catch (e) {
        loopLost = `; its loop device could not be attached again (${(e as Error).message})`;
      }
    }
    const idlePool = rec.kind === "pool" && !rec.acquired; // nobody had it: nothing was lost
    if ((wasMounted && !idlePool) || wasFailed || loopLost)
      this.markLost(rec, `${wasFailed ?? ended ?? "its FUSE connection died with blockd and the fd keeper"}; mounted afresh at ${rec.path}${loopLost}`);
    return { rec, handle };
  }

  private markLost(rec: DeviceRecord, why: string): void {
    rec.state = "lost";
    rec.reason = why;
    console.error(`blockd: device ${rec.id} is lost: ${why}. It serves again, but whatever had it open got I/O errors; it stays "lost" until deleted`);
  }

  /**
   * Connections the keeper holds for no device (a bad table entry's) are dropped, and the leftovers
   * under <state>/dev that no device owns (dead mounts, loops over them) are cleared.
   */
  private async endUnnamed(): Promise<void> {
    for (const key of await this.keeper.keys()) {
      if (this.devices.has(key)) continue;
      console.error(`blockd: the fd keeper held a connection for ${JSON.stringify(key)}, a device the table does not name; ending it`);
      await this.keeper.drop(key);
    }
    const devDir = join(this.opts.stateDir, "dev");
    for (const id of readdirSync(devDir)) {
      if (this.devices.has(id)) continue;
      const path = this.devPath(id);
      for (const loop of loopsBackedBy(path)) detachLoop(loop);
      if (isMountPoint(path)) {
        console.error(`blockd: ${path} is mounted but no device in the table owns it; unmounting it`);
        umount2(path, MNT_DETACH);
      }
      rmSync(path, { force: true });
    }
  }

  /** Hear of the worker's death once its device is in the table (register() covers the time before). */
  private watch(id: string, handle: DeviceHandle): void {
    handle.onDeath = (failure) => {
      const d = this.devices.get(id);
      if (d?.handle === handle) void this.workerDied(d, failure);
    };
  }

  /** Put a device in the table; one whose worker died before this is handled as dead now. */
  private register(dev: Device): void {
    this.devices.set(dev.rec.id, dev);
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
      this.devices.delete(d.rec.id);
      if (d.prepared) await rm(this.preparedDir(d.rec.id), { recursive: true, force: true }).catch(() => {});
      void this.fillPool().catch((e) => console.error(`blockd: pool refill: ${e.message}`));
      if (d.prepared) void this.refillPrepared();
    }
    await this.saveTable().catch((e) => console.error(`blockd: saving the device table: ${e.message}`));
  }

  /**
   * A ublk device: ADD_DEV + SET_PARAMS here, the queue worker FETCHes, then START_DEV. After a
   * crash (recover), the kernel kept the device: START/END_USER_RECOVERY re-attach a new worker.
   */
  private async startUblk(rec: DeviceRecord, recover = false): Promise<{ handle: DeviceHandle; ublk: UblkDevice; replaced: boolean }> {
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
  private async startWorker(rec: DeviceRecord, adopt?: number[]): Promise<DeviceHandle> {
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

  private newId(prefix: string): string {
    return `${prefix}-${++this.serial}`;
  }

  private async addDevice(rec: DeviceRecord, loop: boolean): Promise<DeviceRecord> {
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
      this.devices.delete(rec.id);
      throw e;
    }
    await this.saveTable();
    return rec;
  }

  private device(id: unknown): Device {
    if (typeof id !== "string") throw new BlockdError("BadRequest", `"id" must be a string`);
    const d = this.devices.get(id);
    if (!d) throw new BlockdError("NotFound", `no device ${id}`);
    return d;
  }

  /** One operation per device at a time; a second one is told the device is busy. */
  private async exclusive<T>(id: string, fn: () => Promise<T>): Promise<T> {
    if (this.busy.has(id)) throw new BlockdError("Busy", `device ${id} has an operation in flight`);
    this.busy.add(id);
    try {
      return await fn();
    } finally {
      this.busy.delete(id);
    }
  }

  private view(rec: DeviceRecord, size?: number) {
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

  // ---- RPC methods --------------------------------------------------------------------------

  /**
   * Claim names a call is setting up (a device id, an upper's data file) before its first await,
   * so a racing call is told Exists instead of building the same thing twice. Returns the unclaim.
   */
  private claim(key: string, taken: () => boolean, what: string): () => void {
    if (this.claims.has(key) || taken()) throw new BlockdError("Exists", what);
    this.claims.add(key);
    return () => this.claims.delete(key);
  }
  private claimId(id: string): () => void {
    return this.claim(`dev:${id}`, () => this.devices.has(id), `device ${id} exists`);
  }
  /** Two devices over one upper would corrupt it. */
  private claimUpper(data: string): () => void {
    const used = () => [...this.devices.values()].some((d) => d.rec.config?.upper?.data === data);
    return this.claim(`upper:${data}`, used, `${data} is the upper of another device`);
  }

  private async create(p: Record<string, unknown>) {
    const upperDir = checkUpperDir(p.upperDir);
    const size = checkSize(p.size);
    const devId = p.id === undefined ? this.newId("rw") : checkId(p.id);
    const config = checkConfig(p.lowers, upperDir);
    const unclaimId = this.claimId(devId);
    const unclaimUpper = this.claimUpper(config.upper!.data);
    try {
      if (await exists(config.upper!.data)) throw new BlockdError("Exists", `${upperDir} already holds a writable layer`);
      const removeUpper = await makeUpper(upperDir, size, p.sparse === true);
      try {
        const rec = await this.addDevice({ id: devId, kind: "rw", path: this.devPath(devId), config, readOnly: false, refs: 1, size }, p.loop === true);
        return this.view(rec, size);
      } catch (e) {
        await removeUpper();
        throw e;
      }
    } finally {
      unclaimUpper();
      unclaimId();
    }
  }

  /** The same lowers give the same device: a second caller joins the one being made (or its failure). */
  private async createReadOnly(p: Record<string, unknown>) {
    const config = checkConfig(p.lowers);
    if (!config.lowers.length) throw new BlockdError("BadRequest", "a read-only device needs at least one layer");
    const key = JSON.stringify(config.lowers.map((l, i) => resolveLayerPath(l, i)));
    for (;;) {
      for (const d of this.devices.values())
        if (d.rec.kind === "ro" && d.rec.key === key) {
          d.rec.refs++;
          const made = this.view(d.rec, d.handle.size); // this call's count: others may add theirs while the table is written
          await this.saveTable();
          return made;
        }
      const making = this.roMaking.get(key);
      if (!making) break;
      await making;
    }
    const devId = this.newId("ro");
    const making = this.addDevice({ id: devId, kind: "ro", path: this.devPath(devId), config, readOnly: true, refs: 1, key }, p.loop === true);
    this.roMaking.set(key, making);
    try {
      const rec = await making;
      return this.view(rec, this.devices.get(devId)!.handle.size);
    } finally {
      this.roMaking.delete(key);
    }
  }

  private async restack(p: Record<string, unknown>) {
    const d = this.device(p.id);
    if (d.rec.readOnly || !d.rec.config) throw new BlockdError("ReadOnly", `device ${d.rec.id} has no writable layer`);
    if (typeof p.layerPath !== "string" || !isAbsolute(p.layerPath)) throw new BlockdError("BadRequest", `"layerPath" must be an absolute file path`);
    return this.exclusive(d.rec.id, async () => {
      const r = await d.handle.restack(p.layerPath as string);
      d.rec.config = r.config;
      await this.saveTable();
      return r;
    });
  }

  private async resize(p: Record<string, unknown>) {
    const d = this.device(p.id);
    const size = checkSize(p.size);
    return this.exclusive(d.rec.id, async () => {
      await d.handle.resize(size);
      return this.view(d.rec, d.handle.size);
    });
  }

  private async remove(p: Record<string, unknown>) {
    const d = this.device(p.id);
    if (d.rec.kind === "ro" && --d.rec.refs > 0) {
      const left = { id: d.rec.id, refs: d.rec.refs, freed: false };
      await this.saveTable();
      return left;
    }
    await d.committing;
    await this.exclusive(d.rec.id, () => this.teardown(d));
    this.devices.delete(d.rec.id);
    if (d.prepared) {
      await rm(this.preparedDir(d.rec.id), { recursive: true, force: true });
      void this.refillPrepared();
    }
    await this.saveTable();
    return { id: d.rec.id, refs: 0, freed: true };
  }

  private async teardown(d: Device): Promise<void> {
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

  /** Top the pool up to its size; one refill at a time (two would both fill the same gap). */
  private fillPool(): Promise<void> {
    const idle = () => [...this.devices.values()].filter((d) => isPlainIdle(d)).length;
    this.filling ??= (async () => {
      while (!this.closing && idle() < (this.opts.pool ?? 0)) {
        const id = this.newId("pool");
        this.busy.add(id); // nobody takes it before its warm-up is over
        try {
          await this.addDevice({ id, kind: "pool", path: this.devPath(id), config: null, readOnly: true, refs: 0 }, false);
          await this.warmUp(this.devices.get(id)!);
        } finally {
          this.busy.delete(id);
        }
      }
    })().finally(() => (this.filling = undefined));
    return this.filling;
  }

  /**
   * A new pool device's worker runs an acquire's swap once, over a 2-layer stack of 2560 segments
   * with a held upper, and back: a thread compiles each function at its first call and optimizes
   * its loops after some thousand turns, and a fresh device's first acquire had cost 15–20 ms more
   * than a later one (a 2-layer memory stack of ~1000 segments: its open and merge 3–6 ms after a
   * warm-up over one segment, 1–2.5 ms after this one). Best effort: a failure is logged only.
   */
  private async warmUp(dev: Device): Promise<void> {
    const at = join(this.warmUpDir, dev.rec.id);
    const hold = { data: `${at}.data`, index: `${at}.index`, size: WARM_UP_BASE_BYTES };
    try {
      this.warmUpLayers ??= this.writeWarmUpLayers();
      await dev.handle.swap({ lowers: (await this.warmUpLayers).map((file) => ({ file })) }, true, hold);
      await dev.handle.swap(null, true);
    } catch (e) {
      this.warmUpLayers = undefined; // made again by the next one
      console.error(`blockd: device ${dev.rec.id}: warm-up: ${(e as Error).message}`);
      if (!dev.handle.failure) await dev.handle.swap(null, true).catch(() => {});
    } finally {
      await rm(hold.data, { force: true });
      await rm(hold.index, { force: true });
    }
  }

  /**
   * The warm-up's stack, sealed by a memory writer (its syncs stay off this loop): a base with
   * every even 4 KiB page written (2048 segments) and a top with the odd ones of its first 4 MiB
   * (512), which the merge interleaves.
   */
  private async writeWarmUpLayers(): Promise<string[]> {
    const layers: string[] = [];
    for (const [name, size, first] of [["base", WARM_UP_BASE_BYTES, 0], ["top", WARM_UP_TOP_BYTES, 1]] as const) {
      const path = join(this.warmUpDir, name);
      const image = `${path}.raw`;
      const bytes = new Uint8Array(size);
      for (let page = first; page < size / 4096; page += 2) bytes[page * 4096] = 1;
      await writeFile(image, bytes);
      try {
        await this.memoryWriter.write({ out: path, size, from: { file: image } });
      } finally {
        await rm(image, { force: true });
      }
      layers.push(path);
    }
    return layers;
  }

  /**
   * An idle pool device (not prepared, not failed), reserved for the caller (busy) before any await.
   * The one released last goes first: a release then an acquire swaps under the same live file.
   * None idle: a cold one.
   */
  private async reserveIdle(): Promise<{ dev: Device; cold: boolean }> {
    let best: Device | undefined;
    for (const d of this.devices.values())
      if (isPlainIdle(d) && !d.handle.failure && !this.busy.has(d.rec.id) && (d.releasedAt ?? 0) >= (best?.releasedAt ?? 0)) best = d;
    if (best) {
      this.busy.add(best.rec.id);
      return { dev: best, cold: false };
    }
    // Still a pool device, so release recycles it.
    const id = this.newId("pool");
    this.busy.add(id);
    try {
      await this.addDevice({ id, kind: "pool", path: this.devPath(id), config: null, readOnly: true, refs: 0 }, false);
    } catch (e) {
      this.busy.delete(id);
      throw e;
    }
    return { dev: this.devices.get(id)!, cold: true };
  }

  /**
   * Take a ready device and swap the image in under it (no mount, no worker start). A device
   * prepared for the same lowers and size goes first: see acquirePrepared.
   */
  private async acquire(p: Record<string, unknown>): Promise<ReturnType<Blockd["view"]> & { prepared: boolean }> {
    const readOnly = p.upperDir === undefined;
    const config = readOnly ? checkConfig(p.lowers) : checkConfig(p.lowers, checkUpperDir(p.upperDir));
    const size = readOnly ? 0 : checkSize(p.size);
    if (readOnly && !config.lowers.length) throw new BlockdError("BadRequest", "a read-only device needs at least one layer");
    if (p.onto !== undefined) {
      if (!readOnly) throw new BlockdError("BadRequest", `"onto" is for a read-only acquire (no "upperDir")`);
      return this.acquireOnto(config, p.onto);
    }
    const unclaimUpper = config.upper ? this.claimUpper(config.upper.data) : () => {};
    try {
      if (!readOnly) {
        const key = stackKey(config, size);
        const counted = this.served(key);
        const fast = await this.acquirePrepared(config, checkUpperDir(p.upperDir), key);
        if (counted && !fast) void this.refillPrepared(); // what the target has prepared past its count goes
        if (fast) return { ...this.view(fast.rec, fast.handle.size), prepared: true };
      }
      const { dev, cold } = await this.reserveIdle();
      let removeUpper: (() => Promise<void>) | undefined;
      let swapped = false;
      try {
        // An upper that exists is reattached as it is (a sandbox acquiring its own disk again); a
        // missing one the worker makes (LocalFile's syncs would block this loop).
        const make = config.upper !== undefined && !(await exists(config.upper.data));
        if (make) removeUpper = await upperFolder(checkUpperDir(p.upperDir));
        await dev.handle.swap(config, readOnly, undefined, make ? size : undefined);
        swapped = true;
        // The crumb commits, here on this loop (a small write and a rename: 0.05–0.5 ms, where the
        // table's write and sync took 2–20 ms among running guests): a blockd that dies before the
        // table names the device finds it (settleAcquired). The table write follows the reply.
        writeAcquiredCrumb(this.preparedDir(dev.rec.id), { config, readOnly });
        dev.rec.acquired = true;
        dev.rec.config = config;
        dev.rec.readOnly = readOnly;
      } catch (e) {
        if (swapped) await dev.handle.swap(null, true).catch(() => {});
        await removeUpper?.();
        if (cold) await this.dropCold(dev);
        throw e;
      } finally {
        this.busy.delete(dev.rec.id);
      }
      this.commitLater(dev);
      void this.fillPool().catch((e) => console.error(`blockd: pool refill: ${e.message}`));
      return { ...this.view(dev.rec, dev.handle.size), prepared: false };
    } finally {
      unclaimUpper();
    }
  }

  /**
   * A read-only acquire onto `onto`, a read-only device its caller acquired and gives up into this
   * one, whose lowers are the first of these: its worker opens only the rest, on top (a fork's
   * memory stack over its source's layers, opened while the VMM wrote the new one: docs/vmm.md).
   * Nothing may map `onto`. The reply is that device with the longer stack; on a failure it stays
   * as it was, still the caller's.
   */
  private async acquireOnto(config: ImageConfig, onto: unknown): Promise<ReturnType<Blockd["view"]> & { prepared: boolean }> {
    if (typeof onto !== "string") throw new BlockdError("BadRequest", `"onto" must be a device id`);
    const dev = this.device(onto);
    const id = dev.rec.id;
    const has = dev.rec.config?.lowers.map((l, i) => resolveLayerPath(l, i));
    if (dev.rec.kind !== "pool" || !dev.rec.acquired || !dev.rec.readOnly || !has)
      throw new BlockdError("BadRequest", `"onto": device ${id} is not a read-only device taken by acquire`);
    const want = config.lowers.map((l, i) => resolveLayerPath(l, i));
    if (has.length >= want.length || has.some((path, i) => path !== want[i]))
      throw new BlockdError("BadRequest", `"onto": device ${id}'s ${has.length} lowers are not the first of these ${want.length}`);
    return this.exclusive(id, async () => {
      await dev.committing; // its own acquire's table write and crumb removal come first
      await dev.handle.extend({ lowers: config.lowers.slice(has.length) });
      // As a plain acquire commits: the crumb now, the table after the reply.
      try {
        writeAcquiredCrumb(this.preparedDir(id), { config, readOnly: true });
      } catch (e) {
        await dev.handle.swap(dev.rec.config, true).catch(() => {}); // back to the stack the table names
        throw e;
      }
      dev.rec.config = config;
      this.commitLater(dev);
      return { ...this.view(dev.rec, dev.handle.size), prepared: false };
    });
  }

  /**
   * An acquire committed by its crumb is recorded in the table once its reply has gone out
   * (setImmediate runs after the microtasks that send it), then its folder goes; release and
   * remove wait for that.
   */
  private commitLater(dev: Device): void {
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

  /**
   * An acquire of `key` counts against a target that serves a number of them, before it takes a
   * device (so the refill that follows does not replace one nobody will ask for); at 0 the target
   * ends, and the refill after the acquire retires what it still has prepared. True if it counted.
   */
  private served(key: string): boolean {
    const t = this.targets.get(key);
    if (t?.acquires === undefined) return false;
    t.acquires--;
    t.count = Math.min(t.count, t.acquires);
    if (t.acquires <= 0) this.targets.delete(key);
    return true;
  }

  /**
   * A prepared device of this stack, acquired: its fresh upper is renamed to upperDir, the crumb
   * in its prepared folder names upperDir, and the worker puts the upper over the lowers it holds.
   * The rename commits: a blockd that dies after it finds the crumb (settlePrepared), so the reply
   * does not wait for the table write, which follows. Undefined (nothing changed) when none is
   * prepared or upperDir cannot take the rename (not empty, another filesystem): acquire goes on
   * as without one.
   */
  private async acquirePrepared(config: ImageConfig, upperDir: string, key: string): Promise<Device | undefined> {
    const found = this.preparedFor(key);
    if (!found) return undefined;
    const { dev, prefix } = found;
    const id = dev.rec.id;
    this.busy.add(id);
    const fresh = join(this.preparedDir(id), PREPARED_UPPER);
    const crumb = join(this.preparedDir(id), ACQUIRED_CRUMB);
    const aboveFile = join(this.preparedDir(id), ABOVE_LOWERS);
    const above: ImageConfig | undefined = prefix < config.lowers.length ? { lowers: config.lowers.slice(prefix) } : undefined;
    let retire = false; // the device cannot serve as prepared any more
    let renamed = false;
    let linked = false;
    let attached = false;
    const commit = () => void (renameDirSync(fresh, upperDir), (renamed = true));
    try {
      let steps: PromiseSettledResult<void>[];
      if (!above) {
        // Exactly the prepared stack: the crumb, then the rename that commits, here on this loop.
        // Two metadata calls on the state filesystem take 0.02–0.8 ms (measured under running
        // guests), where each thread-pool hop took 0.2–8 ms. The worker's upper has been over the
        // lowers since prepare: it learns its new paths after the reply (its control ops run in
        // order; its I/O goes through the open files).
        steps = [settleNow(() => void (symlinkSync(upperDir, crumb), (linked = true)))];
        if (linked) steps.push(settleNow(commit));
      } else {
        // At once, as none needs another: the crumb (before the rename it means nothing), the
        // worker opening the lowers above the prefix, and the rename, after above.json is durable:
        // a restarted blockd rebuilds the whole stack from it.
        steps = await Promise.allSettled([
          symlink(upperDir, crumb).then(() => void (linked = true)),
          dev.handle.attach(config.upper!, above).then(() => void (attached = true)),
          writeAbove(aboveFile, JSON.stringify(above)).then(commit),
        ]);
      }
      const failed = steps.find((r) => r.status === "rejected") as PromiseRejectedResult | undefined;
      if (failed) {
        // Back as it was: the worker holding the upper, which is in the prepared folder, no crumb,
        // above.json blank (a later exact acquire writes none). What does not go back retires the device.
        const e = failed.reason as NodeJS.ErrnoException;
        const detached = !attached || (await dev.handle.detach(prefix, { data: join(fresh, WRITABLE_DATA), index: join(fresh, WRITABLE_INDEX) }).then(() => true, () => false));
        if (linked) await rm(crumb, { force: true }).catch(() => {});
        const back = !renamed || (await rename(upperDir, fresh).then(() => true, () => false));
        if (!back) await rm(upperDir, { recursive: true, force: true }).catch(() => {});
        if (above) await writeSynced(aboveFile, BLANK_ABOVE).catch(() => rm(aboveFile, { force: true })).catch(() => {});
        retire = !detached || !back || dev.handle.failure !== undefined || !(await exists(fresh));
        if (e.code === "EXDEV") console.error(`blockd: ${upperDir} is not on the filesystem of ${this.opts.stateDir}: prepared devices cannot serve it`);
        else if (!["ENOTEMPTY", "EEXIST", "ENOTDIR", "EISDIR"].includes(e.code ?? "")) console.error(`blockd: acquiring prepared device ${id}: ${e.message}; acquiring without it`);
        return undefined; // upperDir not empty or elsewhere: the device stays prepared
      }
      if (!above) void dev.handle.attach(config.upper!).catch((e) => console.error(`blockd: ${id} taking its upper's new paths: ${(e as Error).message}`));
      dev.prepared = undefined;
      dev.rec.acquired = true;
      dev.rec.config = config;
      dev.rec.readOnly = false;
      // The table write and the refill wait for the reply to go out (setImmediate runs after the
      // microtasks that send it): a refill starting a worker here held replies up to 8 ms.
      this.commitLater(dev);
      void afterReply().then(() => this.refillPrepared());
      return dev;
    } finally {
      this.busy.delete(id);
      if (retire) void this.retireIdle(dev).then(() => this.refillPrepared());
    }
  }

  /**
   * A prepared device for the stack of `key`: one of exactly that stack, else one whose lowers are
   * the longest prefix of it (same size), whose worker opens the rest above them (a resume or a
   * fork child: its own sealed layers over its template's). `prefix`: how many lowers it holds.
   */
  private preparedFor(key: string): { dev: Device; prefix: number } | undefined {
    const [want, size] = JSON.parse(key) as [string[], number];
    let best: { dev: Device; prefix: number } | undefined;
    for (const d of this.devices.values()) {
      if (!d.prepared || d.handle.failure || this.busy.has(d.rec.id)) continue;
      if (d.prepared === key) return { dev: d, prefix: want.length };
      const [has, hasSize] = JSON.parse(d.prepared) as [string[], number];
      if (hasSize !== size || has.length >= want.length || has.length <= (best?.prefix ?? 0)) continue;
      if (has.every((p, i) => p === want[i])) best = { dev: d, prefix: has.length };
    }
    return best;
  }

  /**
   * Keep `count` pool devices ready for acquires of this stack (lowers and size): each has the
   * lowers open and a fresh upper in its prepared folder under the state dir, so upperDirs must be
   * on that filesystem. Replies once the devices are ready; count 0 retires them. `acquires`: the
   * target serves that many acquires of the stack, then ends (a fork's children: its devices are
   * not replaced past the last). All or nothing: a refill that fails restores the target it replaced.
   */
  private async prepare(p: Record<string, unknown>) {
    const count = p.count;
    if (!Number.isSafeInteger(count) || (count as number) < 0 || (count as number) > MAX_PREPARED_PER_STACK)
      throw new BlockdError("BadRequest", `"count" must be an integer 0..${MAX_PREPARED_PER_STACK}`);
    if (count === 0) return this.retirePrepared(p);
    const config = checkConfig(p.lowers);
    if (!config.lowers.length) throw new BlockdError("BadRequest", "a prepared stack needs at least one layer");
    const size = checkSize(p.size);
    const acquires = p.acquires;
    if (acquires !== undefined && (!Number.isSafeInteger(acquires) || (acquires as number) < (count as number) || (acquires as number) > MAX_TARGET_ACQUIRES))
      throw new BlockdError("BadRequest", `"acquires" must be an integer ${count as number}..${MAX_TARGET_ACQUIRES} ("count" or more)`);
    const key = stackKey(config, size);
    const before = this.targets.get(key);
    const others = [...this.targets].filter(([k]) => k !== key);
    if (count && !before && others.length >= MAX_PREPARED_STACKS) throw new BlockdError("BadRequest", `${MAX_PREPARED_STACKS} stacks are prepared already`);
    const total = others.reduce((n, [, t]) => n + t.count, count as number);
    if (total > MAX_PREPARED) throw new BlockdError("BadRequest", `${total} prepared devices would be over ${MAX_PREPARED}`);
    const target: PrepareTarget = { lowers: config.lowers, size, count: count as number, acquires: acquires as number | undefined };
    if (target.count) this.targets.set(key, target);
    else this.targets.delete(key);
    await this.refillPrepared();
    const ready = this.preparedCount(key);
    if (ready < target.count && this.targets.get(key) === target && target.error) {
      if (before) this.targets.set(key, { ...before, failedAt: undefined, error: undefined });
      else this.targets.delete(key);
      await this.refillPrepared(); // retires what this call prepared
      throw target.error;
    }
    return { lowers: config.lowers.map((l, i) => resolveLayerPath(l, i)), size, count: target.count, ready };
  }

  /**
   * prepare with count 0: the target of these lowers and size ends and its devices are retired.
   * Its layer files may be gone (the checkpoint removed after its last sandbox): a target is
   * matched by the lowers as it was asked for, when they no longer resolve.
   */
  private async retirePrepared(p: Record<string, unknown>) {
    const size = checkSize(p.size);
    const asked = parseImageConfig({ lowers: checkLowers(p.lowers) }).lowers;
    if (!asked.length) throw new BlockdError("BadRequest", "a prepared stack needs at least one layer");
    let key: string | undefined;
    try {
      key = stackKey({ lowers: asked }, size);
    } catch {
      const refs = JSON.stringify(asked);
      key = [...this.targets].find(([, t]) => t.size === size && JSON.stringify(t.lowers) === refs)?.[0];
    }
    if (key === undefined) return { lowers: asked.map((l) => l.file ?? l.dir ?? l.digest ?? ""), size, count: 0, ready: 0 };
    this.targets.delete(key);
    await this.refillPrepared();
    return { lowers: (JSON.parse(key) as [string[], number])[0], size, count: 0, ready: this.preparedCount(key) };
  }

  /** Plain idle devices free to take now. */
  private idleCount(): number {
    let n = 0;
    for (const d of this.devices.values()) if (isPlainIdle(d) && !d.handle.failure && !this.busy.has(d.rec.id)) n++;
    return n;
  }

  private preparedCount(key: string): number {
    let n = 0;
    for (const d of this.devices.values()) if (d.prepared === key) n++;
    return n;
  }

  /** One refill at a time; a call during one is served by the next, which starts after it. */
  private refillPrepared(): Promise<void> {
    if (!this.refilling) {
      this.refilling = this.refillPass().finally(() => (this.refilling = undefined));
      return this.refilling;
    }
    return (this.refillQueued ??= this.refilling.then(() => {
      this.refillQueued = undefined;
      return this.refillPrepared();
    }));
  }

  /** Every target topped up to its count, PREPARE_AT_ONCE at a time (a failing one waits PREPARE_RETRY_MS), surplus retired, pool filled. */
  private async refillPass(): Promise<void> {
    for (const [key, t] of this.targets) {
      if (t.failedAt !== undefined && Date.now() - t.failedAt < PREPARE_RETRY_MS) continue;
      while (!this.closing && this.targets.get(key) === t && this.preparedCount(key) < t.count) {
        // Idle devices are prepared PREPARE_AT_ONCE at a time; cold ones (a worker start each) one by one.
        const n = Math.min(t.count - this.preparedCount(key), PREPARE_AT_ONCE, Math.max(1, this.idleCount()));
        const made = await Promise.allSettled(Array.from({ length: n }, () => this.prepareOne(key, t)));
        const failed = made.find((r) => r.status === "rejected");
        if (!failed) {
          t.failedAt = t.error = undefined;
          continue;
        }
        t.failedAt = Date.now();
        t.error = failed.reason as Error;
        console.error(`blockd: preparing a device for ${key}: ${t.error.message}`);
        break;
      }
    }
    const surplus = new Map<string, number>();
    for (const d of this.devices.values()) {
      if (!d.prepared || this.busy.has(d.rec.id)) continue;
      const n = (surplus.get(d.prepared) ?? 0) + 1;
      surplus.set(d.prepared, n);
      if (n > (this.targets.get(d.prepared)?.count ?? 0)) await this.retireIdle(d);
    }
    await this.fillPool().catch((e) => console.error(`blockd: pool refill: ${e.message}`));
  }

  /**
   * An idle device made ready for target `t`: a fresh upper in its prepared folder, the lowers
   * opened by its worker, and the table naming it prepared (written before anyone may take it).
   */
  private async prepareOne(key: string, t: PrepareTarget): Promise<void> {
    const { dev, cold } = await this.reserveIdle();
    const dir = this.preparedDir(dev.rec.id);
    try {
      const fresh = join(dir, PREPARED_UPPER);
      await rm(dir, { recursive: true, force: true });
      await mkdir(fresh, { recursive: true });
      await writeSynced(join(dir, ABOVE_LOWERS), BLANK_ABOVE);
      // The worker makes the fresh upper (sync file creations stall under journal load: not on this loop).
      await dev.handle.swap({ lowers: t.lowers }, true, { data: join(fresh, WRITABLE_DATA), index: join(fresh, WRITABLE_INDEX), size: t.size });
      dev.rec.config = { lowers: t.lowers };
      await this.saveTable();
      dev.prepared = key;
    } catch (e) {
      dev.rec.config = null;
      await rm(dir, { recursive: true, force: true }).catch(() => {});
      if (cold) await this.dropCold(dev);
      else await dev.handle.swap(null, true).catch(() => {}); // a swap that failed half way may have left the lowers open
      throw e;
    } finally {
      this.busy.delete(dev.rec.id);
      if (!cold && dev.handle.failure) void this.retireIdle(dev); // died while busy: workerDied left it to us
    }
  }

  /** An idle device that is not wanted (a prepared one past its target, or one whose worker failed) goes: worker, mount, folder. */
  private async retireIdle(d: Device): Promise<void> {
    try {
      await this.exclusive(d.rec.id, () => this.teardown(d));
      this.devices.delete(d.rec.id);
      await rm(this.preparedDir(d.rec.id), { recursive: true, force: true });
      await this.saveTable();
    } catch (e) {
      console.error(`blockd: retiring idle device ${d.rec.id}: ${(e as Error).message}`);
    }
  }

  /** A cold device made for an acquire that then failed: it goes, so the failure leaves nothing. */
  private async dropCold(dev: Device): Promise<void> {
    try {
      await this.teardown(dev);
      this.devices.delete(dev.rec.id);
      await this.saveTable();
    } catch (e) {
      console.error(`blockd: removing ${dev.rec.id}: ${(e as Error).message}`);
    }
  }

  private async release(p: Record<string, unknown>) {
    const d = this.device(p.id);
    if (d.rec.kind !== "pool" || !d.rec.acquired) throw new BlockdError("BadRequest", `device ${d.rec.id} was not acquired from the pool`);
    await d.committing; // its crumb is gone before it can be prepared again
    await this.exclusive(d.rec.id, () => d.handle.swap(null, true));
    d.rec.acquired = false;
    d.rec.config = null;
    d.rec.readOnly = true;
    d.releasedAt = ++this.releases;
    const released = this.view(d.rec, 0);
    // A crumb left by a table write that failed would bring the device back acquired: it goes first.
    await rm(this.preparedDir(d.rec.id), { recursive: true, force: true });
    await this.saveTable();
    return released;
  }

  /** A sealed memory layer at `out` from a memory image file or a stopped VMM's dirty pages (memory_layer.ts). */
  private async memoryLayer(p: Record<string, unknown>) {
    if (typeof p.out !== "string" || !isAbsolute(p.out)) throw new BlockdError("BadRequest", `"out" must be an absolute file path`);
    const f = p.from as Record<string, unknown> | undefined;
    let from: MemorySource;
    if (f && typeof f.file === "string" && isAbsolute(f.file)) from = { file: f.file };
    else if (f && Number.isInteger(f.pid) && (f.pid as number) > 0 && Number.isSafeInteger(f.address) && typeof f.pagesFile === "string" && isAbsolute(f.pagesFile))
      from = { pid: f.pid as number, address: f.address as number, pagesFile: f.pagesFile };
    else throw new BlockdError("BadRequest", `"from" must be {file} or {pid, address, pagesFile} with absolute paths`);
    if (p.zfile !== undefined && p.zfile !== "zstd" && p.zfile !== "lz4") throw new BlockdError("BadRequest", `"zfile" must be "zstd" or "lz4"`);
    return this.memoryWriter.write({ out: p.out, size: p.size as number, from, zfile: p.zfile as "zstd" | "lz4" | undefined });
  }

  /** Note the device's first reads from now on (trace.ts): granule, maxEntries and forMs bound it. */
  private async traceStart(p: Record<string, unknown>) {
    const d = this.device(p.id);
    const granule = p.granule ?? TRACE_GRANULE;
    const maxEntries = p.maxEntries ?? TRACE_MAX_ENTRIES;
    const forMs = p.forMs ?? TRACE_DEFAULT_MS;
    try {
      checkGranule(granule as number, `"granule"`);
    } catch (e) {
      throw new BlockdError("BadRequest", (e as Error).message);
    }
    if (!Number.isInteger(maxEntries) || (maxEntries as number) < 1 || (maxEntries as number) > TRACE_MAX_ENTRIES)
      throw new BlockdError("BadRequest", `"maxEntries" must be an integer 1..${TRACE_MAX_ENTRIES}`);
    if (!Number.isInteger(forMs) || (forMs as number) < 1 || (forMs as number) > TRACE_MAX_MS) throw new BlockdError("BadRequest", `"forMs" must be an integer 1..${TRACE_MAX_MS}`);
    // Numbered before the worker hears of it: a traceStop sent for an earlier recording, arriving
    // after this, is refused instead of ending this one.
    const recording = ++this.recordings;
    const was = d.recording;
    d.recording = recording;
    try {
      const r = await d.handle.traceStart(granule as number, maxEntries as number, forMs as number);
      return { id: d.rec.id, recording, ...r };
    } catch (e) {
      if (d.recording === recording) d.recording = was;
      throw e;
    }
  }

  /** The recording ends; with `out` (absolute) it is written there whole (temp file, rename), replacing what was. */
  private async traceStop(p: Record<string, unknown>) {
    const d = this.device(p.id);
    if (p.out !== undefined && (typeof p.out !== "string" || !isAbsolute(p.out))) throw new BlockdError("BadRequest", `"out" must be an absolute file path`);
    if (p.recording !== undefined && !Number.isSafeInteger(p.recording)) throw new BlockdError("BadRequest", `"recording" must be the number traceStart answered`);
    if (p.recording !== undefined && p.recording !== d.recording)
      throw new BlockdError("TraceError", `device ${d.rec.id} records no trace numbered ${p.recording} (given back and taken again since)`);
    const trace = await d.handle.traceStop();
    const bytes = encodeTrace(trace);
    if (typeof p.out === "string") {
      const tmp = `${p.out}.tmp-${process.pid}-${++traceWrites}`;
      try {
        await writeFile(tmp, bytes, { mode: 0o644 });
        await rename(tmp, p.out);
      } catch (e) {
        await rm(tmp, { force: true }).catch(() => {});
        throw e;
      }
    }
    return { id: d.rec.id, out: p.out ?? null, entries: trace.entries.length, granule: trace.granule, size: trace.size, bytes: bytes.length };
  }

  /** Replay the trace file `trace` ahead of the guest (trace.ts); answered once it has started. A bad file is a TraceError. */
  private async prefetch(p: Record<string, unknown>) {
    const d = this.device(p.id);
    if (typeof p.trace !== "string" || !isAbsolute(p.trace)) throw new BlockdError("BadRequest", `"trace" must be an absolute file path`);
    const path = p.trace;
    const f = await open(path, "r").catch((e: NodeJS.ErrnoException) => {
      throw new BlockdError(e.code === "ENOENT" ? "NotFound" : "TraceError", `trace ${path}: ${e.message}`);
    });
    let bytes: Uint8Array;
    try {
      const { size } = await f.stat();
      if (size > TRACE_MAX_FILE) throw new TraceError(`trace ${path}: ${size} bytes is more than a trace can be (${TRACE_MAX_FILE})`);
      bytes = new Uint8Array(size);
      const { bytesRead } = await f.read(bytes, 0, size, 0);
      if (bytesRead !== size) throw new TraceError(`trace ${path}: read ${bytesRead} of ${size} bytes`);
    } finally {
      await f.close();
    }
    const trace = decodeTrace(bytes, `trace ${path}`);
    return { id: d.rec.id, ...(await d.handle.prefetch(trace)) };
  }

  private async list() {
    return [...this.devices.values()].map((d) => this.view(d.rec, d.handle.failure ? d.rec.size : d.handle.size));
  }

  async dispatch(method: string, params: Record<string, unknown>): Promise<unknown> {
    switch (method) {
      case "hello":
        return { version: PROTOCOL_VERSION, frontend: this.frontend, pid: process.pid };
      case "create":
        return this.create(params);
      case "createReadOnly":
        return this.createReadOnly(params);
      case "restack":
        return this.restack(params);
      case "resize":
        return this.resize(params);
      case "delete":
        return this.remove(params);
      case "list":
        return this.list();
      case "acquire":
        return this.acquire(params);
      case "release":
        return this.release(params);
      case "prepare":
        return this.prepare(params);
      case "memoryLayer":
        return this.memoryLayer(params);
      case "stats":
        return this.device(params.id).handle.stats();
      case "traceStart":
        return this.traceStart(params);
      case "traceStop":
        return this.traceStop(params);
      case "prefetch":
        return this.prefetch(params);
      case "shutdown":
        setTimeout(() => void this.shutdown(), 10);
        return { ok: true };
      default:
        throw new BlockdError("UnknownMethod", `unknown method ${JSON.stringify(method)}`);
    }
  }

  private listen(): void {
    rmSync(this.socketPath, { force: true });
    this.server = Bun.listen<Conn>({
      unix: this.socketPath,
      socket: {
        open: (s) => {
          s.data = { reader: new FrameReader(), writer: new FrameWriter(s), inFlight: 0, queue: [], draining: false };
        },
        drain: (s) => {
          try {
            s.data.writer.flush();
          } catch {
            s.end();
          }
        },
        data: (s, chunk) => {
          let frames: Uint8Array[];
          try {
            frames = s.data.reader.push(chunk);
          } catch (e) {
            reply(s, { v: PROTOCOL_VERSION, id: 0, error: { code: "BadFrame", message: (e as Error).message } });
            s.end();
            return;
          }
          for (const f of frames) this.admit(s, f);
          this.drain(s);
        },
      },
    });
  }

  /**
   * A frame checked and counted in flight (at most MAX_IN_FLIGHT per connection, else Busy), then
   * queued for drain; a malformed one is answered at once.
   */
  private admit(s: Socket<Conn>, frame: Uint8Array): void {
    let req: Request;
    try {
      req = JSON.parse(new TextDecoder().decode(frame));
      if (!req || typeof req !== "object" || typeof req.method !== "string" || typeof req.id !== "number") throw new Error("not a request object");
    } catch (e) {
      return reply(s, { v: PROTOCOL_VERSION, id: 0, error: { code: "BadRequest", message: `malformed request: ${(e as Error).message}` } });
    }
    if (req.v !== PROTOCOL_VERSION)
      return reply(s, { v: PROTOCOL_VERSION, id: req.id, error: { code: "VersionMismatch", message: `blockd speaks version ${PROTOCOL_VERSION}, not ${req.v}` } });
    if (s.data.inFlight >= MAX_IN_FLIGHT)
      return reply(s, { v: PROTOCOL_VERSION, id: req.id, error: { code: "Busy", message: `${MAX_IN_FLIGHT} requests already in flight on this connection` } });
    s.data.inFlight++;
    s.data.queue.push(req);
  }

  /**
   * Starts the queued requests in order, one per event-loop turn: a call that finishes on this loop
   * (a prepared acquire: a symlink and a rename, 0.3–1 ms under running guests) is answered before
   * the next one starts, where a burst read in one chunk (a fork's children) had every reply wait
   * for the last one's work.
   */
  private drain(s: Socket<Conn>): void {
    if (s.data.draining) return;
    const req = s.data.queue.shift();
    if (!req) return;
    void this.serve(s, req);
    if (!s.data.queue.length) return;
    s.data.draining = true;
    setImmediate(() => {
      s.data.draining = false;
      this.drain(s);
    });
  }

  private async serve(s: Socket<Conn>, req: Request): Promise<void> {
    const params = req.params && typeof req.params === "object" ? req.params : {};
    // Shutdown waits for the calls running when it began; one queued behind them does not start.
    const run = this.closing ? Promise.reject(new BlockdError("ShuttingDown", `blockd is shutting down: ${req.method} not started`)) : this.dispatch(req.method, params);
    this.running.add(run);
    try {
      reply(s, { v: PROTOCOL_VERSION, id: req.id, result: await run });
    } catch (e) {
      reply(s, { v: PROTOCOL_VERSION, id: req.id, error: errorOf(e) });
    } finally {
      this.running.delete(run);
      s.data.inFlight--;
    }
  }

  /** Flush and stop every device; the table stays, so a later start brings them back. */
  async shutdown(exit = true): Promise<void> {
    if (this.closing) return;
    this.closing = true;
    this.server?.stop(true);
    // Calls under way (a pool refill included) finish first, so no device appears after the stop below.
    let timer: Timer | undefined;
    await Promise.race([Promise.allSettled([...this.running, this.filling, this.refilling]), new Promise((r) => (timer = setTimeout(r, SHUTDOWN_WAIT_MS)))]);
    clearTimeout(timer);
    for (const d of this.devices.values()) {
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
    rmSync(this.socketPath, { force: true });
    if (exit) process.exit(0);
  }
}

/** One connection: frames in, frames out (whole, in order), and how many of its requests run. */
interface Conn {
  reader: FrameReader;
  writer: FrameWriter;
  /** Requests admitted and not answered yet (queued or running). */
  inFlight: number;
  /** Admitted requests not started yet, in arrival order (at most MAX_IN_FLIGHT). */
  queue: Request[];
  /** A drain turn is scheduled. */
  draining: boolean;
}

/** Names traceStop's temp files apart (two stops writing one out at once). */
let traceWrites = 0;

/** Requests one connection may have running at once; more are answered Busy. */
const MAX_IN_FLIGHT = 64;
/** prepare's bounds: devices per stack, stacks, devices in all (each is a worker and ~8 MiB). */
const MAX_PREPARED_PER_STACK = 16;
const MAX_PREPARED_STACKS = 16;
const MAX_PREPARED = 64;
/** Acquires one target may serve before it ends (a fork's children: the API's limit is 100). */
const MAX_TARGET_ACQUIRES = 1024;
/** Devices of one target prepared at once: each swaps on its own worker, and they share table writes. */
const PREPARE_AT_ONCE = 4;
/** A target whose refill failed (its layers gone, the disk full) is not tried again for this long. */
const PREPARE_RETRY_MS = 5_000;
/** In a prepared device's folder: its fresh upper, and (once acquired) the link to where it went. */
const PREPARED_UPPER = "upper";
const ACQUIRED_CRUMB = "acquired";
/** A plain pool device's acquire, until the table names it: the image it was given. */
const ACQUIRED_IMAGE = "acquired.json";
/** In a prepared folder: the lowers an acquire stacks above the prepared ones (JSON), written before its rename. */
const ABOVE_LOWERS = "above.json";
/** above.json is made this long and blank (spaces) at prepare: an acquire overwrites it in place, a data-only sync. */
const ABOVE_BYTES = 16384;
const BLANK_ABOVE = " ".repeat(ABOVE_BYTES);
/** How long shutdown lets calls under way finish (a restack's seal, a device start) before it stops devices. */
const SHUTDOWN_WAIT_MS = 30_000;

/** A reply that cannot be encoded (too large) goes as its error; a peer that does not read is cut off. */
function reply(s: Socket<Conn>, r: Reply): void {
  let frame: Uint8Array;
  try {
    frame = encodeFrame(r);
  } catch (e) {
    frame = encodeFrame({ v: r.v, id: r.id, error: errorOf(e) });
  }
  try {
    s.data.writer.send(frame);
  } catch {
    s.end();
  }
}

function checkId(id: unknown): string {
  if (typeof id !== "string" || !ID_RE.test(id)) throw new BlockdError("BadRequest", `"id" must match ${ID_RE}`);
  return id;
}

function checkLowers(lowers: unknown): LayerRef[] {
  if (lowers === undefined) return [];
  if (!Array.isArray(lowers)) throw new BlockdError("BadRequest", `"lowers" must be an array of layers`);
  return lowers.map((l) => (typeof l === "string" ? { file: l } : l)) as LayerRef[];
}

function checkSize(size: unknown): number {
  if (!Number.isSafeInteger(size) || (size as number) <= 0 || (size as number) % 512)
    throw new BlockdError("BadRequest", `"size" must be a positive multiple of 512`);
  return size as number;
}

/** Absolute: blockd's working directory is not the caller's. */
function checkUpperDir(dir: unknown): string {
  if (typeof dir !== "string" || !isAbsolute(dir)) throw new BlockdError("BadRequest", `"upperDir" must be an absolute directory path`);
  return dir;
}

/** A stack whose every lower exists (missing → ConfigError), with the upper of upperDir if given. */
function checkConfig(lowers: unknown, upperDir?: string): ImageConfig {
  const upper = upperDir === undefined ? undefined : { data: join(upperDir, WRITABLE_DATA), index: join(upperDir, WRITABLE_INDEX) };
  const config = parseImageConfig({ lowers: checkLowers(lowers), upper });
  config.lowers.forEach((l, i) => resolveLayerPath(l, i));
  return config;
}

/** A pool device that holds nothing: not acquired, not prepared, not being prepared. */
function isPlainIdle(d: Device): boolean {
  return d.rec.kind === "pool" && !d.rec.acquired && d.rec.config === null && !d.prepared;
}

/** Which prepared devices fit an acquire: the lowers' files and the upper's size. */
function stackKey(config: ImageConfig, size: number): string {
  return JSON.stringify([config.lowers.map((l, i) => resolveLayerPath(l, i)), size]);
}

/** `fn`'s outcome as Promise.allSettled reports one. */
function settleNow(fn: () => void): PromiseSettledResult<void> {
  try {
    fn();
    return { status: "fulfilled", value: undefined };
  } catch (e) {
    return { status: "rejected", reason: e };
  }
}

/** Virtual sizes of the warm-up stack's base (2048 pages written; its held upper's too) and top (512). */
const WARM_UP_BASE_BYTES = 16 << 20;
const WARM_UP_TOP_BYTES = 4 << 20;

/** The crumb of a plain pool device's acquire (see settleAcquired): written whole, then renamed in. */
function writeAcquiredCrumb(dir: string, crumb: { config: ImageConfig; readOnly: boolean }): void {
  mkdirSync(dir, { recursive: true });
  const at = join(dir, ACQUIRED_IMAGE);
  writeFileSync(`${at}.tmp`, JSON.stringify(crumb));
  renameSync(`${at}.tmp`, at);
}

/** After the current macrotask's microtasks (a reply being sent among them). */
function afterReply(): Promise<void> {
  return new Promise((r) => setImmediate(r));
}

/**
 * Rename a directory to `to`, making to's parent when missing (makeUpper's mkdir -p), on this
 * thread: an acquire's reply waits on it (see acquirePrepared).
 */
function renameDirSync(from: string, to: string): void {
  try {
    renameSync(from, to);
  } catch (e) {
    if ((e as NodeJS.ErrnoException).code !== "ENOENT" || !existsSync(from)) throw e;
    mkdirSync(dirname(to), { recursive: true });
    renameSync(from, to);
  }
}

async function exists(path: string): Promise<boolean> {
  return stat(path).then(
    () => true,
    () => false,
  );
}

/** upperDir made (mkdir -p) for a writable layer; returns what removes it again (the directories made, or the layer's files). */
async function upperFolder(upperDir: string): Promise<() => Promise<void>> {
  const data = join(upperDir, WRITABLE_DATA);
  const index = join(upperDir, WRITABLE_INDEX);
  const madeDir = await mkdir(upperDir, { recursive: true });
  return async () => {
    if (madeDir) await rm(madeDir, { recursive: true, force: true });
    else await Promise.all([rm(data, { force: true }), rm(index, { force: true })]);
  };
}

/** A fresh writable layer in upperDir; returns what removes it again (and the directories made for it). */
async function makeUpper(upperDir: string, size: number, sparse: boolean): Promise<() => Promise<void>> {
  const remove = await upperFolder(upperDir);
  try {
    await (await WritableLayer.create(join(upperDir, WRITABLE_DATA), join(upperDir, WRITABLE_INDEX), { virtualSize: size, sparse })).close();
  } catch (e) {
    await remove();
    throw e;
  }
  return remove;
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

/**
 * A prepared folder's above.json (BLANK_ABOVE) made `text` and synced: in place when it fits (the
 * rest padded with spaces, the size unchanged, so fdatasync needs no journal commit), else anew.
 */
async function writeAbove(path: string, text: string): Promise<void> {
  const bytes = Buffer.from(text);
  if (bytes.length <= ABOVE_BYTES) {
    const f = await open(path, "r+").catch(() => undefined);
    if (f) {
      try {
        const buf = Buffer.alloc(ABOVE_BYTES, 0x20);
        buf.set(bytes);
        await f.write(buf, 0, ABOVE_BYTES, 0);
        await f.datasync();
        return;
      } finally {
        await f.close();
      }
    }
  }
  await writeSynced(path, text);
}

/** `text` written to `path` and synced before it resolves. */
async function writeSynced(path: string, text: string): Promise<void> {
  const f = await open(path, "w", 0o600);
  try {
    await f.writeFile(text);
    await f.sync();
  } finally {
    await f.close();
  }
}
