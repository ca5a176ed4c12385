// The node's peer identity: a 32-byte ed25519 secret key in `$AENV_HOME/p2p/secret-key` (mode
// 0600, directory 0700), made on first start. Two starts racing on one home agree on one key: the
// key is written to a private temporary file and linked into place, and the loser reads the winner's.

import { link, mkdir, open, readFile, rm, stat } from "node:fs/promises";
import { join } from "node:path";
import { SecretKey } from "@number0/iroh";

export const KEY_BYTES = 32;

export class KeyFileError extends Error {
  override name = "KeyFileError";
  constructor(readonly path: string, why: string) {
    super(`${path}: ${why}`);
  }
}

export function keyPath(home: string): string {
  return join(home, "p2p", "secret-key");
}

/** The node's secret key bytes, created on first use. */
export async function loadOrCreateSecretKey(home: string): Promise<number[]> {
  const path = keyPath(home);
  await mkdir(join(home, "p2p"), { recursive: true, mode: 0o700 });
  const existing = await readKey(path);
  if (existing) return existing;
  const bytes = SecretKey.generate().toBytes();
  const tmp = `${path}.${process.pid}.${Math.random().toString(36).slice(2)}`;
  const fh = await open(tmp, "wx", 0o600);
  try {
    await fh.writeFile(new Uint8Array(bytes));
    await fh.sync();
  } finally {
    await fh.close();
  }
  try {
    await link(tmp, path);
  } catch (e) {
    if ((e as NodeJS.ErrnoException).code !== "EEXIST") throw e;
  } finally {
    await rm(tmp, { force: true });
  }
  const won = await readKey(path);
  if (!won) throw new KeyFileError(path, "vanished after it was written");
  return won;
}

async function readKey(path: string): Promise<number[] | undefined> {
  let b: Buffer;
  try {
    b = await readFile(path);
  } catch (e) {
    if ((e as NodeJS.ErrnoException).code === "ENOENT") return undefined;
    throw e;
  }
  if (b.length !== KEY_BYTES) throw new KeyFileError(path, `holds ${b.length} bytes, a key is ${KEY_BYTES}`);
  const mode = (await stat(path)).mode & 0o777;
  if (mode & 0o077) throw new KeyFileError(path, `mode ${mode.toString(8)}: others may read it (want 600)`);
  return Array.from(b);
}
