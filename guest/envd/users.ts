// Users from /etc/passwd and /etc/group (re-read when they change, since images add users at run
// time), the accounts envd supplies where the image's passwd lacks them, plus E2B's path
// resolution rules relative to a user's home.
import { readFile, stat } from "node:fs/promises";
import { posix } from "node:path";
import { ConnectError } from "./connect.ts";

export interface User {
  name: string;
  uid: number;
  gid: number;
  home: string;
  shell: string;
}

/** One colon-separated database; `refresh` re-reads it (off the event loop) when its mtime moved. */
class Table<T> {
  private mtime = -1;
  private rows: T[] = [];
  constructor(private path: string, private parse: (cols: string[]) => T | undefined) {}

  async refresh() {
    let m: number;
    try {
      m = (await stat(this.path)).mtimeMs;
    } catch {
      this.mtime = -1;
      this.rows = [];
      return;
    }
    if (m === this.mtime) return;
    let text: string;
    try {
      text = await readFile(this.path, "utf8");
    } catch {
      return; // replaced under us: the next refresh sees the new file
    }
    const rows: T[] = [];
    for (const line of text.split("\n")) {
      if (!line || line.startsWith("#")) continue;
      const row = this.parse(line.split(":"));
      if (row) rows.push(row);
    }
    this.mtime = m;
    this.rows = rows;
  }

  all(): T[] {
    return this.rows;
  }
}

/** The SDK's default user (E2B's images have it at uid 1000) and root: supplied when the image's passwd lacks them. */
const SUPPLIED_HOME = { root: "/root", user: "/home/user" } as const;
/** A supplied `user` takes the first id from here that is neither a uid in passwd nor a gid in group. */
const SUPPLIED_FIRST_ID = 1000;

export class Users {
  private passwd: Table<User>;
  private groups: Table<{ name: string; gid: number; members: string[] }>;
  private suppliedRows: User[] = [];

  constructor(passwdPath = "/etc/passwd", groupPath = "/etc/group") {
    this.passwd = new Table(passwdPath, (c) =>
      c.length >= 7 && /^\d+$/.test(c[2]!) && /^\d+$/.test(c[3]!)
        ? { name: c[0]!, uid: Number(c[2]), gid: Number(c[3]), home: c[5] || "/", shell: c[6] || "/bin/sh" }
        : undefined,
    );
    this.groups = new Table(groupPath, (c) =>
      c.length >= 3 && /^\d+$/.test(c[2]!) ? { name: c[0]!, gid: Number(c[2]), members: (c[3] ?? "").split(",").filter(Boolean) } : undefined,
    );
  }

  /** Re-reads both files where they changed; lookups answer from what the last refresh read. */
  async refresh() {
    await Promise.all([this.passwd.refresh(), this.groups.refresh()]);
    this.suppliedRows = this.supply();
  }

  /**
   * root (0:0, /root) and user (1000:1000 unless taken, /home/user) where the image's passwd has
   * no such name: E2B's SDK runs as one or the other. They live in envd only; /etc/passwd is
   * never written, so tools in the image that read it (whoami, ls -l) show the bare ids.
   */
  private supply(): User[] {
    const rows = this.passwd.all();
    const out: User[] = [];
    if (!rows.some((u) => u.name === "root")) out.push({ name: "root", uid: 0, gid: 0, home: SUPPLIED_HOME.root, shell: "/bin/sh" });
    if (!rows.some((u) => u.name === "user")) {
      const uids = new Set(rows.map((u) => u.uid));
      const gids = new Set(this.groups.all().map((g) => g.gid));
      let id = SUPPLIED_FIRST_ID;
      while (uids.has(id) || gids.has(id)) id++;
      out.push({ name: "user", uid: id, gid: id, home: SUPPLIED_HOME.user, shell: "/bin/sh" });
    }
    return out;
  }

  /** The accounts envd supplies now (none when the image has both). */
  supplied(): readonly User[] {
    return this.suppliedRows;
  }

  lookup(name: string): User | undefined {
    return this.passwd.all().find((u) => u.name === name) ?? this.suppliedRows.find((u) => u.name === name);
  }

  userName(uid: number): string {
    return (this.passwd.all().find((u) => u.uid === uid) ?? this.suppliedRows.find((u) => u.uid === uid))?.name ?? String(uid);
  }

  groupName(gid: number): string {
    return (this.groups.all().find((g) => g.gid === gid) ?? this.suppliedRows.find((u) => u.gid === gid))?.name ?? String(gid);
  }

  /** What initgroups(3) gives the user: the primary gid, then every group listing them, in order, once. */
  groupsOf(user: User): number[] {
    const out = [user.gid];
    for (const g of this.groups.all()) if (g.members.includes(user.name) && !out.includes(g.gid)) out.push(g.gid);
    return out;
  }
}

/** E2B path rules: "" → default workdir, "~" → home, relative → under home (not the workdir). */
export function resolvePath(p: string, user: User, defaultWorkdir?: string): string {
  if (p.includes("\0")) throw new ConnectError("invalid_argument", "path must not contain NUL bytes");
  if (p === "" && defaultWorkdir) return posix.resolve(defaultWorkdir);
  if (p === "~" || p.startsWith("~/")) return posix.resolve(user.home, p.slice(2));
  if (p.startsWith("~")) throw new ConnectError("invalid_argument", `path '${p}' refers to another user's home, which is not supported`);
  return posix.resolve(user.home, p);
}
