// The domain proxy: sandboxes' TCP connections redirected by the host table (egress.ts) arrive
// here: those to the proxied ports (80, 443, httpsPorts) of a sandbox with domain or header rules,
// and every TCP connection of a sandbox with an egress proxy. For each one it
//   1. finds the sandbox by the source address (the slot's nsIp) and the original destination
//      (SO_ORIGINAL_DST, ffi/socket.ts);
//   2. on a proxied port, reads the name it claims (TLS SNI or HTTP Host, sniff.ts), nothing
//      decrypted; other ports (egress proxy only) are judged by address alone;
//   3. decides with the sandbox's policy (policy.ts); a connection allowed by a domain rule, or one
//      that header rules apply to, must go to an address the name resolves to on the host (the
//      node's resolvers), else it is refused;
//   4. connects to the original destination from the host, or through the sandbox's egress proxy
//      (upstream.ts: SOCKS5 or HTTP CONNECT; by name when the name was checked, else by address),
//      and passes bytes both ways:
//        pass  as they are: through this thread for the first SPLICE_AFTER bytes, then by the kernel
//              (splice_relay.ts: splice(2) on a Worker, no copy through user memory);
//        http  header rules apply: every request is parsed (http_rewrite.ts), must name the host
//              the connection was judged by (else 421), and gets the rules' headers;
//        tls   a rule says `tls: "terminate"`: the proxy connects to the server over TLS, checking
//              its certificate against the host's trust store (plus `upstreamCa`), then answers the
//              sandbox's handshake with a leaf for the name from the node's CA (x509.ts) and
//              carries the requests as in http.
// A refused HTTP request gets a 403, a refused TLS connection is closed. Refusals are counted and
// logged per sandbox (names and reasons, never header values). A policy change (Egress.onChange)
// closes the slot's connections it now refuses, or would carry another way or through another proxy.

import { Duplex } from "node:stream";
import tls from "node:tls";
import { originalDst, setCongestion } from "../../ffi/socket.ts";
import { resolve4 } from "./dns.ts";
import type { AppliedPolicy, Egress } from "./egress.ts";
import { MAX_PENDING, RequestRewriter, type HeadDecision, type RequestHead } from "./http_rewrite.ts";
import { rulesFor, type EgressPolicy, type UpstreamProxy } from "./policy.ts";
import type { SecretStore } from "./secrets.ts";
import { MAX_SNIFF_BYTES, sniff } from "./sniff.ts";
import { ENDED_AB, ENDED_BA, SPLICE_AFTER, SpliceRelay } from "./splice_relay.ts";
import { Tunnel } from "./upstream.ts";
import type { EgressCa } from "./x509.ts";

export interface EgressProxyOptions {
  /** TCP port on every host address (0: any free one); connections not redirected from a slot are closed. */
  port?: number;
  hostname?: string;
  /** The node's DNS servers (ip or ip:port), asked to check that a name owns the destination. */
  resolvers: string[];
  /** Connections open at once; more are closed at once. */
  maxConnections?: number;
  /** Where `secret:NAME` and `${e2b.secrets.NAME}` header values are read (the node's user secrets in $AENV_HOME/secrets/user). */
  secrets?: SecretStore;
  /** The node's CA: without it a `tls: "terminate"` rule is not applied (the TLS passes as it is). */
  ca?: EgressCa;
  /** PEM certificates trusted for servers besides the host's trust store (tests, private CAs). */
  upstreamCa?: string[];
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
/**
 * The congestion control of the proxy's sockets to sandboxes. bench/network's downloads through
 * the proxy, BBR → cubic: HTTP 1,220 → 1,340 MB/s, HTTPS 1,120 → 1,190, HTTP with a header rule
 * 1,080 → 1,310 (the kernel forwarding them directly: 1,550).
 */
const SANDBOX_LEG_CC = "cubic";
/** Bytes queued towards a socket that cannot take more before its source is paused. */
const HIGH_WATER = 1 << 20;
const STATUS_TEXT: Record<number, string> = { 400: "Bad Request", 403: "Forbidden", 421: "Misdirected Request", 431: "Request Header Fields Too Large", 502: "Bad Gateway" };

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
  /** A TLS engine's write waiting for the queue to drain below HIGH_WATER. */
  waiting?: () => void;
}

type Kind = "http" | "tls" | "none";
type Mode = "pass" | "http" | "tls";

/** A TLS engine over one side's raw socket: `input` carries the socket's bytes into `sock`. */
interface TlsEnd {
  sock: tls.TLSSocket;
  input: Duplex;
}

interface Conn {
  nsIp: string;
  dst: { address: string; port: number };
  name: string | undefined;
  /** What the first bytes were; "none" on ports not sniffed. */
  kind: Kind;
  mode: Mode;
  /** The egress proxy the connection leaves through (upstreamKey), "" when direct. */
  via: string;
  /** spliced: the kernel relay carries it (both sockets paused here). */
  state: "sniff" | "deciding" | "connecting" | "open" | "spliced" | "closed";
  head: Buffer[];
  headLen: number;
  client: Side;
  upstream: Side;
  timer: Timer | undefined;
  tunnel: Tunnel | undefined;
  rewriter: RequestRewriter | undefined;
  /** The client's FIN, waiting for the rewriter to pass on the requests it holds. */
  finAfterRequests: (() => void) | undefined;
  /** tls mode: the engine facing the server (a TLS client) and the one facing the sandbox (a TLS server). */
  tlsServer: TlsEnd | undefined;
  tlsGuest: TlsEnd | undefined;
  /** Bytes carried in pass mode so far (to SPLICE_AFTER), a hand-over waiting for setImmediate, the kernel relay's slot (-1: none). */
  carried: number;
  spliceSoon: boolean;
  relaySlot: number;
}

/** Bun has the socket's fd, but its types do not say so yet. */
const fdOf = (s: Sock) => (s as unknown as { fd: number }).fd;

const upstreamKey = (u: UpstreamProxy | undefined) => (u ? `${u.kind}://${u.username ?? ""}:${u.password ?? ""}@${u.host}:${u.port}` : "");

/** How a connection of this kind to `name` is carried under `policy`. */
function modeFor(policy: EgressPolicy, kind: Kind, name: string | undefined, canTerminate: boolean): Mode {
  const r = rulesFor(policy.rules, name);
  if (!r) return "pass";
  if (kind === "http") return "http";
  return kind === "tls" && r.terminateTls && canTerminate ? "tls" : "pass";
}

export class EgressProxy {
  private server: Bun.TCPSocketListener<Conn> | undefined;
  private egress: Egress | undefined;
  private readonly conns = new Set<Conn>();
  private readonly stats = new Map<string, SandboxEgressStats>();
  private readonly dnsCache = new Map<string, { ips: string[]; until: number }>();
  private readonly maxConnections: number;
  private relay: SpliceRelay | undefined;

  constructor(private readonly opts: EgressProxyOptions) {
    this.maxConnections = opts.maxConnections ?? DEFAULT_MAX_CONNECTIONS;
  }

  /** Starts listening; the port is then `port`. */
  listen(): this {
    try {
      this.relay = new SpliceRelay(this.maxConnections, IDLE_TIMEOUT_S * 1000);
    } catch (e) {
      console.error(`egress: no splice relay (${(e as Error).message}); connections are relayed in JavaScript`);
    }
    this.server = Bun.listen<Conn>({
      hostname: this.opts.hostname ?? "0.0.0.0",
      port: this.opts.port ?? 0,
      // A client that half-closes after its request (nc, HTTP/1.0 tools) still gets the answer.
      allowHalfOpen: true,
      socket: {
        open: (s) => this.accept(s),
        // Each `data` is a fresh Buffer (kept as it is: no copy on the hot path).
        data: (s, d) => this.fromClient(s.data, d),
        drain: (s) => this.drained(s.data, s.data.client),
        end: (s) => this.ended(s.data, s.data.upstream),
        close: (s) => this.lost(s.data),
        error: (s) => this.lost(s.data),
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

  /** Open connections the kernel relay carries. */
  get splicedConnections(): number {
    let n = 0;
    for (const c of this.conns) if (c.state === "spliced") n++;
    return n;
  }

  stop(): void {
    this.server?.stop(true);
    for (const c of [...this.conns]) this.close(c);
    this.relay?.stop();
  }

  private accept(s: Sock): void {
    const c: Conn = {
      nsIp: s.remoteAddress, dst: { address: "", port: 0 }, name: undefined, kind: "none", mode: "pass", via: "", state: "sniff", head: [], headLen: 0,
      client: { sock: s, queue: [], queued: 0, finPending: false }, upstream: { sock: undefined, queue: [], queued: 0, finPending: false }, timer: undefined,
      tunnel: undefined, rewriter: undefined, finAfterRequests: undefined, tlsServer: undefined, tlsGuest: undefined, carried: 0, spliceSoon: false, relaySlot: -1,
    };
    s.data = c;
    const a = this.egress?.bySource(c.nsIp);
    if (this.conns.size >= this.maxConnections || !a) return void s.terminate();
    try {
      c.dst = originalDst(fdOf(s));
    } catch {
      return void s.terminate(); // not redirected by the host table: nothing to do with us
    }
    // The leg to the sandbox is a link on this host (no loss, no queue, a µs round trip); the
    // host's congestion control (BBR here) paces it all the same, a timer per burst and the rate
    // held to its estimate, where cubic sends as the window allows (SANDBOX_LEG_CC's numbers).
    setCongestion(fdOf(s), SANDBOX_LEG_CC);
    this.conns.add(c);
    s.timeout(IDLE_TIMEOUT_S);
    if (!a.policy.proxiedPorts.includes(c.dst.port)) {
      // Redirected for the egress proxy only: no name to read (the server may speak first).
      c.state = "deciding";
      return void this.decide(c);
    }
    c.timer = setTimeout(() => this.refuse(c, "no name within the first bytes' deadline"), SNIFF_TIMEOUT_MS);
  }

  private fromClient(c: Conn, d: Buffer): void {
    if (c.state === "closed") return;
    if (c.state === "open") return this.clientBytes(c, d);
    if (c.state === "spliced") return this.close(c); // read past the pause: the kernel relay's bytes would pass it
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
    c.kind = got.kind === "unknown" ? "none" : got.kind;
    void this.decide(c);
  }

  /** The client's bytes once the connection is open, carried as its mode says. */
  private clientBytes(c: Conn, d: Buffer): void {
    if (c.mode === "pass") {
      this.send(c, c.upstream, c.client, d);
      return this.carried(c, d.length);
    }
    if (c.mode === "http") {
      c.rewriter!.push(d);
      if (c.rewriter!.pending > MAX_PENDING) c.client.sock?.pause();
      return;
    }
    if (!c.tlsGuest!.input.push(d)) c.client.sock?.pause();
  }

  private async decide(c: Conn): Promise<void> {
    const http = c.kind === "http";
    const a = this.egress?.bySource(c.nsIp);
    if (!a) return this.refuse(c, "the sandbox has no policy", http);
    const d = a.matcher.decide(c.dst.address, c.name);
    if (!d.allow) return this.refuse(c, `${d.by}${d.domain ? ` ${d.domain}` : ""}`, http);
    c.mode = modeFor(a.policy, c.kind, c.name, !!this.opts.ca);
    // The name must own the address when it allowed the connection or brings a rule's headers.
    const byName = !!d.domain || c.mode !== "pass";
    if (byName) {
      let ips: string[];
      try {
        ips = await this.resolve(c.name!);
      } catch (e) {
        return this.refuse(c, `resolving ${c.name}: ${(e as Error).message}`, http);
      }
      if (!ips.includes(c.dst.address)) return this.refuse(c, `${c.name} does not resolve to ${c.dst.address} (${ips.join(", ") || "no addresses"})`, http);
    }
    const up = a.policy.upstream;
    let hop = c.dst;
    if (up) {
      try {
        hop = { address: await this.upstreamAddress(up, a), port: up.port };
      } catch (e) {
        return this.refuse(c, (e as Error).message, http);
      }
    }
    if (c.state !== "deciding") return; // the client left meanwhile
    this.count(a.sandboxId, true);
    c.state = "connecting";
    c.via = upstreamKey(up);
    c.timer = setTimeout(() => this.refuse(c, `connecting to ${hop.address}:${hop.port} took over ${CONNECT_TIMEOUT_MS} ms`, http), CONNECT_TIMEOUT_MS);
    try {
      const sock = await Bun.connect<Conn>({
        hostname: hop.address,
        port: hop.port,
        data: c,
        allowHalfOpen: true,
        socket: {
          data: (_s, b) => this.fromUpstream(c, b),
          drain: (_s) => this.drained(c, c.upstream),
          end: () => this.ended(c, c.client),
          close: () => this.lost(c),
          error: () => this.lost(c),
        },
      });
      if (c.state !== "connecting") return void sock.terminate();
      c.upstream.sock = sock;
      if (up) {
        // By name when the name was checked (the proxy resolves it), else by the address asked for.
        c.tunnel = new Tunnel(up, { host: byName ? c.name! : c.dst.address, port: c.dst.port });
        this.send(c, c.upstream, c.client, c.tunnel.start());
        return;
      }
      this.connected(c);
    } catch {
      this.refuse(c, `cannot connect to ${hop.address}:${hop.port}`, http);
    }
  }

  /** The egress proxy's address; one in an always-denied range is refused (it would reach the node's networks). */
  private async upstreamAddress(up: UpstreamProxy, a: AppliedPolicy): Promise<string> {
    let ip = up.host;
    if (!/^\d+\.\d+\.\d+\.\d+$/.test(ip)) {
      const ips = await this.resolve(up.host).catch((e) => {
        throw new Error(`egress proxy ${up.host}: ${(e as Error).message}`);
      });
      if (!ips.length) throw new Error(`egress proxy ${up.host} has no address`);
      ip = ips[0]!;
    }
    if (a.matcher.alwaysDenied(ip)) throw new Error(`egress proxy ${up.host} (${ip}) is in an always-denied range`);
    return ip;
  }

  /** Bytes from the server's side: the tunnel's handshake first, then as the mode says. */
  private fromUpstream(c: Conn, d: Buffer): void {
    if (c.state === "closed") return;
    if (c.state === "spliced") return this.close(c); // as in fromClient
    if (c.tunnel) {
      const step = c.tunnel.feed(d);
      if (step.kind === "more") {
        if (step.send) this.send(c, c.upstream, c.client, step.send);
        return;
      }
      if (step.kind === "failed") return this.refuse(c, `egress proxy: ${step.reason}`, c.kind === "http");
      c.tunnel = undefined;
      this.connected(c);
      if (step.rest.length) this.fromUpstream(c, step.rest);
      return;
    }
    if (c.tlsServer) {
      if (!c.tlsServer.input.push(d)) c.upstream.sock?.pause();
      return;
    }
    this.send(c, c.client, c.upstream, d);
    if (c.mode === "pass") this.carried(c, d.length);
  }

  /** `n` more bytes passed as they are: past SPLICE_AFTER the connection moves to the kernel relay. */
  private carried(c: Conn, n: number): void {
    c.carried += n;
    this.spliceSoon(c);
  }

  /**
   * Asks for the hand-over outside Bun's socket callbacks: a socket paused in its own writable
   * callback is still read in the same dispatch (its events were taken before the callback), and
   * those bytes would pass the relay's. One setImmediate per connection at a time.
   */
  private spliceSoon(c: Conn): void {
    if (c.carried < SPLICE_AFTER || c.spliceSoon || !this.relay?.available) return;
    c.spliceSoon = true;
    setImmediate(() => {
      c.spliceSoon = false;
      this.splice(c);
    });
  }

  /**
   * Hands a pass connection to the kernel relay once nothing is held here: both queues written (so
   * a FIN received is passed on already: ended()), no tunnel handshake. Both sockets are paused (Bun
   * reads nothing more) and keep no idle timeout (the relay has its own).
   */
  private splice(c: Conn): void {
    const { client, upstream } = c;
    if (!this.relay?.available || c.state !== "open" || c.mode !== "pass" || c.tunnel || !client.sock || !upstream.sock) return;
    if (client.queued || upstream.queued) return;
    client.sock.pause();
    upstream.sock.pause();
    const ended = (upstream.finPending ? ENDED_AB : 0) | (client.finPending ? ENDED_BA : 0);
    const slot = this.relay.take(fdOf(client.sock), fdOf(upstream.sock), ended, () => this.unspliced(c));
    if (slot < 0) {
      client.sock.resume();
      upstream.sock.resume();
      return;
    }
    c.state = "spliced";
    c.relaySlot = slot;
    client.sock.timeout(0);
  }

  /** The kernel relay let the connection go: closed here (after "done" the relay's own last close sends the rest gracefully). */
  private unspliced(c: Conn): void {
    c.relaySlot = -1;
    if (c.state === "spliced") this.close(c);
  }

  /** The path to the server is open (directly or through the egress proxy's tunnel). */
  private connected(c: Conn): void {
    if (c.mode === "tls") return this.startTls(c);
    clearTimeout(c.timer);
    c.state = "open";
    const head = Buffer.concat(c.head);
    c.head = [];
    c.headLen = 0;
    if (c.mode === "http") c.rewriter = this.rewriter(c, (b) => this.send(c, c.upstream, c.client, b), () => c.client.sock?.resume());
    if (head.length) this.clientBytes(c, head);
    if (c.upstream.finPending) this.ended(c, c.upstream);
  }

  /** Parses the requests of `c` and sets its host's header rules on each; `out` carries them on. */
  private rewriter(c: Conn, out: (b: Buffer) => void, idle: () => void): RequestRewriter {
    return new RequestRewriter((h) => this.headers(c, h), out, (status, reason) => this.refuseRequest(c, status, reason), () => {
      idle();
      const fin = c.finAfterRequests;
      c.finAfterRequests = undefined;
      fin?.();
    });
  }

  /** The headers one request gets, or its refusal. Values are never logged. */
  private async headers(c: Conn, h: RequestHead): Promise<HeadDecision> {
    if (h.host !== c.name?.replace(/\.$/, "")) return { refuse: 421, reason: `a request for ${h.host ?? "no host"} on a connection to ${c.name}` };
    const a = this.egress?.bySource(c.nsIp);
    if (!a) return { refuse: 403, reason: "the sandbox has no policy" };
    const rules = rulesFor(a.policy.rules, c.name);
    const set: { name: string; value: string }[] = [];
    for (const v of rules?.headers ?? []) {
      if (v.secret === undefined && !v.placeholders) {
        set.push({ name: v.name, value: v.value! });
        continue;
      }
      if (!this.opts.secrets) return { refuse: 502, reason: `header ${v.name} names a secret: this node has no secret store` };
      try {
        set.push({ name: v.name, value: await this.opts.secrets.resolve(v) });
      } catch (e) {
        return { refuse: 502, reason: (e as Error).message };
      }
    }
    return { set };
  }

  /** A request the rules refuse: answered with `status` (over TLS in tls mode), then the connection closes. */
  private refuseRequest(c: Conn, status: number, reason: string): void {
    if (c.state === "closed") return;
    const a = this.egress?.bySource(c.nsIp);
    const destination = `${c.dst.address}:${c.dst.port}`;
    if (a) this.count(a.sandboxId, false, { at: Date.now(), name: c.name, destination, reason });
    console.error(`egress: sandbox ${a?.sandboxId ?? c.nsIp}: request to ${c.name ?? destination} refused (${status}): ${reason}`);
    const body = `egress proxy: ${reason}\n`;
    const answer = `HTTP/1.1 ${status} ${STATUS_TEXT[status] ?? "Refused"}\r\nContent-Type: text/plain\r\nContent-Length: ${Buffer.byteLength(body)}\r\nConnection: close\r\n\r\n${body}`;
    if (c.tlsGuest) {
      c.tlsGuest.sock.end(answer, () => this.close(c));
      setTimeout(() => this.close(c), 1000).unref?.();
      return;
    }
    if (!c.client.sock || c.client.queued > 0) return this.close(c); // mid-answer: an error line would corrupt it
    this.answerAndClose(c, answer);
  }

  /** Writes `answer` to the client, ends it and drops the server side (its close then finds the connection closed). */
  private answerAndClose(c: Conn, answer: string): void {
    c.state = "closed";
    clearTimeout(c.timer);
    this.conns.delete(c);
    c.client.sock?.write(answer);
    c.client.sock?.end();
    c.upstream.sock?.terminate();
  }

  /**
   * tls mode, once the path to the server is open: a TLS client to the server (its certificate
   * checked for the name), then, once that holds, the sandbox's handshake answered with the node
   * CA's leaf for the name. Requests between the two are rewritten.
   */
  private startTls(c: Conn): void {
    const name = c.name!;
    c.tlsServer = this.tlsEnd(c, c.upstream, (input) =>
      tls.connect({ socket: input as never, servername: name, ca: this.trust(), ALPNProtocols: ["http/1.1"] }));
    const server = c.tlsServer.sock;
    server.on("error", (e) => this.refuse(c, `TLS to ${name}: ${e.message}`));
    server.once("secureConnect", () => {
      if (c.state !== "connecting") return;
      clearTimeout(c.timer);
      let leaf;
      try {
        leaf = this.opts.ca!.leaf(name);
      } catch (e) {
        return this.refuse(c, (e as Error).message);
      }
      c.tlsGuest = this.tlsEnd(c, c.client, (input) =>
        new tls.TLSSocket(input as never, { isServer: true, secureContext: tls.createSecureContext({ cert: leaf.certPem, key: leaf.keyPem }), ALPNProtocols: ["http/1.1"] } as tls.TLSSocketOptions));
      const guest = c.tlsGuest.sock;
      c.rewriter = this.rewriter(c, (b) => {
        if (!server.write(b)) guest.pause();
      }, () => guest.resume());
      guest.on("data", (d: Buffer) => {
        c.rewriter!.push(d);
        if (c.rewriter!.pending > MAX_PENDING) guest.pause();
      });
      server.on("drain", () => guest.resume());
      server.on("data", (d: Buffer) => {
        if (!guest.write(d)) server.pause();
      });
      guest.on("drain", () => server.resume());
      guest.on("end", () => {
        if (c.rewriter!.pending > 0) c.finAfterRequests = () => server.end();
        else server.end();
      });
      server.on("end", () => guest.end());
      guest.on("error", () => this.close(c));
      guest.on("close", () => this.close(c));
      server.on("close", () => this.close(c));
      c.state = "open";
      const head = Buffer.concat(c.head);
      c.head = [];
      c.headLen = 0;
      this.clientBytes(c, head);
    });
  }

  /** A TLS engine over `side`'s raw socket, with backpressure both ways. */
  private tlsEnd(c: Conn, side: Side, make: (input: Duplex) => tls.TLSSocket): TlsEnd {
    const input = new Duplex({
      read: () => side.sock?.resume(),
      write: (chunk: Buffer, _enc, cb) => {
        this.send(c, side, undefined, chunk);
        if (side.queued > HIGH_WATER) side.waiting = () => cb();
        else cb();
      },
      final: (cb) => {
        side.finPending = true;
        if (side.queued === 0) side.sock?.shutdown();
        cb();
      },
    });
    return { sock: make(input), input };
  }

  /** The host's trust store plus `upstreamCa`, for servers behind a terminated connection. */
  private trusted: string[] | undefined;
  private trust(): string[] {
    if (!this.trusted) {
      const system = (tls as unknown as { getCACertificates?: (k: string) => string[] }).getCACertificates?.("system") ?? [];
      this.trusted = [...(system.length ? system : tls.rootCertificates), ...(this.opts.upstreamCa ?? [])];
    }
    return this.trusted;
  }

  /** Writes `d` to `to`, queueing what it does not take and pausing `from` past HIGH_WATER. */
  private send(c: Conn, to: Side, from: Side | undefined, d: Buffer): void {
    if (!to.sock || c.state === "closed") return;
    if (to.queued === 0) {
      const n = to.sock.write(d);
      if (n === d.length) return;
      d = d.subarray(Math.max(0, n));
    }
    to.queue.push(d);
    to.queued += d.length;
    if (to.queued > HIGH_WATER) from?.sock?.pause();
  }

  /** `side`'s socket takes more: flush its queue, resume the other side once it is empty. */
  private drained(c: Conn, side: Side): void {
    if (c.state === "spliced") return;
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
    const waiting = side.waiting;
    side.waiting = undefined;
    waiting?.();
    if (c.tlsServer) {
      // tls mode: the TLS engines pace themselves (tlsEnd); a FIN they asked for goes now.
      if (side.finPending && side.queued === 0) side.sock?.shutdown();
      return;
    }
    const other = side === c.client ? c.upstream : c.client;
    other.sock?.resume();
    if (side.finPending) this.ended(c, side);
    else this.spliceSoon(c);
  }

  /**
   * The peer of `to`'s opposite side sent its FIN: `to` gets one too once its queue is written.
   * A client that ends before naming its host is judged on what it sent.
   */
  private ended(c: Conn, to: Side): void {
    if (c.state === "closed" || c.state === "spliced") return; // spliced: Bun reads no FIN while paused
    if (c.mode === "tls" && c.state !== "deciding") {
      // The FIN goes into the TLS engine of the side it came from; before the sandbox's handshake, there is nothing to finish.
      if (to === c.client) c.tlsServer?.input.push(null);
      else if (c.tlsGuest) c.tlsGuest.input.push(null);
      else this.close(c);
      return;
    }
    to.finPending = true;
    if (c.state === "sniff" && to === c.upstream) {
      clearTimeout(c.timer);
      c.state = "deciding";
      const got = sniff(Buffer.concat(c.head));
      c.name = got.kind === "http" || got.kind === "tls" ? got.name : undefined;
      c.kind = got.kind === "http" || got.kind === "tls" ? got.kind : "none";
      return void this.decide(c);
    }
    if (!to.sock || to.queued > 0) return; // not connected yet, or still writing: later
    if (to === c.upstream && c.rewriter && c.rewriter.pending > 0) {
      c.finAfterRequests = () => this.ended(c, c.upstream); // after the requests the rewriter holds
      return;
    }
    to.sock.shutdown();
    const other = to === c.client ? c.upstream : c.client;
    if (other.finPending && other.queued === 0) this.finish(c); // both directions done
  }

  /** Both directions ended: end() lets the kernel send what it still holds (terminate() resets, dropping it for a slow reader). */
  private finish(c: Conn): void {
    c.state = "closed";
    clearTimeout(c.timer);
    this.conns.delete(c);
    c.client.sock?.end();
    c.upstream.sock?.end();
  }

  private refuse(c: Conn, reason: string, http = false): void {
    if (c.state === "closed") return;
    const a = this.egress?.bySource(c.nsIp);
    const destination = `${c.dst.address}:${c.dst.port}`;
    if (a) this.count(a.sandboxId, false, { at: Date.now(), name: c.name, destination, reason });
    console.error(`egress: sandbox ${a?.sandboxId ?? c.nsIp}: refused ${c.name ?? "(no name)"} → ${destination}: ${reason}`);
    if (http && c.client.sock) {
      const body = `egress to ${c.name ?? destination} is refused by the sandbox's network policy\n`;
      return this.answerAndClose(c, `HTTP/1.1 403 Forbidden\r\nContent-Type: text/plain\r\nContent-Length: ${body.length}\r\nConnection: close\r\n\r\n${body}`);
    }
    this.close(c);
  }

  /**
   * Bun closed one of the sockets (the peer's reset, or both directions ended). A spliced one is the
   * relay's to end: its duplicate keeps the socket, and Bun reports a hang-up even when the relay has
   * bytes still to pass (its final shutdown() is what ends both directions).
   */
  private lost(c: Conn | undefined): void {
    if (c?.state !== "spliced") this.close(c);
  }

  private close(c: Conn | undefined): void {
    if (!c || c.state === "closed") {
      if (c) this.conns.delete(c);
      return;
    }
    c.state = "closed";
    clearTimeout(c.timer);
    this.conns.delete(c);
    if (c.relaySlot >= 0) this.relay?.drop(c.relaySlot);
    c.client.sock?.terminate();
    c.upstream.sock?.terminate();
    c.tlsGuest?.sock.destroy();
    c.tlsServer?.sock.destroy();
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
      // Carried another way (header rules came or went) or through another egress proxy: the client reconnects.
      else if (modeFor(now.policy, c.kind, c.name, !!this.opts.ca) !== c.mode || upstreamKey(now.policy.upstream) !== c.via) this.close(c);
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
