// Guest memory read in steps for a memory layer (memory_layer.ts, docs/vmm.md "Memory layers"):
// the pages a paused VM dirtied, copied out of its VMM process by process_vm_readv (up to 1024
// dirty runs per call, one copy: /proc/<pid>/mem copies each page twice, through a kernel page), or
// a whole memory image file (a cold-booted VM's RAM file: its data extents, not its holes) through
// this thread's io_uring.

import { type AlignedBuffer, E, SEEK_DATA, SEEK_HOLE, SyscallError, addressOf, close, lseek, processVmReadv, syscall, SYS_pidfd_open } from "../../ffi/libc.ts";
import { LocalFile } from "../storage/local_file.ts";
import { BlockdError } from "./protocol.ts";

export const PAGE = 4096;
/** Guest memory a layer may describe (the VM sizes the node accepts are far below). */
export const MAX_GUEST_BYTES = 2 ** 40;
/** Pages one step reads at most (4 MiB). */
export const STEP_PAGES = 1024;
/** Remote iovecs per process_vm_readv: the kernel's UIO_MAXIOV. */
const MAX_IOV = 1024;

export type MemorySource = { file: string } | { pid: number; address: number; pagesFile: string };

/** What one step reads: `n` pieces of guest pages (first, count) in `pieces`, `pages` in all, back to back. */
export interface Step {
  pieces: Uint32Array;
  n: number;
  pages: number;
}

export function newStep(): Step {
  return { pieces: new Uint32Array(2 * MAX_IOV), n: 0, pages: 0 };
}

/** The guest memory a layer is written from: which pages, in steps, and their bytes. */
export class GuestMemory {
  /** Next run to take pages from, and pages of it already taken. */
  private run = 0;
  private taken = 0;
  /** process_vm_readv's iovecs as u32 halves: one local, up to MAX_IOV remote. */
  private readonly localIov = new Uint32Array(4);
  private readonly remoteIov = new Uint32Array(4 * MAX_IOV);

  private constructor(
    /** Ascending runs of guest pages (first, count) to copy. */
    private readonly runs: Uint32Array,
    readonly delta: boolean,
    private readonly pid: number,
    private readonly address: number,
    private readonly file: LocalFile | undefined,
  ) {}

  /**
   * Checks `from` against a guest of `size` bytes: the process is there, its pages file holds
   * ascending runs inside the guest, or the image file is exactly `size` bytes.
   */
  static async open(size: number, from: MemorySource): Promise<GuestMemory> {
    if (!Number.isInteger(size) || size <= 0 || size % PAGE !== 0 || size > MAX_GUEST_BYTES) throw new BlockdError("BadRequest", `memory size ${size} is not a positive multiple of ${PAGE}`);
    if (!("pid" in from)) {
      let file: LocalFile;
      try {
        file = LocalFile.open(from.file);
      } catch (e) {
        throw new BlockdError("NotFound", `cannot read the memory of ${from.file}: ${(e as Error).message}`);
      }
      try {
        if (file.size() !== size) throw new BlockdError("BadRequest", `${from.file} holds ${file.size()} bytes, not ${size}`);
        return new GuestMemory(dataRuns(file, size), false, 0, 0, file);
      } catch (e) {
        await file.close();
        throw e;
      }
    }
    try {
      close(syscall(SYS_pidfd_open, from.pid, 0));
    } catch (e) {
      throw new BlockdError("NotFound", `cannot read the memory of process ${from.pid}: ${(e as Error).message}`);
    }
    if (!Number.isSafeInteger(from.address) || from.address < 0 || from.address % PAGE !== 0) throw new BlockdError("BadRequest", `address ${from.address} is not page-aligned`);
    const pagesFile = Bun.file(from.pagesFile);
    // Runs are disjoint and non-empty: at most one per page of the guest.
    if (pagesFile.size > (size / PAGE) * 8) throw new BlockdError("BadRequest", `${from.pagesFile}: ${pagesFile.size} bytes is more runs than the guest has pages`);
    const raw = await pagesFile.arrayBuffer();
    if (raw.byteLength % 8 !== 0) throw new BlockdError("BadRequest", `${from.pagesFile}: ${raw.byteLength} bytes is not whole runs of 8`);
    const runs = new Uint32Array(raw);
    let last = 0;
    for (let i = 0; i < runs.length; i += 2) {
      const first = runs[i]!;
      const count = runs[i + 1]!;
      if (first < last || count === 0 || (first + count) * PAGE > size) throw new BlockdError("BadRequest", `${from.pagesFile}: run ${i / 2} is out of order or out of range`);
      last = first + count;
    }
    return new GuestMemory(runs, true, from.pid, from.address, undefined);
  }

  /** Plans the next step into `step` (at most STEP_PAGES pages, MAX_IOV pieces); false past the end. */
  next(step: Step): boolean {
    step.n = 0;
    step.pages = 0;
    const runs = this.runs;
    while (this.run < runs.length && step.pages < STEP_PAGES && step.n < MAX_IOV) {
      const left = runs[this.run + 1]! - this.taken;
      const k = Math.min(left, STEP_PAGES - step.pages);
      step.pieces[2 * step.n] = runs[this.run]! + this.taken;
      step.pieces[2 * step.n + 1] = k;
      step.n++;
      step.pages += k;
      if (k === left) {
        this.run += 2;
        this.taken = 0;
      } else this.taken += k;
    }
    return step.n > 0;
  }

  /** Reads `step`'s pages into the start of `buf`, back to back; a short read is an error. */
  async read(step: Step, buf: AlignedBuffer): Promise<void> {
    const bytes = step.pages * PAGE;
    if (this.file) {
      const reads: Promise<void>[] = [];
      for (let i = 0, to = 0; i < step.n; i++) {
        const at = step.pieces[2 * i]! * PAGE;
        const len = step.pieces[2 * i + 1]! * PAGE;
        const file = this.file;
        reads.push(
          file.pread(buf.bytes.subarray(to, to + len), at).then((got) => {
            if (got !== len) throw new BlockdError("Io", `short read of guest memory at ${at} (${got} of ${len} bytes)`);
          }),
        );
        to += len;
      }
      await Promise.all(reads);
      return;
    }
    setIov(this.localIov, 0, buf.ptr, bytes);
    for (let i = 0; i < step.n; i++) setIov(this.remoteIov, i, this.address + step.pieces[2 * i]! * PAGE, step.pieces[2 * i + 1]! * PAGE);
    let got: number;
    try {
      got = processVmReadv(this.pid, addressOf(this.localIov), 1, addressOf(this.remoteIov), step.n);
    } catch (e) {
      if (e instanceof SyscallError && (e.errno === E.ESRCH || e.errno === E.EPERM)) throw new BlockdError("NotFound", `cannot read the memory of process ${this.pid}: ${e.message}`);
      if (!(e instanceof SyscallError && e.errno === E.EFAULT)) throw e;
      got = 0; // the first remote range is not mapped
    }
    if (got !== bytes) throw new BlockdError("Io", `short read of guest memory at ${step.pieces[0]! * PAGE} (${got} of ${bytes} bytes)`);
  }

  async close(): Promise<void> {
    await this.file?.close();
  }
}

/**
 * The pages of an image file that hold data (SEEK_DATA / SEEK_HOLE), as ascending runs: a hole
 * reads as zeros, which a base layer leaves out, so holes are neither read nor tested.
 */
function dataRuns(file: LocalFile, size: number): Uint32Array {
  const runs: number[] = [];
  for (let pos = 0; pos < size; ) {
    const start = lseek(file.fd, pos, SEEK_DATA, file.name);
    if (start < 0 || start >= size) break;
    let end = lseek(file.fd, start, SEEK_HOLE, file.name);
    if (end < 0 || end > size) end = size;
    const first = Math.floor(start / PAGE);
    const last = Math.ceil(end / PAGE);
    const n = runs.length;
    if (n && runs[n - 2]! + runs[n - 1]! >= first) runs[n - 1] = last - runs[n - 2]!;
    else runs.push(first, last - first);
    pos = last * PAGE;
  }
  return new Uint32Array(runs);
}

/** iovec `i` of `iov` (u32 halves of {u64 base, u64 len}) = [base, base+len); addresses stay under 2^53. */
function setIov(iov: Uint32Array, i: number, base: number, len: number): void {
  iov[4 * i] = base % 2 ** 32;
  iov[4 * i + 1] = Math.floor(base / 2 ** 32);
  iov[4 * i + 2] = len;
  iov[4 * i + 3] = 0;
}
