// One round of the lifecycle's mix against a node, for the soak test and bench/soak: create, write,
// pause, connect, fork (two children, or three where the node holds at most 3 sandboxes, so the last
// is refused), a snapshot and a create from it (every 4th round), a kill racing a pause (every 4th),
// a timeout the reaper ends (every 5th), refused creates. Throws, naming the step, on a wrong answer.
import { Sandbox } from "e2b";
import { postJson, sdkOpts, until, type NodeProc } from "../node/harness.ts";

/** The node's max_sandboxes the mix is written for (a fork of 3 then has its last child refused). */
export const MIX_MAX_SANDBOXES = 3;

function check(ok: boolean, what: string): void {
  if (!ok) throw new Error(`soak mix: ${what}`);
}

export async function mixRound(node: NodeProc, key: string, r: number): Promise<void> {
  const opts = sdkOpts(node, key);
  const api = (path: string, method = "GET") => fetch(`${node.base}${path}`, { method, headers: { "x-api-key": key } });
  const a = await Sandbox.create("base", opts);
  await a.files.write("/tmp/round", `round ${r}`);
  check((await api(`/sandboxes/${a.sandboxId}/pause`, "POST")).status === 204, "pause answers 204");
  const back = await Sandbox.connect(a.sandboxId, opts);
  check((await back.files.read("/tmp/round")) === `round ${r}`, "a resumed sandbox keeps its file");
  // Refused creates take nothing: an unknown template, a body that does not validate.
  check((await postJson(node, key, "/sandboxes", { templateID: "no-such-template" })).status === 404, "an unknown template is 404");
  check((await postJson(node, key, "/sandboxes", { templateID: "base", timeout: -1 })).status === 400, "a negative timeout is 400");
  const count = r % 2 === 0 ? 2 : MIX_MAX_SANDBOXES;
  const kids = (await (await postJson(node, key, `/sandboxes/${a.sandboxId}/fork`, { count })).json()) as { sandbox?: { sandboxID: string }; error?: { code: number } }[];
  const refused = kids.filter((k) => k.error?.code === 429).length;
  check(refused === (count === 2 ? 0 : 1), `a fork of ${count} has ${count === 2 ? "no" : "one"} child refused (${JSON.stringify(kids.map((k) => k.error ?? "ok"))})`);
  for (const k of kids) if (k.sandbox) await Sandbox.kill(k.sandbox.sandboxID, opts);
  if (r % 4 === 1) {
    const snap = (await (await postJson(node, key, `/sandboxes/${a.sandboxId}/snapshots`, {})).json()) as { snapshotID: string };
    const b = await Sandbox.create(snap.snapshotID, opts);
    check((await b.files.read("/tmp/round")) === `round ${r}`, "a sandbox from a snapshot has the snapshot's file");
    await b.kill();
    check((await api(`/templates/${snap.snapshotID}`, "DELETE")).status === 204, "the snapshot deletes");
  }
  if (r % 4 === 3) {
    // The kill waits for the pause and wins.
    const [p, k] = await Promise.all([api(`/sandboxes/${a.sandboxId}/pause`, "POST"), api(`/sandboxes/${a.sandboxId}`, "DELETE")]);
    check(p.status === 204 && k.status === 204, `a kill racing a pause: both 204 (${p.status}, ${k.status})`);
  } else if (r % 5 === 2) {
    await a.setTimeout(1000);
    await until(async () => (await api(`/sandboxes/${a.sandboxId}`)).status === 404, 60_000, "the reaper kills the expired sandbox");
  } else {
    await a.kill();
  }
}
