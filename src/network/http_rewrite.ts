// The request side of an HTTP/1.x connection, request by request (keep-alive and pipelining
// included), so the domain proxy can set a rule's headers on every request and check each one's
// Host. Bodies pass as they are, framed by Content-Length or chunked coding; after an Upgrade or
// CONNECT request the rest of the connection passes untouched (the protocol is no longer HTTP).
//
// Refused with an HTTP status (the proxy answers it and closes): a head over MAX_REQUEST_HEAD
// (431), a malformed request line or header, folded headers, two Hosts, both Content-Length and
// Transfer-Encoding, an unusable Content-Length or chunk size (400): the ways a request is smuggled
// past a proxy that reads it one way to a server that reads it another.

/** Request line and headers of one request. */
export const MAX_REQUEST_HEAD = 64 * 1024;
/** A chunk-size line or a trailer line. */
const MAX_LINE = 4096;
/** Request input held while a head is decided (the proxy pauses the client past it). */
export const MAX_PENDING = 1 << 20;

export interface RequestHead {
  method: string;
  target: string;
  /** The Host (absolute-form target's authority first), lowercase, port left out; undefined when none. */
  host: string | undefined;
  headers: [string, string][];
}

export type HeadDecision = { set: { name: string; value: string }[] } | { refuse: number; reason: string };

export class HttpRefusal extends Error {
  constructor(readonly status: number, message: string) { super(message); this.name = "HttpRefusal"; }
}

const TOKEN = /^[!#$%&'*+.^_`|~0-9A-Za-z-]+$/;

export function hostOf(authority: string): string | undefined {
  const a = authority.trim().toLowerCase();
  if (a.startsWith("[")) return undefined;
  const h = a.replace(/:\d*$/, "");
  return /^[a-z0-9.-]+$/.test(h) ? h.replace(/\.$/, "") : undefined;
}

export function parseHead(text: string): RequestHead {
  const lines = text.split("\r\n");
  const rl = /^([!#$%&'*+.^_`|~0-9A-Za-z-]+) (\S+) HTTP\/1\.[01]$/.exec(lines[0]!);
  if (!rl) throw new HttpRefusal(400, "malformed request line");
  const headers: [string, string][] = [];
  for (const l of lines.slice(1)) {
    if (l.startsWith(" ") || l.startsWith("\t")) throw new HttpRefusal(400, "folded header line");
    const i = l.indexOf(":");
    if (i <= 0 || !TOKEN.test(l.slice(0, i))) throw new HttpRefusal(400, "malformed header line");
    const v = l.slice(i + 1).trim();
    if (/[\0\r\n]/.test(v)) throw new HttpRefusal(400, "malformed header value");
    headers.push([l.slice(0, i), v]);
  }
  const hosts = headers.filter(([n]) => n.toLowerCase() === "host");
  if (hosts.length > 1) throw new HttpRefusal(400, "two Host headers");
  let host = hosts[0] ? hostOf(hosts[0][1]) : undefined;
  const abs = /^[a-z][a-z0-9+.-]*:\/\/([^/?#]*)/i.exec(rl[2]!);
  if (abs) {
    const h = hostOf(abs[1]!.replace(/^.*@/, ""));
    if (hosts[0] && h !== host) throw new HttpRefusal(400, "the target's authority and Host differ");
    host = h;
  }
  return { method: rl[1]!, target: rl[2]!, host, headers };
}

type Body = { kind: "none" } | { kind: "fixed"; left: number } | { kind: "chunked" } | { kind: "opaque" };

function framing(h: RequestHead): Body {
  const get = (name: string) => h.headers.filter(([n]) => n.toLowerCase() === name).map(([, v]) => v);
  if (h.method === "CONNECT" || get("upgrade").length > 0) return { kind: "opaque" };
  const te = get("transfer-encoding");
  const cl = get("content-length");
  if (te.length && cl.length) throw new HttpRefusal(400, "both Transfer-Encoding and Content-Length");
  if (te.length) {
    const codings = te.join(",").split(",").map((s) => s.trim().toLowerCase()).filter(Boolean);
    if (codings.at(-1) !== "chunked" || codings.filter((c) => c === "chunked").length !== 1) throw new HttpRefusal(400, "a request body must end with the chunked coding");
    return { kind: "chunked" };
  }
  if (cl.length) {
    const values = new Set(cl.join(",").split(",").map((s) => s.trim()));
    const v = [...values][0]!;
    if (values.size !== 1 || !/^\d{1,15}$/.test(v)) throw new HttpRefusal(400, "unusable Content-Length");
    return Number(v) > 0 ? { kind: "fixed", left: Number(v) } : { kind: "none" };
  }
  return { kind: "none" };
}

/** Rebuilds a head with `set`'s headers replacing any of the same name (case-insensitive). */
export function rewriteHead(text: string, set: { name: string; value: string }[]): Buffer {
  if (set.length === 0) return Buffer.from(text + "\r\n\r\n", "latin1");
  const drop = new Set(set.map((s) => s.name.toLowerCase()));
  const lines = text.split("\r\n");
  const kept = lines.slice(1).filter((l) => !drop.has(l.slice(0, l.indexOf(":")).toLowerCase()));
  // Values are UTF-8 as given; the rest of the head keeps its bytes (latin1 round-trips them).
  return Buffer.concat([
    Buffer.from([lines[0], ...kept].join("\r\n") + "\r\n", "latin1"),
    Buffer.from(set.map((s) => `${s.name}: ${s.value}\r\n`).join("") + "\r\n", "utf8"),
  ]);
}

/**
 * Feeds a connection's request bytes through `decide` (one call per request head) to `out`.
 * `fail` is called once with the refusal; nothing passes after it.
 */
export class RequestRewriter {
  private input: Buffer[] = [];
  private held = 0;
  private body: Body | undefined;
  private chunk: "size" | "data" | "crlf" | "trailer" = "size";
  private chunkLeft = 0;
  private busy = false;
  private failed = false;
  /** Requests passed on so far. */
  requests = 0;

  constructor(
    private readonly decide: (h: RequestHead) => HeadDecision | Promise<HeadDecision>,
    private readonly out: (b: Buffer) => void,
    private readonly fail: (status: number, reason: string) => void,
    /** Called when the held input drops to none (the proxy resumes a paused client). */
    private readonly idle: () => void = () => {},
  ) {}

  /** Bytes held, not yet passed on. */
  get pending(): number {
    return this.held;
  }

  push(d: Buffer): void {
    if (this.failed || d.length === 0) return;
    this.input.push(d);
    this.held += d.length;
    void this.pump();
  }

  private joined(): Buffer {
    if (this.input.length > 1) this.input = [Buffer.concat(this.input)];
    return this.input[0] ?? Buffer.alloc(0);
  }

  private consume(n: number): Buffer {
    const b = this.joined();
    const head = b.subarray(0, n);
    this.input = n < b.length ? [b.subarray(n)] : [];
    this.held -= n;
    return head;
  }

  private refuse(status: number, reason: string): void {
    this.failed = true;
    this.input = [];
    this.held = 0;
    this.fail(status, reason);
  }

  private async pump(): Promise<void> {
    if (this.busy) return;
    this.busy = true;
    try {
      while (!this.failed && this.held > 0) {
        if (!(await this.stepOnce())) break;
      }
    } catch (e) {
      if (e instanceof HttpRefusal) this.refuse(e.status, e.message);
      else this.refuse(502, (e as Error).message);
    } finally {
      this.busy = false;
    }
    if (!this.failed && this.held === 0) this.idle();
  }

  /** One step over the held bytes; false when it needs more. */
  private async stepOnce(): Promise<boolean> {
    const b = this.joined();
    const body = this.body;
    if (!body || body.kind === "none") {
      this.body = undefined;
      // Empty lines before a request line are ignored (RFC 9112 2.2).
      let skip = 0;
      while (b[skip] === 0x0d && b[skip + 1] === 0x0a) skip += 2;
      if (skip) {
        this.consume(skip);
        return true;
      }
      const end = b.indexOf("\r\n\r\n");
      if (end < 0) {
        if (b.length > MAX_REQUEST_HEAD) throw new HttpRefusal(431, `a request head over ${MAX_REQUEST_HEAD} bytes`);
        return false;
      }
      if (end > MAX_REQUEST_HEAD) throw new HttpRefusal(431, `a request head over ${MAX_REQUEST_HEAD} bytes`);
      const text = b.subarray(0, end).toString("latin1");
      const head = parseHead(text);
      const next = framing(head);
      const d = await this.decide(head);
      if ("refuse" in d) throw new HttpRefusal(d.refuse, d.reason);
      this.consume(end + 4);
      this.out(rewriteHead(text, d.set));
      this.requests++;
      this.body = next;
      this.chunk = "size";
      return true;
    }
    switch (body.kind) {
      case "opaque":
        this.out(this.consume(b.length));
        return true;
      case "fixed": {
        const n = Math.min(body.left, b.length);
        body.left -= n;
        this.out(this.consume(n));
        if (body.left === 0) this.body = undefined;
        return true;
      }
      case "chunked":
        return this.chunked(b);
    }
  }

  private chunked(b: Buffer): boolean {
    switch (this.chunk) {
      case "size":
      case "trailer": {
        const end = b.indexOf("\r\n");
        if (end < 0) {
          if (b.length > MAX_LINE) throw new HttpRefusal(400, "a chunk line too long");
          return false;
        }
        const line = b.subarray(0, end).toString("latin1");
        this.out(this.consume(end + 2));
        if (this.chunk === "trailer") {
          if (line === "") this.body = undefined; // end of the request
          return true;
        }
        const m = /^([0-9a-fA-F]{1,12})(;.*)?$/.exec(line);
        if (!m) throw new HttpRefusal(400, "malformed chunk size");
        this.chunkLeft = parseInt(m[1]!, 16);
        this.chunk = this.chunkLeft === 0 ? "trailer" : "data";
        return true;
      }
      case "data": {
        const n = Math.min(this.chunkLeft, b.length);
        this.chunkLeft -= n;
        this.out(this.consume(n));
        if (this.chunkLeft === 0) this.chunk = "crlf";
        return true;
      }
      case "crlf": {
        if (b.length < 2) return false;
        if (b[0] !== 0x0d || b[1] !== 0x0a) throw new HttpRefusal(400, "a chunk not followed by CRLF");
        this.out(this.consume(2));
        this.chunk = "size";
        return true;
      }
    }
  }
}
