// An interactive shell in a sandbox over envd's PTY: the local terminal in raw mode, keystrokes
// forwarded in order, the remote size following the local one (SIGWINCH), and the shell's exit
// code returned when it exits. While attached, the sandbox's TTL is pushed forward so an idle
// session is not reaped under the user.

import { CommandExitError, type Sandbox } from "e2b";

/** Keystrokes waiting for the send in flight; past this, reading stdin pauses until they are sent. */
const INPUT_HIGH_WATER = 1 << 20;
/** How often the TTL is renewed while attached, at most (and at half the TTL when that is shorter). */
const KEEPALIVE_MAX_MS = 60_000;

export interface ShellOptions {
  /** The sandbox's TTL in seconds, renewed while attached. */
  ttlS: number;
  user?: string;
}

/** Attach the terminal to a new login shell in `sbx` until it exits; its exit code. */
export async function attachShell(sbx: Sandbox, o: ShellOptions): Promise<number> {
  const stdin = process.stdin;
  const stdout = process.stdout;
  const size = () => ({ cols: stdout.columns || 80, rows: stdout.rows || 24 });
  const handle = await sbx.pty.create({
    ...size(),
    timeoutMs: 0,
    user: o.user,
    envs: { TERM: process.env.TERM || "xterm-256color" },
    onData: (d) => void stdout.write(d),
  });
  const pid = handle.pid;

  // Keystrokes go one send at a time, in order; what arrives meanwhile is sent together next.
  let pending: Buffer[] = [];
  let pendingBytes = 0;
  let sending = false;
  let inputFailed: unknown;
  const pump = async () => {
    if (sending) return;
    sending = true;
    try {
      while (pending.length > 0 && inputFailed === undefined) {
        const chunk = Buffer.concat(pending);
        pending = [];
        pendingBytes = 0;
        stdin.resume();
        await sbx.pty.sendInput(pid, chunk);
      }
    } catch (e) {
      inputFailed = e; // the shell is gone or going; wait() below tells how it ended
    } finally {
      sending = false;
    }
  };
  const onInput = (d: Buffer) => {
    pending.push(d);
    pendingBytes += d.length;
    if (pendingBytes > INPUT_HIGH_WATER) stdin.pause();
    void pump();
  };
  // Piped input ends: Ctrl-D, as a terminal would send, so the shell sees the end of its input.
  const onEnd = () => onInput(Buffer.from([4]));
  const onResize = () => void sbx.pty.resize(pid, size()).catch(() => {});
  const keepalive = setInterval(() => void sbx.setTimeout(o.ttlS * 1000).catch(() => {}), Math.min(KEEPALIVE_MAX_MS, (o.ttlS * 1000) / 2));

  const raw = stdin.isTTY === true;
  if (raw) stdin.setRawMode(true);
  stdin.on("data", onInput);
  stdin.on("end", onEnd);
  stdin.resume();
  stdout.on("resize", onResize);
  try {
    const r = await handle.wait();
    return r.exitCode;
  } catch (e) {
    if (e instanceof CommandExitError) return e.exitCode;
    throw e;
  } finally {
    clearInterval(keepalive);
    stdout.off("resize", onResize);
    stdin.off("data", onInput);
    stdin.off("end", onEnd);
    if (raw) stdin.setRawMode(false);
    stdin.pause();
  }
}
