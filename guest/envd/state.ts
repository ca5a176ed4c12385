// Envd's mutable state: what /init configured, shared by every handler.
import { join } from "node:path";
import { ConnectError } from "./connect.ts";
import { Toolbox } from "./toolbox.ts";
import { Users, type User } from "./users.ts";

export const ENVD_VERSION = "0.6.13";
/** `setpriv --version` answers in milliseconds; one that has not in 5 s is not the one we want. */
const SETPRIV_PROBE_MS = 5000;

export interface EnvdOptions {
  port: number;
  host: string;
  defaultUser: string;
  passwd: string;
  group: string;
  /** Guest mode: /init may set the clock, and /run/e2b markers are written. */
  guest: boolean;
  /** Where /init's caBundle goes into the trust store ("/" in guest mode); unset: nowhere. */
  trustRoot?: string;
  /** util-linux setpriv to start processes with supplementary groups (default: looked up). */
  setpriv?: string;
  /** The tools disk's bin: busybox applets, setpriv, sudo (default: bin/ next to envd, /agentenv/bin in the guest). */
  tools: string;
}

export class EnvdState {
  accessToken?: string;
  envVars: Record<string, string> = {};
  defaultUser: string;
  defaultWorkdir?: string;
  lastInitTimestamp = 0;
  readonly users: Users;
  readonly toolbox: Toolbox;
  /** Only root can switch uid/gid; otherwise every process runs as envd's own user. */
  readonly canSwitchUser = process.getuid?.() === 0;

  constructor(readonly opts: EnvdOptions) {
    this.defaultUser = opts.defaultUser;
    this.users = new Users(opts.passwd, opts.group);
    this.toolbox = new Toolbox(opts.tools, opts.guest);
  }

  /** passwd and group as they are now (images add users at run time), and homes for supplied accounts. */
  async refreshUsers(): Promise<void> {
    await this.users.refresh();
    await this.toolbox.makeHomes(this.users.supplied());
  }

  /** The env every process starts from: /init envVars plus envd's own markers. */
  defaultEnv(): Record<string, string> {
    return { E2B_SANDBOX: "true", ...this.envVars };
  }

  private setprivLookup?: Promise<string | undefined>;

  /**
   * util-linux setpriv, which sets supplementary groups before exec (Bun's spawn sets only the
   * primary gid): ours on the tools disk, else the image's. busybox's applet of
   * that name cannot set ids, so the version line decides. Looked up once, on first need.
   */
  setpriv(): Promise<string | undefined> {
    this.setprivLookup ??= (async () => {
      const candidates = this.opts.setpriv ? [this.opts.setpriv] : [join(this.opts.tools, "setpriv"), "/usr/bin/setpriv", "/bin/setpriv"];
      for (const c of candidates) {
        try {
          const p = Bun.spawn([c, "--version"], { stdout: "pipe", stderr: "ignore", stdin: "ignore" });
          const stuck = setTimeout(() => p.kill("SIGKILL"), SETPRIV_PROBE_MS);
          const [out, code] = await Promise.all([new Response(p.stdout).text(), p.exited]);
          clearTimeout(stuck);
          if (code === 0 && out.includes("util-linux")) return c;
        } catch {
          // not there or not executable
        }
      }
      console.error("envd: no util-linux setpriv: processes get their user's primary group only");
      return undefined;
    })();
    return this.setprivLookup;
  }

  /** Resolves a user name (default user when absent); unknown names are an authentication failure. */
  user(name?: string): User {
    const n = name || this.defaultUser;
    const u = this.users.lookup(n);
    if (!u) throw new ConnectError("unauthenticated", `invalid username: '${n}'`);
    return u;
  }
}
