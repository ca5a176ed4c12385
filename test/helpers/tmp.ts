// Scratch directories for tests: on the real disk (not tmpfs, so O_DIRECT and holes behave as in
// production), removed when the test file ends.
import { mkdtempSync, rmSync, mkdirSync } from "node:fs";
import { join } from "node:path";
import { afterAll } from "bun:test";

const ROOT = "/var/tmp/aenv-test";

/** A fresh directory removed after the test file (or, with keep, left to the caller). */
export function scratchDir(label: string, opts: { keep?: boolean } = {}): string {
  mkdirSync(ROOT, { recursive: true });
  const dir = mkdtempSync(join(ROOT, `${label}-`));
  if (!opts.keep) afterAll(() => rmSync(dir, { recursive: true, force: true }));
  return dir;
}

export function sha256(b: Uint8Array): string {
  return new Bun.CryptoHasher("sha256").update(b).digest("hex");
}

/** A deterministic PRNG (mulberry32) so failures reproduce from a printed seed. */
export function prng(seed: number): () => number {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}
