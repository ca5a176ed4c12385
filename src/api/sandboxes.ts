// E2B's sandbox, snapshot and template routes (the ones the e2b SDK 2.51 and 2.45 call), with
// E2B's field names, status codes and error bodies. Handlers validate, call the orchestrator and
// shape its records; they hold no state of their own.
import { Elysia, t } from "elysia";
import { ApiError, badRequest, notFound } from "./errors.ts";
import { LIMITS, Orchestrator, OrchestratorError } from "../orchestrator/orchestrator.ts";
import { LIST_LIMIT_MAX, StoreError, publicState, type SandboxRecord } from "../orchestrator/store.ts";
import type { TemplateRecord } from "../orchestrator/templates.ts";

export interface SandboxRoutesOptions {
  /** Sandbox domain returned to clients (null: they use their own). */
  domain: string | null;
  defaultTimeoutS: number;
}

const rfc3339 = (ms: number) => new Date(ms).toISOString();
/** Auto-resume tops the TTL up to at least this (E2B: 300 s). */
export const AUTO_RESUME_MIN_TIMEOUT_S = 300;

function sandboxBody(r: SandboxRecord, domain: string | null) {
  return {
    templateID: r.templateId,
    sandboxID: r.id,
    alias: r.alias ?? undefined,
    clientID: "aenv",
    envdVersion: r.envdVersion,
    envdAccessToken: r.envdAccessToken,
    trafficAccessToken: r.trafficAccessToken,
    domain,
  };
}

function listedBody(r: SandboxRecord) {
  return {
    templateID: r.templateId,
    alias: r.alias ?? undefined,
    sandboxID: r.id,
    clientID: "aenv",
    startedAt: rfc3339(r.startedAt),
    endAt: rfc3339(r.endAt),
    cpuCount: r.cpuCount,
    memoryMB: r.memoryMB,
    diskSizeMB: r.diskSizeMB,
    metadata: r.metadata,
    state: publicState(r.state),
    envdVersion: r.envdVersion,
  };
}

function detailBody(r: SandboxRecord, domain: string | null) {
  return {
    ...listedBody(r),
    envdAccessToken: r.envdAccessToken,
    allowInternetAccess: r.allowInternetAccess,
    domain,
    lifecycle: { autoResume: r.autoResume, onTimeout: r.autoPause ? "pause" : "kill" },
    ...(r.network ? { network: withoutSecrets(r.network) } : {}),
  };
}

/** E2B never returns the egress proxy's password. */
function withoutSecrets(network: unknown): unknown {
  const n = network as { egressProxy?: Record<string, unknown> };
  if (!n.egressProxy || typeof n.egressProxy !== "object") return network;
  const { password: _, ...proxy } = n.egressProxy;
  return { ...n, egressProxy: proxy };
}

function snapshotBody(tpl: TemplateRecord) {
  return {
    snapshotID: `${tpl.id}:default`,
    names: tpl.names,
    cpuCount: tpl.cpuCount,
    memoryMB: tpl.memoryMB,
    diskSizeMB: tpl.diskSizeMB,
    createdAt: rfc3339(tpl.createdAt),
    updatedAt: rfc3339(tpl.createdAt),
  };
}

function templateBody(tpl: TemplateRecord) {
  return {
    templateID: tpl.id,
    buildID: tpl.id,
    cpuCount: tpl.cpuCount,
    memoryMB: tpl.memoryMB,
    diskSizeMB: tpl.diskSizeMB,
    public: true,
    aliases: tpl.alias ? [tpl.alias] : [],
    names: tpl.names,
    createdAt: rfc3339(tpl.createdAt),
    updatedAt: rfc3339(tpl.createdAt),
    envdVersion: tpl.envdVersion,
    buildStatus: tpl.checkpoint ? "ready" : "ready",
  };
}

/** The orchestrator's failures as API errors (same status, same words). */
async function call<T>(fn: () => T | Promise<T>): Promise<T> {
  try {
    return await fn();
  } catch (e) {
    if (e instanceof OrchestratorError) throw new ApiError(e.status, e.message);
    if (e instanceof StoreError) throw badRequest(e.message);
    throw e;
  }
}

/**
 * E2B's list `metadata` parameter: the framework decoded it once; it is a query string whose
 * keys and values are encoded once more (the SDK encodes each, then the whole).
 */
export function parseMetadataFilter(raw: string | undefined): Record<string, string> | undefined {
  if (raw === undefined || raw === "") return undefined;
  const out: Record<string, string> = {};
  let text: string;
  try {
    text = decodeURIComponent(raw);
  } catch {
    throw badRequest("metadata: malformed percent-encoding");
  }
  for (const pair of text.split("&")) {
    if (pair === "") continue;
    const eq = pair.indexOf("=");
    if (eq <= 0) throw badRequest(`metadata: '${pair}' is not key=value`);
    try {
      out[decodeURIComponent(pair.slice(0, eq))] = decodeURIComponent(pair.slice(eq + 1));
    } catch {
      throw badRequest("metadata: malformed percent-encoding");
    }
  }
  return out;
}

function checkMap(name: string, m: Record<string, string> | undefined, maxPairs: number): void {
  if (!m) return;
  const entries = Object.entries(m);
  if (entries.length > maxPairs) throw badRequest(`${name}: at most ${maxPairs} entries`);
  for (const [k, v] of entries) {
    if (typeof v !== "string") throw badRequest(`${name}.${k}: must be a string`);
    if (Buffer.byteLength(k) > LIMITS.keyBytes || Buffer.byteLength(v) > LIMITS.valueBytes)
      throw badRequest(`${name}.${k}: keys up to ${LIMITS.keyBytes} bytes, values up to ${LIMITS.valueBytes}`);
  }
}

const SandboxID = t.String({ pattern: "^[a-z0-9]{1,64}$", description: "sandbox ID" });
const Timeout = t.Integer({ minimum: 0, maximum: LIMITS.timeoutS, description: "seconds" });
const StringMap = t.Record(t.String(), t.String());

const NewSandbox = t.Object({
  templateID: t.String({ minLength: 1, maxLength: 256 }),
  timeout: t.Optional(Timeout),
  metadata: t.Optional(StringMap),
  envVars: t.Optional(StringMap),
  autoPause: t.Optional(t.Boolean()),
  autoPauseMemory: t.Optional(t.Boolean()),
  autoResume: t.Optional(t.Object({ enabled: t.Boolean() })),
  secure: t.Optional(t.Boolean()),
  allow_internet_access: t.Optional(t.Boolean()),
  network: t.Optional(t.Object({}, { additionalProperties: true })),
}, { additionalProperties: true });

/**
 * The routes over `getOrch`, which returns the orchestrator or throws (503 while the node starts).
 */
export function sandboxRoutes(getOrch: () => Orchestrator, o: SandboxRoutesOptions) {
  const { domain } = o;
  const orch = (): Orchestrator => getOrch();

  const create = ({ body, set }: { body: typeof NewSandbox.static; set: { status?: number | string; headers: Record<string, string | number> } }) =>
    call(async () => {
      checkMap("metadata", body.metadata, LIMITS.metadataPairs);
      checkMap("envVars", body.envVars, LIMITS.envVars);
      const rec = await orch().create({
        templateId: body.templateID,
        timeoutS: body.timeout,
        metadata: body.metadata,
        envVars: body.envVars,
        autoPause: body.autoPause,
        autoResume: body.autoResume?.enabled,
        allowInternetAccess: body.allow_internet_access ?? null,
        network: body.network,
      });
      set.status = 201;
      set.headers["x-agentenv-sandbox-id"] = rec.id;
      return sandboxBody(rec, domain);
    });

  const connect = ({ params, body, set }: { params: { sandboxID: string }; body: { timeout?: number }; set: { status?: number | string } }) =>
    call(async () => {
      const { rec, resumed } = await orch().connect(params.sandboxID, body.timeout ?? o.defaultTimeoutS);
      set.status = resumed ? 201 : 200;
      return sandboxBody(rec, domain);
    });

  const list = (query: Record<string, string | undefined>, v1: boolean) =>
    call(() => {
      const limit = query.limit === undefined ? LIST_LIMIT_MAX : Number(query.limit);
      if (!Number.isInteger(limit) || limit < 1 || limit > LIST_LIMIT_MAX) throw badRequest(`limit must be 1..${LIST_LIMIT_MAX}`);
      const states = query.state?.split(",").filter(Boolean);
      for (const s of states ?? []) if (s !== "running" && s !== "paused") throw badRequest(`state '${s}' is not running or paused`);
      const order = query.order ?? "desc";
      if (order !== "asc" && order !== "desc") throw badRequest("order must be asc or desc");
      let startedAfter: number | undefined;
      if (query.startedAfter !== undefined) {
        startedAfter = Date.parse(query.startedAfter);
        if (Number.isNaN(startedAfter)) throw badRequest("startedAfter must be RFC 3339");
      }
      return orch().store.list({
        states: v1 ? ["running"] : (states as ("running" | "paused")[] | undefined),
        metadata: parseMetadataFilter(query.metadata),
        template: query.template,
        startedAfter,
        order,
        limit: v1 ? LIST_LIMIT_MAX : limit,
        nextToken: v1 ? undefined : query.nextToken,
      });
    });

  const idParams = t.Object({ sandboxID: SandboxID });
  const tags = (tag: string) => ({ detail: { tags: [tag] } });

  return new Elysia({ name: "sandboxes" })
    .post("/sandboxes", create, { body: NewSandbox, ...tags("sandboxes"), detail: { tags: ["sandboxes"], summary: "Create a sandbox (SDK 2.45; deprecated)" } })
    .post("/v2/sandboxes", create, { body: NewSandbox, detail: { tags: ["sandboxes"], summary: "Create a sandbox from a template or snapshot" } })
    .get("/sandboxes", async ({ query }) => (await list(query, true)).items.map(listedBody), { detail: { tags: ["sandboxes"], summary: "Running sandboxes (v1)" } })
    .get("/v2/sandboxes", async ({ query, set }) => {
      const page = await list(query, false);
      if (page.nextToken) set.headers["x-next-token"] = page.nextToken;
      set.headers["x-total-running"] = String(orch().runningCount());
      return page.items.map(listedBody);
    }, {
      query: t.Object({
        metadata: t.Optional(t.String()), state: t.Optional(t.String()), template: t.Optional(t.String()),
        startedAfter: t.Optional(t.String()), order: t.Optional(t.String()), limit: t.Optional(t.String()), nextToken: t.Optional(t.String()),
      }),
      detail: { tags: ["sandboxes"], summary: "List sandboxes; X-Next-Token while more remain" },
    })
    .get("/sandboxes/:sandboxID", ({ params }) => call(() => detailBody(orch().get(params.sandboxID), domain)), { params: idParams, ...tags("sandboxes") })
    .delete("/sandboxes/:sandboxID", async ({ params, set }) => {
      await call(() => orch().kill(params.sandboxID));
      set.status = 204;
    }, { params: idParams, detail: { tags: ["sandboxes"], summary: "Kill a sandbox (running or paused)" } })
    .post("/sandboxes/:sandboxID/pause", async ({ params, set }) => {
      await call(() => orch().pause(params.sandboxID));
      set.status = 204;
    }, { params: idParams, detail: { tags: ["sandboxes"], summary: "Pause: 204, or 409 when already paused" } })
    .post("/sandboxes/:sandboxID/connect", connect, { params: idParams, body: t.Object({ timeout: t.Optional(Timeout), memory: t.Optional(t.Boolean()) }), detail: { tags: ["sandboxes"], summary: "Connect: 200 running (TTL extended), 201 resumed" } })
    .post("/v2/sandboxes/:sandboxID/connect", connect, { params: idParams, body: t.Object({ timeout: t.Optional(Timeout), memory: t.Optional(t.Boolean()) }), ...tags("sandboxes") })
    .post("/sandboxes/:sandboxID/resume", async ({ params, body, set }) => {
      const { rec } = await call(() => orch().connect(params.sandboxID, body.timeout ?? o.defaultTimeoutS));
      set.status = 201;
      return sandboxBody(rec, domain);
    }, { params: idParams, body: t.Object({ timeout: t.Optional(Timeout), autoPause: t.Optional(t.Boolean()), memory: t.Optional(t.Boolean()) }), detail: { tags: ["sandboxes"], summary: "Resume (deprecated; use connect)" } })
    .put("/sandboxes/:sandboxID/network", async ({ params, body, set }) => {
      await call(() => orch().updateNetwork(params.sandboxID, body));
      set.status = 204;
    }, { params: idParams, body: t.Object({}, { additionalProperties: true }), detail: { tags: ["sandboxes"], summary: "Replace the egress policy; live on a running sandbox (its refused connections are cut)" } })
    .post("/sandboxes/:sandboxID/timeout", ({ params, body, set }) => call(() => {
      orch().setTimeout(params.sandboxID, body.timeout);
      set.status = 204;
    }), { params: idParams, body: t.Object({ timeout: Timeout }), detail: { tags: ["sandboxes"], summary: "Set the TTL to now + timeout (may shorten)" } })
    .post("/sandboxes/:sandboxID/refreshes", ({ params, body, set }) => call(() => {
      const r = orch().get(params.sandboxID);
      orch().store.setEndAt(r.id, Date.now() + (body.duration ?? o.defaultTimeoutS) * 1000, true);
      set.status = 204;
    }), { params: idParams, body: t.Object({ duration: t.Optional(t.Integer({ minimum: 0, maximum: 3600 })) }), ...tags("sandboxes") })
    .get("/sandboxes/:sandboxID/metrics", ({ params }) => call(async () => {
      orch().get(params.sandboxID);
      return orch().metrics(params.sandboxID);
    }), { params: idParams, ...tags("sandboxes") })
    .get("/sandboxes/:sandboxID/logs", ({ params }) => call(async () => {
      orch().get(params.sandboxID);
      const lines = await orch().logs(params.sandboxID);
      return { logs: lines, logEntries: lines.map((l) => ({ timestamp: l.timestamp, level: "info", message: l.line, fields: {} })) };
    }), { params: idParams, detail: { tags: ["sandboxes"], summary: "The guest console, line by line" } })
    .get("/v2/sandboxes/:sandboxID/logs", ({ params }) => call(async () => {
      orch().get(params.sandboxID);
      const lines = await orch().logs(params.sandboxID);
      return { logs: lines.map((l) => ({ timestamp: l.timestamp, level: "info", message: l.line, fields: {} })) };
    }), { params: idParams, detail: { tags: ["sandboxes"], summary: "The guest console as E2B v2 log entries" } })
    .post("/sandboxes/:sandboxID/fork", async ({ params, body, set }) => {
      const count = body.count ?? 1;
      const results = await call(() => orch().fork(params.sandboxID, count, body.timeout));
      set.status = 201;
      return results.map((r) => "rec" in r ? { sandbox: sandboxBody(r.rec, domain) } : { error: { code: r.error.status, message: r.error.message } });
    }, { params: idParams, body: t.Object({ count: t.Optional(t.Integer({ minimum: 1, maximum: LIMITS.forkCount })), timeout: t.Optional(Timeout) }), detail: { tags: ["sandboxes"], summary: "Fork: N children from a live checkpoint; the source keeps running" } })
    .post("/sandboxes/:sandboxID/snapshots", async ({ params, body, set }) => {
      const tpl = await call(() => orch().snapshot(params.sandboxID, body.name));
      set.status = 201;
      return snapshotBody(tpl);
    }, { params: idParams, body: t.Object({ name: t.Optional(t.String({ pattern: "^[A-Za-z0-9_-]{1,128}$" })) }), detail: { tags: ["snapshots"], summary: "Snapshot a running sandbox; usable as templateID" } })
    .get("/snapshots", ({ query, set }) => call(() => {
      const limit = query.limit === undefined ? LIST_LIMIT_MAX : Number(query.limit);
      if (!Number.isInteger(limit) || limit < 1 || limit > LIST_LIMIT_MAX) throw badRequest(`limit must be 1..${LIST_LIMIT_MAX}`);
      const all = orch().templates.list("snapshot", { sourceSandboxId: query.sandboxID, name: query.name });
      const start = query.nextToken ? all.findIndex((s) => s.id === Buffer.from(query.nextToken!, "base64url").toString()) + 1 : 0;
      if (start < 0) throw badRequest("nextToken is not a token this node issued");
      const page = all.slice(start, start + limit);
      if (start + limit < all.length) set.headers["x-next-token"] = Buffer.from(page[page.length - 1]!.id).toString("base64url");
      return page.map(snapshotBody);
    }), { query: t.Object({ sandboxID: t.Optional(t.String()), name: t.Optional(t.String()), limit: t.Optional(t.String()), nextToken: t.Optional(t.String()) }), ...tags("snapshots") })
    .get("/snapshots/:snapshotID", ({ params }) => call(() => {
      const s = orch().templates.resolve(params.snapshotID);
      if (!s || s.kind !== "snapshot") throw notFound(`snapshot ${params.snapshotID} not found`);
      return snapshotBody(s);
    }), { ...tags("snapshots") })
    .get("/templates", () => orch().templates.list("template").map(templateBody), { ...tags("templates") })
    .get("/v2/templates", () => orch().templates.list("template").map(templateBody), { ...tags("templates") })
    .get("/templates/:templateID", ({ params }) => call(() => {
      const tpl = orch().templates.resolve(params.templateID);
      if (!tpl) throw notFound(`template ${params.templateID} not found`);
      return { ...templateBody(tpl), builds: [{ buildID: tpl.id, status: "ready", createdAt: rfc3339(tpl.createdAt), updatedAt: rfc3339(tpl.createdAt), cpuCount: tpl.cpuCount, memoryMB: tpl.memoryMB, diskSizeMB: tpl.diskSizeMB, envdVersion: tpl.envdVersion }] };
    }), { ...tags("templates") })
    .get("/templates/aliases/:alias", ({ params }) => call(() => {
      const tpl = orch().templates.resolve(params.alias);
      if (!tpl || tpl.alias !== params.alias) throw notFound(`template alias ${params.alias} not found`);
      return { templateID: tpl.id, public: true };
    }), { ...tags("templates") })
    .delete("/templates/:templateID", ({ params, set }) => call(async () => {
      if (!(await orch().deleteTemplate(params.templateID))) throw notFound(`template or snapshot ${params.templateID} not found`);
      set.status = 204;
    }), { detail: { tags: ["templates"], summary: "Delete a template or a snapshot (by ID or alias)" } });
}
