// The proxy into sandboxes, on the API's port. A request is for a sandbox when it carries
// `e2b-sandbox-id` / `x-agentenv-sandbox-id`, when its host is `{port}-{id}.{domain}`, or when its
// path is `/proxy/{id}/{port}/...`. Bodies stream both ways unbuffered (bytes pass as they are:
// no decompression); a killed sandbox's open streams are cut. A paused sandbox with auto-resume
// is resumed by its traffic (one resume however many requests wait on it); without auto-resume
// it answers 502 "not found", E2B's answer, which the SDK's isRunning() reads. A path to envd is
// checked and forwarded in one form (envdPath); a WebSocket relay reads one side only while the
// other's backlog is under WS_BUFFERED_MAX.
import { posix } from "node:path";
import type { Server } from "bun";
import { WsRelays, forwardedHeaders, relayHttp, type WsData } from "./relay.ts";

export { WS_BUFFERED_MAX, type WsData } from "./relay.ts";
import type { Orchestrator } from "../orchestrator/orchestrator.ts";
import type { SandboxRecord } from "../orchestrator/store.ts";
import { ENVD_PORT } from "../orchestrator/envd.ts";
import { AUTO_RESUME_MIN_TIMEOUT_S } from "./sandboxes.ts";
import { secretMatches } from "./secret.ts";

export interface ProxyOptions {
  /**
   * Sandbox domain for host routing, compared without its port (`sbx.example.com:8443` matches
   * `{port}-{id}.sbx.example.com` on any port); empty: any host shaped `{port}-{id}.<anything>`.
   */
  domain: string;
}

/**
 * envd paths only the orchestrator may call (E2B's proxy refuses them for public traffic), checked
 * on envdPath's form in lower case: envd routes by exact path, and no route of it differs from
 * these by case alone, so refusing every case costs nothing.
 */
const ENVD_INTERNAL = new Set(["/init", "/freeze", "/unfreeze", "/collapse", "/fsfreeze", "/fsthaw", "/upgrade"]);
/** RFC 3986's unreserved characters: percent-encoded they name the same path, so they are decoded. */
const UNRESERVED = /^[A-Za-z0-9._~-]$/;
/** Encoded '/' or '\': refused, since a server that decodes them would route other segments than were checked. */
const ENCODED_SEPARATOR = /%(2f|5c)/i;
/** A '%' not followed by two hex digits. */
const BAD_ESCAPE = /%(?![0-9A-Fa-f]{2})/;
const SANDBOX_ID = /^[a-z0-9]{1,64}$/;

export interface ProxyTarget {
  id: string;
  port: number;
  /** Path and query as the request gave them. */
  path: string;
}

/** Where an admitted request goes: the sandbox's address and the path and query to send it. */
interface Upstream {
  host: string;
  port: number;
  path: string;
  hostHeader?: string;
}

/**
 * The one form of a path to envd that is both checked and forwarded: unreserved characters
 * percent-decoded (others kept, in upper case), duplicate slashes collapsed, `.` and `..`
 * resolved, no trailing slash. Undefined (refused) when it holds an encoded separator or a bad escape.
 */
function envdPath(pathname: string): string | undefined {
  if (BAD_ESCAPE.test(pathname) || ENCODED_SEPARATOR.test(pathname)) return undefined;
  const decoded = pathname.replace(/%([0-9A-Fa-f]{2})/g, (escape, hex: string) => {
    const c = String.fromCharCode(parseInt(hex, 16));
    return UNRESERVED.test(c) ? c : escape.toUpperCase();
  });
  const path = posix.normalize(`/${decoded}`);
  return path.length > 1 && path.endsWith("/") ? path.slice(0, -1) : path;
}

/** The path and query sent to port `port`: envd's in envdPath's form, another port's as given; undefined when refused. */
function upstreamPath(port: number, pathAndQuery: string): string | undefined {
  if (port !== ENVD_PORT) return pathAndQuery;
  const q = pathAndQuery.indexOf("?");
  const path = envdPath(q < 0 ? pathAndQuery : pathAndQuery.slice(0, q));
  return path === undefined ? undefined : path + (q < 0 ? "" : pathAndQuery.slice(q));
}

/** A Host header's name: lower case (names are case-insensitive), without its port or a trailing dot. */
const hostName = (host: string) => host.toLowerCase().replace(/:\d+$/, "").replace(/\.$/, "");

/** Where a request goes, or undefined when it is not for a sandbox. */
export function routeOf(req: Request, url: URL, opts: ProxyOptions): ProxyTarget | undefined {
  const h = req.headers;
  const id = h.get("e2b-sandbox-id") ?? h.get("x-agentenv-sandbox-id");
  if (id !== null) {
    const port = h.get("e2b-sandbox-port") ?? h.get("x-agentenv-target-port") ?? String(ENVD_PORT);
    return { id, port: Number(port), path: url.pathname + url.search };
  }
  const host = hostName(h.get("host") ?? "");
  const dot = host.indexOf(".");
  if (dot > 0 && (opts.domain === "" || host.slice(dot + 1) === hostName(opts.domain))) {
    // E2B's rule: the left-most label split on '-', part 0 the port, part 1 the sandbox ID (admit
    // checks it), later parts ignored (E2B's older `{id}-{client}` IDs); a label with no '-' (`api`) is the API's.
    const [port, id] = host.slice(0, dot).split("-", 2);
    if (id !== undefined && /^\d{1,5}$/.test(port!)) return { id, port: Number(port), path: url.pathname + url.search };
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
  /** Resumes started by traffic, one per sandbox (so at most one per sandbox the node holds); requests for it wait on it. */
  private readonly resuming = new Map<string, Promise<SandboxRecord>>();
  /** Open WebSocket relays (so their buffers can be counted). */
  private readonly relays = new WsRelays();

  constructor(private readonly orch: Orchestrator, private readonly opts: ProxyOptions) {
    orch.onGone((id) => this.streams.cut(id));
  }

  /**
   * The proxied response, or undefined when `req` is not for a sandbox. A WebSocket upgrade is
   * answered by upgrading on `server` (the promise then resolves to undefined, as Bun wants).
   */
  handle(req: Request, server?: Server<WsData>): Promise<Response | undefined> | undefined {
    const url = new URL(req.url);
    const route = routeOf(req, url, this.opts);
    if (!route) return undefined;
    return this.admit(req, route).then((a) => {
      if (a instanceof Response) return a;
      if (server && req.headers.get("upgrade")?.toLowerCase() === "websocket") return this.upgrade(req, route, a, server);
      return this.forward(req, route, a);
    });
  }

  /** Bytes the WebSocket relays hold now: messages waiting for a client to open, and what either side's socket has not yet taken. */
  wsBufferedBytes(): number {
    return this.relays.bufferedBytes();
  }

  /** Bun's WebSocket handlers for upgraded sandbox connections (pass as `websocket` to Bun.serve). */
  get websocket() {
    return this.relays.websocket;
  }

  /** Checks that `r` may go through: the sandbox exists and runs (resumed if it auto-resumes), the port is open to the public. */
  private async admit(req: Request, r: ProxyTarget): Promise<Response | Upstream> {
    if (!SANDBOX_ID.test(r.id)) return proxyError(400, r.id, "invalid sandbox ID: expected [a-z0-9]+");
    if (!Number.isInteger(r.port) || r.port < 1 || r.port > 65535) return proxyError(400, r.id, `invalid port ${r.port}`);
    const path = upstreamPath(r.port, r.path);
    if (path === undefined) return proxyError(400, r.id, "the path has an encoded '/' or '\\', or a '%' that is not an escape");
    const pathOnly = path.split("?")[0]!;
    if (r.port === ENVD_PORT && ENVD_INTERNAL.has(pathOnly.toLowerCase())) return proxyError(403, r.id, `${pathOnly} is not reachable through the proxy`);
    let rec = this.orch.store.get(r.id);
    if (!rec || rec.state === "killing" || rec.state === "creating") return proxyError(502, r.id, "The sandbox was not found");
    if (rec.state === "paused" || rec.state === "pausing" || rec.state === "resuming") {
      if (!rec.autoResume) return proxyError(502, r.id, "The sandbox was not found");
      try {
        rec = await this.autoResume(r.id);
      } catch (e) {
        return proxyError(502, r.id, `The sandbox could not be resumed: ${(e as Error).message}`);
      }
    }
    if (r.port !== ENVD_PORT && rec.trafficAccessToken !== null) {
      const given = req.headers.get("e2b-traffic-access-token");
      if (given === null) return proxyError(403, r.id, "Sandbox is secured with traffic access token. Token header 'e2b-traffic-access-token' is missing");
      if (!secretMatches(given, rec.trafficAccessToken)) return proxyError(403, r.id, "Sandbox is secured with traffic access token. Provided token in header 'e2b-traffic-access-token' is invalid");
    }
    const target = this.orch.target(r.id, r.port);
    if (!target) return proxyError(502, r.id, "The sandbox was not found");
    // E2B's maskRequestHost: non-envd ports see this Host, ${PORT} replaced.
    const mask = (rec.network as { maskRequestHost?: unknown } | null)?.maskRequestHost;
    if (r.port !== ENVD_PORT && typeof mask === "string") return { ...target, path, hostHeader: mask.replaceAll("${PORT}", String(r.port)) };
    return { ...target, path };
  }

  /**
   * Resumes sandbox `id` for its traffic; concurrent requests share one resume. Its TTL becomes
   * max(its end, now + 300 s): never shortened.
   */
  private autoResume(id: string): Promise<SandboxRecord> {
    const cur = this.resuming.get(id);
    if (cur) return cur;
    const t0 = performance.now();
    const p = this.orch.connect(id, AUTO_RESUME_MIN_TIMEOUT_S, { extendOnly: true }).then(({ rec }) => {
      console.log(`proxy: sandbox ${id} resumed by traffic (${Math.round(performance.now() - t0)} ms)`);
      return rec;
    }).finally(() => this.resuming.delete(id));
    this.resuming.set(id, p);
    return p;
  }

  /** Streams the request to the sandbox and its response back, neither buffered. */
  private async forward(req: Request, r: ProxyTarget, target: Upstream): Promise<Response> {
    const headers = forwardedHeaders(req);
    headers.delete("e2b-traffic-access-token");
    if (target.hostHeader) headers.set("host", target.hostHeader);
    const abort = new AbortController();
    const done = this.streams.add(r.id, abort);
    try {
      return await relayHttp(req, `http://${target.host}:${target.port}${target.path}`, headers, abort, done);
    } catch (e) {
      if (abort.signal.aborted) return proxyError(502, r.id, "The sandbox was not found");
      return proxyError(502, r.id, "The sandbox is running but port is not open", { port: r.port, detail: (e as Error).message });
    }
  }

  private async upgrade(req: Request, r: ProxyTarget, target: Upstream, server: Server<WsData>): Promise<Response | undefined> {
    const abort = new AbortController();
    const forget = this.streams.add(r.id, abort);
    const got = await this.relays.upgrade(req, `ws://${target.host}:${target.port}${target.path}`, server, abort, forget);
    if (got === "upgraded") return undefined;
    if (got === "unreachable") return proxyError(502, r.id, "The sandbox is running but port is not open", { port: r.port });
    return proxyError(400, r.id, "WebSocket upgrade failed");
  }
}
