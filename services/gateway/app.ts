// The gateway's HTTP face: the node's own Elysia routes (src/api: the same auth, validation, error
// bodies and OpenAPI document), with one hook before every handler that sends the validated call
// to where it belongs (services/gateway/sandboxes.ts) instead of running it. Requests into
// sandboxes are relayed to the owning node before Elysia sees them, WebSockets included.
import type { Server } from "bun";
import { createApi } from "../../src/api/app.ts";
import { ApiError, notFound } from "../../src/api/errors.ts";
import { nodeRoutes } from "../../src/api/nodes.ts";
import { routeOf } from "../../src/api/proxy.ts";
import { WsRelays, forwardedHeaders, relayHttp, type WsData } from "../../src/api/relay.ts";
import { sandboxRoutes } from "../../src/api/sandboxes.ts";
import { templateRoutes } from "../../src/api/templates.ts";
import { isVolumeContentPath, volumeRoutes } from "../../src/api/volumes.ts";
import { EtcdError } from "../../src/cluster/etcd_client.ts";
import type { ClusterView } from "./cluster_view.ts";
import type { GatewayMetrics } from "./metrics.ts";
import type { GatewaySandboxes } from "./sandboxes.ts";
import type { GatewayVolumes } from "./volumes.ts";
import { NODE_LIST_TIMEOUT_MS, callNode, passOn } from "./upstream.ts";

export interface GatewayAppOptions {
  apiKey: string;
  maxBodyBytes: number;
  version: string;
  /** Sandbox domain for `{port}-{id}.{domain}` hosts; empty: any host of that shape. */
  domain: string;
  view: ClusterView;
  sandboxes: GatewaySandboxes;
  volumes: GatewayVolumes;
  metrics: GatewayMetrics;
}

/** Routes the gateway answers itself or lets Elysia answer (the OpenAPI document and its UI). */
const OWN = new Set(["/swagger/json", "/swagger/_plugin_ui", "/health"]);

const never = (): never => {
  throw new ApiError(500, "the gateway forwards this route; its handler never runs here");
};

export function gatewayApp(o: GatewayAppOptions) {
  const { view, sandboxes, volumes } = o;
  const dispatch = async (ctx: { request: Request; route: string; params?: Record<string, string>; body?: unknown }): Promise<Response | undefined> => {
    const { request: req, route, params = {} } = ctx;
    if (OWN.has(route)) return undefined;
    const url = new URL(req.url);
    const pq = url.pathname + url.search;
    const body = ctx.body as Record<string, unknown> | undefined;
    const m = req.method;
    const key = `${m} ${route}`;
    if (key === "GET /metrics") return new Response(o.metrics.text(view), { headers: { "content-type": "text/plain; version=0.0.4" } });
    if (key === "POST /sandboxes" || key === "POST /v2/sandboxes" || key === "POST /sandboxes-cold") return sandboxes.create(req, pq, body ?? {});
    if (key === "GET /sandboxes") return sandboxes.listV1(req, pq);
    if (key === "GET /v2/sandboxes") return sandboxes.listV2(req, url);
    if (params.sandboxID !== undefined) return sandboxes.byId(req, pq, params.sandboxID, body);
    if (key === "POST /volumes") return volumes.create(req, pq, body ?? {});
    if (key === "GET /volumes") return sandboxes.listUnion(req, pq, "volumeID");
    if (params.volumeID !== undefined) return volumes.byId(req, pq, params.volumeID, body, isVolumeContentPath(url.pathname));
    if (key === "GET /snapshots") return sandboxes.listUnion(req, pq, "snapshotID");
    if (key === "GET /templates" || key === "GET /v2/templates") return sandboxes.listUnion(req, pq, "templateID");
    if (key === "GET /nodes") return sandboxes.listUnion(req, pq, "id");
    if (params.nodeID !== undefined) {
      const node = view.nodes.get(params.nodeID);
      if (!node) throw notFound(`node ${params.nodeID} not found`);
      return passOn(await callNode(node, req, pq, body, NODE_LIST_TIMEOUT_MS));
    }
    if (key === "PUT /templates/:templateID/files/:hash") return upload(req, pq, params.templateID!, params.hash!);
    // Templates, snapshots and builds: the first node that knows the ID answers.
    const r = await sandboxes.firstKnowing(req, pq, body);
    if (key === "GET /templates/:templateID/files/:hash" && r.status === 201) {
      // The upload URL the node signed names the node: the client uploads through this gateway instead.
      const out = (await r.json()) as { present: boolean; url: string };
      const u = new URL(out.url);
      return Response.json({ ...out, url: `${url.origin}${u.pathname}${u.search}` }, { status: 201 });
    }
    return r;
  };

  /**
   * A COPY archive's upload (signed by the node that will build; no API key): relayed as it
   * streams to the node that knows the template's file, found by asking each with the gateway's key.
   */
  const upload = async (req: Request, pq: string, templateID: string, hash: string): Promise<Response> => {
    const probe = new Request(req.url, { method: "GET", headers: { "x-api-key": o.apiKey } });
    for (const node of view.liveNodes()) {
      const r = await callNode(node, probe, `/templates/${encodeURIComponent(templateID)}/files/${encodeURIComponent(hash)}`, undefined, NODE_LIST_TIMEOUT_MS).catch(() => undefined);
      if (!r || r.status !== 201) continue;
      await r.arrayBuffer();
      try {
        return await relayHttp(req, `${node.apiUrl}${pq}`, forwardedHeaders(req), new AbortController(), () => {});
      } catch (e) {
        throw new ApiError(502, `node ${node.id} did not take the upload: ${(e as Error).message}`);
      }
    }
    throw notFound(`no node is building template ${templateID}`);
  };

  const app = createApi({ apiKey: o.apiKey, maxBodyBytes: o.maxBodyBytes, notReadyReason: () => view.notReady(), version: o.version })
    .onBeforeHandle({ as: "global" }, async (ctx) => {
      try {
        return await dispatch(ctx as unknown as Parameters<typeof dispatch>[0]);
      } catch (e) {
        // The cluster's store out of reach: the caller may retry; nothing was placed.
        if (e instanceof EtcdError) throw new ApiError(503, `the cluster store (etcd) did not answer: ${e.message}`);
        throw e;
      }
    })
    .use(sandboxRoutes(never, { domain: o.domain || null, defaultTimeoutS: 300 }))
    .use(templateRoutes(never))
    .use(volumeRoutes(never, { maxBodyBytes: o.maxBodyBytes }))
    .use(nodeRoutes({
      store: undefined as never, templates: undefined as never, orch: () => undefined, status: () => "ready",
      openStreams: () => undefined, version: o.version, home: "/",
    }));

  const relays = new WsRelays();
  /** A request into a sandbox: relayed to its node's proxy as `/proxy/{id}/{port}/…` ("upgraded": a WebSocket now relayed); undefined when it is not for a sandbox. */
  const proxy = async (req: Request, server: Server<WsData>): Promise<Response | "upgraded" | undefined> => {
    const url = new URL(req.url);
    const r = routeOf(req, url, { domain: o.domain });
    if (!r) return undefined;
    const err = (status: number, message: string) => Response.json({ sandboxId: r.id, message, code: status }, { status });
    if (!/^[a-z0-9]{1,64}$/.test(r.id)) return err(400, "invalid sandbox ID: expected [a-z0-9]+");
    let owner;
    try {
      owner = await view.owner(r.id);
    } catch (e) {
      return err(503, `the cluster store did not answer: ${(e as Error).message}`);
    }
    // A paused sandbox that resumes on traffic, whose node left: taken onto another node, whose proxy resumes it.
    if (owner.kind === "lost" && owner.binding.exported && owner.binding.autoResume) {
      const to = await sandboxes.move(req, r.id, owner.binding).catch(() => undefined);
      if (to) owner = { kind: "live" as const, node: to, binding: { ...owner.binding, node: to.id } };
    }
    // E2B's answer for a sandbox that is not there (the SDK's isRunning() reads it).
    if (owner.kind !== "live") return err(502, "The sandbox was not found");
    o.metrics.proxied++;
    const target = `${owner.node.apiUrl}/proxy/${r.id}/${r.port}${r.path.startsWith("/") ? "" : "/"}${r.path}`;
    const abort = new AbortController();
    if (req.headers.get("upgrade")?.toLowerCase() === "websocket") {
      const got = await relays.upgrade(req, target.replace(/^http/, "ws"), server, abort, () => {});
      if (got === "upgraded") return "upgraded";
      return err(got === "unreachable" ? 502 : 400, got === "unreachable" ? `node ${owner.node.id} did not open the WebSocket` : "WebSocket upgrade failed");
    }
    const headers = forwardedHeaders(req);
    // The path form names the sandbox; headers naming another would contradict it.
    for (const h of ["e2b-sandbox-id", "e2b-sandbox-port", "x-agentenv-sandbox-id", "x-agentenv-target-port"]) headers.delete(h);
    try {
      return await relayHttp(req, target, headers, abort, () => {});
    } catch (e) {
      return err(502, `node ${owner.node.id} did not answer: ${(e as Error).message}`);
    }
  };

  return { app, proxy, relays };
}
