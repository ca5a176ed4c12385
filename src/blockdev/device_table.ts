// The device table on disk (<state>/devices.json): read at start and checked entry by entry. blockd
// mounts, unmounts and detaches what a record names, so a record is trusted only once every field
// is of its kind and its paths are the ones blockd itself gives a device. A bad entry is left out
// (the others come back) and the file as it was is kept beside the table for a person to read.

import { existsSync, readFileSync, renameSync } from "node:fs";
import { open, rename } from "node:fs/promises";
import { join } from "node:path";
import { type ImageConfig, parseImageConfig } from "../storage/image_config.ts";
import { ublkBlockPath } from "./ublk/control.ts";

/** Device ids: what blockd hands out and what `create` accepts. */
export const ID_RE = /^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$/;
/** A table larger than this is not one blockd wrote (a record is well under 4 KiB). */
export const MAX_TABLE_BYTES = 64 << 20;
const LOOP_RE = /^\/dev\/loop\d{1,6}$/;
const KINDS = ["rw", "ro", "pool"];

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

export interface LoadedTable {
  records: DeviceRecord[];
  /** One line per entry left out (or for the whole file), naming it and why. */
  problems: string[];
  /** Where the file was moved when something in it was bad. */
  setAside?: string;
}

/** Where a FUSE device of `id` is mounted: the only path a FUSE record may name. */
export function fuseDevicePath(stateDir: string, id: string): string {
  return join(stateDir, "dev", id);
}

/** Read and check the table; when anything in it is bad, move the file to devices.json.bad-<time>. */
export function loadDeviceTable(tablePath: string, stateDir: string, now = new Date()): LoadedTable {
  if (!existsSync(tablePath)) return { records: [], problems: [] };
  const { records, problems } = checkDeviceTable(readFileSync(tablePath), stateDir);
  if (!problems.length) return { records, problems };
  const setAside = `${tablePath}.bad-${now.toISOString().replace(/[:.]/g, "-")}`;
  renameSync(tablePath, setAside);
  return { records, problems, setAside };
}

/** The good records of a table file's bytes, and a line for each bad one. */
export function checkDeviceTable(bytes: Uint8Array, stateDir: string): { records: DeviceRecord[]; problems: string[] } {
  if (bytes.length > MAX_TABLE_BYTES) return { records: [], problems: [`devices.json is ${bytes.length} bytes, over ${MAX_TABLE_BYTES}: not a device table`] };
  let raw: unknown;
  try {
    raw = JSON.parse(new TextDecoder("utf-8", { fatal: true }).decode(bytes));
  } catch (e) {
    return { records: [], problems: [`devices.json is not JSON (${(e as Error).message})`] };
  }
  if (!Array.isArray(raw)) return { records: [], problems: [`devices.json is not a list of devices (it is ${raw === null ? "null" : typeof raw})`] };
  const records: DeviceRecord[] = [];
  const problems: string[] = [];
  const seen = new Set<string>();
  raw.forEach((entry, i) => {
    const id = entry && typeof entry === "object" && typeof (entry as { id?: unknown }).id === "string" ? (entry as { id: string }).id : undefined;
    const name = `devices.json entry ${i}${id === undefined ? "" : ` (id ${JSON.stringify(id.slice(0, 80))})`}`;
    const why = checkRecord(entry, stateDir) ?? (seen.has(id!) ? "the id appears twice" : undefined);
    if (why) return void problems.push(`${name}: ${why}`);
    seen.add(id!);
    records.push(entry as DeviceRecord);
  });
  return { records, problems };
}

/** Why `r` is not a record blockd wrote, or undefined when it is one. */
function checkRecord(r: unknown, stateDir: string): string | undefined {
  if (!r || typeof r !== "object" || Array.isArray(r)) return "not an object";
  const o = r as Record<string, unknown>;
  if (typeof o.id !== "string" || !ID_RE.test(o.id)) return `"id" must match ${ID_RE}`;
  if (!KINDS.includes(o.kind as string)) return `"kind" must be one of ${KINDS.join(", ")}`;
  if (typeof o.readOnly !== "boolean") return `"readOnly" must be a boolean`;
  if (!Number.isSafeInteger(o.refs) || (o.refs as number) < 0) return `"refs" must be a count`;
  if (o.frontend !== undefined && o.frontend !== "fuse" && o.frontend !== "ublk") return `"frontend" must be fuse or ublk`;
  if (o.size !== undefined && (!Number.isSafeInteger(o.size) || (o.size as number) <= 0 || (o.size as number) % 512)) return `"size" must be a positive multiple of 512`;
  for (const k of ["key", "reason"]) if (o[k] !== undefined && typeof o[k] !== "string") return `"${k}" must be a string`;
  if (o.acquired !== undefined && typeof o.acquired !== "boolean") return `"acquired" must be a boolean`;
  if (o.state !== undefined && o.state !== "lost" && o.state !== "failed") return `"state" must be lost or failed`;
  if (o.config === null) {
    if (o.kind !== "pool") return `a ${o.kind} device needs a "config"`;
  } else {
    try {
      const cfg = parseImageConfig(o.config);
      if (o.kind === "rw" && !cfg.upper) return `a rw device's config needs an "upper"`;
    } catch (e) {
      return `"config": ${(e as Error).message}`;
    }
  }
  if (o.frontend === "ublk") {
    if (!Number.isSafeInteger(o.ublkId) || (o.ublkId as number) < 0 || (o.ublkId as number) >= 0xffffffff) return `"ublkId" must be a ublk device number`;
    if (o.size === undefined) return `a ublk device needs its "size"`;
    if (o.path !== ublkBlockPath(o.ublkId as number)) return `"path" must be ${ublkBlockPath(o.ublkId as number)} for ublk device ${o.ublkId}`;
    if (o.loop !== undefined) return `a ublk device has no "loop"`;
  } else {
    if (o.ublkId !== undefined) return `a FUSE device has no "ublkId"`;
    const want = fuseDevicePath(stateDir, o.id);
    if (o.path !== want) return `"path" must be ${want}`; // never mount over, or unmount, anything else
    if (o.loop !== undefined && (typeof o.loop !== "string" || !LOOP_RE.test(o.loop))) return `"loop" must be /dev/loopN`;
  }
  return undefined;
}

/**
 * Writes the table without blocking the event loop. One write at a time (temp file, fsync, rename:
 * the file on disk is always a whole table, the old one or the new), and every save asked for
 * during a write is served by the one next write, which takes the table as it is when it starts.
 * So a burst of changes costs at most two writes, the last state always lands, and a save
 * resolves only once a write that holds its change is on disk.
 */
export class TableWriter {
  private writing: Promise<void> | undefined;
  private next: PromiseWithResolvers<void> | undefined;

  constructor(
    readonly path: string,
    private readonly records: () => DeviceRecord[],
  ) {}

  save(): Promise<void> {
    const batch = (this.next ??= Promise.withResolvers<void>());
    if (!this.writing) this.writeNext();
    return batch.promise;
  }

  /** Once every save asked for so far is written (or failed). */
  async idle(): Promise<void> {
    while (this.writing) await this.writing;
  }

  private writeNext(): void {
    const batch = this.next!;
    this.next = undefined;
    this.writing = this.write()
      .then(batch.resolve, batch.reject)
      .finally(() => {
        this.writing = undefined;
        if (this.next) this.writeNext();
      });
  }

  private async write(): Promise<void> {
    const text = JSON.stringify(this.records(), null, 1); // the table as it is now, for every save waiting
    const bytes = Buffer.byteLength(text);
    if (bytes > MAX_TABLE_BYTES) throw new Error(`device table of ${bytes} bytes is over ${MAX_TABLE_BYTES}`);
    const tmp = `${this.path}.tmp`;
    const f = await open(tmp, "w");
    try {
      await f.writeFile(text);
      await f.sync();
    } finally {
      await f.close();
    }
    await rename(tmp, this.path); // atomic: a crash leaves the old table or the new one
  }
}
