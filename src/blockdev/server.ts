// blockd: the one long-lived process that owns every block device on a node. It keeps a device
// table on disk, runs one worker per device, and answers the node's RPCs on a unix socket.
// Blockd puts the parts together, starts and stops them, and owns the calls on plain devices
// (create, createReadOnly, restack, resize, delete) and memory layers; the rest is the parts':
// device_set.ts (the devices and what the parts share), recovery.ts (start after a crash),
// pool.ts (the warm pool), prepared.ts (prepare), lender.ts (acquire, release), traces.ts
// (traces and prefetch), rpc_server.ts (the socket).

import { mkdirSync, rmSync, writeFileSync } from "node:fs";
import { rm } from "node:fs/promises";
import { isAbsolute, join, resolve } from "node:path";
import { resolveLayerPath } from "../storage/image_config.ts";
import type { DeviceRecord } from "./device_table.ts";
import { DeviceSet } from "./device_set.ts";
import { KeeperClient } from "./keeper_client.ts";
import { Lender } from "./lender.ts";
import type { MemorySource } from "./memory_layer.ts";
import { MemoryWriter } from "./memory_writer.ts";
import { checkConfig, checkId, checkSize, checkUpperDir } from "./params.ts";
import { DevicePool, type PoolOptions } from "./pool.ts";
import { PreparedDevices } from "./prepared.ts";
import { BlockdError, PROTOCOL_VERSION } from "./protocol.ts";
import { recover } from "./recovery.ts";
import { RpcServer } from "./rpc_server.ts";
import { lockState } from "./state_lock.ts";
import { Traces } from "./traces.ts";
import { UblkControl } from "./ublk/control.ts";
import { exists, makeUpper } from "./upper_dir.ts";

export interface BlockdOptions extends PoolOptions {
  stateDir: string;
  /** Remote-layer reads in flight across all devices (default 32). */
  remoteIo?: number;
  /** "auto" (default): ublk when /dev/ublk-control exists, FUSE otherwise. */
  frontend?: "auto" | "fuse" | "ublk";
}

/** How long shutdown lets calls under way finish (a restack's seal, a device start) before it stops devices. */
const SHUTDOWN_WAIT_MS = 30_000;

export class Blockd {
  private readonly devices: DeviceSet;
  private readonly pool: DevicePool;
  private readonly prepared: PreparedDevices;
  private readonly lender: Lender;
  private readonly traces: Traces;
  private readonly rpc: RpcServer;
  private readonly memoryWriter = new MemoryWriter();
  private roMaking = new Map<string, Promise<DeviceRecord>>(); // read-only devices being made, by key
  readonly socketPath: string;
  readonly frontend: "fuse" | "ublk";

  private constructor(readonly opts: BlockdOptions) {
    this.socketPath = join(opts.stateDir, "blockd.sock");
    // AENV_BLOCKD_FRONTEND: one of blockd's own settings (BlockdSettings in client.ts).
    const want = opts.frontend ?? process.env.AENV_BLOCKD_FRONTEND ?? "auto";
    if (want !== "auto" && want !== "fuse" && want !== "ublk") throw new Error(`AENV_BLOCKD_FRONTEND=${want}: expected auto, fuse or ublk`);
    this.frontend = want === "auto" ? (UblkControl.available() ? "ublk" : "fuse") : want;
    // An idle pool device whose worker died is replaced: the pool is filled again, and a prepared one's target refilled.
    this.devices = new DeviceSet(opts.stateDir, this.frontend, opts.remoteIo ?? 32, (gone) => {
      void this.pool.fillPool().catch((e) => console.error(`blockd: pool refill: ${e.message}`));
      if (gone.prepared) void this.prepared.refill();
    });
    this.pool = new DevicePool(this.devices, opts, this.memoryWriter);
    this.prepared = new PreparedDevices(this.devices, this.pool);
    this.lender = new Lender(this.devices, this.pool, this.prepared);
    this.traces = new Traces(this.devices);
    this.rpc = new RpcServer(this.socketPath, (method, params) => this.dispatch(method, params));
  }

  /** Start: re-export every device in the table, fill the pool, listen. */
  static async start(opts: BlockdOptions): Promise<Blockd> {
    const b = new Blockd({ ...opts, stateDir: resolve(opts.stateDir) });
    mkdirSync(join(b.opts.stateDir, "dev"), { recursive: true });
    mkdirSync(join(b.opts.stateDir, "prepared"), { recursive: true });
    lockState(b.opts.stateDir); // held (its fd open) until this process ends; before the keeper, which only we start
    // Scratch of pool devices' warm-up: what a blockd that died left is nobody's.
    rmSync(b.pool.warmUpDir, { recursive: true, force: true });
    mkdirSync(b.pool.warmUpDir, { recursive: true });
    b.devices.keeper = await KeeperClient.ensure(b.opts.stateDir);
    try {
      await recover(b.devices);
      await b.pool.fillPool();
      b.pool.startTrim();
      b.rpc.listen();
      writeFileSync(join(b.opts.stateDir, "blockd.pid"), String(process.pid));
    } catch (e) {
      await b.devices.keeper.exitIfEmpty().catch(() => {}); // a keeper holding nothing must not outlive a failed start
      throw e;
    }
    return b;
  }

  // ---- RPC methods --------------------------------------------------------------------------

  private async create(p: Record<string, unknown>) {
    const upperDir = checkUpperDir(p.upperDir);
    const size = checkSize(p.size);
    const devId = p.id === undefined ? this.devices.newId("rw") : checkId(p.id);
    const config = checkConfig(p.lowers, upperDir);
    const unclaimId = this.devices.claimId(devId);
    const unclaimUpper = this.devices.claimUpper(config.upper!.data);
    try {
      if (await exists(config.upper!.data)) throw new BlockdError("Exists", `${upperDir} already holds a writable layer`);
      const removeUpper = await makeUpper(upperDir, size, p.sparse === true);
      try {
        const rec = await this.devices.addDevice({ id: devId, kind: "rw", path: this.devices.devPath(devId), config, readOnly: false, refs: 1, size }, p.loop === true);
        return this.devices.view(rec, size);
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
      for (const d of this.devices.byId.values())
        if (d.rec.kind === "ro" && d.rec.key === key) {
          d.rec.refs++;
          const made = this.devices.view(d.rec, d.handle.size); // this call's count: others may add theirs while the table is written
          await this.devices.saveTable();
          return made;
        }
      const making = this.roMaking.get(key);
      if (!making) break;
      await making;
    }
    const devId = this.devices.newId("ro");
    const making = this.devices.addDevice({ id: devId, kind: "ro", path: this.devices.devPath(devId), config, readOnly: true, refs: 1, key }, p.loop === true);
    this.roMaking.set(key, making);
    try {
      const rec = await making;
      return this.devices.view(rec, this.devices.byId.get(devId)!.handle.size);
    } finally {
      this.roMaking.delete(key);
    }
  }

  private async restack(p: Record<string, unknown>) {
    const d = this.devices.device(p.id);
    if (d.rec.readOnly || !d.rec.config) throw new BlockdError("ReadOnly", `device ${d.rec.id} has no writable layer`);
    if (typeof p.layerPath !== "string" || !isAbsolute(p.layerPath)) throw new BlockdError("BadRequest", `"layerPath" must be an absolute file path`);
    return this.devices.exclusive(d.rec.id, async () => {
      const r = await d.handle.restack(p.layerPath as string);
      d.rec.config = r.config;
      await this.devices.saveTable();
      return r;
    });
  }

  private async resize(p: Record<string, unknown>) {
    const d = this.devices.device(p.id);
    const size = checkSize(p.size);
    return this.devices.exclusive(d.rec.id, async () => {
      await d.handle.resize(size);
      return this.devices.view(d.rec, d.handle.size);
    });
  }

  private async remove(p: Record<string, unknown>) {
    const d = this.devices.device(p.id);
    if (d.rec.kind === "ro" && --d.rec.refs > 0) {
      const left = { id: d.rec.id, refs: d.rec.refs, freed: false };
      await this.devices.saveTable();
      return left;
    }
    await d.committing;
    await this.devices.exclusive(d.rec.id, () => this.devices.teardown(d));
    this.devices.byId.delete(d.rec.id);
    if (d.prepared) {
      await rm(this.devices.preparedDir(d.rec.id), { recursive: true, force: true });
      void this.prepared.refill();
    }
    await this.devices.saveTable();
    return { id: d.rec.id, refs: 0, freed: true };
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

  private async list() {
    return [...this.devices.byId.values()].map((d) => this.devices.view(d.rec, d.handle.failure ? d.rec.size : d.handle.size));
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
        return this.lender.acquire(params);
      case "release":
        return this.lender.release(params);
      case "prepare":
        return this.prepared.prepare(params);
      case "memoryLayer":
        return this.memoryLayer(params);
      case "stats":
        return this.devices.device(params.id).handle.stats();
      case "traceStart":
        return this.traces.traceStart(params);
      case "traceStop":
        return this.traces.traceStop(params);
      case "prefetch":
        return this.traces.prefetch(params);
      case "shutdown":
        setTimeout(() => void this.shutdown(), 10);
        return { ok: true };
      default:
        throw new BlockdError("UnknownMethod", `unknown method ${JSON.stringify(method)}`);
    }
  }

  /** Flush and stop every device; the table stays, so a later start brings them back. */
  async shutdown(exit = true): Promise<void> {
    if (this.devices.closing) return;
    this.devices.closing = true;
    this.pool.stopTrim();
    this.rpc.stop();
    // Calls under way (a pool refill included) finish first, so no device appears after the stop below.
    let timer: Timer | undefined;
    await Promise.race([Promise.allSettled([...this.rpc.running, this.pool.filling, this.prepared.refilling]), new Promise((r) => (timer = setTimeout(r, SHUTDOWN_WAIT_MS)))]);
    clearTimeout(timer);
    await this.devices.stopAll();
    rmSync(this.socketPath, { force: true });
    if (exit) process.exit(0);
  }
}
