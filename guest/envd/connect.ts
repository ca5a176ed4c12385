// Connect protocol server side: unary (application/json | application/proto) and streaming
// (application/connect+json | application/connect+proto) on plain Request/Response.
import { BadGzip, BodyTooLarge, gunzipBounded, readBounded } from "./body.ts";
import { ProtoError } from "./proto.ts";
import { schema } from "./schema.ts";

/** Connect's read limit: one request message (unary body or stream envelope, after inflating) is at most 16 MiB. */
export const MAX_MESSAGE_BYTES = 16 * 1024 * 1024;

export type Code =
  | "canceled" | "unknown" | "invalid_argument" | "deadline_exceeded" | "not_found" | "already_exists"
  | "permission_denied" | "resource_exhausted" | "failed_precondition" | "aborted" | "out_of_range"
  | "unimplemented" | "internal" | "unavailable" | "data_loss" | "unauthenticated";

// Connect's code → HTTP status table (used for unary errors only; streams always answer 200).
const HTTP_STATUS: Record<Code, number> = {
  canceled: 499, unknown: 500, invalid_argument: 400, deadline_exceeded: 504, not_found: 404,
  already_exists: 409, permission_denied: 403, resource_exhausted: 429, failed_precondition: 400,
  aborted: 409, out_of_range: 400, unimplemented: 501, internal: 500, unavailable: 503,
  data_loss: 500, unauthenticated: 401,
};

export class ConnectError extends Error {
  constructor(readonly code: Code, message: string) {
    super(message);
  }
}

/** Maps anything thrown by a handler onto a Connect error; node errno codes get their natural meaning. */
export function toConnectError(e: unknown): ConnectError {
  if (e instanceof ConnectError) return e;
  if (e instanceof ProtoError || e instanceof BadGzip) return new ConnectError("invalid_argument", e.message);
  if (e instanceof BodyTooLarge) return new ConnectError("resource_exhausted", `message is larger than the limit of ${e.limit} bytes`);
  const errno = (e as { code?: string })?.code;
  const msg = e instanceof Error ? e.message : String(e);
  const byErrno: Record<string, Code> = {
    ENOENT: "not_found", EACCES: "permission_denied", EPERM: "permission_denied", EEXIST: "already_exists",
    ENOTDIR: "invalid_argument", EISDIR: "invalid_argument", EINVAL: "invalid_argument", ELOOP: "invalid_argument",
    ENAMETOOLONG: "invalid_argument", ENOSPC: "resource_exhausted", EDQUOT: "resource_exhausted",
    ERR_INVALID_ARG_VALUE: "invalid_argument", // node's refusal of a NUL byte in a path or argument
  };
  return new ConnectError((errno && byErrno[errno]) || "internal", msg);
}

export interface RpcCtx {
  headers: Headers;
  /** Aborted when the client goes away (reason: canceled) or the Connect deadline passes (deadline_exceeded). */
  signal: AbortSignal;
  timeoutMs?: number;
  keepaliveMs: number;
  /** User named by HTTP Basic auth; undefined means envd's default user. */
  username?: string;
}

type Msg = Record<string, unknown>;
export type Method =
  | { kind: "unary"; input: string; output: string; handle(req: Msg, ctx: RpcCtx): unknown }
  | { kind: "server"; input: string; output: string; keepalive?: Msg; handle(req: Msg, ctx: RpcCtx, send: (m: Msg) => void): Promise<void> }
  | { kind: "client"; input: string; output: string; handle(reqs: AsyncIterable<Msg>, ctx: RpcCtx): Promise<Msg | void> };

const FLAG_COMPRESSED = 0x01;
const FLAG_END = 0x02;

function mediaType(req: Request): string {
  return (req.headers.get("content-type") ?? "").split(";")[0]!.trim().toLowerCase();
}

function jsonError(err: ConnectError) {
  return { code: err.code, message: err.message };
}

function parseTimeout(h: string | null): number | undefined {
  if (h === null) return undefined;
  if (!/^\d{1,10}$/.test(h)) throw new ConnectError("invalid_argument", `invalid Connect-Timeout-Ms: ${JSON.stringify(h)}`);
  return Number(h);
}

function keepaliveMs(h: string | null): number {
  const s = Number(h);
  return Number.isFinite(s) && s > 0 ? s * 1000 : 90_000; // envd's default when the header is absent
}

async function decompress(body: Uint8Array, encoding: string | null): Promise<Uint8Array> {
  if (!encoding || encoding === "identity") return body;
  if (encoding === "gzip") return gunzipBounded(body, MAX_MESSAGE_BYTES);
  throw new ConnectError("unimplemented", `unsupported compression ${JSON.stringify(encoding)}`);
}

function decodeMsg(type: string, data: Uint8Array, json: boolean): Msg {
  if (!json) return schema.decode(type, data);
  let parsed: unknown;
  try {
    parsed = JSON.parse(new TextDecoder("utf-8", { fatal: true }).decode(data));
  } catch (e) {
    throw new ConnectError("invalid_argument", `unmarshal into ${type}: ${(e as Error).message}`);
  }
  return schema.fromJson(type, parsed);
}

function encodeMsg(type: string, m: Msg, json: boolean): Uint8Array {
  return json ? new TextEncoder().encode(JSON.stringify(schema.toJson(type, m))) : schema.encode(type, m);
}

function envelope(flags: number, payload: Uint8Array): Uint8Array {
  const out = new Uint8Array(5 + payload.length);
  out[0] = flags;
  new DataView(out.buffer).setUint32(1, payload.length);
  out.set(payload, 5);
  return out;
}

/** Bytes received and not yet consumed, as the chunks they came in: consuming copies each byte at most once. */
class ByteQueue {
  private chunks: Uint8Array[] = [];
  private first = 0; // index of the oldest chunk still holding bytes
  private offset = 0; // bytes already consumed from chunks[first]
  length = 0;

  push(chunk: Uint8Array) {
    if (!chunk.length) return;
    this.chunks.push(chunk);
    this.length += chunk.length;
  }

  /** Byte i of the queue (i < length), not consumed. */
  at(i: number): number {
    let k = this.first;
    let off = this.offset + i;
    while (off >= this.chunks[k]!.length) off -= this.chunks[k++]!.length;
    return this.chunks[k]![off]!;
  }

  /** Consumes n bytes (n <= length): a view when they lie in one chunk, else one copy. */
  take(n: number): Uint8Array {
    const head = this.chunks[this.first]!;
    let out: Uint8Array;
    if (head.length - this.offset >= n) {
      out = head.subarray(this.offset, this.offset + n);
      this.advance(n);
      return out;
    }
    out = new Uint8Array(n);
    let filled = 0;
    while (filled < n) {
      const c = this.chunks[this.first]!;
      const part = Math.min(n - filled, c.length - this.offset);
      out.set(c.subarray(this.offset, this.offset + part), filled);
      filled += part;
      this.advance(part);
    }
    return out;
  }

  private advance(n: number) {
    this.length -= n;
    this.offset += n;
    while (this.first < this.chunks.length && this.offset >= this.chunks[this.first]!.length) {
      this.offset -= this.chunks[this.first]!.length;
      this.first++;
    }
    if (this.first === this.chunks.length) {
      this.chunks = [];
      this.first = 0;
    } else if (this.first > 1024) {
      this.chunks = this.chunks.slice(this.first);
      this.first = 0;
    }
  }
}

/**
 * Splits a streaming request body into envelope payloads as bytes arrive. A length past `limit`
 * is refused (resource_exhausted) from its 5-byte prefix, before any of its payload is buffered.
 */
export async function* readEnvelopes(
  body: ReadableStream<Uint8Array> | null,
  encoding: string | null,
  limit = MAX_MESSAGE_BYTES,
): AsyncGenerator<Uint8Array> {
  if (!body) return;
  const queue = new ByteQueue();
  const reader = body.getReader();
  let failed = false;
  try {
    for (;;) {
      while (queue.length >= 5) {
        const len = ((queue.at(1) << 24) | (queue.at(2) << 16) | (queue.at(3) << 8) | queue.at(4)) >>> 0;
        if (len > limit) throw new ConnectError("resource_exhausted", `message size ${len} is larger than configured max ${limit}`);
        if (queue.length < 5 + len) break;
        const flags = queue.at(0);
        queue.take(5);
        const payload = len ? queue.take(len) : new Uint8Array(0);
        if (flags & FLAG_END) return; // clients never need to end a request stream this way
        if (flags & ~FLAG_COMPRESSED) throw new ConnectError("invalid_argument", `invalid envelope flags ${flags}`);
        yield flags & FLAG_COMPRESSED ? await decompress(payload, encoding ?? "none") : payload;
      }
      const { done, value } = await reader.read();
      if (done) break;
      queue.push(value);
    }
    if (queue.length) throw new ConnectError("invalid_argument", "incomplete envelope");
  } catch (e) {
    failed = true;
    throw e;
  } finally {
    // A refused stream is not read on: what the client still sends is dropped, not buffered.
    if (failed) reader.cancel().catch(() => {});
    else reader.releaseLock();
  }
}

function cors(h: Headers) {
  h.set("Access-Control-Allow-Origin", "*");
  h.set("Access-Control-Expose-Headers", "Grpc-Status, Grpc-Message, Grpc-Status-Details-Bin, Connect-Protocol-Version, Location, Cache-Control, X-Content-Type-Options");
}

function unaryError(err: ConnectError): Response {
  return Response.json(jsonError(err), { status: HTTP_STATUS[err.code] });
}

/** Runs before decoding: authenticates and returns the Basic-auth user name; a ConnectError it throws becomes the RPC error. */
export type Prelude = () => string | undefined;

/** Serves one RPC with the error semantics Connect clients expect for its kind. */
export async function serveRpc(req: Request, method: Method, prelude?: Prelude): Promise<Response> {
  const ct = mediaType(req);
  const streaming = method.kind !== "unary";
  const codec = streaming
    ? ct === "application/connect+json" ? "json" : ct === "application/connect+proto" ? "proto" : null
    : ct === "application/json" ? "json" : ct === "application/proto" ? "proto" : null;
  if (!codec) {
    const accept = streaming ? "application/connect+json, application/connect+proto" : "application/json, application/proto";
    return new Response(null, { status: 415, headers: { "Accept-Post": accept } });
  }
  const json = codec === "json";
  return streaming ? serveStream(req, method, json, prelude) : serveUnary(req, method, json, prelude);
}

async function serveUnary(req: Request, method: Extract<Method, { kind: "unary" }>, json: boolean, prelude?: Prelude): Promise<Response> {
  const ac = new AbortController();
  let timer: Timer | undefined;
  try {
    const username = prelude?.();
    const timeoutMs = parseTimeout(req.headers.get("connect-timeout-ms"));
    const body = await decompress(await readBounded(req, MAX_MESSAGE_BYTES), req.headers.get("content-encoding"));
    const input = decodeMsg(method.input, body, json);
    const ctx: RpcCtx = { headers: req.headers, signal: ac.signal, timeoutMs, keepaliveMs: 0, username };
    const work = Promise.resolve(method.handle(input, ctx));
    const deadline = timeoutMs
      ? new Promise<never>((_, rej) => { timer = setTimeout(() => rej(new ConnectError("deadline_exceeded", "deadline exceeded")), timeoutMs); })
      : undefined;
    const out = (await (deadline ? Promise.race([work, deadline]) : work)) as Msg;
    return new Response(encodeMsg(method.output, out ?? {}, json), {
      headers: { "Content-Type": json ? "application/json" : "application/proto" },
    });
  } catch (e) {
    return unaryError(toConnectError(e));
  } finally {
    clearTimeout(timer);
    ac.abort(new ConnectError("canceled", "request finished"));
  }
}

function serveStream(req: Request, method: Exclude<Method, { kind: "unary" }>, json: boolean, prelude?: Prelude): Response {
  const ac = new AbortController();
  let controller!: ReadableStreamDefaultController<Uint8Array>;
  let closed = false;
  let lastSend = Date.now();
  let kaTimer: Timer | undefined;
  let dlTimer: Timer | undefined;
  const ka = keepaliveMs(req.headers.get("keepalive-ping-interval"));

  const cleanup = () => {
    closed = true;
    clearTimeout(kaTimer);
    clearTimeout(dlTimer);
  };
  const send = (m: Msg) => {
    if (closed) return;
    try {
      controller.enqueue(envelope(0, encodeMsg(method.output, m, json)));
      lastSend = Date.now();
    } catch {
      cleanup(); // the client went away between checks
    }
  };
  const finish = (err?: ConnectError) => {
    if (closed) return;
    const end = err ? { error: jsonError(err) } : {};
    try {
      controller.enqueue(envelope(FLAG_END, new TextEncoder().encode(JSON.stringify(end))));
      controller.close();
    } catch {
      // already torn down by the client
    }
    cleanup();
  };
  // Re-armed lazily so a keepalive goes out exactly when the stream has been idle for `ka`.
  const armKeepalive = () => {
    if (method.kind !== "server" || !method.keepalive || closed) return;
    kaTimer = setTimeout(() => {
      if (closed) return;
      if (Date.now() - lastSend >= ka - 5) send(method.keepalive!);
      armKeepalive();
    }, Math.max(10, lastSend + ka - Date.now()));
  };

  const body = new ReadableStream<Uint8Array>({
    start(c) {
      controller = c;
    },
    cancel() {
      cleanup();
      ac.abort(new ConnectError("canceled", "client closed the stream"));
    },
  });
  req.signal?.addEventListener("abort", () => {
    if (closed) return;
    cleanup();
    ac.abort(new ConnectError("canceled", "client closed the stream"));
  });

  void (async () => {
    try {
      const username = prelude?.();
      const timeoutMs = parseTimeout(req.headers.get("connect-timeout-ms"));
      const encoding = req.headers.get("connect-content-encoding");
      if (encoding && encoding !== "identity" && encoding !== "gzip") {
        throw new ConnectError("unimplemented", `unsupported compression ${JSON.stringify(encoding)}`);
      }
      if (timeoutMs) {
        dlTimer = setTimeout(() => ac.abort(new ConnectError("deadline_exceeded", "deadline exceeded")), timeoutMs);
      }
      const ctx: RpcCtx = { headers: req.headers, signal: ac.signal, timeoutMs, keepaliveMs: ka, username };
      const frames = readEnvelopes(req.body, encoding);
      if (method.kind === "server") {
        const first = await frames.next();
        if (first.done) throw new ConnectError("invalid_argument", "missing request message");
        const extra = await frames.next();
        if (!extra.done) throw new ConnectError("invalid_argument", "unary request has multiple messages");
        const input = decodeMsg(method.input, first.value, json);
        armKeepalive();
        await method.handle(input, ctx, send);
        finish();
      } else {
        const input = (async function* () {
          for await (const f of frames) yield decodeMsg(method.input, f, json);
        })();
        const out = await method.handle(input, ctx);
        send(out ?? {});
        finish();
      }
    } catch (e) {
      finish(toConnectError(e));
    }
  })();

  const headers = new Headers({ "Content-Type": json ? "application/connect+json" : "application/connect+proto" });
  cors(headers);
  return new Response(body, { headers });
}

export { cors };
