// E2B's volumes as the e2b SDK 2.51 `Volume` class calls them: the team routes (/volumes, with the
// API key) and the volume-content API (/volumecontent/{volumeID}/..., with the volume's own token
// as `Authorization: Bearer`, and errors whose `code` is a string, as E2B's content API has them).
// Handlers check and shape; the VolumeStore (src/orchestrator/volumes.ts) does the work.
import { Elysia, t } from "elysia";
import { readBoundedJson } from "./body.ts";
import { ApiError, badRequest, bodyFailures, failures } from "./errors.ts";
import { secretMatches } from "./secret.ts";
import { OrchestratorError } from "../orchestrator/orchestrator.ts";
import type { EntryMeta } from "../orchestrator/volume_fs.ts";
import type { VolumeRecord, VolumeStore } from "../orchestrator/volumes.ts";

const CONTENT_PREFIX = "/volumecontent/";

/** A volume-content request: authorised by the volume's token (its route checks it) and its body read by its route. */
export function isVolumeContentPath(path: string): boolean {
  return path.startsWith(CONTENT_PREFIX);
}

/** Levels one listing may go down (each level is one debugfs batch). */
const DEPTH_MAX = 64;
const UINT32_MAX = 2 ** 32 - 1;

async function call<T>(fn: () => T | Promise<T>): Promise<T> {
  try {
    return await fn();
  } catch (e) {
    if (e instanceof OrchestratorError) throw new ApiError(e.status, e.message);
    throw e;
  }
}

const VolumeId = t.Object({ volumeID: t.String({ minLength: 1, maxLength: 128 }) });
const Volume = t.Object({ volumeID: t.String(), name: t.String() });
const VolumeAndToken = t.Object({
  volumeID: t.String(), name: t.String(),
  token: t.String({ description: "the volume-content API's bearer token" }),
  domain: t.Optional(t.String()),
}, { description: "the volume and the token of its content API" });
const andToken = (r: VolumeRecord) => ({ volumeID: r.id, name: r.name, token: r.token });

const Entry = t.Object({
  name: t.String(), type: t.Union([t.Literal("unknown"), t.Literal("file"), t.Literal("directory"), t.Literal("symlink")]), path: t.String(),
  size: t.Integer(), mode: t.Integer({ description: "permission bits (with setuid, setgid, sticky)" }), uid: t.Integer(), gid: t.Integer(),
  atime: t.String({ format: "date-time" }), mtime: t.String({ format: "date-time" }), ctime: t.String({ format: "date-time" }),
  target: t.Optional(t.String({ description: "a symlink's target, as stored (resolved inside the volume)" })),
}, { description: "the entry (E2B's VolumeEntryStat)" });

/** E2B's content API error: `code` a string (here the HTTP status as text). */
const contentError = (description: string) => t.Object({ code: t.String({ description: "the HTTP status as text" }), message: t.String() }, { description });
const CONTENT_ERRORS = {
  400: contentError("bad input: a path that cannot be handled, a bad uid, gid, mode or depth"),
  401: contentError("no `Authorization: Bearer <volume token>`"),
  403: contentError("the token is not this volume's, or no such volume"),
  404: contentError("no such path in the volume"),
  409: contentError("a sandbox has the volume mounted, or the path is in the way"),
  413: contentError("a file larger than the volume"),
  429: contentError("too many calls waiting on the volume, or volumes open at once"),
  500: contentError("a part failed (the message says which and why)"),
  503: contentError("the node is starting, or a call waited too long for its turn"),
  507: contentError("the volume is full"),
};
const contentFails = <const S extends readonly (keyof typeof CONTENT_ERRORS)[]>(...s: S) =>
  Object.fromEntries([401, 403, 500, 503, ...s].map((k) => [k, CONTENT_ERRORS[k as keyof typeof CONTENT_ERRORS]])) as Pick<typeof CONTENT_ERRORS, S[number] | 401 | 403 | 500 | 503>;

const PathQuery = t.Object({ path: t.String({ minLength: 1, description: "absolute, or relative to the volume's root" }) });
const MetaQuery = t.Object({
  path: t.String({ minLength: 1, description: "absolute, or relative to the volume's root" }),
  uid: t.Optional(t.Integer({ minimum: 0, maximum: UINT32_MAX, description: "owner (default 0)" })),
  gid: t.Optional(t.Integer({ minimum: 0, maximum: UINT32_MAX, description: "group (default 0)" })),
  mode: t.Optional(t.Integer({ minimum: 0, maximum: 0o7777, description: "permission bits (default 0644 for a file, 0755 for a directory)" })),
  force: t.Optional(t.Boolean({ description: "make missing parent directories" })),
});

/** uid, gid, mode of a PATCH body, checked. */
function metaOf(body: unknown): EntryMeta {
  if (body === null || typeof body !== "object" || Array.isArray(body)) throw badRequest("the body must be a JSON object");
  const b = body as Record<string, unknown>;
  const out: EntryMeta = {};
  for (const [k, max] of [["uid", UINT32_MAX], ["gid", UINT32_MAX], ["mode", 0o7777]] as const) {
    const v = b[k];
    if (v === undefined || v === null) continue;
    if (!Number.isInteger(v) || (v as number) < 0 || (v as number) > max) throw badRequest(`${k}: a whole number in 0..${max}`);
    out[k] = v as number;
  }
  return out;
}

const metaFrom = (q: { uid?: number; gid?: number; mode?: number }): EntryMeta => ({ uid: q.uid, gid: q.gid, mode: q.mode });

export interface VolumeRouteOptions {
  /** The bound of a PATCH's JSON body (AENV_MAX_BODY_BYTES). */
  maxBodyBytes: number;
}

/** The routes over `getVolumes`, which returns the store or throws (503 while the node starts). */
export function volumeRoutes(getVolumes: () => VolumeStore, opts: VolumeRouteOptions) {
  const tag = { tags: ["volumes"] };
  const content = { tags: ["volume content"], security: [] };
  /** The volume a content request's bearer token opens: 401 without one, 403 when it is not this volume's. */
  const authorised = async (request: Request, volumeID: string): Promise<VolumeRecord> => {
    const auth = request.headers.get("authorization");
    if (auth === null || !auth.startsWith("Bearer ")) throw new ApiError(401, "the volume's token must be sent as Authorization: Bearer <token>");
    const rec = await getVolumes().find(volumeID);
    if (!rec || !secretMatches(auth.slice(7), rec.token)) throw new ApiError(403, `the token does not open volume ${volumeID}`);
    return rec;
  };
  return new Elysia({ name: "volumes" })
    // E2B's content API errors carry `code` as a string: this node's errors are made so on those paths.
    .mapResponse({ as: "global" }, async ({ response, path }) => {
      if (!isVolumeContentPath(path) || !(response instanceof Response) || response.status < 400) return;
      if (!response.headers.get("content-type")?.includes("json")) return;
      const body = (await response.clone().json().catch(() => undefined)) as { code?: unknown } | undefined;
      if (typeof body?.code !== "number") return;
      return Response.json({ ...body, code: String(body.code) }, { status: response.status });
    })
    .post("/volumes", ({ body, set }) => call(async () => {
      const r = await getVolumes().create(body.name);
      set.status = 201;
      return andToken(r);
    }), {
      body: t.Object({ name: t.String({ description: "unique on the node (in a cluster sharing its snapshot store: in the cluster): ^[a-zA-Z0-9_-]+$, at most 128 characters" }) }),
      response: { 201: VolumeAndToken, ...bodyFailures(409, 429) },
      detail: { ...tag, summary: "Create a volume: an empty ext4 file system of AENV_VOLUME_SIZE_MB, and its content API's token" },
    })
    .get("/volumes", () => call(async () => (await getVolumes().catalog()).map((r) => ({ volumeID: r.id, name: r.name }))), {
      response: { 200: t.Array(Volume, { description: "the node's volumes (in a cluster sharing its snapshot store: the cluster's)" }), ...failures() },
      detail: { ...tag, summary: "List volumes" },
    })
    .get("/volumes/:volumeID", ({ params }) => call(async () => andToken(await getVolumes().describe(params.volumeID))), {
      params: VolumeId,
      response: { 200: VolumeAndToken, ...failures(404) },
      detail: { ...tag, summary: "A volume and its content API's token" },
    })
    .delete("/volumes/:volumeID", ({ params, set }) => call(async () => {
      await getVolumes().destroy(params.volumeID);
      set.status = 204;
    }), {
      params: VolumeId,
      response: { 204: t.Void({ description: "deleted with its files" }), ...failures(404, 409) },
      detail: { ...tag, summary: "Delete a volume (409 while a sandbox has it mounted)" },
    })
    .get("/volumecontent/:volumeID/path", ({ params, query, request }) => call(async () => {
      await authorised(request, params.volumeID);
      return getVolumes().entry(params.volumeID, query.path);
    }), {
      params: VolumeId, query: PathQuery,
      response: { 200: Entry, ...contentFails(400, 404, 409, 429) },
      detail: { ...content, summary: "An entry of the volume (a symlink itself, with its target); bearer: the volume's token" },
    })
    .patch("/volumecontent/:volumeID/path", ({ params, query, request }) => call(async () => {
      await authorised(request, params.volumeID);
      const meta = metaOf(await readBoundedJson(request, opts.maxBodyBytes));
      return getVolumes().updateEntry(params.volumeID, query.path, meta);
    }), {
      params: VolumeId, query: PathQuery,
      response: { 200: Entry, ...contentFails(400, 404, 409, 413, 429, 507) },
      detail: {
        ...content, summary: "Set an entry's uid, gid or permission bits; bearer: the volume's token",
        requestBody: { content: { "application/json": { schema: { type: "object", properties: { uid: { type: "integer" }, gid: { type: "integer" }, mode: { type: "integer" } } } } } },
      },
    })
    .delete("/volumecontent/:volumeID/path", ({ params, query, request, set }) => call(async () => {
      await authorised(request, params.volumeID);
      await getVolumes().removeEntry(params.volumeID, query.path);
      set.status = 204;
    }), {
      params: VolumeId, query: PathQuery,
      response: { 204: t.Void({ description: "removed (a directory with everything under it)" }), ...contentFails(400, 404, 409, 429) },
      detail: { ...content, summary: "Remove an entry, a directory with everything under it; bearer: the volume's token" },
    })
    .get("/volumecontent/:volumeID/dir", ({ params, query, request }) => call(async () => {
      await authorised(request, params.volumeID);
      return getVolumes().entries(params.volumeID, query.path, query.depth ?? 1);
    }), {
      params: VolumeId,
      query: t.Object({ path: PathQuery.properties.path, depth: t.Optional(t.Integer({ minimum: 1, maximum: DEPTH_MAX, description: "levels to go down (default 1)" })) }),
      response: { 200: t.Array(Entry, { description: "the entries, parents before children" }), ...contentFails(400, 404, 409, 429) },
      detail: { ...content, summary: "List a directory, `depth` levels down; bearer: the volume's token" },
    })
    .post("/volumecontent/:volumeID/dir", ({ params, query, request, set }) => call(async () => {
      await authorised(request, params.volumeID);
      const e = await getVolumes().makeDir(params.volumeID, query.path, metaFrom(query), query.force === true);
      set.status = 201;
      return e;
    }), {
      params: VolumeId, query: MetaQuery,
      response: { 201: Entry, ...contentFails(400, 404, 409, 429, 507) },
      detail: { ...content, summary: "Make a directory (force: its missing parents too, and an existing one is its answer); bearer: the volume's token" },
    })
    .get("/volumecontent/:volumeID/file", ({ params, query, request }) => call(async () => {
      await authorised(request, params.volumeID);
      const f = await getVolumes().readFile(params.volumeID, query.path, request.signal);
      return new Response(f.stream, { headers: { "content-type": "application/octet-stream", "content-length": String(f.size) } });
    }), {
      params: VolumeId, query: PathQuery,
      response: { 200: t.Unknown({ description: "the file's bytes (symlinks followed inside the volume)" }), ...contentFails(400, 404, 409, 429) },
      detail: {
        ...content, summary: "Read a file; bearer: the volume's token",
        responses: { 200: { description: "the file's bytes (symlinks followed inside the volume)", content: { "application/octet-stream": { schema: { type: "string", format: "binary" } } } } },
      },
    })
    .put("/volumecontent/:volumeID/file", ({ params, query, request, set }) => call(async () => {
      await authorised(request, params.volumeID);
      const e = await getVolumes().writeFile(params.volumeID, query.path, request.body, metaFrom(query), query.force === true);
      set.status = 201;
      return e;
    }), {
      params: VolumeId, query: MetaQuery,
      response: { 201: Entry, ...contentFails(400, 404, 409, 413, 429, 507) },
      detail: {
        ...content, summary: "Write a file from the raw body (streamed), replacing one there (force: its missing parent directories are made); bearer: the volume's token",
        requestBody: { content: { "application/octet-stream": { schema: { type: "string", format: "binary" } } } },
      },
    });
}

