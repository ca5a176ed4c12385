// Relays of one request to an upstream HTTP server: bodies stream both ways unbuffered (bytes pass
// as they are, no decompression), and WebSockets relay message by message, each side read only
// while the other's backlog is under WS_BUFFERED_MAX. The node's proxy relays to a sandbox's port;
// the cluster's gateway relays to the node that owns the sandbox.
import type { Server, ServerWebSocket, WebSocketHandler } from "bun";

export const HOP_BY_HOP = ["connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer", "transfer-encoding", "upgrade", "host", "content-length"];
/** Messages from upstream held while the client's side of a WebSocket is opening. */
const WS_PENDING_MAX = 1 << 20;
const WS_CONNECT_TIMEOUT_MS = 10_000;
/**
 * Bytes a WebSocket relay lets queue toward one side before it stops reading the other: 1 MiB keeps
 * a fast link busy for several round trips and bounds what a side that does not read costs.
 */
export const WS_BUFFERED_MAX = 1 << 20;
/** How often a client paused for upstream's backlog is resumed once it drained (Bun's WebSocket client has no drain event). */
const WS_DRAIN_POLL_MS = 10;

export interface WsData {
  upstream: WebSocket;
  client: ServerWebSocket<WsData> | undefined;
  pending: (string | Uint8Array)[];
  pendingBytes: number;
  /** Set while the client's reading is paused for upstream's backlog. */
  drainPoll: ReturnType<typeof setInterval> | undefined;
  done: () => void;
}

/** The request's headers as an upstream gets them: hop-by-hop ones dropped. */
export function forwardedHeaders(req: Request): Headers {
  const headers = new Headers(req.headers);
  for (const h of HOP_BY_HOP) headers.delete(h);
  return headers;
}

/**
 * Sends `req` to `url` with `headers` and streams the answer back; `abort` cuts both (a kill), and
 * `done` runs once when the exchange ends however it ends. Throws when upstream cannot be reached.
 */
export async function relayHttp(req: Request, url: string, headers: Headers, abort: AbortController, done: () => void): Promise<Response> {
  req.signal.addEventListener("abort", () => abort.abort(), { once: true });
  let upstream: Response;
  try {
    upstream = await fetch(url, {
      method: req.method,
      headers,
      body: req.method === "GET" || req.method === "HEAD" ? undefined : req.body,
      redirect: "manual",
      signal: abort.signal,
      decompress: false, // Bun: pass encoded bodies through as they are
      duplex: "half", // stream the request body as it arrives
    } as RequestInit);
  } catch (e) {
    done();
    throw e;
  }
  const out = new Headers(upstream.headers);
  for (const h of HOP_BY_HOP) if (h !== "content-length") out.delete(h);
  if (!upstream.body) {
    done();
    return new Response(null, { status: upstream.status, headers: out });
  }
  // Pass the body through chunk by chunk (no buffering); an abort errors it, which cuts the
  // client's connection; its end or a client going away forgets it.
  const reader = upstream.body.getReader();
  const body = new ReadableStream<Uint8Array>({
    async pull(c) {
      try {
        const { done: end, value } = await reader.read();
        if (end) {
          done();
          c.close();
        } else c.enqueue(value);
      } catch (e) {
        done();
        c.error(e);
      }
    },
    cancel(reason) {
      done();
      abort.abort();
      reader.cancel(reason).catch(() => {});
    },
  }, { highWaterMark: 0 });
  return new Response(body, { status: upstream.status, headers: out });
}

/** WebSocket relays: Bun's handlers for upgraded connections, and the open relays (their buffers counted). */
export class WsRelays {
  private readonly open = new Set<WsData>();

  /** Bytes the relays hold now: messages waiting for a client to open, and what either side's socket has not yet taken. */
  bufferedBytes(): number {
    let n = 0;
    for (const d of this.open) n += d.pendingBytes + d.upstream.bufferedAmount + (d.client?.getBufferedAmount() ?? 0);
    return n;
  }

  /** Bun's WebSocket handlers for upgraded connections (pass as `websocket` to Bun.serve). */
  readonly websocket: WebSocketHandler<WsData> = {
    open: (ws) => {
      const d = ws.data;
      d.client = ws;
      for (const m of d.pending) ws.send(m);
      d.pending.length = 0;
      d.pendingBytes = 0;
      if (ws.getBufferedAmount() > WS_BUFFERED_MAX) d.upstream.pause();
    },
    message: (ws, msg) => {
      const up = ws.data.upstream;
      if (up.readyState !== WebSocket.OPEN) return;
      up.send(msg);
      if (up.bufferedAmount > WS_BUFFERED_MAX) pauseClient(ws);
    },
    // The client's socket took its backlog: upstream is read again.
    drain: (ws) => {
      if (ws.getBufferedAmount() <= WS_BUFFERED_MAX) ws.data.upstream.resume();
    },
    close: (ws, code, reason) => {
      ws.data.done();
      try { ws.data.upstream.close(code === 1005 ? 1000 : code, reason); } catch { ws.data.upstream.close(); }
    },
  };

  /**
   * Opens `url` (ws://) with the request's subprotocols and upgrades `req` on `server` once it is
   * open: "upgraded", or "unreachable" / "refused" (nothing left open). `abort` closes both sides;
   * `forget` runs once when the relay ends.
   */
  async upgrade(req: Request, url: string, server: Server<WsData>, abort: AbortController, forget: () => void): Promise<"upgraded" | "unreachable" | "refused"> {
    const protocols = req.headers.get("sec-websocket-protocol")?.split(",").map((p) => p.trim()).filter(Boolean);
    const upstream = new WebSocket(url, protocols);
    upstream.binaryType = "arraybuffer";
    const data: WsData = {
      upstream, pending: [], pendingBytes: 0, client: undefined, drainPoll: undefined,
      done: () => {
        forget();
        clearInterval(data.drainPoll);
        this.open.delete(data);
      },
    };
    this.open.add(data);
    abort.signal.addEventListener("abort", () => {
      data.client?.close(1001, "the other side is gone");
      upstream.close();
    }, { once: true });
    upstream.onmessage = (e) => {
      const m = typeof e.data === "string" ? e.data : new Uint8Array(e.data as ArrayBuffer);
      if (data.client) {
        data.client.send(m);
        // The client's socket backs up: stop reading upstream until drain() sees it take the backlog.
        if (data.client.getBufferedAmount() > WS_BUFFERED_MAX) upstream.pause();
        return;
      }
      data.pendingBytes += typeof m === "string" ? m.length : m.byteLength;
      if (data.pendingBytes > WS_PENDING_MAX) upstream.close(1009, "client not ready");
      else data.pending.push(m);
    };
    upstream.onclose = (e) => {
      data.done();
      data.client?.close(e.code === 1005 || e.code === 1006 ? 1000 : e.code, e.reason);
    };
    const opened = await new Promise<boolean>((resolve) => {
      const t = setTimeout(() => resolve(false), WS_CONNECT_TIMEOUT_MS);
      upstream.onopen = () => { clearTimeout(t); resolve(true); };
      upstream.onerror = () => { clearTimeout(t); resolve(false); };
    });
    if (!opened) {
      data.done();
      upstream.close();
      return "unreachable";
    }
    if (server.upgrade(req, { data, headers: upstream.protocol ? { "sec-websocket-protocol": upstream.protocol } : undefined })) return "upgraded";
    data.done();
    upstream.close();
    return "refused";
  }
}

/** Stops reading a client whose messages back up toward upstream, until that backlog is under WS_BUFFERED_MAX. */
function pauseClient(ws: ServerWebSocket<WsData>): void {
  const d = ws.data;
  if (d.drainPoll !== undefined) return;
  ws.pause();
  d.drainPoll = setInterval(() => {
    if (d.upstream.readyState === WebSocket.OPEN && d.upstream.bufferedAmount > WS_BUFFERED_MAX) return;
    clearInterval(d.drainPoll);
    d.drainPoll = undefined;
    ws.resume();
  }, WS_DRAIN_POLL_MS);
}
