// EntryInfo construction shared by the filesystem RPCs, watch events and /files, with Go's
// os.FileMode.String() permissions text and user.e2b.* xattrs as metadata.
import { chownSync, lstatSync, mkdirSync, readlinkSync, realpathSync, statSync, type BigIntStats } from "node:fs";
import { posix } from "node:path";
import { ConnectError } from "./connect.ts";
import { FileType } from "./schema.ts";
import { xattr } from "./sys.ts";
import type { User, Users } from "./users.ts";

export const META_PREFIX = "user.e2b.";

const S_IFMT = 0o170000;

/** Go's FileMode.String(): its type/special letters in Go's bit order ("dalTLDpSugct?"), then rwx bits. */
export function permissionsString(mode: number): string {
  const t = mode & S_IFMT;
  const letters: [boolean, string][] = [
    [t === 0o040000, "d"], [t === 0o120000, "L"], [t === 0o060000 || t === 0o020000, "D"], [t === 0o010000, "p"],
    [t === 0o140000, "S"], [(mode & 0o4000) !== 0, "u"], [(mode & 0o2000) !== 0, "g"], [t === 0o020000, "c"],
    [(mode & 0o1000) !== 0, "t"],
  ];
  const prefix = letters.filter(([on]) => on).map(([, c]) => c).join("");
  let rwx = "";
  for (let i = 8; i >= 0; i--) rwx += mode & (1 << i) ? "rwxrwxrwx"[8 - i] : "-";
  return (prefix || "-") + rwx;
}

export function readMetadata(path: string): Record<string, string> {
  const out: Record<string, string> = {};
  try {
    for (const name of xattr.list(path)) {
      if (name.startsWith(META_PREFIX)) out[name.slice(META_PREFIX.length)] = xattr.get(path, name);
    }
  } catch {
    // no xattr support here (or a dangling link): no metadata
  }
  return out;
}

function fileType(st: { isDirectory(): boolean; isFile(): boolean }): number {
  return st.isDirectory() ? FileType.DIRECTORY : st.isFile() ? FileType.FILE : FileType.UNSPECIFIED;
}

/** lstat-based entry; for symlinks the type and mode are the target's and symlinkTarget is fully resolved. */
export function entryInfo(path: string, users: Users, shownPath = path): Record<string, unknown> {
  let st: BigIntStats;
  try {
    st = lstatSync(path, { bigint: true });
  } catch (e) {
    if ((e as { code?: string }).code === "ENOENT") throw new ConnectError("not_found", `path '${shownPath}' does not exist`);
    throw e;
  }
  const lmode = Number(st.mode);
  let type = fileType(st);
  let mode = lmode & 0o777;
  let symlinkTarget: string | undefined;
  let metadata: Record<string, string> = {};
  if (st.isSymbolicLink()) {
    try {
      symlinkTarget = realpathSync(path);
      const t = statSync(symlinkTarget);
      type = fileType(t);
      mode = t.mode & 0o777;
      metadata = readMetadata(path);
    } catch {
      type = FileType.UNSPECIFIED; // dangling: the SDK skips such entries in listings
      try {
        symlinkTarget = posix.resolve(posix.dirname(path), readlinkSync(path));
      } catch {
        symlinkTarget = undefined;
      }
    }
  } else {
    metadata = readMetadata(path);
  }
  const ns = st.mtimeNs;
  return {
    name: posix.basename(shownPath),
    type,
    path: shownPath,
    size: Number(st.size),
    mode,
    permissions: permissionsString(lmode),
    owner: users.userName(Number(st.uid)),
    group: users.groupName(Number(st.gid)),
    modifiedTime: { seconds: Number(ns / 1_000_000_000n), nanos: Number(ns % 1_000_000_000n) },
    symlinkTarget,
    metadata,
  };
}

/** mkdir -p where every directory it creates gets 0755 and the user's ownership. */
export function ensureDirs(dir: string, user: User) {
  const missing: string[] = [];
  let cur = posix.resolve(dir);
  for (;;) {
    try {
      if (!statSync(cur).isDirectory()) throw new ConnectError("invalid_argument", `path '${cur}' is not a directory`);
      break;
    } catch (e) {
      if (e instanceof ConnectError) throw e;
      if ((e as { code?: string }).code !== "ENOENT") throw e;
      missing.push(cur);
      const up = posix.dirname(cur);
      if (up === cur) break;
      cur = up;
    }
  }
  for (const d of missing.reverse()) {
    try {
      mkdirSync(d, 0o755);
    } catch (e) {
      if ((e as { code?: string }).code !== "EEXIST") throw e;
      continue;
    }
    chownQuiet(d, user);
  }
}

export function chownQuiet(path: string, user: User) {
  try {
    chownSync(path, user.uid, user.gid);
  } catch {
    // not root: the file stays ours
  }
}
