// FuseDisk: one device as one FUSE-mounted regular file (the mount's root *is* the file), served
// from a DeviceIo by the raw /dev/fuse protocol. One instance per device worker thread, so the
// thread that owns the device's image is the thread that answers its requests (as with ublk).

import {
  mount,
  open,
  poll,
  POLLIN,
  read,
  umount2,
  write,
  O_RDWR,
  O_CLOEXEC,
  O_NONBLOCK,
  MS_NOSUID,
  MS_NODEV,
  MNT_DETACH,
  SyscallError,
  prctl,
  PR_SET_IO_FLUSHER,
  allocAligned,
  FALLOC_FL_KEEP_SIZE,
  FALLOC_FL_PUNCH_HOLE,
  FALLOC_FL_ZERO_RANGE,
} from "../../../ffi/libc.ts";
import * as F from "../../../ffi/fuse.ts";
import type { DeviceIo, WakeSource } from "../device_io.ts";
import { deferLocalIoCompletions, reapLocalIo } from "../../storage/local_file.ts";
import { ReaderLink } from "./reader_link.ts";
import { closeHeldFd, heldFd } from "../fd_ledger.ts";

/** Largest request payload: 1 MiB measured no faster for 1 MiB writes, with twice the slot memory. */
const MAX_WRITE = 512 << 10;
/** Requests taken from the kernel per wakeup and served concurrently (their I/O batches). */
const MAX_SLOTS = 32;
/** Slots lent to the reader thread (fuse/reader.ts); 0 turns the reader off. */
const READER_SLOTS = readerSlots(process.env.AENV_FUSE_READER_SLOTS);

function readerSlots(v: string | undefined): number {
  const n = v === undefined || v === "" ? 8 : Number(v);
  if (Number.isInteger(n) && n >= 0 && n <= 64) return n;
  console.error(`blockd: AENV_FUSE_READER_SLOTS=${v} is not an integer 0..64; using 8`);
  return 8;
}
/** A WRITE request at least this long (header included) starts the reader thread. */
const READER_FROM = 128 << 10;
/**
 * While a reader runs, the serve loop's poll wakes at least this often, so the reader's end (a
 * Worker event) is heard even on an idle device, where a request it stranded would wait forever.
 */
const READER_WATCH_MS = 1000;
const ATTR_VALID_SEC = 1;
const SECTOR = 512;
// Linux errno values sent back as −errno.
const ENOENT = 2;
const EIO = 5;
const EPERM = 1;
const EROFS = 30;
const ENOSYS = 38;
const EINVAL = 22;
const ENOTSUP = 95;

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

/** Bytes of one slot: a page before each buffer so the payload after the header is page-aligned. */
const SLOT_BYTES = 2 * (4096 + MAX_WRITE);

/** Buffers for one request in flight: the request as read, and its reply. */
class Slot {
  /** The /dev/fuse fd the request in this slot came from; its reply goes back there. */
  fd = -1;
  readonly req: Uint8Array;
  readonly reqView: DataView;
  readonly out: Uint8Array;
  readonly outView: DataView;
  constructor(
    mem: Uint8Array,
    at: number,
    /** Slot number in the reader's share, or -1 for the device worker's own slots. */
    readonly readerSlot = -1,
  ) {
    // WRITE data starts 80 bytes into a request and READ data 16 bytes into a reply: both land
    // page-aligned, so O_DIRECT I/O of the layers takes them without a bounce copy.
    this.req = mem.subarray(at + 4096 - F.FUSE_WRITE_DATA_OFFSET, at + 4096 + MAX_WRITE);
    this.reqView = new DataView(this.req.buffer, this.req.byteOffset, this.req.byteLength);
    const o = at + 4096 + MAX_WRITE;
    this.out = mem.subarray(o + 4096 - F.FUSE_OUT_HEADER, o + 4096 + MAX_WRITE);
    this.outView = new DataView(this.out.buffer, this.out.byteOffset, this.out.byteLength);
  }
}

export class FuseDisk {

  private initialized = false;
  readonly stats = { requests: 0, reads: 0, writes: 0, fsyncs: 0, discards: 0, takenByReader: 0 };

  private constructor(
    readonly fd: number,
    readonly opts: FuseDiskOptions,
    /** A second fd on the connection, served by a reader thread; -1 when there is none. */
    readonly cloneFd: number,
  ) {}

  /** Open /dev/fuse and mount it over opts.path. INIT is queued at once; serve() answers it. */
  static mount(opts: FuseDiskOptions): FuseDisk {
    // Non-blocking: after poll says readable, we take every queued request (up to MAX_SLOTS).
    const fd = heldFd(open("/dev/fuse", O_RDWR | O_CLOEXEC | O_NONBLOCK));
    try {
      const data = F.mountOptions(fd, F.S_IFREG, process.getuid?.() ?? 0, process.getgid?.() ?? 0, ["allow_other", "max_read=" + MAX_WRITE]);
      mount("agentenv", opts.path, "fuse.agentenv", MS_NOSUID | MS_NODEV, data);
    } catch (e) {
      closeHeldFd(fd);
      throw e;
    }
    return new FuseDisk(fd, opts, READER_SLOTS > 0 ? ReaderLink.cloneFd(fd) : -1);
  }

  /**
   * Adopt the fds of a live connection (after a blockd restart) instead of mounting: the
   * connection's own and, when the dead server had one, its reader's clone.
   */
  static adopt(fd: number, opts: FuseDiskOptions, cloneFd?: number): FuseDisk {
    if (cloneFd === undefined && READER_SLOTS > 0) cloneFd = ReaderLink.cloneFd(fd);
    const d = new FuseDisk(fd, opts, cloneFd ?? -1);
    d.initialized = true;
    return d;
  }

  unmount(): void {
    try {
      umount2(this.opts.path, MNT_DETACH);
    } catch (e) {
      if (!(e instanceof SyscallError && (e.code === "EINVAL" || e.code === "ENOENT"))) throw e;
    }
  }

  /**
   * Serve requests until the mount goes away or wake.stopping(). One poll(2) watches /dev/fuse,
   * the control eventfd and the eventfd of this thread's I/O ring: requests are taken while
   * earlier ones wait on the disk, and control work (a restack, which drains requests) runs
   * beside them, since their I/O completes only while this loop keeps polling.
   */
  async serve(io: DeviceIo, wake: WakeSource): Promise<void> {
    try {
      prctl(PR_SET_IO_FLUSHER, 1); // page reclaim may write back through us: do not recurse
    } catch {}
    const ioFd = deferLocalIoCompletions();
    try {
      await new ServeLoop(this, io, wake, ioFd).run();
    } finally {
      deferLocalIoCompletions(false);
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

  private reply(slot: Slot, unique: bigint, error: number, payloadLen = 0): void {
    const len = F.FUSE_OUT_HEADER + (error ? 0 : payloadLen);
    F.encodeOutHeader(slot.outView, len, error ? -error : 0, unique);
    try {
      write(slot.fd, slot.out.subarray(0, len));
    } catch (e) {
      const code = (e as SyscallError).code;
      // ENOENT: the request was interrupted; ENODEV: unmounted while it ran (nobody waits for it).
      if (code !== "ENOENT" && code !== "ENODEV" && code !== "ECONNABORTED") throw e;
    }
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
  invalidate(): void {
    const b = new Uint8Array(F.FUSE_OUT_HEADER + 24);
    const dv = new DataView(b.buffer);
    F.encodeOutHeader(dv, b.length, F.FUSE_NOTIFY_INVAL_INODE, 0n);
    dv.setBigUint64(16, BigInt(F.FUSE_ROOT_ID), true);
    dv.setBigInt64(24, 0n, true);
    dv.setBigInt64(32, 0n, true); // len 0 = to the end of the file
    try {
      write(this.fd, b);
    } catch (e) {
      if ((e as SyscallError).code !== "ENOENT") throw e; // nothing cached yet
    }
  }

  async handle(io: DeviceIo, slot: Slot): Promise<void> {
    const h = F.decodeInHeader(slot.reqView);
    const dv = slot.reqView;
    const out = slot.outView;
    const P = F.FUSE_IN_HEADER;
    this.stats.requests++;
    try {
      switch (h.opcode) {
        case F.FUSE_INIT: {
          const init = F.decodeInitIn(dv, P);
          if (init.major < 7) return this.reply(slot, h.unique, 71 /* EPROTO */);
          const want = F.FUSE_ASYNC_READ | F.FUSE_BIG_WRITES | F.FUSE_ASYNC_DIO | F.FUSE_MAX_PAGES | F.FUSE_PARALLEL_DIROPS | F.FUSE_INIT_EXT;
          F.encodeInitOut(out, F.FUSE_OUT_HEADER, {
            major: F.FUSE_KERNEL_VERSION,
            minor: Math.min(init.minor, F.FUSE_KERNEL_MINOR_VERSION),
            maxReadahead: init.maxReadahead,
            flags: want & init.flags,
            maxBackground: 64,
            congestionThreshold: 48,
            maxWrite: MAX_WRITE,
            timeGran: 1,
            maxPages: MAX_WRITE / 4096,
            // Echoed so resent requests (after a blockd restart) are marked, as the kernel offers.
            flags2: init.flags & F.FUSE_INIT_EXT ? init.flags2 & F.FUSE2_HAS_RESEND : 0,
          });
          this.initialized = true;
          return this.reply(slot, h.unique, 0, F.FUSE_INIT_OUT_SIZE);
        }
        case F.FUSE_GETATTR:
          F.encodeAttrOut(out, F.FUSE_OUT_HEADER, ATTR_VALID_SEC, this.attr(io));
          return this.reply(slot, h.unique, 0, F.FUSE_ATTR_OUT_SIZE);
        case F.FUSE_SETATTR: {
          const s = F.decodeSetattrIn(dv, P);
          if (s.valid & F.FATTR_SIZE && s.size !== io.size()) return this.reply(slot, h.unique, EPERM); // resize goes through blockd
          F.encodeAttrOut(out, F.FUSE_OUT_HEADER, ATTR_VALID_SEC, this.attr(io));
          return this.reply(slot, h.unique, 0, F.FUSE_ATTR_OUT_SIZE);
        }
        case F.FUSE_OPEN: {
          const flags = dv.getUint32(P, true);
          if (io.readOnly && (flags & 3) !== 0) return this.reply(slot, h.unique, EROFS);
          const direct = this.opts.directIo ?? !io.readOnly;
          F.encodeOpenOut(out, F.FUSE_OUT_HEADER, 1, direct ? F.FOPEN_DIRECT_IO | F.FOPEN_PARALLEL_DIRECT_WRITES : F.FOPEN_KEEP_CACHE);
          return this.reply(slot, h.unique, 0, F.FUSE_OPEN_OUT_SIZE);
        }
        case F.FUSE_READ: {
          const r = F.decodeRwIn(dv, P);
          const size = io.size();
          const len = Math.max(0, Math.min(r.size, size - r.offset, MAX_WRITE));
          this.stats.reads++;
          if (len > 0) await readAny(io, slot.out.subarray(F.FUSE_OUT_HEADER, F.FUSE_OUT_HEADER + len), r.offset);
          return this.reply(slot, h.unique, 0, len);
        }
        case F.FUSE_WRITE: {
          const r = F.decodeRwIn(dv, P);
          if (io.readOnly) return this.reply(slot, h.unique, EROFS);
          if (r.offset + r.size > io.size()) return this.reply(slot, h.unique, 27 /* EFBIG */);
          this.stats.writes++;
          await writeAny(io, slot.req.subarray(F.FUSE_WRITE_DATA_OFFSET, F.FUSE_WRITE_DATA_OFFSET + r.size), r.offset);
          out.setUint32(F.FUSE_OUT_HEADER, r.size, true);
          out.setUint32(F.FUSE_OUT_HEADER + 4, 0, true);
          return this.reply(slot, h.unique, 0, F.FUSE_WRITE_OUT_SIZE);
        }
        case F.FUSE_FSYNC:
          this.stats.fsyncs++;
          if (!io.readOnly) await io.flush();
          return this.reply(slot, h.unique, 0);
        case F.FUSE_FALLOCATE: {
          const f = F.decodeFallocateIn(dv, P);
          if (io.readOnly) return this.reply(slot, h.unique, EROFS);
          const mode = f.mode & ~FALLOC_FL_KEEP_SIZE;
          if (mode === 0) return this.reply(slot, h.unique, f.offset + f.length <= io.size() ? 0 : EPERM); // preallocation: nothing to do
          if (mode !== FALLOC_FL_PUNCH_HOLE && mode !== FALLOC_FL_ZERO_RANGE) return this.reply(slot, h.unique, ENOTSUP);
          // Both become zero segments; unaligned edges are zeroed by writing.
          this.stats.discards++;
          await zeroAny(io, f.offset, Math.min(f.length, io.size() - f.offset));
          return this.reply(slot, h.unique, 0);
        }
        case F.FUSE_STATFS:
          F.encodeStatfs(out, F.FUSE_OUT_HEADER, Math.ceil(io.size() / 4096), 4096);
          return this.reply(slot, h.unique, 0, F.FUSE_KSTATFS_SIZE);
        case F.FUSE_FLUSH:
        case F.FUSE_RELEASE:
        case F.FUSE_ACCESS:
          return this.reply(slot, h.unique, 0);
        case F.FUSE_FORGET:
        case F.FUSE_BATCH_FORGET:
        case F.FUSE_INTERRUPT:
          return; // no reply expected
        case F.FUSE_LOOKUP:
          return this.reply(slot, h.unique, ENOENT); // the root is the only node
        default:
          return this.reply(slot, h.unique, ENOSYS);
      }
    } catch (e) {
      // A failed image I/O is the guest's EIO, never a dead server.
      console.error(`fuse ${this.opts.path}: opcode ${h.opcode}: ${(e as Error).message}`);
      return this.reply(slot, h.unique, (e as { errno?: number }).errno === EINVAL ? EINVAL : EIO);
    }
  }

  close(): void {
    if (this.cloneFd >= 0) closeHeldFd(this.cloneFd);
    closeHeldFd(this.fd);
  }
}

/** The state of one serve(): slots, requests in flight, control work in flight. */
class ServeLoop {
  // pollfds: 0 /dev/fuse, 1 control eventfd, 2 ring eventfd, 3 reader's "taken" eventfd (-1: none).
  private pollfds = new Uint8Array(32);
  private pv = new DataView(this.pollfds.buffer);
  private counter = new Uint8Array(8);
  private idle: Slot[] = [];
  /** Every slot's buffers in one huge-page mapping: the kernel pins and copies into them per request. */
  private readonly arena = allocAligned((MAX_SLOTS + READER_SLOTS) * SLOT_BYTES, true);
  private made = 0;
  private busy = 0;
  private control: Promise<void> | undefined;
  private controlAgain = false;
  private reader: ReaderLink | undefined;
  private readerSlots: Slot[] = [];
  /** Set once the reader's end has been dealt with; the device serves on without it. */
  private readerEnded = false;

  constructor(
    private disk: FuseDisk,
    private io: DeviceIo,
    private wake: WakeSource,
    ioFd: number,
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
    this.start(this.readerSlots[i]!);
  };

  private start(slot: Slot): void {
    if (!this.reader && slot.reqView.getUint32(4, true) === F.FUSE_WRITE && slot.reqView.getUint32(0, true) >= READER_FROM) this.startReader();
    this.busy++;
    void this.disk.handle(this.io, slot).finally(() => {
      this.busy--;
      if (slot.readerSlot >= 0) this.reader!.giveBack(slot.readerSlot);
      else this.idle.push(slot);
    });
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

  /** Serve until stopped or the connection is gone, then release the slots once none is in use. */
  async run(): Promise<void> {
    try {
      await this.loop();
    } finally {
      this.reader?.close();
      this.arena.free();
    }
  }

  private async loop(): Promise<void> {
    const pv = this.pv;
    let gone = false;
    for (;;) {
      const reader = this.reader;
      const stopping = gone || this.wake.stopping();
      if (stopping && reader && !reader.exited) reader.stop();
      // Done once nothing is in flight: no request, no control work, no reader that may still take one.
      if (stopping && this.busy === 0 && !this.control && (!reader || reader.exited)) {
        if (reader) reader.drainTaken(this.startTaken); // taken as it stopped
        if (this.busy === 0) return;
      }
      if (gone) pv.setInt32(0, -1, true); // poll skips it: a dead connection reports POLLERR forever
      // No new request while every slot is busy (the kernel queues them) or while stopping.
      pv.setInt16(4, this.busy < MAX_SLOTS && !stopping ? POLLIN : 0, true);
      for (const at of [6, 14, 22, 30]) pv.setInt16(at, 0, true);
      // Control work may wait on timers and messages: keep the event loop turning meanwhile.
      const timeout = this.control || gone ? 1 : reader && !reader.exited ? READER_WATCH_MS : -1;
      if (poll(this.pollfds, 4, timeout) > 0) {
        if (pv.getInt16(22, true) & POLLIN) {
          read(pv.getInt32(16, true), this.counter);
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
        if (pv.getInt16(6, true) !== 0) {
          while (this.busy < MAX_SLOTS) {
            const slot = this.idle.pop() ?? new Slot(this.arena.bytes, SLOT_BYTES * this.made++);
            const got = this.disk.take(slot);
            if (got === true) this.start(slot);
            else {
              this.idle.push(slot);
              if (got === "gone") gone = true; // requests in flight still finish into the slots
              break;
            }
          }
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
