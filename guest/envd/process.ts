// process.Process: start commands (pipes or a real pty via Bun.Terminal), fan their output out to
// every attached stream, and take input, signals and resizes by pid or tag.
import { stat, writeFile } from "node:fs/promises";
import type { FileSink, Subprocess, Terminal } from "bun";
import { ConnectError, type Method, type RpcCtx } from "./connect.ts";
import type { EnvdState } from "./state.ts";
import { resolvePath } from "./users.ts";

type Msg = Record<string, unknown>;
type Listener = (ev: Msg) => void;

interface ProcConfig {
  cmd: string;
  args: string[];
  envs: Record<string, string>;
  cwd?: string;
}

interface Proc {
  pid: number;
  config: ProcConfig;
  tag?: string;
  sub: Subprocess;
  terminal?: Terminal;
  stdin?: FileSink;
  listeners: Set<Listener>;
  end?: Msg;
  killTimer?: Timer;
}

/** A checked start request, ready to spawn. */
interface Launch {
  req: Msg;
  ctx: RpcCtx;
  config: ProcConfig;
  cwd: string;
  env: Record<string, string>;
  argv: string[];
  ids: { uid?: number; gid?: number };
}

const DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
const PIPE_CHUNK = 32 * 1024;
const PTY_CHUNK = 16 * 1024;
/** After exit, output still held open by orphaned children is read this long before `end` is sent. */
const OUTPUT_GRACE_MS = 500;
/** Connect to a process that just exited still gets start + end for this long. */
const RECENT_MS = 30_000;

// Go's ProcessState.String() wording, which the SDK passes through as the error text.
const SIGNAL_TEXT: Record<string, string> = {
  SIGHUP: "hangup", SIGINT: "interrupt", SIGQUIT: "quit", SIGILL: "illegal instruction", SIGTRAP: "trace/breakpoint trap",
  SIGABRT: "aborted", SIGBUS: "bus error", SIGFPE: "floating point exception", SIGKILL: "killed",
  SIGUSR1: "user defined signal 1", SIGSEGV: "segmentation fault", SIGUSR2: "user defined signal 2",
  SIGPIPE: "broken pipe", SIGALRM: "alarm clock", SIGTERM: "terminated",
};

function endEvent(sub: Subprocess): Msg {
  if (sub.signalCode) {
    const status = `signal: ${SIGNAL_TEXT[sub.signalCode] ?? sub.signalCode}`;
    return { exitCode: -1, exited: false, status, error: status };
  }
  const code = sub.exitCode ?? -1;
  const status = `exit status ${code}`;
  return { exitCode: code, exited: true, status, error: code === 0 ? undefined : status };
}

function broadcast(p: Proc, ev: Msg) {
  for (const l of p.listeners) {
    try {
      l(ev);
    } catch {
      p.listeners.delete(l);
    }
  }
}

function emitChunks(p: Proc, key: "stdout" | "stderr" | "pty", data: Uint8Array, max: number) {
  for (let off = 0; off < data.length; off += max) {
    broadcast(p, { data: { [key]: data.slice(off, off + max) } });
  }
}

/** Resolves when the signal aborts; the abort reason tells cancel from deadline. */
function aborted(signal: AbortSignal): Promise<unknown> {
  return new Promise((resolve) => {
    if (signal.aborted) resolve(signal.reason);
    else signal.addEventListener("abort", () => resolve(signal.reason), { once: true });
  });
}

export class ProcessService {
  private live = new Map<number, Proc>();
  private recent = new Map<number, Proc>();

  constructor(private state: EnvdState) {}

  private find(selector: Msg | undefined): Proc {
    const pid = selector?.pid as number | undefined;
    const tag = selector?.tag as string | undefined;
    if (pid !== undefined) {
      const p = this.live.get(pid);
      if (p) return p;
      throw new ConnectError("not_found", `process with pid ${pid} not found`);
    }
    if (tag !== undefined) {
      for (const p of this.live.values()) if (p.tag === tag) return p;
      throw new ConnectError("not_found", `process with tag ${tag} not found`);
    }
    throw new ConnectError("invalid_argument", "process selector is required");
  }

  /** Streams a process's events to one client until `end` or until the client/deadline stops it. */
  private async attach(p: Proc, ctx: RpcCtx, send: (m: Msg) => void): Promise<void> {
    send({ event: { start: { pid: p.pid } } });
    if (p.end) {
      send({ event: { end: p.end } });
      return;
    }
    let done!: () => void;
    const ended = new Promise<void>((r) => (done = r));
    const listener: Listener = (ev) => {
      send({ event: ev });
      if (ev.end) done();
    };
    p.listeners.add(listener);
    try {
      const reason = await Promise.race([ended.then(() => null), aborted(ctx.signal)]);
      if (reason instanceof ConnectError && reason.code === "deadline_exceeded") throw reason;
    } finally {
      p.listeners.delete(listener);
    }
  }

  /** Everything a start needs that may wait on the filesystem: user, cwd, argv. Spawns nothing. */
  private async prepare(req: Msg, ctx: RpcCtx): Promise<Launch> {
    const user = this.state.user(ctx.username);
    const cfgIn = (req.process ?? {}) as Msg;
    const config: ProcConfig = {
      cmd: (cfgIn.cmd as string) ?? "",
      args: (cfgIn.args as string[]) ?? [],
      envs: (cfgIn.envs as Record<string, string>) ?? {},
      cwd: cfgIn.cwd as string | undefined,
    };
    if (!config.cmd) throw new ConnectError("invalid_argument", "process.cmd is required");
    const cwd = resolvePath(config.cwd ?? "", user, this.state.defaultWorkdir);
    const isDir = await stat(cwd).then((st) => st.isDirectory(), () => false);
    if (!isDir) throw new ConnectError("invalid_argument", `cwd '${cwd}' does not exist`);

    const env: Record<string, string> = {
      PATH: process.env.PATH || DEFAULT_PATH,
      HOME: user.home,
      USER: user.name,
      LOGNAME: user.name,
      ...this.state.defaultEnv(),
    };
    // The tools disk's applets go last on envd's or the template's PATH; a request's own PATH is kept as given.
    env.PATH = this.state.toolbox.path(env.PATH!);
    Object.assign(env, config.envs);
    const exe = await this.state.toolbox.command(config.cmd);
    let argv = [exe, ...config.args];
    let ids: { uid?: number; gid?: number } = this.state.canSwitchUser ? { uid: user.uid, gid: user.gid } : {};
    const groups = this.state.canSwitchUser ? this.state.users.groupsOf(user) : [];
    const setpriv = groups.length > 1 ? await this.state.setpriv() : undefined;
    if (setpriv) {
      // setpriv execs the command with the user's ids and all their groups, as a login would.
      // A command that is not there must still fail the start, not exit 127 later.
      if (!Bun.which(exe, { PATH: env.PATH, cwd }))
        throw new ConnectError("invalid_argument", `failed to start process: executable not found: ${config.cmd}`);
      argv = [setpriv, `--reuid=${user.uid}`, `--regid=${user.gid}`, `--groups=${groups.join(",")}`, "--", ...argv];
      ids = {};
    }
    return { req, ctx, config, cwd, env, argv, ids };
  }

  /**
   * Starts a prepared process. Synchronous on purpose: the caller attaches its listener in the same
   * tick, before any output can be pumped.
   */
  private spawn({ req, ctx, config, cwd, env, argv, ids }: Launch): Proc {
    const pty = req.pty as { size?: { cols?: number; rows?: number } } | undefined;
    const stdinOn = req.stdin !== false; // absent means open (the legacy default)

    const p = { listeners: new Set<Listener>(), config, tag: req.tag as string | undefined } as Proc;
    let ptyEof!: () => void;
    const ptyClosed = new Promise<void>((r) => (ptyEof = r));
    try {
      if (pty) {
        p.sub = Bun.spawn(argv, {
          cwd,
          env,
          ...ids,
          terminal: {
            cols: pty.size?.cols || 80,
            rows: pty.size?.rows || 24,
            data: (_t, d) => emitChunks(p, "pty", d, PTY_CHUNK),
            exit: () => ptyEof(),
          },
        });
        p.terminal = p.sub.terminal;
      } else {
        p.sub = Bun.spawn(argv, {
          cwd,
          env,
          ...ids,
          stdin: stdinOn ? "pipe" : "ignore",
          stdout: "pipe",
          stderr: "pipe",
        });
        if (stdinOn) p.stdin = p.sub.stdin as FileSink;
      }
    } catch (e) {
      throw new ConnectError("invalid_argument", `failed to start process: ${(e as Error).message}`);
    }
    p.pid = p.sub.pid;
    this.live.set(p.pid, p);
    if (this.state.opts.guest) {
      // User processes go before envd under memory pressure (best effort).
      writeFile(`/proc/${p.pid}/oom_score_adj`, "100").catch(() => {});
    }
    if (ctx.timeoutMs) p.killTimer = setTimeout(() => p.sub.kill("SIGKILL"), ctx.timeoutMs); // the deadline is the process lifetime
    void this.lifecycle(p, pty ? ptyClosed : undefined);
    return p;
  }

  /** Pumps output, then publishes `end` once the process is reaped and its output drained. */
  private async lifecycle(p: Proc, ptyClosed?: Promise<void>) {
    const readers: { cancel(): Promise<void> }[] = [];
    const pump = async (stream: ReadableStream<Uint8Array>, key: "stdout" | "stderr") => {
      const reader = stream.getReader();
      readers.push(reader);
      try {
        for (;;) {
          const { done, value } = await reader.read();
          if (done) return;
          emitChunks(p, key, value, PIPE_CHUNK);
        }
      } catch {
        // cancelled after the grace period
      }
    };
    // Pumps are started in the same tick as the spawn, after the first listener was added.
    await Promise.resolve();
    const outputs = ptyClosed
      ? [ptyClosed]
      : [pump(p.sub.stdout as ReadableStream<Uint8Array>, "stdout"), pump(p.sub.stderr as ReadableStream<Uint8Array>, "stderr")];
    try {
      await p.sub.exited;
    } catch {
      // exit information is read from the subprocess below
    }
    let grace: Timer | undefined;
    await Promise.race([Promise.all(outputs), new Promise((r) => (grace = setTimeout(r, OUTPUT_GRACE_MS)))]);
    clearTimeout(grace);
    for (const r of readers) r.cancel().catch(() => {});
    clearTimeout(p.killTimer);
    p.end = endEvent(p.sub);
    this.live.delete(p.pid);
    this.recent.set(p.pid, p);
    setTimeout(() => {
      if (this.recent.get(p.pid) === p) this.recent.delete(p.pid);
    }, RECENT_MS).unref?.();
    broadcast(p, { end: p.end });
    p.listeners.clear();
    try {
      p.terminal?.close();
    } catch {
      // already closed
    }
  }

  private writeStdin(p: Proc, data: Uint8Array) {
    if (p.terminal) throw new ConnectError("internal", "process is a pty, send pty input instead of stdin");
    if (!p.stdin) throw new ConnectError("internal", "stdin not enabled or closed");
    try {
      p.stdin.write(data);
      const f = p.stdin.flush();
      if (f instanceof Promise) f.catch(() => {});
    } catch (e) {
      throw new ConnectError("internal", `failed to write to stdin: ${(e as Error).message}`);
    }
  }

  private writeInput(p: Proc, input: Msg | undefined) {
    if (input?.stdin !== undefined) this.writeStdin(p, input.stdin as Uint8Array);
    else if (input?.pty !== undefined) {
      if (!p.terminal) throw new ConnectError("internal", "process is not a pty");
      p.terminal.write(input.pty as Uint8Array);
    }
  }

  /** SIGKILLs every live process (envd shutting down must not leave orphans behind). */
  killAll() {
    for (const p of this.live.values()) p.sub.kill("SIGKILL");
  }

  methods(): Record<string, Method> {
    return {
      Start: {
        kind: "server",
        input: "process.StartRequest",
        output: "process.StartResponse",
        keepalive: { event: { keepalive: {} } },
        handle: async (req, ctx, send) => {
          const p = this.spawn(await this.prepare(req, ctx));
          try {
            await this.attach(p, ctx, send);
          } catch (e) {
            if (e instanceof ConnectError && e.code === "deadline_exceeded") p.sub.kill("SIGKILL");
            throw e;
          }
        },
      },
      Connect: {
        kind: "server",
        input: "process.ConnectRequest",
        output: "process.ConnectResponse",
        keepalive: { event: { keepalive: {} } },
        handle: async (req, ctx, send) => {
          const sel = req.process as Msg | undefined;
          const recent = sel?.pid !== undefined ? this.recent.get(sel.pid as number) : undefined;
          const p = sel?.pid !== undefined && !this.live.has(sel.pid as number) && recent ? recent : this.find(sel);
          await this.attach(p, ctx, send);
        },
      },
      List: {
        kind: "unary",
        input: "process.ListRequest",
        output: "process.ListResponse",
        handle: () => ({
          processes: [...this.live.values()].map((p) => ({ config: p.config, pid: p.pid, tag: p.tag })),
        }),
      },
      SendInput: {
        kind: "unary",
        input: "process.SendInputRequest",
        output: "process.SendInputResponse",
        handle: (req) => {
          this.writeInput(this.find(req.process as Msg), req.input as Msg);
          return {};
        },
      },
      StreamInput: {
        kind: "client",
        input: "process.StreamInputRequest",
        output: "process.StreamInputResponse",
        handle: async (reqs) => {
          let p: Proc | undefined;
          for await (const r of reqs) {
            if (r.start) p = this.find((r.start as Msg).process as Msg);
            else if (r.data) {
              if (!p) throw new ConnectError("failed_precondition", "first message must be start");
              this.writeInput(p, (r.data as Msg).input as Msg);
            }
          }
          return {};
        },
      },
      SendSignal: {
        kind: "unary",
        input: "process.SendSignalRequest",
        output: "process.SendSignalResponse",
        handle: (req) => {
          const p = this.find(req.process as Msg);
          const sig = req.signal === 9 ? "SIGKILL" : req.signal === 15 ? "SIGTERM" : undefined;
          if (!sig) throw new ConnectError("unimplemented", `invalid signal: ${req.signal ?? 0}`);
          p.sub.kill(sig);
          return {};
        },
      },
      CloseStdin: {
        kind: "unary",
        input: "process.CloseStdinRequest",
        output: "process.CloseStdinResponse",
        handle: (req) => {
          const p = this.find(req.process as Msg);
          if (p.terminal) throw new ConnectError("failed_precondition", "cannot close stdin of a pty process, send Ctrl+D (0x04) instead");
          if (p.stdin) {
            const s = p.stdin;
            p.stdin = undefined;
            try {
              const r = s.end();
              if (r instanceof Promise) r.catch(() => {});
            } catch {
              // the process may already be gone
            }
          }
          return {};
        },
      },
      Update: {
        kind: "unary",
        input: "process.UpdateRequest",
        output: "process.UpdateResponse",
        handle: (req) => {
          const p = this.find(req.process as Msg);
          const size = (req.pty as Msg | undefined)?.size as { cols?: number; rows?: number } | undefined;
          if (!req.pty) return {};
          if (!p.terminal) throw new ConnectError("internal", "process is not a pty");
          p.terminal.resize(size?.cols || 80, size?.rows || 24);
          return {};
        },
      },
    };
  }
}
