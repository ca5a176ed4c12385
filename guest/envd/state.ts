// Envd's mutable state: what /init configured, shared by every handler.
import { ConnectError } from "./connect.ts";
import { Users, type User } from "./users.ts";

export const ENVD_VERSION = "0.6.13";

export interface EnvdOptions {
  port: number;
  host: string;
  defaultUser: string;
  passwd: string;
  group: string;
  /** Guest mode: /init may set the clock, and /run/e2b markers are written. */
  guest: boolean;
}

export class EnvdState {
  accessToken?: string;
  envVars: Record<string, string> = {};
  defaultUser: string;
  defaultWorkdir?: string;
  lastInitTimestamp = 0;
  readonly users: Users;
  /** Only root can switch uid/gid; otherwise every process runs as envd's own user. */
  readonly canSwitchUser = process.getuid?.() === 0;

  constructor(readonly opts: EnvdOptions) {
    this.defaultUser = opts.defaultUser;
    this.users = new Users(opts.passwd, opts.group);
  }

  /** The env every process starts from: /init envVars plus envd's own markers. */
  defaultEnv(): Record<string, string> {
    return { E2B_SANDBOX: "true", ...this.envVars };
  }

  /** Resolves a user name (default user when absent); unknown names are an authentication failure. */
  user(name?: string): User {
    const n = name || this.defaultUser;
    const u = this.users.lookup(n);
    if (!u) throw new ConnectError("unauthenticated", `invalid username: '${n}'`);
    return u;
  }
}
