// Kill: after the operation in flight on the sandbox, everything it holds goes back (ledger.ts)
// and so does its row.
import { collectCheckpointsLater } from "./checkpoint.ts";
import { notFound } from "./errors.ts";
import { teardown } from "./ledger.ts";
import type { NodeState } from "./node_state.ts";

/** Kills a running or paused sandbox; 404 when it is unknown or already being killed. */
export async function kill(node: NodeState, id: string): Promise<void> {
  if (!node.store.get(id)) throw notFound(id);
  await node.settled(id);
  const rec = node.store.transition(id, ["running", "paused"], "killing");
  if (!rec) {
    if (!node.store.get(id) || node.store.get(id)!.state === "killing") throw notFound(id);
    return kill(node, id); // a new operation started between the wait and the transition
  }
  await node.track(id, "kill", async () => {
    await teardown(node, id);
    collectCheckpointsLater(node);
  });
}
