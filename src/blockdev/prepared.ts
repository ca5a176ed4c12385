// Prepared devices (`prepare`): pool devices whose worker already holds a stack's lowers open with
// a fresh upper over them, kept at each target's count by a refill in the background, and taken
// by an acquire of that stack (or of one that begins with it) with a rename instead of a swap.

import { existsSync, mkdirSync, renameSync, symlinkSync } from "node:fs";
import { mkdir, open, rename, rm, symlink } from "node:fs/promises";
import { dirname, join } from "node:path";
import { type ImageConfig, type LayerRef, parseImageConfig, resolveLayerPath } from "../storage/image_config.ts";
import { WRITABLE_DATA, WRITABLE_INDEX } from "../storage/lsmt/writable_layer.ts";
import { type Device, type DeviceSet, afterReply } from "./device_set.ts";
import { checkConfig, checkLowers, checkSize } from "./params.ts";
import type { DevicePool } from "./pool.ts";
import { BlockdError } from "./protocol.ts";
import { exists } from "./upper_dir.ts";

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
export const PREPARED_UPPER = "upper";
export const ACQUIRED_CRUMB = "acquired";
/** In a prepared folder: the lowers an acquire stacks above the prepared ones (JSON), written before its rename. */
export const ABOVE_LOWERS = "above.json";
/** above.json is made this long and blank (spaces) at prepare: an acquire overwrites it in place, a data-only sync. */
const ABOVE_BYTES = 16384;
const BLANK_ABOVE = " ".repeat(ABOVE_BYTES);

export class PreparedDevices {
  private targets = new Map<string, PrepareTarget>(); // prepare's, by stackKey
  private refillRunning: Promise<void> | undefined;
  private refillQueued: Promise<void> | undefined;

  constructor(
    private readonly devices: DeviceSet,
    private readonly pool: DevicePool,
  ) {}

  /** The refill under way, if any (shutdown lets it finish). */
  get refilling(): Promise<void> | undefined {
    return this.refillRunning;
  }

  /**
   * An acquire's device, if a prepared one serves it (acquirePrepared); undefined: acquire goes on
   * without one. The acquire counts against its stack's target first (served).
   */
  async acquire(config: ImageConfig, upperDir: string, size: number): Promise<Device | undefined> {
    const key = stackKey(config, size);
    const counted = this.served(key);
    const fast = await this.acquirePrepared(config, upperDir, key);
    if (counted && !fast) void this.refill(); // what the target has prepared past its count goes
    return fast;
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
    this.devices.busy.add(id);
    const folder = this.devices.preparedDir(id);
    const fresh = join(folder, PREPARED_UPPER);
    const crumb = join(folder, ACQUIRED_CRUMB);
    const aboveFile = join(folder, ABOVE_LOWERS);
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
        if (e.code === "EXDEV") console.error(`blockd: ${upperDir} is not on the filesystem of ${this.devices.stateDir}: prepared devices cannot serve it`);
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
      this.devices.commitLater(dev);
      void afterReply().then(() => this.refill());
      return dev;
    } finally {
      this.devices.busy.delete(id);
      if (retire) void this.pool.retireIdle(dev).then(() => this.refill());
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
    for (const d of this.devices.byId.values()) {
      if (!d.prepared || d.handle.failure || this.devices.busy.has(d.rec.id)) continue;
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
  async prepare(p: Record<string, unknown>) {
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
    await this.refill();
    const ready = this.preparedCount(key);
    if (ready < target.count && this.targets.get(key) === target && target.error) {
      if (before) this.targets.set(key, { ...before, failedAt: undefined, error: undefined });
      else this.targets.delete(key);
      await this.refill(); // retires what this call prepared
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
    await this.refill();
    return { lowers: (JSON.parse(key) as [string[], number])[0], size, count: 0, ready: this.preparedCount(key) };
  }

  private preparedCount(key: string): number {
    let n = 0;
    for (const d of this.devices.byId.values()) if (d.prepared === key) n++;
    return n;
  }

  /** One refill at a time; a call during one is served by the next, which starts after it. */
  refill(): Promise<void> {
    if (!this.refillRunning) {
      this.refillRunning = this.refillPass().finally(() => (this.refillRunning = undefined));
      return this.refillRunning;
    }
    return (this.refillQueued ??= this.refillRunning.then(() => {
      this.refillQueued = undefined;
      return this.refill();
    }));
  }

  /** Every target topped up to its count, PREPARE_AT_ONCE at a time (a failing one waits PREPARE_RETRY_MS), surplus retired, pool filled. */
  private async refillPass(): Promise<void> {
    for (const [key, t] of this.targets) {
      if (t.failedAt !== undefined && Date.now() - t.failedAt < PREPARE_RETRY_MS) continue;
      while (!this.devices.closing && this.targets.get(key) === t && this.preparedCount(key) < t.count) {
        // Idle devices are prepared PREPARE_AT_ONCE at a time; cold ones (a worker start each) one by one.
        const n = Math.min(t.count - this.preparedCount(key), PREPARE_AT_ONCE, Math.max(1, this.pool.idleCount()));
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
    for (const d of this.devices.byId.values()) {
      if (!d.prepared || this.devices.busy.has(d.rec.id)) continue;
      const n = (surplus.get(d.prepared) ?? 0) + 1;
      surplus.set(d.prepared, n);
      if (n > (this.targets.get(d.prepared)?.count ?? 0)) await this.pool.retireIdle(d);
    }
    await this.pool.fillPool().catch((e) => console.error(`blockd: pool refill: ${e.message}`));
  }

  /**
   * An idle device made ready for target `t`: a fresh upper in its prepared folder, the lowers
   * opened by its worker, and the table naming it prepared (written before anyone may take it).
   */
  private async prepareOne(key: string, t: PrepareTarget): Promise<void> {
    const { dev, cold } = await this.pool.reserveIdle();
    const dir = this.devices.preparedDir(dev.rec.id);
    try {
      const fresh = join(dir, PREPARED_UPPER);
      await rm(dir, { recursive: true, force: true });
      await mkdir(fresh, { recursive: true });
      await writeSynced(join(dir, ABOVE_LOWERS), BLANK_ABOVE);
      // The worker makes the fresh upper (sync file creations stall under journal load: not on this loop).
      await dev.handle.swap({ lowers: t.lowers }, true, { data: join(fresh, WRITABLE_DATA), index: join(fresh, WRITABLE_INDEX), size: t.size });
      dev.rec.config = { lowers: t.lowers };
      await this.devices.saveTable();
      dev.prepared = key;
    } catch (e) {
      dev.rec.config = null;
      await rm(dir, { recursive: true, force: true }).catch(() => {});
      if (cold) await this.pool.dropCold(dev);
      else await dev.handle.swap(null, true).catch(() => {}); // a swap that failed half way may have left the lowers open
      throw e;
    } finally {
      this.devices.busy.delete(dev.rec.id);
      if (!cold && dev.handle.failure) void this.pool.retireIdle(dev); // died while busy: workerDied left it to us
    }
  }
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
