// The handshake that opens a tunnel through a sandbox's egress proxy (`network.egressProxy`) to one
// destination: SOCKS5 (RFC 1928, username/password per RFC 1929; E2B's kind) or HTTP CONNECT
// (RFC 9110 9.3.6, Proxy-Authorization Basic). A pure state machine over the bytes: the domain
// proxy writes what `start` and `feed` return and passes the bytes after the handshake on.
// A destination by name is sent as a name (SOCKS5 ATYP 3), so the proxy resolves it.

import type { UpstreamProxy } from "./policy.ts";

/** The proxy's answers must fit in this (a CONNECT reply's headers, a SOCKS5 reply is < 300 bytes). */
export const MAX_TUNNEL_REPLY = 16 * 1024;

export type TunnelStep =
  | { kind: "more"; send?: Buffer }
  /** Open: `rest` is the first bytes from the destination. */
  | { kind: "open"; rest: Buffer }
  | { kind: "failed"; reason: string };

const SOCKS_REPLIES = ["succeeded", "general failure", "not allowed by the proxy's ruleset", "network unreachable", "host unreachable",
  "connection refused", "TTL expired", "command not supported", "address type not supported"];

export class Tunnel {
  private buf: Buffer = Buffer.alloc(0);
  private phase: "greeting" | "auth" | "connect" | "http" = "greeting";

  constructor(private readonly proxy: UpstreamProxy, private readonly target: { host: string; port: number }) {}

  /** The first bytes to send once connected to the proxy. */
  start(): Buffer {
    if (this.proxy.kind === "http") {
      this.phase = "http";
      const hp = `${this.target.host}:${this.target.port}`;
      const auth = this.proxy.username === undefined ? "" :
        `Proxy-Authorization: Basic ${Buffer.from(`${this.proxy.username}:${this.proxy.password ?? ""}`).toString("base64")}\r\n`;
      return Buffer.from(`CONNECT ${hp} HTTP/1.1\r\nHost: ${hp}\r\n${auth}\r\n`);
    }
    return Buffer.from(this.proxy.username === undefined ? [5, 1, 0] : [5, 2, 0, 2]);
  }

  /** Bytes from the proxy. */
  feed(d: Buffer): TunnelStep {
    this.buf = this.buf.length ? Buffer.concat([this.buf, d]) : d;
    if (this.buf.length > MAX_TUNNEL_REPLY) return { kind: "failed", reason: "the proxy's answer is too long" };
    // Each answer of the proxy waits for our next message, so one feed finishes at most one step.
    return this.step();
  }

  private take(n: number): Buffer {
    const b = this.buf.subarray(0, n);
    this.buf = this.buf.subarray(n);
    return b;
  }

  private step(): TunnelStep {
    const b = this.buf;
    switch (this.phase) {
      case "http": {
        const end = b.indexOf("\r\n\r\n");
        if (end < 0) return MORE;
        const status = /^HTTP\/1\.[01] (\d{3})([^\r\n]*)/.exec(b.subarray(0, end).toString("latin1"));
        if (!status) return { kind: "failed", reason: "the proxy did not answer HTTP" };
        if (status[1] !== "200") return { kind: "failed", reason: `the proxy answered ${status[1]}${status[2]}` };
        this.take(end + 4);
        return { kind: "open", rest: this.buf };
      }
      case "greeting": {
        if (b.length < 2) return MORE;
        const [ver, method] = this.take(2);
        if (ver !== 5) return { kind: "failed", reason: "the proxy does not speak SOCKS5" };
        if (method === 0) return this.connect();
        if (method === 2 && this.proxy.username !== undefined) {
          this.phase = "auth";
          const u = Buffer.from(this.proxy.username);
          const p = Buffer.from(this.proxy.password ?? "");
          return { kind: "more", send: Buffer.concat([Buffer.from([1, u.length]), u, Buffer.from([p.length]), p]) };
        }
        return { kind: "failed", reason: method === 0xff ? "the proxy accepts none of our authentication methods" : `the proxy chose method ${method}` };
      }
      case "auth": {
        if (b.length < 2) return MORE;
        const [, status] = this.take(2);
        if (status !== 0) return { kind: "failed", reason: "the proxy refused the username and password" };
        return this.connect();
      }
      case "connect": {
        if (b.length < 5) return MORE;
        if (b[0] !== 5) return { kind: "failed", reason: "malformed SOCKS5 reply" };
        if (b[1] !== 0) return { kind: "failed", reason: `the proxy answered: ${SOCKS_REPLIES[b[1]!] ?? `reply ${b[1]}`}` };
        const atyp = b[3];
        const addrLen = atyp === 1 ? 4 : atyp === 4 ? 16 : atyp === 3 ? 1 + b[4]! : -1;
        if (addrLen < 0) return { kind: "failed", reason: "malformed SOCKS5 reply" };
        if (b.length < 4 + addrLen + 2) return MORE;
        this.take(4 + addrLen + 2);
        return { kind: "open", rest: this.buf };
      }
    }
  }

  private connect(): TunnelStep {
    this.phase = "connect";
    const h = this.target.host;
    const addr = /^\d+\.\d+\.\d+\.\d+$/.test(h)
      ? Buffer.from([1, ...h.split(".").map(Number)])
      : Buffer.concat([Buffer.from([3, Buffer.byteLength(h)]), Buffer.from(h)]);
    const port = Buffer.from([this.target.port >> 8, this.target.port & 255]);
    return { kind: "more", send: Buffer.concat([Buffer.from([5, 1, 0]), addr, port]) };
  }
}

const MORE: TunnelStep = { kind: "more" };
