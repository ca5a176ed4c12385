// LSMT HeaderTrailer: the 4096-byte block at the start (and, for read-only layers, the end)
// of every layer file (docs/formats.md, LSMT header and trailer).

import { FieldError, FormatError, magicMismatch, magicPartsMatching } from "../errors.ts";

export const HT_SPACE = 4096;
export const HT_STRUCT_SIZE = 390;
const MAGIC0 = [0x4c, 0x53, 0x4d, 0x54, 0x00, 0x01, 0x02, 0x00];
const MAGIC1 = [0x65, 0x7e, 0x63, 0xd2, 0x94, 0x44, 0x08, 0x4c, 0xa2, 0xd2, 0xc8, 0xec, 0x4f, 0xcf, 0xae, 0x8a];
const MAGIC = [MAGIC0, MAGIC1] as const;
/** A disk is whole sectors. */
const DISK_SECTOR = 512;

/** Byte offsets of the fields errors name. */
export const HT_FIELD = { flags: 28, indexOffset: 32, indexSize: 40, virtualSize: 48 } as const;

export const FLAG_HEADER = 0x01;
export const FLAG_DATA = 0x02;
export const FLAG_SEALED = 0x04;
export const FLAG_SPARSE = 0x10;

export const NULL_UUID = "00000000-0000-0000-0000-000000000000";
const UUID_RE = /^[0-9A-Fa-f]{8}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{12}$/;
const USER_TAG_MAX = 256;

export interface HeaderTrailer {
  flags: number;
  indexOffset: number; // bytes
  indexSize: number; // entries
  virtualSize: number; // bytes
  uuid: string; // upper-case text; NULL_UUID for none
  parentUuid: string;
  version: number;
  subVersion: number;
  userTag: Uint8Array; // up to 256 bytes, no terminator needed
}

export function newHeader(fields: Partial<HeaderTrailer>): HeaderTrailer {
  return {
    flags: 0,
    indexOffset: 0,
    indexSize: 0,
    virtualSize: 0,
    uuid: NULL_UUID,
    parentUuid: NULL_UUID,
    version: 1,
    subVersion: 1,
    userTag: new Uint8Array(0),
    ...fields,
  };
}

/** C++ form of a UUID: upper case; anything unparsable (empty, garbage) is the null UUID. */
export function normalizeUuid(text: string | undefined): string {
  if (!text || !UUID_RE.test(text)) return NULL_UUID;
  return text.toUpperCase();
}

export function parseUuidArg(text: string): string {
  if (!UUID_RE.test(text)) throw new FormatError(`not a UUID: ${JSON.stringify(text)}`);
  return text.toUpperCase();
}

export function randomUuid(): string {
  return crypto.randomUUID().toUpperCase();
}

export function userTagFromString(s: string): Uint8Array {
  const b = new TextEncoder().encode(s);
  if (b.length > USER_TAG_MAX) throw new FormatError(`user tag is ${b.length} bytes, at most ${USER_TAG_MAX}`);
  return b;
}

export function userTagText(tag: Uint8Array): string {
  const z = tag.indexOf(0);
  return new TextDecoder().decode(z < 0 ? tag : tag.subarray(0, z));
}

export function encodeHeader(h: HeaderTrailer): Uint8Array {
  const out = new Uint8Array(HT_SPACE);
  const dv = new DataView(out.buffer);
  out.set(MAGIC0, 0);
  out.set(MAGIC1, 8);
  dv.setUint32(24, HT_STRUCT_SIZE, true);
  dv.setUint32(28, h.flags >>> 0, true);
  dv.setBigUint64(32, BigInt(h.indexOffset), true);
  dv.setBigUint64(40, BigInt(h.indexSize), true);
  dv.setBigUint64(48, BigInt(h.virtualSize), true);
  writeUuid(out, 56, h.uuid);
  writeUuid(out, 93, h.parentUuid);
  dv.setUint16(130, 0, true);
  out[132] = h.version;
  out[133] = h.subVersion;
  if (h.userTag.length > USER_TAG_MAX) throw new FormatError(`user tag longer than ${USER_TAG_MAX} bytes`);
  out.set(h.userTag, 134);
  return out;
}

function writeUuid(out: Uint8Array, pos: number, uuid: string): void {
  const text = normalizeUuid(uuid);
  for (let i = 0; i < 36; i++) out[pos + i] = text.charCodeAt(i);
  out[pos + 36] = 0;
}

function readUuid(b: Uint8Array, pos: number): string {
  let s = "";
  for (let i = 0; i < 36; i++) s += String.fromCharCode(b[pos + i]!);
  return normalizeUuid(s);
}

export function hasLsmtMagic(b: Uint8Array): boolean {
  return magicPartsMatching(b, MAGIC) === 2;
}

/** One of the two magic parts matches: an LSMT block with a damaged magic, not some other format. */
export function hasDamagedLsmtMagic(b: Uint8Array): boolean {
  return magicPartsMatching(b, MAGIC) === 1;
}

/** "Is this an LSMT file?": magic and is_header in the first block. */
export function isLsmtHeader(b: Uint8Array): boolean {
  return hasLsmtMagic(b) && b.length >= 32 && (b[28]! & FLAG_HEADER) !== 0;
}

export function decodeHeader(b: Uint8Array, file = "", offset = 0): HeaderTrailer {
  if (b.length < HT_STRUCT_SIZE) throw new FormatError("header block is truncated", file, offset);
  const bad = magicMismatch(b, MAGIC);
  if (bad) throw new FormatError(`bad LSMT magic: ${bad}`, file, offset);
  const dv = new DataView(b.buffer, b.byteOffset, b.byteLength);
  const u64 = (p: number, what: string) => {
    const v = dv.getBigUint64(p, true);
    if (v > BigInt(Number.MAX_SAFE_INTEGER)) throw new FieldError(what, v.toString(), "is impossible (over 2^53)", file, offset + p);
    return Number(v);
  };
  return {
    flags: dv.getUint32(28, true),
    indexOffset: u64(32, "index_offset"),
    indexSize: u64(40, "index_size"),
    virtualSize: u64(48, "virtual_size"),
    uuid: readUuid(b, 56),
    parentUuid: readUuid(b, 93),
    version: b[132]!,
    subVersion: b[133]!,
    userTag: b.slice(134, 134 + USER_TAG_MAX),
  };
}

/**
 * The size a stack's disk takes from `virtual_size`: not 0 and whole sectors. C++ opens a layer
 * with either (a size-0 layer takes its disk size from a layer above), so this is checked on the
 * stack, not on each layer.
 */
export function checkDiskSize(virtualSize: number, file: string, offset = -1): void {
  if (virtualSize === 0) throw new FieldError("virtual_size", 0, "in every layer of the stack: the disk has no size", file, offset);
  if (virtualSize % DISK_SECTOR)
    throw new FieldError("virtual_size", virtualSize, `is not a multiple of ${DISK_SECTOR}: a disk is whole sectors`, file, offset);
}
