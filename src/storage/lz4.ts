// LZ4 *block* format (no frame): what the C++ overlaybd tools store in a ZFile by default.
// The decoder checks every bound; the compressor follows the LZ4_compress_default match finder.

import { FormatError } from "./errors.ts";

const MIN_MATCH = 4;
// Inputs shorter than this are one literal run (LZ4's LZ4_minLength = MFLIMIT + 1).
const MIN_INPUT_TO_MATCH = 13;
// A match may not start in the last 12 bytes, and the last 5 bytes are always literals.
const MATCH_FIND_LIMIT = 12;
const LAST_LITERALS = 5;
const MAX_DISTANCE = 65535;
const HASH_LOG = 13;
const SKIP_TRIGGER = 6;

/** Largest possible output of lz4CompressInto for n input bytes (LZ4_COMPRESSBOUND). */
export function lz4CompressBound(n: number): number {
  return n + Math.floor(n / 255) + 16;
}

// One table for every call: compression is synchronous, so calls never overlap.
const hashTable = new Int32Array(1 << HASH_LOG);

function hash4(src: Uint8Array, p: number): number {
  const v = src[p]! | (src[p + 1]! << 8) | (src[p + 2]! << 16) | (src[p + 3]! << 24);
  return Math.imul(v, 0x9e3779b1) >>> (32 - HASH_LOG);
}

function equal4(src: Uint8Array, a: number, b: number): boolean {
  return src[a] === src[b] && src[a + 1] === src[b + 1] && src[a + 2] === src[b + 2] && src[a + 3] === src[b + 3];
}

function writeLengthTail(dst: Uint8Array, op: number, rest: number): number {
  while (rest >= 255) {
    dst[op++] = 255;
    rest -= 255;
  }
  dst[op++] = rest;
  return op;
}

function copyBytes(dst: Uint8Array, op: number, src: Uint8Array, from: number, len: number): void {
  // A view plus set() only pays off for longer runs.
  if (len > 32) dst.set(src.subarray(from, from + len), op);
  else for (let k = 0; k < len; k++) dst[op + k] = src[from + k]!;
}

/**
 * Compress src as one LZ4 block into dst (at least lz4CompressBound(src.length) long); returns the
 * length written. For inputs below 64 KiB + 11 bytes (every ZFile block) it takes the same
 * decisions as LZ4_compress_default (16-bit table, 13-bit hash, acceleration 1).
 */
export function lz4CompressInto(src: Uint8Array, dst: Uint8Array): number {
  const n = src.length;
  if (dst.length < lz4CompressBound(n)) throw new RangeError(`lz4: output buffer ${dst.length} < bound ${lz4CompressBound(n)}`);
  let op = 0;
  let anchor = 0;
  if (n >= MIN_INPUT_TO_MATCH) {
    const table = hashTable;
    table.fill(0);
    const mflimitPlusOne = n - MATCH_FIND_LIMIT + 1;
    const matchLimit = n - LAST_LITERALS;
    table[hash4(src, 0)] = 0;
    let ip = 1;
    let forwardH = hash4(src, ip);
    search: for (;;) {
      let match = 0;
      // Skip ahead faster and faster while nothing matches (LZ4's skip trigger).
      let forwardIp = ip;
      let step = 1;
      let searchMatchNb = 1 << SKIP_TRIGGER;
      for (;;) {
        const h = forwardH;
        ip = forwardIp;
        forwardIp += step;
        step = searchMatchNb++ >>> SKIP_TRIGGER;
        if (forwardIp > mflimitPlusOne) break search;
        match = table[h]!;
        forwardH = hash4(src, forwardIp);
        table[h] = ip;
        if (ip - match <= MAX_DISTANCE && equal4(src, match, ip)) break;
      }
      while (ip > anchor && match > 0 && src[ip - 1] === src[match - 1]) {
        ip--;
        match--;
      }
      const litLen = ip - anchor;
      let token = op++;
      if (litLen >= 15) {
        dst[token] = 0xf0;
        op = writeLengthTail(dst, op, litLen - 15);
      } else {
        dst[token] = litLen << 4;
      }
      copyBytes(dst, op, src, anchor, litLen);
      op += litLen;
      // Emit matches back to back while the next position matches right away.
      for (;;) {
        const offset = ip - match;
        dst[op++] = offset & 0xff;
        dst[op++] = offset >>> 8;
        let p = ip + MIN_MATCH;
        let m = match + MIN_MATCH;
        while (p < matchLimit && src[p] === src[m]) {
          p++;
          m++;
        }
        const extra = p - ip - MIN_MATCH;
        ip = p;
        if (extra >= 15) {
          dst[token] = dst[token]! + 15;
          op = writeLengthTail(dst, op, extra - 15);
        } else {
          dst[token] = dst[token]! + extra;
        }
        anchor = ip;
        if (ip >= mflimitPlusOne) break search;
        table[hash4(src, ip - 2)] = ip - 2;
        const h = hash4(src, ip);
        match = table[h]!;
        table[h] = ip;
        if (ip - match <= MAX_DISTANCE && equal4(src, match, ip)) {
          token = op++;
          dst[token] = 0;
          continue;
        }
        break;
      }
      forwardH = hash4(src, ++ip);
    }
  }
  const lastRun = n - anchor;
  if (lastRun >= 15) {
    dst[op++] = 0xf0;
    op = writeLengthTail(dst, op, lastRun - 15);
  } else {
    dst[op++] = lastRun << 4;
  }
  copyBytes(dst, op, src, anchor, lastRun);
  return op + lastRun;
}

/** Compress src as one LZ4 block into a fresh array of exactly the compressed length. */
export function lz4Compress(src: Uint8Array): Uint8Array {
  const out = new Uint8Array(lz4CompressBound(src.length));
  return out.slice(0, lz4CompressInto(src, out));
}

/**
 * Decode one LZ4 block into dst; returns the number of bytes produced. Malformed input (a run or
 * match past either end, offset 0 or before the output start) throws FormatError; nothing is ever
 * written outside dst.
 */
export function lz4DecompressInto(src: Uint8Array, dst: Uint8Array): number {
  const iend = src.length;
  const oend = dst.length;
  let ip = 0;
  let op = 0;
  for (;;) {
    if (ip >= iend) throw new FormatError(`lz4: block ends at ${ip} where a token was expected`);
    const token = src[ip++]!;
    let litLen = token >>> 4;
    if (litLen === 15) {
      let b: number;
      do {
        if (ip >= iend) throw new FormatError("lz4: block ends inside a literal length");
        b = src[ip++]!;
        litLen += b;
      } while (b === 255);
    }
    if (litLen > iend - ip) throw new FormatError(`lz4: literal run of ${litLen} at ${ip} passes the end of the block`);
    if (litLen > oend - op) throw new FormatError(`lz4: output passes the expected ${oend} bytes`);
    copyBytes(dst, op, src, ip, litLen);
    ip += litLen;
    op += litLen;
    // The last sequence is literals only: the block ends right after them.
    if (ip === iend) return op;
    if (iend - ip < 2) throw new FormatError("lz4: block ends inside a match offset");
    const offset = src[ip]! | (src[ip + 1]! << 8);
    ip += 2;
    if (offset === 0 || offset > op) throw new FormatError(`lz4: match offset ${offset} at output ${op} is out of range`);
    let matchLen = token & 15;
    if (matchLen === 15) {
      let b: number;
      do {
        if (ip >= iend) throw new FormatError("lz4: block ends inside a match length");
        b = src[ip++]!;
        matchLen += b;
      } while (b === 255);
    }
    matchLen += MIN_MATCH;
    if (matchLen > oend - op) throw new FormatError(`lz4: output passes the expected ${oend} bytes`);
    const from = op - offset;
    if (offset < matchLen || matchLen <= 32) {
      // Overlapping copies repeat the pattern, so they go byte by byte.
      for (let k = 0; k < matchLen; k++) dst[op + k] = dst[from + k]!;
    } else {
      dst.copyWithin(op, from, from + matchLen);
    }
    op += matchLen;
  }
}

/** Decode one LZ4 block that must expand to exactly size bytes. */
export function lz4Decompress(src: Uint8Array, size: number): Uint8Array {
  const out = new Uint8Array(size);
  const n = lz4DecompressInto(src, out);
  if (n !== size) throw new FormatError(`lz4: block decodes to ${n} bytes, expected ${size}`);
  return out;
}
