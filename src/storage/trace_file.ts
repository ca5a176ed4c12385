// The prefetch trace file (AETRACE1, docs/blockd.md, Prefetch traces): a device's granules in the
// order of their first read, with the device's size and a crc32c over the whole. blockd records and
// replays them; templates carry them in images.

import { crc32c } from "./crc32c.ts";

/** "AETRACE1": the file's first 8 bytes. */
const MAGIC = new TextEncoder().encode("AETRACE1");
/** magic 8, device size u64 8, granule u32 4, count u32 4; then count u32 granule indexes, then crc32c u32. */
const HEADER = 24;
/** Granules a trace holds at most (256 KiB of indexes; a boot reads a few thousand 64 KiB granules). */
export const TRACE_MAX_ENTRIES = 65536;
export const TRACE_MIN_GRANULE = 4096;
export const TRACE_MAX_GRANULE = 16 << 20;
/** The smallest trace file (no entries) and the largest (TRACE_MAX_ENTRIES): a file outside them is refused unread. */
export const TRACE_MIN_FILE = HEADER + 4;
export const TRACE_MAX_FILE = HEADER + 4 * TRACE_MAX_ENTRIES + 4;

/** A trace file that is not one (truncated, bad magic or checksum) or does not fit the device. */
export class TraceError extends Error {
  override name = "TraceError";
}

export interface Trace {
  /** The device's size in bytes when it was recorded: a replay needs a device of this size. */
  size: number;
  granule: number;
  /** Granule indexes in the order of their first read, each once. */
  entries: Uint32Array;
}

export function encodeTrace(t: Trace): Uint8Array<ArrayBuffer> {
  const out = new Uint8Array(HEADER + 4 * t.entries.length + 4);
  const v = new DataView(out.buffer);
  out.set(MAGIC, 0);
  v.setBigUint64(8, BigInt(t.size), true);
  v.setUint32(16, t.granule, true);
  v.setUint32(20, t.entries.length, true);
  for (let i = 0; i < t.entries.length; i++) v.setUint32(HEADER + 4 * i, t.entries[i]!, true);
  v.setUint32(out.length - 4, crc32c(out.subarray(0, out.length - 4)), true);
  return out;
}

/** A trace file checked whole: magic, length, checksum, granule, every index inside the device. */
export function decodeTrace(bytes: Uint8Array, what = "trace"): Trace {
  if (bytes.length < TRACE_MIN_FILE) throw new TraceError(`${what}: ${bytes.length} bytes is too short for a trace`);
  if (!MAGIC.every((b, i) => bytes[i] === b)) throw new TraceError(`${what}: not a trace file (bad magic)`);
  const v = new DataView(bytes.buffer, bytes.byteOffset, bytes.length);
  const size = Number(v.getBigUint64(8, true));
  const granule = v.getUint32(16, true);
  const count = v.getUint32(20, true);
  if (count > TRACE_MAX_ENTRIES) throw new TraceError(`${what}: ${count} entries exceed ${TRACE_MAX_ENTRIES}`);
  if (bytes.length !== HEADER + 4 * count + 4) throw new TraceError(`${what}: ${bytes.length} bytes, but ${count} entries need ${HEADER + 4 * count + 4} (truncated?)`);
  if (v.getUint32(bytes.length - 4, true) !== crc32c(bytes.subarray(0, bytes.length - 4))) throw new TraceError(`${what}: checksum mismatch`);
  checkGranule(granule, what);
  if (!Number.isSafeInteger(size) || size <= 0) throw new TraceError(`${what}: device size ${size} is not valid`);
  const granules = Math.ceil(size / granule);
  const entries = new Uint32Array(count);
  for (let i = 0; i < count; i++) {
    const g = v.getUint32(HEADER + 4 * i, true);
    if (g >= granules) throw new TraceError(`${what}: entry ${i} (granule ${g}) is past the device's ${granules} granules`);
    entries[i] = g;
  }
  return { size, granule, entries };
}

export function checkGranule(granule: number, what = "trace"): void {
  if (!Number.isInteger(granule) || granule < TRACE_MIN_GRANULE || granule > TRACE_MAX_GRANULE || (granule & (granule - 1)) !== 0)
    throw new TraceError(`${what}: granule ${granule} is not a power of two ${TRACE_MIN_GRANULE}..${TRACE_MAX_GRANULE}`);
}
