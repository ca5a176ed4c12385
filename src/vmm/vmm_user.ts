// The unprivileged user VMMs run as (docs/vmm.md, Confinement): QEMU switches to it with `-runas`
// once it has opened its files, the Firecracker jailer with `--uid/--gid`. A system user with its
// own group, no home and no login shell, created when missing (the node runs as root).

/** The VMMs' user when the node runs as root. */
export const VMM_USER = "aenv-vmm";
/** getent and useradd each get 10 s. */
const USER_TOOL_TIMEOUT_MS = 10_000;

export class VmmUserError extends Error {
  constructor(message: string) {
    super(message);
    this.name = "VmmUserError";
  }
}

export interface SystemUser {
  name: string;
  uid: number;
  gid: number;
}

/** A user name as useradd takes it (and as it can sit in an argv without reading as an option). */
function checkUserName(name: string): string {
  if (!/^[a-z_][a-z0-9_-]{0,31}$/.test(name)) throw new VmmUserError(`bad user name ${JSON.stringify(name)}: [a-z_][a-z0-9_-]{0,31}`);
  return name;
}

async function run(argv: string[]): Promise<{ code: number | null; out: string; err: string }> {
  const p = Bun.spawn(argv, { stdin: "ignore", stdout: "pipe", stderr: "pipe", signal: AbortSignal.timeout(USER_TOOL_TIMEOUT_MS), killSignal: "SIGKILL" });
  const [out, err] = await Promise.all([new Response(p.stdout).text(), new Response(p.stderr).text(), p.exited]);
  return { code: p.exitCode, out, err };
}

/** The user's uid and gid (getent: local files or the host's directory), undefined when there is none. */
export async function lookupUser(name: string): Promise<SystemUser | undefined> {
  const r = await run(["getent", "passwd", checkUserName(name)]);
  if (r.code === 2) return undefined; // getent: key not found
  if (r.code !== 0) throw new VmmUserError(`getent passwd ${name} failed (${r.code}): ${r.err.trim()}`);
  const f = r.out.trim().split(":");
  const uid = Number(f[2]);
  const gid = Number(f[3]);
  if (f[0] !== name || !Number.isInteger(uid) || !Number.isInteger(gid)) throw new VmmUserError(`getent passwd ${name}: unexpected answer ${JSON.stringify(r.out.slice(0, 200))}`);
  if (uid === 0 || gid === 0) throw new VmmUserError(`user ${name} is privileged (uid ${uid}, gid ${gid}): VMMs must not run as root`);
  return { name, uid, gid };
}

const ensured = new Map<string, Promise<SystemUser>>();

/** The user `name`, created first as a system user (own group, no home, no shell) when missing; asked once per process. */
export function ensureSystemUser(name: string): Promise<SystemUser> {
  let p = ensured.get(name);
  if (!p) {
    p = (async () => {
      const known = await lookupUser(name);
      if (known) return known;
      const r = await run(["useradd", "--system", "--user-group", "--no-create-home", "--home-dir", "/nonexistent", "--shell", "/usr/sbin/nologin", checkUserName(name)]);
      // 9: another process made it meanwhile.
      if (r.code !== 0 && r.code !== 9) throw new VmmUserError(`useradd ${name} failed (${r.code}): ${r.err.trim()}`);
      const made = await lookupUser(name);
      if (!made) throw new VmmUserError(`useradd ${name} succeeded but getent does not know it`);
      return made;
    })();
    p.catch(() => ensured.delete(name));
    ensured.set(name, p);
  }
  return p;
}

/** Whether this process may switch a child to another user (it runs as root). */
export function canDropPrivileges(): boolean {
  return process.getuid?.() === 0;
}
