// FuseDisk: one device as one FUSE-mounted regular file (the mount's root *is* the file), served
// from a DeviceIo by the raw FUSE protocol. One instance per device worker thread, so the thread
// that owns the device's image is the thread that answers its requests (as with ublk). Requests
// come from read(2) of /dev/fuse, or, in ring mode, as io_uring completions (fuse/uring.ts); both
// are served by the same handler.

import {
  libc,
  mount,
  open,
  poll,
  POLLIN,
  read,
  umount2,
  write,
  errno,
  E,
  O_RDWR,
  O_CLOEXEC,
  O_NONBLOCK,
  MS_NOSUID,
  MS_NODEV,
  MNT_DETACH,
  MNT_FORCE,
  SyscallError,
  prctl,
  PR_SET_IO_FLUSHER,
  allocAligned,
  madvise,
  MADV_DONTNEED,
  FALLOC_FL_KEEP_SIZE,
  FALLOC_FL_PUNCH_HOLE,
  FALLOC_FL_ZERO_RANGE,
  type AlignedBuffer,
} from "../../../ffi/libc.ts";
import * as F from "../../../ffi/fuse.ts";
import { IoUring } from "../../../ffi/io_uring.ts";
import type { DeviceIo, WakeSource } from "../device_io.ts";
import { deferLocalIoCompletions, reapLocalIo } from "../../storage/local_file.ts";
import { PENDING_WAIT_MS, remoteWorkPending } from "../../storage/remote/pending.ts";
import { ReaderLink } from "./reader_link.ts";
import { FuseRequest } from "./request.ts";
import { FuseRing, possibleCpus, ringLayout, uringUnavailable, type RingEntry, type RingLayout } from "./uring.ts";
import { closeHeldFd, forgetHeldFd, heldFd } from "../fd_ledger.ts";

/** Largest request payload: 1 MiB measured no faster for 1 MiB writes, with twice the slot memory. */
const MAX_WRITE = 512 << 10;
/** Requests taken from /dev/fuse per wakeup and served concurrently (their I/O batches). */
const MAX_SLOTS = 32;
/** Slots lent to the reader thread (fuse/reader.ts), AENV_FUSE_READER_SLOTS (BlockdSettings); 0 turns the reader off. */
const READER_SLOTS = readerSlots(process.env.AENV_FUSE_READER_SLOTS);

function readerSlots(v: string | undefined): number {
  const n = v === undefined || v === "" ? 8 : Number(v);
  if (Number.isInteger(n) && n >= 0 && n <= 64) return n;
  console.error(`blockd: AENV_FUSE_READER_SLOTS=${v} is not an integer 0..64; using 8`);
  return 8;
}

/**
 * Ring mode (FUSE over io_uring) for devices mounted from now on: AENV_FUSE_URING=1 (BlockdSettings). Off by
 * default: the kernel does not resend requests a dead server held in ring entries
 * (FUSE_NOTIFY_RESEND covers /dev/fuse only), so a ring connection cannot outlive a blockd crash
 * the way a /dev/fuse one does; a restart ends it and serves the device afresh (lost).
 */
const URING_WANTED = process.env.AENV_FUSE_URING === "1";
let uringChecked: string | undefined;

/** "" when ring mode is on and usable; otherwise why not (said once per thread, in one line). */
function uringRefusal(): string {
  if (!URING_WANTED) return "off";
  if (uringChecked === undefined) {
    uringChecked = uringUnavailable();
    if (uringChecked) console.error(`blockd: FUSE over io_uring unavailable (${uringChecked}); serving /dev/fuse by read and write`);
  }
  return uringChecked;
}

/** A WRITE request at least this long (header included) starts the reader thread, or wakes it. */
const READER_FROM = 128 << 10;
/**
 * Requests after the last large WRITE before the reader is paused: a reader takes small requests
 * too, and handing one over costs more than reading it here (4 KiB random reads: ~2× the CPU).
 */
const READER_IDLE_REQUESTS = 512;
/**
 * While a reader runs, the serve loop's poll wakes at least this often, so the reader's end (a
 * Worker event) is heard even on an idle device, where a request it stranded would wait forever.
 */
const READER_WATCH_MS = 1000;
const ATTR_VALID_SEC = 1;
const SECTOR = 512;
const TWO32 = 0x1_0000_0000;
// Linux errno values sent back as −errno.
const ENOENT = 2;
const EIO = 5;
const EPERM = 1;
const EROFS = 30;
const ENOSYS = 38;
const EINVAL = 22;
const ENOTSUP = 95;
const EFBIG = 27;
/** Tags of the polls the FUSE ring keeps armed in ring mode (fuse/uring.ts watch()). */
const WATCH_FUSE = 0;
const WATCH_WAKE = 1;
const WATCH_IO = 2;
/** handle()'s answer for requests that get no reply (FORGET, INTERRUPT). */
const NO_REPLY = -1_000_000;

export interface FuseDiskOptions {
  /** A regular file to mount over; it becomes the device. */
  path: string;
  readOnly: boolean;
  /**
   * Bypass the kernel page cache (every I/O reaches the image; the guest caches for itself).
   * Default: writable devices do; read-only ones (shared memory snapshots and bases) keep one
   * copy in the page cache for every reader and every open (FOPEN_KEEP_CACHE): direct I/O would
   * send each VM's reads to us, and each new mmap of a direct-I/O file drops the cached pages.
   */
  directIo?: boolean;
}

/** Thrown by adopt(): the connection was served over io_uring, which no new server can take over. */
export class FuseRingAdoptError extends Error {
  override name = "FuseRingAdoptError";
}

/** Bytes of one slot: a page before each buffer so the payload after the header is page-aligned. */
const SLOT_BYTES = 2 * (4096 + MAX_WRITE);

/** Buffers for one request read from /dev/fuse, and its reply. */
class Slot extends FuseRequest {
  /** The /dev/fuse fd the request in this slot came from; its reply goes back there. */
  fd = -1;
  /** Where its SLOT_BYTES start in the arena. */
  readonly at: number;
  readonly req: Uint8Array;
  /** The reply buffer: fuse_out_header, then `out`. */
  readonly replyBuf: Uint8Array;
  constructor(
    mem: Uint8Array,
    at: number,
    /** Slot number in the reader's share, or -1 for the device worker's own slots. */
    readonly readerSlot = -1,
  ) {
    // WRITE data starts 80 bytes into a request and READ data 16 bytes into a reply: both land
    // page-aligned, so O_DIRECT I/O of the layers takes them without a bounce copy.
    const ab = mem.buffer;
    const req = mem.subarray(at + 4096 - F.FUSE_WRITE_DATA_OFFSET, at + 4096 + MAX_WRITE);
    const o = at + 4096 + MAX_WRITE;
    const reply = mem.subarray(o + 4096 - F.FUSE_OUT_HEADER, o + 4096 + MAX_WRITE);
    const out = reply.subarray(F.FUSE_OUT_HEADER);
    super(
      new DataView(ab, req.byteOffset, F.FUSE_IN_HEADER),
      new DataView(ab, req.byteOffset + F.FUSE_IN_HEADER, req.byteLength - F.FUSE_IN_HEADER),
      req.subarray(F.FUSE_WRITE_DATA_OFFSET),
      new DataView(ab, reply.byteOffset, F.FUSE_OUT_HEADER),
      out,
      new DataView(ab, out.byteOffset, out.byteLength),
    );
    this.req = req;
    this.replyBuf = reply;
    this.at = at;
  }
}

export class FuseDisk {
  private initialized = false;
  /** INIT was answered with FUSE_OVER_IO_URING: the serve loop lends the ring its entries. */
  ringAccepted = false;
  /** The ring, once it has been set up (then the memory its entries use is freed only by close()). */
  private ring: FuseRing | undefined;
  private arena: AlignedBuffer | undefined;
  private loop: ServeLoop | undefined;
  /** The connection was aborted (unmount in ring mode): nothing can write into the entries any more. */
  private aborted = false;
  readonly stats = { requests: 0, reads: 0, writes: 0, fsyncs: 0, discards: 0, takenByReader: 0, overRing: 0, readerPauses: 0 };

  private constructor(
    readonly fd: number,
    readonly opts: FuseDiskOptions,
    /** A second fd on the connection, served by a reader thread; -1 when there is none. */
    readonly cloneFd: number,
    /** Offer FUSE_OVER_IO_URING at INIT. */
    private readonly ringWanted: boolean,
  ) {}

  /** Open /dev/fuse and mount it over opts.path. INIT is queued at once; serve() answers it. */
  static mount(opts: FuseDiskOptions): FuseDisk {
    // Non-blocking: after poll says readable, we take every queued request (up to MAX_SLOTS).
    const fd = heldFd(open("/dev/fuse", O_RDWR | O_CLOEXEC | O_NONBLOCK));
    const ringWanted = uringRefusal() === "";
    try {
      const data = F.mountOptions(fd, F.S_IFREG, process.getuid?.() ?? 0, process.getgid?.() ?? 0, ["allow_other", "max_read=" + MAX_WRITE]);
      mount("agentenv", opts.path, "fuse.agentenv", MS_NOSUID | MS_NODEV, data);
    } catch (e) {
      closeHeldFd(fd);
      throw e;
    }
    return new FuseDisk(fd, opts, READER_SLOTS > 0 && !ringWanted ? ReaderLink.cloneFd(fd) : -1, ringWanted);
  }

  /**
   * Adopt the fds of a live connection (after a blockd restart) instead of mounting: the
   * connection's own and, when the dead server had one, its reader's clone. A connection that was
   * served over io_uring is refused (FuseRingAdoptError): the requests the dead server held in its
   * ring entries are never resent, so their callers would wait forever.
   */
  static adopt(fd: number, opts: FuseDiskOptions, cloneFd?: number): FuseDisk {
    const why = ringInUse(fd);
    if (why) throw new FuseRingAdoptError(`${opts.path}: ${why}`);
    if (cloneFd === undefined && READER_SLOTS > 0) cloneFd = ReaderLink.cloneFd(fd);
    const d = new FuseDisk(fd, opts, cloneFd ?? -1, false);
    d.initialized = true;
    return d;
  }

  unmount(): void {
    if (this.ring) {
      // Ring mode: abort the connection first (MNT_FORCE: fuse_umount_begin), so the kernel ends
      // the entries it holds and writes no request into their memory after close() frees it.
      try {
        umount2(this.opts.path, MNT_FORCE);
        this.aborted = true;
      } catch (e) {
        const code = (e as SyscallError).code;
        if (code === "EBUSY") this.aborted = true; // aborted, still in use: the detach below ends it
      }
    }
    try {
      umount2(this.opts.path, MNT_DETACH);
    } catch (e) {
      if (!(e instanceof SyscallError && (e.code === "EINVAL" || e.code === "ENOENT"))) throw e;
    }
  }

  /**
   * Serve requests until the mount goes away or wake.stopping(). One poll(2) watches /dev/fuse,
   * the control eventfd, the eventfd of this thread's I/O ring (and the FUSE ring in ring mode):
   * requests are taken while earlier ones wait on the disk, and control work (a restack, which
   * drains requests) runs beside them, since their I/O completes only while this loop keeps polling.
   */
  async serve(io: DeviceIo, wake: WakeSource): Promise<void> {
    try {
      prctl(PR_SET_IO_FLUSHER, 1); // page reclaim may write back through us: do not recurse
    } catch {}
    const ioFd = deferLocalIoCompletions();
    const layout = this.ringWanted ? ringLayout(possibleCpus(), MAX_WRITE) : undefined;
    const slotBytes = (MAX_SLOTS + (this.cloneFd >= 0 ? READER_SLOTS : 0)) * SLOT_BYTES;
    this.arena = allocAligned(slotBytes + (layout?.bytes ?? 0), true);
    try {
      this.loop = new ServeLoop(this, io, wake, ioFd, this.arena, slotBytes, layout);
      await this.loop.run();
    } finally {
      this.loop = undefined;
      deferLocalIoCompletions(false);
      // Without a ring nothing but this loop wrote into the arena; with one, close() frees it.
      if (!this.ring) {
        this.arena.free();
        this.arena = undefined;
      }
    }
  }

  /** Set up the ring (after INIT was answered with it) and lend the kernel its entries. */
  startRing(arena: AlignedBuffer, at: number, layout: RingLayout): FuseRing | undefined {
    try {
      this.ring = new FuseRing(this.fd, layout, arena, at, MAX_WRITE);
      this.ring.registerAll();
      return this.ring;
    } catch (e) {
      // The connection goes on over /dev/fuse (the kernel uses the ring only once every queue has an entry).
      console.error(`fuse ${this.opts.path}: FUSE over io_uring not started (${(e as Error).message}); serving /dev/fuse by read and write`);
      return undefined;
    }
  }

  /** Take one queued request into slot; false when none is queued (or it was interrupted). */
  take(slot: Slot): boolean | "gone" {
    let n: number;
    slot.fd = this.fd;
    try {
      n = read(this.fd, slot.req);
    } catch (e) {
      const code = (e as SyscallError).code;
      if (code === "EAGAIN" || code === "ENOENT" || code === "EINTR") return false; // drained / interrupted
      if (code === "ENODEV" || code === "ECONNABORTED") return "gone"; // unmounted or aborted
      throw e;
    }
    return n >= F.FUSE_IN_HEADER;
  }

  /** Send a slot's reply (fuse_out_header + `len` bytes of `out`) on the fd its request came from. */
  sendSlot(slot: Slot, error: number, len: number): void {
    const total = F.FUSE_OUT_HEADER + (error ? 0 : len);
    const h = slot.outHead;
    h.setUint32(0, total, true);
    h.setInt32(4, -error, true);
    h.setUint32(8, slot.head.getUint32(8, true), true); // unique, as two words (no BigInt)
    h.setUint32(12, slot.head.getUint32(12, true), true);
    for (;;) {
      if (Number(libc.write(slot.fd, slot.replyBuf, total)) >= 0) return;
      const e = errno();
      if (e === E.EINTR) continue;
      // ENOENT: the request was interrupted; ENODEV: unmounted while it ran (nobody waits for it).
      if (e !== E.ENOENT && e !== E.ENODEV && e !== E.ECONNABORTED) throw new SyscallError("write", e);
      return;
    }
  }

  /** Put an entry's reply in place and queue its COMMIT_AND_FETCH (sent at the ring's next submit). */
  sendEntry(e: RingEntry, error: number, len: number): void {
    e.head.setUint32(0, F.FUSE_OUT_HEADER + (error ? 0 : len), true);
    e.head.setInt32(4, -error, true); // unique stays where the request had it (same offset in both headers)
    e.inOut.setUint32(16, error ? 0 : len, true); // payload_sz
    this.ring!.commit(e, e.inOut.getUint32(8, true), e.inOut.getUint32(12, true));
  }

  private attr(io: DeviceIo): F.FuseAttr {
    return {
      ino: F.FUSE_ROOT_ID,
      size: io.size(),
      mode: F.S_IFREG | (io.readOnly ? 0o444 : 0o644),
      nlink: 1,
      uid: 0,
      gid: 0,
      blksize: 4096,
      mtimeSec: 0,
    };
  }

  /**
   * After adopting a live connection from a dead server: requests it had read but not answered
   * are put back in the queue (FUSE_NOTIFY_RESEND, protocol 7.40), so no caller waits forever.
   */
  resend(): void {
    const b = new Uint8Array(F.FUSE_OUT_HEADER);
    F.encodeOutHeader(new DataView(b.buffer), b.length, F.FUSE_NOTIFY_RESEND, 0n);
    try {
      write(this.fd, b);
    } catch (e) {
      console.error(`fuse ${this.opts.path}: resend refused: ${(e as Error).message}`);
    }
  }

  /** Ask the kernel to drop cached attributes and pages (after the image under us changed). */
  /** The memory of slots holding no request goes back to the kernel (a device back in the pool); returns the bytes given. */
  trimIdle(): number {
    return this.loop?.trimIdle() ?? 0;
  }

  invalidate(): void {
    const b = new Uint8Array(F.FUSE_OUT_HEADER + 24);
    const dv = new DataView(b.buffer);
    F.encodeOutHeader(dv, b.length, F.FUSE_NOTIFY_INVAL_INODE, 0n);
    dv.setBigUint64(16, BigInt(F.FUSE_ROOT_ID), true);
    dv.setBigInt64(24, 0n, true);
    dv.setBigInt64(32, 0n, true); // len 0 = to the end of the file
    try {
      write(this.fd, b); // notifications go through /dev/fuse in ring mode too
    } catch (e) {
      if ((e as SyscallError).code !== "ENOENT") throw e; // nothing cached yet
    }
  }

  /**
   * Serve one request: returns the reply at once (bytes of reply arguments, or −errno, or
   * NO_REPLY), or the image I/O it waits for (then the reply is r.reply bytes, once it is done).
   */
  handle(io: DeviceIo, r: FuseRequest): number | Promise<unknown> {
    const opcode = r.head.getUint32(4, true);
    const a = r.args;
    this.stats.requests++;
    switch (opcode) {
      case F.FUSE_READ: {
        const offset = u64(a, 8);
        const len = Math.max(0, Math.min(a.getUint32(16, true), io.size() - offset, MAX_WRITE));
        this.stats.reads++;
        if (len === 0) return 0;
        r.reply = len;
        const buf = r.out.subarray(0, len);
        return offset % SECTOR === 0 && len % SECTOR === 0 ? io.read(buf, offset) : readAny(io, buf, offset);
      }
      case F.FUSE_WRITE: {
        const offset = u64(a, 8);
        const size = a.getUint32(16, true);
        if (io.readOnly) return -EROFS;
        if (size > MAX_WRITE || offset + size > io.size()) return -EFBIG;
        this.stats.writes++;
        r.reply = F.FUSE_WRITE_OUT_SIZE;
        r.written = size; // fuse_write_out is put in place once the write is done (in ring mode `out` holds the data)
        const data = r.data.subarray(0, size);
        return offset % SECTOR === 0 && size % SECTOR === 0 ? io.write(data, offset) : writeAny(io, data, offset);
      }
      case F.FUSE_INIT: {
        const init = F.decodeInitIn(a, 0);
        if (init.major < 7) return -71; // EPROTO
        const want = F.FUSE_ASYNC_READ | F.FUSE_BIG_WRITES | F.FUSE_ASYNC_DIO | F.FUSE_MAX_PAGES | F.FUSE_PARALLEL_DIROPS | F.FUSE_INIT_EXT;
        const ext = init.flags & F.FUSE_INIT_EXT ? init.flags2 : 0;
        // Echoed so resent requests (after a blockd restart) are marked, as the kernel offers.
        let flags2 = ext & F.FUSE2_HAS_RESEND;
        if (this.ringWanted && ext & F.FUSE2_OVER_IO_URING) flags2 |= F.FUSE2_OVER_IO_URING;
        else if (this.ringWanted) console.error(`fuse ${this.opts.path}: the kernel did not offer FUSE over io_uring at INIT; serving /dev/fuse by read and write`);
        F.encodeInitOut(r.outView, 0, {
          major: F.FUSE_KERNEL_VERSION,
          minor: Math.min(init.minor, F.FUSE_KERNEL_MINOR_VERSION),
          maxReadahead: init.maxReadahead,
          flags: want & init.flags,
          maxBackground: 64,
          congestionThreshold: 48,
          maxWrite: MAX_WRITE,
          timeGran: 1,
          maxPages: MAX_WRITE / 4096,
          flags2,
        });
        this.initialized = true;
        this.ringAccepted = (flags2 & F.FUSE2_OVER_IO_URING) !== 0;
        return F.FUSE_INIT_OUT_SIZE;
      }
      case F.FUSE_GETATTR:
        F.encodeAttrOut(r.outView, 0, ATTR_VALID_SEC, this.attr(io));
        return F.FUSE_ATTR_OUT_SIZE;
      case F.FUSE_SETATTR: {
        const s = F.decodeSetattrIn(a, 0);
        if (s.valid & F.FATTR_SIZE && s.size !== io.size()) return -EPERM; // resize goes through blockd
        F.encodeAttrOut(r.outView, 0, ATTR_VALID_SEC, this.attr(io));
        return F.FUSE_ATTR_OUT_SIZE;
      }
      case F.FUSE_OPEN: {
        // A read-only device opens for writing too and refuses every write, truncate and fallocate:
        // QEMU 7.2 opens a memory-backend-file O_RDWR even to map it private (copy-on-write).
        const direct = this.opts.directIo ?? !io.readOnly;
        F.encodeOpenOut(r.outView, 0, 1, direct ? F.FOPEN_DIRECT_IO | F.FOPEN_PARALLEL_DIRECT_WRITES : F.FOPEN_KEEP_CACHE);
        return F.FUSE_OPEN_OUT_SIZE;
      }
      case F.FUSE_FSYNC:
        this.stats.fsyncs++;
        r.reply = 0;
        return io.readOnly ? 0 : io.flush();
      case F.FUSE_FALLOCATE: {
        const f = F.decodeFallocateIn(a, 0);
        // On a read-only device a hole punch is a no-op that succeeds: QEMU punches the file before it
        // drops a private mapping's pages (its discard of guest RAM: balloon, free page reporting),
        // and the drop alone is what frees host memory; the shared image must never change.
        if (io.readOnly) return f.mode === (FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE) ? 0 : -EROFS;
        const mode = f.mode & ~FALLOC_FL_KEEP_SIZE;
        if (mode === 0) return f.offset + f.length <= io.size() ? 0 : -EPERM; // preallocation: nothing to do
        if (mode !== FALLOC_FL_PUNCH_HOLE && mode !== FALLOC_FL_ZERO_RANGE) return -ENOTSUP;
        // Both become zero segments; unaligned edges are zeroed by writing.
        this.stats.discards++;
        r.reply = 0;
        return zeroAny(io, f.offset, Math.min(f.length, io.size() - f.offset));
      }
      case F.FUSE_STATFS:
        F.encodeStatfs(r.outView, 0, Math.ceil(io.size() / 4096), 4096);
        return F.FUSE_KSTATFS_SIZE;
      case F.FUSE_FLUSH:
      case F.FUSE_RELEASE:
      case F.FUSE_ACCESS:
        return 0;
      case F.FUSE_FORGET:
      case F.FUSE_BATCH_FORGET:
      case F.FUSE_INTERRUPT:
        return NO_REPLY;
      case F.FUSE_LOOKUP:
        return -ENOENT; // the root is the only node
      default:
        return -ENOSYS;
    }
  }

  /** A failed image I/O is the guest's EIO (or EINVAL), never a dead server. */
  failed(r: FuseRequest, e: unknown): number {
    console.error(`fuse ${this.opts.path}: opcode ${r.head.getUint32(4, true)}: ${(e as Error).message}`);
    return (e as { errno?: number }).errno === EINVAL ? -EINVAL : -EIO;
  }

  /**
   * Close the connection's fds. The ring's entries are in the arena: it is freed only once the
   * connection was aborted (unmount did), since until then the kernel may write a request into
   * an entry it holds; otherwise the mapping is left for the process's life.
   */
  close(): void {
    if (this.ring) {
      this.ring.close();
      if (this.aborted) this.arena?.free();
      else console.error(`fuse ${this.opts.path}: connection not aborted; the ring's ${this.arena?.length} bytes of buffers stay mapped`);
      this.arena = undefined;
    }
    if (this.cloneFd >= 0) closeHeldFd(this.cloneFd);
    closeHeldFd(this.fd);
  }
}

/** A u64 field that fits a double (offsets, sizes: < 2^53). */
function u64(dv: DataView, at: number): number {
  return dv.getUint32(at, true) + dv.getUint32(at + 4, true) * TWO32;
}

/**
 * Whether the connection of `fd` has an io_uring ring (a dead server used FUSE over io_uring):
 * a COMMIT_AND_FETCH of a request that does not exist finds a queue (ENOENT) only if it has.
 */
function ringInUse(fd: number): string {
  let ring: IoUring;
  try {
    ring = new IoUring(8, { sqe128: true });
  } catch {
    return ""; // no io_uring here: nobody can have used the FUSE ring either
  }
  heldFd(ring.fd);
  try {
    const sqe = ring.getSqe();
    const s = ring.sqes;
    s.setUint8(sqe, 46); // IORING_OP_URING_CMD
    s.setInt32(sqe + 4, fd, true);
    s.setUint32(sqe + 8, F.FUSE_IO_URING_CMD_COMMIT_AND_FETCH, true);
    ring.submitAndWait(1);
    let res = 0;
    ring.reap((_ud, r) => (res = r));
    return res === -E.ENOENT ? "its requests were served over io_uring, and the kernel does not resend requests a dead server held in ring entries" : "";
  } finally {
    forgetHeldFd(ring.fd);
    ring.close();
  }
}

/** The state of one serve(): slots, ring entries and requests in flight, control work in flight. */
class ServeLoop {
  // pollfds: 0 /dev/fuse, 1 control eventfd, 2 I/O ring eventfd, 3 reader's "taken" eventfd (-1: none).
  private pollfds = new Uint8Array(32);
  private pv = new DataView(this.pollfds.buffer);
  private counter = new Uint8Array(8);
  private idle: Slot[] = [];
  private made = 0;
  /** Requests being served, and how many of them are in /dev/fuse slots of this thread. */
  private busy = 0;
  private slotsBusy = 0;
  private control: Promise<void> | undefined;
  private controlAgain = false;
  private reader: ReaderLink | undefined;
  private readerSlots: Slot[] = [];
  /** Set once the reader's end has been dealt with; the device serves on without it. */
  private readerEnded = false;
  private readerPaused = false;
  /** Request count at the last large WRITE (stats.requests). */
  private lastLargeWrite = 0;
  private ring: FuseRing | undefined;

  constructor(
    private disk: FuseDisk,
    private io: DeviceIo,
    private wake: WakeSource,
    /** The eventfd of this thread's I/O ring (-1 without one). */
    private ioFd: number,
    private arena: AlignedBuffer,
    /** Where the ring's entries start in the arena (after the slots). */
    private ringAt: number,
    private layout: RingLayout | undefined,
  ) {
    [disk.fd, wake.fd, ioFd, -1].forEach((fd, i) => {
      this.pv.setInt32(8 * i, fd, true);
      this.pv.setInt16(8 * i + 4, POLLIN, true);
    });
  }

  /**
   * The reader thread starts with the first large WRITE: only then is the payload copy worth a
   * thread, so read-only and idle devices never pay for one. (A clone adopted from a server that
   * had a reader stays open and parked even with readers off.)
   */
  private startReader(): void {
    const cloneFd = this.disk.cloneFd;
    if (this.reader || cloneFd < 0 || READER_SLOTS === 0 || this.wake.stopping()) return;
    for (let i = 0; i < READER_SLOTS; i++) this.readerSlots.push(new Slot(this.arena.bytes, SLOT_BYTES * (MAX_SLOTS + i), i));
    for (const s of this.readerSlots) s.fd = cloneFd;
    const r = this.readerSlots[0]!.req;
    this.reader = new ReaderLink(cloneFd, this.arena, this.readerSlots.map((s) => s.req.byteOffset), r.byteLength);
    this.pv.setInt32(24, this.reader.takenFd, true);
  }

  private runControl(): void {
    if (this.control) return void (this.controlAgain = true);
    this.control = this.wake.onWake().finally(() => {
      this.control = undefined;
      if (this.controlAgain) {
        this.controlAgain = false;
        this.runControl();
      }
    });
  }

  private readonly startTaken = (i: number) => {
    this.disk.stats.takenByReader++;
    this.startSlot(this.readerSlots[i]!);
  };

  /** A request read from /dev/fuse (by this thread or the reader). */
  private startSlot(slot: Slot): void {
    const h = slot.head;
    if (h.getUint32(4, true) === F.FUSE_WRITE && h.getUint32(0, true) >= READER_FROM) {
      this.lastLargeWrite = this.disk.stats.requests;
      if (!this.reader) this.startReader();
      else if (this.readerPaused) {
        this.readerPaused = false;
        this.reader.resume();
      }
    } else if (this.reader && !this.readerPaused && this.disk.stats.requests - this.lastLargeWrite > READER_IDLE_REQUESTS) {
      this.readerPaused = true;
      this.disk.stats.readerPauses++;
      this.reader.pause();
    }
    if (slot.readerSlot < 0) this.slotsBusy++;
    this.serve(slot, false);
  }

  /** Serve r and send its reply; `entry`: r is a ring entry. */
  private serve(r: Slot | RingEntry, entry: boolean): void {
    this.busy++;
    r.written = -1;
    let res: number | Promise<unknown>;
    try {
      res = this.disk.handle(this.io, r);
    } catch (e) {
      res = this.disk.failed(r, e);
    }
    if (typeof res === "number") return this.finish(r, entry, res);
    r.done ??= () => {
      if (r.written >= 0) {
        r.outView.setUint32(0, r.written, true);
        r.outView.setUint32(4, 0, true);
      }
      this.finish(r, entry, r.reply);
    };
    r.fail ??= (e: unknown) => this.finish(r, entry, this.disk.failed(r, e));
    res.then(r.done, r.fail);
  }

  private finish(r: Slot | RingEntry, entry: boolean, res: number): void {
    try {
      if (entry) this.disk.sendEntry(r as RingEntry, res === NO_REPLY ? ENOSYS : res < 0 ? -res : 0, res < 0 ? 0 : res); // a ring entry comes back only with a commit
      else if (res !== NO_REPLY) this.disk.sendSlot(r as Slot, res < 0 ? -res : 0, res < 0 ? 0 : res);
    } finally {
      this.busy--;
      if (!entry) {
        const slot = r as Slot;
        if (slot.readerSlot >= 0) this.reader!.giveBack(slot.readerSlot);
        else {
          this.slotsBusy--;
          this.idle.push(slot);
        }
      }
    }
    // INIT answered with the ring: lend the kernel the entries (it needs max_write first).
    if (this.disk.ringAccepted && !this.ring && this.layout) this.startRing();
  }

  /**
   * From here on the loop waits in io_uring_enter on the FUSE ring, which also watches what poll(2)
   * watched: /dev/fuse (INIT's successors until the ring is ready, FORGET, INTERRUPT, resent
   * requests), the control eventfd and the I/O ring's eventfd.
   */
  private startRing(): void {
    const ring = this.disk.startRing(this.arena, this.ringAt, this.layout!);
    this.disk.ringAccepted = false;
    if (!ring) return;
    ring.watch(this.disk.fd, WATCH_FUSE);
    ring.watch(this.wake.fd, WATCH_WAKE);
    if (this.ioFd >= 0) ring.watch(this.ioFd, WATCH_IO);
    this.ring = ring;
  }

  private readonly startEntry = (e: RingEntry) => {
    this.disk.stats.overRing++;
    this.serve(e, true);
  };

  // What the FUSE ring's polls reported in one reap.
  private fuseReadable = false;
  private wakeFired = false;
  private ioFired = false;

  private readonly onPoll = (tag: number, rearm: boolean) => {
    if (tag === WATCH_FUSE) this.fuseReadable = true;
    else if (tag === WATCH_WAKE) this.wakeFired = true;
    else this.ioFired = true;
    // A multishot poll the kernel ended (it says so by leaving out F_MORE) is armed again.
    if (rearm) this.ring!.watch(tag === WATCH_FUSE ? this.disk.fd : tag === WATCH_WAKE ? this.wake.fd : this.ioFd, tag);
  };

  /**
   * The device worker's idle slots' pages back to the kernel (MADV_DONTNEED: the next request in a
   * slot faults in zeroed pages): a slot's bytes matter only while it holds a request, and a pooled
   * device would otherwise keep every slot it ever used resident (up to the arena's 42 MiB). Not in
   * ring mode (the kernel holds the entries) nor for the reader's slots (its thread owns them).
   */
  trimIdle(): number {
    if (this.layout) return 0;
    for (const s of this.idle) madvise(this.arena.ptr + s.at, SLOT_BYTES, MADV_DONTNEED);
    return this.idle.length * SLOT_BYTES;
  }

  /** Take queued /dev/fuse requests while a slot is free; "gone" once the connection is. */
  private takeRequests(): boolean | "gone" {
    while (this.slotsBusy < MAX_SLOTS) {
      const slot = this.idle.pop() ?? new Slot(this.arena.bytes, SLOT_BYTES * this.made++);
      const got = this.disk.take(slot);
      if (got === true) this.startSlot(slot);
      else {
        this.idle.push(slot);
        return got; // false: drained; "gone": requests in flight still finish into the slots
      }
    }
    return true;
  }

  /**
   * The reader ended while the device serves: the device worker reads every request itself from
   * now on (the connection's queue is shared by its fds). A crashed reader may have read a request
   * it never handed over; FUSE_NOTIFY_RESEND queues every unanswered request of the connection
   * again, and a duplicate of one being served is harmless (its first reply finds no request).
   */
  private readerLost(reader: ReaderLink): void {
    this.readerEnded = true;
    reader.drainTaken(this.startTaken);
    if (reader.stranded) this.disk.resend();
  }

  /** Serve until stopped or the connection is gone. */
  async run(): Promise<void> {
    try {
      await this.loop();
    } finally {
      this.reader?.close();
    }
  }

  private async loop(): Promise<void> {
    const pv = this.pv;
    let gone = false;
    for (;;) {
      const reader = this.reader;
      const ring = this.ring;
      const stopping = gone || this.wake.stopping();
      if (stopping && reader && !reader.exited) reader.stop();
      // Done once nothing is in flight: no request, no control work, no reader that may still take one.
      if (stopping && this.busy === 0 && !this.control && (!reader || reader.exited)) {
        if (reader) reader.drainTaken(this.startTaken); // taken as it stopped
        ring?.submit(); // the last replies
        if (this.busy === 0) return;
      }
      // Control work may wait on timers and messages, remote layers' fetches on the network: keep
      // the event loop turning meanwhile.
      const timeout = this.control || gone ? 1 : remoteWorkPending() > 0 ? PENDING_WAIT_MS : reader && !reader.exited ? READER_WATCH_MS : -1;
      if (ring) {
        // Replies of this tick (and the entries they lend again) go in the same io_uring_enter that waits.
        const takeNow = this.fuseReadable && this.slotsBusy < MAX_SLOTS && !stopping;
        ring.wait(takeNow ? 0 : timeout);
        this.wakeFired = this.ioFired = false;
        ring.reap(this.startEntry, this.onPoll);
        if (this.ioFired) reapLocalIo(); // edge-triggered: the eventfd's count is left as it is
        if (this.wakeFired) {
          read(this.wake.fd, this.counter);
          this.runControl();
        }
        if (this.fuseReadable && !stopping) {
          const got = this.takeRequests();
          if (got !== true) this.fuseReadable = false; // drained until the poll fires again
          if (got === "gone") gone = true;
        }
      } else {
        if (gone) pv.setInt32(0, -1, true); // poll skips it: a dead connection reports POLLERR forever
        // No new request while every slot is busy (the kernel queues them) or while stopping.
        pv.setInt16(4, this.slotsBusy < MAX_SLOTS && !stopping ? POLLIN : 0, true);
        for (const at of [6, 14, 22, 30]) pv.setInt16(at, 0, true);
        if (poll(this.pollfds, 4, timeout) > 0) {
          if (pv.getInt16(22, true) & POLLIN) {
            read(this.ioFd, this.counter);
            reapLocalIo();
          }
          if (pv.getInt16(14, true) & POLLIN) {
            read(this.wake.fd, this.counter);
            this.runControl();
          }
          if (pv.getInt16(30, true) & POLLIN) {
            read(reader!.takenFd, this.counter);
            reader!.drainTaken(this.startTaken);
          }
          if (reader?.exited && !stopping && !this.readerEnded) this.readerLost(reader);
          if (pv.getInt16(6, true) !== 0 && this.takeRequests() === "gone") gone = true;
        }
      }
      // Let every handler run until it waits on the disk (its I/O is then submitted).
      await new Promise<void>((r) => setImmediate(r));
    }
  }
}

// FUSE passes byte ranges; the image works in sectors. Unaligned edges go through a bounce sector.
async function readAny(io: DeviceIo, buf: Uint8Array, offset: number): Promise<void> {
  if (offset % SECTOR === 0 && buf.length % SECTOR === 0) return io.read(buf, offset);
  const b = Math.floor(offset / SECTOR) * SECTOR;
  const e = Math.ceil((offset + buf.length) / SECTOR) * SECTOR;
  const tmp = new Uint8Array(e - b);
  await io.read(tmp, b);
  buf.set(tmp.subarray(offset - b, offset - b + buf.length));
}

async function writeAny(io: DeviceIo, data: Uint8Array, offset: number): Promise<void> {
  if (offset % SECTOR === 0 && data.length % SECTOR === 0) return io.write(data, offset);
  const b = Math.floor(offset / SECTOR) * SECTOR;
  const e = Math.ceil((offset + data.length) / SECTOR) * SECTOR;
  const tmp = new Uint8Array(e - b);
  await io.read(tmp, b); // read-modify-write of the partial sectors
  tmp.set(data, offset - b);
  await io.write(tmp, b);
}

async function zeroAny(io: DeviceIo, offset: number, length: number): Promise<void> {
  if (length <= 0) return;
  const b = Math.ceil(offset / SECTOR) * SECTOR;
  const e = Math.floor((offset + length) / SECTOR) * SECTOR;
  if (e <= b) return writeAny(io, new Uint8Array(length), offset);
  if (b > offset) await writeAny(io, new Uint8Array(b - offset), offset);
  await io.discard(b, e - b);
  if (offset + length > e) await writeAny(io, new Uint8Array(offset + length - e), e);
}
