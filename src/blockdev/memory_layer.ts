// Guest memory into a sealed overlaybd layer of 4 KiB blocks (docs/vmm.md, "Memory layers"):
// either a whole memory image (a cold-booted VM's RAM file: the base layer) or the pages a paused
// VM dirtied, read from its VMM's /proc/<pid>/mem (a delta layer, stacked on the image's).
// Non-zero pages are data; an all-zero page is a hole in a base layer and a zero segment in a
// delta (it must mask the page below). Work goes in 1 MiB steps; blockd runs it on a memory writer
// thread (memory_writer.ts), whose waits on each write and sync hold no other call.

import { type FileHandle, open, rename, rm, stat } from "node:fs/promises";
import { LocalFile } from "../storage/local_file.ts";
import { WritableLayer } from "../storage/lsmt/writable_layer.ts";
import { type ZFileAlgorithm, writeZFile } from "../storage/zfile.ts";
import { BlockdError } from "./protocol.ts";

const PAGE = 4096;
/** Bytes read per step. */
const STEP = 1 << 20;
/** Guest memory a layer may describe (the VM sizes the node accepts are far below). */
const MAX_SIZE = 2 ** 40;

export type MemorySource = { file: string } | { pid: number; address: number; pagesFile: string };

export interface MemoryLayerResult {
  /** Pages stored as data. */
  dataPages: number;
  /** Pages stored as zeros (delta) or left out (base). */
  zeroPages: number;
  /** Size of the sealed layer file. */
  bytes: number;
}

/** True when the 4 KiB page at `at` of `words` (a u32 view) is all zeros. */
function zeroPage(words: Uint32Array, at: number): boolean {
  for (let i = at, end = at + PAGE / 4; i < end; i++) if (words[i] !== 0) return false;
  return true;
}

/** The files a write of `out` works in until it renames its result to `out`: data, index, ZFile. */
export function memoryLayerScratch(out: string): { data: string; index: string; zfile: string } {
  return { data: `${out}.tmp.data`, index: `${out}.tmp.index`, zfile: `${out}.tmp.zfile` };
}

/**
 * Writes `out` (a sealed layer of `size` bytes) from `from`, compressed as a ZFile of 4 KiB blocks
 * when `zfile` names an algorithm; the file appears only when complete.
 */
export async function writeMemoryLayer(out: string, size: number, from: MemorySource, zfile?: ZFileAlgorithm): Promise<MemoryLayerResult> {
  if (!Number.isInteger(size) || size <= 0 || size % PAGE !== 0 || size > MAX_SIZE) throw new BlockdError("BadRequest", `memory size ${size} is not a positive multiple of ${PAGE}`);
  const tmp = memoryLayerScratch(out);
  const layer = await WritableLayer.create(tmp.data, tmp.index, { virtualSize: size });
  const delta = "pid" in from;
  let src: FileHandle;
  try {
    src = await open(delta ? `/proc/${from.pid}/mem` : from.file, "r");
  } catch (e) {
    await layer.close();
    await rm(tmp.data, { force: true });
    await rm(tmp.index, { force: true });
    throw new BlockdError("NotFound", `cannot read the memory of ${delta ? `process ${from.pid}` : from.file}: ${(e as Error).message}`);
  }
  const buf = new Uint8Array(STEP);
  const words = new Uint32Array(buf.buffer);
  const result: MemoryLayerResult = { dataPages: 0, zeroPages: 0, bytes: 0 };
  // Copies guest bytes [offset, offset+length) from `src` at `srcAt`, in steps.
  const copy = async (offset: number, length: number, srcAt: number) => {
    for (let done = 0; done < length; done += STEP) {
      const n = Math.min(STEP, length - done);
      const { bytesRead } = await src.read(buf, 0, n, srcAt + done);
      if (bytesRead !== n) throw new BlockdError("Io", `short read of guest memory at ${offset + done} (${bytesRead} of ${n} bytes)`);
      // Runs of non-zero pages become one write each, runs of zero pages one discard (delta only).
      const pages = n / PAGE;
      let p0 = 0;
      while (p0 < pages) {
        const zero = zeroPage(words, (p0 * PAGE) / 4);
        let to = p0 + 1;
        while (to < pages && zeroPage(words, (to * PAGE) / 4) === zero) to++;
        const at = offset + done + p0 * PAGE;
        if (zero) {
          result.zeroPages += to - p0;
          if (delta) await layer.discard(at, (to - p0) * PAGE);
        } else {
          await layer.write(buf.subarray(p0 * PAGE, to * PAGE), at);
          result.dataPages += to - p0;
        }
        p0 = to;
      }
    }
  };
  try {
    if ("pid" in from) {
      const runs = new Uint32Array(await Bun.file(from.pagesFile).arrayBuffer());
      let last = 0;
      for (let i = 0; i + 1 < runs.length; i += 2) {
        const first = runs[i]! * PAGE;
        const length = runs[i + 1]! * PAGE;
        if (first < last || length === 0 || first + length > size) throw new BlockdError("BadRequest", `${from.pagesFile}: run ${i / 2} is out of order or out of range`);
        last = first + length;
        await copy(first, length, from.address + first);
      }
    } else {
      const st = await stat(from.file);
      if (st.size !== size) throw new BlockdError("BadRequest", `${from.file} holds ${st.size} bytes, not ${size}`);
      await copy(0, size, 0);
    }
    await layer.seal();
  } catch (e) {
    await layer.close().catch(() => {});
    await src.close();
    await rm(tmp.data, { force: true });
    await rm(tmp.index, { force: true });
    throw e;
  }
  await layer.close();
  await src.close();
  await rm(tmp.index, { force: true });
  if (zfile) {
    const sealed = LocalFile.open(tmp.data);
    const packed = LocalFile.open(tmp.zfile, { write: true, create: true });
    try {
      await writeZFile(sealed, packed, { algorithm: zfile, headerOverwrite: true });
      await packed.fdatasync();
    } catch (e) {
      await rm(tmp.zfile, { force: true });
      throw e;
    } finally {
      await sealed.close();
      await packed.close();
      await rm(tmp.data, { force: true });
    }
    await rename(tmp.zfile, out);
  } else await rename(tmp.data, out);
  result.bytes = (await stat(out)).size;
  return result;
}
