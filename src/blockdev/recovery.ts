// Crash recovery at start: the device table read back and checked, each device settled (an
// acquire committed by its crumb but not yet by the table comes back acquired), served again
// (its connection taken back from the fd keeper, or mounted afresh and marked lost), and what no
// device owns ended.

import { existsSync, readFileSync, readdirSync, readlinkSync, rmSync } from "node:fs";
import { isAbsolute, join } from "node:path";
import { umount2, MNT_DETACH } from "../../ffi/libc.ts";
import { loopAttach } from "../../ffi/loop.ts";
import { type LayerRef, parseImageConfig } from "../storage/image_config.ts";
import { WRITABLE_DATA, WRITABLE_INDEX } from "../storage/lsmt/writable_layer.ts";
import { DeviceHandle } from "./device.ts";
import type { Device, DeviceSet } from "./device_set.ts";
import { type DeviceRecord, loadDeviceTable } from "./device_table.ts";
import { ACQUIRED_IMAGE } from "./lender.ts";
import { detachLoop, isMountPoint, loopBackingFile, loopsBackedBy } from "./leftovers.ts";
import { ABOVE_LOWERS, ACQUIRED_CRUMB, PREPARED_UPPER } from "./prepared.ts";

/**
 * After a crash or a stop. The table is checked entry by entry: a bad entry is reported and left
 * out (the file as it was is set aside), the good devices come back. A FUSE device whose
 * connection the keeper still holds is served again as it is: same mount, same loop, open files
 * keep working, and requests the dead blockd had taken are resent. Otherwise its old mount, if
 * one is there, is dead: its loop is detached, it is mounted afresh at its path and marked lost.
 * A device that cannot be brought back is kept as failed. What the table does not name (a bad
 * entry's connection in the keeper, its mount, its loop) is ended, so nothing waits on it.
 */
export async function recover(devices: DeviceSet): Promise<void> {
  const table = loadDeviceTable(devices.tablePath, devices.stateDir);
  for (const p of table.problems) console.error(`blockd: ${p}; left out`);
  if (table.setAside) console.error(`blockd: ${devices.tablePath} as it was is kept in ${table.setAside}`);
  for (const rec of table.records) {
    devices.noteId(rec.id);
    settlePrepared(devices, rec);
    let dev: Device;
    try {
      dev = await bringBack(devices, rec);
    } catch (e) {
      const why = (e as Error).message;
      console.error(`blockd: could not bring back ${rec.id}: ${why}`);
      if (rec.kind === "pool" && !rec.acquired) continue; // holds nothing: endUnnamed clears it, fillPool replaces it
      rec.state = "failed";
      rec.reason = `not brought back at start: ${why}`;
      dev = { rec, handle: DeviceHandle.failed(rec.id, rec.reason) };
    }
    devices.register(dev);
  }
  await endUnnamed(devices);
  await devices.saveTable();
  // Only now that the table names every acquired device: what prepared devices left is blockd's own scratch.
  const prepared = join(devices.stateDir, "prepared");
  for (const name of readdirSync(prepared)) rmSync(join(prepared, name), { recursive: true, force: true });
}

/**
 * A pool entry that was prepared (lowers, no upper, not acquired) comes back as an idle device,
 * unless an acquire had taken it before its table entry was written: its fresh upper is then gone
 * from the device's prepared folder, renamed to the caller's upperDir, and the crumb there names
 * where. The rename is what an acquire commits on, so such a device comes back acquired.
 */
function settlePrepared(devices: DeviceSet, rec: DeviceRecord): void {
  if (rec.kind !== "pool") return;
  // An acquired read-only entry with a crumb: an acquire onto it that the table write did not follow (acquireOnto).
  if (rec.acquired) return void (rec.readOnly && settleAcquired(devices, rec));
  if (!rec.config) return settleAcquired(devices, rec);
  if (rec.config.upper) return;
  const dir = devices.preparedDir(rec.id);
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
function settleAcquired(devices: DeviceSet, rec: DeviceRecord): void {
  let text: string;
  try {
    text = readFileSync(join(devices.preparedDir(rec.id), ACQUIRED_IMAGE), "utf8");
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
async function bringBack(devices: DeviceSet, rec: DeviceRecord): Promise<Device> {
  const wasFailed = rec.state === "failed" ? rec.reason : undefined;
  if ((rec.frontend ?? "fuse") === "ublk") {
    const { handle, ublk, replaced } = await devices.startUblk(rec, true);
    if (replaced) markLost(rec, `its ublk device could not be recovered and was added anew as ${rec.path}`);
    else if (wasFailed) markLost(rec, wasFailed);
    return { rec, handle, ublk };
  }
  const live = await devices.keeper.take(rec.id);
  let ended: string | undefined;
  if (live?.length) {
    try {
      const handle = await devices.startWorker(rec, live);
      if (wasFailed) markLost(rec, wasFailed);
      return { rec, handle };
    } catch (e) {
      // Nobody will serve this connection: end it, so its users get errors instead of a wait
      // (the worker that failed closed our copies of its fds).
      await devices.keeper.drop(rec.id);
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
  const handle = await devices.startWorker(rec);
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
    markLost(rec, `${wasFailed ?? ended ?? "its FUSE connection died with blockd and the fd keeper"}; mounted afresh at ${rec.path}${loopLost}`);
  return { rec, handle };
}

function markLost(rec: DeviceRecord, why: string): void {
  rec.state = "lost";
  rec.reason = why;
  console.error(`blockd: device ${rec.id} is lost: ${why}. It serves again, but whatever had it open got I/O errors; it stays "lost" until deleted`);
}

/**
 * Connections the keeper holds for no device (a bad table entry's) are dropped, and the leftovers
 * under <state>/dev that no device owns (dead mounts, loops over them) are cleared.
 */
async function endUnnamed(devices: DeviceSet): Promise<void> {
  for (const key of await devices.keeper.keys()) {
    if (devices.byId.has(key)) continue;
    console.error(`blockd: the fd keeper held a connection for ${JSON.stringify(key)}, a device the table does not name; ending it`);
    await devices.keeper.drop(key);
  }
  const devDir = join(devices.stateDir, "dev");
  for (const id of readdirSync(devDir)) {
    if (devices.byId.has(id)) continue;
    const path = devices.devPath(id);
    for (const loop of loopsBackedBy(path)) detachLoop(loop);
    if (isMountPoint(path)) {
      console.error(`blockd: ${path} is mounted but no device in the table owns it; unmounting it`);
      umount2(path, MNT_DETACH);
    }
    rmSync(path, { force: true });
  }
}
