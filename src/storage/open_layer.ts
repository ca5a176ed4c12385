// Open a read-only layer file whatever its wrapping: tar → ZFile → LSMT, detected in that order
// (docs/formats.md, How a layer file nests); each level is a plain random-access file to the next.

import { statSync } from "node:fs";
import { FileTypeError, FormatError, hexBytes } from "./errors.ts";
import type { ReadableFile } from "./file.ts";
import type { IoLimiter } from "./io_limiter.ts";
import { LocalFile } from "./local_file.ts";
import { openRemoteFile } from "./remote/layer.ts";
import { REMOTE_PREFIX } from "./remote/spec.ts";
import { hasDamagedLsmtMagic, hasLsmtMagic } from "./lsmt/header.ts";
import { ReadOnlyLayer } from "./lsmt/readonly_layer.ts";
import { TarView, isOverlaybdTar } from "./tar.ts";
import { ZFileReader, hasDamagedZFileMagic, isZFile, zfileHeaderProblem } from "./zfile.ts";

export type Wrapping = "tar" | "zfile";

/** "ustar" at byte 257: a tar header, whether or not its checksum holds. */
const USTAR_AT = 257;
const USTAR = [0x75, 0x73, 0x74, 0x61, 0x72];

/**
 * Refuse what is not a regular file before opening it: opening a FIFO blocks until a writer
 * comes, and a device or directory has no layer size. A missing path is left to open to report.
 */
export function requireRegularFile(path: string): void {
  const st = statSync(path, { throwIfNoEntry: false });
  if (!st || st.isFile()) return;
  const kind = st.isFIFO()
    ? "a FIFO"
    : st.isCharacterDevice()
      ? "a character device"
      : st.isBlockDevice()
        ? "a block device"
        : st.isDirectory()
          ? "a directory"
          : st.isSocket()
            ? "a socket"
            : "not a file";
  throw new FileTypeError(`is ${kind}, not a regular file`, path);
}

/**
 * Peel tar and ZFile wrappers off `file`; returns the logical LSMT file and what was peeled.
 * A first block that is none of the three, or one with a damaged magic, is a FormatError that
 * names the format it was meant to be.
 */
export async function unwrap(file: ReadableFile): Promise<{ file: ReadableFile; wrappers: Wrapping[] }> {
  const wrappers: Wrapping[] = [];
  const head = new Uint8Array(512);
  const n = await file.pread(head, 0);
  if (n === 512 && isOverlaybdTar(head)) {
    file = await TarView.open(file);
    wrappers.push("tar");
    head.fill(0);
    await file.pread(head, 0);
  } else if (USTAR.every((x, i) => head[USTAR_AT + i] === x)) {
    throw new FormatError("tar header (\"ustar\" at byte 257) is not POSIX ustar with a good checksum (GNU tar is not read)", file.name, 0);
  }
  if (isZFile(head)) {
    file = await ZFileReader.open(file);
    wrappers.push("zfile");
  } else if (hasDamagedZFileMagic(head)) {
    throw zfileHeaderProblem(head, file.name)!;
  } else if (!hasLsmtMagic(head) && !hasDamagedLsmtMagic(head)) {
    throw new FormatError(`no tar, ZFile or LSMT header at byte 0 (it starts ${hexBytes(head.subarray(0, 8))})`, file.name, 0);
  }
  return { file, wrappers };
}

/**
 * A layer file by path, or a remote layer by `remote:sha256:<hex>` (registered in this thread,
 * see remote/layer.ts), reading through `remoteIo`, the node-wide remote-I/O budget.
 */
export async function openLayerFile(path: string, opts: { remoteIo?: IoLimiter } = {}): Promise<ReadOnlyLayer> {
  let base: ReadableFile;
  if (path.startsWith(REMOTE_PREFIX)) base = openRemoteFile(path, opts);
  else {
    requireRegularFile(path);
    base = LocalFile.open(path, {});
  }
  try {
    return await ReadOnlyLayer.open((await unwrap(base)).file);
  } catch (e) {
    await base.close();
    throw e;
  }
}
