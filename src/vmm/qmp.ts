// A QMP client: QEMU's JSON monitor protocol over a unix socket. One JSON object per line; replies
// carry our "id" back, events arrive in between and are kept for whoever waits on them.

import type { Socket } from "bun";
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
