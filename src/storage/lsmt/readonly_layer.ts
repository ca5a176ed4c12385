// A read-only LSMT layer (sealed or committed): opened through its trailer and validated with
// the C++ rules of overlaybd-format.md §4.5, so a file we accept is one C++ accepts too.

import { FormatError, TruncatedError } from "../errors.ts";
import type { ReadableFile } from "../file.ts";
import { type HeaderTrailer, HT_SPACE, decodeHeader, FLAG_HEADER, FLAG_DATA, FLAG_SEALED } from "./header.ts";
import { type Segment, SEGMENT_BYTES, SECTOR, decodeSegments, segEnd } from "./segment.ts";

/** C++ MAX_LSMT_RO_INDEX_SIZE: bigger read-only indexes are refused. */
export const MAX_RO_INDEX_ENTRIES = 1_000_000;

export class ReadOnlyLayer {
  private constructor(
    readonly file: ReadableFile,
    readonly header: HeaderTrailer,
    readonly trailer: HeaderTrailer,
    /** Sorted, disjoint, tags reset to 0. */
    readonly index: Segment[],
  ) {}

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
    const hb = new Uint8Array(HT_SPACE);
    if ((await file.pread(hb, 0)) !== HT_SPACE) throw new TruncatedError("short read of the header", name, 0);
    const header = decodeHeader(hb, name, 0);
    if (!(header.flags & FLAG_HEADER) || !(header.flags & FLAG_DATA))
      throw new FormatError(`header flags 0x${header.flags.toString(16)} do not say data header`, name, 0);
    const toff = size - HT_SPACE;
    const tb = new Uint8Array(HT_SPACE);
    if ((await file.pread(tb, toff)) !== HT_SPACE) throw new TruncatedError("short read of the trailer", name, toff);
    const trailer = decodeHeader(tb, name, toff);
    if (trailer.flags & FLAG_HEADER || !(trailer.flags & FLAG_DATA) || !(trailer.flags & FLAG_SEALED))
      throw new FormatError(`trailer flags 0x${trailer.flags.toString(16)} do not say sealed data trailer`, name, toff);
    if (trailer.indexSize > MAX_RO_INDEX_ENTRIES)
      throw new FormatError(`index_size ${trailer.indexSize} exceeds ${MAX_RO_INDEX_ENTRIES}`, name, toff + 40);
    if (trailer.indexOffset % SECTOR !== 0 || trailer.indexOffset < HT_SPACE)
      throw new FormatError(`index_offset ${trailer.indexOffset} is not a sector past the header`, name, toff + 32);
    const ibytes = trailer.indexSize * SEGMENT_BYTES;
    if (ibytes > toff - trailer.indexOffset)
      throw new FormatError(`index of ${trailer.indexSize} entries at ${trailer.indexOffset} runs past the trailer`, name, toff + 40);
    const raw = new Uint8Array(ibytes);
    if (ibytes && (await file.pread(raw, trailer.indexOffset)) !== ibytes)
      throw new TruncatedError("short read of the index", name, trailer.indexOffset);
    const index = decodeSegments(raw);
    validateReadOnlyIndex(index, trailer.indexOffset / SECTOR, name, trailer.indexOffset);
    return new ReadOnlyLayer(file, header, trailer, index);
  }

  close(): Promise<void> {
    return this.file.close();
  }
}

/** Sorted, disjoint, and every moffset inside [8, limit] (zeroed) or [8, limit − length] (data). Tags are reset to 0. */
export function validateReadOnlyIndex(index: Segment[], limitSectors: number, name: string, at: number): void {
  let prevEnd = 0;
  for (let i = 0; i < index.length; i++) {
    const s = index[i]!;
    const where = at + i * SEGMENT_BYTES;
    s.tag = 0;
    if (s.length === 0) throw new FormatError(`entry ${i} has length 0`, name, where);
    if (s.offset < prevEnd) throw new FormatError(`entry ${i} at sector ${s.offset} overlaps or is out of order`, name, where);
    if (s.moffset < 8 || (s.zeroed ? s.moffset > limitSectors : s.moffset + s.length > limitSectors))
      throw new FormatError(`entry ${i} maps sector ${s.moffset} outside the data area [8, ${limitSectors})`, name, where);
    prevEnd = segEnd(s);
  }
}
