// blockd's side of the fd keeper: start it when absent, park FUSE fds there, take them back.
// The keeper answers JSON lines in order, so a call's number is its place in that order; every
// call ends with its reply, a BlockdTimeoutError, or a BlockdConnectionError when the keeper goes.

import { existsSync, openSync } from "node:fs";
import { readFile } from "node:fs/promises";
import { join } from "node:path";
import { takeFdFrom } from "../../ffi/libc.ts";
import { BlockdConnectionError, BlockdError, ClientLink, MAX_FRAME } from "./protocol.ts";

/** The keeper only dups fds: 10 s without a reply means it is stuck. */
export const KEEPER_TIMEOUT_MS = 10_000;

export class KeeperClient {
  private buf = "";
  private sent = 0;
  private answered = 0;

  private constructor(
    private link: ClientLink,
    readonly pid: number,
    private timeoutMs: number,
  ) {}

  /** Connect to a keeper listening on sock (pid: its process, whose fds take() copies). */
  static async connect(sock: string, pid: number, opts: { timeoutMs?: number } = {}): Promise<KeeperClient> {
    let k!: KeeperClient;
    const link = await ClientLink.connect("fd keeper", sock, (c) => k.onData(c));
    k = new KeeperClient(link, pid, opts.timeoutMs ?? KEEPER_TIMEOUT_MS);
    return k;
  }

  static async ensure(stateDir: string, opts: { timeoutMs?: number } = {}): Promise<KeeperClient> {
    const sock = join(stateDir, "keeper.sock");
    const pidFile = join(stateDir, "keeper.pid");
    const connect = async () => {
      if (!existsSync(sock) || !existsSync(pidFile)) return undefined;
      let k: KeeperClient;
      try {
        k = await KeeperClient.connect(sock, Number(await readFile(pidFile, "utf8")), opts);
      } catch {
        return undefined; // nobody listens (yet)
      }
      try {
        await k.call({ op: "list" });
        return k;
      } catch (e) {
        k.close();
        if (e instanceof BlockdConnectionError) return undefined;
        throw e; // a keeper that listens but does not answer: starting a second one would split the fds
      }
    };
    const k = await connect();
    if (k) return k;
    const log = openSync(join(stateDir, "keeper.log"), "a");
    Bun.spawn([process.execPath, join(import.meta.dir, "fd_keeper.ts"), stateDir], { stdio: ["ignore", log, log], detached: true }).unref();
    for (let i = 0; i < 200; i++) {
      await Bun.sleep(25);
      const c = await connect();
      if (c) return c;
    }
    throw new BlockdError("KeeperFailed", `fd keeper did not start; see ${join(stateDir, "keeper.log")}`);
  }

  private onData(c: Uint8Array): void {
    this.buf += new TextDecoder().decode(c);
    if (this.buf.length > MAX_FRAME) throw new Error(`a reply line over ${MAX_FRAME} bytes`);
    let nl: number;
    while ((nl = this.buf.indexOf("\n")) >= 0) {
      const line = this.buf.slice(0, nl);
      this.buf = this.buf.slice(nl + 1);
      this.link.calls.settle(++this.answered, JSON.parse(line)); // a late reply to a timed-out call is dropped
    }
  }

  private async call(req: { op: string } & Record<string, unknown>): Promise<any> {
    const r = (await this.link.call(++this.sent, req.op, this.timeoutMs, new TextEncoder().encode(JSON.stringify(req) + "\n"))) as { ok?: boolean; error?: string };
    if (!r?.ok) throw new BlockdError("KeeperFailed", `fd keeper ${req.op}: ${r?.error}`);
    return r;
  }

  /** Park copies of our fds under key (replacing what it held). */
  async hold(key: string, fds: number[]): Promise<void> {
    await this.call({ op: "hold", pid: process.pid, fds, key });
  }
  async drop(key: string): Promise<void> {
    await this.call({ op: "drop", key });
  }
  /** Our own copies of the fds parked under key, in the order given to hold, or undefined. */
  async take(key: string): Promise<number[] | undefined> {
    const { held } = await this.call({ op: "list" });
    const v = held[key] as number[] | number | undefined; // a keeper from before clones held one fd
    return v === undefined ? undefined : (Array.isArray(v) ? v : [v]).map((fd) => takeFdFrom(this.pid, fd));
  }
  /** The keys the keeper holds fds under. */
  async keys(): Promise<string[]> {
    const { held } = await this.call({ op: "list" });
    return Object.keys(held);
  }
  /** Let the keeper go when it holds nothing (graceful shutdown). */
  async exitIfEmpty(): Promise<void> {
    const { held } = await this.call({ op: "list" });
    if (Object.keys(held).length === 0) {
      try {
        process.kill(this.pid, "SIGTERM");
      } catch {}
    }
  }

  close(): void {
    this.link.fail("closed by this client");
  }
}
