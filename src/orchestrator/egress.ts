// A sandbox's egress policy: checked from its request, put in force on its slot before its VM
// runs, and replaced live by PUT /sandboxes/{id}/network.
import { PolicyError, parseEgressPolicy, parseInboundPolicy, type EgressPolicy, type Slot } from "../network/index.ts";
import { asOrchestratorError, notFound, OrchestratorError } from "./errors.ts";
import type { SandboxRuntime } from "./ledger.ts";
import type { NodeState } from "./node_state.ts";

/** The fields of `network` that PUT /sandboxes/{id}/network replaces; the others (inbound) stay. */
const EGRESS_FIELDS = ["allowOut", "denyOut", "rules", "egressProxy", "httpsPorts"] as const;

/** A sandbox's egress policy from its request fields (inbound ones checked too); a malformed one is a 400 naming the field. */
export function egressPolicyOf(allowInternetAccess: unknown, network: unknown): EgressPolicy {
  try {
    parseInboundPolicy(network);
    return parseEgressPolicy(allowInternetAccess, network);
  } catch (e) {
    if (e instanceof PolicyError) throw new OrchestratorError(400, e.message);
    throw e;
  }
}

/**
 * Puts the stored policy of sandbox `id` in force on `slot`. Called right after each store write
 * of the policy or the slot (no await in between), so the last call carries the last policy.
 */
export function applyEgress(node: NodeState, id: string, slot: Slot): Promise<void> {
  const rec = node.store.get(id);
  if (!node.opts.egress || !rec) return Promise.resolve();
  return node.opts.egress.apply(slot, id, egressPolicyOf(rec.allowInternetAccess, rec.network));
}

/**
 * PUT /sandboxes/{id}/network: replaces the sandbox's egress settings (omitted ones cleared, the
 * inbound ones kept); a running sandbox gets them live and loses its connections they refuse. A
 * malformed body is a 400 naming the field, and the policy in force stays.
 */
export async function updateNetwork(node: NodeState, id: string, body: Record<string, unknown>): Promise<void> {
  const old = node.sandbox(id);
  const allow = body.allow_internet_access ?? null;
  const network: Record<string, unknown> = { ...((old.network ?? {}) as Record<string, unknown>) };
  for (const f of EGRESS_FIELDS) {
    if (body[f] === undefined) delete network[f];
    else network[f] = body[f];
  }
  egressPolicyOf(allow, network);
  if (!node.store.setNetwork(id, allow as boolean | null, network)) throw notFound(id);
  const slot = (node.store.get(id)?.runtime as SandboxRuntime | null)?.slot;
  if (!slot) return; // paused or not yet placed: applied when it gets a slot
  try {
    await applyEgress(node, id, slot);
  } catch (e) {
    node.store.setNetwork(id, old.allowInternetAccess, old.network);
    await applyEgress(node, id, slot).catch(() => {});
    throw asOrchestratorError(e, `applying the network policy of ${id}`);
  }
}
