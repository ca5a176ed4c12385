// `aenv node ls|drain|cordon|ready`: the nodes behind an endpoint (a gateway lists the cluster's,
// a node itself) and their placement status (E2B's POST /nodes/{nodeID} status change).
import type { ParsedArgs } from "./args.ts";
import { NODE_OPTIONS, api, resolveTarget } from "./node_client.ts";
import { JSON_OPTION, printListing } from "./table.ts";
import type { Verb } from "./verbs.ts";


interface ListedNode {
  id: string;
  status: string;
  sandboxCount: number;
  sandboxPausedCount: number;
  version: string;
}

async function ls(a: ParsedArgs): Promise<void> {
  const t = await resolveTarget(a);
  const { data } = await api<ListedNode[]>(t, "GET", "/nodes");
  printListing(data, [
    { header: "NODE", cell: (n) => n.id },
    { header: "STATUS", cell: (n) => n.status },
    { header: "RUNNING", cell: (n) => String(n.sandboxCount) },
    { header: "PAUSED", cell: (n) => String(n.sandboxPausedCount) },
    { header: "VERSION", cell: (n) => n.version },
  ], { json: a.flag("json"), empty: "no nodes" });
}

function setStatus(status: "draining" | "cordoned" | "ready") {
  return async (a: ParsedArgs): Promise<void> => {
    const [id] = a.need(1, "a node ID") as [string];
    const t = await resolveTarget(a);
    const pause = a.flag("pause");
    const { data } = await api<{ paused: number; failed: string[] }>(t, "POST", `/nodes/${encodeURIComponent(id)}`, { body: { status, ...(pause ? { pause: true } : {}) }, subject: { kind: "node", id } });
    process.stdout.write(`node ${id}: ${status}${pause ? `; ${data.paused} sandboxes paused` : ""}\n`);
    for (const f of data.failed) process.stderr.write(`  not paused: ${f}\n`);
    if (data.failed.length) process.exitCode = 1;
  };
}

const PAUSE = { flag: "--pause", help: "also pause every running sandbox on it (they resume there)" };

export const NODE_GROUP_VERBS: Record<string, Verb> = {
  ls: { operands: "", summary: "the nodes behind the endpoint (a gateway: the cluster's) with status and sandbox counts", options: [JSON_OPTION, ...NODE_OPTIONS], run: ls },
  drain: { operands: "ID", summary: "stop placing sandboxes on node ID (E2B's draining); its sandboxes stay unless --pause", options: [PAUSE, ...NODE_OPTIONS], run: setStatus("draining") },
  cordon: { operands: "ID", summary: "the same as drain, marked as an operator's hold", options: [PAUSE, ...NODE_OPTIONS], run: setStatus("cordoned") },
  ready: { operands: "ID", summary: "place sandboxes on node ID again", options: [...NODE_OPTIONS], run: setStatus("ready") },
};
