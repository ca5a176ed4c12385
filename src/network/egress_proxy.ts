// The domain proxy: sandboxes' TCP connections to the proxied ports (80, 443, httpsPorts) of a
// sandbox with domain rules arrive here, redirected by the host table (egress.ts). For each one it
//   1. finds the sandbox by the source address (the slot's nsIp) and the original destination
//      (SO_ORIGINAL_DST, ffi/socket.ts);
//   2. reads the name it claims (TLS SNI or HTTP Host, sniff.ts), nothing decrypted;
//   3. decides with the sandbox's policy (policy.ts); a connection allowed by a domain rule must
//      go to an address the name resolves to on the host (the node's resolvers), else it is refused;
//   4. connects to the original destination from the host and passes bytes both ways.
// A refused HTTP request gets a 403, a refused TLS connection is closed. Refusals are counted and
// logged per sandbox. A policy change (Egress.onChange) closes the slot's connections it now refuses.

import { originalDst } from "../../ffi/socket.ts";
import { resolve4 } from "./dns.ts";
import type { AppliedPolicy, Egress } from "./egress.ts";
import { MAX_SNIFF_BYTES, sniff } from "./sniff.ts";

export interface EgressProxyOptions {
  /** TCP port on every host address (0: any free one); connections not redirected from a slot are closed. */
  port?: number;
  hostname?: string;
  /** The node's DNS servers (ip or ip:port), asked to check that a name owns the destination. */
  resolvers: string[];
  /** Connections open at once; more are closed at once. */
  maxConnections?: number;
}

/** The first bytes must name the host within this. */
export const SNIFF_TIMEOUT_MS = 5_000;
export const CONNECT_TIMEOUT_MS = 10_000;
/** A connection idle this long is closed (as the node's inbound proxy: E2B uses 620 s). */
export const IDLE_TIMEOUT_S = 620;
export const DEFAULT_MAX_CONNECTIONS = 4096;
/** Name → addresses answers are kept this long, at most this many. */
const DNS_CACHE_MS = 30_000;
const DNS_CACHE_ENTRIES = 4096;
/** Sandboxes whose counts are kept (the oldest goes first). */
const STATS_SANDBOXES = 4096;
/** Refusals kept per sandbox for `stats`. */
const RECENT_DENIALS = 32;
/** Bytes queued towards a socket that cannot take more before its source is paused. */
const HIGH_WATER = 1 << 20;

export interface Denial {
  at: number;
  name: string | undefined;
  destination: string;
  reason: string;
}

export interface SandboxEgressStats {
  allowed: number;
  denied: number;
  recent: Denial[];
}

type Sock = Bun.Socket<Conn>;

interface Side {
  sock: Sock | undefined;
  /** The other side sent its FIN: pass it on once the queue is written. */
  finPending: boolean;
  /** Bytes the socket did not take yet. */
  queue: Buffer[];
  queued: number;
}

interface Conn {
  nsIp: string;
  dst: { address: string; port: number };
  name: string | undefined;
  state: "sniff" | "deciding" | "connecting" | "open" | "closed";
  head: Buffer[];
  headLen: number;
  client: Side;
  upstream: Side;
  timer: Timer | undefined;
}

export class EgressProxy {
  private server: Bun.TCPSocketListener<Conn> | undefined;
  private egress: Egress | undefined;
  private readonly conns = new Set<Conn>();
  private readonly stats = new Map<string, SandboxEgressStats>();
  private readonly dnsCache = new Map<string, { ips: string[]; until: number }>();
  private readonly maxConnections: number;

  constructor(private readonly opts: EgressProxyOptions) {
    this.maxConnections = opts.maxConnections ?? DEFAULT_MAX_CONNECTIONS;
  }

  /** Starts listening; the port is then `port`. */
  listen(): this {
    this.server = Bun.listen<Conn>({
      hostname: this.opts.hostname ?? "0.0.0.0",
      port: this.opts.port ?? 0,
      // A client that half-closes after its request (nc, HTTP/1.0 tools) still gets the answer.
      allowHalfOpen: true,
      socket: {
        open: (s) => this.accept(s),
        data: (s, d) => this.fromClient(s.data, Buffer.from(d)),
        drain: (s) => this.drained(s.data, s.data.client),
        end: (s) => this.ended(s.data, s.data.upstream),
        close: (s) => this.close(s.data),
        error: (s) => this.close(s.data),
        timeout: (s) => this.close(s.data),
      },
    });
    return this;
  }

  get port(): number {
    return this.server?.port ?? 0;
  }

  /** The policies to judge by, and the changes that re-judge open connections. */
  use(egress: Egress): void {
    this.egress = egress;
    egress.onChange((nsIp, now) => this.rejudge(nsIp, now));
  }

  /** Allowed and refused connections of a sandbox so far, with the latest refusals. */
  statsOf(sandboxId: string): SandboxEgressStats {
    return this.stats.get(sandboxId) ?? { allowed: 0, denied: 0, recent: [] };
  }

  get openConnections(): number {
    return this.conns.size;
  }

  stop(): void {
    this.server?.stop(true);
    for (const c of [...this.conns]) this.close(c);
  }

  private accept(s: Sock): void {
    const c: Conn = {
      nsIp: s.remoteAddress, dst: { address: "", port: 0 }, name: undefined, state: "sniff", head: [], headLen: 0,
      client: { sock: s, queue: [], queued: 0, finPending: false }, upstream: { sock: undefined, queue: [], queued: 0, finPending: false }, timer: undefined,
    };
    s.data = c;
    if (this.conns.size >= this.maxConnections || !this.egress?.bySource(c.nsIp)) return void s.terminate();
    try {
      // Bun has the accepted socket's fd, but its types do not say so yet.
      c.dst = originalDst((s as unknown as { fd: number }).fd);
    } catch {
      return void s.terminate(); // not redirected by the host table: nothing to do with us
    }
    this.conns.add(c);
    s.timeout(IDLE_TIMEOUT_S);
    c.timer = setTimeout(() => this.refuse(c, "no name within the first bytes' deadline"), SNIFF_TIMEOUT_MS);
  }

  private fromClient(c: Conn, d: Buffer): void {
    if (c.state === "closed") return;
    if (c.state === "open") return this.send(c, c.upstream, c.client, d);
    if (c.state !== "sniff") {
      // Deciding or connecting: keep it (bounded) for the upstream.
      c.head.push(d);
      c.headLen += d.length;
      if (c.headLen > MAX_SNIFF_BYTES + HIGH_WATER) this.close(c);
      return;
    }
    c.head.push(d);
    c.headLen += d.length;
    const got = sniff(Buffer.concat(c.head));
    if (got.kind === "more") return;
    clearTimeout(c.timer);
    c.state = "deciding";
    c.name = got.kind === "unknown" ? undefined : got.name;
    void this.decide(c, got.kind === "http");
  }

  private async decide(c: Conn, http: boolean): Promise<void> {
    const a = this.egress?.bySource(c.nsIp);
    if (!a) return this.refuse(c, "the sandbox has no policy", http);
    const d = a.matcher.decide(c.dst.address, c.name);
    if (!d.allow) return this.refuse(c, `${d.by}${d.domain ? ` ${d.domain}` : ""}`, http);
    if (d.domain) {
      let ips: string[];
      try {
        ips = await this.resolve(c.name!);
      } catch (e) {
        return this.refuse(c, `resolving ${c.name}: ${(e as Error).message}`, http);
      }
      if (!ips.includes(c.dst.address)) return this.refuse(c, `${c.name} does not resolve to ${c.dst.address} (${ips.join(", ") || "no addresses"})`, http);
    }
    if (c.state !== "deciding") return; // the client left meanwhile
    this.count(a.sandboxId, true);
    c.state = "connecting";
    c.timer = setTimeout(() => this.close(c), CONNECT_TIMEOUT_MS);
    try {
      const up = await Bun.connect<Conn>({
        hostname: c.dst.address,
        port: c.dst.port,
        data: c,
        allowHalfOpen: true,
        socket: {
          data: (_s, b) => this.send(c, c.client, c.upstream, Buffer.from(b)),
          drain: (_s) => this.drained(c, c.upstream),
          end: () => this.ended(c, c.client),
          close: () => this.close(c),
          error: () => this.close(c),
        },
      });
      clearTimeout(c.timer);
      if (c.state !== "connecting") return void up.terminate();
      c.upstream.sock = up;
      c.state = "open";
      const head = Buffer.concat(c.head);
      c.head = [];
      c.headLen = 0;
      this.send(c, c.upstream, c.client, head);
      if (c.upstream.finPending) this.ended(c, c.upstream);
    } catch {
      this.close(c);
    }
  }

  /** Writes `d` to `to`, queueing what it does not take and pausing `from` past HIGH_WATER. */
  private send(c: Conn, to: Side, from: Side, d: Buffer): void {
    if (!to.sock || c.state === "closed") return;
    if (to.queued === 0) {
      const n = to.sock.write(d);
      if (n === d.length) return;
      d = d.subarray(Math.max(0, n));
    }
    to.queue.push(d);
    to.queued += d.length;
    if (to.queued > HIGH_WATER) from.sock?.pause();
  }

  /** `side`'s socket takes more: flush its queue, resume the other side once it is empty. */
  private drained(c: Conn, side: Side): void {
    while (side.queue.length && side.sock) {
      const d = side.queue[0]!;
      const n = side.sock.write(d);
      side.queued -= Math.max(0, n);
      if (n < d.length) {
        side.queue[0] = d.subarray(Math.max(0, n));
        return;
      }
      side.queue.shift();
    }
    const other = side === c.client ? c.upstream : c.client;
    other.sock?.resume();
    if (side.finPending) this.ended(c, side);
  }

  /**
   * The peer of `to`'s opposite side sent its FIN: `to` gets one too once its queue is written.
   * A client that ends before naming its host is judged on what it sent.
   */
  private ended(c: Conn, to: Side): void {
    if (c.state === "closed") return;
    to.finPending = true;
    if (c.state === "sniff" && to === c.upstream) {
      clearTimeout(c.timer);
      c.state = "deciding";
      const got = sniff(Buffer.concat(c.head));
      c.name = got.kind === "http" || got.kind === "tls" ? got.name : undefined;
      return void this.decide(c, got.kind === "http");
    }
    if (!to.sock || to.queued > 0) return; // not connected yet, or still writing: later
    to.sock.shutdown();
    const other = to === c.client ? c.upstream : c.client;
    if (other.finPending && other.queued === 0) this.close(c); // both directions done
  }

  private refuse(c: Conn, reason: string, http = false): void {
    if (c.state === "closed") return;
    const a = this.egress?.bySource(c.nsIp);
    const destination = `${c.dst.address}:${c.dst.port}`;
    if (a) this.count(a.sandboxId, false, { at: Date.now(), name: c.name, destination, reason });
    console.error(`egress: sandbox ${a?.sandboxId ?? c.nsIp}: refused ${c.name ?? "(no name)"} → ${destination}: ${reason}`);
    if (http && c.client.sock) {
      const body = `egress to ${c.name ?? destination} is refused by the sandbox's network policy\n`;
      c.client.sock.write(`HTTP/1.1 403 Forbidden\r\nContent-Type: text/plain\r\nContent-Length: ${body.length}\r\nConnection: close\r\n\r\n${body}`);
      c.client.sock.end();
      c.state = "closed";
      clearTimeout(c.timer);
      this.conns.delete(c);
      return;
    }
    this.close(c);
  }

  private close(c: Conn | undefined): void {
    if (!c || c.state === "closed") {
      if (c) this.conns.delete(c);
      return;
    }
    c.state = "closed";
    clearTimeout(c.timer);
    this.conns.delete(c);
    c.client.sock?.terminate();
    c.upstream.sock?.terminate();
  }

  private count(sandboxId: string, allowed: boolean, denial?: Denial): void {
    let s = this.stats.get(sandboxId);
    if (!s) {
      if (this.stats.size >= STATS_SANDBOXES) this.stats.delete(this.stats.keys().next().value!);
      this.stats.set(sandboxId, (s = { allowed: 0, denied: 0, recent: [] }));
    }
    if (allowed) s.allowed++;
    else s.denied++;
    if (denial) {
      s.recent.push(denial);
      if (s.recent.length > RECENT_DENIALS) s.recent.shift();
    }
  }

  /** A policy changed (or went): the slot's connections it refuses now are closed. */
  private rejudge(nsIp: string, now: AppliedPolicy | undefined): void {
    for (const c of [...this.conns]) {
      if (c.nsIp !== nsIp || c.state === "sniff") continue;
      if (!now) {
        this.close(c);
        continue;
      }
      if (!now.matcher.decide(c.dst.address, c.name).allow) this.refuse(c, "refused by the new policy");
    }
  }

  private async resolve(name: string): Promise<string[]> {
    const hit = this.dnsCache.get(name);
    if (hit && hit.until > Date.now()) return hit.ips;
    const ips = await resolve4(name, this.opts.resolvers);
    if (this.dnsCache.size >= DNS_CACHE_ENTRIES) this.dnsCache.delete(this.dnsCache.keys().next().value!);
    this.dnsCache.set(name, { ips, until: Date.now() + DNS_CACHE_MS });
    return ips;
  }
}
