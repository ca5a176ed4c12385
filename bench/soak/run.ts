// The soak test's mix (test/helpers/soak_mix.ts) for many rounds against `bun run node`, printing
// every count of test/helpers/census.ts and blockd's and the node's anonymous memory every
// --every rounds, each after the node settled, so growth shows as a table: flat rows are the target.
//   npx bun bench/soak/run.ts [--rounds 500] [--every 50] [--json]
import { intFlag } from "../flags.ts";
import { census, diffCounts, type Census, type CensusScope } from "../../test/helpers/census.ts";
import { FIRST_START_MS, nodeSetup, startNode, stopNode } from "../../test/node/harness.ts";
import { MIX_MAX_SANDBOXES, mixRound } from "../../test/helpers/soak_mix.ts";

const argv = process.argv.slice(2);
const flag = (name: string, dflt: number) => intFlag(argv, name, dflt);
const ROUNDS = flag("--rounds", 500);
const EVERY = flag("--every", 50);
/** How long a row waits for the counts of the start (else two equal readings a second apart): the pool's surplus retires after 2 s idle here. */
const SETTLE_MS = 60_000;

const KEY = "e2b_" + "5b".repeat(20);
const setup = nodeSetup("bs", 229, KEY, { AENV_MAX_SANDBOXES: String(MIX_MAX_SANDBOXES), AENV_REAPER_INTERVAL_MS: "200", AENV_BLOCKD_POOL_IDLE_MS: "2000" });
const node = await startNode(setup.env, FIRST_START_MS);
const scope: CensusScope = { home: setup.home, runDir: setup.runDir, slotPrefix: setup.env.AENV_SLOT_PREFIX, slotCidr: setup.env.AENV_SLOT_CIDR, nodePid: node.proc.pid };

async function settled(want?: Census): Promise<Census> {
  let last = await census(scope);
  for (const end = Date.now() + SETTLE_MS; Date.now() < end; ) {
    await Bun.sleep(1000);
    const now = await census(scope);
    if (!diffCounts(last.counts, now.counts) && (!want || !diffCounts(want.counts, now.counts))) return now;
    last = now;
  }
  return last;
}

const rows: { round: number; seconds: number; census: Census }[] = [];
const t0 = performance.now();
try {
  rows.push({ round: 0, seconds: 0, census: await settled() });
  for (let r = 0; r < ROUNDS; r++) {
    await mixRound(node, KEY, r);
    if ((r + 1) % EVERY === 0 || r + 1 === ROUNDS) rows.push({ round: r + 1, seconds: Math.round((performance.now() - t0) / 1000), census: await settled(rows[0]!.census) });
    if ((r + 1) % EVERY === 0) console.error(`  ${r + 1} rounds, ${Math.round((performance.now() - t0) / 1000)} s`);
  }
} finally {
  await stopNode(node, setup);
}

if (argv.includes("--json")) console.log(JSON.stringify(rows));
else {
  const names = Object.keys(rows[0]!.census.counts);
  const cols = ["round", "s", ...names.map((n) => n.replace(/^blockd /, "bd ")), "blockd anon MiB", "node anon MiB"];
  console.log(cols.join(" | "));
  for (const row of rows)
    console.log([row.round, row.seconds, ...names.map((n) => row.census.counts[n]), (row.census.memoryKiB.blockd / 1024).toFixed(1), (row.census.memoryKiB.node / 1024).toFixed(1)].join(" | "));
  const grew = diffCounts(rows[0]!.census.counts, rows.at(-1)!.census.counts);
  console.log(grew ? `not flat: ${grew}` : `flat: every count after ${ROUNDS} rounds equals its start value`);
}
