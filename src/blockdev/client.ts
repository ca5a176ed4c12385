// BlockdClient: the node's side of blockd's socket. The node starts blockd when it is not
// running and reconnects when it is; blockd outlives the node.

import { existsSync, openSync } from "node:fs";
import { join } from "node:path";
import type { Socket } from "bun";
import { BlockdError, FrameReader, PROTOCOL_VERSION, encodeFrame, type Reply } from "./protocol.ts";

export class BlockdClient {
  private nextId = 0;
  private waiting = new Map<number, { resolve: (v: unknown) => void; reject: (e: Error) => void }>();
  private reader = new FrameReader();

  private constructor(private socket: Socket<undefined>) {}

  static async connect(socketPath: string): Promise<BlockdClient> {
    let client!: BlockdClient;
    const socket = await Bun.connect({
      unix: socketPath,
      socket: {
        data: (_s, chunk) => client.onData(chunk),
        close: () => client.failAll(new BlockdError("Disconnected", "blockd closed the connection")),
        error: (_s, e) => client.failAll(e),
      },
    });
    client = new BlockdClient(socket);
    return client;
  }

  /** Connect to the blockd of stateDir, starting one (detached, outliving us) when none answers. */
  static async ensure(stateDir: string, opts: { pool?: number; timeoutMs?: number } = {}): Promise<BlockdClient> {
    const sock = join(stateDir, "blockd.sock");
    const tryConnect = async () => {
      if (!existsSync(sock)) return undefined;
      try {
        const c = await BlockdClient.connect(sock);
        await c.call("hello");
        return c;
      } catch {
        return undefined;
      }
    };
    const existing = await tryConnect();
    if (existing) return existing;
    const log = openSync(join(stateDir, "blockd.log"), "a");
    const proc = Bun.spawn([process.execPath, join(import.meta.dir, "main.ts"), "--state", stateDir, "--pool", String(opts.pool ?? 0)], {
      stdio: ["ignore", log, log],
      detached: true,
    });
    proc.unref();
    const until = Date.now() + (opts.timeoutMs ?? 15_000);
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
      const w = this.waiting.get(r.id);
      if (!w) continue;
      this.waiting.delete(r.id);
      if (r.error) w.reject(new BlockdError(r.error.code, r.error.message));
      else w.resolve(r.result);
    }
  }

  private failAll(e: Error): void {
    for (const w of this.waiting.values()) w.reject(e);
    this.waiting.clear();
  }

  call<T = any>(method: string, params: Record<string, unknown> = {}): Promise<T> {
    const id = ++this.nextId;
    return new Promise<T>((resolve, reject) => {
      this.waiting.set(id, { resolve: resolve as (v: unknown) => void, reject });
      this.socket.write(encodeFrame({ v: PROTOCOL_VERSION, id, method, params }));
    });
  }

  /** Raw bytes on the socket (tests of malformed input). */
  sendRaw(bytes: Uint8Array): void {
    this.socket.write(bytes);
  }

  close(): void {
    this.socket.end();
  }
}
