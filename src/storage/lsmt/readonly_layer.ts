// A read-only LSMT layer (sealed or committed): opened through its trailer and validated with
// C++'s rules (docs/formats.md, Opening a read-only layer), so a file we accept is one C++ accepts too.

import { FieldError, FormatError, TruncatedError } from "../errors.ts";
import type { ReadableFile } from "../file.ts";
import { type HeaderTrailer, HT_FIELD, HT_SPACE, decodeHeader, FLAG_HEADER, FLAG_DATA, FLAG_SEALED } from "./header.ts";
import { type Segment, SEGMENT_BYTES, SECTOR, firstEndingAfter, segEnd } from "./segment.ts";
import { SegmentTable } from "./segment_table.ts";

/** C++ MAX_LSMT_RO_INDEX_SIZE: bigger read-only indexes are refused. */
export const MAX_RO_INDEX_ENTRIES = 1_000_000;

export class ReadOnlyLayer {
  private entries: Segment[] | undefined;

  private constructor(
    readonly file: ReadableFile,
    readonly header: HeaderTrailer,
    readonly trailer: HeaderTrailer,
    /** The index: sorted, disjoint, tags 0, length-0 entries dropped. */
    readonly table: SegmentTable,
  ) {}

  /** The index as Segment objects (made on first use: the read path uses `table`). */
  get index(): Segment[] {
    return (this.entries ??= this.table.toArray());
  }

  get name(): string {
    return this.file.name;
  }
  get virtualSize(): number {
    return this.trailer.virtualSize;
  }
  get uuid(): string {
    return this.trailer.uuid;
  }
  get parentUuid(): string {
    return this.trailer.parentUuid;
  }

  static async open(file: ReadableFile): Promise<ReadOnlyLayer> {
    const name = file.name;
    const size = file.size();
    if (size < 2 * HT_SPACE) throw new TruncatedError(`${size} bytes is too small for an LSMT layer`, name, 0);
    // Header and trailer at once: one submit for a local file, both ranges in flight for a remote one.
    const hb = new Uint8Array(HT_SPACE);
    const tb = new Uint8Array(HT_SPACE);
    const toff = size - HT_SPACE;
    const [gotHead, gotTrailer] = await Promise.all([file.pread(hb, 0), file.pread(tb, toff)]);
    if (gotHead !== HT_SPACE) throw new TruncatedError("short read of the header", name, 0);
    const header = decodeHeader(hb, name, 0);
    const flags = (h: HeaderTrailer) => `0x${h.flags.toString(16)}`;
    if (!(header.flags & FLAG_HEADER) || !(header.flags & FLAG_DATA))
      throw new FieldError("header flags", flags(header), "do not say data header (bits 0x03)", name, HT_FIELD.flags);
    if (gotTrailer !== HT_SPACE) throw new TruncatedError("short read of the trailer", name, toff);
    const trailer = decodeHeader(tb, name, toff);
    if (trailer.flags & FLAG_HEADER || !(trailer.flags & FLAG_DATA) || !(trailer.flags & FLAG_SEALED))
      throw new FieldError("trailer flags", flags(trailer), "do not say sealed data trailer (bits 0x06, 0x01 clear)", name, toff + HT_FIELD.flags);
    if (trailer.indexSize > MAX_RO_INDEX_ENTRIES)
      throw new FieldError("index_size", trailer.indexSize, `exceeds the ${MAX_RO_INDEX_ENTRIES} entries C++ reads`, name, toff + HT_FIELD.indexSize);
    const ibytes = trailer.indexSize * SEGMENT_BYTES;
    if (ibytes > toff - trailer.indexOffset)
      throw new FormatError(`index of ${trailer.indexSize} entries at ${trailer.indexOffset} runs past the trailer`, name, toff + HT_FIELD.indexSize);
    const raw = new Uint8Array(ibytes);
    if (ibytes && (await file.pread(raw, trailer.indexOffset)) !== ibytes)
      throw new TruncatedError("short read of the index", name, trailer.indexOffset);
    // C++ bounds entries by index_offset in whole sectors and checks nothing else about it. It
    // keeps length-0 entries; they map nothing, so they are dropped here once checked.
    const table = SegmentTable.decode(raw, Math.floor(trailer.indexOffset / SECTOR), name, trailer.indexOffset);
    return new ReadOnlyLayer(file, header, trailer, table);
  }

  close(): Promise<void> {
    return this.file.close();
  }
}

/**
 * What C++ opens in a read-only layer but a disk of its size cannot show as is: a virtual_size of
 * 0 (the layer takes its disk size from a layer above) or not whole sectors, and entries past it.
 */
export function layerWarnings(layer: ReadOnlyLayer): string[] {
  const v = layer.virtualSize;
  const out: string[] = [];
  if (v === 0) out.push("virtual_size 0: the layer has no disk size of its own; a stack takes it from a layer above");
  else if (v % SECTOR) out.push(`virtual_size ${v} is not a multiple of ${SECTOR}: no disk has that size`);
  const past = entriesPast(layer.index, v);
  if (past && v > 0) out.push(past);
  return out;
}

/** A sentence on the entries of a sorted index that map sectors at or past `virtualSize` bytes, or "" when none do. */
export function entriesPast(index: readonly Segment[], virtualSize: number): string {
  const first = firstEndingAfter(index, Math.floor(virtualSize / SECTOR));
  const n = index.length - first;
  if (n === 0) return "";
  const s = index[first]!;
  return `${n} ${n === 1 ? "entry maps" : "entries map"} data past virtual_size ${virtualSize} (entry ${first}: bytes ${s.offset * SECTOR}..${segEnd(s) * SECTOR}); a disk of that size never shows it`;
}
