// Users from /etc/passwd and /etc/group (re-read when they change, since images add users at run
// time), plus E2B's path resolution rules relative to a user's home.
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

export class Users {
  private passwd: Table<User>;
  private groups: Table<{ name: string; gid: number; members: string[] }>;

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
  }

  lookup(name: string): User | undefined {
    return this.passwd.all().find((u) => u.name === name);
  }

  userName(uid: number): string {
    return this.passwd.all().find((u) => u.uid === uid)?.name ?? String(uid);
  }

  groupName(gid: number): string {
    return this.groups.all().find((g) => g.gid === gid)?.name ?? String(gid);
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
