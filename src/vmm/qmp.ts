// A QMP client: QEMU's JSON monitor protocol over a unix socket. One JSON object per line; replies
// carry our "id" back, events arrive in between and are kept for whoever waits on them.

import type { Socket } from "bun";
import { E, SyscallError, errno, errnoName, libc } from "../../ffi/libc.ts";
import { sendMsg, unixConnect } from "../../ffi/unix_fd.ts";
import { VmmError } from "./types.ts";
import { retryUntilListening, withTimeout } from "./wait.ts";

export interface QmpEvent {
  event: string;
  data?: Record<string, unknown>;
  timestamp?: { seconds: number; microseconds: number };
}

export class QmpClient {
  private buf = "";
  private nextId = 0;
  private waiting = new Map<string, { resolve: (v: any) => void; reject: (e: Error) => void; command: string }>();
  private greeting: Promise<unknown>;
  private greeted!: (v: unknown) => void;
  private closedWith: Error | undefined;
  private eventWaiters: { name: string; resolve: (e: QmpEvent) => void }[] = [];
  readonly events: QmpEvent[] = [];

  private constructor(private socket: Socket<undefined> | undefined) {
    this.greeting = new Promise((r) => (this.greeted = r));
  }

  /** Connect, read the greeting and leave capabilities negotiation mode. */
  static async connect(path: string, timeoutMs = 10_000): Promise<QmpClient> {
    const client = new QmpClient(undefined);
    const until = Date.now() + timeoutMs;
    const open = () =>
      Bun.connect({
        unix: path,
        socket: {
          data: (_s, chunk) => client.onData(chunk),
          close: () => client.onClose(new VmmError("Protocol", `QMP connection ${path} closed`)),
          error: (_s, e) => client.onClose(e),
        },
      });
    // QEMU binds the socket before it listens: the file can exist a moment before connect works.
    const socket = await retryUntilListening(open, until, `QMP ${path}`);
    client.socket = socket;
    const closed = new Promise((_, reject) => (client.rejectGreeting = reject));
    try {
      await withTimeout(Promise.race([client.greeting, closed]), Math.max(1, until - Date.now()), `no QMP greeting on ${path}`);
      await client.execute("qmp_capabilities");
    } catch (e) {
      client.close();
      throw e;
    }
    return client;
  }

  private rejectGreeting: (e: Error) => void = () => {};

  private onData(chunk: Uint8Array): void {
    this.buf += new TextDecoder().decode(chunk);
    let nl: number;
    while ((nl = this.buf.indexOf("\n")) >= 0) {
      const line = this.buf.slice(0, nl).trim();
      this.buf = this.buf.slice(nl + 1);
      if (!line) continue;
      let msg: any;
      try {
        msg = JSON.parse(line);
      } catch {
        continue; // QMP only sends JSON; a torn line cannot happen on a stream we split by newline
      }
      if (msg.QMP) this.greeted(msg.QMP);
      else if (msg.event) this.onEvent(msg as QmpEvent);
      else if (msg.id !== undefined) {
        const w = this.waiting.get(String(msg.id));
        if (!w) continue;
        this.waiting.delete(String(msg.id));
        if (msg.error) w.reject(new VmmError("Protocol", `QMP ${w.command}: ${msg.error.class}: ${msg.error.desc}`));
        else w.resolve(msg.return);
      }
    }
  }

  private onEvent(e: QmpEvent): void {
    this.events.push(e);
    if (this.events.length > 256) this.events.shift(); // bounded: nobody needs old events
    this.eventWaiters = this.eventWaiters.filter((w) => {
      if (w.name !== e.event) return true;
      w.resolve(e);
      return false;
    });
  }

  private onClose(e: Error): void {
    if (this.closedWith) return;
    this.closedWith = e;
    this.rejectGreeting(e);
    for (const w of this.waiting.values()) w.reject(e);
    this.waiting.clear();
  }

  get closed(): boolean {
    return this.closedWith !== undefined;
  }

  execute<T = any>(command: string, args?: Record<string, unknown>): Promise<T> {
    if (this.closedWith) return Promise.reject(this.closedWith);
    const id = `q${++this.nextId}`;
    return new Promise<T>((resolve, reject) => {
      this.waiting.set(id, { resolve, reject, command });
      this.socket!.write(JSON.stringify(args ? { execute: command, arguments: args, id } : { execute: command, id }) + "\n");
    });
  }

  /** The next event of this name (events seen before the call do not count). */
  nextEvent(name: string, timeoutMs: number): Promise<QmpEvent> {
    let w!: { name: string; resolve: (e: QmpEvent) => void };
    const p = new Promise<QmpEvent>((resolve) => {
      w = { name, resolve };
      this.eventWaiters.push(w);
    });
    return withTimeout(p, timeoutMs, `no QMP event ${name} within ${timeoutMs} ms`).finally(() => {
      this.eventWaiters = this.eventWaiters.filter((x) => x !== w);
    });
  }

  close(): void {
    this.onClose(new VmmError("Protocol", "QMP client closed"));
    this.socket?.end();
  }
}

/** Each reply on a QmpFdSession is waited for at most this long (QEMU answers these in ms). */
export const FD_SESSION_REPLY_TIMEOUT_MS = 10_000;
/** A QmpFdSession line longer than 64 KiB is a protocol error: its replies are a few hundred bytes. */
const FD_SESSION_LINE_MAX_BYTES = 64 * 1024;
/** How often a QmpFdSession polls its non-blocking socket (the event loop runs in between). */
const FD_SESSION_POLL_MS = 1;

/**
 * QMP on a second monitor socket over a raw socket, for commands that take a descriptor (`add-fd`,
 * `getfd`): Bun's sockets cannot attach one (SCM_RIGHTS). One command at a time; each answer is
 * waited for at most `timeoutMs` (Timeout), a line past 64 KiB or a closed socket is Protocol.
 */
export class QmpFdSession {
  private buf = "";
  private nextId = 0;
  private closed = false;

  private constructor(
    private readonly fd: number,
    private readonly path: string,
    private readonly timeoutMs: number,
  ) {}

  /** Connects (refused connects retried until the deadline), reads the greeting, negotiates. */
  static async open(path: string, timeoutMs = FD_SESSION_REPLY_TIMEOUT_MS): Promise<QmpFdSession> {
    const fd = await retryUntilListening(async () => {
      try {
        return unixConnect(path);
      } catch (e) {
        // A full backlog is as good as not listening yet: try again.
        if (e instanceof SyscallError && e.code === "EAGAIN") throw Object.assign(new Error(e.message), { code: "ECONNREFUSED" });
        throw e;
      }
    }, Date.now() + timeoutMs, `QMP ${path}`);
    const s = new QmpFdSession(fd, path, timeoutMs);
    try {
      const greeting = await s.readMessage(Date.now() + timeoutMs);
      if (!greeting.QMP) throw new VmmError("Protocol", `QMP ${path}: no greeting`);
      await s.execute("qmp_capabilities");
    } catch (e) {
      s.close();
      throw e;
    }
    return s;
  }

  /** Runs one command; `fd`, when given, travels with it (SCM_RIGHTS). */
  async execute<T = any>(command: string, args?: Record<string, unknown>, fd?: number): Promise<T> {
    if (this.closed) throw new VmmError("Protocol", `QMP ${this.path}: session closed`);
    const id = `f${++this.nextId}`;
    const line = new TextEncoder().encode(JSON.stringify(args ? { execute: command, arguments: args, id } : { execute: command, id }) + "\n");
    const deadline = Date.now() + this.timeoutMs;
    await this.send(line, fd, deadline, command);
    for (;;) {
      const msg = await this.readMessage(deadline, command);
      if (msg.id !== id) continue; // events, and nothing else arrives unasked
      if (msg.error) throw new VmmError("Protocol", `QMP ${command}: ${msg.error.class}: ${msg.error.desc}`);
      return msg.return as T;
    }
  }

  private async send(line: Uint8Array, fd: number | undefined, deadline: number, what: string): Promise<void> {
    let at = 0;
    while (at < line.length) {
      const rest = line.subarray(at);
      // The descriptor goes with the first byte that leaves.
      const n = sendMsg(this.fd, rest, at === 0 ? fd : undefined);
      if (n > 0) at += n;
      else if (n === -E.EAGAIN) await this.pause(deadline, what);
      else throw new VmmError("Protocol", `QMP ${this.path}: ${what}: send failed (${n === 0 ? "nothing sent" : errnoName(-n)})`);
    }
  }

  private async readMessage(deadline: number, what = "greeting"): Promise<any> {
    const chunk = new Uint8Array(4096);
    for (;;) {
      const nl = this.buf.indexOf("\n");
      if (nl >= 0) {
        const line = this.buf.slice(0, nl).trim();
        this.buf = this.buf.slice(nl + 1);
        if (!line) continue;
        try {
          return JSON.parse(line);
        } catch {
          throw new VmmError("Protocol", `QMP ${this.path}: ${what}: not JSON: ${line.slice(0, 200)}`);
        }
      }
      if (this.buf.length > FD_SESSION_LINE_MAX_BYTES) throw new VmmError("Protocol", `QMP ${this.path}: ${what}: a line over ${FD_SESSION_LINE_MAX_BYTES} bytes`);
      const n = readOrErrno(this.fd, chunk);
      if (n > 0) this.buf += new TextDecoder().decode(chunk.subarray(0, n));
      else if (n === 0) throw new VmmError("Protocol", `QMP ${this.path}: ${what}: connection closed`);
      else if (n === -E.EAGAIN) await this.pause(deadline, what);
      else throw new VmmError("Protocol", `QMP ${this.path}: ${what}: read failed (${errnoName(-n)})`);
    }
  }

  private async pause(deadline: number, what: string): Promise<void> {
    if (Date.now() > deadline) throw new VmmError("Timeout", `QMP ${this.path}: no answer to ${what} within ${this.timeoutMs} ms`);
    await Bun.sleep(FD_SESSION_POLL_MS);
  }

  close(): void {
    if (this.closed) return;
    this.closed = true;
    libc.close(this.fd);
  }
}

/** One read(2): the count, 0 at EOF, or -errno. */
function readOrErrno(fd: number, buf: Uint8Array): number {
  for (;;) {
    const r = Number(libc.read(fd, buf, buf.length));
    if (r >= 0) return r;
    const e = errno();
    if (e !== E.EINTR) return -e;
  }
}
