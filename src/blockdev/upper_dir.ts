// A caller's upperDir, where a writable device's upper lives: made (mkdir -p) for a new writable
// layer, and removed again, with what was made for it, when the call fails.

import { mkdir, rm, stat } from "node:fs/promises";
import { join } from "node:path";
import { WRITABLE_DATA, WRITABLE_INDEX, WritableLayer } from "../storage/lsmt/writable_layer.ts";

export async function exists(path: string): Promise<boolean> {
  return stat(path).then(
    () => true,
    () => false,
  );
}

/** upperDir made (mkdir -p) for a writable layer; returns what removes it again (the directories made, or the layer's files). */
export async function upperFolder(upperDir: string): Promise<() => Promise<void>> {
  const data = join(upperDir, WRITABLE_DATA);
  const index = join(upperDir, WRITABLE_INDEX);
  const madeDir = await mkdir(upperDir, { recursive: true });
  return async () => {
    if (madeDir) await rm(madeDir, { recursive: true, force: true });
    else await Promise.all([rm(data, { force: true }), rm(index, { force: true })]);
  };
}

/** A fresh writable layer in upperDir; returns what removes it again (and the directories made for it). */
export async function makeUpper(upperDir: string, size: number, sparse: boolean): Promise<() => Promise<void>> {
  const remove = await upperFolder(upperDir);
  try {
    await (await WritableLayer.create(join(upperDir, WRITABLE_DATA), join(upperDir, WRITABLE_INDEX), { virtualSize: size, sparse })).close();
  } catch (e) {
    await remove();
    throw e;
  }
  return remove;
}
