// etcd members for one machine (`bun run cluster` and the tests): Debian's `etcd` binary, 1 or 3
// members on one address, client port `basePort + 2i`, peer port `basePort + 2i + 1`, data under
// `dir/member-i`. Members are their own process groups: a stop of the caller leaves nothing behind
// only when it calls stop().
import { mkdirSync } from "node:fs";
import { join } from "node:path";
import type { Subprocess } from "bun";

/** A member answers /health within this after its start (a fresh 3-member cluster elects in ~1 s). */
const START_TIMEOUT_MS = 30_000;

export interface EtcdMembersOptions {
  dir: string;
  members: 1 | 3;
  /** Address the members listen on (loopback for tests; the cluster bridge's for `bun run cluster`). */
  host: string;
  basePort: number;
  /** Lines of each member's log kept (for failure messages). */
  logLines?: number;
}

export class EtcdMembers {
  private readonly procs: (Subprocess | undefined)[] = [];
  readonly logs: string[][] = [];

  private constructor(private readonly o: EtcdMembersOptions) {}

  static async start(o: EtcdMembersOptions): Promise<EtcdMembers> {
    if (!Bun.which("etcd")) throw new Error("etcd is missing: install Debian's etcd-server (see .ci/deps)");
    const m = new EtcdMembers(o);
    for (let i = 0; i < o.members; i++) m.spawn(i, "new");
    await m.healthy(START_TIMEOUT_MS);
    return m;
  }

  clientUrl(i: number): string {
    return `http://${this.o.host}:${this.o.basePort + 2 * i}`;
  }

  private peerUrl(i: number): string {
    return `http://${this.o.host}:${this.o.basePort + 2 * i + 1}`;
  }

  /** The client endpoints, comma-separated (AENV_CLUSTER's form). */
  get endpoints(): string {
    return Array.from({ length: this.o.members }, (_, i) => this.clientUrl(i)).join(",");
  }

  pid(i: number): number | undefined {
    return this.procs[i]?.pid;
  }

  private spawn(i: number, state: "new" | "existing"): void {
    const data = join(this.o.dir, `member-${i}`);
    mkdirSync(data, { recursive: true, mode: 0o700 });
    const cluster = Array.from({ length: this.o.members }, (_, k) => `m${k}=${this.peerUrl(k)}`).join(",");
    const log: string[] = (this.logs[i] = this.logs[i] ?? []);
    const keep = this.o.logLines ?? 200;
    const p = Bun.spawn(["etcd",
      "--name", `m${i}`, "--data-dir", data,
      "--listen-client-urls", this.clientUrl(i), "--advertise-client-urls", this.clientUrl(i),
      "--listen-peer-urls", this.peerUrl(i), "--initial-advertise-peer-urls", this.peerUrl(i),
      "--initial-cluster", cluster, "--initial-cluster-state", state, "--initial-cluster-token", "aenv",
      // Elections in ~1 s on a busy 2-core machine: a 100 ms heartbeat, a 1 s election timeout.
      "--heartbeat-interval", "100", "--election-timeout", "1000",
      "--auto-compaction-mode", "revision", "--auto-compaction-retention", "10000",
      "--logger", "zap", "--log-level", "warn",
    ], { stdout: "ignore", stderr: "pipe" });
    this.procs[i] = p;
    void (async () => {
      const dec = new TextDecoder();
      for await (const c of p.stderr as ReadableStream<Uint8Array>) {
        for (const line of dec.decode(c).split("\n")) if (line) { log.push(line); if (log.length > keep) log.shift(); }
      }
    })().catch(() => {});
  }

  /** Every running member answers /health with true (a quorum and a leader). */
  async healthy(timeoutMs: number): Promise<void> {
    const until = performance.now() + timeoutMs;
    for (;;) {
      let ok = true;
      for (let i = 0; i < this.o.members; i++) {
        if (!this.procs[i] || this.procs[i]!.exitCode !== null) continue;
        try {
          const r = await fetch(`${this.clientUrl(i)}/health`, { signal: AbortSignal.timeout(1000) });
          const j = (await r.json()) as { health?: string };
          if (j.health !== "true") ok = false;
        } catch {
          ok = false;
        }
      }
      if (ok) return;
      if (performance.now() > until) {
        const states = this.procs.map((p, i) => `m${i}: ${p ? (p.exitCode === null ? "running" : `exited ${p.exitCode}`) : "stopped"}`).join(", ");
        throw new Error(`etcd not healthy in ${timeoutMs} ms (${states}):\n${this.logs.map((l, i) => l.slice(-4).map((x) => `m${i} ${x}`).join("\n")).join("\n")}`);
      }
      await Bun.sleep(100);
    }
  }

  /** The member that leads now, by asking each its status. */
  async leader(): Promise<number | undefined> {
    for (let i = 0; i < this.o.members; i++) {
      try {
        const r = await fetch(`${this.clientUrl(i)}/v3/maintenance/status`, { method: "POST", body: "{}", signal: AbortSignal.timeout(1000) });
        const j = (await r.json()) as { header?: { member_id?: string }; leader?: string };
        if (j.leader && j.leader === j.header?.member_id) return i;
      } catch { /* down */ }
    }
    return undefined;
  }

  /** SIGKILL member i. */
  async kill(i: number): Promise<void> {
    const p = this.procs[i];
    if (!p) return;
    p.kill(9);
    await p.exited;
    this.procs[i] = undefined;
  }

  /** Starts member i again on its data. */
  restart(i: number): void {
    if (this.procs[i]) return;
    this.spawn(i, "existing");
  }

  async stop(): Promise<void> {
    for (let i = 0; i < this.procs.length; i++) await this.kill(i);
  }
}
