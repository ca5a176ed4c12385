// Pool devices lent out and taken back: `acquire` (a prepared device first, else an idle one with
// the image swapped in under it), `acquire` onto a read-only device the caller gives up into it,
// and `release`. An acquire commits on a crumb in the device's folder and replies before the
// table is written (DeviceSet.commitLater).

import { mkdirSync, renameSync, writeFileSync } from "node:fs";
import { rm } from "node:fs/promises";
import { join } from "node:path";
import { type ImageConfig, resolveLayerPath } from "../storage/image_config.ts";
import type { DeviceSet, DeviceView } from "./device_set.ts";
import { checkConfig, checkSize, checkUpperDir } from "./params.ts";
import type { DevicePool } from "./pool.ts";
import type { PreparedDevices } from "./prepared.ts";
import { BlockdError } from "./protocol.ts";
import { exists, upperFolder } from "./upper_dir.ts";

/** A plain pool device's acquire, until the table names it: the image it was given. */
export const ACQUIRED_IMAGE = "acquired.json";

export class Lender {
  private releases = 0;

  constructor(
    private readonly devices: DeviceSet,
    private readonly pool: DevicePool,
    private readonly prepared: PreparedDevices,
  ) {}

  /**
   * Take a ready device and swap the image in under it (no mount, no worker start). A device
   * prepared for the same lowers and size goes first (PreparedDevices.acquire).
   */
  async acquire(p: Record<string, unknown>): Promise<DeviceView & { prepared: boolean }> {
    const readOnly = p.upperDir === undefined;
    const config = readOnly ? checkConfig(p.lowers) : checkConfig(p.lowers, checkUpperDir(p.upperDir));
    const size = readOnly ? 0 : checkSize(p.size);
    if (readOnly && !config.lowers.length) throw new BlockdError("BadRequest", "a read-only device needs at least one layer");
    if (p.onto !== undefined) {
      if (!readOnly) throw new BlockdError("BadRequest", `"onto" is for a read-only acquire (no "upperDir")`);
      return this.acquireOnto(config, p.onto);
    }
    const unclaimUpper = config.upper ? this.devices.claimUpper(config.upper.data) : () => {};
    try {
      if (!readOnly) {
        const fast = await this.prepared.acquire(config, checkUpperDir(p.upperDir), size);
        if (fast) return { ...this.devices.view(fast.rec, fast.handle.size), prepared: true };
      }
      const { dev, cold } = await this.pool.reserveIdle();
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
        writeAcquiredCrumb(this.devices.preparedDir(dev.rec.id), { config, readOnly });
        dev.rec.acquired = true;
        dev.rec.config = config;
        dev.rec.readOnly = readOnly;
      } catch (e) {
        if (swapped) await dev.handle.swap(null, true).catch(() => {});
        await removeUpper?.();
        if (cold) await this.pool.dropCold(dev);
        throw e;
      } finally {
        this.devices.busy.delete(dev.rec.id);
      }
      this.devices.commitLater(dev);
      void this.pool.fillPool().catch((e) => console.error(`blockd: pool refill: ${e.message}`));
      return { ...this.devices.view(dev.rec, dev.handle.size), prepared: false };
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
  private async acquireOnto(config: ImageConfig, onto: unknown): Promise<DeviceView & { prepared: boolean }> {
    if (typeof onto !== "string") throw new BlockdError("BadRequest", `"onto" must be a device id`);
    const dev = this.devices.device(onto);
    const id = dev.rec.id;
    const has = dev.rec.config?.lowers.map((l, i) => resolveLayerPath(l, i));
    if (dev.rec.kind !== "pool" || !dev.rec.acquired || !dev.rec.readOnly || !has)
      throw new BlockdError("BadRequest", `"onto": device ${id} is not a read-only device taken by acquire`);
    const want = config.lowers.map((l, i) => resolveLayerPath(l, i));
    if (has.length >= want.length || has.some((path, i) => path !== want[i]))
      throw new BlockdError("BadRequest", `"onto": device ${id}'s ${has.length} lowers are not the first of these ${want.length}`);
    return this.devices.exclusive(id, async () => {
      await dev.committing; // its own acquire's table write and crumb removal come first
      await dev.handle.extend({ lowers: config.lowers.slice(has.length) });
      // As a plain acquire commits: the crumb now, the table after the reply.
      try {
        writeAcquiredCrumb(this.devices.preparedDir(id), { config, readOnly: true });
      } catch (e) {
        await dev.handle.swap(dev.rec.config, true).catch(() => {}); // back to the stack the table names
        throw e;
      }
      dev.rec.config = config;
      this.devices.commitLater(dev);
      return { ...this.devices.view(dev.rec, dev.handle.size), prepared: false };
    });
  }

  async release(p: Record<string, unknown>) {
    const d = this.devices.device(p.id);
    if (d.rec.kind !== "pool" || !d.rec.acquired) throw new BlockdError("BadRequest", `device ${d.rec.id} was not acquired from the pool`);
    await d.committing; // its crumb is gone before it can be prepared again
    await this.devices.exclusive(d.rec.id, () => d.handle.swap(null, true));
    d.rec.acquired = false;
    d.rec.config = null;
    d.rec.readOnly = true;
    d.releasedAt = ++this.releases;
    d.idleSince = Date.now();
    const released = this.devices.view(d.rec, 0);
    // A crumb left by a table write that failed would bring the device back acquired: it goes first.
    await rm(this.devices.preparedDir(d.rec.id), { recursive: true, force: true });
    await this.devices.saveTable();
    return released;
  }
}

/** The crumb of a plain pool device's acquire (see settleAcquired): written whole, then renamed in. */
function writeAcquiredCrumb(dir: string, crumb: { config: ImageConfig; readOnly: boolean }): void {
  mkdirSync(dir, { recursive: true });
  const at = join(dir, ACQUIRED_IMAGE);
  writeFileSync(`${at}.tmp`, JSON.stringify(crumb));
  renameSync(`${at}.tmp`, at);
}
