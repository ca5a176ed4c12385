// blockd's RPC: length-prefixed JSON over a unix socket. A frame is a u32 big-endian byte count
// then a UTF-8 JSON object. Requests {v, id, method, params}; replies {v, id, result} or
// {v, id, error: {code, message}}. Every request gets exactly one reply.

import type { Socket } from "bun";

export const PROTOCOL_VERSION = 1;
/** Frames above this are refused (a device table or image config is far smaller). */
export const MAX_FRAME = 4 << 20;

export class BlockdError extends Error {
  constructor(
    readonly code: string,
    message: string,
  ) {
    super(message);
    this.name = code;
  }
}

/** An error as a reply carries it: a BlockdError's code, else the error's name ("Internal" for a plain Error). */
export function errorOf(e: unknown): { code: string; message: string } {
  const err = e as Error;
  return { code: e instanceof BlockdError ? e.code : err.name && err.name !== "Error" ? err.name : "Internal", message: err.message };
}

export interface Request {
  v: number;
  id: number;
  method: string;
  params?: Record<string, unknown>;
}

export interface Reply {
  v: number;
  id: number;
  result?: unknown;
  error?: { code: string; message: string };
}

export function encodeFrame(obj: unknown): Uint8Array {
  const body = new TextEncoder().encode(JSON.stringify(obj));
  if (body.length > MAX_FRAME) throw new BlockdError("FrameTooLarge", `frame of ${body.length} bytes exceeds ${MAX_FRAME}`);
  const out = new Uint8Array(4 + body.length);
  new DataView(out.buffer).setUint32(0, body.length, false);
  out.set(body, 4);
  return out;
}

/** Accumulates socket bytes and yields whole frames; a bad length poisons the stream. */
export class FrameReader {
  private buf = new Uint8Array(0);
  push(chunk: Uint8Array): Uint8Array[] {
    const merged = new Uint8Array(this.buf.length + chunk.length);
    merged.set(this.buf);
    merged.set(chunk, this.buf.length);
    this.buf = merged;
    const frames: Uint8Array[] = [];
    for (;;) {
      if (this.buf.length < 4) break;
      const n = new DataView(this.buf.buffer, this.buf.byteOffset).getUint32(0, false);
      if (n > MAX_FRAME) throw new BlockdError("FrameTooLarge", `frame of ${n} bytes exceeds ${MAX_FRAME}`);
      if (this.buf.length < 4 + n) break;
      frames.push(this.buf.slice(4, 4 + n));
      this.buf = this.buf.slice(4 + n);
    }
    return frames;
  }
}

/** A peer (blockd, the fd keeper) that did not answer a call in time. The call may still run there. */
export class BlockdTimeoutError extends BlockdError {
  constructor(peer: string, call: string, ms: number) {
    super("Timeout", `${peer} did not answer ${JSON.stringify(call)} within ${ms} ms`);
  }
}

/** The connection to a peer closed, failed or spoke garbage before a call was answered. */
export class BlockdConnectionError extends BlockdError {
  constructor(peer: string, call: string, why: string) {
    super("Disconnected", `${peer} connection lost during ${JSON.stringify(call)}: ${why}`);
  }
}

/**
 * The calls a client has in flight on one connection, each with its own timer. Every call ends:
 * with its reply, its timeout, or the connection's end. A reply to a call that timed out is dropped.
 */
export class CallTable {
  private waiting = new Map<number, { call: string; resolve: (v: unknown) => void; reject: (e: Error) => void; timer: Timer }>();
  private closed: string | undefined;

  constructor(private readonly peer: string) {}

  get size(): number {
    return this.waiting.size;
  }

  /** Register call `key`, then send it with `send`; rejects at once when the connection is gone. */
  add(key: number, call: string, timeoutMs: number, send: () => void): Promise<unknown> {
    if (this.closed !== undefined) return Promise.reject(new BlockdConnectionError(this.peer, call, this.closed));
    return new Promise((resolve, reject) => {
      const timer = setTimeout(() => {
        this.waiting.delete(key);
        reject(new BlockdTimeoutError(this.peer, call, timeoutMs));
      }, timeoutMs);
      this.waiting.set(key, { call, resolve, reject, timer });
      try {
        send();
      } catch (e) {
        // A socket found closed on the write is the connection lost, as when it closes later.
        const lost = e instanceof BlockdError && e.code === "Disconnected" && !(e instanceof BlockdConnectionError);
        this.settle(key, undefined, lost ? new BlockdConnectionError(this.peer, call, e.message) : (e as Error));
      }
    });
  }

  /** End call `key` with its result or error; false when no such call waits (it timed out). */
  settle(key: number, result: unknown, error?: Error): boolean {
    const w = this.waiting.get(key);
    if (!w) return false;
    this.waiting.delete(key);
    clearTimeout(w.timer);
    if (error) w.reject(error);
    else w.resolve(result);
    return true;
  }

  /** The connection is gone: fail every waiting call, and every later one, saying why. */
  close(why: string): void {
    this.closed ??= why;
    for (const [key, w] of this.waiting) this.settle(key, undefined, new BlockdConnectionError(this.peer, w.call, why));
  }
}

/** Bytes a FrameWriter holds for a peer that does not read: past this the connection is cut. */
export const MAX_UNSENT = 4 * MAX_FRAME;

/**
 * Whole frames onto a Bun socket, in order. socket.write takes what the kernel buffer has room
 * for; the rest waits here for the socket's drain callback, which must call flush().
 */
export class FrameWriter {
  private unsent: Uint8Array[] = [];
  private unsentBytes = 0;

  constructor(private readonly socket: { write(b: Uint8Array): number }) {}

  send(bytes: Uint8Array): void {
    if (this.unsentBytes + bytes.length > MAX_UNSENT)
      throw new BlockdError("Backpressure", `peer is not reading: ${this.unsentBytes} bytes unsent`);
    this.unsent.push(bytes);
    this.unsentBytes += bytes.length;
    if (this.unsent.length === 1) this.flush();
  }

  flush(): void {
    while (this.unsent.length) {
      const head = this.unsent[0]!;
      const n = this.socket.write(head);
      if (n < 0) throw new BlockdError("Disconnected", "socket is closed");
      this.unsentBytes -= n;
      if (n < head.length) {
        this.unsent[0] = head.subarray(n);
        return;
      }
      this.unsent.shift();
    }
  }
}

/**
 * A client's end of one unix-socket connection: its calls (each ends, see CallTable), its writes
 * (whole, in order), and its end. A reply the client cannot parse ends the connection.
 */
export class ClientLink {
  readonly calls: CallTable;
  private writer!: FrameWriter;
  private socket!: Socket<undefined>;

  private constructor(readonly peer: string) {
    this.calls = new CallTable(peer);
  }

  /** onData parses replies and settles calls; a throw from it ends the connection. */
  static async connect(peer: string, unix: string, onData: (chunk: Uint8Array) => void): Promise<ClientLink> {
    const link = new ClientLink(peer);
    link.socket = await Bun.connect({
      unix,
      socket: {
        data: (_s, chunk) => {
          try {
            onData(chunk);
          } catch (e) {
            link.fail(`bad reply: ${(e as Error).message}`);
          }
        },
        drain: () => {
          try {
            link.writer.flush();
          } catch (e) {
            link.fail((e as Error).message);
          }
        },
        close: () => link.calls.close(`${peer} closed the connection`),
        error: (_s, e) => link.calls.close(e.message),
      },
    });
    link.writer = new FrameWriter(link.socket);
    return link;
  }

  /** Send call `key` (its bytes) and wait for its reply, its timeout, or the connection's end. */
  call(key: number, call: string, timeoutMs: number, bytes: Uint8Array): Promise<unknown> {
    return this.calls.add(key, call, timeoutMs, () => this.writer.send(bytes));
  }

  /** Raw bytes on the socket (tests of malformed input). */
  sendRaw(bytes: Uint8Array): void {
    this.writer.send(bytes);
  }

  /** End the connection: every waiting call, and every later one, fails saying why. */
  fail(why: string): void {
    this.calls.close(why);
    this.socket.end();
  }
}
