// The gateway's answers to the sandbox routes: creates placed by the scheduler (a refusing node
// passes the create to the next candidate, a node that may have started one never does), by-ID
// calls forwarded to the owning node, and lists merged across nodes in the nodes' own order and
// page tokens, so a page is stable while nodes join or leave.
import { ApiError, notFound } from "../../src/api/errors.ts";
import { parseMetadataFilter } from "../../src/api/sandboxes.ts";
import { encodeCursor, listScope, LIST_LIMIT_MAX } from "../../src/orchestrator/store.ts";
import type { Binding, NodeRecord } from "../../src/cluster/records.ts";
import { rank, type PlacementOptions } from "../scheduler/placement.ts";
import { Reservations } from "../scheduler/reservations.ts";
import type { ClusterView } from "./cluster_view.ts";
import type { GatewayMetrics } from "./metrics.ts";
import { NODE_LIST_TIMEOUT_MS, NodeUnreachable, callNode, jsonOf, passOn } from "./upstream.ts";

/** A node's list answer: an array, else a 502 naming the node (a list never half-trusts a node). */
async function listOf<T>(node: NodeRecord, r: Response): Promise<T[]> {
  const v = await jsonOf<unknown>(r);
  if (!Array.isArray(v)) throw new ApiError(502, `node ${node.id} answered its list with something that is not an array`);
  return v as T[];
}

/** Statuses with which a node refuses a create before starting anything: the next candidate is asked. */
const REFUSALS = new Set([404, 429, 503, 507]);
/** Candidates a create tries at most. */
export const MAX_CREATE_TRIES = 4;

export interface GatewaySandboxesOptions {
  /** The cluster's API key: the gateway's own calls (a move) carry it. */
  apiKey: string;
  view: ClusterView;
  reservations: Reservations;
  metrics: GatewayMetrics;
  placement?: PlacementOptions;
}

type Listed = { sandboxID: string; startedAt: string; state: string } & Record<string, unknown>;

const rfc3339 = (ms: number) => new Date(ms).toISOString();

function lostBody(id: string, b: Binding): Listed {
  return {
    templateID: b.templateId, ...(b.alias ? { alias: b.alias } : {}), sandboxID: id, clientID: "aenv",
    startedAt: rfc3339(b.startedAt), endAt: rfc3339(b.endAt), cpuCount: b.cpuCount, memoryMB: b.memoryMB, diskSizeMB: b.diskSizeMB,
    // A paused sandbox in the shared store resumes on another node: it is paused, not lost.
    metadata: b.metadata, state: b.exported ? "paused" : "lost", envdVersion: b.envdVersion,
  };
}

export class GatewaySandboxes {
  constructor(private readonly o: GatewaySandboxesOptions) {}

  /** POST /sandboxes, /v2/sandboxes, /sandboxes-cold. */
  async create(req: Request, pathAndQuery: string, body: Record<string, unknown>): Promise<Response> {
    const cold = pathAndQuery.startsWith("/sandboxes-cold");
    const template = cold ? `cold:${String(body.image)}` : String(body.templateID);
    const need = { template, cpus: Number(body.cpuCount ?? 1), memoryMB: Number(body.memoryMB ?? 512), layers: this.o.view.template(template)?.layers };
    const candidates = rank(this.o.view.liveNodes(), await this.o.reservations.all(), need, this.o.placement).slice(0, MAX_CREATE_TRIES);
    if (candidates.length === 0) {
      this.o.metrics.creates.none++;
      const any = this.o.view.liveNodes().length > 0;
      throw new ApiError(any ? 429 : 503, any ? "every node in the cluster is full, draining or cordoned" : "no node is in the cluster");
    }
    let last: Response | undefined;
    for (const { node } of candidates) {
      const rid = crypto.randomUUID();
      if (!(await this.o.reservations.reserve(node, { id: rid, cpus: need.cpus, memoryMB: need.memoryMB }))) continue;
      let r: Response;
      try {
        r = await callNode(node, req, pathAndQuery, body);
      } catch (e) {
        if (e instanceof NodeUnreachable && e.refused) {
          this.o.metrics.creates.retried++;
          continue;
        }
        // The node may have started it: never a second one for one request.
        this.o.metrics.creates.failed++;
        throw new ApiError(502, (e as Error).message);
      } finally {
        void this.o.reservations.release(node.id, rid).catch(() => {});
      }
      if (REFUSALS.has(r.status)) {
        last = r;
        this.o.metrics.creates.retried++;
        continue;
      }
      if (r.status !== 201) return passOn(r);
      const text = await r.text();
      const out = JSON.parse(text) as { sandboxID?: string };
      if (out.sandboxID) this.o.view.learn(out.sandboxID, this.provisional(node, need, body));
      this.o.metrics.creates.placed++;
      const headers = new Headers(r.headers);
      headers.delete("content-length");
      headers.set("x-aenv-node", node.id);
      return new Response(text, { status: r.status, headers });
    }
    this.o.metrics.creates.none++;
    if (last) return passOn(last);
    throw new ApiError(429, "every candidate node is full (reservations of creates in flight included)");
  }

  /** A binding as the gateway knows it from a create's answer, until the watch brings the node's. */
  private provisional(node: NodeRecord, need: { template: string; cpus: number; memoryMB: number }, body: Record<string, unknown>): Binding {
    const now = Date.now();
    return {
      node: node.id, lease: "0", templateId: need.template, cpuCount: need.cpus, memoryMB: need.memoryMB, diskSizeMB: 0,
      metadata: (body.metadata as Record<string, string> | undefined) ?? {}, envdVersion: "", startedAt: now, endAt: now,
    };
  }

  /**
   * Resume anywhere: paused sandbox `id`, whose node left the cluster or drains, taken onto another
   * node (the scheduler's candidates in order); that node, or undefined when none could take it.
   */
  async move(req: Request, id: string, b: Binding): Promise<NodeRecord | undefined> {
    const need = { template: b.templateId, cpus: b.cpuCount, memoryMB: b.memoryMB };
    const nodes = this.o.view.liveNodes().filter((n) => n.id !== b.node);
    for (const { node } of rank(nodes, await this.o.reservations.all(), need, this.o.placement).slice(0, MAX_CREATE_TRIES)) {
      let r: Response;
      try {
        r = await callNode(node, new Request(req.url, { method: "POST", headers: { "x-api-key": this.o.apiKey } }), `/sandboxes/${id}/move`, {});
      } catch {
        continue;
      }
      if (r.status === 201) {
        await r.arrayBuffer();
        this.o.view.learn(id, { ...b, node: node.id });
        this.o.metrics.moved++;
        return node;
      }
      const why = (await jsonOf<{ message?: string }>(r).catch(() => ({ message: "" }))).message ?? "";
      // Another node took it meanwhile: it is there now.
      if (r.status === 409 && /taken by another node/.test(why)) {
        const now = await this.o.view.owner(id);
        if (now.kind === "live") return now.node;
      }
    }
    return undefined;
  }

  /** A route on one sandbox: to the node that owns it. */
  async byId(req: Request, pathAndQuery: string, id: string, body: unknown): Promise<Response> {
    let owner = await this.o.view.owner(id);
    if (owner.kind === "none") throw notFound(`sandbox ${id} not found`);
    const path = pathAndQuery.split("?")[0]!;
    const resumes = req.method === "POST" && (path === `/sandboxes/${id}/connect` || path === `/v2/sandboxes/${id}/connect` || path === `/sandboxes/${id}/resume` || path === `/sandboxes/${id}/move`);
    // A paused sandbox in the shared store whose node is gone, or drains and is asked to resume: taken onto another node first.
    if (owner.binding?.exported && (owner.kind === "lost" || (resumes && owner.node.status !== "ready"))) {
      const to = await this.move(req, id, owner.binding);
      if (!to) throw new ApiError(503, `sandbox ${id} is paused in the shared store but no node could take it now`);
      if (path === `/sandboxes/${id}/move`) return this.byId(new Request(req.url, { method: "GET", headers: req.headers }), `/sandboxes/${id}`, id, undefined);
      owner = { kind: "live", node: to, binding: { ...owner.binding, node: to.id } };
    }
    if (owner.kind === "lost") {
      // The node left the cluster: a kill forgets the sandbox; anything else says where it was.
      if (req.method === "DELETE" && pathAndQuery.split("?")[0] === `/sandboxes/${id}`) {
        await this.o.view.etcd.delete(`/aenv/sandboxes/${id}`);
        this.o.view.forget(id);
        return new Response(null, { status: 204 });
      }
      throw new ApiError(502, `sandbox ${id} is lost: its node ${owner.nodeId} left the cluster (its lease expired)`, { state: "lost", node: owner.nodeId });
    }
    this.o.metrics.forwarded++;
    let r: Response;
    try {
      r = await callNode(owner.node, req, pathAndQuery, body);
    } catch (e) {
      throw new ApiError(502, (e as Error).message);
    }
    if (req.method === "DELETE" && r.status === 204) this.o.view.forget(id);
    if (r.status === 201 && pathAndQuery.startsWith(`/sandboxes/${id}/fork`)) {
      // The children run on the parent's node, which bound them: route them at once.
      const text = await r.text();
      for (const c of JSON.parse(text) as { sandbox?: { sandboxID: string } }[]) if (c.sandbox) this.o.view.learn(c.sandbox.sandboxID, { ...owner.binding });
      return new Response(text, { status: 201, headers: { "content-type": "application/json" } });
    }
    return passOn(r);
  }

  /** Every live node's answer to the same GET, in parallel; a node that fails is named in `failed`. */
  async fanOut(req: Request, pathAndQuery: string): Promise<{ answers: { node: NodeRecord; r: Response }[]; failed: string[] }> {
    const nodes = this.o.view.liveNodes();
    const got = await Promise.all(nodes.map(async (node) => {
      try {
        return { node, r: await callNode(node, req, pathAndQuery, undefined, NODE_LIST_TIMEOUT_MS) };
      } catch {
        return { node, r: undefined };
      }
    }));
    const answers = got.filter((g): g is { node: NodeRecord; r: Response } => g.r !== undefined && g.r.ok);
    const failed = got.filter((g) => !g.r || !g.r.ok).map((g) => g.node.id);
    // A 4xx from every node is the caller's mistake (bad filters): answer it as the nodes did.
    const bad = got.find((g) => g.r && g.r.status >= 400 && g.r.status < 500);
    if (answers.length === 0 && bad?.r) throw new ApiError(bad.r.status, (await jsonOf<{ message?: string }>(bad.r)).message ?? "refused");
    return { answers, failed };
  }

  /** GET /sandboxes (v1, running only, not paginated). */
  async listV1(req: Request, pathAndQuery: string): Promise<Response> {
    const { answers, failed } = await this.fanOut(req, pathAndQuery);
    const all: Listed[] = [];
    for (const a of answers) all.push(...(await listOf<Listed>(a.node, a.r)));
    all.sort((x, y) => Date.parse(y.startedAt) - Date.parse(x.startedAt) || x.sandboxID.localeCompare(y.sandboxID));
    return Response.json(all, { headers: failed.length ? { "x-aenv-unreachable-nodes": failed.join(",") } : {} });
  }

  /**
   * GET /v2/sandboxes: each node is asked for one page after the same token (a token is a position
   * in the order every node shares: startedAt); the pages merge, the first `limit` are the page, and
   * the token is the last one's position. Sandboxes of nodes that left the cluster are listed with
   * state `lost` unless a state filter leaves them out.
   */
  async listV2(req: Request, url: URL): Promise<Response> {
    const q = url.searchParams;
    const limit = q.get("limit") === null ? LIST_LIMIT_MAX : Number(q.get("limit"));
    if (!Number.isInteger(limit) || limit < 1 || limit > LIST_LIMIT_MAX) throw new ApiError(400, `limit must be 1..${LIST_LIMIT_MAX}`);
    const states = q.get("state")?.split(",").filter(Boolean);
    for (const s of states ?? []) if (s !== "running" && s !== "paused" && s !== "lost") throw new ApiError(400, `state '${s}' is not running, paused or lost`);
    const nodeStates = states?.filter((s) => s !== "lost");
    const wantLost = !states || states.includes("lost");
    const desc = (q.get("order") ?? "desc") === "desc";
    const forward = new URLSearchParams(q);
    if (nodeStates && nodeStates.length > 0) forward.set("state", nodeStates.join(","));
    else forward.delete("state");
    const only = nodeStates?.length === 1 ? nodeStates[0]! : "";
    const items: Listed[] = [];
    let more = false;
    let running = 0;
    let failed: string[] = [];
    if (!states || nodeStates!.length > 0) {
      const got = await this.fanOut(req, `/v2/sandboxes?${forward}`);
      failed = got.failed;
      for (const a of got.answers) {
        items.push(...(await listOf<Listed>(a.node, a.r)));
        if (a.r.headers.get("x-next-token")) more = true;
        running += Number(a.r.headers.get("x-total-running") ?? 0);
      }
    }
    if (wantLost) items.push(...this.lostMatching(q, desc));
    const at = (x: Listed) => Date.parse(x.startedAt);
    items.sort((a, b) => (desc ? at(b) - at(a) : at(a) - at(b)) || a.sandboxID.localeCompare(b.sandboxID));
    let page = items.slice(0, limit);
    if (items.length > limit) {
      more = true;
      // A token points past a startedAt: never cut between two sandboxes of one millisecond (on two nodes).
      const cut = at(items[limit]!);
      const trimmed = page.filter((x) => at(x) !== cut);
      if (trimmed.length > 0) page = trimmed;
    }
    const headers: Record<string, string> = { "x-total-running": String(running) };
    if (failed.length) headers["x-aenv-unreachable-nodes"] = failed.join(",");
    const last = page[page.length - 1];
    if (more && last) {
      const scope = listScope("sandboxes", [desc, only, Object.entries(parseMetadataFilter(q.get("metadata") ?? undefined) ?? {}).sort(), q.get("template") ?? null, q.get("startedAfter") ? Date.parse(q.get("startedAfter")!) : null]);
      headers["x-next-token"] = encodeCursor(at(last), last.sandboxID, scope);
    }
    return Response.json(page, { headers });
  }

  /** Lost sandboxes that match the list's filters and lie past its token. */
  private lostMatching(q: URLSearchParams, desc: boolean): Listed[] {
    const metadata = parseMetadataFilter(q.get("metadata") ?? undefined);
    const template = q.get("template");
    const after = q.get("startedAfter") ? Date.parse(q.get("startedAfter")!) : undefined;
    let cursor: number | undefined;
    const token = q.get("nextToken");
    if (token) {
      const m = /^(\d{1,16})__/.exec(Buffer.from(token, "base64url").toString("utf8"));
      if (m) cursor = Number(m[1]);
    }
    const out: Listed[] = [];
    for (const [id, b] of this.o.view.lost()) {
      if (metadata && !Object.entries(metadata).every(([k, v]) => b.metadata[k] === v)) continue;
      if (template && b.templateId !== template && b.alias !== template) continue;
      if (after !== undefined && b.startedAt < after) continue;
      if (cursor !== undefined && (desc ? b.startedAt >= cursor : b.startedAt <= cursor)) continue;
      out.push(lostBody(id, b));
    }
    return out;
  }

  /** GET lists of templates and snapshots: every node's, each ID once. */
  async listUnion(req: Request, pathAndQuery: string, idField: string): Promise<Response> {
    const { answers, failed } = await this.fanOut(req, pathAndQuery);
    const seen = new Set<string>();
    const out: Record<string, unknown>[] = [];
    let next: string | null = null;
    for (const a of answers) {
      for (const item of await listOf<Record<string, unknown>>(a.node, a.r)) {
        const id = String(item[idField]);
        if (seen.has(id)) continue;
        seen.add(id);
        out.push(item);
      }
      next ??= a.r.headers.get("x-next-token");
    }
    const headers: Record<string, string> = {};
    if (next) headers["x-next-token"] = next;
    if (failed.length) headers["x-aenv-unreachable-nodes"] = failed.join(",");
    return Response.json(out, { headers });
  }

  /** A lookup any node may answer (a template, a snapshot, a build): the first node that knows it. */
  async firstKnowing(req: Request, pathAndQuery: string, body: unknown): Promise<Response> {
    let last: Response | undefined;
    for (const node of this.o.view.liveNodes()) {
      try {
        const r = await callNode(node, req, pathAndQuery, body, NODE_LIST_TIMEOUT_MS);
        if (r.status !== 404) return passOn(r);
        last = r;
      } catch { /* next */ }
    }
    if (last) return passOn(last);
    throw new ApiError(503, "no node is in the cluster");
  }
}
