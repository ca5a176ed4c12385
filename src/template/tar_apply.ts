// Applies one OCI layer's tar stream onto a mounted file system, synchronously (it runs on a worker
// thread: apply_worker.ts). Every name is resolved inside the root with openat2(RESOLVE_IN_ROOT |
// RESOLVE_NO_SYMLINKS): a `..` component or a path through a symlink fails the layer (UnsafePath),
// since layer tars written by docker and buildkit hold real paths only. Entries are created with
// the *at calls on the parent's fd, never by path. Whiteouts (`.wh.<name>`) remove the lower
// entry, `.wh..wh..opq` empties a directory of lower content; owners, modes, mtimes, xattrs (PAX
// SCHILY.xattr.*), hard links, symlinks, device nodes and fifos are kept.
//
// Names are byte strings (latin1, one char per byte) from the header to the syscall.

import { ConvertError } from "./convert_error.ts";
import { close, E, O_CLOEXEC, O_CREAT, O_DIRECTORY, O_EXCL, O_NOFOLLOW, O_PATH, O_RDONLY, O_WRONLY, SyscallError, write } from "../../ffi/libc.ts";
import {
  AT_REMOVEDIR, AT_SYMLINK_NOFOLLOW, DT_DIR, fchmod, fchmodat, fchown, fchownat, fsetxattr, linkat, lsetxattr, makedev, mkdirat,
  mknodat, openat, openat2, readdirFd, RESOLVE_IN_ROOT, RESOLVE_NO_MAGICLINKS, RESOLVE_NO_SYMLINKS, S_IFBLK, S_IFCHR, S_IFIFO,
  symlinkat, syncfs, unlinkat, utimensat,
} from "../../ffi/fs_at.ts";

const BLOCK = 512;
/** PAX and GNU long-name records are read whole; real ones are a few hundred bytes. */
const MAX_META_BYTES = 1 << 20;
/** Open parent-directory fds kept (tar entries come grouped by directory). */
const DIR_FDS = 64;
/** Directories whose mtime is set at the end (after their entries are written). */
const MAX_DEFERRED_DIRS = 4_000_000;
const RESOLVE = RESOLVE_IN_ROOT | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS;

const WHITEOUT = ".wh.";
const OPAQUE = ".wh..wh..opq";

export interface ApplyStats {
  entries: number;
  /** Bytes of file data written. */
  dataBytes: number;
  whiteouts: number;
  /** Entries skipped: aufs metadata (`.wh..wh.*`). */
  skipped: number;
}

interface Entry {
  /** Path components (byte strings), none `.`/`..`/empty; [] is the root. */
  parts: string[];
  type: string;
  mode: number;
  uid: number;
  gid: number;
  size: number;
  mtimeNs: bigint;
  atimeNs: bigint;
  linkname: string;
  devmajor: number;
  devminor: number;
  xattrs: [string, Uint8Array][];
}

/** Display form of a byte-string path. */
function shown(s: string): string {
  return Buffer.from(s, "latin1").toString("utf8");
}

function cstr(b: Uint8Array): string {
  const nul = b.indexOf(0);
  return Buffer.from(nul < 0 ? b : b.subarray(0, nul)).toString("latin1");
}

/** Octal (space/NUL padded) or GNU base-256 (high bit set) number field. */
function num(b: Uint8Array, entry: string): number {
  if (b[0]! & 0x80) {
    let v = b[0]! & 0x7f;
    for (let i = 1; i < b.length; i++) v = v * 256 + b[i]!;
    if (!Number.isSafeInteger(v)) throw new ConvertError("CorruptLayer", "tar number field out of range", entry);
    return v;
  }
  const s = cstr(b).trim();
  if (s === "") return 0;
  if (!/^[0-7]+$/.test(s)) throw new ConvertError("CorruptLayer", `tar number field ${JSON.stringify(s)} is not octal`, entry);
  return parseInt(s, 8);
}

/** Components of a tar name; UnsafePath for a `..` component. */
function split(name: string, what: string): string[] {
  const parts: string[] = [];
  for (const p of name.split("/")) {
    if (p === "" || p === ".") continue;
    if (p === "..") throw new ConvertError("UnsafePath", `${what} ${JSON.stringify(shown(name))} has a ".." component`, shown(name));
    parts.push(p);
  }
  return parts;
}

/** Nanoseconds since the epoch from a PAX time ("1700000000.123456789", maybe negative). */
function paxTime(v: string): bigint {
  const m = /^(-?)(\d+)(?:\.(\d{1,9})\d*)?$/.exec(v);
  if (!m) return 0n;
  const ns = BigInt(m[2]!) * 1_000_000_000n + BigInt((m[3] ?? "").padEnd(9, "0"));
  return m[1] ? -ns : ns;
}

/** PAX records "<len> <key>=<value>\n"; values are bytes (xattr values are binary). */
function parsePax(b: Uint8Array, entry: string): Map<string, Uint8Array> {
  const out = new Map<string, Uint8Array>();
  let off = 0;
  while (off < b.length) {
    if (b[off] === 0) break;
    const sp = b.indexOf(0x20, off);
    const len = sp < 0 ? NaN : Number(Buffer.from(b.subarray(off, sp)).toString("latin1"));
    if (!Number.isSafeInteger(len) || len <= 0 || off + len > b.length) throw new ConvertError("CorruptLayer", "bad PAX record", entry);
    const rec = b.subarray(sp + 1, off + len - 1); // without the trailing newline
    const eq = rec.indexOf(0x3d);
    if (eq < 0) throw new ConvertError("CorruptLayer", "PAX record without '='", entry);
    out.set(Buffer.from(rec.subarray(0, eq)).toString("utf8"), rec.subarray(eq + 1));
    off += len;
  }
  return out;
}

type Sink =
  | { kind: "file"; fd: number; e: Entry; left: number }
  | { kind: "meta"; type: string; buf: Uint8Array; at: number; left: number; entry: string }
  | { kind: "skip"; left: number };

/** Apply a tar stream chunk by chunk: `feed` each chunk, then `finish`. Not reusable. */
export class TarApplier {
  readonly stats: ApplyStats = { entries: 0, dataBytes: 0, whiteouts: 0, skipped: 0 };
  private rootFd: number;
  /** Opened before any write: syncfs on it reports every writeback error of the apply. */
  private syncFd: number;
  private dirFds = new Map<string, number>();
  /** Paths this layer made: a whiteout or opaque marker hides only lower content. */
  private created = new Set<string>();
  private deferredDirs: { parts: string[]; atimeNs: bigint; mtimeNs: bigint }[] = [];
  private header = new Uint8Array(BLOCK);
  private headerAt = 0;
  private sink: Sink | null = null;
  /** Bytes of padding left after the current entry's data. */
  private pad = 0;
  private ended = false;
  private pax: Map<string, Uint8Array> | null = null;
  private longName: string | null = null;
  private longLink: string | null = null;
  private closed = false;

  constructor(readonly root: string) {
    this.rootFd = openat2(-100, root, O_PATH | O_DIRECTORY | O_CLOEXEC, 0, 0);
    this.syncFd = openat(this.rootFd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  }

  feed(chunk: Uint8Array): void {
    let off = 0;
    while (off < chunk.length) {
      if (this.ended) return; // after the end marker: padding to the record size
      if (this.sink) {
        off += this.consume(chunk.subarray(off));
        continue;
      }
      if (this.pad > 0) {
        // The zero padding after an entry's data, up to the next 512-byte block.
        const n = Math.min(this.pad, chunk.length - off);
        this.pad -= n;
        off += n;
        continue;
      }
      const n = Math.min(BLOCK - this.headerAt, chunk.length - off);
      this.header.set(chunk.subarray(off, off + n), this.headerAt);
      this.headerAt += n;
      off += n;
      if (this.headerAt === BLOCK) {
        this.headerAt = 0;
        this.onHeader(this.header);
      }
    }
  }

  /** The stream ended: it must end between entries. Sets the directories' times; closes every fd. */
  finish(): ApplyStats {
    try {
      if (this.sink || this.headerAt !== 0 || this.pad > 0) throw new ConvertError("CorruptLayer", "tar stream cut short inside an entry");
      this.dropDirFds();
      // Deepest first is not needed (setting a time does not touch the parent's), but last write wins for repeats.
      for (const d of this.deferredDirs) this.setDirTimes(d.parts, d.atimeNs, d.mtimeNs);
      try {
        syncfs(this.syncFd);
      } catch (e) {
        // A write the device refused: ext4 dropped the data (and may have aborted its journal).
        throw new ConvertError("ApplyFailed", `writing the layer's file system back failed: ${(e as Error).message} (the block device refused writes)`);
      }
      return this.stats;
    } finally {
      this.close();
    }
  }

  close(): void {
    if (this.closed) return;
    this.closed = true;
    if (this.sink?.kind === "file") tryClose(this.sink.fd);
    this.sink = null;
    this.dropDirFds();
    tryClose(this.syncFd);
    tryClose(this.rootFd);
  }

  // ---- stream ---------------------------------------------------------------------------------

  private consume(data: Uint8Array): number {
    const s = this.sink!;
    const n = Math.min(s.left, data.length);
    const part = data.subarray(0, n);
    if (s.kind === "file") {
      for (let at = 0; at < part.length; ) {
        try {
          at += write(s.fd, part.subarray(at));
        } catch (e) {
          throw this.failed(e, s.e.parts);
        }
      }
      this.stats.dataBytes += n;
    } else if (s.kind === "meta") {
      s.buf.set(part, s.at);
      s.at += n;
    }
    s.left -= n;
    if (s.left === 0) {
      this.sink = null;
      if (s.kind === "file") this.finishFile(s.fd, s.e);
      else if (s.kind === "meta") this.onMeta(s.type, s.buf, s.entry);
    }
    return n;
  }

  private onHeader(h: Uint8Array): void {
    if (h.every((b) => b === 0)) {
      this.ended = true; // the first of the two zero blocks ends the archive
      return;
    }
    const rawName = cstr(h.subarray(0, 100));
    const label = shown(rawName);
    const stored = num(h.subarray(148, 156), label);
    let sum = 0;
    for (let i = 0; i < BLOCK; i++) sum += i >= 148 && i < 156 ? 0x20 : h[i]!;
    if (sum !== stored) throw new ConvertError("CorruptLayer", `tar header checksum mismatch at entry ${JSON.stringify(label)}`, label);
    const type = h[156] === 0 ? "0" : String.fromCharCode(h[156]!);
    const size = num(h.subarray(124, 136), label);
    const magic = cstr(h.subarray(257, 263));
    const prefix = magic === "ustar" && h[263] === 0x30 ? cstr(h.subarray(345, 500)) : "";

    if (type === "x" || type === "g" || type === "L" || type === "K") {
      if (size > MAX_META_BYTES) throw new ConvertError("CorruptLayer", `a ${type} record of ${size} bytes (at most ${MAX_META_BYTES})`, label);
      this.pad = (BLOCK - (size % BLOCK)) % BLOCK;
      if (size === 0) return this.onMeta(type, new Uint8Array(0), label);
      this.sink = { kind: "meta", type, buf: new Uint8Array(size), at: 0, left: size, entry: label };
      return;
    }

    const pax = this.pax;
    this.pax = null;
    let name = this.longName ?? (prefix ? `${prefix}/${rawName}` : rawName);
    let linkname = this.longLink ?? cstr(h.subarray(157, 257));
    this.longName = this.longLink = null;
    const e: Entry = {
      parts: [], type, size,
      mode: num(h.subarray(100, 108), label) & 0o7777,
      uid: num(h.subarray(108, 116), label),
      gid: num(h.subarray(116, 124), label),
      mtimeNs: BigInt(num(h.subarray(136, 148), label)) * 1_000_000_000n,
      atimeNs: -1n,
      linkname: "",
      devmajor: num(h.subarray(329, 337), label),
      devminor: num(h.subarray(337, 345), label),
      xattrs: [],
    };
    if (pax) {
      for (const [k, v] of pax) {
        const text = () => Buffer.from(v).toString("latin1");
        if (k === "path") name = text();
        else if (k === "linkpath") linkname = text();
        else if (k === "size") e.size = Number(text());
        else if (k === "uid") e.uid = Number(text());
        else if (k === "gid") e.gid = Number(text());
        else if (k === "mtime") e.mtimeNs = paxTime(text());
        else if (k === "atime") e.atimeNs = paxTime(text());
        else if (k.startsWith("SCHILY.xattr.")) e.xattrs.push([k.slice("SCHILY.xattr.".length), v]);
        else if (k.startsWith("GNU.sparse.")) throw new ConvertError("Unsupported", "GNU sparse files are not supported", shown(name));
      }
      if (!Number.isSafeInteger(e.size) || e.size < 0) throw new ConvertError("CorruptLayer", "bad PAX size", shown(name));
    }
    if (e.atimeNs < 0n) e.atimeNs = e.mtimeNs;
    e.parts = split(name, "entry");
    e.linkname = linkname;
    this.pad = (BLOCK - (e.size % BLOCK)) % BLOCK;
    this.stats.entries++;
    this.apply(e, shown(name));
  }

  private onMeta(type: string, buf: Uint8Array, label: string): void {
    if (type === "x") this.pax = parsePax(buf, label);
    else if (type === "L") this.longName = cstr(buf);
    else if (type === "K") this.longLink = cstr(buf);
    // "g": global PAX headers hold archive comments in practice; nothing of them is applied.
  }

  // ---- entries --------------------------------------------------------------------------------

  private apply(e: Entry, label: string): void {
    const dataSink = (): void => {
      if (e.size > 0) this.sink = { kind: "skip", left: e.size };
    };
    const base = e.parts.at(-1);
    if (base === undefined) {
      // The root itself ("./"): only a directory makes sense.
      if (e.type !== "5") throw new ConvertError("UnsafePath", `entry ${JSON.stringify(label)} names the root but is not a directory`, label);
      this.setRootMeta(e);
      return dataSink();
    }
    const parentParts = e.parts.slice(0, -1);
    if (base.startsWith(WHITEOUT)) {
      if (base === OPAQUE) this.opaque(parentParts);
      else if (base.startsWith(`${WHITEOUT}${WHITEOUT}`)) this.stats.skipped++;
      else this.whiteout([...parentParts, base.slice(WHITEOUT.length)]);
      return dataSink();
    }
    const path = e.parts.join("/");
    try {
      const parent = this.dirFd(parentParts, label);
      if (e.type === "5") {
        this.makeDir(parent, base);
        this.meta(parent, base, e, true);
        if (this.deferredDirs.length >= MAX_DEFERRED_DIRS) throw new ConvertError("Unsupported", `more than ${MAX_DEFERRED_DIRS} directories in one layer`, label);
        this.deferredDirs.push({ parts: e.parts, atimeNs: e.atimeNs, mtimeNs: e.mtimeNs });
        this.created.add(path);
        return dataSink();
      }
      this.removeExisting(parent, base, path);
      this.created.add(path);
      switch (e.type) {
        case "0":
        case "7": {
          const fd = openat(parent, base, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0o600);
          if (e.size === 0) this.finishFile(fd, e);
          else this.sink = { kind: "file", fd, e, left: e.size };
          return;
        }
        case "1": {
          const target = split(e.linkname, `hard link target of ${JSON.stringify(label)}:`);
          const tBase = target.at(-1);
          if (tBase === undefined) throw new ConvertError("UnsafePath", `hard link ${JSON.stringify(label)} to the root`, label);
          const tParent = this.dirFd(target.slice(0, -1), label, false);
          linkat(tParent, tBase, parent, base);
          return dataSink();
        }
        case "2":
          symlinkat(e.linkname, parent, base);
          this.meta(parent, base, e, false);
          return dataSink();
        case "3":
        case "4":
        case "6": {
          const kind = e.type === "3" ? S_IFCHR : e.type === "4" ? S_IFBLK : S_IFIFO;
          mknodat(parent, base, kind | 0o600, e.type === "6" ? 0n : makedev(e.devmajor, e.devminor));
          this.meta(parent, base, e, true);
          return dataSink();
        }
        default:
          throw new ConvertError("Unsupported", `tar entry type ${JSON.stringify(e.type)} is not supported`, label);
      }
    } catch (err) {
      throw this.failed(err, e.parts);
    }
  }

  /** Owner, mode, xattrs, times of a created non-regular entry (mode: false for a symlink, which has none). */
  private meta(parent: number, base: string, e: Entry, hasMode: boolean): void {
    fchownat(parent, base, e.uid, e.gid, AT_SYMLINK_NOFOLLOW);
    if (hasMode) fchmodat(parent, base, e.mode); // after chown, which clears set-id bits
    if (e.xattrs.length) {
      if (e.type === "5") {
        const fd = openat(parent, base, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
        try {
          for (const [k, v] of e.xattrs) fsetxattr(fd, k, v, base);
        } finally {
          close(fd);
        }
      } else {
        // Symlinks and device nodes cannot be opened for fsetxattr; the parent's fd names the place.
        for (const [k, v] of e.xattrs) lsetxattr(`/proc/self/fd/${parent}/${base}`, k, v);
      }
    }
    if (e.type !== "5") utimensat(parent, base, e.atimeNs, e.mtimeNs, AT_SYMLINK_NOFOLLOW);
  }

  private finishFile(fd: number, e: Entry): void {
    try {
      fchown(fd, e.uid, e.gid);
      fchmod(fd, e.mode);
      for (const [k, v] of e.xattrs) fsetxattr(fd, k, v);
      utimensat(fd, null, e.atimeNs, e.mtimeNs, 0);
    } catch (err) {
      throw this.failed(err, e.parts);
    } finally {
      close(fd);
    }
  }

  private setRootMeta(e: Entry): void {
    const fd = openat(this.rootFd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    try {
      fchown(fd, e.uid, e.gid);
      fchmod(fd, e.mode);
      for (const [k, v] of e.xattrs) fsetxattr(fd, k, v, "/");
    } finally {
      close(fd);
    }
    this.deferredDirs.push({ parts: [], atimeNs: e.atimeNs, mtimeNs: e.mtimeNs });
  }

  private setDirTimes(parts: string[], atimeNs: bigint, mtimeNs: bigint): void {
    if (parts.length === 0) {
      const fd = openat(this.rootFd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
      try {
        utimensat(fd, null, atimeNs, mtimeNs, 0);
      } finally {
        close(fd);
      }
      return;
    }
    let parent: number;
    try {
      parent = this.dirFd(parts.slice(0, -1), parts.join("/"), false);
      utimensat(parent, parts.at(-1)!, atimeNs, mtimeNs, AT_SYMLINK_NOFOLLOW);
    } catch (e) {
      // A later entry of the layer removed or replaced it: nothing to set.
      if (e instanceof SyscallError && (e.errno === E.ENOENT || e.errno === E.ENOTDIR)) return;
      throw this.failed(e, parts);
    }
  }

  /** A directory at parent/base: an existing one is kept (its lower entries stay), anything else replaced. */
  private makeDir(parent: number, base: string): void {
    try {
      mkdirat(parent, base, 0o700);
      return;
    } catch (e) {
      if (!(e instanceof SyscallError) || e.errno !== E.EEXIST) throw e;
    }
    try {
      close(openat(parent, base, O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
      return; // a directory already
    } catch (e) {
      if (!(e instanceof SyscallError) || (e.errno !== E.ENOTDIR && e.errno !== E.ELOOP)) throw e;
    }
    unlinkat(parent, base, 0);
    mkdirat(parent, base, 0o700);
  }

  /** Whatever is at parent/base (`path` under the root) goes, a directory with everything in it: tar's unlink-first. */
  private removeExisting(parent: number, base: string, path: string): void {
    try {
      unlinkat(parent, base, 0);
    } catch (e) {
      if (!(e instanceof SyscallError)) throw e;
      if (e.errno === E.ENOENT) return;
      if (e.errno !== E.EISDIR) throw e;
      this.forget(path);
      removeTree(parent, base);
    }
  }

  private whiteout(parts: string[]): void {
    this.stats.whiteouts++;
    if (this.created.has(parts.join("/"))) return; // a whiteout hides lower entries only
    let parent: number;
    try {
      parent = this.dirFd(parts.slice(0, -1), parts.join("/"), false);
    } catch (e) {
      if (e instanceof SyscallError && (e.errno === E.ENOENT || e.errno === E.ENOTDIR)) return; // nothing below to hide
      throw this.failed(e, parts);
    }
    try {
      this.removeExisting(parent, parts.at(-1)!, parts.join("/"));
    } catch (e) {
      throw this.failed(e, parts);
    }
  }

  /** `.wh..wh..opq`: the directory keeps only what this layer puts in it. */
  private opaque(parts: string[]): void {
    this.stats.whiteouts++;
    let fd: number;
    try {
      const parent = parts.length ? this.dirFd(parts.slice(0, -1), parts.join("/"), false) : this.rootFd;
      fd = openat(parent, parts.length ? parts.at(-1)! : ".", O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    } catch (e) {
      if (e instanceof SyscallError && (e.errno === E.ENOENT || e.errno === E.ENOTDIR)) return;
      throw this.failed(e, parts);
    }
    try {
      const prefix = parts.length ? `${parts.join("/")}/` : "";
      for (const child of readdirFd(fd)) {
        if (this.created.has(prefix + child.name)) continue;
        this.removeExisting(fd, child.name, prefix + child.name);
      }
    } catch (e) {
      throw this.failed(e, parts);
    } finally {
      close(fd);
    }
  }

  /**
   * An O_PATH fd of the directory `parts` under the root, resolved by the kernel inside the root
   * with no symlink allowed on the way; missing directories are made (0755, root) when `create`.
   * The fd belongs to the cache: valid until the next dirFd/dropDirFds call that evicts it.
   */
  private dirFd(parts: string[], label: string, create = true): number {
    if (parts.length === 0) return this.rootFd;
    const key = parts.join("/");
    const hit = this.dirFds.get(key);
    if (hit !== undefined) {
      this.dirFds.delete(key);
      this.dirFds.set(key, hit); // most recent last
      return hit;
    }
    let fd: number;
    try {
      fd = openat2(this.rootFd, key, O_PATH | O_DIRECTORY | O_CLOEXEC, 0, RESOLVE);
    } catch (e) {
      if (!(e instanceof SyscallError)) throw e;
      if (e.errno === E.ELOOP || e.errno === E.EXDEV) {
        throw new ConvertError("UnsafePath", `entry ${JSON.stringify(label)}: its path ${JSON.stringify(shown(key))} runs through a symlink`, label);
      }
      if (e.errno !== E.ENOENT || !create) throw e;
      const parent = this.dirFd(parts.slice(0, -1), label, true);
      try {
        mkdirat(parent, parts.at(-1)!, 0o755);
      } catch (m) {
        if (!(m instanceof SyscallError) || m.errno !== E.EEXIST) throw m;
      }
      fd = openat2(this.rootFd, key, O_PATH | O_DIRECTORY | O_CLOEXEC, 0, RESOLVE);
    }
    this.dirFds.set(key, fd);
    if (this.dirFds.size > DIR_FDS) {
      const [oldKey, oldFd] = this.dirFds.entries().next().value!;
      this.dirFds.delete(oldKey);
      tryClose(oldFd);
    }
    return fd;
  }

  /** A directory tree at `path` is going: its cached fds (it and everything below) are closed. */
  private forget(path: string): void {
    for (const [key, fd] of this.dirFds) {
      if (key === path || key.startsWith(`${path}/`)) {
        this.dirFds.delete(key);
        tryClose(fd);
      }
    }
  }

  /** Every cached directory fd is closed. */
  private dropDirFds(): void {
    for (const fd of this.dirFds.values()) tryClose(fd);
    this.dirFds.clear();
  }

  private failed(e: unknown, parts: string[]): Error {
    if (e instanceof ConvertError) return e;
    const label = shown(parts.join("/"));
    if (e instanceof SyscallError) {
      if (e.errno === E.ELOOP) return new ConvertError("UnsafePath", `entry ${JSON.stringify(label)}: ${e.message}`, label);
      return new ConvertError("ApplyFailed", `entry ${JSON.stringify(label)}: ${e.message}`, label);
    }
    return e as Error;
  }
}

/** Remove parent/name and, if it is a directory, everything in it; no symlink is followed. */
export function removeTree(parent: number, name: string): void {
  let fd: number;
  try {
    fd = openat(parent, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  } catch (e) {
    if (e instanceof SyscallError && (e.errno === E.ENOTDIR || e.errno === E.ELOOP)) return unlinkat(parent, name, 0);
    if (e instanceof SyscallError && e.errno === E.ENOENT) return;
    throw e;
  }
  try {
    for (const child of readdirFd(fd)) {
      if (child.type === DT_DIR) removeTree(fd, child.name);
      else {
        try {
          unlinkat(fd, child.name, 0);
        } catch (e) {
          if (!(e instanceof SyscallError) || e.errno !== E.EISDIR) throw e;
          removeTree(fd, child.name); // DT_UNKNOWN on a file system without d_type
        }
      }
    }
  } finally {
    close(fd);
  }
  unlinkat(parent, name, AT_REMOVEDIR);
}

function tryClose(fd: number): void {
  try {
    close(fd);
  } catch {}
}
