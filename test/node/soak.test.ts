// A node ends a workload holding what it held at start. `bun run node` with the stock e2b SDK runs
// SOAK_ROUNDS rounds of the lifecycle's mix (soak_mix.ts); with zero sandboxes left and the pools back to their size, every count of
// test/helpers/census.ts equals its value after start, each named in the failure, and blockd's and
// the node's anonymous memory stay within BLOCKD_MEMORY_BOUND_KIB and NODE_MEMORY_BOUND_KIB of theirs (docs/node.md, Resource
// bounds). Then an orphan: a device taken from blockd behind the node's back is reported with no
// holder and given back by the reaper, and counted in /metrics.
import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { join } from "node:path";
import { BlockdClient } from "../../src/blockdev/client.ts";
import { census, diffCounts, grownCounts, type Census, type CensusScope } from "../helpers/census.ts";
import { FIRST_START_MS, nodeSetup, nodeSkipReason, startNode, stopNode, until, type NodeProc } from "./harness.ts";
import { MIX_MAX_SANDBOXES, mixRound } from "../helpers/soak_mix.ts";

const skip = nodeSkipReason();
const KEY = "e2b_" + "50".repeat(20);
/** Rounds of the mix (the floor is 20); bench/soak runs hundreds. */
const SOAK_ROUNDS = 20;
/**
 * Anonymous memory blockd and the node may keep past their start values once the workload is over:
 * their JS heaps (blockd's main thread and its device workers', the node's) grow to a plateau the
 * collector keeps; over 100 rounds blockd stayed 43-79 MiB and the node 12-15 MiB above start
 * (docs/node.md, Resource bounds).
 */
const BLOCKD_MEMORY_BOUND_KIB = 96 * 1024;
const NODE_MEMORY_BOUND_KIB = 48 * 1024;
/** How long the node may take to give everything back once the last kill answered (the pool's surplus waits 2 s here, the orphan sweep 2 s). */
const SETTLE_MS = 90_000;

describe.skipIf(!!skip)("soak: a node ends a workload holding what it held at start", () => {
  if (skip) return void test.skip(skip!, () => {});
  const setup = nodeSetup("sk", 227, KEY, {
    AENV_MAX_SANDBOXES: String(MIX_MAX_SANDBOXES),
    AENV_REAPER_INTERVAL_MS: "200",
    // The pool's surplus retires after 2 s idle (default 30 s), so the test sees the pool back at its size.
    AENV_BLOCKD_POOL_IDLE_MS: "2000",
  });
  let node: NodeProc;
  let scope: CensusScope;
  let start: Census;
  const api = (path: string, method = "GET") => fetch(`${node.base}${path}`, { method, headers: { "x-api-key": KEY } });

  /** Census once two readings a second apart agree (the pools refilled, the cleanups after answers done). */
  async function settled(want?: Census, ms = SETTLE_MS): Promise<Census> {
    let last = await census(scope);
    const deadline = Date.now() + ms;
    while (Date.now() < deadline) {
      await Bun.sleep(1000);
      const now = await census(scope);
      if (!diffCounts(last.counts, now.counts) && (!want || !grownCounts(want.counts, now.counts))) return now;
      last = now;
    }
    return last;
  }

  beforeAll(async () => {
    node = await startNode(setup.env, FIRST_START_MS);
    scope = { home: setup.home, runDir: setup.runDir, slotPrefix: setup.env.AENV_SLOT_PREFIX, slotCidr: setup.env.AENV_SLOT_CIDR, nodePid: node.proc.pid };
    start = await settled();
    console.log(`  at start: ${JSON.stringify(start)}`);
  }, FIRST_START_MS + SETTLE_MS + 60_000);

  afterAll(() => stopNode(node, setup), 180_000);

  test(`${SOAK_ROUNDS} rounds of the mix leave every count at its start value`, async () => {
    for (let r = 0; r < SOAK_ROUNDS; r++) await mixRound(node, KEY, r);
    // Checked before anything is cleaned: no sandbox is left, running or paused.
    const left = (await (await api("/v2/sandboxes?state=running,paused")).json()) as unknown[];
    expect(left).toEqual([]);
    const end = await settled(start);
    console.log(`  after ${SOAK_ROUNDS} rounds: ${JSON.stringify(end)}`);
    const fell = diffCounts(start.counts, end.counts);
    if (fell) console.log(`  counts that moved: ${fell}`);
    expect(grownCounts(start.counts, end.counts)).toBe("");
    expect(end.memoryKiB.blockd - start.memoryKiB.blockd).toBeLessThan(BLOCKD_MEMORY_BOUND_KIB);
    expect(end.memoryKiB.node - start.memoryKiB.node).toBeLessThan(NODE_MEMORY_BOUND_KIB);
  }, SOAK_ROUNDS * 60_000 + SETTLE_MS);

  test("a device nobody holds is reported as an orphan, given back by the reaper and counted", async () => {
    const nodeId = ((await (await api("/nodes")).json()) as { id: string }[])[0]!.id;
    const bd = await BlockdClient.connect(join(setup.home, "blockd", "blockd.sock"));
    try {
      // What a leak looks like from blockd's side: a device acquired that no sandbox names.
      const template = ((await (await api("/templates/base")).json()) as { templateID: string }).templateID;
      const stray = await bd.call<{ id: string }>("acquire", { lowers: [join(setup.home, "checkpoints", `template-${template}`, "mem.layer")] });
      const held = async () => ((await (await api(`/nodes/${nodeId}`)).json()) as { devices: { id: string; holder: string }[] }).devices;
      expect((await held()).find((d) => d.id === stray.id)?.holder).toBe("orphan");
      for (const d of await held()) if (d.id !== stray.id) expect(d.holder).not.toBe("orphan");
      // The node counts a reclaim once blockd answered its release: the count is what is waited for.
      const counted = async () => (await (await fetch(`${node.base}/metrics`)).text()).includes("aenv_orphans_reclaimed_total 1\n");
      await until(counted, 60_000, "the reaper gives the orphan back and counts it");
      expect((await bd.call<{ id: string; acquired?: boolean }[]>("list")).find((d) => d.id === stray.id)?.acquired).toBeFalsy();
    } finally {
      bd.close();
    }
  }, 120_000);
});
