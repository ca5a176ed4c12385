// blockd's side of the fd keeper: start it when absent, park FUSE fds there, take them back.

import { existsSync, openSync, readFileSync } from "node:fs";
import { join } from "node:path";
import type { Socket } from "bun";
import { takeFdFrom } from "../../ffi/libc.ts";

export class KeeperClient {
  private buf = "";
  private waiting: ((v: any) => void)[] = [];

  private constructor(
    private socket: Socket<undefined>,
    readonly pid: number,
  ) {}

  static async ensure(stateDir: string): Promise<KeeperClient> {
    const sock = join(stateDir, "keeper.sock");
    const pidFile = join(stateDir, "keeper.pid");
    const connect = async () => {
      if (!existsSync(sock) || !existsSync(pidFile)) return undefined;
      let k!: KeeperClient;
      try {
        const s = await Bun.connect({ unix: sock, socket: { data: (_s, c) => k.onData(c) } });
        k = new KeeperClient(s, Number(readFileSync(pidFile, "utf8")));
        await k.call({ op: "list" });
        return k;
      } catch {
        return undefined;
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
    throw new Error(`fd keeper did not start; see ${join(stateDir, "keeper.log")}`);
  }

  private onData(c: Uint8Array): void {
    this.buf += new TextDecoder().decode(c);
    let nl: number;
    while ((nl = this.buf.indexOf("\n")) >= 0) {
      const line = this.buf.slice(0, nl);
      this.buf = this.buf.slice(nl + 1);
      this.waiting.shift()?.(JSON.parse(line));
    }
  }

  private async call(req: Record<string, unknown>): Promise<any> {
    const r = await new Promise<any>((resolve) => {
      this.waiting.push(resolve);
      this.socket.write(JSON.stringify(req) + "\n");
    });
    if (!r.ok) throw new Error(`fd keeper: ${r.error}`);
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
    this.socket.end();
  }
}
