// E2B's template build routes as the e2b SDK 2.51 `Template` builder calls them: request a build
// (POST /v3/templates), upload COPY files by hash (GET a URL, PUT the archive to it), start it
// (POST /v2/templates/{templateID}/builds/{buildID}), poll its status with logsOffset, and tags.
// Handlers validate and shape; the builder (src/orchestrator/builder.ts) holds the builds.
import { Elysia, t } from "elysia";
import { ApiError } from "./errors.ts";
import { OrchestratorError } from "../orchestrator/orchestrator.ts";
import { LOG_PAGE, TemplateBuildError, type BuildSpec, type LogLevel, type TemplateBuilder } from "../orchestrator/builder.ts";

/** The archive upload: its URL carries a signature instead of the API key (the SDK sends none). */
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
}, { additionalProperties: true });

const LEVELS = new Set(["debug", "info", "warn", "error"]);

/** The routes over `getBuilder`, which returns the builder or throws (503 while the node starts). */
export function templateRoutes(getBuilder: () => TemplateBuilder) {
  const tag = { tags: ["templates"] };
  return new Elysia({ name: "templates" })
    .post("/v3/templates", ({ body, set }) => call(() => {
      const out = getBuilder().request(body);
      set.status = 202;
      return out;
    }), { body: NewTemplate, detail: { ...tag, summary: "Request a build: the template's ID (the name's when it exists) and a new build ID" } })
    .post("/v2/templates/:templateID/builds/:buildID", ({ params, body, set }) => call(async () => {
      await getBuilder().start(params.templateID, params.buildID, body as BuildSpec);
      set.status = 202;
      return "";
    }), { params: Ids, body: BuildStart, detail: { ...tag, summary: "Start a requested build: fromTemplate or fromImage, steps, startCmd, readyCmd" } })
    .get("/templates/:templateID/builds/:buildID/status", ({ params, query }) => call(() => {
      const offset = query.logsOffset === undefined ? 0 : Number(query.logsOffset);
      const limit = query.limit === undefined ? LOG_PAGE : Number(query.limit);
      if (!Number.isInteger(offset) || offset < 0) throw new ApiError(400, "logsOffset must be a whole number ≥ 0");
      if (!Number.isInteger(limit) || limit < 0 || limit > LOG_PAGE) throw new ApiError(400, `limit must be 0..${LOG_PAGE}`);
      if (query.level !== undefined && !LEVELS.has(query.level)) throw new ApiError(400, "level must be debug, info, warn or error");
      return getBuilder().status(params.templateID, params.buildID, offset, limit, query.level as LogLevel | undefined);
    }), {
      params: Ids,
      query: t.Object({ logsOffset: t.Optional(t.String()), limit: t.Optional(t.String()), level: t.Optional(t.String()) }),
      detail: { ...tag, summary: `Build status (waiting, building, ready, error) with up to ${LOG_PAGE} log entries from logsOffset` },
    })
    .get("/templates/:templateID/builds/:buildID/logs", ({ params, query }) => call(() => {
      const offset = query.cursor === undefined ? 0 : Number(query.cursor);
      if (!Number.isInteger(offset) || offset < 0) throw new ApiError(400, "cursor must be a whole number ≥ 0");
      return { logs: getBuilder().status(params.templateID, params.buildID, offset).logEntries };
    }), { params: Ids, query: t.Object({ cursor: t.Optional(t.String()) }), detail: { ...tag, summary: `A build's log entries from cursor (up to ${LOG_PAGE})` } })
    .get("/templates/:templateID/files/:hash", ({ params, request, set }) => call(async () => {
      const st = await getBuilder().fileStatus(params.templateID, params.hash);
      set.status = 201;
      // The URL is given even when present: the SDK re-uploads on forceUpload only when it has one.
      return { present: st.present, url: `${new URL(request.url).origin}${st.uploadPath}` };
    }), { params: FileParams, detail: { ...tag, summary: "Whether a COPY archive (by the SDK's files hash) is here, and the URL to PUT it to" } })
    .put("/templates/:templateID/files/:hash", ({ params, query, request, set }) => call(async () => {
      await getBuilder().putFile(params.templateID, params.hash, query.signature ?? "", request.body);
      set.status = 200;
      return {};
    }), {
      params: FileParams,
      query: t.Object({ signature: t.Optional(t.String()) }),
      detail: { ...tag, summary: "Upload a COPY archive (tar or tar.gz) to the signed URL the files route gave", security: [] },
    })
    .post("/templates/tags", ({ body, set }) => call(() => {
      const out = getBuilder().assignTags(body.target, body.tags);
      set.status = 201;
      return out;
    }), { body: t.Object({ target: t.String({ minLength: 1, maxLength: 256 }), tags: Tags }), detail: { ...tag, summary: "Tag the build that target (name:tag) names" } })
    .delete("/templates/tags", ({ body, set }) => call(() => {
      getBuilder().removeTags(body.name, body.tags);
      set.status = 204;
      return "";
    }), { body: t.Object({ name: t.String({ minLength: 1, maxLength: 256 }), tags: Tags }), detail: { ...tag, summary: "Remove tags from a template ('default' stays)" } })
    .get("/templates/:templateID/tags", ({ params }) => call(() => getBuilder().listTags(params.templateID)), { detail: { ...tag, summary: "A template's tags and the build each names" } });
}
