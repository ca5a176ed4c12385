// libc through bun:ffi (x86_64 glibc): raw symbols, wrappers that throw SyscallError, kernel constants.

import { FFIType, dlopen, ptr, read, toArrayBuffer, type Pointer } from "bun:ffi";

// mmap returns an integer, compared with -1 for MAP_FAILED (as a ptr it would be an inexact ~2^64
// double); ioctl requests are u64 (0xc0207504 has bit 31 set); syscall(2) takes 7 i64s.
export const libc = dlopen("libc.so.6", {
  open: { args: ["ptr", "i32", "u32"], returns: "i32" },
  close: { args: ["i32"], returns: "i32" },
  read: { args: ["i32", "ptr", "u64"], returns: FFIType.i64_fast },
  write: { args: ["i32", "ptr", "u64"], returns: FFIType.i64_fast },
  writev: { args: ["i32", "ptr", "i32"], returns: FFIType.i64_fast },
  pread: { args: ["i32", "ptr", "u64", "i64"], returns: FFIType.i64_fast },
  pwrite: { args: ["i32", "ptr", "u64", "i64"], returns: FFIType.i64_fast },
  fsync: { args: ["i32"], returns: "i32" },
  fdatasync: { args: ["i32"], returns: "i32" },
  fallocate: { args: ["i32", "i32", "i64", "i64"], returns: "i32" },
  posix_fadvise: { args: ["i32", "i64", "i64", "i32"], returns: "i32" },
  lseek: { args: ["i32", "i64", "i32"], returns: "i64" },
  ftruncate: { args: ["i32", "i64"], returns: "i32" },
  mmap: { args: ["u64", "u64", "i32", "i32", "i32", "i64"], returns: FFIType.i64_fast },
  munmap: { args: ["u64", "u64"], returns: "i32" },
  madvise: { args: ["u64", "u64", "i32"], returns: "i32" },
  ioctl: { args: ["i32", "u64", "ptr"], returns: "i32" },
  syscall: { args: ["i64", "i64", "i64", "i64", "i64", "i64", "i64"], returns: FFIType.i64_fast },
  mount: { args: ["ptr", "ptr", "ptr", "u64", "ptr"], returns: "i32" },
  umount2: { args: ["ptr", "i32"], returns: "i32" },
  strerror: { args: ["i32"], returns: "cstring" },
  poll: { args: ["ptr", "u64", "i32"], returns: "i32" },
  eventfd: { args: ["u32", "i32"], returns: "i32" },
  prctl: { args: ["i32", "u64", "u64", "u64", "u64"], returns: "i32" },
  __errno_location: { args: [], returns: "ptr" },
}).symbols;

// errno is thread-local and this module is instantiated once per JS thread, so the address is ours.
const errnoPtr = libc.__errno_location() as Pointer;

/** This thread's errno; read it right after the failing call, before any other libc call. */
export function errno(): number {
  return read.i32(errnoPtr, 0);
}

// ---------------------------------------------------------------------------------------------
// errno names

const ERRNO_TABLE = [
  [1, "EPERM", "Operation not permitted"],
  [2, "ENOENT", "No such file or directory"],
  [3, "ESRCH", "No such process"],
  [4, "EINTR", "Interrupted system call"],
  [5, "EIO", "Input/output error"],
  [6, "ENXIO", "No such device or address"],
  [7, "E2BIG", "Argument list too long"],
  [8, "ENOEXEC", "Exec format error"],
  [9, "EBADF", "Bad file descriptor"],
  [10, "ECHILD", "No child processes"],
  [11, "EAGAIN", "Resource temporarily unavailable"],
  [12, "ENOMEM", "Cannot allocate memory"],
  [13, "EACCES", "Permission denied"],
  [14, "EFAULT", "Bad address"],
  [15, "ENOTBLK", "Block device required"],
  [16, "EBUSY", "Device or resource busy"],
  [17, "EEXIST", "File exists"],
  [18, "EXDEV", "Invalid cross-device link"],
  [19, "ENODEV", "No such device"],
  [20, "ENOTDIR", "Not a directory"],
  [21, "EISDIR", "Is a directory"],
  [22, "EINVAL", "Invalid argument"],
  [23, "ENFILE", "Too many open files in system"],
  [24, "EMFILE", "Too many open files"],
  [25, "ENOTTY", "Inappropriate ioctl for device"],
  [26, "ETXTBSY", "Text file busy"],
  [27, "EFBIG", "File too large"],
  [28, "ENOSPC", "No space left on device"],
  [29, "ESPIPE", "Illegal seek"],
  [30, "EROFS", "Read-only file system"],
  [31, "EMLINK", "Too many links"],
  [32, "EPIPE", "Broken pipe"],
  [33, "EDOM", "Numerical argument out of domain"],
  [34, "ERANGE", "Numerical result out of range"],
  [35, "EDEADLK", "Resource deadlock avoided"],
  [36, "ENAMETOOLONG", "File name too long"],
  [37, "ENOLCK", "No locks available"],
  [38, "ENOSYS", "Function not implemented"],
  [39, "ENOTEMPTY", "Directory not empty"],
  [40, "ELOOP", "Too many levels of symbolic links"],
  [42, "ENOMSG", "No message of desired type"],
  [53, "EBADR", "Invalid request descriptor"],
  [61, "ENODATA", "No data available"],
  [62, "ETIME", "Timer expired"],
  [75, "EOVERFLOW", "Value too large for defined data type"],
  [77, "EBADFD", "File descriptor in bad state"],
  [95, "EOPNOTSUPP", "Operation not supported"],
  [98, "EADDRINUSE", "Address already in use"],
  [99, "EADDRNOTAVAIL", "Cannot assign requested address"],
  [101, "ENETUNREACH", "Network is unreachable"],
  [103, "ECONNABORTED", "Software caused connection abort"],
  [104, "ECONNRESET", "Connection reset by peer"],
  [105, "ENOBUFS", "No buffer space available"],
  [106, "EISCONN", "Transport endpoint is already connected"],
  [107, "ENOTCONN", "Transport endpoint is not connected"],
  [110, "ETIMEDOUT", "Connection timed out"],
  [111, "ECONNREFUSED", "Connection refused"],
  [113, "EHOSTUNREACH", "No route to host"],
  [114, "EALREADY", "Operation already in progress"],
  [115, "EINPROGRESS", "Operation now in progress"],
  [116, "ESTALE", "Stale file handle"],
  [122, "EDQUOT", "Disk quota exceeded"],
  [125, "ECANCELED", "Operation canceled"],
  [130, "EOWNERDEAD", "Owner died"],
  [131, "ENOTRECOVERABLE", "State not recoverable"],
  [133, "EHWPOISON", "Memory page has hardware error"],
] as const;
export type ErrnoName = (typeof ERRNO_TABLE)[number][1];
const ERRNO_NAMES = new Map<number, string>();
const ERRNO_TEXTS = new Map<number, string>();
/** errno values by name, e.g. E.ENOSPC === 28. */
export const E = {} as Record<ErrnoName, number>;
for (const [n, name, text] of ERRNO_TABLE) {
  ERRNO_NAMES.set(n, name);
  ERRNO_TEXTS.set(n, text);
  E[name] = n;
}

/** "ENOSPC" for 28; "ERRNO_<n>" for a value not in the table. */
export function errnoName(n: number): string {
  return ERRNO_NAMES.get(n) ?? `ERRNO_${n}`;
}

/** "No space left on device" for 28; libc's strerror for a value not in the table. */
export function strerror(n: number): string {
  return ERRNO_TEXTS.get(n) ?? String(libc.strerror(n));
}

/** A failed system call: which call, which errno, and (optionally) on what. */
export class SyscallError extends Error {
  override name = "SyscallError";
  readonly code: string;
  constructor(
    readonly call: string,
    readonly errno: number,
    /** What the call was on (a path, "path @offset"), shown after the call name. */
    readonly context: string = "",
  ) {
    const code = errnoName(errno);
    super(`${call}${context ? ` ${context}` : ""}: ${code} (${strerror(errno)})`);
    this.code = code;
  }
}

/** Throw the current errno as a SyscallError when a libc call returned -1. */
function check(call: string, ret: number | bigint, context?: string): number {
  const r = Number(ret);
  if (r === -1) throw new SyscallError(call, errno(), context);
  return r;
}

// ---------------------------------------------------------------------------------------------
// constants (x86_64 values)

export const PAGE_SIZE = 4096;

export const O_RDONLY = 0;
export const O_WRONLY = 0o1;
export const O_RDWR = 0o2;
export const O_CREAT = 0o100;
export const O_EXCL = 0o200;
export const O_NOCTTY = 0o400;
export const O_TRUNC = 0o1000;
export const O_APPEND = 0o2000;
export const O_NONBLOCK = 0o4000;
export const O_DSYNC = 0o10000;
export const O_DIRECT = 0o40000;
export const O_LARGEFILE = 0o100000;
export const O_DIRECTORY = 0o200000;
export const O_NOFOLLOW = 0o400000;
export const O_NOATIME = 0o1000000;
export const O_CLOEXEC = 0o2000000;
export const O_SYNC = 0o4010000;
export const O_PATH = 0o10000000;
export const O_TMPFILE = 0o20200000;

export const PROT_NONE = 0;
export const PROT_READ = 1;
export const PROT_WRITE = 2;
export const PROT_EXEC = 4;

export const MAP_SHARED = 0x01;
export const MAP_PRIVATE = 0x02;
export const MAP_FIXED = 0x10;
export const MAP_ANONYMOUS = 0x20;
export const MAP_NORESERVE = 0x4000;
export const MAP_POPULATE = 0x8000;
export const MAP_HUGETLB = 0x40000;
export const MAP_FAILED = -1;

export const MADV_NORMAL = 0;
export const MADV_RANDOM = 1;
export const MADV_SEQUENTIAL = 2;
export const MADV_WILLNEED = 3;
export const MADV_DONTNEED = 4;
export const MADV_FREE = 8;
export const MADV_REMOVE = 9;
export const MADV_DONTFORK = 10;
export const MADV_DOFORK = 11;
export const MADV_HUGEPAGE = 14;
export const HUGE_PAGE_SIZE = 2 << 20;

export const FALLOC_FL_KEEP_SIZE = 0x01;
export const FALLOC_FL_PUNCH_HOLE = 0x02;
export const FALLOC_FL_COLLAPSE_RANGE = 0x08;
export const FALLOC_FL_ZERO_RANGE = 0x10;
export const FALLOC_FL_INSERT_RANGE = 0x20;

export const MS_RDONLY = 1;
export const MS_NOSUID = 2;
export const MS_NODEV = 4;
export const MS_NOEXEC = 8;
export const MS_SYNCHRONOUS = 16;
export const MS_REMOUNT = 32;
export const MS_NOATIME = 1024;
export const MS_BIND = 4096;
export const MS_MOVE = 8192;
export const MS_REC = 16384;
export const MS_PRIVATE = 1 << 18;
export const MS_SLAVE = 1 << 19;
export const MS_SHARED = 1 << 20;

export const MNT_FORCE = 1;
export const MNT_DETACH = 2;
export const MNT_EXPIRE = 4;
export const UMOUNT_NOFOLLOW = 8;

export const SYS_read = 0;
export const SYS_write = 1;
export const SYS_close = 3;
export const SYS_mmap = 9;
export const SYS_munmap = 11;
export const SYS_ioctl = 16;
export const SYS_pread64 = 17;
export const SYS_pwrite64 = 18;
export const SYS_madvise = 28;
export const SYS_prctl = 157;
export const SYS_process_vm_readv = 310;
export const SYS_mount = 165;
export const SYS_umount2 = 166;
export const SYS_gettid = 186;
export const SYS_epoll_wait = 232;
export const SYS_epoll_ctl = 233;
export const SYS_openat = 257;
export const SYS_fallocate = 285;
export const SYS_eventfd2 = 290;
export const SYS_epoll_create1 = 291;
export const SYS_memfd_create = 319;
export const SYS_io_uring_setup = 425;
export const SYS_io_uring_enter = 426;
export const SYS_io_uring_register = 427;
export const SYS_pidfd_open = 434;
export const SYS_pidfd_getfd = 438;

const SYSCALL_NAMES: Record<number, string> = {
  [SYS_prctl]: "prctl",
  [SYS_process_vm_readv]: "process_vm_readv",
  [SYS_gettid]: "gettid",
  [SYS_epoll_wait]: "epoll_wait",
  [SYS_epoll_ctl]: "epoll_ctl",
  [SYS_eventfd2]: "eventfd2",
  [SYS_epoll_create1]: "epoll_create1",
  [SYS_memfd_create]: "memfd_create",
  [SYS_pidfd_open]: "pidfd_open",
  [SYS_pidfd_getfd]: "pidfd_getfd",
  [SYS_io_uring_setup]: "io_uring_setup",
  [SYS_io_uring_enter]: "io_uring_enter",
  [SYS_io_uring_register]: "io_uring_register",
};

// ---------------------------------------------------------------------------------------------
// wrappers: throw SyscallError on -1; read/write-like calls retry EINTR

type Arg = number | bigint;
/** Something bun:ffi accepts for a `ptr` argument: a typed array, or an address as a number. */
export type PtrArg = NodeJS.TypedArray | DataView | Pointer | number | null;

/** A NUL-terminated copy of s for a `char *` argument. */
export function cString(s: string): Uint8Array {
  return Buffer.from(s + "\0", "utf8");
}

export function open(path: string, flags: number, mode = 0o644): number {
  return check("open", libc.open(cString(path), flags, mode), path);
}

export function close(fd: number): void {
  // No EINTR retry: on Linux the fd is released even when close reports EINTR.
  check("close", libc.close(fd));
}

export function read_(fd: number, buf: Uint8Array): number {
  if (buf.length === 0) return 0;
  for (;;) {
    const r = Number(libc.read(fd, buf, buf.length));
    if (r >= 0) return r;
    const e = errno();
    if (e !== E.EINTR) throw new SyscallError("read", e);
  }
}
export { read_ as read };

export function write(fd: number, buf: Uint8Array): number {
  if (buf.length === 0) return 0;
  for (;;) {
    const r = Number(libc.write(fd, buf, buf.length));
    if (r >= 0) return r;
    const e = errno();
    if (e !== E.EINTR) throw new SyscallError("write", e);
  }
}

/** iov: an array of 16-byte {u64 base, u64 len} entries (typed array or address). */
export function writev(fd: number, iov: PtrArg, iovcnt: number): number {
  for (;;) {
    const r = Number(libc.writev(fd, iov as Pointer, iovcnt));
    if (r >= 0) return r;
    const e = errno();
    if (e !== E.EINTR) throw new SyscallError("writev", e);
  }
}

/** One pread(2): returns the count read (short at EOF); retries EINTR. */
export function pread(fd: number, buf: Uint8Array, offset: number, context?: string): number {
  if (buf.length === 0) return 0;
  for (;;) {
    const r = Number(libc.pread(fd, buf, buf.length, offset));
    if (r >= 0) return r;
    const e = errno();
    if (e !== E.EINTR) throw new SyscallError("pread", e, context);
  }
}

/** One pwrite(2): returns the count written (possibly short); retries EINTR. */
export function pwrite(fd: number, buf: Uint8Array, offset: number, context?: string): number {
  if (buf.length === 0) return 0;
  for (;;) {
    const r = Number(libc.pwrite(fd, buf, buf.length, offset));
    if (r >= 0) return r;
    const e = errno();
    if (e !== E.EINTR) throw new SyscallError("pwrite", e, context);
  }
}

export function fsync(fd: number, context?: string): void {
  check("fsync", libc.fsync(fd), context);
}

export function fdatasync(fd: number, context?: string): void {
  check("fdatasync", libc.fdatasync(fd), context);
}

export function fallocate(fd: number, mode: number, offset: number, len: number, context?: string): void {
  check("fallocate", libc.fallocate(fd, mode, offset, len), context);
}

export const POLLIN = 0x1;
export const EFD_CLOEXEC = 0o2000000;
export const PR_SET_IO_FLUSHER = 57;

/**
 * poll(2) over `fds` (pollfd = {i32 fd, i16 events, i16 revents}); returns the ready count,
 * 0 on timeout. EINTR counts as 0 ready so callers simply poll again.
 */
export function poll(pollfds: Uint8Array, nfds: number, timeoutMs: number): number {
  const r = libc.poll(pollfds, nfds, timeoutMs);
  if (r < 0) {
    const e = errno();
    if (e === E.EINTR) return 0;
    throw new SyscallError("poll", e);
  }
  return r;
}

/** eventfd(2): a counter fd used to wake a thread blocked in poll or io_uring. */
export function eventfd(initval = 0, flags = EFD_CLOEXEC): number {
  return check("eventfd", libc.eventfd(initval, flags));
}

const EVENTFD_ONE = new Uint8Array(new BigUint64Array([1n]).buffer);
/** Add 1 to an eventfd's counter: wakes whoever polls it. */
export function eventfdSignal(fd: number): void {
  write(fd, EVENTFD_ONE);
}

/** prctl(2) with integer arguments. */
export function prctl(option: number, a2 = 0, a3 = 0, a4 = 0, a5 = 0): number {
  return check("prctl", libc.prctl(option, a2, a3, a4, a5));
}

export const POSIX_FADV_DONTNEED = 4;
export const POSIX_FADV_WILLNEED = 3;

/** posix_fadvise(2): returns the error number instead of setting errno. */
export function posixFadvise(fd: number, offset: number, len: number, advice: number, context?: string): void {
  const rc = libc.posix_fadvise(fd, offset, len, advice);
  if (rc !== 0) throw new SyscallError("posix_fadvise", rc, context);
}

export const SEEK_SET = 0;
export const SEEK_DATA = 3;
export const SEEK_HOLE = 4;

/** lseek(2); ENXIO (no data/hole past offset) is returned as -1 rather than thrown. */
export function lseek(fd: number, offset: number, whence: number, context?: string): number {
  const r = Number(libc.lseek(fd, offset, whence));
  if (r < 0) {
    const e = errno();
    if (e === E.ENXIO) return -1;
    throw new SyscallError("lseek", e, context);
  }
  return r;
}

export function ftruncate(fd: number, len: number, context?: string): void {
  check("ftruncate", libc.ftruncate(fd, len), context);
}

/** mmap(2); returns the address as a number (user addresses fit in 47 bits). */
export function mmap(addr: number, len: number, prot: number, flags: number, fd: number, offset: number): number {
  return check("mmap", libc.mmap(addr, len, prot, flags, fd, offset));
}

export function munmap(addr: number, len: number): void {
  check("munmap", libc.munmap(addr, len));
}

export function madvise(addr: number, len: number, advice: number): void {
  check("madvise", libc.madvise(addr, len, advice));
}

/** ioctl(2); arg is a pointer (typed array / address) or a plain integer argument. */
export function ioctl(fd: number, request: Arg, arg: PtrArg = 0, context?: string): number {
  const r = libc.ioctl(fd, request, arg as Pointer);
  if (r === -1) {
    throw new SyscallError(`ioctl(0x${BigInt(request).toString(16)})`, errno(), context);
  }
  return r;
}

/** Raw syscall(2): returns the result; throws SyscallError named after the syscall on -1. */
export function syscall(nr: number, a1: Arg = 0, a2: Arg = 0, a3: Arg = 0, a4: Arg = 0, a5: Arg = 0, a6: Arg = 0): number {
  const r = Number(libc.syscall(nr, a1, a2, a3, a4, a5, a6));
  if (r === -1) throw new SyscallError(SYSCALL_NAMES[nr] ?? `syscall(${nr})`, errno());
  return r;
}

/**
 * process_vm_readv(2): copies `pid`'s memory at the `remoteCount` iovecs at `remoteIov` into the
 * `localCount` at `localIov` (addresses of 16-byte {u64 base, u64 len} entries, at most 1024
 * each) in one copy, no bounce page as /proc/<pid>/mem has; returns the bytes copied, short where
 * a remote range is not mapped.
 */
export function processVmReadv(pid: number, localIov: number, localCount: number, remoteIov: number, remoteCount: number): number {
  for (;;) {
    const r = Number(libc.syscall(SYS_process_vm_readv, pid, localIov, localCount, remoteIov, remoteCount, 0));
    if (r >= 0) return r;
    const e = errno();
    if (e !== E.EINTR) throw new SyscallError("process_vm_readv", e, `process ${pid}`);
  }
}

/**
 * A copy, in this process, of another process's fd (pidfd_open + pidfd_getfd, Linux 5.6+): the
 * same open file description, so a FUSE connection parked elsewhere survives our restart.
 */
export function takeFdFrom(pid: number, fd: number): number {
  const pidfd = syscall(SYS_pidfd_open, pid, 0);
  try {
    return syscall(SYS_pidfd_getfd, pidfd, fd, 0); // the new fd has FD_CLOEXEC set
  } finally {
    close(pidfd);
  }
}

export function mount(source: string | null, target: string, fstype: string | null, flags: number, data: string | null): void {
  const r = libc.mount(
    source === null ? null : cString(source),
    cString(target),
    fstype === null ? null : cString(fstype),
    flags,
    data === null ? null : cString(data),
  );
  check("mount", r, target);
}

export function umount2(target: string, flags = 0): void {
  check("umount2", libc.umount2(cString(target), flags), target);
}

// ---------------------------------------------------------------------------------------------
// page-aligned buffers the kernel may keep using after a call returns

export interface AlignedBuffer {
  /** Address of the first byte (page-aligned). */
  readonly ptr: number;
  /** Length in bytes (as asked, not rounded). */
  readonly length: number;
  /** A view of the memory; becomes empty (detached) after free(). */
  readonly bytes: Uint8Array<ArrayBuffer>;
  /** Unmap the memory; safe to call twice. */
  free(): void;
}

/**
 * Anonymous private mmap of len bytes (rounded up to pages), zero-filled, owned by the caller.
 * hugePages: 2 MiB-aligned and MADV_HUGEPAGE, for buffers the kernel pins and copies into on
 * every request (one PMD instead of 512 PTEs to walk; fewer TLB misses in the copy).
 */
export function allocAligned(len: number, hugePages = false): AlignedBuffer {
  if (!(len > 0)) throw new RangeError(`allocAligned: bad length ${len}`);
  const unit = hugePages ? HUGE_PAGE_SIZE : PAGE_SIZE;
  const mapLen = Math.ceil(len / unit) * unit;
  let addr = mmap(0, mapLen + unit - PAGE_SIZE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (hugePages) {
    // Over-mapped by up to one huge page: cut the head and tail off around the aligned span.
    const start = Math.ceil(addr / unit) * unit;
    if (start > addr) munmap(addr, start - addr);
    const tail = addr + mapLen + unit - PAGE_SIZE - (start + mapLen);
    if (tail > 0) munmap(start + mapLen, tail);
    addr = start;
    try {
      madvise(addr, mapLen, MADV_HUGEPAGE);
    } catch {} // THP compiled out or off: small pages still work
  }
  const ab = toArrayBuffer(addr as Pointer, 0, len);
  let freed = false;
  return {
    ptr: addr,
    length: len,
    bytes: new Uint8Array(ab),
    free() {
      if (freed) return;
      freed = true;
      // Detach the ArrayBuffer first so JS views read as empty instead of touching unmapped memory.
      ab.transfer(0);
      munmap(addr, mapLen);
    },
  };
}

/** A view of len bytes at addr: memory another thread of this process mapped (it must outlive the view). */
export function viewAt(addr: number, len: number): Uint8Array<ArrayBuffer> {
  return new Uint8Array(toArrayBuffer(addr as Pointer, 0, len));
}

/** Address of a non-empty typed array's first byte (bun:ffi ptr), for SQEs and iovecs. */
export function addressOf(view: NodeJS.TypedArray | DataView): number {
  if (view.byteLength === 0) throw new RangeError("addressOf: empty buffer has no address");
  return ptr(view);
}
