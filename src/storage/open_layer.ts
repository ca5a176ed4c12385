// Open a read-only layer file whatever its wrapping: tar → ZFile → LSMT, detected in that order
// (overlaybd-format.md §1); each level is a plain random-access file to the next.

import type { ReadableFile } from "./file.ts";
import { LocalFile } from "./local_file.ts";
import { ReadOnlyLayer } from "./lsmt/readonly_layer.ts";
import { TarView, isOverlaybdTar } from "./tar.ts";
import { ZFileReader, isZFile } from "./zfile.ts";

export type Wrapping = "tar" | "zfile";

/** Peel tar and ZFile wrappers off `file`; returns the logical LSMT file and what was peeled. */
export async function unwrap(file: ReadableFile): Promise<{ file: ReadableFile; wrappers: Wrapping[] }> {
  const wrappers: Wrapping[] = [];
  const head = new Uint8Array(512);
  const n = await file.pread(head, 0);
  if (n === 512 && isOverlaybdTar(head)) {
    file = await TarView.open(file);
    wrappers.push("tar");
    head.fill(0);
    await file.pread(head, 0);
  }
  if (isZFile(head)) {
    file = await ZFileReader.open(file);
    wrappers.push("zfile");
  }
  return { file, wrappers };
}

export async function openLayerFile(path: string): Promise<ReadOnlyLayer> {
  const local = await LocalFile.open(path, {});
  try {
    return await ReadOnlyLayer.open((await unwrap(local)).file);
  } catch (e) {
    await local.close();
    throw e;
  }
}
