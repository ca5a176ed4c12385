// Files written whole or not at all: the bytes go to a temp file beside the target, which takes the
// target's place (rename) only once every byte is in and checked; any failure removes the temp file.
import { randomBytes } from "node:crypto";
import { copyFile, lstat, open, readlink, rename, stat, unlink, type FileHandle } from "node:fs/promises";
import { posix } from "node:path";
import type { Stats } from "node:fs";
import { ConnectError } from "./connect.ts";
import { ensureDirs } from "./entry.ts";
import { xattr } from "./sys.ts";
import type { User } from "./users.ts";

/**
 * Temp file names: the prefix says whether the target existed when the write began, so that a
 * watcher (watch.ts) reports the rename as the target's own events (created and written, or
 * written), as an in-place write would have been reported.
 */
export const STAGED_NEW = ".envd-new.";
export const STAGED_REPLACE = ".envd-replace.";

export function stagedKind(name: string): "new" | "replace" | undefined {
  const base = name.slice(name.lastIndexOf("/") + 1);
  return base.startsWith(STAGED_NEW) ? "new" : base.startsWith(STAGED_REPLACE) ? "replace" : undefined;
}

/** Symlinks the kernel follows in one path lookup before ELOOP. */
const MAX_LINK_HOPS = 40;

async function statOrNull(path: string): Promise<Stats | null> {
  try {
    return await stat(path);
  } catch (e) {
    if ((e as { code?: string }).code === "ENOENT") return null;
    throw e;
  }
}

/** Where a write to `path` lands: its symlinks followed (a dangling one to the file it names). */
async function writeTarget(path: string): Promise<string> {
  let p = path;
  for (let hops = 0; hops <= MAX_LINK_HOPS; hops++) {
    try {
      if (!(await lstat(p)).isSymbolicLink()) return p;
    } catch (e) {
      if ((e as { code?: string }).code === "ENOENT") return p;
      throw e;
    }
    p = posix.resolve(posix.dirname(p), await readlink(p));
  }
  throw new ConnectError("invalid_argument", `path '${path}': too many levels of symbolic links`);
}

/**
 * A target file being written: `write` the bytes, `finish` when they are all there (the fd is
 * closed, so a request staging many files holds none open), then `commit` (the target changes only
 * there) or `discard`.
 */
export class StagedFile {
  private state: "writing" | "finished" | "committed" | "discarded" = "writing";

  private constructor(
    /** The path as asked for (what answers report). */
    readonly path: string,
    /** The file that is replaced: `path` with its symlinks followed. */
    readonly target: string,
    private readonly temp: string,
    private readonly fh: FileHandle,
    private readonly user: User,
  ) {}

  /** Refuses directories and non-regular files (a FIFO or device never ends), creates missing parents. */
  static async create(path: string, user: User): Promise<StagedFile> {
    const target = await writeTarget(path);
    const st = await statOrNull(target);
    if (st) assertRegular(path, st);
    const dir = posix.dirname(target);
    ensureDirs(dir, user);
    const temp = `${dir}/${st ? STAGED_REPLACE : STAGED_NEW}${randomBytes(8).toString("hex")}`;
    const fh = await open(temp, "wx", 0o666); // 0666 & umask, as a new file gets
    return new StagedFile(path, target, temp, fh, user);
  }

  async write(chunk: Uint8Array): Promise<void> {
    for (let off = 0; off < chunk.length; ) off += (await this.fh.write(chunk, off, chunk.length - off)).bytesWritten;
  }

  /**
   * Gives the temp file the target's owner and mode as they are now (a new file: the user's, 0644),
   * through the fd (a name in the user's directory can be swapped under us, the fd cannot), and
   * closes it.
   */
  async finish(): Promise<void> {
    if (this.state !== "writing") return;
    try {
      const old = await statOrNull(this.target);
      if (old) assertRegular(this.path, old);
      await this.fh.chown(old ? old.uid : this.user.uid, old ? old.gid : this.user.gid).catch(() => {}); // not root: stays ours
      if (old) await this.fh.chmod(old.mode & 0o7777); // after chown, which clears set-id bits
      await this.fh.close();
      this.state = "finished";
    } catch (e) {
      await this.discard();
      throw e;
    }
  }

  /**
   * Copies the target's user xattrs onto the temp file, runs `prepare` on it, and renames it over
   * the target. A target that is a mount point cannot be renamed over: the checked bytes are copied
   * into it instead.
   */
  async commit(prepare?: (path: string) => void): Promise<void> {
    await this.finish();
    if (this.state !== "finished") throw new Error(`commit of a ${this.state} staged file`);
    try {
      copyUserXattrs(this.target, this.temp);
      prepare?.(this.temp);
      try {
        await rename(this.temp, this.target);
      } catch (e) {
        const code = (e as { code?: string }).code;
        if (code !== "EBUSY" && code !== "EXDEV") throw e;
        await copyFile(this.temp, this.target);
        prepare?.(this.target);
        await unlink(this.temp);
      }
      this.state = "committed";
    } catch (e) {
      await this.discard();
      throw e;
    }
  }

  /** Removes the temp file; the target is untouched. Idempotent, and a no-op once committed. */
  async discard(): Promise<void> {
    if (this.state === "committed" || this.state === "discarded") return;
    if (this.state === "writing") await this.fh.close().catch(() => {});
    this.state = "discarded";
    await unlink(this.temp).catch(() => {});
  }
}

function assertRegular(path: string, st: Stats) {
  if (st.isDirectory()) throw new ConnectError("invalid_argument", `path '${path}' is a directory`);
  if (!st.isFile()) throw new ConnectError("invalid_argument", `path '${path}' is not a regular file`);
}

/**
 * The `user.*` xattrs of `from` onto `to`, best effort (an upload then replaces envd's own
 * `user.e2b.*` set). Other namespaces are not copied: security.* (file capabilities) must not
 * move onto a file the user may have swapped in.
 */
function copyUserXattrs(from: string, to: string) {
  let names: string[];
  try {
    names = xattr.list(from);
  } catch {
    return; // no xattr support here
  }
  for (const name of names) {
    if (!name.startsWith("user.")) continue;
    try {
      xattr.set(to, name, xattr.get(from, name));
    } catch {
      // gone meanwhile, or a file system that refuses it
    }
  }
}
