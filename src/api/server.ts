// One port for the API and the proxy: a request for a sandbox goes to the proxy (WebSocket
// upgrades included) before Elysia sees it, so proxied traffic pays no API routing or hooks. With
// a certificate the same handler serves HTTPS (the node's second listener, docs/node.md).
import type { Server } from "bun";
import type { SandboxProxy, WsData } from "./proxy.ts";

/** Bun's longest idle timeout; envd streams send keepalives every 50 s, well inside it. */
export const IDLE_TIMEOUT_S = 255;

export interface ServeOptions {
  hostname: string;
  port: number;
  /** PEM certificate chain and key: the listener speaks HTTPS (Bun offers no ALPN: HTTP/1.1 inside). */
  tls?: { cert: string; key: string };
  /** The proxy once the node can run sandboxes; until then sandbox traffic gets the API's answer. */
  proxy: () => SandboxProxy | undefined;
}

/** Anything that answers a Request (the Elysia app's `handle`). */
export interface RequestHandler {
  handle(req: Request): Promise<Response> | Response;
}

export function serveNode(app: RequestHandler, o: ServeOptions): Server<WsData> {
  const ws = (): SandboxProxy["websocket"] => {
    const p = o.proxy();
    if (!p) throw new Error("WebSocket before the proxy exists");
    return p.websocket;
  };
  return Bun.serve<WsData>({
    hostname: o.hostname,
    port: o.port,
    ...(o.tls ? { tls: { cert: o.tls.cert, key: o.tls.key } } : {}),
    idleTimeout: IDLE_TIMEOUT_S,
    // Uploads through the proxy stream and may be any size; API routes bound their own bodies.
    maxRequestBodySize: Number.MAX_SAFE_INTEGER,
    fetch(req, server) {
      return o.proxy()?.handle(req, server) ?? app.handle(req);
    },
    websocket: {
      open: (s) => void ws().open?.(s),
      message: (s, m) => void ws().message?.(s, m),
      drain: (s) => void ws().drain?.(s),
      close: (s, c, r) => void ws().close?.(s, c, r),
    },
  });
}
