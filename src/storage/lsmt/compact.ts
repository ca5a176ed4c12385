// Commit: compact a layer or a merged stack into one dense, garbage-free read-only layer, laid
// out exactly as C++ overlaybd-commit does (docs/formats.md, Committed layer), so outputs are byte-equal.

import type { ReadableFile, WritableFile } from "../file.ts";
import { preadFull } from "../file.ts";
import { FLAG_DATA, FLAG_HEADER, FLAG_SEALED, HT_SPACE, encodeHeader, newHeader, normalizeUuid, userTagFromString, NULL_UUID } from "./header.ts";
import { type Segment, SECTOR, MAX_SEGMENT_SECTORS, encodeSegments, segMend } from "./segment.ts";

/** C++ copies in 32 KiB steps and emits one entry per step before merging. */
const COPY_STEP_SECTORS = 64;
/** Committed indexes are padded with invalid entries to a multiple of 256 (4096 bytes). */
const INDEX_ALIGN_ENTRIES = 256;
const READ_CHUNK = 4 << 20;

export interface CompactSource {
  /** Layer files by tag. */
  files: readonly ReadableFile[];
  /** Sorted, disjoint; tag picks the file. */
  index: Iterable<Segment>;
  /** virtual_size of the top source layer. */
  virtualSize: number;
  /** parent_uuid of the bottom source layer (used when opts.parentUuid is not given). */
  parentUuid: string;
}

export interface CompactOptions {
  uuid?: string;
  parentUuid?: string;
  message?: string;
}

/** Appends to a WritableFile through a 1 MiB buffer. */
class SequentialWriter {
  private buf = new Uint8Array(1 << 20);
  private used = 0;
  pos = 0;
  constructor(private out: WritableFile) {}
  async write(b: Uint8Array): Promise<void> {
    while (b.length) {
      const k = Math.min(b.length, this.buf.length - this.used);
      this.buf.set(b.subarray(0, k), this.used);
      this.used += k;
      b = b.subarray(k);
      if (this.used === this.buf.length) await this.drain();
    }
  }
  async drain(): Promise<void> {
    if (!this.used) return;
    await this.out.pwrite(this.buf.subarray(0, this.used), this.pos);
    this.pos += this.used;
    this.used = 0;
  }
}

export async function compact(src: CompactSource, out: WritableFile, opts: CompactOptions = {}): Promise<{ size: number; entries: number }> {
  const header = newHeader({
    flags: FLAG_HEADER | FLAG_DATA | FLAG_SEALED,
    virtualSize: src.virtualSize,
    uuid: normalizeUuid(opts.uuid),
    // C++: --parent-uuid when valid, else the bottom source layer's parent.
    parentUuid: normalizeUuid(opts.parentUuid) !== NULL_UUID ? normalizeUuid(opts.parentUuid) : src.parentUuid,
    userTag: userTagFromString(opts.message ?? ""),
  });
  await out.truncate(0);
  const w = new SequentialWriter(out);
  await w.write(encodeHeader(header));
  let pos = HT_SPACE / SECTOR;
  const entries: Segment[] = [];
  let run: Segment | undefined;
  // Emit one step entry, folding it into the running one by the neighbour rule (limit < 16383).
  const emit = (offset: number, length: number, moffset: number, zeroed: boolean, tag: number) => {
    if (
      run &&
      run.offset + run.length === offset &&
      segMend(run) === moffset &&
      run.zeroed === zeroed &&
      run.tag === tag &&
      run.length + length < MAX_SEGMENT_SECTORS
    ) {
      run.length += length;
      return;
    }
    run = { offset, length, moffset, zeroed, tag };
    entries.push(run);
  };
  const chunk = new Uint8Array(READ_CHUNK);
  for (const m of src.index) {
    if (m.zeroed) {
      emit(m.offset, m.length, pos, true, m.tag);
      continue;
    }
    const file = src.files[m.tag]!;
    for (let done = 0; done < m.length; ) {
      const k = Math.min(m.length - done, READ_CHUNK / SECTOR);
      const view = chunk.subarray(0, k * SECTOR);
      await preadFull(file, view, (m.moffset + done) * SECTOR);
      await w.write(view);
      for (let s = 0; s < k; s += COPY_STEP_SECTORS) {
        // Steps restart at every source entry, as in C++.
        const stepStart = done + s;
        const len = Math.min(COPY_STEP_SECTORS, m.length - stepStart, k - s);
        emit(m.offset + stepStart, len, pos, false, m.tag);
        pos += len;
      }
      done += k;
    }
  }
  const indexOffset = pos * SECTOR;
  const padded = Math.ceil(entries.length / INDEX_ALIGN_ENTRIES) * INDEX_ALIGN_ENTRIES;
  await w.write(encodeSegments(entries, padded));
  await w.write(encodeHeader({ ...header, flags: FLAG_DATA | FLAG_SEALED, indexOffset, indexSize: padded }));
  await w.drain();
  await out.fdatasync();
  return { size: w.pos, entries: entries.length };
}

