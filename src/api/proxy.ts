// The proxy into sandboxes, on the API's port. A request is for a sandbox when it carries
// `e2b-sandbox-id` / `x-agentenv-sandbox-id`, when its host is `{port}-{id}.{domain}`, or when its
// path is `/proxy/{id}/{port}/...`. Bodies stream both ways unbuffered (bytes pass as they are:
// no decompression); a killed sandbox's open streams are cut.
import type { Orchestrator } from "../orchestrator/orchestrator.ts";
import { ENVD_PORT } from "../orchestrator/envd.ts";
import { AUTO_RESUME_MIN_TIMEOUT_S } from "./sandboxes.ts";

export interface ProxyOptions {
  /** Sandbox domain for host routing; empty: any host shaped `{port}-{id}.<anything>`. */
  domain: string;
}

/** envd paths only the orchestrator may call (E2B's proxy refuses them for public traffic). */
const ENVD_INTERNAL = new Set(["/init", "/freeze", "/unfreeze", "/collapse", "/fsfreeze", "/fsthaw", "/upgrade"]);
const HOP_BY_HOP = ["connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer", "transfer-encoding", "upgrade", "host", "content-length"];
const SANDBOX_ID = /^[a-z0-9]{1,64}$/;

export interface ProxyTarget {
  id: string;
  port: number;
  /** Path and query to send upstream. */
  path: string;
}

/** Where a request goes, or undefined when it is not for a sandbox. */
export function routeOf(req: Request, url: URL, opts: ProxyOptions): ProxyTarget | undefined {
  const h = req.headers;
  const id = h.get("e2b-sandbox-id") ?? h.get("x-agentenv-sandbox-id");
  if (id !== null) {
    const port = h.get("e2b-sandbox-port") ?? h.get("x-agentenv-target-port") ?? String(ENVD_PORT);
    return { id, port: Number(port), path: url.pathname + url.search };
  }
  const host = (h.get("host") ?? "").replace(/:\d+$/, "");
  const dot = host.indexOf(".");
  if (dot > 0 && (opts.domain === "" || host.slice(dot + 1) === opts.domain)) {
    const m = /^(\d{1,5})-([a-z0-9]{1,64})$/.exec(host.slice(0, dot));
    if (m) return { id: m[2]!, port: Number(m[1]), path: url.pathname + url.search };
  }
  const p = /^\/proxy\/([^/]+)\/(\d{1,5})(\/.*)?$/.exec(url.pathname);
  if (p) return { id: p[1]!, port: Number(p[2]), path: (p[3] ?? "/") + url.search };
  return undefined;
}

function proxyError(status: number, sandboxId: string, message: string, extra: Record<string, unknown> = {}): Response {
  return Response.json({ sandboxId, message, ...extra, code: status }, { status });
}

/** Open upstream requests per sandbox, so a kill can cut them. */
class OpenStreams {
  private readonly bySandbox = new Map<string, Set<AbortController>>();
  add(id: string, c: AbortController): () => void {
    let set = this.bySandbox.get(id);
    if (!set) this.bySandbox.set(id, (set = new Set()));
    set.add(c);
    return () => {
      set!.delete(c);
      if (set!.size === 0 && this.bySandbox.get(id) === set) this.bySandbox.delete(id);
    };
  }
  cut(id: string): void {
    const set = this.bySandbox.get(id);
    this.bySandbox.delete(id);
    for (const c of set ?? []) c.abort(new Error(`sandbox ${id} is gone`));
  }
  count(): number {
    let n = 0;
    for (const s of this.bySandbox.values()) n += s.size;
    return n;
  }
}

export class SandboxProxy {
  readonly streams = new OpenStreams();

  constructor(private readonly orch: Orchestrator, private readonly opts: ProxyOptions) {
    orch.onGone((id) => this.streams.cut(id));
  }

  /** The proxied response, or undefined when `req` is not for a sandbox. */
  handle(req: Request): Promise<Response> | undefined {
    const url = new URL(req.url);
    const route = routeOf(req, url, this.opts);
    return route && this.forward(req, route);
  }

  private async forward(req: Request, r: ProxyTarget): Promise<Response> {
    if (!SANDBOX_ID.test(r.id)) return proxyError(400, r.id, "invalid sandbox ID: expected [a-z0-9]+");
    if (!Number.isInteger(r.port) || r.port < 1 || r.port > 65535) return proxyError(400, r.id, `invalid port ${r.port}`);
    let rec = this.orch.store.get(r.id);
    if (!rec || rec.state === "killing" || rec.state === "creating") return proxyError(502, r.id, "The sandbox was not found");
    if (rec.state === "paused" || rec.state === "pausing" || rec.state === "resuming") {
      if (!rec.autoResume) return proxyError(502, r.id, "The sandbox was not found");
      try {
        rec = (await this.orch.connect(r.id, AUTO_RESUME_MIN_TIMEOUT_S)).rec;
      } catch (e) {
        return proxyError(502, r.id, `The sandbox could not be resumed: ${(e as Error).message}`);
      }
    }
    const path = r.path.split("?")[0]!;
    if (r.port === ENVD_PORT && ENVD_INTERNAL.has(path)) return proxyError(403, r.id, `${path} is not reachable through the proxy`);
    if (r.port !== ENVD_PORT && rec.trafficAccessToken !== null) {
      const given = req.headers.get("e2b-traffic-access-token");
      if (given === null) return proxyError(403, r.id, "Sandbox is secured with traffic access token. Token header 'e2b-traffic-access-token' is missing");
      if (given !== rec.trafficAccessToken) return proxyError(403, r.id, "Sandbox is secured with traffic access token. Provided token in header 'e2b-traffic-access-token' is invalid");
    }
    const target = this.orch.target(r.id, r.port);
    if (!target) return proxyError(502, r.id, "The sandbox was not found");

    const headers = new Headers(req.headers);
    for (const h of HOP_BY_HOP) headers.delete(h);
    headers.delete("e2b-traffic-access-token");
    const abort = new AbortController();
    const done = this.streams.add(r.id, abort);
    req.signal.addEventListener("abort", () => abort.abort(), { once: true });
    let upstream: Response;
    try {
      upstream = await fetch(`http://${target.host}:${target.port}${r.path}`, {
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
      if (abort.signal.aborted) return proxyError(502, r.id, "The sandbox was not found");
      return proxyError(502, r.id, "The sandbox is running but port is not open", { port: r.port, detail: (e as Error).message });
    }
    const out = new Headers(upstream.headers);
    for (const h of HOP_BY_HOP) if (h !== "content-length") out.delete(h);
    if (!upstream.body) {
      done();
      return new Response(null, { status: upstream.status, headers: out });
    }
    // Pass the body through chunk by chunk (no buffering); an abort (kill) errors it, which cuts
    // the client's connection; its end or a client going away forgets it.
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
}
