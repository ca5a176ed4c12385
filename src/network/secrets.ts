// Node-side secrets that header rules name (`secret:NAME` → the file <dir>/NAME, dir being
// $AENV_HOME/secrets): read when a request needs one, so a changed file applies to the next request.
// A file that is not a regular file (a symlink included), is readable by group or others, is larger
// than MAX_HEADER_VALUE or holds CR, LF or NUL (past one trailing newline) is refused. Values are
// never logged: errors name the secret only.

import { lstat, readFile } from "node:fs/promises";
import { join } from "node:path";
import { NetworkError } from "./command.ts";
import { MAX_HEADER_VALUE } from "./policy.ts";

/** Secrets kept in memory (by name, checked against the file's identity on every use). */
const CACHE_ENTRIES = 1024;

export class SecretStore {
  private readonly cache = new Map<string, { stamp: string; value: string }>();

  constructor(readonly dir: string) {}

  /** The secret's value; NetworkError `BadSecret` naming it when it cannot be used. */
  async get(name: string): Promise<string> {
    const path = join(this.dir, name);
    let st;
    try {
      st = await lstat(path);
    } catch {
      throw new NetworkError("BadSecret", `secret ${name} does not exist`);
    }
    if (!st.isFile()) throw new NetworkError("BadSecret", `secret ${name} is not a regular file`);
    if (st.mode & 0o077) throw new NetworkError("BadSecret", `secret ${name} is readable by group or others (mode ${(st.mode & 0o777).toString(8)}); it must be 0600`);
    if (st.size > MAX_HEADER_VALUE + 2) throw new NetworkError("BadSecret", `secret ${name} is larger than ${MAX_HEADER_VALUE} bytes`);
    const stamp = `${st.ino}:${st.size}:${st.mtimeMs}`;
    const hit = this.cache.get(name);
    if (hit?.stamp === stamp) return hit.value;
    const value = (await readFile(path, "utf8")).replace(/\r?\n$/, "");
    if (/[\r\n\0]/.test(value)) throw new NetworkError("BadSecret", `secret ${name} holds CR, LF or NUL`);
    if (this.cache.size >= CACHE_ENTRIES) this.cache.delete(this.cache.keys().next().value!);
    this.cache.set(name, { stamp, value });
    return value;
  }
}
