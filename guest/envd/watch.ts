// Directory watching on raw inotify (fsnotify semantics: one event per op, names relative to the
// watched root, new subdirectories picked up by recursive watches). The inotify fd is read through
// Bun.file(fd).stream(), which polls it on Bun's event loop instead of blocking a thread.
import { readdir, readFile } from "node:fs/promises";
import { EventType } from "./schema.ts";
import { stagedKind } from "./staging.ts";
import { inotify } from "./sys.ts";

const IN_MODIFY = 0x2;
const IN_ATTRIB = 0x4;
const IN_MOVED_FROM = 0x40;
const IN_MOVED_TO = 0x80;
const IN_CREATE = 0x100;
const IN_DELETE = 0x200;
const IN_DELETE_SELF = 0x400;
const IN_MOVE_SELF = 0x800;
const IN_IGNORED = 0x8000;
const IN_ISDIR = 0x40000000;
const MASK = IN_MODIFY | IN_ATTRIB | IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE | IN_DELETE | IN_DELETE_SELF | IN_MOVE_SELF;

export interface WatchEvent {
  name: string;
  type: number;
}

/** Renames of staged uploads whose other half has not arrived yet; a burst of uploads is far fewer. */
const MAX_PENDING_MOVES = 1024;

export class DirWatcher {
  private fd = -1;
  private dirs = new Map<number, string>(); // watch descriptor → directory relative to root
  /** Move cookie → the kind of a staged upload (staging.ts) moved away under it. */
  private stagedMoves = new Map<number, "new" | "replace">();
  private stopReading?: () => Promise<void>;
  private closed = false;

  constructor(
    private root: string,
    private recursive: boolean,
    private onEvent: (ev: WatchEvent) => void,
  ) {}

  /** Arms the watches (the whole tree when recursive), so events after this resolves are not missed. */
  async start() {
    this.fd = inotify.init();
    try {
      await this.addTree("");
    } catch (e) {
      inotify.close(this.fd);
      this.closed = true;
      throw e;
    }
    void this.loop();
  }

  /**
   * Watch rel and, when recursive, every directory under it. announce: rel is a directory that
   * just appeared, so what is already in it was created before its watch existed (e.g.
   * `mkdir sub && echo > sub/f`): report those entries as created, or nobody ever would.
   * The directory is read asynchronously: a large tree never stalls envd's other requests.
   */
  private async addTree(rel: string, announce = false): Promise<void> {
    if (this.closed) return;
    const wd = inotify.add(this.fd, rel ? `${this.root}/${rel}` : this.root, MASK);
    this.dirs.set(wd, rel);
    if (!this.recursive) return;
    let entries: import("node:fs").Dirent[] = [];
    try {
      entries = await readdir(rel ? `${this.root}/${rel}` : this.root, { withFileTypes: true });
    } catch {
      return; // unreadable subdirectory: watch what we can
    }
    for (const d of entries) {
      if (stagedKind(d.name)) continue; // an upload in flight shows up when it lands
      const child = rel ? `${rel}/${d.name}` : d.name;
      if (announce && !this.closed) this.onEvent({ name: child, type: EventType.CREATE });
      if (!d.isDirectory()) continue;
      try {
        await this.addTree(child, announce);
      } catch {
        // vanished or unreadable meanwhile
      }
    }
  }

  private async loop() {
    const reader = Bun.file(this.fd).stream().getReader();
    this.stopReading = () => reader.cancel();
    let carry = new Uint8Array(0);
    try {
      while (!this.closed) {
        const { done, value } = await reader.read();
        if (done || this.closed) break;
        let buf = value;
        if (carry.length) {
          buf = new Uint8Array(carry.length + value.length);
          buf.set(carry);
          buf.set(value, carry.length);
        }
        const used = this.parse(buf);
        carry = buf.slice(used);
      }
    } catch {
      // the fd was closed under us
    }
  }

  private parse(buf: Uint8Array): number {
    const dv = new DataView(buf.buffer, buf.byteOffset, buf.byteLength);
    let off = 0;
    while (off + 16 <= buf.length) {
      const wd = dv.getInt32(off, true);
      const mask = dv.getUint32(off + 4, true);
      const cookie = dv.getUint32(off + 8, true);
      const len = dv.getUint32(off + 12, true);
      if (off + 16 + len > buf.length) break;
      const raw = buf.subarray(off + 16, off + 16 + len);
      const nul = raw.indexOf(0);
      const name = Buffer.from(nul < 0 ? raw : raw.subarray(0, nul)).toString("utf8");
      off += 16 + len;
      this.handle(wd, mask, cookie, name);
    }
    return off;
  }

  private handle(wd: number, mask: number, cookie: number, name: string) {
    if (mask & IN_IGNORED) {
      this.dirs.delete(wd);
      return;
    }
    const dir = this.dirs.get(wd);
    if (dir === undefined || !name) return; // self events are reported by the parent directory
    const rel = dir ? `${dir}/${name}` : name;
    // A staged upload is envd's own temp file: its events are internal, and its rename onto the
    // target reads as the in-place write it stands for (created and written, or written).
    const staged = stagedKind(name);
    if (staged) {
      if (mask & IN_MOVED_FROM) {
        this.stagedMoves.set(cookie, staged);
        if (this.stagedMoves.size > MAX_PENDING_MOVES) this.stagedMoves.delete(this.stagedMoves.keys().next().value!);
      }
      return;
    }
    const upload = mask & IN_MOVED_TO ? this.stagedMoves.get(cookie) : undefined;
    if (upload) {
      this.stagedMoves.delete(cookie);
      if (upload === "new" && !this.closed) this.onEvent({ name: rel, type: EventType.CREATE });
      if (!this.closed) this.onEvent({ name: rel, type: EventType.WRITE });
      return;
    }
    // fsnotify's op order within one event: create, rename, chmod, write, remove.
    const ops: [number, number][] = [
      [IN_CREATE | IN_MOVED_TO, EventType.CREATE],
      [IN_MOVED_FROM, EventType.RENAME],
      [IN_ATTRIB, EventType.CHMOD],
      [IN_MODIFY, EventType.WRITE],
      [IN_DELETE, EventType.REMOVE],
    ];
    for (const [bits, type] of ops) {
      if (mask & bits && !this.closed) this.onEvent({ name: rel, type });
    }
    // After the directory's own event, so its contents are reported after it, as they were made.
    if (this.recursive && mask & IN_ISDIR && mask & (IN_CREATE | IN_MOVED_TO)) {
      this.addTree(rel, true).catch(() => {}); // already gone again
    }
  }

  close() {
    if (this.closed) return;
    this.closed = true;
    const fd = this.fd;
    const done = this.stopReading ? this.stopReading().catch(() => {}) : Promise.resolve();
    void done.then(() => inotify.close(fd)); // close only after Bun stopped polling it
  }
}

const NETWORK_FS = /^(nfs4?|cifs|smb3?|smbfs|fuse(\..*)?|fuseblk|9p|ceph|glusterfs|sshfs)$/;

/** Whether `path` lives on a network or FUSE mount (per /proc/self/mountinfo, longest prefix wins). */
export async function isNetworkMount(path: string): Promise<boolean> {
  let best = "";
  let bestType = "";
  let text = "";
  try {
    text = await readFile("/proc/self/mountinfo", "utf8");
  } catch {
    return false;
  }
  for (const line of text.split("\n")) {
    const [left, right] = line.split(" - ");
    if (!left || !right) continue;
    const mountPoint = left.split(" ")[4]?.replace(/\\([0-7]{3})/g, (_, o: string) => String.fromCharCode(parseInt(o, 8)));
    if (!mountPoint) continue;
    const inside = mountPoint === "/" || path === mountPoint || path.startsWith(`${mountPoint}/`);
    if (inside && mountPoint.length >= best.length) {
      best = mountPoint;
      bestType = right.split(" ")[0] ?? "";
    }
  }
  return NETWORK_FS.test(bestType);
}
