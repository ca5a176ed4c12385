// The pages a VM dirtied in a private (copy-on-write) mapping of its memory image, read from
// /proc/<pid>/pagemap (kernel Documentation/admin-guide/mm/pagemap.rst): one little-endian u64 per
// page; bit 63 present, bit 62 swapped, bit 61 file-page or shared-anon. A page of a MAP_PRIVATE
// file mapping that is present or swapped and not a file page is an anonymous copy: the guest (or
// the VMM on its behalf) wrote it. 1 GiB of guest is 2 MiB of pagemap, read in 256 KiB steps.

import { open, readFile, stat } from "node:fs/promises";
import { VmmError } from "./types.ts";

export const PAGE_SIZE = 4096;
/** Pagemap entries read per step (256 KiB of pagemap, 128 MiB of guest). */
const STEP_PAGES = 32_768;
const PRESENT_OR_SWAPPED = 0xc000_0000; // bits 63 and 62 of the u64, in its high u32
const FILE_PAGE = 0x2000_0000; // bit 61

/** The one mapping of `path` in `pid`: its start address and length. */
export async function mappingOf(pid: number, path: string, o: { byInode?: boolean } = {}): Promise<{ address: number; length: number }> {
  const maps = await readFile(`/proc/${pid}/maps`, "utf8").catch((e) => {
    throw new VmmError("BadState", `cannot read the mappings of VMM ${pid}: ${(e as Error).message}`);
  });
  // By inode: a jailed VMM maps the file under another name (its chroot's), the inode is the same.
  let ident: string | undefined;
  if (o.byInode) {
    const st = await stat(path, { bigint: true }).catch((e) => {
      throw new VmmError("BadState", `cannot stat ${path}: ${(e as Error).message}`);
    });
    const dev = st.dev;
    const major = ((dev >> 8n) & 0xfffn) | ((dev >> 32n) & ~0xfffn);
    const minor = (dev & 0xffn) | ((dev >> 12n) & ~0xffn);
    ident = `${major.toString(16).padStart(2, "0")}:${minor.toString(16).padStart(2, "0")} ${st.ino}`;
  }
  const found: { address: number; length: number }[] = [];
  for (const line of maps.split("\n")) {
    // start-end perms offset dev inode path (the path is the rest of the line)
    const m = /^([0-9a-f]+)-([0-9a-f]+) \S+ \S+ (\S+ \S+)\s+(.*)$/.exec(line);
    if (m && (ident !== undefined ? m[3] === ident : m[4] === path)) found.push({ address: parseInt(m[1]!, 16), length: parseInt(m[2]!, 16) - parseInt(m[1]!, 16) });
  }
  if (found.length !== 1) throw new VmmError("BadState", `VMM ${pid} maps ${path} ${found.length} times, not once`);
  return found[0]!;
}

/**
 * Dirty pages of the private mapping at `address` (`pages` long) as ascending runs [first, count],
 * packed as little-endian u32 pairs. The VM must be stopped, or the answer is already old.
 */
export async function dirtyRuns(pid: number, address: number, pages: number): Promise<{ runs: Uint32Array; dirty: number }> {
  if (address % PAGE_SIZE !== 0 || !Number.isInteger(pages) || pages <= 0) throw new VmmError("BadSpec", `bad mapping ${address}+${pages} pages`);
  const fh = await open(`/proc/${pid}/pagemap`, "r").catch((e) => {
    throw new VmmError("BadState", `cannot read the pagemap of VMM ${pid}: ${(e as Error).message}`);
  });
  const buf = new Uint8Array(STEP_PAGES * 8);
  const words = new Uint32Array(buf.buffer);
  let out = new Uint32Array(1024);
  let n = 0; // u32s used in out
  let dirty = 0;
  let runStart = -1;
  const push = (first: number, count: number) => {
    if (n + 2 > out.length) {
      const grown = new Uint32Array(out.length * 2);
      grown.set(out);
      out = grown;
    }
    out[n++] = first;
    out[n++] = count;
  };
  try {
    const base = (address / PAGE_SIZE) * 8;
    for (let at = 0; at < pages; at += STEP_PAGES) {
      const count = Math.min(STEP_PAGES, pages - at);
      const { bytesRead } = await fh.read(buf, 0, count * 8, base + at * 8);
      if (bytesRead !== count * 8) throw new VmmError("BadState", `short pagemap read of VMM ${pid} (${bytesRead} of ${count * 8} bytes)`);
      for (let i = 0; i < count; i++) {
        const hi = words[i * 2 + 1]!;
        const isDirty = (hi & PRESENT_OR_SWAPPED) !== 0 && (hi & FILE_PAGE) === 0;
        const page = at + i;
        if (isDirty) {
          dirty++;
          if (runStart < 0) runStart = page;
        } else if (runStart >= 0) {
          push(runStart, page - runStart);
          runStart = -1;
        }
      }
    }
    if (runStart >= 0) push(runStart, pages - runStart);
  } finally {
    await fh.close();
  }
  return { runs: out.slice(0, n), dirty };
}
