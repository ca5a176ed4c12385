// E2B's sandbox, snapshot and template routes (the ones the e2b SDK 2.51 and 2.45 call), with
// E2B's field names, status codes and error bodies. Handlers validate, call the orchestrator and
// shape its records; they hold no state of their own.
import { Elysia, t, type TSchema } from "elysia";
import { ApiError, badRequest, bodyFailures as bodyFails, conflict, failures as fails, notFound } from "./errors.ts";
import { LIMITS, Orchestrator, OrchestratorError } from "../orchestrator/orchestrator.ts";
import { LIST_LIMIT_MAX, StoreError, decodeCursor, encodeCursor, listScope, publicState, type ListQuery, type SandboxRecord } from "../orchestrator/store.ts";
import type { TemplateRecord } from "../orchestrator/templates.ts";
import { TemplateBuildError } from "../orchestrator/builder.ts";

export interface SandboxRoutesOptions {
  /** Sandbox domain returned to clients (null: they use their own). */
  domain: string | null;
  defaultTimeoutS: number;
  /** POST /sandboxes-cold: the template of an OCI image at a size, built on first use (the node's builder). */
  coldTemplate?: (image: string, size: { cpuCount?: number; memoryMB?: number }) => Promise<string>;
  /** In a cluster: whether the node takes new sandboxes, and each new sandbox's binding before its answer. */
  placement?: Placement;
}

/**
 * A node's place in a cluster (src/node/cluster.ts), as the create routes see it: `admit` throws
 * (an ApiError, 503) when the node may not take a new sandbox, and `bind` makes a created sandbox's
 * binding durable before the answer; a sandbox whose binding fails is killed and the create fails.
 */
export interface Placement {
  admit(): void;
  bind(rec: SandboxRecord): Promise<void>;
  /** Resume anywhere: takes paused sandbox `id` from the shared snapshot store onto this node (ApiErrors say why not). */
  adopt?(id: string): Promise<SandboxRecord>;
  /** A template this node lacks that another node of the cluster published: imported before the create (resolves at once when it has it). */
  ensureTemplate?(ref: string): Promise<void>;
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
    volumeMounts: r.volumeMounts ?? [],
  };
}

function detailBody(r: SandboxRecord, domain: string | null) {
  return {
    ...listedBody(r),
    envdAccessToken: r.envdAccessToken,
    allowInternetAccess: r.allowInternetAccess,
    domain,
    lifecycle: { autoResume: r.autoResume, onTimeout: r.autoPause ? "pause" as const : "kill" as const },
    ...(r.network ? { network: withoutSecrets(r.network) } : {}),
  };
}

/** E2B never returns the egress proxy's password. */
function withoutSecrets(network: unknown): Record<string, unknown> {
  const n = network as { egressProxy?: Record<string, unknown> };
  if (!n.egressProxy || typeof n.egressProxy !== "object") return network as Record<string, unknown>;
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
    buildStatus: "ready" as const,
    // aenv's own field: what its sandboxes start with (its build and tags are named above).
    ...(tpl.config ? { config: (({ buildId: _b, tags: _t, ...c }) => c)(tpl.config) } : {}),
  };
}

/** The orchestrator's failures as API errors (same status, same words). */
async function call<T>(fn: () => T | Promise<T>): Promise<T> {
  try {
    return await fn();
  } catch (e) {
    if (e instanceof OrchestratorError || e instanceof TemplateBuildError) throw new ApiError(e.status, e.message);
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

/** Guest paths a volume may not be mounted on: the root, the kernel's and ours. */
const VOLUME_PATH_REFUSED = /^\/(proc|sys|dev|run|agentenv)(\/|$)/;

/** E2B volumeMounts: a name each (the volume's), an absolute guest path each, none twice; at most LIMITS.volumeMounts. */
export function checkVolumeMounts(mounts: { name: string; path: string }[] | undefined): void {
  if (!mounts) return;
  if (mounts.length > LIMITS.volumeMounts) throw badRequest(`volumeMounts: at most ${LIMITS.volumeMounts} volumes per sandbox`);
  const paths = new Set<string>();
  const names = new Set<string>();
  for (const m of mounts) {
    if (!/^[a-zA-Z0-9_-]{1,128}$/.test(m.name)) throw badRequest(`volumeMounts: volume name ${JSON.stringify(m.name)} is not a volume name ([a-zA-Z0-9_-]+)`);
    const p = m.path.replace(/\/+$/, "");
    if (!/^(\/[A-Za-z0-9._-]+)+$/.test(p) || p.split("/").some((c) => c === "." || c === "..") || p.length > 256)
      throw badRequest(`volumeMounts: path ${JSON.stringify(m.path)} must be an absolute path of letters, digits, '.', '_' and '-' (at most 256 bytes), not the root`);
    if (VOLUME_PATH_REFUSED.test(p)) throw badRequest(`volumeMounts: path ${JSON.stringify(m.path)} is under a system directory (/proc, /sys, /dev, /run, /agentenv)`);
    if (paths.has(p)) throw badRequest(`volumeMounts: path ${p} is given twice`);
    if (names.has(m.name)) throw badRequest(`volumeMounts: volume ${m.name} is given twice`);
    paths.add(p);
    names.add(m.name);
    m.path = p;
  }
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

/**
 * A transform hook: these body fields, when given, are JSON objects. Checked on the raw body, as
 * validation's normalizing would turn an array or a string into an object.
 */
export const rawObjects = (...fields: string[]) => ({ body }: { body: unknown }) => {
  for (const f of fields) {
    const v = (body as Record<string, unknown> | undefined)?.[f];
    if (v !== undefined && v !== null && (typeof v !== "object" || Array.isArray(v))) throw badRequest(`${f} must be a JSON object`);
  }
};

function checkExtensionParams(p: Record<string, unknown> | undefined): void {
  if (p !== undefined && Buffer.byteLength(JSON.stringify(p)) > LIMITS.extensionParamsBytes)
    throw badRequest(`customExtensionParams: at most ${LIMITS.extensionParamsBytes} bytes as JSON`);
}

/** RFC 7396 JSON merge patch: `patch`'s members replace `target`'s, null removes one, objects merge. */
export function mergePatch(target: unknown, patch: unknown): unknown {
  if (patch === null || typeof patch !== "object" || Array.isArray(patch)) return patch;
  const out: Record<string, unknown> = target !== null && typeof target === "object" && !Array.isArray(target) ? { ...(target as Record<string, unknown>) } : {};
  for (const [k, v] of Object.entries(patch)) {
    if (v === null) delete out[k];
    // defineProperty: a member named `__proto__` is kept as data, never set as the prototype.
    else Object.defineProperty(out, k, { value: mergePatch(Object.hasOwn(out, k) ? out[k] : undefined, v), enumerable: true, writable: true, configurable: true });
  }
  return out;
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
  volumeMounts: t.Optional(t.Array(t.Object({ name: t.String({ description: "the volume's name" }), path: t.String({ description: "absolute guest path" }) }), { description: `volumes mounted read-write (ext4), at most ${LIMITS.volumeMounts}; such a sandbox boots rather than restores` })),
  allow_internet_access: t.Optional(t.Boolean()),
  network: t.Optional(t.Object({}, { additionalProperties: true })),
  customExtensionParams: t.Optional(t.Record(t.String(), t.Unknown(), { description: `opaque JSON kept with the sandbox (at most ${LIMITS.extensionParamsBytes} bytes)` })),
}, { additionalProperties: true });

/** AgentENV's NewColdSandbox: a sandbox straight from an OCI image (its template is built on first use). */
const NewColdSandbox = t.Object({
  image: t.String({ minLength: 1, maxLength: 512, description: "OCI image reference, e.g. docker.io/library/python:3.12-slim, or s3://bucket/prefix[:tag] (an OCI image layout in S3)" }),
  cpuCount: t.Optional(t.Integer({ minimum: 1, maximum: 64 })),
  memoryMB: t.Optional(t.Integer({ minimum: 128, maximum: 1 << 20 })),
  diskSizeMB: t.Optional(t.Integer({ minimum: 1024, description: "refused: the image's converted disk is used (20 GiB unless the image says)" })),
  attachedDrives: t.Optional(t.Array(t.Unknown(), { description: "refused unless empty: no attached drives here" })),
  extraBootArgs: t.Optional(t.String({ description: "refused unless empty: a restored VM keeps its template's kernel command line" })),
  timeout: t.Optional(Timeout),
  metadata: t.Optional(StringMap),
  envVars: t.Optional(StringMap),
  autoPause: t.Optional(t.Boolean()),
  autoResume: t.Optional(t.Object({ enabled: t.Boolean() })),
  secure: t.Optional(t.Boolean()),
  allowInternetAccess: t.Optional(t.Boolean()),
  network: t.Optional(t.Object({}, { additionalProperties: true })),
  customExtensionParams: t.Optional(t.Record(t.String(), t.Unknown())),
}, { additionalProperties: true });

// Response bodies (a factory where a route describes the same body its own way).
const Nullable = <S extends TSchema>(s: S) => t.Union([s, t.Null()]);
const sandboxOut = (description: string) => t.Object({
  templateID: t.String(), sandboxID: t.String(), alias: t.Optional(t.String()), clientID: t.String(),
  envdVersion: t.String({ description: "semver" }), envdAccessToken: t.String({ description: "X-Access-Token for envd" }),
  trafficAccessToken: Nullable(t.String({ description: "wanted on non-envd ports when allowPublicTraffic is false" })),
  domain: Nullable(t.String({ description: "null: clients use their own" })),
}, { description });
const listedFields = {
  templateID: t.String(), alias: t.Optional(t.String()), sandboxID: t.String(), clientID: t.String(),
  startedAt: t.String({ format: "date-time" }), endAt: t.String({ format: "date-time" }),
  cpuCount: t.Number(), memoryMB: t.Number(), diskSizeMB: t.Number(), metadata: StringMap,
  state: t.Union([t.Literal("running"), t.Literal("paused")]), envdVersion: t.String(),
  volumeMounts: t.Array(t.Object({ name: t.String(), path: t.String() }), { description: "volumes mounted, by name, at their guest paths" }),
};
const ListedSandboxes = (description: string) => t.Array(t.Object(listedFields), { description });
const SandboxDetail = t.Object({
  ...listedFields,
  envdAccessToken: t.String(),
  allowInternetAccess: Nullable(t.Boolean()),
  domain: Nullable(t.String()),
  lifecycle: t.Object({ autoResume: t.Boolean(), onTimeout: t.Union([t.Literal("kill"), t.Literal("pause")]) }),
  network: t.Optional(t.Record(t.String(), t.Unknown(), { description: "the egress and inbound settings (the egress proxy's password left out)" })),
}, { description: "the sandbox" });
const snapshotFields = {
  snapshotID: t.String({ description: "`<id>:default`, usable as templateID" }), names: t.Array(t.String()),
  cpuCount: t.Number(), memoryMB: t.Number(), diskSizeMB: t.Number(),
  createdAt: t.String({ format: "date-time" }), updatedAt: t.String({ format: "date-time" }),
};
const templateFields = {
  templateID: t.String(), buildID: t.String(), cpuCount: t.Number(), memoryMB: t.Number(), diskSizeMB: t.Number(),
  public: t.Boolean(), aliases: t.Array(t.String()), names: t.Array(t.String()),
  createdAt: t.String({ format: "date-time" }), updatedAt: t.String({ format: "date-time" }), envdVersion: t.String(), buildStatus: t.Literal("ready"),
  config: t.Optional(t.Record(t.String(), t.Unknown(), { description: "aenv's own: env, user, workdir, startCmd, readyCmd, exposed, labels, and the image's entrypoint and cmd" })),
};
const Templates = t.Array(t.Object(templateFields), { description: "templates (snapshots are listed by GET /snapshots)" });
const TemplateWithBuilds = t.Object({
  ...templateFields,
  builds: t.Array(t.Object({
    buildID: t.String(), status: t.Literal("ready"), createdAt: t.String({ format: "date-time" }), updatedAt: t.String({ format: "date-time" }),
    cpuCount: t.Number(), memoryMB: t.Number(), diskSizeMB: t.Number(), envdVersion: t.String(),
  }), { description: "its one kept build" }),
}, { description: "the template or snapshot" });
const Metrics = t.Array(t.Object({
  timestamp: t.String({ format: "date-time" }), timestampUnix: t.Number(), cpuCount: t.Number(), cpuUsedPct: t.Number(),
  memUsed: t.Number({ description: "bytes" }), memTotal: t.Number(), memCache: t.Number(), diskUsed: t.Number(), diskTotal: t.Number(),
}), { description: "samples in [start, end], oldest first" });
const LogEntry = t.Object({ timestamp: t.String({ format: "date-time" }), level: t.String(), message: t.String(), fields: t.Record(t.String(), t.String()) });
const ExtensionParams = (description: string) => t.Record(t.String(), t.Unknown(), { description });
const noContent = (description: string) => t.Void({ description });
export const pageQuery = { limit: t.Optional(t.String({ description: `1..${LIST_LIMIT_MAX}, default ${LIST_LIMIT_MAX}` })), nextToken: t.Optional(t.String({ description: "X-Next-Token of the previous page" })) };

/** A query value in unix seconds (absent: undefined), as the SDK's getMetrics sends `start` and `end`. */
function unixSeconds(name: string, raw: string | undefined): number | undefined {
  if (raw === undefined) return undefined;
  if (!/^\d{1,12}$/.test(raw)) throw badRequest(`${name} must be unix seconds (a whole number ≥ 0)`);
  return Number(raw);
}

/** A `limit` query value, 1..LIST_LIMIT_MAX (absent: the most). */
function pageLimit(raw: string | undefined): number {
  const limit = raw === undefined ? LIST_LIMIT_MAX : Number(raw);
  if (!Number.isInteger(limit) || limit < 1 || limit > LIST_LIMIT_MAX) throw badRequest(`limit must be 1..${LIST_LIMIT_MAX}`);
  return limit;
}

/**
 * One page of a list in its order (newest first, then by ID: templates, snapshots, secrets), after the
 * token's item; the token names the item and the list (`scope`), so a deleted item still marks
 * its place and another list's token is a 400.
 */
export function newestFirstPage<T extends { createdAt: number; id: string }>(all: T[], q: { limit?: string; nextToken?: string }, scope: string, set: { headers: Record<string, string | number> }): T[] {
  const limit = pageLimit(q.limit);
  let rest = all;
  if (q.nextToken !== undefined) {
    const c = decodeCursor(q.nextToken, scope);
    rest = all.filter((x) => x.createdAt < c.at || (x.createdAt === c.at && x.id > c.id));
  }
  const page = rest.slice(0, limit);
  const last = page[page.length - 1];
  if (rest.length > limit && last) set.headers["x-next-token"] = encodeCursor(last.createdAt, last.id, scope);
  return page;
}

/**
 * The routes over `getOrch`, which returns the orchestrator or throws (503 while the node starts).
 */
export function sandboxRoutes(getOrch: () => Orchestrator, o: SandboxRoutesOptions) {
  const { domain } = o;
  const orch = (): Orchestrator => getOrch();

  type Created = { status?: number | string; headers: Record<string, string | number> };
  /** The new sandbox's binding (in a cluster); a sandbox that cannot be bound is killed, so no sandbox runs unrouted. */
  const bound = async (rec: SandboxRecord): Promise<void> => {
    if (!o.placement) return;
    try {
      await o.placement.bind(rec);
    } catch (e) {
      await orch().kill(rec.id).catch(() => {});
      throw e;
    }
  };
  const create = ({ body, set }: { body: typeof NewSandbox.static; set: Created }) =>
    call(async () => {
      checkMap("metadata", body.metadata, LIMITS.metadataPairs);
      checkMap("envVars", body.envVars, LIMITS.envVars);
      checkExtensionParams(body.customExtensionParams);
      checkVolumeMounts(body.volumeMounts);
      o.placement?.admit();
      await o.placement?.ensureTemplate?.(body.templateID);
      const rec = await orch().create({
        customExtensionParams: body.customExtensionParams,
        templateId: body.templateID,
        timeoutS: body.timeout,
        metadata: body.metadata,
        envVars: body.envVars,
        autoPause: body.autoPause,
        autoPauseMemory: body.autoPauseMemory,
        volumeMounts: body.volumeMounts,
        autoResume: body.autoResume?.enabled,
        allowInternetAccess: body.allow_internet_access ?? null,
        network: body.network,
      });
      await bound(rec);
      set.status = 201;
      set.headers["x-agentenv-sandbox-id"] = rec.id;
      return sandboxBody(rec, domain);
    });

  // Refusals first, so a bad request never starts a build.
  const createCold = ({ body, set }: { body: typeof NewColdSandbox.static; set: Created }) =>
    call(async () => {
      if (!o.coldTemplate) throw new ApiError(400, "this node has no image puller: create from a template");
      if (body.diskSizeMB !== undefined) throw badRequest("diskSizeMB: not supported here; the image's converted disk is used");
      if (body.attachedDrives?.length) throw badRequest("attachedDrives: not supported here");
      if (body.extraBootArgs?.trim()) throw badRequest("extraBootArgs: not supported here (a restored VM keeps its template's kernel command line)");
      orch(); // 503 while the node starts, before a build is asked for
      o.placement?.admit();
      const templateID = await o.coldTemplate(body.image, { cpuCount: body.cpuCount, memoryMB: body.memoryMB });
      const { image: _i, cpuCount: _c, memoryMB: _m, diskSizeMB: _d, attachedDrives: _a, extraBootArgs: _e, allowInternetAccess, ...rest } = body;
      return create({ body: { ...rest, templateID, allow_internet_access: allowInternetAccess }, set });
    });

  const connect = ({ params, body, set }: { params: { sandboxID: string }; body: { timeout?: number; memory?: boolean }; set: { status?: number | string } }) =>
    call(async () => {
      const { rec, resumed } = await orch().connect(params.sandboxID, body.timeout ?? o.defaultTimeoutS, { memory: body.memory });
      set.status = resumed ? 201 : 200;
      return sandboxBody(rec, domain);
    });

  const list = (query: Record<string, string | undefined>, v1: boolean) =>
    call(() => {
      const limit = pageLimit(query.limit);
      const states = query.state?.split(",").filter(Boolean);
      for (const s of states ?? []) if (s !== "running" && s !== "paused") throw badRequest(`state '${s}' is not running or paused`);
      const order = query.order ?? "desc";
      if (order !== "asc" && order !== "desc") throw badRequest("order must be asc or desc");
      let startedAfter: number | undefined;
      if (query.startedAfter !== undefined) {
        startedAfter = Date.parse(query.startedAfter);
        if (Number.isNaN(startedAfter)) throw badRequest("startedAfter must be RFC 3339");
      }
      const q: ListQuery = {
        states: v1 ? ["running"] : (states as ("running" | "paused")[] | undefined),
        metadata: parseMetadataFilter(query.metadata),
        template: query.template,
        startedAfter,
        order,
        limit,
      };
      if (!v1) return orch().store.list({ ...q, nextToken: query.nextToken });
      // v1 is not paginated: every page (the node holds at most AENV_MAX_SANDBOXES).
      const items: SandboxRecord[] = [];
      let nextToken: string | undefined;
      do {
        const page = orch().store.list({ ...q, limit: LIST_LIMIT_MAX, nextToken });
        items.push(...page.items);
        nextToken = page.nextToken;
      } while (nextToken);
      return { items };
    });

  const idParams = t.Object({ sandboxID: SandboxID });
  const tags = (tag: string, summary: string) => ({ detail: { tags: [tag], summary } });
  const metadataQuery = t.Optional(t.String({ description: "k=v&k2=v2, each key and value URL-encoded, then the whole (E2B's)" }));
  const created = { body: NewSandbox, transform: rawObjects("network", "customExtensionParams"), response: { 201: sandboxOut("created; header x-agentenv-sandbox-id: its ID"), ...bodyFails(404, 429, 507) } };
  const connected = {
    params: idParams,
    body: t.Object({ timeout: t.Optional(Timeout), memory: t.Optional(t.Boolean({ description: "false: a paused sandbox boots on its disk instead of restoring its memory (SDK onResume 'reboot')" })) }),
    response: { 200: sandboxOut("was running: its TTL extended (never shortened)"), 201: sandboxOut("was paused: resumed"), ...bodyFails(404, 409) },
  };
  const templateParams = t.Object({ templateID: t.String({ minLength: 1, maxLength: 256, description: "ID, alias or name:tag" }) });

  return new Elysia({ name: "sandboxes" })
    .post("/sandboxes", create, { ...created, ...tags("sandboxes", "Create a sandbox (SDK 2.45; deprecated)") })
    .post("/v2/sandboxes", create, { ...created, ...tags("sandboxes", "Create a sandbox from a template or snapshot (alias, ID or name:tag)") })
    .post("/sandboxes-cold", createCold, {
      body: NewColdSandbox, transform: rawObjects("network", "customExtensionParams"),
      response: { 201: sandboxOut("created; its template (cold-…) was built from the image on first use"), ...bodyFails(404, 429, 507) },
      ...tags("sandboxes", "Create a sandbox from an OCI image (AgentENV): pulled, converted and booted once per image and size, a restore after"),
    })
    .get("/sandboxes", async ({ query }) => (await list(query, true)).items.map(listedBody), {
      query: t.Object({ metadata: metadataQuery }),
      response: { 200: ListedSandboxes("every running sandbox"), ...fails(400) },
      ...tags("sandboxes", "Running sandboxes, not paginated (v1; deprecated)"),
    })
    .get("/v2/sandboxes", async ({ query, set }) => {
      const page = await list(query, false);
      if (page.nextToken) set.headers["x-next-token"] = page.nextToken;
      set.headers["x-total-running"] = String(orch().runningCount());
      return page.items.map(listedBody);
    }, {
      query: t.Object({
        metadata: metadataQuery,
        state: t.Optional(t.String({ description: "running, paused or both (comma-separated); default both" })),
        template: t.Optional(t.String({ description: "template ID or alias" })),
        startedAfter: t.Optional(t.String({ description: "RFC 3339, inclusive" })),
        order: t.Optional(t.String({ description: "asc or desc (default) by startedAt" })),
        ...pageQuery,
      }),
      response: { 200: ListedSandboxes("one page; header X-Next-Token while more remain (a token is good for the same filters and order only), X-Total-Running"), ...fails(400) },
      ...tags("sandboxes", "List sandboxes; X-Next-Token while more remain"),
    })
    .get("/sandboxes/:sandboxID", ({ params }) => call(() => detailBody(orch().get(params.sandboxID), domain)), {
      params: idParams, response: { 200: SandboxDetail, ...fails(400, 404) }, ...tags("sandboxes", "A sandbox, running or paused"),
    })
    .delete("/sandboxes/:sandboxID", async ({ params, set }) => {
      await call(() => orch().kill(params.sandboxID));
      set.status = 204;
    }, { params: idParams, response: { 204: noContent("killed"), ...fails(400, 404) }, ...tags("sandboxes", "Kill a sandbox (running or paused)") })
    .post("/sandboxes/:sandboxID/pause", async ({ params, body, set }) => {
      await call(() => orch().pause(params.sandboxID, { memory: body.memory }));
      set.status = 204;
    }, {
      params: idParams,
      body: t.Object({ memory: t.Optional(t.Boolean({ description: "false: filesystem-only: the VM stops, its memory is dropped, its disk kept; the resume boots (default true)" })) }),
      response: { 204: noContent("paused"), ...bodyFails(404, 409) },
      ...tags("sandboxes", "Pause: 204, or 409 when already paused"),
    })
    .post("/sandboxes/:sandboxID/connect", connect, { ...connected, ...tags("sandboxes", "Connect (SDK 2.45): 200 running (TTL extended), 201 resumed") })
    .post("/v2/sandboxes/:sandboxID/connect", connect, { ...connected, ...tags("sandboxes", "Connect: 200 running (TTL extended), 201 resumed") })
    .post("/sandboxes/:sandboxID/resume", ({ params, body, set }) => call(async () => {
      if (orch().get(params.sandboxID).state === "running") throw conflict(`sandbox ${params.sandboxID} is already running`);
      const { rec } = await orch().connect(params.sandboxID, body.timeout ?? o.defaultTimeoutS, { memory: body.memory });
      set.status = 201;
      return sandboxBody(rec, domain);
    }), {
      params: idParams,
      body: t.Object({ timeout: t.Optional(Timeout), autoPause: t.Optional(t.Boolean({ description: "ignored (deprecated)" })), memory: t.Optional(t.Boolean()) }),
      response: { 201: sandboxOut("resumed; its TTL set to now + timeout"), ...bodyFails(404, 409) },
      ...tags("sandboxes", "Resume a paused sandbox; 409 when running (deprecated; use connect)"),
    })
    .put("/sandboxes/:sandboxID/network", async ({ params, body, set }) => {
      await call(() => orch().updateNetwork(params.sandboxID, body));
      set.status = 204;
    }, {
      params: idParams,
      body: t.Object({}, { additionalProperties: true, description: "allowOut, denyOut, rules, egressProxy, httpsPorts, allow_internet_access; omitted ones are cleared" }),
      response: { 204: noContent("the policy is in force"), ...bodyFails(404, 409) },
      ...tags("sandboxes", "Replace the egress policy; live on a running sandbox (its refused connections are cut)"),
    })
    .post("/sandboxes/:sandboxID/timeout", ({ params, body, set }) => call(() => {
      orch().setTimeout(params.sandboxID, body.timeout);
      set.status = 204;
    }), { params: idParams, body: t.Object({ timeout: Timeout }), response: { 204: noContent("TTL set"), ...bodyFails(404) }, ...tags("sandboxes", "Set the TTL to now + timeout (may shorten)") })
    .post("/sandboxes/:sandboxID/refreshes", ({ params, body, set }) => call(() => {
      const r = orch().get(params.sandboxID);
      orch().store.setEndAt(r.id, Date.now() + (body.duration ?? o.defaultTimeoutS) * 1000, true);
      set.status = 204;
    }), {
      params: idParams,
      body: t.Object({ duration: t.Optional(t.Integer({ minimum: 0, maximum: 3600, description: "seconds" })) }),
      response: { 204: noContent("TTL extended (never shortened)"), ...bodyFails(404) },
      ...tags("sandboxes", "Extend the TTL to now + duration (only extends)"),
    })
    .get("/sandboxes/:sandboxID/metrics", ({ params, query }) => call(async () => {
      const start = unixSeconds("start", query.start);
      const end = unixSeconds("end", query.end);
      if (start !== undefined && end !== undefined && start > end) throw badRequest("start must not be after end");
      orch().get(params.sandboxID);
      return orch().metrics(params.sandboxID, start, end);
    }), {
      params: idParams,
      query: t.Object({ start: t.Optional(t.String({ description: "unix seconds, inclusive" })), end: t.Optional(t.String({ description: "unix seconds, inclusive" })) }),
      response: { 200: Metrics, ...fails(400, 404) },
      ...tags("sandboxes", "CPU, memory and disk samples of envd (every 5 s while running, the last 30 min kept) in [start, end]"),
    })
    .get("/sandboxes/:sandboxID/custom-extension-params", ({ params }) => call(() => orch().get(params.sandboxID).customExtensionParams ?? {}), {
      params: idParams,
      response: { 200: ExtensionParams("the sandbox's params ({} when none are set)"), ...fails(400, 404) },
      ...tags("sandboxes", "AgentENV's customExtensionParams of a sandbox"),
    })
    .patch("/sandboxes/:sandboxID/custom-extension-params", ({ params, body }) => call(() => {
      const rec = orch().get(params.sandboxID);
      if (rec.state !== "running") throw conflict(`sandbox ${rec.id} is ${rec.state}, not running`);
      const next = mergePatch(rec.customExtensionParams ?? {}, body) as Record<string, unknown>;
      checkExtensionParams(next);
      const out = orch().store.setExtensionParams(rec.id, next);
      if (!out) throw conflict(`sandbox ${rec.id} is no longer running`);
      return out.customExtensionParams ?? {};
    }), {
      params: idParams,
      body: ExtensionParams("a JSON merge patch (RFC 7396): members replace, null removes, objects merge"),
      response: { 200: ExtensionParams("the params after the patch"), ...bodyFails(404, 409) },
      ...tags("sandboxes", `Patch a running sandbox's customExtensionParams (409 when not running; at most ${LIMITS.extensionParamsBytes} bytes)`),
    })
    .get("/sandboxes/:sandboxID/logs", ({ params }) => call(async () => {
      orch().get(params.sandboxID);
      const lines = await orch().logs(params.sandboxID);
      return { logs: lines, logEntries: lines.map((l) => ({ timestamp: l.timestamp, level: "info", message: l.line, fields: {} })) };
    }), {
      params: idParams,
      response: { 200: t.Object({ logs: t.Array(t.Object({ timestamp: t.String(), line: t.String() })), logEntries: t.Array(LogEntry) }, { description: "the console's last 64 KiB" }), ...fails(400, 404) },
      ...tags("sandboxes", "The guest console, line by line"),
    })
    .get("/v2/sandboxes/:sandboxID/logs", ({ params }) => call(async () => {
      orch().get(params.sandboxID);
      const lines = await orch().logs(params.sandboxID);
      return { logs: lines.map((l) => ({ timestamp: l.timestamp, level: "info", message: l.line, fields: {} })) };
    }), {
      params: idParams,
      response: { 200: t.Object({ logs: t.Array(LogEntry) }, { description: "the console's last 64 KiB" }), ...fails(400, 404) },
      ...tags("sandboxes", "The guest console as E2B v2 log entries"),
    })
    .post("/sandboxes/:sandboxID/fork", async ({ params, body, set }) => {
      const count = body.count ?? 1;
      o.placement?.admit();
      const results = await call(() => orch().fork(params.sandboxID, count, body.timeout));
      // Each child bound before the answer; one that cannot be is killed and reported as its error.
      const out = await Promise.all(results.map(async (r) => {
        if (!("rec" in r)) return { error: { code: r.error.status, message: r.error.message } };
        try {
          await bound(r.rec);
          return { sandbox: sandboxBody(r.rec, domain) };
        } catch (e) {
          return { error: { code: e instanceof ApiError ? e.status : 500, message: (e as Error).message } };
        }
      }));
      set.status = 201;
      return out;
    }, {
      params: idParams,
      body: t.Object({ count: t.Optional(t.Integer({ minimum: 1, maximum: LIMITS.forkCount })), timeout: t.Optional(Timeout) }),
      response: {
        201: t.Array(t.Object({ sandbox: t.Optional(sandboxOut("a child")), error: t.Optional(t.Object({ code: t.Number(), message: t.String() }, { description: "why this child did not start" })) }), { description: "one result per child: sandbox or error" }),
        ...bodyFails(404, 409),
      },
      ...tags("sandboxes", "Fork: N children from a live checkpoint; the source keeps running"),
    })
    .post("/sandboxes/:sandboxID/move", async ({ params, set }) => {
      if (!o.placement?.adopt) throw conflict("this node is not in a cluster with a shared snapshot store (AENV_CLUSTER, AENV_RESUME_ANYWHERE)");
      const rec = await call(() => o.placement!.adopt!(params.sandboxID));
      set.status = 201;
      return sandboxBody(rec, domain);
    }, {
      params: idParams,
      response: { 201: sandboxOut("taken: paused on this node, ready to resume"), ...fails(400, 404, 409, 429) },
      ...tags("sandboxes", "aenv's: take a paused sandbox whose node left the cluster or drains from the shared snapshot store onto this node (a gateway's connect does it by itself)"),
    })
    .post("/sandboxes/:sandboxID/snapshots", async ({ params, body, set }) => {
      const tpl = await call(() => orch().snapshot(params.sandboxID, body.name));
      set.status = 201;
      return snapshotBody(tpl);
    }, {
      params: idParams,
      body: t.Object({ name: t.Optional(t.String({ pattern: "^[A-Za-z0-9_-]{1,128}$" })) }),
      response: { 201: t.Object(snapshotFields, { description: "the snapshot; the sandbox keeps running" }), ...bodyFails(404, 409) },
      ...tags("snapshots", "Snapshot a running sandbox; usable as templateID"),
    })
    .get("/snapshots", ({ query, set }) => call(() => {
      const all = orch().templates.list("snapshot", { sourceSandboxId: query.sandboxID, name: query.name });
      return newestFirstPage(all, query, listScope("snapshots", [query.sandboxID ?? null, query.name ?? null]), set).map(snapshotBody);
    }), {
      query: t.Object({ sandboxID: t.Optional(t.String({ description: "the source sandbox" })), name: t.Optional(t.String({ description: "ID or name, tag-qualified or not" })), ...pageQuery }),
      response: { 200: t.Array(t.Object(snapshotFields), { description: "one page, newest first; header X-Next-Token while more remain" }), ...fails(400) },
      ...tags("snapshots", "List snapshots; X-Next-Token while more remain"),
    })
    .get("/snapshots/:snapshotID", ({ params }) => call(() => {
      const s = orch().templates.resolve(params.snapshotID);
      if (!s || s.kind !== "snapshot") throw notFound(`snapshot ${params.snapshotID} not found`);
      return snapshotBody(s);
    }), {
      params: t.Object({ snapshotID: t.String({ minLength: 1, maxLength: 256, description: "ID, name or name:tag" }) }),
      response: { 200: t.Object(snapshotFields, { description: "the snapshot" }), ...fails(400, 404) },
      ...tags("snapshots", "A snapshot"),
    })
    .get("/templates", () => orch().templates.list("template").map(templateBody), { response: { 200: Templates, ...fails() }, ...tags("templates", "Every template, not paginated (deprecated)") })
    .get("/v2/templates", ({ query, set }) => call(() => newestFirstPage(orch().templates.list("template"), query, listScope("templates", []), set).map(templateBody)), {
      query: t.Object(pageQuery),
      response: { 200: t.Array(t.Object(templateFields), { description: "one page, newest first; header X-Next-Token while more remain" }), ...fails(400) },
      ...tags("templates", "List templates; X-Next-Token while more remain"),
    })
    .get("/templates/:templateID", ({ params }) => call(() => {
      const tpl = orch().templates.resolve(params.templateID);
      if (!tpl) throw notFound(`template ${params.templateID} not found`);
      return { ...templateBody(tpl), builds: [{ buildID: tpl.id, status: "ready" as const, createdAt: rfc3339(tpl.createdAt), updatedAt: rfc3339(tpl.createdAt), cpuCount: tpl.cpuCount, memoryMB: tpl.memoryMB, diskSizeMB: tpl.diskSizeMB, envdVersion: tpl.envdVersion }] };
    }), { params: templateParams, response: { 200: TemplateWithBuilds, ...fails(400, 404) }, ...tags("templates", "A template or snapshot with its build") })
    .get("/templates/aliases/:alias", ({ params }) => call(() => {
      const tpl = orch().templates.resolve(params.alias);
      if (!tpl || tpl.alias !== params.alias) throw notFound(`template alias ${params.alias} not found`);
      return { templateID: tpl.id, public: true };
    }), {
      params: t.Object({ alias: t.String({ minLength: 1, maxLength: 256 }) }),
      response: { 200: t.Object({ templateID: t.String(), public: t.Boolean() }, { description: "the alias names a template" }), ...fails(400, 404) },
      ...tags("templates", "Whether an alias exists"),
    })
    .delete("/templates/:templateID", ({ params, set }) => call(async () => {
      if (!(await orch().deleteTemplate(params.templateID))) throw notFound(`template or snapshot ${params.templateID} not found`);
      set.status = 204;
    }), { params: templateParams, response: { 204: noContent("deleted"), ...fails(400, 404) }, ...tags("templates", "Delete a template or a snapshot (by ID or alias)") });
}
