// A local file through this thread's io_uring ring; calls made in one tick share one io_uring_enter.

import { fstatSync } from "node:fs";
import {
  IORING_FSYNC_DATASYNC,
  IOSQE_IO_DRAIN,
  IORING_REGISTER_EVENTFD,
  IoUring,
} from "../../ffi/io_uring.ts";
import {
  E,
  FALLOC_FL_KEEP_SIZE,
  FALLOC_FL_PUNCH_HOLE,
  O_CLOEXEC,
  O_CREAT,
  O_DIRECT,
  O_RDONLY,
  O_RDWR,
  PAGE_SIZE,
  SyscallError,
  addressOf,
  allocAligned,
  cString,
  libc,
  eventfd,
  errno as lastErrno,
  type AlignedBuffer,
} from "../../ffi/libc.ts";
import { IoRangeError } from "./errors.ts";
import type { ReadWaiter, WritableFile } from "./file.ts";

/** O_DIRECT requests must have offset and length in multiples of this. */
export const DIRECT_ALIGN = 512;

/** Entries of the per-thread ring. */
const RING_ENTRIES = 128;
/** Largest single read/write SQE (the kernel caps one call at about 2 GiB anyway). */
const MAX_IO = 1 << 30;
/** Bounce buffers up to this size are kept for reuse. */
const POOL_MAX_BUF = 1 << 20;
/** Kept bounce buffers per size class. */
const POOL_PER_CLASS = 16;

export interface LocalFileOptions {
  /** Open read-write (default read-only). */
  write?: boolean;
  /** Create the file when missing (implies write). */
  create?: boolean;
  /** O_DIRECT: bypass the page cache; requests must be 512-aligned. */
  direct?: boolean;
  /** Mode for a created file (default 0o644). */
  mode?: number;
}

/** A failed system call on a local file: names the call, the errno, the file and the offset. */
export class LocalFileError extends SyscallError {
  override name = "LocalFileError";
  constructor(
    call: string,
    errno: number,
    readonly file: string,
    readonly offset: number = -1,
  ) {
    super(call, errno, offset >= 0 ? `${file} @${offset}` : file);
  }
}

// ---------------------------------------------------------------------------------------------
// page-aligned bounce buffers for O_DIRECT (one pool per thread, like the ring)

const bouncePool = new Map<number, AlignedBuffer[]>();

function bounceClass(len: number): number {
  if (len > POOL_MAX_BUF) return Math.ceil(len / PAGE_SIZE) * PAGE_SIZE;
  let c = PAGE_SIZE;
  while (c < len) c *= 2;
  return c;
}

function getBounce(len: number): AlignedBuffer {
  const cls = bounceClass(len);
  return bouncePool.get(cls)?.pop() ?? allocAligned(cls);
}

function putBounce(b: AlignedBuffer): void {
  if (b.length > POOL_MAX_BUF) return b.free();
  let list = bouncePool.get(b.length);
  if (!list) bouncePool.set(b.length, (list = []));
  if (list.length < POOL_PER_CLASS) list.push(b);
  else b.free();
}

// ---------------------------------------------------------------------------------------------
// queued operations

const OP_READ = 0;
const OP_WRITE = 1;
const OP_FSYNC = 2; // barrier: after everything queued before it
const OP_PUNCH = 3; // barrier
const OP_TRUNCATE = 4; // run synchronously at its turn (no ring op before 6.9)
const OP_CLOSE = 5; // run synchronously at its turn
const runsAlone = (kind: number) => kind === OP_TRUNCATE || kind === OP_CLOSE;

const CALL_NAMES = ["pread", "pwrite", "fdatasync", "fallocate", "ftruncate", "close"];

class Op {
  /** Bytes done so far (read/write). */
  done = 0;
  /** Bytes asked of the kernel by the SQE in flight. */
  want = 0;
  bounce: AlignedBuffer | null = null;
  constructor(
    readonly kind: number,
    readonly file: LocalFile,
    readonly buf: Uint8Array | null,
    readonly offset: number,
    readonly length: number,
    /** Settles a promise-returning call; null when `waiter` is told instead (preadTo). */
    readonly resolve: ((v: any) => void) | null,
    readonly reject: ((e: unknown) => void) | null,
    readonly waiter: ReadWaiter | null = null,
  ) {}

  fail(errno: number): void {
    this.error(new LocalFileError(CALL_NAMES[this.kind]!, errno, this.file.name, this.kind <= OP_PUNCH && this.kind !== OP_FSYNC ? this.offset : -1));
  }

  error(e: unknown): void {
    this.release();
    if (this.waiter) this.waiter.readFailed(e);
    else this.reject!(e);
  }

  finish(v: unknown): void {
    this.release();
    if (this.waiter) this.waiter.readDone(v as number);
    else this.resolve!(v);
  }

  release(): void {
    if (this.bounce) {
      putBounce(this.bounce);
      this.bounce = null;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// the per-thread engine: a queue drained by a microtask, through the ring or synchronously

export type IoEngineKind = "io_uring" | "sync";

class Engine {
  /** undefined: not probed yet; null: io_uring unavailable, use synchronous libc calls. */
  private ring: IoUring | null | undefined = undefined;
  private forceSync = false;
  unavailableReason = "";
  private queue: Op[] = [];
  private qHead = 0;
  private slots: (Op | null)[] = [];
  private retry: Op[] = [];
  private scheduled = false;
  private readonly onCqe = (userData: number, res: number) => this.complete(userData, res);
  private readonly flushFn = () => this.flush();
  /**
   * Deferred completions (opt-in per thread): a flush submits and returns; CQEs are reaped when
   * the thread's event loop sees `eventFd` readable. Lets a server overlap disk I/O with taking
   * new requests. Default: a flush waits for all its CQEs.
   */
  private deferred = false;
  private eventFd = -1;
  private free: number[] = [];
  private inflight = 0;
  /** SQEs put on the ring so far: what shows a request went through io_uring, not the sync path. */
  sqesPrepared = 0;

  kind(): IoEngineKind {
    return this.getRing() ? "io_uring" : "sync";
  }

  setForceSync(on: boolean): void {
    this.forceSync = on;
  }

  enqueue(op: Op): void {
    this.queue.push(op);
    if (!this.scheduled) {
      this.scheduled = true;
      queueMicrotask(this.flushFn);
    }
  }

  /**
   * Switch this thread to deferred completions (returns the eventfd to watch, -1 without a ring)
   * or back (on = false: waits for everything in flight, then flushes block again).
   */
  deferCompletions(on: boolean): number {
    const ring = this.getRing();
    if (!ring) return -1;
    if (on && !this.deferred) {
      if (this.eventFd < 0) {
        this.eventFd = eventfd(0);
        fdWatcher?.hold(this.eventFd);
        ring.register(IORING_REGISTER_EVENTFD, addressOf(new Int32Array([this.eventFd])), 1);
      }
      this.free = Array.from({ length: this.slots.length }, (_, i) => this.slots.length - 1 - i);
      this.inflight = 0;
      this.deferred = true;
    } else if (!on && this.deferred) {
      while (this.inflight > 0) {
        ring.submitAndWait(1);
        this.reapReady();
      }
      this.deferred = false;
    }
    return this.eventFd;
  }

  /** Deferred mode: handle every CQE that is ready, without waiting. */
  reapReady(): void {
    if (!this.ring) return;
    this.ring.reap(this.onCqe);
    if (this.retry.length) {
      for (const op of this.retry) this.queue.push(op);
      this.retry.length = 0;
      if (!this.scheduled) {
        this.scheduled = true;
        queueMicrotask(this.flushFn);
      }
    }
  }

  /** Drain the queue (runs as a microtask after the tick that queued the ops). */
  flush(): void {
    this.scheduled = false;
    try {
      if (this.deferred && this.ring) this.runDeferred(this.ring);
      else this.run();
    } catch (e) {
      this.failAll(e);
    }
  }

  private getRing(): IoUring | null {
    if (this.forceSync) return null;
    if (this.ring === undefined) {
      try {
        this.ring = new IoUring(RING_ENTRIES);
        fdWatcher?.hold(this.ring.fd);
        this.slots = new Array(this.ring.sqEntries).fill(null);
      } catch (e) {
        // io_uring_setup refused (seccomp EPERM, io_uring_disabled, ENOSYS): use synchronous libc calls.
        this.ring = null;
        this.unavailableReason = e instanceof Error ? e.message : String(e);
      }
    }
    return this.ring;
  }

  private run(): void {
    while (this.qHead < this.queue.length) {
      const ring = this.getRing();
      if (!ring) {
        const op = this.queue[this.qHead++]!;
        runSync(op);
        continue;
      }
      // Barriers (fsync, punch: IO_DRAIN) start a round and sync ops run alone, so both follow all earlier ops.
      let n = 0;
      while (this.qHead < this.queue.length && n < ring.sqEntries) {
        const op = this.queue[this.qHead]!;
        if (op.kind >= OP_TRUNCATE) {
          if (n > 0) break;
          this.qHead++;
          runSync(op);
          continue;
        }
        const barrier = op.kind === OP_FSYNC || op.kind === OP_PUNCH;
        if (barrier && n > 0) break;
        this.qHead++;
        if (this.prep(ring, op, n, barrier ? IOSQE_IO_DRAIN : 0)) {
          this.slots[n++] = op;
          this.sqesPrepared++;
        }
      }
      if (n === 0) continue;
      // Waiting for every CQE means the kernel is done with callers' JS-heap buffers before we return.
      let reaped = 0;
      while (reaped < n) {
        ring.submitAndWait(n - reaped);
        reaped += ring.reap(this.onCqe);
      }
      // Requests with work left (short write, short read before EOF, EINTR) go first next round.
      for (let i = this.retry.length - 1; i >= 0; i--) this.queue[--this.qHead] = this.retry[i]!;
      this.retry.length = 0;
    }
    this.queue.length = 0;
    this.qHead = 0;
  }

  private runDeferred(ring: IoUring): void {
    let n = 0;
    while (this.qHead < this.queue.length) {
      const op = this.queue[this.qHead]!;
      if (runsAlone(op.kind) || this.free.length === 0) {
        // truncate/close run after everything before them; a full ring frees a slot first.
        if (n) ring.submit();
        n = 0;
        const want = runsAlone(op.kind) ? 0 : this.inflight - 1;
        while (this.inflight > want) {
          ring.submitAndWait(1);
          this.reapReady();
        }
        if (runsAlone(op.kind)) {
          this.qHead++;
          runSync(op);
        }
        continue;
      }
      this.qHead++;
      const slot = this.free.pop()!;
      const barrier = op.kind === OP_FSYNC || op.kind === OP_PUNCH;
      if (this.prep(ring, op, slot, barrier ? IOSQE_IO_DRAIN : 0)) {
        this.slots[slot] = op;
        this.inflight++;
        this.sqesPrepared++;
        n++;
      } else this.free.push(slot);
    }
    this.queue.length = 0;
    this.qHead = 0;
    if (n) ring.submit();
    this.reapReady(); // cached reads complete inside the submit
  }

  /** Fill the SQE for op; false (op rejected) when its buffer cannot be addressed. */
  private prep(ring: IoUring, op: Op, ud: number, sqeFlags: number): boolean {
    const fd = op.file.fd;
    try {
      switch (op.kind) {
        case OP_READ:
        case OP_WRITE: {
          const buf = op.buf!;
          const want = Math.min(buf.length - op.done, MAX_IO);
          let addr: number;
          if (op.file.direct) {
            addr = directAddress(op);
          } else {
            addr = addressOf(buf) + op.done;
          }
          op.want = want;
          if (op.kind === OP_READ) ring.prepRead(fd, addr, want, op.offset + op.done, ud, 0, sqeFlags);
          else ring.prepWrite(fd, addr, want, op.offset + op.done, ud, 0, sqeFlags);
          return true;
        }
        case OP_FSYNC:
          ring.prepFsync(fd, ud, IORING_FSYNC_DATASYNC, sqeFlags);
          return true;
        case OP_PUNCH:
          ring.prepFallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, op.offset, op.length, ud, sqeFlags);
          return true;
      }
      throw new Error(`local_file: bad op kind ${op.kind}`);
    } catch (e) {
      op.error(e);
      return false;
    }
  }

  private complete(ud: number, res: number): void {
    const op = this.slots[ud]!;
    this.slots[ud] = null;
    if (this.deferred) {
      this.free.push(ud);
      this.inflight--;
    }
    if (res < 0) {
      if (res === -E.EINTR || res === -E.EAGAIN) this.retry.push(op);
      else op.fail(-res);
      return;
    }
    const file = op.file;
    switch (op.kind) {
      case OP_READ: {
        const buf = op.buf!;
        if (op.bounce && res > 0) buf.set(op.bounce.bytes.subarray(op.done, op.done + res), op.done);
        op.done += res;
        const end = op.offset + op.done;
        // Short only at EOF: stop on 0, on a short O_DIRECT read (it cannot resume unaligned),
        // or when the known size says EOF; a short buffered read before EOF is resumed.
        if (op.done === buf.length || res === 0 || (res < op.want && (file.direct || end >= file.knownSize))) {
          op.finish(op.done);
        } else {
          this.retry.push(op);
        }
        return;
      }
      case OP_WRITE: {
        const buf = op.buf!;
        op.done += res;
        file.grow(op.offset + op.done);
        if (op.done === buf.length) op.finish(undefined);
        else if (res === 0) op.fail(E.EIO); // a write that makes no progress would loop forever
        else this.retry.push(op);
        return;
      }
      default:
        op.finish(undefined);
    }
  }

  /** The ring failed as a whole: fail every queued and in-flight op, drop the ring. */
  private failAll(e: unknown): void {
    const ops: Op[] = [];
    for (let i = 0; i < this.slots.length; i++) {
      const op = this.slots[i];
      if (op) ops.push(op);
      this.slots[i] = null;
    }
    ops.push(...this.retry, ...this.queue.slice(this.qHead));
    this.retry.length = 0;
    this.queue.length = 0;
    this.qHead = 0;
    if (this.ring) {
      fdWatcher?.release(this.ring.fd);
      this.ring.close();
      this.ring = undefined; // probe again on the next request
    }
    for (const op of ops) op.error(e);
  }
}

/** Address to give the kernel for an O_DIRECT op: the caller's buffer if page-aligned, else a bounce. */
function directAddress(op: Op): number {
  const buf = op.buf!;
  if (op.bounce) return op.bounce.ptr + op.done;
  const a = addressOf(buf);
  if (a % PAGE_SIZE === 0) return a + op.done;
  op.bounce = getBounce(buf.length);
  if (op.kind === OP_WRITE) op.bounce.bytes.set(buf);
  return op.bounce.ptr + op.done;
}

/** Serve one op with synchronous libc calls (no ring, or truncate/close). */
function runSync(op: Op): void {
  const file = op.file;
  const fd = file.fd;
  switch (op.kind) {
    case OP_READ:
    case OP_WRITE: {
      const buf = op.buf!;
      const isRead = op.kind === OP_READ;
      while (op.done < buf.length) {
        const want = Math.min(buf.length - op.done, MAX_IO);
        const addr = file.direct ? directAddress(op) : addressOf(buf) + op.done;
        const pos = op.offset + op.done;
        const r = Number(isRead ? libc.pread(fd, addr, want, pos) : libc.pwrite(fd, addr, want, pos));
        if (r < 0) {
          const e = lastErrno();
          if (e === E.EINTR || e === E.EAGAIN) continue;
          return op.fail(e);
        }
        if (isRead && op.bounce && r > 0) buf.set(op.bounce.bytes.subarray(op.done, op.done + r), op.done);
        op.done += r;
        if (!isRead) file.grow(op.offset + op.done);
        if (r === 0) {
          if (isRead) break;
          return op.fail(E.EIO);
        }
        if (isRead && r < want && file.direct) break;
      }
      return op.finish(isRead ? op.done : undefined);
    }
    case OP_FSYNC:
      return libc.fdatasync(fd) < 0 ? op.fail(lastErrno()) : op.finish(undefined);
    case OP_PUNCH:
      return libc.fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, op.offset, op.length) < 0
        ? op.fail(lastErrno())
        : op.finish(undefined);
    case OP_TRUNCATE:
      if (libc.ftruncate(fd, op.offset) < 0) return op.fail(lastErrno());
      file.setKnownSize(op.offset);
      return op.finish(undefined);
    case OP_CLOSE:
      // No retry on EINTR: Linux releases the fd even then.
      return libc.close(fd) < 0 ? op.fail(lastErrno()) : op.finish(undefined);
  }
}

// Module state is per JS thread (each Worker loads its own copy), so this is a per-thread ring.
const engine = new Engine();

/** Told of each fd this thread's local I/O opens (hold) and of each before it is closed (release). */
export interface LocalFdWatcher {
  hold(fd: number): void;
  release(fd: number): void;
}
let fdWatcher: LocalFdWatcher | undefined;

/** A thread whose fds must be closed by another if it dies (a blockd device worker) watches them here. */
export function watchLocalFds(w: LocalFdWatcher | undefined): void {
  fdWatcher = w;
}

/** Which engine this thread's local files use ("sync" when io_uring_setup was refused). */
export function localIoEngine(): IoEngineKind {
  return engine.kind();
}

/** Why io_uring is not used on this thread ("" when it is). */
export function localIoEngineReason(): string {
  return engine.unavailableReason;
}

/**
 * Deferred completions for this thread (a server that polls): returns an eventfd that becomes
 * readable when I/O completes; then read it and call reapLocalIo(). -1 when there is no ring.
 */
export function deferLocalIoCompletions(on = true): number {
  return engine.deferCompletions(on);
}

/** SQEs this thread's local files have put on the ring (stays put on the synchronous path). */
export function localIoSqes(): number {
  return engine.sqesPrepared;
}

export function reapLocalIo(): void {
  engine.reapReady();
}

/** Force synchronous libc calls on this thread (tests, debugging); takes effect at the next flush. */
export function forceSyncLocalIo(on: boolean): void {
  engine.setForceSync(on);
}

// ---------------------------------------------------------------------------------------------

export class LocalFile implements WritableFile {
  private _size: number;
  private closed = false;

  private constructor(
    readonly name: string,
    readonly fd: number,
    readonly direct: boolean,
    readonly writable: boolean,
    size: number,
  ) {
    this._size = size;
  }

  /** Open path (read-only unless write/create). Synchronous: opening is one cheap syscall. */
  static open(path: string, opts: LocalFileOptions = {}): LocalFile {
    const writable = !!(opts.write || opts.create);
    let flags = (writable ? O_RDWR : O_RDONLY) | O_CLOEXEC;
    if (opts.create) flags |= O_CREAT;
    if (opts.direct) flags |= O_DIRECT;
    const fd = libc.open(cString(path), flags, opts.mode ?? 0o644);
    if (fd < 0) throw new LocalFileError("open", lastErrno(), path);
    let size: number;
    try {
      size = fstatSync(fd).size;
    } catch (e) {
      libc.close(fd);
      throw e;
    }
    fdWatcher?.hold(fd);
    return new LocalFile(path, fd, !!opts.direct, writable, size);
  }

  size(): number {
    return this._size;
  }

  /** The size as tracked here (writes past EOF grow it, truncate sets it). */
  get knownSize(): number {
    return this._size;
  }

  /** @internal a completed write reached `end`. */
  grow(end: number): void {
    if (end > this._size) this._size = end;
  }

  /** @internal a truncate completed. */
  setKnownSize(size: number): void {
    this._size = size;
  }

  pread(buf: Uint8Array, offset: number): Promise<number> {
    const bad = this.check(offset, buf.length, "pread");
    if (bad) return Promise.reject(bad);
    if (buf.length === 0) return Promise.resolve(0); // bun:ffi ptr() has no address for it
    return this.submit(OP_READ, buf, offset, buf.length);
  }

  /** pread telling `waiter` instead of settling a promise of its own (see ReadableFile.preadTo). */
  preadTo(buf: Uint8Array, offset: number, waiter: ReadWaiter): void {
    const bad = this.check(offset, buf.length, "pread");
    if (bad) return waiter.readFailed(bad);
    if (buf.length === 0) return waiter.readDone(0);
    engine.enqueue(new Op(OP_READ, this, buf, offset, buf.length, null, null, waiter));
  }

  pwrite(buf: Uint8Array, offset: number): Promise<void> {
    const bad = this.check(offset, buf.length, "pwrite");
    if (bad) return Promise.reject(bad);
    if (buf.length === 0) return Promise.resolve();
    return this.submit(OP_WRITE, buf, offset, buf.length);
  }

  fdatasync(): Promise<void> {
    if (this.closed) return Promise.reject(this.closedError());
    return this.submit(OP_FSYNC, null, 0, 0);
  }

  truncate(size: number): Promise<void> {
    if (this.closed) return Promise.reject(this.closedError());
    if (!Number.isSafeInteger(size) || size < 0) {
      return Promise.reject(new IoRangeError(`truncate: bad size ${size}`, this.name));
    }
    return this.submit(OP_TRUNCATE, null, size, 0);
  }

  punchHole(offset: number, length: number): Promise<void> {
    if (this.closed) return Promise.reject(this.closedError());
    if (!Number.isSafeInteger(offset) || offset < 0 || !Number.isSafeInteger(length) || length < 0) {
      return Promise.reject(new IoRangeError(`punchHole: bad range +${length}`, this.name, offset));
    }
    if (length === 0) return Promise.resolve();
    return this.submit(OP_PUNCH, null, offset, length);
  }

  /** Close after every request issued before it has completed; later calls are refused. */
  close(): Promise<void> {
    if (this.closed) return Promise.resolve();
    this.closed = true;
    fdWatcher?.release(this.fd);
    return this.submit(OP_CLOSE, null, 0, 0);
  }

  private submit<T>(kind: number, buf: Uint8Array | null, offset: number, length: number): Promise<T> {
    return new Promise<T>((resolve, reject) => {
      engine.enqueue(new Op(kind, this, buf, offset, length, resolve, reject));
    });
  }

  private check(offset: number, length: number, call: string): IoRangeError | null {
    if (this.closed) return this.closedError();
    if (!Number.isSafeInteger(offset) || offset < 0) {
      return new IoRangeError(`${call}: bad offset ${offset}`, this.name);
    }
    if (this.direct && (offset % DIRECT_ALIGN !== 0 || length % DIRECT_ALIGN !== 0)) {
      return new IoRangeError(`${call}: O_DIRECT needs ${DIRECT_ALIGN}-aligned offset and length (length ${length})`, this.name, offset);
    }
    return null;
  }

  private closedError(): IoRangeError {
    return new IoRangeError("file is closed", this.name);
  }
}
