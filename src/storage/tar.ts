// The tar wrapper of overlaybd's `-t` flag (docs/formats.md, Tar wrapper): a ustar "00" archive with a
// PAX header carrying the size, one entry "overlaybd.commit", then the payload.

import { FormatError, IoRangeError, TruncatedError } from "./errors.ts";
import type { ReadableFile, WritableFile } from "./file.ts";

export const TAR_BLOCK = 512;
/** Payload offset of an overlaybd tar: PAX header, PAX record block, entry header. */
export const OVERLAYBD_TAR_PAYLOAD_OFFSET = 3 * TAR_BLOCK;

const NAME = 0;
const MODE = 100;
const UID = 108;
const GID = 116;
const SIZE = 124;
const MTIME = 136;
const CHKSUM = 148;
const TYPEFLAG = 156;
const MAGIC = 257;
const VERSION = 263;
const UNAME = 265;
const GNAME = 297;

const TYPE_PAX = 0x78; // 'x'
const TYPE_REG = 0x30; // '0'

const ascii = (s: string): Uint8Array => new TextEncoder().encode(s);

function headerSums(h: Uint8Array): { unsigned: number; signed: number } {
  let unsigned = 0;
  let signed = 0;
  for (let i = 0; i < TAR_BLOCK; i++) {
    // The checksum field itself counts as eight spaces.
    const b = i >= CHKSUM && i < CHKSUM + 8 ? 0x20 : h[i]!;
    unsigned += b;
    signed += b >= 0x80 ? b - 256 : b;
  }
  return { unsigned, signed };
}

/** Value of an octal numeric field: leading spaces, octal digits, then anything; base-256 when the top bit is set. */
function parseNumeric(h: Uint8Array, at: number, len: number): number {
  if (h[at]! & 0x80) {
    let n = h[at]! & 0x3f;
    for (let i = 1; i < len; i++) n = n * 256 + h[at + i]!;
    return n;
  }
  let i = at;
  const end = at + len;
  while (i < end && (h[i] === 0x20 || h[i] === 0x09)) i++;
  let n = 0;
  let digits = 0;
  for (; i < end && h[i]! >= 0x30 && h[i]! <= 0x37; i++, digits++) n = n * 8 + (h[i]! - 0x30);
  return digits === 0 ? -1 : n;
}

/**
 * True when a 512-byte block is a ustar "00" header with a good checksum: the C++ reader's test
 * (unsigned or signed sum). GNU tars ("ustar  ") do not qualify.
 */
export function isOverlaybdTar(first512: Uint8Array): boolean {
  if (first512.length < TAR_BLOCK) return false;
  const magic = [0x75, 0x73, 0x74, 0x61, 0x72]; // "ustar"
  for (let i = 0; i < 5; i++) if (first512[MAGIC + i] !== magic[i]) return false;
  if (first512[VERSION] !== 0x30 || first512[VERSION + 1] !== 0x30) return false;
  const stored = parseNumeric(first512, CHKSUM, 8);
  const { unsigned, signed } = headerSums(first512);
  return stored === unsigned || stored === signed;
}

/** The "size" value of a PAX extended header ("<len> key=value\n" records), or -1 when absent. */
export function paxSize(records: Uint8Array): number {
  const text = new TextDecoder().decode(records);
  let pos = 0;
  let size = -1;
  while (pos < text.length && text.charCodeAt(pos) !== 0) {
    const space = text.indexOf(" ", pos);
    const len = space > pos ? Number(text.slice(pos, space)) : NaN;
    if (!Number.isInteger(len) || len <= space - pos || pos + len > text.length || text[pos + len - 1] !== "\n") {
      throw new FormatError(`malformed PAX record at ${pos}`);
    }
    const record = text.slice(space + 1, pos + len - 1);
    const eq = record.indexOf("=");
    if (eq < 0) throw new FormatError(`PAX record without '=' at ${pos}`);
    if (record.slice(0, eq) === "size") {
      const value = record.slice(eq + 1);
      if (!/^[0-9]+$/.test(value) || !Number.isSafeInteger(Number(value))) throw new FormatError(`bad PAX size "${value}"`);
      size = Number(value);
    }
    pos += len;
  }
  return size;
}

/**
 * The payload of an overlaybd tar as a ReadableFile: it starts at 512, or at 1536 when the first
 * entry is a PAX header, and its size is the PAX "size" or else the entry's ustar size.
 * close() closes the underlying file; when open() fails the caller still owns it.
 */
export class TarView implements ReadableFile {
  readonly name: string;

  private constructor(
    private readonly file: ReadableFile,
    readonly payloadOffset: number,
    private readonly payloadSize: number,
  ) {
    this.name = file.name;
  }

  static async open(file: ReadableFile): Promise<TarView> {
    const name = file.name;
    const first = new Uint8Array(TAR_BLOCK);
    const got = await file.pread(first, 0);
    if (got < TAR_BLOCK || !isOverlaybdTar(first)) throw new FormatError("not a ustar archive with a valid header", name, 0);
    if (first[TYPEFLAG] !== TYPE_PAX) {
      const size = parseNumeric(first, SIZE, 12);
      if (size < 0) throw new FormatError("tar entry has no size", name, SIZE);
      return TarView.checked(file, TAR_BLOCK, size);
    }
    const recordLen = parseNumeric(first, SIZE, 12);
    // The C++ reader assumes the PAX records fit in one block and the payload starts at 1536.
    if (recordLen < 0 || recordLen > TAR_BLOCK) throw new FormatError(`PAX header of ${recordLen} bytes is not one block`, name, SIZE);
    const blocks = new Uint8Array(2 * TAR_BLOCK);
    const got2 = await file.pread(blocks, TAR_BLOCK);
    if (got2 < blocks.length) throw new TruncatedError("tar ends inside its headers", name, TAR_BLOCK + got2);
    let size: number;
    try {
      size = paxSize(blocks.subarray(0, recordLen));
    } catch (e) {
      throw new FormatError((e as Error).message, name, TAR_BLOCK);
    }
    if (size < 0) size = parseNumeric(blocks, TAR_BLOCK + SIZE, 12);
    if (size < 0) throw new FormatError("tar entry has no size", name, 2 * TAR_BLOCK + SIZE);
    return TarView.checked(file, OVERLAYBD_TAR_PAYLOAD_OFFSET, size);
  }

  private static checked(file: ReadableFile, offset: number, size: number): TarView {
    if (offset + size > file.size()) {
      throw new TruncatedError(`tar payload of ${size} bytes at ${offset} passes the end of the file (${file.size()})`, file.name, file.size());
    }
    return new TarView(file, offset, size);
  }

  size(): number {
    return this.payloadSize;
  }

  async pread(buf: Uint8Array, offset: number): Promise<number> {
    if (!Number.isSafeInteger(offset) || offset < 0) throw new IoRangeError(`bad read offset ${offset}`, this.name, offset);
    if (offset >= this.payloadSize) return 0;
    const len = Math.min(buf.length, this.payloadSize - offset);
    const view = len === buf.length ? buf : buf.subarray(0, len);
    return this.file.pread(view, this.payloadOffset + offset);
  }

  async close(): Promise<void> {
    await this.file.close();
  }
}

// libtar's int_to_oct: octal right-aligned in width-2 columns, a space, then NUL.
function putOctalSpaceNul(h: Uint8Array, at: number, width: number, value: number): void {
  h.set(ascii(value.toString(8).padStart(width - 2, " ") + " "), at);
  h[at + width - 1] = 0;
}

// libtar's int_to_oct_nonull: octal right-aligned in width-1 columns, then a space, no NUL.
function putOctalSpace(h: Uint8Array, at: number, width: number, value: number): void {
  h.set(ascii(value.toString(8).padStart(width - 1, " ") + " "), at);
}

function finishHeader(h: Uint8Array): void {
  h.set(ascii("ustar\0"), MAGIC);
  h.set(ascii("00"), VERSION);
  putOctalSpaceNul(h, CHKSUM, 8, headerSums(h).unsigned);
}

/** A PAX record "<len> key=value\n", where len counts the whole record including its own digits. */
function paxRecord(key: string, value: string): string {
  const body = ` ${key}=${value}\n`;
  let len = body.length + String(body.length).length;
  // Adding the digits can add a digit (e.g. 9 -> 10); the second pass settles it.
  if (String(len).length + body.length !== len) len = String(len).length + body.length;
  return `${len}${body}`;
}

/** S_IFMT and S_IFREG: the entry's mode is the tar file's own st_mode, type bits included. */
const S_IFMT = 0o170000;
const S_IFREG = 0o100000;

/**
 * The first 1536 bytes of an overlaybd tar holding payloadSize bytes, as the C++ tools write them
 * with root's uid/gid/names and mtime 0; mode is the tar file's whole st_mode, as overlaybd records
 * it (e.g. 0o100644: a regular file's type bits, then the permissions).
 */
export function overlaybdTarHead(payloadSize: number, mode: number): Uint8Array {
  if (!Number.isSafeInteger(payloadSize) || payloadSize < 0) throw new RangeError(`bad payload size ${payloadSize}`);
  if (!Number.isInteger(mode) || mode < 0 || mode > 0o777777) throw new RangeError(`mode ${mode} does not fit the field`);
  if ((mode & S_IFMT) !== S_IFREG) throw new RangeError(`mode 0o${mode.toString(8)} is not a regular file's st_mode (type bits 0o100000)`);
  const out = new Uint8Array(OVERLAYBD_TAR_PAYLOAD_OFFSET);
  const record = ascii(paxRecord("size", String(payloadSize)));
  const pax = out.subarray(0, TAR_BLOCK);
  pax.set(ascii("overlaybd.pax"), NAME);
  putOctalSpace(pax, SIZE, 12, record.length);
  pax[TYPEFLAG] = TYPE_PAX;
  finishHeader(pax);
  out.set(record, TAR_BLOCK);
  const entry = out.subarray(2 * TAR_BLOCK, 3 * TAR_BLOCK);
  entry.set(ascii("overlaybd.commit"), NAME);
  putOctalSpaceNul(entry, MODE, 8, mode);
  putOctalSpaceNul(entry, UID, 8, 0);
  putOctalSpaceNul(entry, GID, 8, 0);
  // The real size lives in the PAX record; the ustar field says 0.
  putOctalSpace(entry, SIZE, 12, 0);
  putOctalSpace(entry, MTIME, 12, 0);
  entry[TYPEFLAG] = TYPE_REG;
  entry.set(ascii("root"), UNAME);
  entry.set(ascii("root"), GNAME);
  finishHeader(entry);
  return out;
}

/** What follows the payload: zero padding to a 512 multiple, then two zero blocks. */
export function overlaybdTarTail(payloadSize: number): Uint8Array {
  const pad = (TAR_BLOCK - (payloadSize % TAR_BLOCK)) % TAR_BLOCK;
  return new Uint8Array(pad + 2 * TAR_BLOCK);
}

/** Total size of an overlaybd tar holding payloadSize bytes. */
export function overlaybdTarSize(payloadSize: number): number {
  return OVERLAYBD_TAR_PAYLOAD_OFFSET + payloadSize + overlaybdTarTail(payloadSize).length;
}

/** Wrap all of payload into out as an overlaybd tar (out is cut to the tar's size; no fsync); returns that size. */
export async function writeOverlaybdTar(payload: ReadableFile, out: WritableFile, mode: number): Promise<number> {
  const size = payload.size();
  await out.pwrite(overlaybdTarHead(size, mode), 0);
  const chunk = new Uint8Array(Math.min(1 << 20, Math.max(size, 1)));
  let pos = 0;
  while (pos < size) {
    const want = Math.min(chunk.length, size - pos);
    const view = want === chunk.length ? chunk : chunk.subarray(0, want);
    const got = await payload.pread(view, pos);
    if (got <= 0) throw new TruncatedError(`payload ended at ${pos} of ${size} bytes`, payload.name, pos);
    await out.pwrite(got === view.length ? view : view.subarray(0, got), OVERLAYBD_TAR_PAYLOAD_OFFSET + pos);
    pos += got;
  }
  await out.pwrite(overlaybdTarTail(size), OVERLAYBD_TAR_PAYLOAD_OFFSET + size);
  const total = overlaybdTarSize(size);
  if (out.size() > total) await out.truncate(total);
  return total;
}
