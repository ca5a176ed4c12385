// Guest memory into a sealed overlaybd layer of 4 KiB blocks (docs/vmm.md, "Memory layers"):
// either a whole memory image (a cold-booted VM's RAM file: the base layer) or the pages a paused
// VM dirtied, read from its VMM process (a delta layer, stacked on the image's); guest_memory.ts
// reads them. Non-zero pages are data; an all-zero page is a hole in a base layer and a zero
// segment in a delta (it must mask the page below). The file is what a WritableLayer's seal makes
// (RW header, data, index, sealed trailer), written in one pass: 4 MiB steps through a ring of
// page-aligned buffers, each step's data packed to the front of its buffer and written with
// O_DIRECT while the next steps are read, the index kept in memory, one fdatasync at the end.
// blockd runs it on a memory writer thread (memory_writer.ts), whose waits hold no other call.

import { rename, rm, stat } from "node:fs/promises";
import { type AlignedBuffer, POLLIN, allocAligned, poll, read } from "../../ffi/libc.ts";
import { LocalFile, deferLocalIoCompletions, reapLocalIo } from "../storage/local_file.ts";
import { FLAG_DATA, FLAG_HEADER, FLAG_SEALED, HT_SPACE, NULL_UUID, encodeHeader, newHeader, randomUuid } from "../storage/lsmt/header.ts";
import { type Segment, SECTOR, SEGMENT_BYTES, encodeSegment } from "../storage/lsmt/segment.ts";
import { type ZFileAlgorithm, writeZFile } from "../storage/zfile.ts";
import { GuestMemory, type MemorySource, PAGE, STEP_PAGES, newStep, type Step } from "./guest_memory.ts";

export type { MemorySource } from "./guest_memory.ts";

/** Steps in flight: one being read and packed while the others' writes run. */
const BUFFERS = 3;
/** One index entry maps at most 4 MiB (1024 whole pages; the format allows 16383 sectors). */
const ENTRY_SECTORS = 8192;
const PAGE_SECTORS = PAGE / SECTOR;
/** A wait for this thread's I/O polls its eventfd this long at a time (the job's bound is the writer's). */
const IO_POLL_MS = 1000;

export interface MemoryLayerResult {
  /** Pages stored as data. */
  dataPages: number;
  /** Pages stored as zeros (delta) or left out (base). */
  zeroPages: number;
  /** Size of the sealed layer file. */
  bytes: number;
}

/** True when the 4 KiB page at `at` of `words` (an i32 view) is all zeros: 8 words OR-ed per test (2.7x a word at a time). */
function zeroPage(w: Int32Array, at: number): boolean {
  for (let i = at, end = at + PAGE / 4; i < end; i += 8) if ((w[i]! | w[i + 1]! | w[i + 2]! | w[i + 3]! | w[i + 4]! | w[i + 5]! | w[i + 6]! | w[i + 7]!) !== 0) return false;
  return true;
}

/** The files a write of `out` works in until it renames its result to `out`: the plain layer, the ZFile. */
export function memoryLayerScratch(out: string): { data: string; zfile: string } {
  return { data: `${out}.tmp.data`, zfile: `${out}.tmp.zfile` };
}

/**
 * A sealed layer's index built as its entries come, in guest order: each new run extends the
 * last entry when it continues it in the guest and in the file, up to ENTRY_SECTORS.
 */
class IndexBuilder {
  private bytes = new Uint8Array(1024 * SEGMENT_BYTES);
  private dv = new DataView(this.bytes.buffer);
  count = 0;
  private readonly open: Segment = { offset: 0, length: 0, moffset: 0, zeroed: false, tag: 0 };

  /** Maps guest sectors [offset, offset+length) to file sector `moffset` on, or to zeros. */
  add(offset: number, length: number, moffset: number, zeroed: boolean): void {
    const e = this.open;
    while (length > 0) {
      const continues = e.length > 0 && e.zeroed === zeroed && e.offset + e.length === offset && (zeroed || e.moffset + e.length === moffset) && e.length < ENTRY_SECTORS;
      if (!continues) {
        this.emit();
        e.offset = offset;
        e.moffset = moffset;
        e.zeroed = zeroed;
      }
      const k = Math.min(length, ENTRY_SECTORS - e.length);
      e.length += k;
      offset += k;
      length -= k;
      if (!zeroed) moffset += k;
    }
  }

  private emit(): void {
    if (this.open.length === 0) return;
    if ((this.count + 1) * SEGMENT_BYTES > this.bytes.length) {
      const grown = new Uint8Array(this.bytes.length * 2);
      grown.set(this.bytes);
      this.bytes = grown;
      this.dv = new DataView(grown.buffer);
    }
    encodeSegment(this.dv, this.count * SEGMENT_BYTES, this.open);
    this.count++;
    this.open.length = 0;
  }

  /** The index region as a seal writes it: the entries, zero-padded to a whole sector. */
  finish(): Uint8Array {
    this.emit();
    const used = this.count * SEGMENT_BYTES;
    return this.bytes.slice(0, Math.ceil(used / SECTOR) * SECTOR);
  }
}

/** Resolves after every microtask queued so far, and every one those queue, has run. */
const drained = () => new Promise<void>((resolve) => setImmediate(resolve));

/** Waits for `p`, I/O of this thread in deferred mode (`ioFd` its eventfd; -1: no ring, p settles by itself), reaping until it settles. */
async function completion<T>(p: Promise<T>, ioFd: number): Promise<T> {
  if (ioFd < 0) return p;
  let settled = false;
  p.then(
    () => (settled = true),
    () => (settled = true),
  );
  await drained(); // the queued I/O is submitted, and an early completion seen through
  const pollfd = new Uint8Array(8);
  const dv = new DataView(pollfd.buffer);
  dv.setInt32(0, ioFd, true);
  dv.setInt16(4, POLLIN, true);
  const counter = new Uint8Array(8);
  while (!settled) {
    if (poll(pollfd, 1, IO_POLL_MS) > 0) {
      read(ioFd, counter);
      reapLocalIo();
    }
    await drained();
  }
  return p;
}

/**
 * Packs a step read into `buf`: its data pages moved to the front, in order (memmove only after
 * the first zero page), each run mapped in `index` at file byte `dataAt` on; zero runs mapped as
 * zeros in a delta. Returns the data bytes at the front of `buf`.
 */
function pack(step: Step, buf: AlignedBuffer, index: IndexBuilder, dataAt: number, delta: boolean, counts: MemoryLayerResult): number {
  const words = new Int32Array(buf.bytes.buffer, 0, (step.pages * PAGE) / 4);
  let packed = 0;
  let at = 0; // bytes of buf behind this piece
  for (let i = 0; i < step.n; i++) {
    const first = step.pieces[2 * i]!;
    const count = step.pieces[2 * i + 1]!;
    for (let p = 0; p < count; ) {
      const zero = zeroPage(words, (at + p * PAGE) / 4);
      let q = p + 1;
      while (q < count && zeroPage(words, (at + q * PAGE) / 4) === zero) q++;
      const pages = q - p;
      if (zero) {
        counts.zeroPages += pages;
        if (delta) index.add((first + p) * PAGE_SECTORS, pages * PAGE_SECTORS, (dataAt + packed) / SECTOR, true);
      } else {
        const from = at + p * PAGE;
        if (from !== packed) buf.bytes.copyWithin(packed, from, from + pages * PAGE);
        index.add((first + p) * PAGE_SECTORS, pages * PAGE_SECTORS, (dataAt + packed) / SECTOR, false);
        packed += pages * PAGE;
        counts.dataPages += pages;
      }
      p = q;
    }
    at += count * PAGE;
  }
  return packed;
}

/** Opens the layer's data file for O_DIRECT writes, or buffered where O_DIRECT is refused (tmpfs) or `buffered`. */
function openData(path: string, buffered: boolean): LocalFile {
  if (!buffered) {
    try {
      return LocalFile.open(path, { write: true, create: true, direct: true });
    } catch {}
  }
  return LocalFile.open(path, { write: true, create: true });
}

/**
 * Writes `out` (a sealed layer of `size` bytes) from `from`, compressed as a ZFile of 4 KiB blocks
 * when `zfile` names an algorithm; the file appears only when complete. Runs on a thread of its
 * own: while it copies, the thread's local I/O completes through deferLocalIoCompletions.
 */
export async function writeMemoryLayer(out: string, size: number, from: MemorySource, zfile?: ZFileAlgorithm): Promise<MemoryLayerResult> {
  const src = await GuestMemory.open(size, from);
  const tmp = memoryLayerScratch(out);
  const result: MemoryLayerResult = { dataPages: 0, zeroPages: 0, bytes: 0 };
  const header = newHeader({ flags: FLAG_HEADER | FLAG_DATA, virtualSize: size, uuid: randomUuid(), parentUuid: NULL_UUID });
  const index = new IndexBuilder();
  const bufs: AlignedBuffer[] = [];
  let data: LocalFile | undefined;
  try {
    // A ZFile's plain layer is scratch, read back at once: through the page cache, never synced.
    data = openData(tmp.data, !!zfile);
    const ioFd = deferLocalIoCompletions(true);
    let dataEnd = HT_SPACE;
    try {
      const writes: (Promise<void> | undefined)[] = [];
      const started = data.pwrite(encodeHeader(header), 0);
      started.catch(() => {});
      writes.push(started);
      const step = newStep();
      for (let k = 0; src.next(step); k++) {
        const slot = k % BUFFERS;
        if (writes[slot]) await completion(writes[slot], ioFd);
        const buf = (bufs[slot] ??= allocAligned(STEP_PAGES * PAGE));
        await completion(src.read(step, buf), ioFd);
        const bytes = pack(step, buf, index, dataEnd, src.delta, result);
        if (bytes === 0) {
          writes[slot] = undefined;
          continue;
        }
        const w = data.pwrite(buf.bytes.subarray(0, bytes), dataEnd);
        w.catch(() => {}); // its failure reaches the job through its completion below
        writes[slot] = w;
        dataEnd += bytes;
        await null; // submitted (the flush queued first) before the next step's read
      }
      for (const w of writes) if (w) await completion(w, ioFd);
      if (!src.delta) result.zeroPages = size / PAGE - result.dataPages; // the holes too
    } finally {
      deferLocalIoCompletions(false); // waits for whatever is still in flight
      for (const b of bufs) b.free();
    }
    // The seal: the index and a sealed trailer after the data, then the one sync.
    const entries = index.finish();
    const region = new Uint8Array(entries.length + HT_SPACE);
    region.set(entries, 0);
    region.set(encodeHeader({ ...header, flags: FLAG_DATA | FLAG_SEALED, indexOffset: dataEnd, indexSize: index.count }), entries.length);
    await data.pwrite(region, dataEnd);
    if (!zfile) await data.fdatasync();
  } catch (e) {
    await data?.close().catch(() => {});
    await src.close();
    await rm(tmp.data, { force: true });
    throw e;
  }
  await data.close();
  await src.close();
  if (zfile) {
    const sealed = LocalFile.open(tmp.data);
    const packed = LocalFile.open(tmp.zfile, { write: true, create: true });
    try {
      await writeZFile(sealed, packed, { algorithm: zfile, headerOverwrite: true });
      await packed.fdatasync();
    } catch (e) {
      await rm(tmp.zfile, { force: true });
      throw e;
    } finally {
      await sealed.close();
      await packed.close();
      await rm(tmp.data, { force: true });
    }
    await rename(tmp.zfile, out);
  } else await rename(tmp.data, out);
  result.bytes = (await stat(out)).size;
  return result;
}
