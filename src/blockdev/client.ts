// BlockdClient: the node's side of blockd's socket. The node starts blockd when it is not
// running and reconnects when it is; blockd outlives the node. Every call ends: with its reply,
// a BlockdTimeoutError, or a BlockdConnectionError when blockd goes away.

import { existsSync, openSync } from "node:fs";
import { join } from "node:path";
import { BlockdConnectionError, BlockdError, ClientLink, FrameReader, PROTOCOL_VERSION, encodeFrame, type Reply } from "./protocol.ts";

/** A control call answers in milliseconds; 30 s without a reply means blockd is stuck. */
export const CALL_TIMEOUT_MS = 30_000;
/** Calls that open, seal or flush images (their cost follows the layers' indexes and the disk). */
export const SLOW_CALL_TIMEOUT_MS = 120_000;
const SLOW_CALLS = new Set(["create", "createReadOnly", "restack", "acquire", "release", "delete", "prepare", "memoryLayer"]);

/**
 * blockd's own settings, which it reads from its environment (a separate process that outlives the
 * node): the node passes its values when it starts blockd; a running blockd keeps those it started with.
 */
export interface BlockdSettings {
  /** AENV_BLOCKD_FRONTEND; auto: ublk when ublk_drv is loaded, else FUSE. */
  frontend: "auto" | "fuse" | "ublk";
  /** AENV_FUSE_URING: FUSE over io_uring for the devices it mounts. */
  fuseUring: boolean;
  /** AENV_FUSE_READER_SLOTS: 0..64 requests a device's reader thread takes; 0: no reader. */
  fuseReaderSlots: number;
}

/**
 * Threads of blockd's pool for async file calls (UV_THREADPOOL_SIZE, read at its start; the
 * environment's value wins): Bun's default is 2 on a 2-core host, and two fsyncs (a table write, an
 * above.json) would then hold an acquire's rename behind them.
 */
const BLOCKD_FS_THREADS = "16";

/** The environment that carries BlockdSettings to a blockd process. */
export function blockdEnv(s: BlockdSettings): Record<string, string> {
  return { AENV_BLOCKD_FRONTEND: s.frontend, AENV_FUSE_URING: s.fuseUring ? "1" : "0", AENV_FUSE_READER_SLOTS: String(s.fuseReaderSlots) };
}

export interface BlockdClientOptions {
  /** Timeout of a call (default CALL_TIMEOUT_MS). */
  timeoutMs?: number;
  /** Timeout of the calls in SLOW_CALLS (default SLOW_CALL_TIMEOUT_MS). */
  slowTimeoutMs?: number;
}

export class BlockdClient {
  private nextId = 0;
  private reader = new FrameReader();
  private readonly pending = new Map<string, number>();

  private constructor(
    private link: ClientLink,
    private opts: BlockdClientOptions,
  ) {}

  static async connect(socketPath: string, opts: BlockdClientOptions = {}): Promise<BlockdClient> {
    let client!: BlockdClient;
    const link = await ClientLink.connect("blockd", socketPath, (chunk) => client.onData(chunk));
    client = new BlockdClient(link, opts);
    return client;
  }

  /**
   * Connect to the blockd of stateDir, starting one (detached, outliving us) when none listens.
   * A blockd that listens but does not answer is an error, not a reason to start a second one.
   * `settings` go to a blockd started here; without them it inherits this process's environment.
   */
  static async ensure(stateDir: string, opts: BlockdClientOptions & { pool?: number; startTimeoutMs?: number; settings?: BlockdSettings } = {}): Promise<BlockdClient> {
    const sock = join(stateDir, "blockd.sock");
    const tryConnect = async () => {
      if (!existsSync(sock)) return undefined;
      let c: BlockdClient;
      try {
        c = await BlockdClient.connect(sock, opts);
      } catch {
        return undefined; // nobody listens (yet)
      }
      try {
        await c.call("hello");
        return c;
      } catch (e) {
        c.close();
        if (e instanceof BlockdConnectionError) return undefined; // it went away while we asked
        throw e;
      }
    };
    const existing = await tryConnect();
    if (existing) return existing;
    const log = openSync(join(stateDir, "blockd.log"), "a");
    const proc = Bun.spawn([process.execPath, join(import.meta.dir, "main.ts"), "--state", stateDir, "--pool", String(opts.pool ?? 0)], {
      stdio: ["ignore", log, log],
      detached: true,
      // As it is now (Bun's default is the environment we started with), then the settings.
      env: { UV_THREADPOOL_SIZE: BLOCKD_FS_THREADS, ...process.env, ...(opts.settings ? blockdEnv(opts.settings) : {}) },
    });
    proc.unref();
    const until = Date.now() + (opts.startTimeoutMs ?? 15_000);
    while (Date.now() < until) {
      const c = await tryConnect();
      if (c) return c;
      await Bun.sleep(50);
    }
    throw new BlockdError("StartFailed", `blockd did not answer on ${sock}; see ${join(stateDir, "blockd.log")}`);
  }

  private onData(chunk: Uint8Array): void {
    for (const f of this.reader.push(chunk)) {
      const r = JSON.parse(new TextDecoder().decode(f)) as Reply;
      if (r.error) this.link.calls.settle(r.id, undefined, new BlockdError(r.error.code, r.error.message));
      else this.link.calls.settle(r.id, r.result);
    }
  }

  /** One call; rejects with BlockdTimeoutError after its timeout, BlockdConnectionError when blockd goes. */
  call<T = any>(method: string, params: Record<string, unknown> = {}, o: { timeoutMs?: number } = {}): Promise<T> {
    const id = ++this.nextId;
    const timeoutMs = o.timeoutMs ?? (SLOW_CALLS.has(method) ? (this.opts.slowTimeoutMs ?? SLOW_CALL_TIMEOUT_MS) : (this.opts.timeoutMs ?? CALL_TIMEOUT_MS));
    const p = this.link.call(id, method, timeoutMs, encodeFrame({ v: PROTOCOL_VERSION, id, method, params })) as Promise<T>;
    this.pending.set(method, (this.pending.get(method) ?? 0) + 1);
    const done = () => void this.pending.set(method, this.pending.get(method)! - 1);
    p.then(done, done);
    return p;
  }

  /** Calls of `method` sent and not yet answered (or timed out). */
  inFlight(method: string): number {
    return this.pending.get(method) ?? 0;
  }

  /** Raw bytes on the socket (tests of malformed input). */
  sendRaw(bytes: Uint8Array): void {
    this.link.sendRaw(bytes);
  }

  close(): void {
    this.link.fail("closed by this client");
  }
}
