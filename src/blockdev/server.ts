// blockd: the one long-lived process that owns every block device on a node. It keeps a device
// table on disk, runs one worker per device, and answers the node's RPCs on a unix socket.

import { existsSync, mkdirSync, renameSync, rmSync, writeFileSync, readFileSync } from "node:fs";
import { join, resolve } from "node:path";
import type { Socket } from "bun";
import { umount2, MNT_DETACH } from "../../ffi/libc.ts";
import { loopAttach, loopDetach } from "../../ffi/loop.ts";
import { type ImageConfig, type LayerRef, parseImageConfig, resolveLayerPath } from "../storage/image_config.ts";
import { WRITABLE_DATA, WRITABLE_INDEX, WritableLayer } from "../storage/lsmt/writable_layer.ts";
import { DeviceHandle } from "./device.ts";
import { KeeperClient } from "./keeper_client.ts";
import { IoLimiter } from "../storage/io_limiter.ts";
import { Image } from "../storage/image.ts";
import { UblkControl } from "./ublk/control.ts";
import { UblkDevice } from "./ublk/frontend.ts";
import { BlockdError, FrameReader, PROTOCOL_VERSION, encodeFrame, type Reply, type Request } from "./protocol.ts";


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
}

interface Device {
  rec: DeviceRecord;
  handle: DeviceHandle;
  ublk?: UblkDevice;
}

const ID_RE = /^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$/;

export class Blockd {
  private devices = new Map<string, Device>();
  private serial = 0;
  private busy = new Set<string>(); // ids with an operation in flight
  private server: ReturnType<typeof Bun.listen> | undefined;
  private closing = false;
  private keeper!: KeeperClient;
  private remoteIo: IoLimiter;
  readonly socketPath: string;
  readonly frontend: "fuse" | "ublk";
  private ublkCtrl: UblkControl | undefined;

  private constructor(readonly opts: BlockdOptions) {
    this.socketPath = join(opts.stateDir, "blockd.sock");
    this.remoteIo = IoLimiter.create(opts.remoteIo ?? 32);
    const want = opts.frontend ?? (process.env.AENV_BLOCKD_FRONTEND as BlockdOptions["frontend"]) ?? "auto";
    this.frontend = want === "auto" ? (UblkControl.available() ? "ublk" : "fuse") : want;
  }

  private get tablePath(): string {
    return join(this.opts.stateDir, "devices.json");
  }
  private devPath(id: string): string {
    return join(this.opts.stateDir, "dev", id);
  }

  /** Start: re-export every device in the table, fill the pool, listen. */
  static async start(opts: BlockdOptions): Promise<Blockd> {
    const b = new Blockd({ ...opts, stateDir: resolve(opts.stateDir) });
    mkdirSync(join(b.opts.stateDir, "dev"), { recursive: true });
    b.keeper = await KeeperClient.ensure(b.opts.stateDir);
    await b.recover();
    await b.fillPool();
    b.listen();
    writeFileSync(join(b.opts.stateDir, "blockd.pid"), String(process.pid));
    return b;
  }

  private saveTable(): void {
    const tmp = `${this.tablePath}.tmp`;
    writeFileSync(tmp, JSON.stringify([...this.devices.values()].map((d) => d.rec), null, 1));
    renameSync(tmp, this.tablePath); // atomic: a crash leaves the old table or the new one
  }

  /**
   * After a crash. A device whose FUSE connection the keeper still holds is served again as it
   * is: same mount, same loop, open files keep working, and requests the dead blockd had taken
   * are resent. Otherwise the old mount is dead: detach its loop and mount afresh at the path.
   */
  private async recover(): Promise<void> {
    if (!existsSync(this.tablePath)) return;
    const recs = JSON.parse(readFileSync(this.tablePath, "utf8")) as DeviceRecord[];
    for (const rec of recs) {
      const n = Number(/-(\d+)$/.exec(rec.id)?.[1] ?? 0);
      if (n > this.serial) this.serial = n;
      try {
        if ((rec.frontend ?? "fuse") === "ublk") {
          const { handle, ublk } = await this.startUblk(rec, true);
          this.devices.set(rec.id, { rec, handle, ublk });
          continue;
        }
        const live = await this.keeper.take(rec.id);
        if (live?.length) {
          const handle = await this.startWorker(rec, live);
          this.devices.set(rec.id, { rec, handle });
          continue;
        }
        if (rec.loop) {
          try {
            loopDetach(rec.loop);
          } catch {}
        }
        try {
          umount2(rec.path, MNT_DETACH);
        } catch {}
        const handle = await this.startWorker(rec);
        const dev: Device = { rec: { ...rec, loop: undefined }, handle };
        this.devices.set(rec.id, dev);
        if (rec.loop) dev.rec.loop = loopAttach(rec.path).path;
      } catch (e) {
        console.error(`blockd: could not bring back ${rec.id}: ${(e as Error).message}`);
      }
    }
    this.saveTable();
  }

  /**
   * A ublk device: ADD_DEV + SET_PARAMS here, the queue worker FETCHes, then START_DEV. After a
   * crash (recover), the kernel kept the device: START/END_USER_RECOVERY re-attach a new worker.
   */
  private async startUblk(rec: DeviceRecord, recover = false): Promise<{ handle: DeviceHandle; ublk: UblkDevice }> {
    this.ublkCtrl ??= new UblkControl();
    let ublk: UblkDevice | undefined;
    if (recover && rec.ublkId !== undefined) {
      try {
        ublk = await UblkDevice.recover(this.ublkCtrl, rec.ublkId);
      } catch (e) {
        console.error(`blockd: ublk ${rec.ublkId} not recoverable (${(e as Error).message}); adding it anew`);
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
      await ublk.start();
      return { handle, ublk };
    } catch (e) {
      await ublk.stop().catch(() => {});
      await ublk.remove().catch(() => {});
      throw e;
    }
  }

  /** adopt: the fds the keeper kept of a live connection (its own, then its reader's clone). */
  private async startWorker(rec: DeviceRecord, adopt?: number[]): Promise<DeviceHandle> {
    if (adopt === undefined && !existsSync(rec.path)) writeFileSync(rec.path, "");
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
    await this.keeper.hold(rec.id, handle.fuseFds); // the connection now outlives us
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
      this.devices.set(rec.id, { rec, handle, ublk });
      this.saveTable();
      return rec; // already a block device: no loop needed
    }
    rec.frontend = "fuse";
    const handle = await this.startWorker(rec);
    this.devices.set(rec.id, { rec, handle });
    try {
      if (loop) rec.loop = loopAttach(rec.path, { readOnly: rec.readOnly }).path;
    } catch (e) {
      await this.keeper.drop(rec.id);
      await handle.stop();
      this.devices.delete(rec.id);
      throw e;
    }
    this.saveTable();
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
    return { id: rec.id, kind: rec.kind, path: rec.path, loop: rec.loop ?? null, readOnly: rec.readOnly, refs: rec.refs, size, config: rec.config };
  }

  // ---- RPC methods --------------------------------------------------------------------------

  private async create(p: Record<string, unknown>) {
    const { lowers, upperDir, size, sparse, loop, id } = p;
    const cfgLowers = checkLowers(lowers);
    if (typeof upperDir !== "string" || !upperDir) throw new BlockdError("BadRequest", `"upperDir" must be a directory path`);
    if (!Number.isSafeInteger(size) || (size as number) <= 0 || (size as number) % 512)
      throw new BlockdError("BadRequest", `"size" must be a positive multiple of 512`);
    const devId = id === undefined ? this.newId("rw") : checkId(id);
    if (this.devices.has(devId)) throw new BlockdError("Exists", `device ${devId} exists`);
    const data = join(upperDir, WRITABLE_DATA);
    const index = join(upperDir, WRITABLE_INDEX);
    if (existsSync(data)) throw new BlockdError("Exists", `${upperDir} already holds a writable layer`);
    const config = parseImageConfig({ lowers: cfgLowers, upper: { data, index } });
    for (let i = 0; i < config.lowers.length; i++) resolveLayerPath(config.lowers[i]!, i); // missing layer → ConfigError now
    mkdirSync(upperDir, { recursive: true });
    await (await WritableLayer.create(data, index, { virtualSize: size as number, sparse: sparse === true })).close();
    const rec = await this.addDevice({ id: devId, kind: "rw", path: this.devPath(devId), config, readOnly: false, refs: 1, size: size as number }, loop === true);
    return this.view(rec, size as number);
  }

  private async createReadOnly(p: Record<string, unknown>) {
    const config = parseImageConfig({ lowers: checkLowers(p.lowers) });
    if (!config.lowers.length) throw new BlockdError("BadRequest", "a read-only device needs at least one layer");
    const key = JSON.stringify(config.lowers.map((l, i) => resolveLayerPath(l, i)));
    for (const d of this.devices.values())
      if (d.rec.kind === "ro" && d.rec.key === key) {
        d.rec.refs++;
        this.saveTable();
        return this.view(d.rec, d.handle.size);
      }
    const devId = this.newId("ro");
    const rec = await this.addDevice({ id: devId, kind: "ro", path: this.devPath(devId), config, readOnly: true, refs: 1, key }, p.loop === true);
    return this.view(rec, this.devices.get(devId)!.handle.size);
  }

  private async restack(p: Record<string, unknown>) {
    const d = this.device(p.id);
    if (d.rec.readOnly || !d.rec.config) throw new BlockdError("ReadOnly", `device ${d.rec.id} has no writable layer`);
    if (typeof p.layerPath !== "string" || !p.layerPath) throw new BlockdError("BadRequest", `"layerPath" must be a file path`);
    return this.exclusive(d.rec.id, async () => {
      const r = await d.handle.restack(p.layerPath as string);
      d.rec.config = r.config;
      this.saveTable();
      return r;
    });
  }

  private async resize(p: Record<string, unknown>) {
    const d = this.device(p.id);
    if (!Number.isSafeInteger(p.size) || (p.size as number) <= 0 || (p.size as number) % 512)
      throw new BlockdError("BadRequest", `"size" must be a positive multiple of 512`);
    return this.exclusive(d.rec.id, async () => {
      await d.handle.resize(p.size as number);
      return this.view(d.rec, d.handle.size);
    });
  }

  private async remove(p: Record<string, unknown>) {
    const d = this.device(p.id);
    if (d.rec.kind === "ro" && --d.rec.refs > 0) {
      this.saveTable();
      return { id: d.rec.id, refs: d.rec.refs, freed: false };
    }
    await this.exclusive(d.rec.id, () => this.teardown(d));
    this.devices.delete(d.rec.id);
    this.saveTable();
    return { id: d.rec.id, refs: 0, freed: true };
  }

  private async teardown(d: Device): Promise<void> {
    if (d.ublk) {
      await d.handle.stop();
      await d.ublk.stop();
      await d.ublk.remove();
      return;
    }
    await this.keeper.drop(d.rec.id);
    if (d.rec.loop) {
      try {
        loopDetach(d.rec.loop);
      } catch {}
    }
    await d.handle.stop();
    rmSync(d.rec.path, { force: true });
  }

  private async fillPool(): Promise<void> {
    const want = this.opts.pool ?? 0;
    let have = [...this.devices.values()].filter((d) => d.rec.kind === "pool" && !d.rec.acquired).length;
    for (; have < want; have++) {
      const id = this.newId("pool");
      await this.addDevice({ id, kind: "pool", path: this.devPath(id), config: null, readOnly: true, refs: 0 }, false);
    }
  }

  /** Take a ready device and swap the image in under it (no mount, no worker start). */
  private async acquire(p: Record<string, unknown>): Promise<ReturnType<Blockd["view"]>> {
    const idle = [...this.devices.values()].find((d) => d.rec.kind === "pool" && !d.rec.acquired && !this.busy.has(d.rec.id));
    if (!idle) {
      // Pool empty: a cold device, still handed out as a pool device so release recycles it.
      const id = this.newId("pool");
      await this.addDevice({ id, kind: "pool", path: this.devPath(id), config: null, readOnly: true, refs: 0 }, false);
      return this.acquire(p);
    }
    const readOnly = p.upperDir === undefined;
    let config: ImageConfig;
    if (readOnly) config = parseImageConfig({ lowers: checkLowers(p.lowers) });
    else {
      const upperDir = p.upperDir as string;
      if (typeof upperDir !== "string" || !Number.isSafeInteger(p.size) || (p.size as number) % 512)
        throw new BlockdError("BadRequest", `"upperDir" and a "size" multiple of 512 are needed for a writable device`);
      const data = join(upperDir, WRITABLE_DATA);
      const index = join(upperDir, WRITABLE_INDEX);
      config = parseImageConfig({ lowers: checkLowers(p.lowers), upper: { data, index } });
      if (!existsSync(data)) {
        mkdirSync(upperDir, { recursive: true });
        await (await WritableLayer.create(data, index, { virtualSize: p.size as number })).close();
      }
    }
    idle.rec.acquired = true;
    try {
      await this.exclusive(idle.rec.id, () => idle.handle.swap(config, readOnly));
    } catch (e) {
      idle.rec.acquired = false;
      throw e;
    }
    idle.rec.config = config;
    idle.rec.readOnly = readOnly;
    this.saveTable();
    void this.fillPool().catch((e) => console.error(`blockd: pool refill: ${e.message}`));
    return this.view(idle.rec, idle.handle.size);
  }

  private async release(p: Record<string, unknown>) {
    const d = this.device(p.id);
    if (d.rec.kind !== "pool" || !d.rec.acquired) throw new BlockdError("BadRequest", `device ${d.rec.id} was not acquired from the pool`);
    await this.exclusive(d.rec.id, () => d.handle.swap(null, true));
    d.rec.acquired = false;
    d.rec.config = null;
    d.rec.readOnly = true;
    this.saveTable();
    return this.view(d.rec, 0);
  }

  private async list() {
    return [...this.devices.values()].map((d) => this.view(d.rec, d.handle.size));
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
      case "stats":
        return this.device(params.id).handle.stats();
      case "shutdown":
        setTimeout(() => void this.shutdown(), 10);
        return { ok: true };
      default:
        throw new BlockdError("UnknownMethod", `unknown method ${JSON.stringify(method)}`);
    }
  }

  private listen(): void {
    rmSync(this.socketPath, { force: true });
    this.server = Bun.listen<{ reader: FrameReader }>({
      unix: this.socketPath,
      socket: {
        open: (s) => {
          s.data = { reader: new FrameReader() };
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
          for (const f of frames) void this.serveFrame(s, f);
        },
      },
    });
  }

  private async serveFrame(s: Socket<{ reader: FrameReader }>, frame: Uint8Array): Promise<void> {
    let req: Request;
    try {
      req = JSON.parse(new TextDecoder().decode(frame));
      if (!req || typeof req !== "object" || typeof req.method !== "string" || typeof req.id !== "number") throw new Error("not a request object");
    } catch (e) {
      return reply(s, { v: PROTOCOL_VERSION, id: 0, error: { code: "BadRequest", message: `malformed request: ${(e as Error).message}` } });
    }
    if (req.v !== PROTOCOL_VERSION)
      return reply(s, { v: PROTOCOL_VERSION, id: req.id, error: { code: "VersionMismatch", message: `blockd speaks version ${PROTOCOL_VERSION}, not ${req.v}` } });
    try {
      const params = req.params && typeof req.params === "object" ? req.params : {};
      reply(s, { v: PROTOCOL_VERSION, id: req.id, result: await this.dispatch(req.method, params) });
    } catch (e) {
      const err = e as Error & { code?: string };
      const code = e instanceof BlockdError ? e.code : err.name && err.name !== "Error" ? err.name : "Internal";
      reply(s, { v: PROTOCOL_VERSION, id: req.id, error: { code, message: err.message } });
    }
  }

  /** Flush and stop every device; the table stays, so a later start brings them back. */
  async shutdown(exit = true): Promise<void> {
    if (this.closing) return;
    this.closing = true;
    this.server?.stop(true);
    for (const d of this.devices.values()) {
      try {
        if (d.rec.loop) loopDetach(d.rec.loop);
      } catch {}
      try {
        if (d.ublk) {
          await d.handle.stop();
          await d.ublk.stop();
          await d.ublk.remove();
          continue;
        }
        await this.keeper.drop(d.rec.id);
        await d.handle.stop();
      } catch (e) {
        console.error(`blockd: stopping ${d.rec.id}: ${(e as Error).message}`);
      }
    }
    await this.keeper.exitIfEmpty();
    rmSync(this.socketPath, { force: true });
    if (exit) process.exit(0);
  }
}

function reply(s: Socket<unknown>, r: Reply): void {
  s.write(encodeFrame(r));
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

/** The virtual size a config's stack has (ublk sets the device size before a worker opens it). */
async function imageSize(config: ImageConfig): Promise<number> {
  const image = await Image.open(config);
  try {
    return image.virtualSize;
  } finally {
    await image.close();
  }
}
