// ZFile: a file stored as independently compressed fixed-size blocks plus a table of their stored
// lengths (docs/formats.md, ZFile). Reader (a ReadableFile view), writer, and the 512-byte
// header/trailer codec.

import { decompress as fzstdDecompress } from "fzstd";
import { rawCrc32c } from "./crc32c.ts";
import { ChecksumError, FieldError, FormatError, IoRangeError, StorageError, TruncatedError, magicMismatch, magicPartsMatching } from "./errors.ts";
import type { ReadableFile, WritableFile } from "./file.ts";
import { lz4CompressBound, lz4CompressInto, lz4DecompressInto } from "./lz4.ts";
import { zstdDecompressInto, zstdLibLoaded } from "../../ffi/zstd.ts";

export const ZFILE_HT_SIZE = 512;
const HT_STRUCT_SIZE = 96;
const MAGIC0 = [0x5a, 0x46, 0x69, 0x6c, 0x65, 0x00, 0x01, 0x00];
const MAGIC1 = [0x74, 0x75, 0x6a, 0x69, 0x2e, 0x79, 0x79, 0x66, 0x40, 0x41, 0x6c, 0x69, 0x62, 0x61, 0x62, 0x61];
const MAGIC = [MAGIC0, MAGIC1] as const;
const FLAGS_FIELD = 32;
const DIGEST_FIELD = 28;

export const ZF_FLAG_HEADER = 0x01;
export const ZF_FLAG_DATA = 0x02;
export const ZF_FLAG_SEALED = 0x04;
export const ZF_FLAG_HEADER_OVERWRITE = 0x08;
export const ZF_FLAG_DIGEST = 0x10;
export const ZF_FLAG_INDEX_COMPRESSED = 0x20;

/** Flags the C++ writer puts in the initial header, the trailer and the rewritten header. */
export const ZF_FLAGS_INITIAL_HEADER = 0x13;
export const ZF_FLAGS_TRAILER = 0x16;
export const ZF_FLAGS_OVERWRITTEN_HEADER = 0x1b;

export const ZF_ALGO_LZ4 = 1;
export const ZF_ALGO_ZSTD = 2;
export const ZF_BLOCK_CRC_SEED = 100007;
// The C++ reader refuses more blocks than this.
const MAX_INDEX_ENTRIES = 1e9;
// Compressed bytes fetched by one pread when a request spans many blocks.
const MAX_READ_SPAN = 1 << 20;
// Read buffers a reader keeps between reads (one per read in flight at QD32, then some).
const MAX_KEPT = 64;
// Output staged by the writer before one pwrite.
const WRITE_FLUSH_BYTES = 1 << 20;

/** The 96-byte structure of a ZFile header or trailer; sizes and offsets in bytes. */
export interface ZFileHeader {
  flags: number;
  indexOffset: number;
  /** Number of blocks (u32 entries in the index). */
  indexSize: number;
  originalFileSize: number;
  indexCrc: number;
  blockSize: number;
  /** 1 = LZ4, 2 = zstd. */
  algorithm: number;
  level: number;
  useDict: number;
  dictSize: number;
  verify: boolean;
  /** As stored; encodeZFileHeader recomputes it. */
  digest: number;
}

function hasMagic(b: Uint8Array): boolean {
  return magicPartsMatching(b, MAGIC) === 2;
}

/** True when the bytes start with a ZFile header (magic and header bit; the digest is checked by open). */
export function isZFile(headerBytes: Uint8Array): boolean {
  return headerBytes.length >= 40 && hasMagic(headerBytes) && (headerBytes[FLAGS_FIELD]! & ZF_FLAG_HEADER) !== 0;
}

/** One magic part matches, or both without the header bit: a damaged ZFile header, not another format. */
export function hasDamagedZFileMagic(headerBytes: Uint8Array): boolean {
  return magicPartsMatching(headerBytes, MAGIC) >= 1 && !isZFile(headerBytes);
}

/** Why the bytes are not a ZFile header (which magic part, or the header bit); null when they are one. */
export function zfileHeaderProblem(headerBytes: Uint8Array, name = ""): FormatError | null {
  const bad = magicMismatch(headerBytes, MAGIC);
  if (bad) return new FormatError(`bad ZFile magic: ${bad}`, name, 0);
  const flags = headerBytes[FLAGS_FIELD] ?? 0;
  if (!(flags & ZF_FLAG_HEADER)) return new FieldError("ZFile header flags", hex(flags), "lack the header bit 0x01", name, FLAGS_FIELD);
  return null;
}

function getU64(v: DataView, at: number, what: string): number {
  const n = v.getUint32(at, true) + v.getUint32(at + 4, true) * 2 ** 32;
  if (!Number.isSafeInteger(n)) throw new FormatError(`ZFile ${what} ${n} is too large`);
  return n;
}

function setU64(v: DataView, at: number, n: number): void {
  v.setUint32(at, n % 2 ** 32, true);
  v.setUint32(at + 4, Math.floor(n / 2 ** 32), true);
}

/** Digest of a 512-byte header or trailer: raw CRC-32C, seed 0, over all of it with the digest field as zero. */
export function zfileHeaderDigest(block: Uint8Array): number {
  const copy = block.slice(0, ZFILE_HT_SIZE);
  copy.fill(0, DIGEST_FIELD, DIGEST_FIELD + 4);
  return rawCrc32c(0, copy);
}

/** Parse a header or trailer block; FormatError without the magic. Nothing else is validated here. */
export function decodeZFileHeader(block: Uint8Array): ZFileHeader {
  if (block.length < ZFILE_HT_SIZE || !hasMagic(block)) throw new FormatError("not a ZFile header/trailer: bad magic");
  const v = new DataView(block.buffer, block.byteOffset, ZFILE_HT_SIZE);
  // The flag bits in use all sit in the low word; the high word is ignored like the C++ reader does.
  return {
    flags: v.getUint32(32, true),
    indexOffset: getU64(v, 40, "index_offset"),
    indexSize: getU64(v, 48, "index_size"),
    originalFileSize: getU64(v, 56, "original_file_size"),
    indexCrc: v.getUint32(64, true),
    blockSize: v.getUint32(72, true),
    algorithm: block[76]!,
    level: block[77]!,
    useDict: block[78]!,
    dictSize: v.getUint32(84, true),
    verify: block[88] !== 0,
    digest: v.getUint32(DIGEST_FIELD, true),
  };
}

/** Encode a header or trailer block; the digest is computed when flags has the digest bit, else 0. */
export function encodeZFileHeader(h: ZFileHeader): Uint8Array {
  const block = new Uint8Array(ZFILE_HT_SIZE);
  block.set(MAGIC0, 0);
  block.set(MAGIC1, 8);
  const v = new DataView(block.buffer);
  v.setUint32(24, HT_STRUCT_SIZE, true);
  v.setUint32(32, h.flags, true);
  setU64(v, 40, h.indexOffset);
  setU64(v, 48, h.indexSize);
  setU64(v, 56, h.originalFileSize);
  v.setUint32(64, h.indexCrc, true);
  v.setUint32(72, h.blockSize, true);
  block[76] = h.algorithm;
  block[77] = h.level;
  block[78] = h.useDict;
  v.setUint32(84, h.dictSize, true);
  block[88] = h.verify ? 1 : 0;
  if (h.flags & ZF_FLAG_DIGEST) v.setUint32(DIGEST_FIELD, rawCrc32c(0, block), true);
  return block;
}

// ---------------------------------------------------------------------------------------------
// zstd

const ZSTD_MAGIC = [0x28, 0xb5, 0x2f, 0xfd];
// RFC 8878: a block holds at most min(Window_Size, 128 KiB).
const ZSTD_MAX_BLOCK = 128 * 1024;

// Reads decode with libzstd into the caller's buffer (ffi/zstd.ts); without it, with Bun's built-in
// zstd, which decodes 4 KiB blocks 2.5-4x faster than fzstd (61–123k against 22–27k blocks/s).
const bunZstd: { compress: (b: Uint8Array) => Uint8Array; decompress: (b: Uint8Array) => Uint8Array } | null =
  typeof Bun !== "undefined" && typeof Bun.zstdDecompressSync === "function" && typeof Bun.zstdCompressSync === "function"
    ? { compress: (b) => Bun.zstdCompressSync(b, { level: 3 }), decompress: (b) => Bun.zstdDecompressSync(b) }
    : null;

/** Size of zstdRawFrame's output for n input bytes. */
export function zstdRawFrameSize(n: number): number {
  const fcsBytes = n < 256 ? 1 : n < 65536 + 256 ? 2 : 4;
  return 4 + 1 + fcsBytes + Math.max(1, Math.ceil(n / ZSTD_MAX_BLOCK)) * 3 + n;
}

/**
 * A zstd frame (RFC 8878) that stores data as Raw_Blocks: magic, a single-segment frame header with
 * Frame_Content_Size and no checksum, then 3-byte block headers (type 0) each followed by the bytes.
 * Any zstd decoder reads it; it is the ZFile writer's escape for blocks zstd cannot shrink.
 */
export function zstdRawFrame(data: Uint8Array): Uint8Array {
  const n = data.length;
  if (n > 0xffffffff) throw new RangeError("zstd raw frame: input over 4 GiB");
  const out = new Uint8Array(zstdRawFrameSize(n));
  out.set(ZSTD_MAGIC, 0);
  let p = 5;
  // Frame_Header_Descriptor: FCS flag in bits 7-6, Single_Segment in bit 5 (so no Window_Descriptor).
  if (n < 256) {
    out[4] = 0x20;
    out[p++] = n;
  } else if (n < 65536 + 256) {
    out[4] = 0x60;
    const v = n - 256; // the 2-byte FCS field is stored minus 256
    out[p++] = v & 0xff;
    out[p++] = v >>> 8;
  } else {
    out[4] = 0xa0;
    new DataView(out.buffer).setUint32(p, n, true);
    p += 4;
  }
  let at = 0;
  do {
    const len = Math.min(ZSTD_MAX_BLOCK, n - at);
    const last = at + len === n ? 1 : 0;
    // Block header: Last_Block in bit 0, Block_Type (0 = Raw) in bits 1-2, Block_Size in bits 3-23.
    const bh = (len << 3) | last;
    out[p++] = bh & 0xff;
    out[p++] = (bh >>> 8) & 0xff;
    out[p++] = bh >>> 16;
    out.set(data.subarray(at, at + len), p);
    p += len;
    at += len;
  } while (at < n);
  return out;
}

/**
 * One ZFile block as a zstd frame at level 3; when zstd cannot make it smaller than the input, a
 * hand-made Raw_Block frame is stored instead if that is no longer.
 */
export function zstdCompressBlock(data: Uint8Array): Uint8Array {
  if (!bunZstd) throw new StorageError("zstd compression needs Bun.zstdCompressSync");
  const z = bunZstd.compress(data);
  if (z.length >= data.length && zstdRawFrameSize(data.length) <= z.length) return zstdRawFrame(data);
  return z;
}

const DID_BYTES = [0, 1, 2, 4];
const FCS_BYTES = [0, 2, 4, 8]; // by FCS flag; flag 0 means 1 byte with Single_Segment, else none

/** Frame_Content_Size of a zstd frame, or -1 when the frame does not declare it. */
function zstdFrameContentSize(f: Uint8Array): number {
  if (f.length < 5 || f[0] !== 0x28 || f[1] !== 0xb5 || f[2] !== 0x2f || f[3] !== 0xfd) {
    throw new FormatError("zstd: bad frame magic");
  }
  const fhd = f[4]!;
  const fcsFlag = fhd >>> 6;
  const singleSegment = (fhd >>> 5) & 1;
  const didBytes = DID_BYTES[fhd & 3]!;
  const fcsBytes = fcsFlag === 0 ? singleSegment : FCS_BYTES[fcsFlag]!;
  if (fcsBytes === 0) return -1;
  const p = 5 + (singleSegment ? 0 : 1) + didBytes;
  if (f.length < p + fcsBytes) throw new FormatError("zstd: frame header passes the end of the block");
  if (fcsBytes === 1) return f[p]!;
  if (fcsBytes === 2) return (f[p]! | (f[p + 1]! << 8)) + 256;
  const lo = (f[p]! | (f[p + 1]! << 8) | (f[p + 2]! << 16) | (f[p + 3]! << 24)) >>> 0;
  if (fcsBytes === 4) return lo;
  const hi = (f[p + 4]! | (f[p + 5]! << 8) | (f[p + 6]! << 16) | (f[p + 7]! << 24)) >>> 0;
  return lo + hi * 2 ** 32;
}

/** Decode one zstd-compressed ZFile block that must expand to exactly size bytes. */
export function zstdDecompressBlock(payload: Uint8Array, size: number): Uint8Array {
  const out = new Uint8Array(size);
  zstdDecompressBlockInto(payload, out);
  return out;
}

/** Decode one zstd-compressed ZFile block into `target`, which it must fill exactly. */
export function zstdDecompressBlockInto(payload: Uint8Array, target: Uint8Array): void {
  const size = target.length;
  // Checking the declared size first keeps a hostile frame from making a decoder allocate a lot.
  const declared = zstdFrameContentSize(payload);
  if (declared >= 0 && declared !== size) throw new FormatError(`zstd: frame declares ${declared} bytes, expected ${size}`);
  let n: number;
  try {
    if (zstdLibLoaded) n = zstdDecompressInto(target, payload); // never writes past target
    else {
      const out = bunZstd ? bunZstd.decompress(payload) : fzstdDecompress(payload);
      n = out.length;
      if (n === size) target.set(out);
    }
  } catch (e) {
    throw new FormatError(`zstd: ${(e as Error).message}`);
  }
  if (n !== size) throw new FormatError(`zstd: block decodes to ${n} bytes, expected ${size}`);
}

// ---------------------------------------------------------------------------------------------
// Reader

export interface ZFileOpenOptions {
  /** Bytes of decoded blocks kept for reads that cover only part of a block (default 256 KiB; 0 = none). */
  cacheBytes?: number;
}

function readU32(b: Uint8Array, at: number): number {
  return (b[at]! | (b[at + 1]! << 8) | (b[at + 2]! << 16) | (b[at + 3]! << 24)) >>> 0;
}

function hex(n: number): string {
  return `0x${n.toString(16).padStart(8, "0")}`;
}

function sameIndexInfo(a: ZFileHeader, b: ZFileHeader): boolean {
  return (
    a.indexOffset === b.indexOffset &&
    a.indexSize === b.indexSize &&
    a.originalFileSize === b.originalFileSize &&
    a.indexCrc === b.indexCrc &&
    a.blockSize === b.blockSize &&
    a.algorithm === b.algorithm &&
    a.verify === b.verify
  );
}

/**
 * A ZFile opened over any ReadableFile, itself a ReadableFile of the original bytes. Every block read
 * is CRC-checked (when the file has per-block CRCs) and must decode to its exact size. close() closes
 * the underlying file; when open() fails the caller still owns it.
 */
export class ZFileReader implements ReadableFile {
  readonly name: string;
  readonly blockSize: number;
  readonly algorithm: number;
  readonly verify: boolean;
  readonly blockCount: number;
  private readonly originalSize: number;
  /** starts[i] = file offset of block i; starts[blockCount] = index offset. */
  private readonly starts: Float64Array;
  private readonly scratch: Uint8Array;
  private readonly cacheTags: Int32Array;
  private readonly cacheData: Uint8Array;
  /** Read buffers of keptSize bytes (two blocks) that reads take and give back. */
  private readonly kept: Uint8Array[] = [];
  private readonly keptSize: number;

  private constructor(
    private readonly file: ReadableFile,
    readonly meta: ZFileHeader,
    starts: Float64Array,
    cacheBytes: number,
  ) {
    this.name = file.name;
    this.blockSize = meta.blockSize;
    this.algorithm = meta.algorithm;
    this.verify = meta.verify;
    this.blockCount = meta.indexSize;
    this.originalSize = meta.originalFileSize;
    this.starts = starts;
    this.scratch = new Uint8Array(meta.blockSize);
    this.keptSize = 2 * meta.blockSize;
    const slots = meta.indexSize === 0 ? 0 : Math.min(meta.indexSize, Math.floor(cacheBytes / meta.blockSize));
    this.cacheTags = new Int32Array(slots).fill(-1);
    this.cacheData = new Uint8Array(slots * meta.blockSize);
  }

  /** Open and validate a ZFile as C++ does: magic, header digest, trailer or rewritten header, index bounds and CRC. */
  static async open(file: ReadableFile, opts: ZFileOpenOptions = {}): Promise<ZFileReader> {
    const name = file.name;
    const fileSize = file.size();
    if (fileSize < ZFILE_HT_SIZE) throw new TruncatedError(`ZFile of ${fileSize} bytes is shorter than its header`, name, 0);
    const readTrailer = fileSize >= 2 * ZFILE_HT_SIZE;
    const head = new Uint8Array(ZFILE_HT_SIZE);
    const tail = new Uint8Array(ZFILE_HT_SIZE);
    const [gotHead, gotTail] = await Promise.all([
      file.pread(head, 0),
      readTrailer ? file.pread(tail, fileSize - ZFILE_HT_SIZE) : Promise.resolve(0),
    ]);
    if (gotHead < ZFILE_HT_SIZE) throw new TruncatedError("ZFile header is cut short", name, gotHead);
    const notZFile = zfileHeaderProblem(head, name);
    if (notZFile) throw notZFile;
    const header = decodeZFileHeader(head);
    if (header.flags & ZF_FLAG_DIGEST) {
      const digest = zfileHeaderDigest(head);
      if (digest !== header.digest) {
        throw new ChecksumError(`ZFile header digest ${hex(header.digest)} != computed ${hex(digest)}`, name, DIGEST_FIELD);
      }
    }
    const trailerOffset = fileSize - ZFILE_HT_SIZE;
    const haveTrailer = readTrailer && gotTail === ZFILE_HT_SIZE && hasMagic(tail);
    let meta: ZFileHeader;
    if (header.flags & ZF_FLAG_HEADER_OVERWRITE) {
      meta = header;
      // The rewritten header is authoritative; a trailer that is present must agree with it.
      if (haveTrailer) {
        const t = decodeZFileHeader(tail);
        if (!(t.flags & ZF_FLAG_HEADER) && !sameIndexInfo(t, header)) {
          throw new FormatError("ZFile trailer disagrees with the rewritten header", name, trailerOffset);
        }
      }
    } else {
      if (!haveTrailer) {
        throw new TruncatedError("no ZFile trailer in the last 512 bytes: the file is cut short or was never finished", name, trailerOffset);
      }
      meta = decodeZFileHeader(tail);
      const need = ZF_FLAG_DATA | ZF_FLAG_SEALED;
      if (meta.flags & ZF_FLAG_HEADER || (meta.flags & need) !== need) {
        throw new FormatError(`ZFile trailer flags ${hex(meta.flags)} lack trailer/data/sealed`, name, trailerOffset);
      }
    }
    const metaAt = header.flags & ZF_FLAG_HEADER_OVERWRITE ? 0 : trailerOffset;
    if (meta.flags & ZF_FLAG_INDEX_COMPRESSED) throw new FormatError("ZFile compressed index is not supported", name, metaAt);
    if (meta.algorithm !== ZF_ALGO_LZ4 && meta.algorithm !== ZF_ALGO_ZSTD) {
      throw new FormatError(`ZFile algorithm ${meta.algorithm} is not supported (1 = lz4, 2 = zstd)`, name, metaAt);
    }
    if (meta.useDict) throw new FormatError("ZFile dictionaries are not supported", name, metaAt);
    if (meta.blockSize === 0 || meta.blockSize > 1 << 26) throw new FormatError(`ZFile block size ${meta.blockSize} is impossible`, name, metaAt);
    const n = meta.indexSize;
    if (n > MAX_INDEX_ENTRIES) throw new FormatError(`ZFile index of ${n} entries is too large`, name, metaAt);
    if (n !== Math.ceil(meta.originalFileSize / meta.blockSize)) {
      throw new FormatError(`ZFile has ${n} blocks for ${meta.originalFileSize} bytes in blocks of ${meta.blockSize}`, name, metaAt);
    }
    const firstBlock = ZFILE_HT_SIZE + meta.dictSize;
    const indexEnd = meta.indexOffset + n * 4;
    if (meta.indexOffset < firstBlock) throw new FormatError(`ZFile index offset ${meta.indexOffset} is inside the header`, name, metaAt);
    if (indexEnd > fileSize) throw new TruncatedError(`ZFile index ends at ${indexEnd}, past the end of the file`, name, fileSize);
    if (!(header.flags & ZF_FLAG_HEADER_OVERWRITE) && indexEnd > trailerOffset) {
      throw new FormatError(`ZFile index ends at ${indexEnd}, inside the trailer`, name, meta.indexOffset);
    }
    const index = new Uint8Array(n * 4);
    if (n > 0) {
      const got = await file.pread(index, meta.indexOffset);
      if (got < index.length) throw new TruncatedError("ZFile index is cut short", name, meta.indexOffset + got);
    }
    if (meta.flags & ZF_FLAG_DIGEST) {
      const crc = rawCrc32c(0, index);
      if (crc !== meta.indexCrc) {
        throw new ChecksumError(`ZFile index_crc ${hex(meta.indexCrc)} != computed ${hex(crc)}`, name, meta.indexOffset);
      }
    }
    const minStored = meta.verify ? 5 : 1;
    const starts = new Float64Array(n + 1);
    let at = firstBlock;
    for (let i = 0; i < n; i++) {
      const len = readU32(index, i * 4);
      if (len < minStored) throw new FormatError(`ZFile block ${i} has stored length ${len}`, name, meta.indexOffset + i * 4);
      starts[i] = at;
      at += len;
    }
    starts[n] = at;
    if (at !== meta.indexOffset) {
      throw new FormatError(`ZFile blocks end at ${at} but the index starts at ${meta.indexOffset}`, name, meta.indexOffset);
    }
    return new ZFileReader(file, meta, starts, opts.cacheBytes ?? 256 * 1024);
  }

  size(): number {
    return this.originalSize;
  }

  /** File offset and stored length (payload plus CRC) of block i. */
  blockExtent(i: number): { offset: number; length: number } {
    return { offset: this.starts[i]!, length: this.starts[i + 1]! - this.starts[i]! };
  }

  async pread(buf: Uint8Array, offset: number): Promise<number> {
    if (!Number.isSafeInteger(offset) || offset < 0) throw new IoRangeError(`bad read offset ${offset}`, this.name, offset);
    if (offset >= this.originalSize || buf.length === 0) return 0;
    const len = Math.min(buf.length, this.originalSize - offset);
    const end = offset + len;
    const bs = this.blockSize;
    const starts = this.starts;
    const last = Math.floor((end - 1) / bs);
    let first = Math.floor(offset / bs);
    while (first <= last) {
      if (this.copyFromCache(first, buf, offset, end)) {
        first++;
        continue;
      }
      // One pread for a run of adjacent blocks, capped so a huge request does not buffer it all.
      const base = starts[first]!;
      let lastInSpan = first;
      while (lastInSpan < last && starts[lastInSpan + 2]! - base <= MAX_READ_SPAN) lastInSpan++;
      const span = starts[lastInSpan + 1]! - base;
      // Spans of up to two blocks' bytes go through a kept buffer: no allocation per block read.
      const kept = span <= this.keptSize ? (this.kept.pop() ?? new Uint8Array(this.keptSize)) : undefined;
      const stored = kept ? kept.subarray(0, span) : new Uint8Array(span);
      try {
        const got = await this.file.pread(stored, base);
        if (got < stored.length) {
          throw new TruncatedError(`ZFile blocks ${first}..${lastInSpan} are cut short`, this.name, base + got);
        }
        for (let i = first; i <= lastInSpan; i++) this.decodeBlock(i, stored, starts[i]! - base, buf, offset, end);
      } finally {
        if (kept && this.kept.length < MAX_KEPT) this.kept.push(kept);
      }
      first = lastInSpan + 1;
    }
    return len;
  }

  async close(): Promise<void> {
    await this.file.close();
  }

  private copyFromCache(i: number, buf: Uint8Array, reqStart: number, reqEnd: number): boolean {
    const slots = this.cacheTags.length;
    if (slots === 0) return false;
    const slot = i % slots;
    if (this.cacheTags[slot] !== i) return false;
    const bs = this.blockSize;
    const blockStart = i * bs;
    const from = Math.max(reqStart, blockStart);
    const to = Math.min(reqEnd, blockStart + bs);
    const cached = slot * bs;
    buf.set(this.cacheData.subarray(cached + from - blockStart, cached + to - blockStart), from - reqStart);
    return true;
  }

  private decodeBlock(i: number, stored: Uint8Array, at: number, buf: Uint8Array, reqStart: number, reqEnd: number): void {
    const bs = this.blockSize;
    const blockStart = i * bs;
    const blockLen = Math.min(bs, this.originalSize - blockStart);
    const fileOffset = this.starts[i]!;
    const payloadLen = this.starts[i + 1]! - fileOffset - (this.verify ? 4 : 0);
    const payload = stored.subarray(at, at + payloadLen);
    if (this.verify) {
      const want = readU32(stored, at + payloadLen);
      const crc = rawCrc32c(ZF_BLOCK_CRC_SEED, payload);
      if (crc !== want) {
        throw new ChecksumError(
          `ZFile block ${i} (bytes ${blockStart}..${blockStart + blockLen} of the original): CRC32C ${hex(crc)} != stored ${hex(want)}`,
          this.name,
          fileOffset,
        );
      }
    }
    const from = Math.max(reqStart, blockStart);
    const to = Math.min(reqEnd, blockStart + blockLen);
    const whole = from === blockStart && to === blockStart + blockLen;
    const slots = this.cacheTags.length;
    // A whole block decodes straight into the caller's buffer; a partial one goes through the cache slot.
    let target: Uint8Array;
    if (whole) target = blockLen === buf.length ? buf : buf.subarray(blockStart - reqStart, blockStart - reqStart + blockLen);
    else if (slots > 0) target = this.cacheData.subarray((i % slots) * bs, (i % slots) * bs + blockLen);
    else target = this.scratch.subarray(0, blockLen);
    try {
      if (this.algorithm === ZF_ALGO_LZ4) {
        const n = lz4DecompressInto(payload, target);
        if (n !== blockLen) throw new FormatError(`lz4: block decodes to ${n} bytes, expected ${blockLen}`);
      } else {
        zstdDecompressBlockInto(payload, target);
      }
    } catch (e) {
      if (!whole && slots > 0) this.cacheTags[i % slots] = -1;
      if (e instanceof FormatError) throw new FormatError(`ZFile block ${i}: ${e.message}`, this.name, fileOffset);
      throw e;
    }
    if (!whole) {
      if (slots > 0) this.cacheTags[i % slots] = i;
      buf.set(target.subarray(from - blockStart, to - blockStart), from - reqStart);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Writer

export type ZFileAlgorithm = "zstd" | "lz4";

export interface ZFileWriteOptions {
  algorithm: ZFileAlgorithm;
  /** Uncompressed block size: a power of two from 4 KiB to 64 KiB, as the C++ tools require (default 4096). */
  blockSize?: number;
  /** Append a CRC32C to every block (default true). */
  verify?: boolean;
  /** Rewrite the header with the index information at the end, like `overlaybd-commit -z` (default false). */
  headerOverwrite?: boolean;
}

/**
 * Streaming ZFile writer over a WritableFile, from offset 0: create() writes the initial header,
 * append() takes uncompressed bytes in order (await each call), finish() writes the last block, the
 * index and the trailer (and rewrites the header when asked) and cuts the file there. No fsync.
 */
export class ZFileBuilder {
  private readonly blockSize: number;
  private readonly algorithm: number;
  private readonly verify: boolean;
  private readonly headerOverwrite: boolean;
  private readonly stage: Uint8Array;
  private stageLen = 0;
  private readonly outBuf: Uint8Array;
  private outLen = 0;
  private outPos = ZFILE_HT_SIZE;
  private lens = new Uint32Array(1024);
  private blocks = 0;
  private bytesIn = 0;
  private busy = false;
  private finished = false;

  private constructor(
    private readonly out: WritableFile,
    opts: ZFileWriteOptions,
  ) {
    const bs = opts.blockSize ?? 4096;
    if (!Number.isInteger(bs) || bs < 4096 || bs > 65536 || (bs & (bs - 1)) !== 0) {
      throw new RangeError(`ZFile block size ${bs} is not a power of two from 4096 to 65536`);
    }
    if (opts.algorithm !== "zstd" && opts.algorithm !== "lz4") throw new RangeError(`unknown ZFile algorithm ${opts.algorithm}`);
    if (opts.algorithm === "zstd" && !bunZstd) throw new StorageError("zstd compression needs Bun.zstdCompressSync");
    this.blockSize = bs;
    this.algorithm = opts.algorithm === "lz4" ? ZF_ALGO_LZ4 : ZF_ALGO_ZSTD;
    this.verify = opts.verify ?? true;
    this.headerOverwrite = opts.headerOverwrite ?? false;
    this.stage = new Uint8Array(bs);
    // zstdCompressBlock never returns more than the raw frame, so that bounds the zstd case.
    const worstBlock = Math.max(lz4CompressBound(bs), zstdRawFrameSize(bs)) + 4;
    this.outBuf = new Uint8Array(WRITE_FLUSH_BYTES + worstBlock);
  }

  static async create(out: WritableFile, opts: ZFileWriteOptions): Promise<ZFileBuilder> {
    const b = new ZFileBuilder(out, opts);
    await out.pwrite(encodeZFileHeader(b.header(ZF_FLAGS_INITIAL_HEADER, 0, 0)), 0);
    return b;
  }

  /** Uncompressed bytes taken so far. */
  get size(): number {
    return this.bytesIn;
  }

  async append(data: Uint8Array): Promise<void> {
    this.enter();
    try {
      const bs = this.blockSize;
      let at = 0;
      while (at < data.length) {
        if (this.stageLen === 0 && data.length - at >= bs) {
          this.compressBlock(data.subarray(at, at + bs));
          at += bs;
        } else {
          const take = Math.min(bs - this.stageLen, data.length - at);
          this.stage.set(data.subarray(at, at + take), this.stageLen);
          this.stageLen += take;
          at += take;
          if (this.stageLen === bs) {
            this.compressBlock(this.stage);
            this.stageLen = 0;
          }
        }
        if (this.outLen >= WRITE_FLUSH_BYTES) await this.flush();
      }
      this.bytesIn += data.length;
    } finally {
      this.busy = false;
    }
  }

  /** Write the tail of the file; returns the header fields as the reader will see them. */
  async finish(): Promise<ZFileHeader> {
    this.enter();
    try {
      if (this.stageLen > 0) this.compressBlock(this.stage.subarray(0, this.stageLen));
      this.stageLen = 0;
      await this.flush();
      const indexOffset = this.outPos;
      const index = new Uint8Array(this.blocks * 4);
      const iv = new DataView(index.buffer);
      for (let i = 0; i < this.blocks; i++) iv.setUint32(i * 4, this.lens[i]!, true);
      const indexCrc = rawCrc32c(0, index);
      const trailer = encodeZFileHeader(this.header(ZF_FLAGS_TRAILER, indexOffset, indexCrc));
      const tailBytes = new Uint8Array(index.length + ZFILE_HT_SIZE);
      tailBytes.set(index, 0);
      tailBytes.set(trailer, index.length);
      await this.out.pwrite(tailBytes, indexOffset);
      const end = indexOffset + tailBytes.length;
      if (this.out.size() > end) await this.out.truncate(end);
      const final = this.header(this.headerOverwrite ? ZF_FLAGS_OVERWRITTEN_HEADER : ZF_FLAGS_TRAILER, indexOffset, indexCrc);
      if (this.headerOverwrite) await this.out.pwrite(encodeZFileHeader(final), 0);
      this.finished = true;
      return decodeZFileHeader(encodeZFileHeader(final));
    } finally {
      this.busy = false;
    }
  }

  private enter(): void {
    if (this.finished) throw new StorageError("ZFileBuilder used after finish()", this.out.name);
    if (this.busy) throw new StorageError("ZFileBuilder calls must not overlap: await each one", this.out.name);
    this.busy = true;
  }

  private header(flags: number, indexOffset: number, indexCrc: number): ZFileHeader {
    const initial = flags === ZF_FLAGS_INITIAL_HEADER;
    return {
      flags,
      indexOffset,
      indexSize: initial ? 0 : this.blocks,
      originalFileSize: initial ? 0 : this.bytesIn,
      indexCrc,
      blockSize: this.blockSize,
      algorithm: this.algorithm,
      level: 0,
      useDict: 0,
      dictSize: 0,
      verify: this.verify,
      digest: 0,
    };
  }

  private compressBlock(block: Uint8Array): void {
    const start = this.outLen;
    let payloadLen: number;
    if (this.algorithm === ZF_ALGO_LZ4) {
      payloadLen = lz4CompressInto(block, this.outBuf.subarray(start));
    } else {
      const z = zstdCompressBlock(block);
      this.outBuf.set(z, start);
      payloadLen = z.length;
    }
    let stored = payloadLen;
    if (this.verify) {
      const crc = rawCrc32c(ZF_BLOCK_CRC_SEED, this.outBuf.subarray(start, start + payloadLen));
      const p = start + payloadLen;
      this.outBuf[p] = crc & 0xff;
      this.outBuf[p + 1] = (crc >>> 8) & 0xff;
      this.outBuf[p + 2] = (crc >>> 16) & 0xff;
      this.outBuf[p + 3] = crc >>> 24;
      stored += 4;
    }
    if (this.blocks === this.lens.length) {
      const grown = new Uint32Array(this.lens.length * 2);
      grown.set(this.lens);
      this.lens = grown;
    }
    this.lens[this.blocks++] = stored;
    this.outLen += stored;
  }

  private async flush(): Promise<void> {
    if (this.outLen === 0) return;
    // No copy: every caller awaits the write before the staging buffer is touched again.
    await this.out.pwrite(this.outBuf.subarray(0, this.outLen), this.outPos);
    this.outPos += this.outLen;
    this.outLen = 0;
  }
}

/** Compress all of src into out as a ZFile; returns the header fields of the result. */
export async function writeZFile(src: ReadableFile, out: WritableFile, opts: ZFileWriteOptions): Promise<ZFileHeader> {
  const builder = await ZFileBuilder.create(out, opts);
  const total = src.size();
  const bs = opts.blockSize ?? 4096;
  const chunk = new Uint8Array(Math.max(bs, Math.floor(WRITE_FLUSH_BYTES / bs) * bs));
  let pos = 0;
  while (pos < total) {
    const want = Math.min(chunk.length, total - pos);
    const got = await src.pread(want === chunk.length ? chunk : chunk.subarray(0, want), pos);
    if (got <= 0) throw new TruncatedError(`source ended at ${pos} of ${total} bytes`, src.name, pos);
    await builder.append(chunk.subarray(0, got));
    pos += got;
  }
  return builder.finish();
}
