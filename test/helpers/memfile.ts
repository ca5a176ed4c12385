// In-memory files and generated data for storage tests. MemFile is a real WritableFile over a
// growable array (not a mock of ours): format code reads and writes it like any backend.
import type { WritableFile } from "../../src/storage/file.ts";

export class MemFile implements WritableFile {
  private data: Uint8Array;
  private length: number;
  closed = false;
  constructor(
    readonly name: string,
    init: Uint8Array = new Uint8Array(0),
  ) {
    this.data = init.slice();
    this.length = init.length;
  }
  size(): number {
    return this.length;
  }
  async pread(buf: Uint8Array, offset: number): Promise<number> {
    if (offset >= this.length) return 0;
    const n = Math.min(buf.length, this.length - offset);
    buf.set(this.data.subarray(offset, offset + n));
    return n;
  }
  async pwrite(buf: Uint8Array, offset: number): Promise<void> {
    const end = offset + buf.length;
    if (end > this.data.length) {
      const grown = new Uint8Array(Math.max(end, this.data.length * 2));
      grown.set(this.data.subarray(0, this.length));
      this.data = grown;
    }
    if (offset > this.length) this.data.fill(0, this.length, offset);
    this.data.set(buf, offset);
    this.length = Math.max(this.length, end);
  }
  async fdatasync(): Promise<void> {}
  async truncate(size: number): Promise<void> {
    if (size > this.length) await this.pwrite(new Uint8Array(size - this.length), this.length);
    this.length = size;
  }
  async punchHole(offset: number, length: number): Promise<void> {
    this.data.fill(0, offset, Math.min(offset + length, this.length));
  }
  async close(): Promise<void> {
    this.closed = true;
  }
  bytes(): Uint8Array {
    return this.data.slice(0, this.length);
  }
}

/** Deterministic xorshift bytes (incompressible). */
export function randomBytes(n: number, seed: number): Uint8Array {
  const out = new Uint8Array(n);
  let x = seed >>> 0 || 1;
  for (let i = 0; i < n; i++) {
    x ^= x << 13;
    x ^= x >>> 17;
    x ^= x << 5;
    out[i] = x & 0xff;
  }
  return out;
}

/** Deterministic text-like bytes (compressible). */
export function compressible(n: number, seed: number): Uint8Array {
  const words = ["overlaybd ", "zfile ", "block ", "lsmt ", "segment ", "index ", "\n", "0123 "];
  const out = new Uint8Array(n);
  const rnd = randomBytes(Math.max(n, 1), seed);
  let p = 0;
  for (let i = 0; p < n; i++) {
    const w = words[rnd[i % n]! % words.length]!;
    for (let k = 0; k < w.length && p < n; k++) out[p++] = w.charCodeAt(k);
  }
  return out;
}

