// A volume's ext4 file system, worked on in user space: e2fsprogs' debugfs reads and writes it as
// data on the volume's blockd device, so an image a guest wrote is never mounted in the host
// kernel, and every path (a symlink's target too) resolves from the file system's own root. One
// debugfs process per call, each with a timeout; the caller runs one call at a time per volume
// (volumes.ts). Paths are checked and normalised here: `..` stops at the root.

import { OrchestratorError } from "./errors.ts";

/** A metadata call (stat, list, mkdir, chmod) takes milliseconds; 60 s means a stuck debugfs. */
export const FS_CALL_TIMEOUT_MS = 60_000;
/** A file's bytes in or out: a volume's whole size at ~10 MiB/s on a loaded host. */
export const FS_FILE_TIMEOUT_MS = 15 * 60_000;
/** Linux's PATH_MAX and NAME_MAX, in bytes. */
const PATH_MAX = 4096;
const NAME_MAX = 255;
/** Symlinks followed to resolve one path (Linux's bound: 40). */
const SYMLINK_HOPS_MAX = 40;
/** Entries one listing returns; past it the caller lists a deeper path or a smaller depth. */
export const LIST_ENTRIES_MAX = 10_000;
/** Entries one recursive remove deletes; past it the caller removes subdirectories first. */
export const REMOVE_ENTRIES_MAX = 100_000;
/** Commands one debugfs process reads from its stdin. */
const BATCH_COMMANDS = 1000;
/** debugfs's output kept per call: a batch of 1000 stats is ~1 MiB. */
const OUTPUT_MAX_BYTES = 64 << 20;
/** The tools' environment: no pager, untranslated messages. */
const TOOL_ENV = { PATH: "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", LC_ALL: "C", DEBUGFS_PAGER: "__none__", PAGER: "__none__" };

export type EntryType = "unknown" | "file" | "directory" | "symlink";

/** E2B's VolumeEntryStat. `mode` is the permission bits (with setuid, setgid, sticky). */
export interface VolumeEntry {
  name: string;
  type: EntryType;
  path: string;
  size: number;
  mode: number;
  uid: number;
  gid: number;
  atime: string;
  mtime: string;
  ctime: string;
  target?: string;
}

/** uid, gid and permission bits a write, mkdir or metadata update sets. */
export interface EntryMeta {
  uid?: number;
  gid?: number;
  mode?: number;
}

const badPath = (message: string) => new OrchestratorError(400, message);
const notFound = (path: string) => new OrchestratorError(404, `path ${path} not found`);

/**
 * A path in the volume, absolute and normalised: relative paths start at the root, `.` and empty
 * components go, `..` climbs but never above the root. debugfs quotes with `"` and reads a line
 * per command, so names with `"` or control characters are refused (400).
 */
export function volumePath(p: string): string {
  if (typeof p !== "string" || p === "") throw badPath("path: must not be empty");
  if (Buffer.byteLength(p) > PATH_MAX) throw badPath(`path: longer than ${PATH_MAX} bytes`);
  if (/["\u0000-\u001f\u007f]/.test(p)) throw badPath("path: names with '\"' or control characters cannot be handled");
  const out: string[] = [];
  for (const c of p.split("/")) {
    if (c === "" || c === ".") continue;
    if (c === "..") out.pop();
    else if (Buffer.byteLength(c) > NAME_MAX) throw badPath(`path: a name longer than ${NAME_MAX} bytes`);
    else out.push(c);
  }
  return "/" + out.join("/");
}

/** A debugfs argument: the path in double quotes (volumePath refused what cannot be quoted). */
const q = (p: string) => `"${p}"`;
const parentOf = (p: string) => (p.lastIndexOf("/") <= 0 ? "/" : p.slice(0, p.lastIndexOf("/")));
const baseOf = (p: string) => (p === "/" ? "/" : p.slice(p.lastIndexOf("/") + 1));
const join = (dir: string, name: string) => (dir === "/" ? `/${name}` : `${dir}/${name}`);

/** debugfs's type names: the entry's type and its mode's file-type bits (S_IFMT). */
const TYPES: Record<string, [EntryType, number]> = {
  regular: ["file", 0o100000], directory: ["directory", 0o040000], symlink: ["symlink", 0o120000], FIFO: ["unknown", 0o010000],
  "character special": ["unknown", 0o020000], "block special": ["unknown", 0o060000], socket: ["unknown", 0o140000],
};
const S_IFMT = 0o170000;
const TYPE_BITS: Record<EntryType, number> = { file: 0o100000, directory: 0o040000, symlink: 0o120000, unknown: 0 };
/** The file-type bits of each entry stat found: a metadata update keeps them. */
const typeBits = new WeakMap<VolumeEntry, number>();

/** ext4's timestamp as debugfs prints it (`0xSECONDS:EXTRA`, extra: nanoseconds << 2 | epoch bits) as RFC 3339. */
function timeOf(text: string, field: string): string {
  const m = new RegExp(`^\\s*${field}: 0x([0-9a-f]+)(?::([0-9a-f]+))?`, "m").exec(text);
  if (!m) return new Date(0).toISOString();
  const extra = m[2] ? Number.parseInt(m[2], 16) : 0;
  const seconds = (Number.parseInt(m[1]!, 16) | 0) + (extra & 3) * 2 ** 32;
  const d = new Date(seconds * 1000 + Math.floor((extra >>> 2) / 1e6));
  return Number.isNaN(d.getTime()) ? new Date(0).toISOString() : d.toISOString();
}

/** One `stat` block of debugfs's output as an entry at `path` (a fast symlink's target is in it; a slow one's comes later). */
function parseStat(path: string, block: Buffer): VolumeEntry | undefined {
  const text = block.toString("latin1");
  const head = /Type: (.+?)\s+Mode:\s+([0-7]+)/.exec(text);
  const owner = /User:\s+(\d+)\s+Group:\s+(\d+)(?:\s+Project:\s+\d+)?\s+Size:\s+(\d+)/.exec(text);
  if (!head || !owner) return undefined;
  const [type, bits] = TYPES[head[1]!.trim()] ?? ["unknown", 0];
  const entry: VolumeEntry = {
    name: baseOf(path), type, path, size: Number(owner[3]), mode: Number.parseInt(head[2]!, 8) & 0o7777,
    uid: Number(owner[1]), gid: Number(owner[2]), atime: timeOf(text, "atime"), mtime: timeOf(text, "mtime"), ctime: timeOf(text, "ctime"),
  };
  const fast = 'Fast link dest: "';
  const at = block.indexOf(fast);
  if (type === "symlink" && at >= 0) entry.target = block.subarray(at + fast.length, at + fast.length + entry.size).toString("utf8");
  typeBits.set(entry, bits);
  return entry;
}

/** The output of each command of a batch, found by the echo (`debugfs: <command>`) debugfs prints before it. */
function sections(out: Buffer, commands: string[]): Buffer[] {
  const at: { echo: number; body: number }[] = [];
  let from = 0;
  for (const c of commands) {
    const echo = `debugfs: ${c}\n`;
    const i = out.indexOf(echo, from);
    at.push(i < 0 ? { echo: -1, body: -1 } : { echo: i, body: i + Buffer.byteLength(echo) });
    if (i >= 0) from = i + Buffer.byteLength(echo);
  }
  // Each section ends where the next echo found begins.
  const parts: Buffer[] = new Array(at.length);
  let end = out.length;
  for (let i = at.length - 1; i >= 0; i--) {
    parts[i] = at[i]!.body < 0 ? Buffer.alloc(0) : out.subarray(at[i]!.body, end);
    if (at[i]!.echo >= 0) end = at[i]!.echo;
  }
  return parts;
}

interface Ran {
  out: Buffer;
  /** debugfs's complaints (its version banner left out), one per line. */
  errors: string[];
}

/** debugfs on `device` with `commands` on its stdin (`write`: read-write). */
async function debugfs(device: string, commands: string[], write: boolean, timeoutMs = FS_CALL_TIMEOUT_MS): Promise<Ran> {
  const deadline = AbortSignal.timeout(timeoutMs);
  const p = Bun.spawn(["debugfs", ...(write ? ["-w"] : []), "-f", "-", device], {
    stdin: Buffer.from(commands.join("\n") + "\n"), stdout: "pipe", stderr: "pipe", env: TOOL_ENV,
    signal: deadline, killSignal: "SIGKILL", maxBuffer: OUTPUT_MAX_BYTES,
  });
  const [out, err] = await Promise.all([new Response(p.stdout).arrayBuffer(), new Response(p.stderr).text(), p.exited]);
  if (p.exitCode === null) {
    throw new OrchestratorError(500, deadline.aborted ? `debugfs did not finish within ${timeoutMs} ms (killed)` : `debugfs was killed by ${p.signalCode} (output over ${OUTPUT_MAX_BYTES} bytes?)`);
  }
  const errors = err.split("\n").map((l) => l.trim()).filter((l) => l && !/^debugfs \d/.test(l));
  // A file system debugfs could not open answers every command with "Filesystem not open" (and exits 0).
  const unopened = errors.find((l) => /while trying to open|Filesystem not open/.test(l));
  if (unopened) throw new OrchestratorError(500, `debugfs could not open the volume: ${unopened}`);
  return { out: Buffer.from(out), errors };
}

/** A failed change: 507 when the file system is full, else 500 with what debugfs said. */
function changeFailed(what: string, errors: string[]): OrchestratorError {
  const text = errors.join("; ").slice(0, 2000);
  if (/Could not allocate|No free space|out of space|No space/i.test(text)) return new OrchestratorError(507, `${what}: the volume is full (${text})`);
  return new OrchestratorError(500, `${what}: ${text}`);
}

/** The ext4 file system on one volume device. */
export class VolumeFs {
  constructor(readonly device: string) {}

  /**
   * Replays the journal a guest left (an unclean stop leaves committed transactions unapplied):
   * e2fsck's journal replay only, nothing else checked or asked. Exit 0 or 1 (replayed) is done.
   */
  async replayJournal(): Promise<void> {
    const deadline = AbortSignal.timeout(FS_CALL_TIMEOUT_MS);
    const p = Bun.spawn(["e2fsck", "-E", "journal_only", "-p", this.device], { stdin: "ignore", stdout: "pipe", stderr: "pipe", env: TOOL_ENV, signal: deadline, killSignal: "SIGKILL", maxBuffer: 1 << 20 });
    const [out, err] = await Promise.all([new Response(p.stdout).text(), new Response(p.stderr).text(), p.exited]);
    if (p.exitCode === 0 || p.exitCode === 1) return;
    throw new OrchestratorError(500, `the volume's journal could not be replayed (e2fsck ${p.exitCode ?? `killed by ${p.signalCode}`}): ${(out + err).trim().slice(-1000)}`);
  }

  /** The entry at `path` (normalised), itself if a symlink; undefined when there is none. */
  async stat(path: string): Promise<VolumeEntry | undefined> {
    return (await this.statMany([path]))[0];
  }

  /** Entries at `paths`, in order (undefined where none is), a batch per debugfs process. */
  async statMany(paths: string[]): Promise<(VolumeEntry | undefined)[]> {
    const out: (VolumeEntry | undefined)[] = [];
    for (let i = 0; i < paths.length; i += BATCH_COMMANDS) {
      const chunk = paths.slice(i, i + BATCH_COMMANDS);
      const cmds = chunk.map((p) => `stat ${q(p)}`);
      const ran = await debugfs(this.device, cmds, false);
      const blocks = sections(ran.out, cmds);
      const entries = chunk.map((p, j) => parseStat(p, blocks[j]!));
      // A slow symlink keeps its target in a data block: read with cat, `size` bytes each.
      const slow = entries.filter((e): e is VolumeEntry => e?.type === "symlink" && e.target === undefined);
      if (slow.length) {
        const cats = slow.map((e) => `cat ${q(e.path)}`);
        const got = sections((await debugfs(this.device, cats, false)).out, cats);
        slow.forEach((e, k) => (e.target = got[k]!.subarray(0, e.size).toString("utf8")));
      }
      out.push(...entries);
    }
    return out;
  }

  /**
   * `path` with its symlinks followed inside the file system (at most SYMLINK_HOPS_MAX): the
   * entry it names, or undefined (a dangling link). debugfs follows symlinks of the path's
   * directories itself, from this file system's root; the last name is followed here.
   */
  async resolve(path: string): Promise<VolumeEntry | undefined> {
    let p = path;
    for (let hops = 0; hops <= SYMLINK_HOPS_MAX; hops++) {
      const e = await this.stat(p);
      if (e?.type !== "symlink") return e;
      if (!e.target) return undefined;
      p = volumePath(e.target.startsWith("/") ? e.target : `${parentOf(p)}/${e.target}`);
    }
    throw new OrchestratorError(400, `path ${path}: more than ${SYMLINK_HOPS_MAX} symlinks`);
  }

  /** The names in the directories `dirs` (no `.` or `..`; names debugfs cannot quote are left out), with their types. */
  private async names(dirs: string[]): Promise<{ dir: string; name: string; type: EntryType }[][]> {
    const out: { dir: string; name: string; type: EntryType }[][] = [];
    for (let i = 0; i < dirs.length; i += BATCH_COMMANDS) {
      const chunk = dirs.slice(i, i + BATCH_COMMANDS);
      const cmds = chunk.map((d) => `ls -p ${q(d)}`);
      const blocks = sections((await debugfs(this.device, cmds, false)).out, cmds);
      chunk.forEach((dir, j) => {
        const listed: { dir: string; name: string; type: EntryType }[] = [];
        // `/inode/mode/uid/gid/name/size/`: the name is what lies between the fourth field and the last two.
        for (const line of blocks[j]!.toString("utf8").split("\n")) {
          const parts = line.split("/");
          if (parts.length < 8 || parts[0] !== "" || parts.at(-1) !== "") continue;
          const name = parts.slice(5, -2).join("/");
          if (name === "." || name === ".." || name === "" || name.includes("/")) continue;
          try {
            if (volumePath(name) !== `/${name}`) continue;
          } catch {
            continue;
          }
          const mode = Number.parseInt(parts[2]!, 8);
          const type = (Object.entries(TYPE_BITS).find(([t, bits]) => t !== "unknown" && (mode & S_IFMT) === bits)?.[0] ?? "unknown") as EntryType;
          listed.push({ dir, name, type });
        }
        out.push(listed);
      });
    }
    return out;
  }

  /** The entries under directory `path` (its symlink followed), `depth` levels deep, parents before children. */
  async list(path: string, depth: number): Promise<VolumeEntry[]> {
    const root = await this.resolve(path);
    if (!root) throw notFound(path);
    if (root.type !== "directory") throw badPath(`path ${path} is not a directory`);
    const found: string[] = [];
    let level = [root.path];
    for (let d = 0; d < depth && level.length; d++) {
      const next: string[] = [];
      for (const names of await this.names(level)) {
        for (const n of names) {
          const p = join(n.dir, n.name);
          found.push(p);
          if (n.type === "directory") next.push(p);
        }
      }
      if (found.length > LIST_ENTRIES_MAX) throw badPath(`path ${path}: more than ${LIST_ENTRIES_MAX} entries; list a deeper path or with a smaller depth`);
      level = next;
    }
    // An entry gone between the listing and its stat cannot be: the caller holds the volume.
    const stats = await this.statMany(found);
    // Paths under the one asked for: a symlinked directory's entries keep the caller's prefix.
    const shown = (p: string) => {
      const rel = root.path === "/" ? p : p.slice(root.path.length);
      return path === "/" ? rel : `${path}${rel}`;
    };
    return stats.filter((e): e is VolumeEntry => e !== undefined).map((e) => ({ ...e, path: shown(e.path) }));
  }

  /** The file at `path` (symlinks followed): its size and a stream of its bytes (debugfs cat). */
  async read(path: string, signal?: AbortSignal): Promise<{ size: number; stream: ReadableStream<Uint8Array>; done: Promise<void> }> {
    const e = await this.resolve(path);
    if (!e) throw notFound(path);
    if (e.type !== "file") throw badPath(`path ${path} is not a file`);
    const deadline = AbortSignal.timeout(FS_FILE_TIMEOUT_MS);
    const p = Bun.spawn(["debugfs", "-R", `cat ${q(e.path)}`, this.device], {
      stdin: "ignore", stdout: "pipe", stderr: "pipe", env: TOOL_ENV, killSignal: "SIGKILL",
      signal: signal ? AbortSignal.any([deadline, signal]) : deadline,
    });
    const err = new Response(p.stderr).text();
    // The stream fails (the client sees a cut transfer) unless all `size` bytes arrived.
    let sent = 0;
    const counted = p.stdout.pipeThrough(new TransformStream<Uint8Array, Uint8Array>({
      transform(chunk, c) {
        sent += chunk.byteLength;
        c.enqueue(chunk);
      },
      async flush(c) {
        await p.exited;
        if (sent !== e.size) c.error(new Error(`volume read of ${path}: ${sent} of ${e.size} bytes (${(await err).trim().slice(-500)})`));
      },
    }));
    const done = p.exited.then(() => {});
    return { size: e.size, stream: counted, done };
  }

  /**
   * Writes the local file `from` at `path`, replacing a file or symlink there (a directory: 409).
   * The parent must be a directory (its symlinks followed); `makeParents` makes missing ones.
   */
  async write(path: string, from: string, meta: EntryMeta, makeParents: boolean): Promise<VolumeEntry> {
    if (path === "/") throw badPath("path: the volume's root is a directory");
    if (/["\u0000-\u001f\u007f]/.test(from)) throw new OrchestratorError(500, `the upload's file ${JSON.stringify(from)} cannot be quoted for debugfs`);
    const dir = await this.directory(parentOf(path), makeParents, meta);
    const target = join(dir, baseOf(path));
    const old = await this.stat(target);
    if (old?.type === "directory") throw new OrchestratorError(409, `path ${path} is a directory`);
    const cmds = [...(old ? [`rm ${q(target)}`] : []), `write ${q(from)} ${q(target)}`, ...this.setMeta(target, TYPE_BITS.file, { mode: meta.mode ?? 0o644, uid: meta.uid ?? 0, gid: meta.gid ?? 0 })];
    const ran = await debugfs(this.device, cmds, true, FS_FILE_TIMEOUT_MS);
    if (ran.errors.length) {
      // A write cut short (the volume full) leaves no partial file behind.
      await debugfs(this.device, [`rm ${q(target)}`], true).catch(() => {});
      throw changeFailed(`writing ${path}`, ran.errors);
    }
    return this.statOrFail(target, path);
  }

  /** A directory at `path`: with `makeParents` its missing parents too (an existing directory is then its answer), else 409 when it exists. */
  async mkdir(path: string, meta: EntryMeta, makeParents: boolean): Promise<VolumeEntry> {
    const existing = await this.resolve(path);
    if (existing) {
      if (makeParents && existing.type === "directory") return { ...existing, path, name: baseOf(path) };
      throw new OrchestratorError(409, `path ${path} exists`);
    }
    const dir = await this.directory(parentOf(path), makeParents, meta);
    const target = join(dir, baseOf(path));
    const ran = await debugfs(this.device, [`mkdir ${q(target)}`, ...this.setMeta(target, TYPE_BITS.directory, { mode: meta.mode ?? 0o755, uid: meta.uid ?? 0, gid: meta.gid ?? 0 })], true);
    if (ran.errors.length) throw changeFailed(`making directory ${path}`, ran.errors);
    return this.statOrFail(target, path);
  }

  /** uid, gid, permission bits of the entry at `path` (a symlink itself). */
  async update(path: string, meta: EntryMeta): Promise<VolumeEntry> {
    const e = await this.stat(path);
    if (!e) throw notFound(path);
    const cmds = this.setMeta(path, typeBits.get(e) ?? TYPE_BITS[e.type], meta);
    if (cmds.length) {
      const ran = await debugfs(this.device, cmds, true);
      if (ran.errors.length) throw changeFailed(`updating ${path}`, ran.errors);
    }
    return this.statOrFail(path, path);
  }

  /** Removes the entry at `path` (a symlink itself); a directory with everything under it. */
  async remove(path: string): Promise<void> {
    if (path === "/") throw badPath("path: the volume's root cannot be removed");
    const e = await this.stat(path);
    if (!e) throw notFound(path);
    if (e.type !== "directory") {
      const ran = await debugfs(this.device, [`rm ${q(path)}`], true);
      if (ran.errors.length) throw changeFailed(`removing ${path}`, ran.errors);
      return;
    }
    const files: string[] = [];
    const dirs: string[][] = [[path]];
    for (let level = [path]; level.length; ) {
      const next: string[] = [];
      for (const names of await this.names(level)) {
        for (const n of names) (n.type === "directory" ? next : files).push(join(n.dir, n.name));
      }
      if (files.length + dirs.flat().length + next.length > REMOVE_ENTRIES_MAX) throw badPath(`path ${path}: more than ${REMOVE_ENTRIES_MAX} entries; remove its subdirectories first`);
      if (next.length) dirs.push(next);
      level = next;
    }
    // Files first, then directories deepest level first: each rmdir finds its directory empty.
    const cmds = [...files.map((f) => `rm ${q(f)}`), ...dirs.reverse().flat().map((d) => `rmdir ${q(d)}`)];
    for (let i = 0; i < cmds.length; i += BATCH_COMMANDS) {
      const ran = await debugfs(this.device, cmds.slice(i, i + BATCH_COMMANDS), true, FS_FILE_TIMEOUT_MS);
      if (ran.errors.length) throw changeFailed(`removing ${path}`, ran.errors);
    }
  }

  /** The directory `dir` names (symlinks followed), made with its parents when `make` and missing. */
  private async directory(dir: string, make: boolean, meta: EntryMeta): Promise<string> {
    const e = await this.resolve(dir);
    if (e?.type === "directory") return e.path;
    if (e) throw badPath(`path ${dir} is not a directory`);
    if (!make) throw notFound(dir);
    const parent = await this.directory(parentOf(dir), true, meta);
    const made = join(parent, baseOf(dir));
    const ran = await debugfs(this.device, [`mkdir ${q(made)}`, ...this.setMeta(made, TYPE_BITS.directory, { mode: 0o755, uid: meta.uid ?? 0, gid: meta.gid ?? 0 })], true);
    if (ran.errors.length) throw changeFailed(`making directory ${dir}`, ran.errors);
    return made;
  }

  /** debugfs's set_inode_field commands for `meta` on an entry whose file-type bits are `bits` (kept). */
  private setMeta(path: string, bits: number, meta: EntryMeta): string[] {
    const cmds: string[] = [];
    if (meta.mode !== undefined) cmds.push(`sif ${q(path)} mode 0${(bits | (meta.mode & 0o7777)).toString(8)}`);
    if (meta.uid !== undefined) cmds.push(`sif ${q(path)} uid ${meta.uid}`);
    if (meta.gid !== undefined) cmds.push(`sif ${q(path)} gid ${meta.gid}`);
    return cmds;
  }

  /** The entry just made or changed at `at`, answered under the caller's `path`. */
  private async statOrFail(at: string, path: string): Promise<VolumeEntry> {
    const e = await this.stat(at);
    if (!e) throw new OrchestratorError(500, `path ${path} is missing right after it was written`);
    return { ...e, path, name: baseOf(path) };
  }
}
