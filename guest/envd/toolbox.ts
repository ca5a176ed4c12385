// What envd supplies where the user's image lacks what E2B's SDK assumes: a shell at /bin/bash and
// /bin/sh (the tools disk's busybox sh), the tools disk's applets last on PATH, homes for the
// accounts users.ts supplies, and a root-only sudo. Nothing is written into the image's files:
// the shell is swapped in envd's argv, the accounts live in envd, the homes are made in the
// sandbox's own writable layer, and the report goes to envd's log, the console and /run (tmpfs).
import { accessSync } from "node:fs";
import { access, appendFile, chown, constants, mkdir, stat, writeFile } from "node:fs/promises";
import { dirname, join } from "node:path";
import type { User, Users } from "./users.ts";

/** The SDK starts commands as `/bin/bash -l -c CMD` and PTYs as `/bin/bash -i -l`; scripts and tools assume /bin/sh. */
const SHELLS = ["/bin/bash", "/bin/sh"];
/** Where an image keeps sudo (a command's own PATH may be anything; these are where packages put it). */
const SUDO_PATHS = ["/usr/local/sbin/sudo", "/usr/local/bin/sudo", "/usr/sbin/sudo", "/usr/bin/sudo", "/sbin/sudo", "/bin/sudo"];
/** One line per thing supplied, rewritten at start and on each /init (guest mode): the node's template build copies it into its log. */
export const SUPPLIED_REPORT = "/run/aenv/supplied";
/** A supplied account's home: only its owner enters (useradd's default on Debian 12). */
const HOME_MODE = 0o700;

async function executable(path: string): Promise<boolean> {
  return access(path, constants.X_OK).then(() => true, () => false);
}

export class Toolbox {
  /** Homes already made (or found), so each is looked at once per envd. */
  private readonly homesSeen = new Set<string>();
  /** Shells already reported as swapped, so envd's log says it once each. */
  private readonly swapped = new Set<string>();
  /** The last report written (undefined: none yet, so the first is always written). */
  private lastReport: string | undefined;
  /** The toolbox is used only when it holds a shell (looked at once, at start). */
  readonly active: boolean;

  /**
   * `dir`: the tools disk's bin (busybox applets, util-linux setpriv, sudo). `guest`: homes are
   * made and the report goes to the console and SUPPLIED_REPORT.
   */
  constructor(readonly dir: string, private readonly guest: boolean) {
    try {
      accessSync(join(dir, "sh"), constants.X_OK);
      this.active = true;
    } catch {
      this.active = false;
    }
  }

  /**
   * What to exec for `cmd`: the tools disk's sh in place of a /bin/bash or /bin/sh the image does
   * not have (busybox sh takes bash's `-l -c` and `-i -l`), else `cmd` as given.
   */
  async command(cmd: string): Promise<string> {
    if (!this.active || !SHELLS.includes(cmd) || (await executable(cmd))) return cmd;
    const sh = join(this.dir, "sh");
    if (!this.swapped.has(cmd)) {
      this.swapped.add(cmd);
      console.error(`envd: the image has no ${cmd}: running ${sh} (busybox sh) in its place`);
    }
    return sh;
  }

  /** PATH with the toolbox appended (once): the image's own tools always come first. */
  path(p: string): string {
    if (!this.active || p.split(":").includes(this.dir)) return p;
    return p ? `${p}:${this.dir}` : this.dir;
  }

  /**
   * Makes the home of each supplied account that is missing (guest mode: a host process never
   * writes outside its scratch files): /home made 0755 when absent, the home HOME_MODE and owned
   * by the account. An existing directory is left as it is.
   */
  async makeHomes(users: readonly User[]): Promise<void> {
    if (!this.guest) return;
    for (const u of users) {
      if (this.homesSeen.has(u.home)) continue;
      this.homesSeen.add(u.home);
      try {
        if (await stat(u.home).then(() => true, () => false)) continue;
        await mkdir(dirname(u.home), { recursive: true });
        await mkdir(u.home, { mode: HOME_MODE });
        await chown(u.home, u.uid, u.gid);
        console.error(`envd: made ${u.home}, the home of user '${u.name}' (uid ${u.uid}), which the image has no account for`);
      } catch (e) {
        console.error(`envd: making ${u.home} for user '${u.name}' failed: ${(e as Error).message}`);
      }
    }
  }

  /** What envd supplies for the image as it is now, one line each (empty: nothing). */
  async report(users: Users): Promise<string[]> {
    const lines: string[] = [];
    for (const sh of this.active ? SHELLS : []) {
      if (!(await executable(sh))) lines.push(`${sh}: not in the image; ${join(this.dir, "sh")} (busybox sh) runs in its place`);
    }
    for (const u of users.supplied()) {
      lines.push(`user '${u.name}': not in the image's /etc/passwd; envd supplies uid ${u.uid}, gid ${u.gid}, home ${u.home}`);
    }
    let hasSudo = !this.active; // without the tools disk there is nothing to offer in its place
    for (const p of SUDO_PATHS) if (!hasSudo && (await executable(p))) hasSudo = true;
    if (!hasSudo) {
      lines.push((await executable(join(this.dir, "sudo")))
        ? `sudo: not in the image; ${join(this.dir, "sudo")} runs commands for callers that are root already and refuses others`
        : "sudo: not in the image; none supplied");
    }
    return lines;
  }

  /**
   * Logs the report (stderr: envd's log) when it changed or `always`; in guest mode also on the
   * console (the sandbox's logs) and into SUPPLIED_REPORT.
   */
  async announce(users: Users, always: boolean): Promise<void> {
    const lines = await this.report(users);
    const text = lines.join("\n");
    const changed = text !== this.lastReport;
    this.lastReport = text;
    const line = `envd: supplied for this image${this.active ? ` (${this.dir} is last on PATH)` : ""}: ${lines.join("; ")}`;
    if (lines.length && (changed || always)) console.error(line);
    if (!this.guest) return;
    if (changed) await writeFile(SUPPLIED_REPORT, text ? `${text}\n` : "").catch((e) => console.error(`envd: writing ${SUPPLIED_REPORT}: ${(e as Error).message}`));
    if (lines.length && always) await appendFile("/dev/console", `${line}\n`).catch(() => {});
  }
}
