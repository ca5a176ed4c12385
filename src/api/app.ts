// The node's HTTP API on Elysia: API-key auth on every API route, bounded JSON bodies, errors as
// E2B's `{code, message}` with the status the SDK maps, and the OpenAPI document with an offline
// Swagger UI. Routes are added by the caller (`.use(...)`); src/api/server.ts serves it beside the proxy.
import { Elysia, t } from "elysia";
import { swagger } from "@elysiajs/swagger";
import { ApiError, badRequest, errorBody, notFound, unauthorized } from "./errors.ts";
import { readBoundedJson } from "./body.ts";
import { secretMatches } from "./secret.ts";
import { swaggerUiResponse } from "./swagger_ui.ts";
import { isUploadRequest } from "./templates.ts";
import { isVolumeContentPath } from "./volumes.ts";

export interface ApiOptions {
  apiKey: string;
  maxBodyBytes: number;
  /** undefined: the node can create sandboxes; a string: why it cannot yet (503). */
  notReadyReason: () => string | undefined;
  version: string;
}

const PLUGIN_UI = "/swagger/_plugin_ui";
/** The parsed body of a route that reads `request.body` itself. */
const UNREAD_BODY = Object.freeze({});

/** Paths answered without an API key (E2B and AgentENV leave these open). */
const OPEN_PATHS = new Set(["/health", "/metrics", "/swagger", "/swagger/", "/swagger/json"]);

function presentedKey(headers: Headers): string | null {
  const x = headers.get("x-api-key");
  if (x !== null) return x;
  const auth = headers.get("authorization");
  return auth !== null && auth.startsWith("Bearer ") ? auth.slice(7) : null;
}

/** Whether `request` to `path` may go on: an open path, a signed upload or volume content (their routes check URL or token), or the right key. */
function authorised(request: Request, path: string, apiKey: string): boolean {
  if (OPEN_PATHS.has(path) || path.startsWith("/swagger/assets/")) return true;
  if (isUploadRequest(request.method, path) || isVolumeContentPath(path)) return true;
  return secretMatches(presentedKey(request.headers), apiKey);
}

export function createApi(opts: ApiOptions) {
  return new Elysia()
    .onRequest(({ request }) => {
      const path = new URL(request.url).pathname;
      // The plugin's own page loads its assets from a CDN: this node serves /swagger instead.
      if (path === PLUGIN_UI) return notFound("route not found: the API's UI is /swagger").response();
      // The key before anything reads the body: a caller without it learns nothing of a route's schema.
      if (!authorised(request, path, opts.apiKey)) return unauthorized().response();
      return swaggerUiResponse(path);
    })
    .onParse(async ({ request, contentType, path }) => {
      // A template file upload or volume content streams or reads its own body (bounded there), whatever its type.
      if (isUploadRequest(request.method, path) || isVolumeContentPath(path)) return UNREAD_BODY;
      if (contentType === "" || contentType.startsWith("application/json")) return readBoundedJson(request, opts.maxBodyBytes);
      throw new ApiError(415, `content type '${contentType}' is not accepted: send application/json`);
    })
    .onTransform(({ body }) => {
      // Every API body is a JSON object; anything else is refused before validation, whose
      // normalizing would turn an array or a string into an object.
      if (body !== undefined && (body === null || typeof body !== "object" || Array.isArray(body))) throw badRequest("the body must be a JSON object");
    })
    .onError(({ code, error, request, path }) => {
      if (error instanceof ApiError) return error.response();
      // A body parser's own error reaches here wrapped in Elysia's ParseError.
      const cause = (error as { cause?: unknown }).cause;
      if (cause instanceof ApiError) return cause.response();
      if (code === "NOT_FOUND") return notFound(`route not found: ${request.method} ${path}`).response();
      // An answer that does not match its route's response schema is this node's bug, not the caller's.
      if (code === "VALIDATION" && (error as { type?: string }).type === "response") {
        console.error(`api: ${request.method} ${path}: the answer does not match its schema:`, (error as Error).message);
        return new ApiError(500, "internal error: the answer does not match its schema").response();
      }
      if (code === "VALIDATION" || code === "PARSE") {
        const summary = (error as { message?: string }).message ?? String(error);
        let message = summary;
        try {
          // Elysia's validation error as JSON: name the field (its JSON pointer) with the summary.
          const v = JSON.parse(summary) as { summary?: string; property?: string };
          const field = v.property?.replace(/^\//, "").replaceAll("/", ".");
          message = `${field ? `${field}: ` : ""}${v.summary ?? summary}`;
        } catch { /* plain text */ }
        return badRequest(`invalid request: ${message}`).response();
      }
      console.error(`api: ${request.method} ${path}:`, error);
      return new ApiError(500, "internal error").response();
    })
    .use(swagger({
      path: PLUGIN_UI,
      specPath: "/swagger/json",
      documentation: {
        info: { title: "AgentENV node API (E2B-compatible)", version: opts.version },
        components: { securitySchemes: { ApiKeyAuth: { type: "apiKey", in: "header", name: "X-API-Key" } } },
        security: [{ ApiKeyAuth: [] }],
      },
    }))
    .get("/health", ({ set }) => {
      const reason = opts.notReadyReason();
      if (reason === undefined) return { status: "ok" as const };
      set.status = 503;
      return { code: 503, message: reason };
    }, {
      response: { 200: t.Object({ status: t.Literal("ok") }, { description: "the node can create sandboxes" }), 503: errorBody(503) },
      detail: { tags: ["node"], summary: "200 once the node can create sandboxes, 503 with the reason while it cannot", security: [] },
    });
}

export type Api = ReturnType<typeof createApi>;
