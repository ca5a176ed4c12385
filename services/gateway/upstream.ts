// Requests from the gateway to one node's API: the caller's headers (its API key among them) and
// the body the gateway validated, with a deadline; a node that cannot be reached is a NodeUnreachable.
import { ApiError } from "../../src/api/errors.ts";
import { forwardedHeaders } from "../../src/api/relay.ts";
import type { NodeRecord } from "../../src/cluster/records.ts";

/** A forwarded API call's bound: a create from an image builds its template first (minutes under TCG). */
export const NODE_CALL_TIMEOUT_MS = 30 * 60_000;
/** A list's or a lookup's bound per node: one slow node must not stall every list. */
export const NODE_LIST_TIMEOUT_MS = 10_000;

export class NodeUnreachable extends Error {
  override name = "NodeUnreachable";
  /** True when the connection was refused: the node never saw the request, so another may be asked. */
  constructor(readonly node: string, readonly refused: boolean, message: string) {
    super(message);
  }
}

/** `req` (its method and headers) to `node` at `pathAndQuery`, with `body` as JSON when given. */
export async function callNode(node: NodeRecord, req: Request, pathAndQuery: string, body: unknown, timeoutMs = NODE_CALL_TIMEOUT_MS): Promise<Response> {
  const headers = forwardedHeaders(req);
  let payload: string | undefined;
  if (body !== undefined && req.method !== "GET" && req.method !== "HEAD") {
    payload = JSON.stringify(body);
    headers.set("content-type", "application/json");
  }
  try {
    return await fetch(`${node.apiUrl}${pathAndQuery}`, { method: req.method, headers, body: payload, redirect: "manual", signal: AbortSignal.timeout(timeoutMs) });
  } catch (e) {
    const code = (e as { code?: string }).code;
    const refused = code === "ConnectionRefused" || /ECONNREFUSED|Unable to connect/i.test((e as Error).message);
    throw new NodeUnreachable(node.id, refused, `node ${node.id} (${node.apiUrl}) did not answer: ${(e as Error).message}`);
  }
}

/** A node's answer passed on as it came (status, headers, body streamed). */
export function passOn(r: Response): Response {
  const headers = new Headers(r.headers);
  headers.delete("content-length");
  headers.delete("content-encoding");
  headers.delete("transfer-encoding");
  return new Response(r.body, { status: r.status, headers });
}

/** A node's JSON answer read whole (lists and lookups, bounded by the node's own page size). */
export async function jsonOf<T>(r: Response): Promise<T> {
  const text = await r.text();
  try {
    return JSON.parse(text) as T;
  } catch {
    throw new ApiError(502, `a node answered ${r.status} with a body that is not JSON`);
  }
}
