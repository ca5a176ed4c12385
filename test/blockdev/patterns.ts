// Data the fixtures write and the tests check: every 4-byte word names its pass, chunk and place,
// so a chunk that is stale, misplaced or torn shows which.
export const CHUNK = 256 << 10; // a WRITE this large starts a device's FUSE reader thread

export function chunkPattern(pass: number, chunk: number): Uint8Array {
  const words = new Uint32Array(CHUNK / 4);
  for (let i = 0; i < words.length; i++) words[i] = ((pass & 0xff) << 24) ^ ((chunk & 0xfff) << 12) ^ i;
  return new Uint8Array(words.buffer);
}

/** The first chunk of `data` that is not pass `pass`'s pattern, or -1 when every one is. */
export function firstBadChunk(data: Uint8Array, pass: number): number {
  for (let c = 0; c < data.length / CHUNK; c++) if (Buffer.compare(data.subarray(c * CHUNK, (c + 1) * CHUNK), chunkPattern(pass, c)) !== 0) return c;
  return -1;
}
