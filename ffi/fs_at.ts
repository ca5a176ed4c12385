// The *at(2) file calls relative to a directory fd, and openat2 with its RESOLVE_* rules: what
// applying an untrusted tar inside a mounted root needs (x86_64 syscall numbers). Names are byte
// strings (latin1, one char per byte), so a file name that is not UTF-8 survives unchanged.

import { ptr } from "bun:ffi";
import { errno, libc, SyscallError } from "./libc.ts";

export const SYS_fchmod = 91;
export const SYS_fchown = 93;
export const SYS_getdents64 = 217;
export const SYS_lsetxattr = 189;
export const SYS_fsetxattr = 190;
export const SYS_mkdirat = 258;
export const SYS_mknodat = 259;
export const SYS_fchownat = 260;
export const SYS_unlinkat = 263;
export const SYS_linkat = 265;
export const SYS_symlinkat = 266;
export const SYS_fchmodat = 268;
export const SYS_utimensat = 280;
export const SYS_openat = 257;
export const SYS_openat2 = 437;
export const SYS_syncfs = 306;

export const AT_FDCWD = -100;
export const AT_SYMLINK_NOFOLLOW = 0x100;
export const AT_REMOVEDIR = 0x200;
export const AT_EMPTY_PATH = 0x1000;

/** openat2's resolve flags (linux/openat2.h). */
export const RESOLVE_NO_XDEV = 0x01;
export const RESOLVE_NO_MAGICLINKS = 0x02;
export const RESOLVE_NO_SYMLINKS = 0x04;
export const RESOLVE_BENEATH = 0x08;
export const RESOLVE_IN_ROOT = 0x10;

export const S_IFMT = 0o170000;
export const S_IFIFO = 0o010000;
export const S_IFCHR = 0o020000;
export const S_IFDIR = 0o040000;
export const S_IFBLK = 0o060000;
export const S_IFREG = 0o100000;
export const S_IFLNK = 0o120000;

/** utimensat's "leave this time as it is". */
export const UTIME_OMIT = (1 << 30) - 2;

/** A NUL-terminated byte string for a `char *` argument (latin1: one byte per char). */
function bytePath(s: string): Uint8Array {
  return Buffer.from(s + "\0", "latin1");
}

/** Shown in errors: the byte string read back as UTF-8. */
function shown(s: string): string {
  return Buffer.from(s, "latin1").toString("utf8");
}

/** A raw syscall argument: an integer, or a typed array passed by address (null is NULL). */
type Arg = number | bigint | NodeJS.TypedArray | null;
const word = (a: Arg): number | bigint => (a === null ? 0 : typeof a === "object" ? ptr(a) : a);

/** One raw syscall; the arrays stay referenced (so not collected) until it returns. */
function sys(name: string, context: string, nr: number, a1: Arg = 0, a2: Arg = 0, a3: Arg = 0, a4: Arg = 0, a5: Arg = 0): number {
  const r = Number(libc.syscall(nr, word(a1), word(a2), word(a3), word(a4), word(a5), 0));
  if (r === -1) throw new SyscallError(name, errno(), context);
  return r;
}

/** struct open_how {u64 flags; u64 mode; u64 resolve}. */
const how = new BigUint64Array(3);

/** openat2(2): open `path` under `dirfd` with RESOLVE_* rules (Linux 5.6+). */
export function openat2(dirfd: number, path: string, flags: number, mode: number, resolve: number): number {
  how[0] = BigInt(flags);
  how[1] = BigInt(mode);
  how[2] = BigInt(resolve);
  return sys("openat2", shown(path), SYS_openat2, dirfd, bytePath(path), how, 24);
}

/** openat(2) of one name in dirfd. */
export function openat(dirfd: number, name: string, flags: number, mode = 0): number {
  return sys("openat", shown(name), SYS_openat, dirfd, bytePath(name), flags, mode);
}

export function mkdirat(dirfd: number, name: string, mode: number): void {
  sys("mkdirat", shown(name), SYS_mkdirat, dirfd, bytePath(name), mode);
}

/** mknodat(2); dev is the kernel's encoding (makedev). */
export function mknodat(dirfd: number, name: string, mode: number, dev: bigint): void {
  sys("mknodat", shown(name), SYS_mknodat, dirfd, bytePath(name), mode, dev);
}

/** glibc's makedev: the 32-bit major and minor split around each other in a u64. */
export function makedev(major: number, minor: number): bigint {
  const ma = BigInt(major >>> 0);
  const mi = BigInt(minor >>> 0);
  return ((ma & 0xfffff000n) << 32n) | ((ma & 0xfffn) << 8n) | ((mi & 0xffffff00n) << 12n) | (mi & 0xffn);
}

export function symlinkat(target: string, dirfd: number, name: string): void {
  sys("symlinkat", shown(name), SYS_symlinkat, bytePath(target), dirfd, bytePath(name));
}

/** linkat(2) without AT_SYMLINK_FOLLOW: a link to the entry itself, even a symlink. */
export function linkat(olddirfd: number, oldname: string, newdirfd: number, newname: string): void {
  sys("linkat", `${shown(oldname)} -> ${shown(newname)}`, SYS_linkat, olddirfd, bytePath(oldname), newdirfd, bytePath(newname), 0);
}

export function unlinkat(dirfd: number, name: string, flags: number): void {
  sys("unlinkat", shown(name), SYS_unlinkat, dirfd, bytePath(name), flags);
}

export function fchownat(dirfd: number, name: string, uid: number, gid: number, flags: number): void {
  sys("fchownat", shown(name), SYS_fchownat, dirfd, bytePath(name), uid, gid, flags);
}

export function fchown(fd: number, uid: number, gid: number, context = ""): void {
  sys("fchown", context, SYS_fchown, fd, uid, gid);
}

export function fchmodat(dirfd: number, name: string, mode: number): void {
  sys("fchmodat", shown(name), SYS_fchmodat, dirfd, bytePath(name), mode);
}

export function fchmod(fd: number, mode: number, context = ""): void {
  sys("fchmod", context, SYS_fchmod, fd, mode);
}

const times = new BigInt64Array(4);
/** utimensat(2) with atime and mtime from nanoseconds since the epoch; name "" with fd alone is futimens. */
export function utimensat(dirfd: number, name: string | null, atimeNs: bigint, mtimeNs: bigint, flags: number): void {
  times[0] = atimeNs / 1_000_000_000n;
  times[1] = atimeNs % 1_000_000_000n;
  times[2] = mtimeNs / 1_000_000_000n;
  times[3] = mtimeNs % 1_000_000_000n;
  sys("utimensat", name === null ? "" : shown(name), SYS_utimensat, dirfd, name === null ? null : bytePath(name), times, flags);
}

export function fsetxattr(fd: number, name: string, value: Uint8Array, context = ""): void {
  // A zero-length value still needs a valid pointer.
  const v = value.length ? value : new Uint8Array(1);
  sys("fsetxattr", `${context} ${name}`, SYS_fsetxattr, fd, bytePath(name), v, value.length, 0);
}

export function lsetxattr(path: string, name: string, value: Uint8Array): void {
  const v = value.length ? value : new Uint8Array(1);
  sys("lsetxattr", `${shown(path)} ${name}`, SYS_lsetxattr, bytePath(path), bytePath(name), v, value.length, 0);
}

/**
 * syncfs(2): write the file system of fd back. EIO when any writeback on it failed since fd was
 * opened (the superblock's error sequence, Linux 5.8+): open fd before the writes it vouches for.
 */
export function syncfs(fd: number): void {
  sys("syncfs", "", SYS_syncfs, fd);
}

export interface DirEntry {
  /** Byte string (latin1). */
  name: string;
  /** DT_* type (DT_DIR = 4, DT_LNK = 10, DT_UNKNOWN = 0). */
  type: number;
}
export const DT_DIR = 4;

/** Every entry of an open directory (getdents64), without "." and "..". */
export function readdirFd(fd: number): DirEntry[] {
  const buf = new Uint8Array(64 << 10);
  const dv = new DataView(buf.buffer);
  const out: DirEntry[] = [];
  for (;;) {
    const n = sys("getdents64", "", SYS_getdents64, fd, buf, buf.length);
    if (n === 0) return out;
    for (let off = 0; off < n; ) {
      const reclen = dv.getUint16(off + 16, true);
      const type = buf[off + 18]!;
      let end = off + 19;
      while (buf[end] !== 0) end++;
      const name = Buffer.from(buf.subarray(off + 19, end)).toString("latin1");
      if (name !== "." && name !== "..") out.push({ name, type });
      off += reclen;
    }
  }
}
