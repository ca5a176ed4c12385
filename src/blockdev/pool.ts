// The warm pool: pool devices made ahead of acquire (a worker and a mount each), each warmed up
// before anyone may take it, reserved one at a time for an acquire or a prepare, and the surplus
// past the pool's size retired after it stays idle a while.

import { writeFile, rm } from "node:fs/promises";
import { join } from "node:path";
import type { Device, DeviceSet } from "./device_set.ts";
import type { MemoryWriter } from "./memory_writer.ts";

export interface PoolOptions {
  /** Ready devices kept for acquire (0 = none). */
  pool?: number;
  /** How long a plain idle pool device past `pool` stays before it is retired (default POOL_SURPLUS_IDLE_MS). */
  poolIdleMs?: number;
}

/** A plain idle pool device past the pool's size is retired after this long unused. */
const POOL_SURPLUS_IDLE_MS = 30_000;
/** How often the pool's surplus is looked at, at most. */
const POOL_TRIM_INTERVAL_MS = 5_000;
/** Virtual sizes of the warm-up stack's base (2048 pages written; its held upper's too) and top (512). */
const WARM_UP_BASE_BYTES = 16 << 20;
const WARM_UP_TOP_BYTES = 4 << 20;

export class DevicePool {
  private fill: Promise<void> | undefined;
  private poolTrim: Timer | undefined;
  private trimming = false;
  /** The warm-up's sealed stack (base, top), once made. */
  private warmUpLayers: Promise<string[]> | undefined;

  constructor(
    private readonly devices: DeviceSet,
    private readonly opts: PoolOptions,
    private readonly memoryWriter: MemoryWriter,
  ) {}

  /** Pool workers' warm-up scratch. */
  get warmUpDir(): string {
    return join(this.devices.stateDir, "warm-up");
  }

  /** The fill under way, if any (shutdown lets it finish). */
  get filling(): Promise<void> | undefined {
    return this.fill;
  }

  /** Top the pool up to its size; one refill at a time (two would both fill the same gap). */
  fillPool(): Promise<void> {
    const idle = () => [...this.devices.byId.values()].filter((d) => isPlainIdle(d)).length;
    this.fill ??= (async () => {
      while (!this.devices.closing && idle() < (this.opts.pool ?? 0)) {
        const id = this.devices.newId("pool");
        this.devices.busy.add(id); // nobody takes it before its warm-up is over
        try {
          await this.devices.addDevice({ id, kind: "pool", path: this.devices.devPath(id), config: null, readOnly: true, refs: 0 }, false);
          await this.warmUp(this.devices.byId.get(id)!);
        } finally {
          this.devices.busy.delete(id);
        }
      }
    })().finally(() => (this.fill = undefined));
    return this.fill;
  }

  private get poolIdleMs(): number {
    return this.opts.poolIdleMs ?? POOL_SURPLUS_IDLE_MS;
  }

  /** The surplus trim runs from start (after the first fill) to shutdown. */
  startTrim(): void {
    this.poolTrim = setInterval(() => void this.trimPool(), Math.min(this.poolIdleMs, POOL_TRIM_INTERVAL_MS));
  }
  stopTrim(): void {
    clearInterval(this.poolTrim);
  }

  /**
   * Plain idle pool devices past the pool's size, idle for poolIdleMs, are retired (worker, mount,
   * ~8.5 MiB each): a burst's devices serve the next burst, and a quiet node falls back to `pool`.
   */
  private async trimPool(): Promise<void> {
    if (this.devices.closing || this.fill || this.trimming) return;
    this.trimming = true;
    try {
      await this.trimPoolOnce();
    } finally {
      this.trimming = false;
    }
  }

  private async trimPoolOnce(): Promise<void> {
    const now = Date.now();
    const busy = this.devices.busy;
    const idle = [...this.devices.byId.values()].filter((d) => isPlainIdle(d) && !busy.has(d.rec.id));
    for (const d of idle) d.idleSince ??= now; // made by the pool's fill, or found at start
    idle.sort((a, b) => (b.idleSince ?? 0) - (a.idleSince ?? 0));
    for (const d of idle.slice(this.opts.pool ?? 0)) if (now - (d.idleSince ?? 0) >= this.poolIdleMs && isPlainIdle(d) && !busy.has(d.rec.id)) await this.retireIdle(d);
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
  async reserveIdle(): Promise<{ dev: Device; cold: boolean }> {
    const busy = this.devices.busy;
    let best: Device | undefined;
    for (const d of this.devices.byId.values())
      if (isPlainIdle(d) && !d.handle.failure && !busy.has(d.rec.id) && (d.releasedAt ?? 0) >= (best?.releasedAt ?? 0)) best = d;
    if (best) {
      busy.add(best.rec.id);
      return { dev: best, cold: false };
    }
    // Still a pool device, so release recycles it.
    const id = this.devices.newId("pool");
    busy.add(id);
    try {
      await this.devices.addDevice({ id, kind: "pool", path: this.devices.devPath(id), config: null, readOnly: true, refs: 0 }, false);
    } catch (e) {
      busy.delete(id);
      throw e;
    }
    return { dev: this.devices.byId.get(id)!, cold: true };
  }

  /** Plain idle devices free to take now. */
  idleCount(): number {
    let n = 0;
    for (const d of this.devices.byId.values()) if (isPlainIdle(d) && !d.handle.failure && !this.devices.busy.has(d.rec.id)) n++;
    return n;
  }

  /** An idle device that is not wanted (a prepared one past its target, or one whose worker failed) goes: worker, mount, folder. */
  async retireIdle(d: Device): Promise<void> {
    try {
      await this.devices.exclusive(d.rec.id, () => this.devices.teardown(d));
      this.devices.byId.delete(d.rec.id);
      await rm(this.devices.preparedDir(d.rec.id), { recursive: true, force: true });
      await this.devices.saveTable();
    } catch (e) {
      console.error(`blockd: retiring idle device ${d.rec.id}: ${(e as Error).message}`);
    }
  }

  /** A cold device made for an acquire that then failed: it goes, so the failure leaves nothing. */
  async dropCold(dev: Device): Promise<void> {
    try {
      await this.devices.teardown(dev);
      this.devices.byId.delete(dev.rec.id);
      await this.devices.saveTable();
    } catch (e) {
      console.error(`blockd: removing ${dev.rec.id}: ${(e as Error).message}`);
    }
  }
}

/** A pool device that holds nothing: not acquired, not prepared, not being prepared. */
function isPlainIdle(d: Device): boolean {
  return d.rec.kind === "pool" && !d.rec.acquired && d.rec.config === null && !d.prepared;
}
