// The few libc calls Bun has no API for (inotify, xattrs, clock_settime), via bun:ffi.
// Loaded lazily so envd still serves everything else where no libc can be opened.
import { dlopen, read, type Pointer } from "bun:ffi";

// Buffers are passed straight to "ptr" arguments so they stay alive for the whole call.

function load() {
  for (const name of ["libc.so.6", "libc.so", "libc.musl-x86_64.so.1", "libc.musl-aarch64.so.1"]) {
    try {
      return dlopen(name, {
        inotify_init1: { args: ["i32"], returns: "i32" },
        inotify_add_watch: { args: ["i32", "ptr", "u32"], returns: "i32" },
        inotify_rm_watch: { args: ["i32", "i32"], returns: "i32" },
        close: { args: ["i32"], returns: "i32" },
        setxattr: { args: ["ptr", "ptr", "ptr", "u64", "i32"], returns: "i32" },
        getxattr: { args: ["ptr", "ptr", "ptr", "u64"], returns: "i64" },
        listxattr: { args: ["ptr", "ptr", "u64"], returns: "i64" },
        removexattr: { args: ["ptr", "ptr"], returns: "i32" },
        clock_settime: { args: ["i32", "ptr"], returns: "i32" },
        open: { args: ["ptr", "i32"], returns: "i32" },
        write: { args: ["i32", "ptr", "u64"], returns: "i64" },
        ioctl: { args: ["i32", "u64", "u64"], returns: "i32" },
        strerror: { args: ["i32"], returns: "cstring" },
        __errno_location: { args: [], returns: "ptr" },
      }).symbols;
    } catch {
      // try the next name
    }
  }
  return undefined;
}

let libc: ReturnType<typeof load> | null = null;
function c() {
  if (libc === null) libc = load();
  if (!libc) throw new Error("libc is not available through bun:ffi");
  return libc;
}

const cstr = (s: string) => Buffer.from(`${s}\0`);

export class SysError extends Error {
  constructor(op: string, readonly errno: number, readonly code: string) {
    super(`${op}: ${code} (${String(c().strerror(errno))})`);
  }
}

const ERRNO_NAMES: Record<number, string> = { 1: "EPERM", 2: "ENOENT", 13: "EACCES", 20: "ENOTDIR", 22: "EINVAL", 28: "ENOSPC", 61: "ENODATA", 95: "ENOTSUP", 7: "E2BIG", 34: "ERANGE" };

function fail(op: string): never {
  const e = read.i32(c().__errno_location() as Pointer, 0);
  throw new SysError(op, e, ERRNO_NAMES[e] ?? `errno ${e}`);
}

const IN_NONBLOCK = 0x800;
const IN_CLOEXEC = 0x80000;

export const inotify = {
  init(): number {
    const fd = c().inotify_init1(IN_NONBLOCK | IN_CLOEXEC);
    return fd < 0 ? fail("inotify_init1") : fd;
  },
  add(fd: number, path: string, mask: number): number {
    const wd = c().inotify_add_watch(fd, cstr(path), mask >>> 0);
    return wd < 0 ? fail(`inotify_add_watch ${path}`) : wd;
  },
  close(fd: number) {
    c().close(fd);
  },
};

/** Extended attributes on the file itself, following symlinks like the Go envd does. */
export const xattr = {
  list(path: string): string[] {
    const p = cstr(path);
    const n = Number(c().listxattr(p, null, 0));
    if (n < 0) return fail(`listxattr ${path}`);
    if (n === 0) return [];
    const buf = Buffer.alloc(n);
    const got = Number(c().listxattr(p, buf, n));
    if (got < 0) return fail(`listxattr ${path}`);
    return buf.subarray(0, got).toString("latin1").split("\0").filter(Boolean);
  },
  get(path: string, name: string): string {
    const p = cstr(path);
    const k = cstr(name);
    const n = Number(c().getxattr(p, k, null, 0));
    if (n < 0) return fail(`getxattr ${path}`);
    if (n === 0) return "";
    const buf = Buffer.alloc(n);
    const got = Number(c().getxattr(p, k, buf, n));
    return got < 0 ? fail(`getxattr ${path}`) : buf.subarray(0, got).toString("latin1");
  },
  set(path: string, name: string, value: string) {
    const v = Buffer.from(`${value}\0`, "latin1"); // the NUL keeps the buffer non-empty; length excludes it
    if (c().setxattr(cstr(path), cstr(name), v, v.length - 1, 0) < 0) fail(`setxattr ${path}`);
  },
  remove(path: string, name: string) {
    if (c().removexattr(cstr(path), cstr(name)) < 0) fail(`removexattr ${path}`);
  },
};

const RNDRESEEDCRNG = 0x5207;
const O_WRONLY_CLOEXEC = 0o1 | 0o2000000;

/**
 * Mixes host-given bytes into the kernel's entropy pool and forces the CRNG to reseed from it
 * (RNDRESEEDCRNG, needs CAP_SYS_ADMIN). Restores of one snapshot start with one CRNG state, so
 * without this they would hand out the same "random" bytes.
 */
export function reseedRandom(bytes: Uint8Array) {
  const fd = c().open(cstr("/dev/urandom"), O_WRONLY_CLOEXEC);
  if (fd < 0) fail("open /dev/urandom");
  try {
    if (Number(c().write(fd, bytes, bytes.length)) !== bytes.length) fail("write /dev/urandom");
    if (c().ioctl(fd, RNDRESEEDCRNG, 0) < 0) fail("ioctl RNDRESEEDCRNG");
  } finally {
    c().close(fd);
  }
}

/** Sets CLOCK_REALTIME (needs CAP_SYS_TIME); used by /init to fix a restored guest's clock. */
export function setClock(ms: number) {
  const ts = new BigInt64Array([BigInt(Math.floor(ms / 1000)), BigInt(Math.round((ms % 1000) * 1e6))]);
  if (c().clock_settime(0, ts) < 0) fail("clock_settime");
}
