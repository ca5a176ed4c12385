// E2B's template build routes as the e2b SDK 2.51 `Template` builder calls them: request a build
// (POST /v3/templates), upload COPY files by hash (GET a URL, PUT the archive to it), start it
// (POST /v2/templates/{templateID}/builds/{buildID}), poll its status with logsOffset, and tags.
// Handlers validate and shape; the builder (src/orchestrator/builder.ts) holds the builds.
import { Elysia, t } from "elysia";
import { ApiError, bodyFailures as bodyFails, failures as fails } from "./errors.ts";
import { UploadUrls } from "./upload_url.ts";
import { OrchestratorError } from "../orchestrator/orchestrator.ts";
import { LOG_PAGE, type LogLevel } from "../orchestrator/build_log.ts";
import { TemplateBuildError, type BuildSpec, type TemplateBuilder } from "../orchestrator/builder.ts";

/** The archive upload: its URL carries a signature and an expiry instead of the API key (the SDK sends none). */
const UPLOAD_PATH = /^\/templates\/[^/]+\/files\/[^/]+$/;

/** A PUT of a COPY archive: its body is streamed by the route, not parsed, and it is authorised by its URL's signature. */
export function isUploadRequest(method: string, path: string): boolean {
  return method === "PUT" && UPLOAD_PATH.test(path);
}

async function call<T>(fn: () => T | Promise<T>): Promise<T> {
  try {
    return await fn();
  } catch (e) {
    if (e instanceof TemplateBuildError || e instanceof OrchestratorError) throw new ApiError(e.status, e.message);
    throw e;
  }
}

const Ids = t.Object({ templateID: t.String({ pattern: "^[A-Za-z0-9_.-]{1,128}$" }), buildID: t.String({ pattern: "^[A-Za-z0-9-]{1,64}$" }) });
const FileParams = t.Object({ templateID: t.String({ pattern: "^[A-Za-z0-9_.-]{1,128}$" }), hash: t.String() });
const Tags = t.Array(t.String({ maxLength: 128 }), { maxItems: 64 });

const NewTemplate = t.Object({
  name: t.Optional(t.String({ minLength: 1, maxLength: 256 })),
  alias: t.Optional(t.String({ minLength: 1, maxLength: 256 })),
  tags: t.Optional(Tags),
  cpuCount: t.Optional(t.Integer({ minimum: 1, maximum: 64 })),
  memoryMB: t.Optional(t.Integer({ minimum: 128, maximum: 262_144 })),
  minFreeDiskMb: t.Optional(t.Integer({ minimum: 0 })),
  teamID: t.Optional(t.String()),
}, { additionalProperties: true });

const Step = t.Object({
  type: t.String({ maxLength: 16 }),
  args: t.Optional(t.Array(t.String())),
  filesHash: t.Optional(t.String()),
  force: t.Optional(t.Boolean()),
}, { additionalProperties: true });

const BuildStart = t.Object({
  fromImage: t.Optional(t.String({ maxLength: 1024 })),
  fromTemplate: t.Optional(t.String({ maxLength: 256 })),
  fromImageRegistry: t.Optional(t.Object({ type: t.String(), username: t.Optional(t.String()), password: t.Optional(t.String()) }, { additionalProperties: true })),
  force: t.Optional(t.Boolean()),
  startCmd: t.Optional(t.String()),
  readyCmd: t.Optional(t.String()),
  steps: t.Optional(t.Array(Step)),
  imageCmd: t.Optional(t.Boolean({ description: "aenv's own: fromImage without startCmd starts the image's Entrypoint + Cmd" })),
}, { additionalProperties: true });

const LEVELS = new Set(["debug", "info", "warn", "error"]);

// Response bodies.
const Level = t.Union([t.Literal("debug"), t.Literal("info"), t.Literal("warn"), t.Literal("error")]);
const LogEntry = t.Object({ timestamp: t.String({ format: "date-time" }), level: Level, message: t.String(), step: t.Optional(t.String()) });
const BuildStatus = t.Object({
  templateID: t.String(), buildID: t.String(),
  status: t.Union([t.Literal("waiting"), t.Literal("building"), t.Literal("ready"), t.Literal("error")]),
  logs: t.Array(t.String(), { description: "deprecated: logEntries as lines" }),
  logEntries: t.Array(LogEntry),
  reason: t.Optional(t.Object({ message: t.String(), step: t.Optional(t.String()), logEntries: t.Array(LogEntry) }, { description: "why it failed" })),
}, { description: `the build's status and up to ${LOG_PAGE} log entries from logsOffset` });
const Requested = t.Object({
  templateID: t.String(), buildID: t.String(), public: t.Boolean(), names: t.Array(t.String()), tags: t.Array(t.String()), aliases: t.Array(t.String()),
}, { description: "requested: start it with POST /v2/templates/{templateID}/builds/{buildID}" });
const noContent = (description: string) => t.Void({ description });

const PushBody = t.Object({
  ref: t.String({ minLength: 1, maxLength: 1024, description: "registry/repository:tag, or s3://bucket/prefix[:tag] (an OCI image layout, with the node's S3 settings), the image goes to" }),
  username: t.Optional(t.String({ maxLength: 1024 })),
  password: t.Optional(t.String({ maxLength: 16_384 })),
});
const Pushed = t.Object({
  ref: t.String(), manifestDigest: t.String(), configDigest: t.String(),
  layers: t.Array(t.Object({ digest: t.String(), size: t.Integer(), uploaded: t.Boolean({ description: "false: the registry had it (HEAD), nothing sent" }) })),
  trace: t.Optional(t.Object({ digest: t.String(), size: t.Integer(), uploaded: t.Boolean() }, { description: "the template's boot trace blob (org.aenv.prefetch.rootfs), when it has one" })),
}, { description: "the image pushed: its manifest and each layer's blob, base first" });

export interface TemplateRouteOptions {
  /** Lifts the server's idle timeout from a request whose answer takes long (a push). */
  keepOpen?: (req: Request) => void;
  /** How long an upload URL stays valid (default UPLOAD_URL_TTL_S). */
  uploadUrlTtlS?: number;
}

/** The routes over `getBuilder`, which returns the builder or throws (503 while the node starts). */
export function templateRoutes(getBuilder: () => TemplateBuilder, opts: TemplateRouteOptions = {}) {
  const tag = { tags: ["templates"] };
  const uploads = new UploadUrls(opts.uploadUrlTtlS);
  return new Elysia({ name: "templates" })
    .post("/templates/:templateID/push", ({ params, body, request }) => call(async () => {
      if ((body.username === undefined) !== (body.password === undefined)) throw new ApiError(400, "username and password: give both or neither");
      opts.keepOpen?.(request);
      return getBuilder().push(params.templateID, body.ref, body.username !== undefined ? { username: body.username, password: body.password! } : undefined);
    }), {
      params: t.Object({ templateID: t.String({ minLength: 1, maxLength: 256, description: "ID or name" }) }),
      body: PushBody,
      response: { 200: Pushed, ...bodyFails(403, 404, 502, 504) },
      detail: { ...tag, summary: "aenv's: push a template's rootfs layers (base first) and its env, user and workdir to a registry or S3 as an overlaybd image; blobs already there are not sent" },
    })
    .post("/v3/templates", ({ body, set }) => call(() => {
      const out = getBuilder().request(body);
      set.status = 202;
      return out;
    }), { body: NewTemplate, response: { 202: Requested, ...bodyFails(409) }, detail: { ...tag, summary: "Request a build: the template's ID (the name's when it exists) and a new build ID" } })
    .post("/v2/templates/:templateID/builds/:buildID", ({ params, body, set }) => call(async () => {
      await getBuilder().start(params.templateID, params.buildID, body as BuildSpec);
      set.status = 202;
    }), {
      params: Ids, body: BuildStart,
      response: { 202: noContent("started (or queued): poll its status"), ...bodyFails(404, 409, 429) },
      detail: { ...tag, summary: "Start a requested build: fromTemplate or fromImage, steps, startCmd, readyCmd" },
    })
    .get("/templates/:templateID/builds/:buildID/status", ({ params, query }) => call(() => {
      const offset = query.logsOffset === undefined ? 0 : Number(query.logsOffset);
      const limit = query.limit === undefined ? LOG_PAGE : Number(query.limit);
      if (!Number.isInteger(offset) || offset < 0) throw new ApiError(400, "logsOffset must be a whole number ≥ 0");
      if (!Number.isInteger(limit) || limit < 0 || limit > LOG_PAGE) throw new ApiError(400, `limit must be 0..${LOG_PAGE}`);
      if (query.level !== undefined && !LEVELS.has(query.level)) throw new ApiError(400, "level must be debug, info, warn or error");
      return getBuilder().status(params.templateID, params.buildID, offset, limit, query.level as LogLevel | undefined);
    }), {
      params: Ids,
      query: t.Object({
        logsOffset: t.Optional(t.String({ description: "first log entry, default 0" })),
        limit: t.Optional(t.String({ description: `0..${LOG_PAGE}, default ${LOG_PAGE}` })),
        level: t.Optional(t.String({ description: "debug, info, warn or error: that level and above" })),
      }),
      response: { 200: BuildStatus, ...fails(400, 404) },
      detail: { ...tag, summary: `Build status (waiting, building, ready, error) with up to ${LOG_PAGE} log entries from logsOffset` },
    })
    .get("/templates/:templateID/builds/:buildID/logs", ({ params, query }) => call(() => {
      const offset = query.cursor === undefined ? 0 : Number(query.cursor);
      if (!Number.isInteger(offset) || offset < 0) throw new ApiError(400, "cursor must be a whole number ≥ 0");
      return { logs: getBuilder().status(params.templateID, params.buildID, offset).logEntries };
    }), {
      params: Ids,
      query: t.Object({ cursor: t.Optional(t.String({ description: "first log entry, default 0" })) }),
      response: { 200: t.Object({ logs: t.Array(LogEntry) }, { description: `up to ${LOG_PAGE} log entries from cursor` }), ...fails(400, 404) },
      detail: { ...tag, summary: `A build's log entries from cursor (up to ${LOG_PAGE})` },
    })
    .get("/templates/:templateID/files/:hash", ({ params, request, set }) => call(async () => {
      const present = await getBuilder().fileStatus(params.templateID, params.hash);
      set.status = 201;
      // The URL is given even when present: the SDK re-uploads on forceUpload only when it has one.
      return { present, url: `${new URL(request.url).origin}${uploads.pathFor(params.templateID, params.hash)}` };
    }), {
      params: FileParams,
      response: { 201: t.Object({ present: t.Boolean(), url: t.String({ description: "signed and expiring: PUT the archive here, no API key" }) }, { description: "whether the archive is here, and where to upload it" }), ...fails(400, 404) },
      detail: { ...tag, summary: "Whether a COPY archive (by the SDK's files hash) is here, and the URL to PUT it to" },
    })
    .put("/templates/:templateID/files/:hash", ({ params, query, request, set }) => call(async () => {
      uploads.check(params.templateID, params.hash, query.expires, query.signature);
      await getBuilder().putFile(params.templateID, params.hash, request.body);
      set.status = 200;
      return {};
    }), {
      params: FileParams,
      query: t.Object({
        expires: t.Optional(t.String({ description: "from the URL the files route gave: unix seconds" })),
        signature: t.Optional(t.String({ description: "from the URL the files route gave" })),
      }),
      response: { 200: t.Object({}, { description: "stored, or already here (the stored archive is kept)" }), ...fails(400, 403, 404, 409, 413) },
      detail: {
        ...tag, summary: "Upload a COPY archive (tar or tar.gz) to the signed URL the files route gave, before it expires; a hash already here keeps its archive", security: [],
        requestBody: { required: true, content: { "application/octet-stream": { schema: { type: "string", format: "binary" } } } },
      },
    })
    .post("/templates/tags", ({ body, set }) => call(() => {
      const out = getBuilder().assignTags(body.target, body.tags);
      set.status = 201;
      return out;
    }), {
      body: t.Object({ target: t.String({ minLength: 1, maxLength: 256 }), tags: Tags }),
      response: { 201: t.Object({ buildID: t.String(), tags: t.Array(t.String()) }, { description: "the build the tags now name" }), ...bodyFails(404) },
      detail: { ...tag, summary: "Tag the build that target (name:tag) names" },
    })
    .delete("/templates/tags", ({ body, set }) => call(() => {
      getBuilder().removeTags(body.name, body.tags);
      set.status = 204;
    }), {
      body: t.Object({ name: t.String({ minLength: 1, maxLength: 256 }), tags: Tags }),
      response: { 204: noContent("removed"), ...bodyFails(404) },
      detail: { ...tag, summary: "Remove tags from a template ('default' stays)" },
    })
    .get("/templates/:templateID/tags", ({ params }) => call(() => getBuilder().listTags(params.templateID)), {
      params: t.Object({ templateID: t.String({ minLength: 1, maxLength: 256, description: "ID or name" }) }),
      response: { 200: t.Array(t.Object({ tag: t.String(), buildID: t.String(), createdAt: t.String({ format: "date-time" }) }), { description: "its tags" }), ...fails(400, 404) },
      detail: { ...tag, summary: "A template's tags and the build each names" },
    });
}
