// blockd's RPC socket (<state>/blockd.sock): frames read per connection, each request checked and
// admitted (at most MAX_IN_FLIGHT per connection), started in arrival order one per event-loop
// turn, and answered in the frame protocol (protocol.ts). What a method does is the dispatcher's.

import { rmSync } from "node:fs";
import type { Socket } from "bun";
import { BlockdError, FrameReader, FrameWriter, PROTOCOL_VERSION, encodeFrame, errorOf, type Reply, type Request } from "./protocol.ts";

/** One connection: frames in, frames out (whole, in order), and how many of its requests run. */
interface Conn {
  reader: FrameReader;
  writer: FrameWriter;
  /** Requests admitted and not answered yet (queued or running). */
  inFlight: number;
  /** Admitted requests not started yet, in arrival order (at most MAX_IN_FLIGHT). */
  queue: Request[];
  /** A drain turn is scheduled. */
  draining: boolean;
}

/** Requests one connection may have running at once; more are answered Busy. */
const MAX_IN_FLIGHT = 64;

export class RpcServer {
  private server: ReturnType<typeof Bun.listen> | undefined;
  private stopped = false;
  /** RPCs under way, which shutdown lets finish. */
  readonly running = new Set<Promise<unknown>>();

  constructor(
    readonly socketPath: string,
    private readonly dispatch: (method: string, params: Record<string, unknown>) => Promise<unknown>,
  ) {}

  listen(): void {
    rmSync(this.socketPath, { force: true });
    this.server = Bun.listen<Conn>({
      unix: this.socketPath,
      socket: {
        open: (s) => {
          s.data = { reader: new FrameReader(), writer: new FrameWriter(s), inFlight: 0, queue: [], draining: false };
        },
        drain: (s) => {
          try {
            s.data.writer.flush();
          } catch {
            s.end();
          }
        },
        data: (s, chunk) => {
          let frames: Uint8Array[];
          try {
            frames = s.data.reader.push(chunk);
          } catch (e) {
            reply(s, { v: PROTOCOL_VERSION, id: 0, error: { code: "BadFrame", message: (e as Error).message } });
            s.end();
            return;
          }
          for (const f of frames) this.admit(s, f);
          this.drain(s);
        },
      },
    });
  }

  /** Shutdown: no new connection, and a request queued behind the ones running is not started. */
  stop(): void {
    this.stopped = true;
    this.server?.stop(true);
  }

  /**
   * A frame checked and counted in flight (at most MAX_IN_FLIGHT per connection, else Busy), then
   * queued for drain; a malformed one is answered at once.
   */
  private admit(s: Socket<Conn>, frame: Uint8Array): void {
    let req: Request;
    try {
      req = JSON.parse(new TextDecoder().decode(frame));
      if (!req || typeof req !== "object" || typeof req.method !== "string" || typeof req.id !== "number") throw new Error("not a request object");
    } catch (e) {
      return reply(s, { v: PROTOCOL_VERSION, id: 0, error: { code: "BadRequest", message: `malformed request: ${(e as Error).message}` } });
    }
    if (req.v !== PROTOCOL_VERSION)
      return reply(s, { v: PROTOCOL_VERSION, id: req.id, error: { code: "VersionMismatch", message: `blockd speaks version ${PROTOCOL_VERSION}, not ${req.v}` } });
    if (s.data.inFlight >= MAX_IN_FLIGHT)
      return reply(s, { v: PROTOCOL_VERSION, id: req.id, error: { code: "Busy", message: `${MAX_IN_FLIGHT} requests already in flight on this connection` } });
    s.data.inFlight++;
    s.data.queue.push(req);
  }

  /**
   * Starts the queued requests in order, one per event-loop turn: a call that finishes on this loop
   * (a prepared acquire: a symlink and a rename, 0.3–1 ms under running guests) is answered before
   * the next one starts, where a burst read in one chunk (a fork's children) had every reply wait
   * for the last one's work.
   */
  private drain(s: Socket<Conn>): void {
    if (s.data.draining) return;
    const req = s.data.queue.shift();
    if (!req) return;
    void this.serve(s, req);
    if (!s.data.queue.length) return;
    s.data.draining = true;
    setImmediate(() => {
      s.data.draining = false;
      this.drain(s);
    });
  }

  private async serve(s: Socket<Conn>, req: Request): Promise<void> {
    const params = req.params && typeof req.params === "object" ? req.params : {};
    // Shutdown waits for the calls running when it began; one queued behind them does not start.
    const run = this.stopped ? Promise.reject(new BlockdError("ShuttingDown", `blockd is shutting down: ${req.method} not started`)) : this.dispatch(req.method, params);
    this.running.add(run);
    try {
      reply(s, { v: PROTOCOL_VERSION, id: req.id, result: await run });
    } catch (e) {
      reply(s, { v: PROTOCOL_VERSION, id: req.id, error: errorOf(e) });
    } finally {
      this.running.delete(run);
      s.data.inFlight--;
    }
  }
}

/** A reply that cannot be encoded (too large) goes as its error; a peer that does not read is cut off. */
function reply(s: Socket<Conn>, r: Reply): void {
  let frame: Uint8Array;
  try {
    frame = encodeFrame(r);
  } catch (e) {
    frame = encodeFrame({ v: r.v, id: r.id, error: errorOf(e) });
  }
  try {
    s.data.writer.send(frame);
  } catch {
    s.end();
  }
}
