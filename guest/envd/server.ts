// Envd's HTTP server: routing, CORS, the access-token gate and a last-resort error net, so that no
// request, however malformed, can take the process down.
import { ConnectError, cors, serveRpc, type Method } from "./connect.ts";
import { composeFiles, getFile, httpError, postFile, tokenMatches } from "./files.ts";
import { FilesystemService } from "./filesystem.ts";
import { envs, health, init, metrics, UNAUTHORIZED, writeMarkers } from "./http.ts";
import { ProcessService } from "./process.ts";
import { EnvdState, type EnvdOptions } from "./state.ts";

/** Basic-auth user for RPCs ("Basic base64(user:)"); malformed headers are an authentication error. */
function basicUser(req: Request): string | undefined {
  const h = req.headers.get("authorization");
  if (!h) return undefined;
  const m = /^Basic\s+([A-Za-z0-9+/=_-]*)\s*$/i.exec(h);
  if (!m) throw new ConnectError("unauthenticated", "invalid authorization header");
  const decoded = Buffer.from(m[1]!, "base64").toString("utf8");
  const user = decoded.split(":")[0] ?? "";
  return user || undefined;
}

export function createEnvd(opts: EnvdOptions) {
  const state = new EnvdState(opts);
  const processes = new ProcessService(state);
  const services: Record<string, Record<string, Method>> = {
    "process.Process": processes.methods(),
    "filesystem.Filesystem": new FilesystemService(state).methods(),
  };
  void writeMarkers(state);
  // What the image lacks is reported once before any request but /health is served (a build reads
  // the report as soon as envd answers).
  const started = state.refreshUsers()
    .then(() => state.toolbox.announce(state.users, false))
    .catch((e) => console.error(`envd: looking at the image: ${(e as Error)?.stack ?? e}`));

  async function route(req: Request): Promise<Response> {
    const url = new URL(req.url);
    const path = url.pathname;
    const method = req.method;

    if (method === "OPTIONS") {
      return new Response(null, {
        status: 204,
        headers: {
          "Access-Control-Allow-Methods": "GET, POST, PUT, PATCH, DELETE, OPTIONS",
          "Access-Control-Allow-Headers": req.headers.get("access-control-request-headers") ?? "*",
          "Access-Control-Max-Age": "7200",
        },
      });
    }
    if (path === "/health") return method === "GET" || method === "HEAD" ? health() : notAllowed("GET");
    await started;
    await state.refreshUsers();
    if (path === "/init") return method === "POST" ? init(req, state) : notAllowed("POST");
    if (path === "/files") {
      if (method === "GET" || method === "HEAD") return getFile(req, url, state);
      return method === "POST" ? postFile(req, url, state) : notAllowed("GET, POST");
    }

    // Everything below needs the access token once /init has set one.
    if (state.accessToken && !tokenMatches(req.headers.get("x-access-token"), state.accessToken)) {
      return httpError(401, UNAUTHORIZED);
    }
    if (path === "/files/compose") return method === "POST" ? composeFiles(req, state) : notAllowed("POST");
    if (path === "/envs") return method === "GET" ? envs(state) : notAllowed("GET");
    if (path === "/metrics") return method === "GET" ? metrics() : notAllowed("GET");

    const rpc = /^\/([\w.]+)\/(\w+)$/.exec(path);
    const service = rpc ? services[rpc[1]!] : undefined;
    if (rpc && service) {
      const m = Object.hasOwn(service, rpc[2]!) ? service[rpc[2]!] : undefined;
      if (!m) return Response.json({ code: "unimplemented", message: `${path} is not implemented` }, { status: 404 });
      if (method !== "POST") return notAllowed("POST");
      return serveRpc(req, m, () => basicUser(req));
    }
    return httpError(404, `${path} not found`);
  }

  async function fetch(req: Request): Promise<Response> {
    let res: Response;
    try {
      res = await route(req);
    } catch (e) {
      console.error(`envd: ${req.method} ${req.url}: ${(e as Error)?.stack ?? e}`);
      res = httpError(500, `internal error: ${(e as Error)?.message ?? e}`);
    }
    cors(res.headers);
    return res;
  }

  return { state, fetch, processes };
}

function notAllowed(allow: string): Response {
  const res = httpError(405, "method not allowed");
  res.headers.set("Allow", allow);
  return res;
}

export function serve(opts: EnvdOptions) {
  const envd = createEnvd(opts);
  const server = Bun.serve({
    port: opts.port,
    hostname: opts.host,
    idleTimeout: 0, // streams stay open indefinitely; keepalives are the liveness signal
    maxRequestBodySize: Number.MAX_SAFE_INTEGER, // uploads are streamed to disk, never buffered
    development: false,
    fetch: envd.fetch,
    error(e) {
      console.error(`envd: unhandled: ${e?.stack ?? e}`);
      return httpError(500, "internal error");
    },
  });
  return { ...envd, server };
}
