// E2B's secrets routes (the e2b SDK 2.51's `Secret`): create, list (`limit` + `nextToken`,
// `X-Next-Token`), get / update / delete by ID (`sec_…`) or name. Values are write-only: bodies
// take them, no answer carries one. The store (src/network/secrets.ts, wired by the node) checks
// names, values and metadata and keeps the secrets the egress proxy resolves; its refusals carry
// their HTTP status (400, 404, 409, 429), answered as `{code, message}`.
import { Elysia, t } from "elysia";
import { ApiError, bodyFailures, failures } from "./errors.ts";
import { newestFirstPage, pageQuery, rawObjects } from "./sandboxes.ts";
import { StoreError, listScope } from "../orchestrator/store.ts";

/** What the API shows of a secret: never its value. */
export interface SecretInfo {
  id: string;
  name: string;
  version: number;
  metadata: Record<string, string>;
  /** Unix ms. */
  createdAt: number;
  updatedAt: number;
}

/** The node's secret store as these routes use it (`ref`: an ID or a name). */
export interface SecretBook {
  create(name: string, value: string, metadata?: Record<string, string>): Promise<SecretInfo>;
  list(): Promise<SecretInfo[]>;
  info(ref: string): Promise<SecretInfo | undefined>;
  update(ref: string, value: string, metadata?: Record<string, string>): Promise<SecretInfo>;
  remove(ref: string): Promise<boolean>;
}

const secretBody = (s: SecretInfo) => ({
  secretID: s.id,
  name: s.name,
  currentVersion: s.version,
  metadata: s.metadata,
  createdAt: new Date(s.createdAt).toISOString(),
  updatedAt: new Date(s.updatedAt).toISOString(),
});

const Metadata = t.Record(t.String(), t.String(), {
  description: "at most 32 entries; keys at most 128 bytes, values 1024, all of them 8192 together",
});
const SecretFields = {
  secretID: t.String({ description: "sec_ and 24 characters of [a-z0-9]" }),
  name: t.String({ description: "lower-cased" }),
  currentVersion: t.Integer({ description: "1 when created, one more on each update" }),
  metadata: Metadata,
  createdAt: t.String({ format: "date-time" }),
  updatedAt: t.String({ format: "date-time" }),
};
const Secret = (description: string) => t.Object(SecretFields, { description, additionalProperties: false });
const Value = t.String({ description: "write-only: at most 8192 bytes without CR, LF or NUL; never returned" });
const SecretRef = t.Object({ secretID: t.String({ minLength: 1, maxLength: 512, description: "the secret's ID (sec_…) or its name" }) });
const tags = (summary: string) => ({ detail: { tags: ["secrets"], summary } });

/** The store's refusals as API errors (same status, same words). */
async function call<T>(fn: () => Promise<T>): Promise<T> {
  try {
    return await fn();
  } catch (e) {
    const status = (e as { status?: unknown }).status;
    if (typeof status === "number" && status >= 400 && status < 500) throw new ApiError(status, (e as Error).message);
    if (e instanceof StoreError) throw new ApiError(400, e.message);
    throw e;
  }
}

export function secretRoutes(book: SecretBook) {
  return new Elysia()
    .post("/secrets", async ({ body, set }) => {
      const s = await call(() => book.create(body.name, body.value, body.metadata));
      set.status = 201;
      return secretBody(s);
    }, {
      body: t.Object({
        name: t.String({ minLength: 1, maxLength: 1024, description: "unique on this node; lower-cased; no '{', '}' or control characters, not starting with sec_" }),
        value: Value,
        metadata: t.Optional(Metadata),
      }),
      transform: rawObjects("metadata"),
      response: { 201: Secret("created: its metadata, never its value"), ...bodyFailures(409, 429) },
      ...tags("Create a secret; ${e2b.secrets.NAME} in a network rule's header resolves to its value at egress"),
    })
    .get("/secrets", ({ query, set }) => call(async () => newestFirstPage(await book.list(), query, listScope("secrets", []), set).map(secretBody)), {
      query: t.Object(pageQuery),
      response: { 200: t.Array(Secret("a secret"), { description: "newest first; header X-Next-Token when more remain" }), ...failures(400) },
      ...tags("List the secrets (limit + nextToken)"),
    })
    .get("/secrets/:secretID", async ({ params }) => {
      const s = await book.info(params.secretID);
      if (!s) throw new ApiError(404, `secret ${params.secretID} not found`);
      return secretBody(s);
    }, {
      params: SecretRef,
      response: { 200: Secret("the secret's metadata"), ...failures(404) },
      ...tags("A secret by ID or name"),
    })
    .post("/secrets/:secretID", async ({ params, body }) => secretBody(await call(() => book.update(params.secretID, body.value, body.metadata))), {
      params: SecretRef,
      body: t.Object({ value: Value, metadata: t.Optional(Metadata) }),
      transform: rawObjects("metadata"),
      response: { 200: Secret("updated: a new version (metadata replaced when given)"), ...bodyFailures(404, 429) },
      ...tags("A new value for a secret; the next request a sandbox sends gets it"),
    })
    .delete("/secrets/:secretID", async ({ params, set }) => {
      if (!(await call(() => book.remove(params.secretID)))) throw new ApiError(404, `secret ${params.secretID} not found`);
      set.status = 204;
    }, {
      params: SecretRef,
      response: { 204: t.Void({ description: "deleted: a rule naming it fails its requests (502) from now on" }), ...failures(404, 429) },
      ...tags("Delete a secret"),
    });
}
