// The API's one error type: it carries its HTTP status, and its body is E2B's `{code, message}`
// with `code` the status as a number (the SDK compares it with 404 and 409).
import { t } from "elysia";

export class ApiError extends Error {
  constructor(readonly status: number, message: string, readonly extra: Record<string, unknown> = {}) {
    super(message);
    this.name = "ApiError";
  }

  body(): Record<string, unknown> {
    return { code: this.status, message: this.message, ...this.extra };
  }

  response(headers: Record<string, string> = {}): Response {
    return Response.json(this.body(), { status: this.status, headers });
  }
}

export const badRequest = (message: string) => new ApiError(400, message);
export const unauthorized = () => new ApiError(401, "Invalid API key, it must be sent as X-API-Key or Authorization: Bearer");
export const notFound = (message: string) => new ApiError(404, message);
export const conflict = (message: string) => new ApiError(409, message);
export const tooLarge = (limit: number) => new ApiError(413, `request body is larger than ${limit} bytes`);

/** What each error status means on this API: the OpenAPI document's description of its `{code, message}` body. */
const MEANING: Record<number, string> = {
  400: "bad input (the message names the field)",
  401: "missing or wrong API key",
  403: "refused by the node's own rules (an S3 bucket outside AENV_S3_BUCKETS, a registry outside AENV_INSECURE_REGISTRIES at an internal address), or an upload URL that is expired or altered",
  404: "unknown sandbox, template, snapshot, build, node or secret",
  409: "wrong state (e.g. pausing a paused sandbox), or a name that is taken (a template's, a secret's)",
  413: "request body over AENV_MAX_BODY_BYTES",
  415: "request body is not JSON",
  429: "the node is full (AENV_MAX_SANDBOXES, builds running and waiting, or 1000 secrets)",
  500: "a part failed (the message says which and why)",
  503: "the node is starting (the message names the step)",
  507: "the node's disk: less free than AENV_DISK_RESERVE_MB, or a disk above AENV_MAX_DISK_SIZE_MB",
};

const errorSchema = (description: string) =>
  t.Object({ code: t.Number({ description: "the HTTP status" }), message: t.String() }, { description, additionalProperties: true });
type ErrorSchema = ReturnType<typeof errorSchema>;
/** One schema per status (at most one per entry of MEANING, plus what routes name). */
const errorBodies = new Map<number, ErrorSchema>();

/** The `{code, message}` body of an error status, as a response schema. */
export function errorBody(status: number): ErrorSchema {
  let s = errorBodies.get(status);
  if (!s) {
    s = errorSchema(MEANING[status] ?? `error ${status}`);
    errorBodies.set(status, s);
  }
  return s;
}

/** Response schemas of error statuses, to spread into a route's `response` beside its success. */
export function errorResponses<const S extends readonly number[]>(...statuses: S): Record<S[number], ErrorSchema> {
  return Object.fromEntries(statuses.map((s) => [s, errorBody(s)])) as Record<S[number], ErrorSchema>;
}

/** What an API route may fail with besides `extra`: a bad key (401), a part failing (500), the node starting (503). */
export const failures = <const S extends readonly number[]>(...extra: S) => errorResponses(401, 500, 503, ...extra);
/** A route with a JSON body: also malformed or wrong fields (400), too large (413), not JSON (415). */
export const bodyFailures = <const S extends readonly number[]>(...extra: S) => failures(400, 413, 415, ...extra);
