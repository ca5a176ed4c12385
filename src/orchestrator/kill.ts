// Kill: after the operation in flight on the sandbox, everything it holds goes back (ledger.ts)
// and so does its row.
import { collectCheckpointsLater } from "./checkpoint.ts";
import { ENVD_PORT } from "./envd.ts";
import { runProcess } from "./envd_process.ts";
import { notFound, OrchestratorError } from "./errors.ts";
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
    // What the guest wrote to its volumes is flushed before its VM goes (they outlive it).
    if (rec.volumeMounts?.length) await syncGuest(node, id, rec.envdAccessToken).catch((e) => console.error(`orchestrator: sync in ${id} before its kill: ${(e as Error).message}`));
    await teardown(node, id);
    collectCheckpointsLater(node);
  });
}

/** `sync`'s limit in a guest (the VM stops after it either way: ext4's journal covers the rest). */
const SYNC_TIMEOUT_MS = 10_000;

/** `sync` as root in a running sandbox's guest, through its envd; nothing for one not running here. */
export async function syncGuest(node: NodeState, id: string, token: string): Promise<void> {
  const live = node.live.get(id);
  if (!live) return;
  const r = await runProcess(`http://${live.slot.nsIp}:${ENVD_PORT}`, token, { cmd: "/agentenv/bin/busybox", args: ["sync"], user: "root", cwd: "/" }, { timeoutMs: SYNC_TIMEOUT_MS });
  if (r.exitCode !== 0) throw new OrchestratorError(500, `sync ended with ${r.status}`);
}
