// The deterministic write stream shared by crash_writer.ts and crash.test.ts: op n writes a
// 4 KiB block whose first 8 bytes hold n + 1, so a block read back names the op that wrote it.
import { prng } from "../helpers/tmp.ts";

export function blockFor(op: number, blocks: number): { block: number; bytes: Uint8Array } {
  const r = prng(op * 7919 + 1);
  const block = Math.floor(r() * blocks);
  const bytes = new Uint8Array(4096);
  const dv = new DataView(bytes.buffer);
  dv.setFloat64(0, op + 1, true);
  for (let i = 8; i < 4096; i += 4) dv.setUint32(i, (r() * 2 ** 32) >>> 0, true);
  return { block, bytes };
}
