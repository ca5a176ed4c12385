// Density: how many idle sandboxes one host holds, and what each costs it. `bun run node` with the
// stock e2b SDK starts --count idle sandboxes from --template one after another and keeps them all
// running, then prints:
// - the create rate as the count grows (creates per second over each --step);
// - host memory per running sandbox: MemAvailable's drop over the run divided by the count (the
//   number that decides density), and where it goes: each VMM's own memory (its PSS outside guest
//   RAM: QEMU's heap, TCG's translated code), the guest pages dirtied since the restore (private
//   copies of the memory device's pages: envd's heap among them), the shared memory image's page
//   cache split over the VMs that map it, blockd's growth split over the sandboxes;
// - that every sandbox answers a command (and how long all of them took);
// - host memory per paused sandbox: MemAvailable's change when --paused of them pause.
// The goal (docs/node.md, Density): 150 running idle sandboxes at ≤ 64 MiB of host memory each.
//   npx bun bench/density/run.ts [--count 150] [--step 10] [--paused 10] [--template base] [--tcg-cache-mb N] [--json]
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { Sandbox } from "e2b";
import { intFlag } from "../flags.ts";
import { FIRST_START_MS, nodeSetup, sdkOpts, startNode, stopNode } from "../../test/node/harness.ts";
import { qemuPids } from "../../test/vmm/harness.ts";

const argv = process.argv.slice(2);
const flag = (name: string, dflt: number) => intFlag(argv, name, dflt);
const COUNT = flag("--count", 150);
const STEP = flag("--step", 10);
const PAUSED = Math.min(flag("--paused", 10), COUNT);
const TEMPLATE = argv.includes("--template") ? argv[argv.indexOf("--template") + 1]! : "base";
/** The node's qemu_tcg_cache_mb (0: QEMU's default); absent: the node's default. */
const TCG_CACHE = argv.includes("--tcg-cache-mb") ? String(Number(argv[argv.indexOf("--tcg-cache-mb") + 1])) : undefined;
/** Host memory per running idle sandbox this bench aims at (12.5 % of a 512 MiB guest). */
const GOAL_MIB = 64;
/** Settling time after the last create before memory is read (free page reporting runs every few seconds). */
const SETTLE_MS = 20_000;

const MiB = 1024 * 1024;
const meminfo = () => {
  const text = readFileSync("/proc/meminfo", "utf8");
  const kb = (k: string) => Number(new RegExp(`^${k}:\\s+(\\d+)`, "m").exec(text)?.[1] ?? NaN) * 1024;
  return { available: kb("MemAvailable"), cached: kb("Cached"), anon: kb("AnonPages") };
};

/**
 * A process's memory from smaps: PSS of the guest RAM mapping (private copies vs shared file pages),
 * of TCG's translated code (its one rwx mapping) and of everything else.
 */
function vmmMemory(pid: number, ramMarker: string): { ownPss: number; tcgCode: number; guestDirty: number; guestSharedPss: number } {
  const out = { ownPss: 0, tcgCode: 0, guestDirty: 0, guestSharedPss: 0 };
  let text: string;
  try {
    text = readFileSync(`/proc/${pid}/smaps`, "utf8");
  } catch {
    return out;
  }
  let guest = false;
  let code = false;
  for (const line of text.split("\n")) {
    if (/^[0-9a-f]+-[0-9a-f]+ /.test(line)) {
      guest = line.includes(ramMarker);
      code = / rwxp /.test(line);
      continue;
    }
    const m = /^(Pss|Anonymous):\s+(\d+) kB/.exec(line);
    if (!m) continue;
    const bytes = Number(m[2]) * 1024;
    if (!guest && m[1] === "Pss") out[code ? "tcgCode" : "ownPss"] += bytes;
    if (guest && m[1] === "Anonymous") out.guestDirty += bytes;
    // A private copy counts whole in Pss: the rest of the mapping's Pss is its share of the file's pages.
    if (guest && m[1] === "Pss") out.guestSharedPss += bytes;
    if (guest && m[1] === "Anonymous") out.guestSharedPss -= bytes;
  }
  return out;
}

function pss(pid: number): number {
  try {
    return Number(/^Pss:\s+(\d+) kB/m.exec(readFileSync(`/proc/${pid}/smaps_rollup`, "utf8"))?.[1] ?? 0) * 1024;
  } catch {
    return 0;
  }
}

const KEY = "e2b_" + "d3".repeat(20);
// A /20 of slot addresses (2048 /31s; a test node's /24 holds 128 slots).
const slotCidr = `10.233.${(process.pid % 16) * 16}.0/20`;
const setup = nodeSetup("dn", 233, KEY, { AENV_MAX_SANDBOXES: String(COUNT + 8), AENV_SLOT_POOL: "8", AENV_DEVICE_POOL: "4", AENV_SLOT_CIDR: slotCidr, ...(TCG_CACHE ? { AENV_QEMU_TCG_CACHE_MB: TCG_CACHE } : {}) });
const node = await startNode(setup.env, FIRST_START_MS);
const opts = { ...sdkOpts(node, KEY), requestTimeoutMs: 600_000 };
const blockdPid = Number(readFileSync(join(setup.home, "blockd", "blockd.pid"), "utf8"));

const rows: Record<string, unknown> = { count: COUNT, template: TEMPLATE, tcgCacheMiB: TCG_CACHE ?? "node default" };
const sandboxes: Sandbox[] = [];
try {
  // One create first: the template's checkpoint and devices exist before the baseline is read.
  await (await Sandbox.create(TEMPLATE, opts)).kill();
  await Bun.sleep(5000);
  const before = meminfo();
  const blockdBefore = pss(blockdPid);
  const rates: { upTo: number; perSecond: number }[] = [];
  let t = performance.now();
  for (let i = 0; i < COUNT; i++) {
    try {
      sandboxes.push(await Sandbox.create(TEMPLATE, { ...opts, timeoutMs: 3_600_000 }));
    } catch (e) {
      // The host is full (CPU or memory): the rows below are of the sandboxes that run.
      rows.stoppedAt = { running: sandboxes.length, why: (e as Error).message.slice(0, 300) };
      console.error(`  create ${i + 1} failed: ${(e as Error).message.slice(0, 300)}`);
      break;
    }
    if ((i + 1) % STEP === 0 || i + 1 === COUNT) {
      const n = (i % STEP) + 1;
      rates.push({ upTo: i + 1, perSecond: Number((n / ((performance.now() - t) / 1000)).toFixed(2)) });
      console.error(`  ${i + 1} running, ${rates.at(-1)!.perSecond} creates/s, MemAvailable ${((meminfo().available) / MiB / 1024).toFixed(1)} GiB`);
      t = performance.now();
    }
  }
  rows.createRate = rates;
  const t0 = performance.now();
  const running = sandboxes.length;
  const answers = await Promise.all(sandboxes.map((s) => s.commands.run("echo ok").then((r) => r.stdout === "ok\n", () => false)));
  rows.commands = { answered: answers.filter(Boolean).length, of: running, seconds: Number(((performance.now() - t0) / 1000).toFixed(1)) };
  await Bun.sleep(SETTLE_MS);
  const after = meminfo();
  const pids = qemuPids(setup.runDir);
  let own = 0;
  let tcg = 0;
  let dirty = 0;
  let shared = 0;
  for (const pid of pids) {
    const m = vmmMemory(pid, join(setup.home, "blockd", "dev"));
    own += m.ownPss;
    tcg += m.tcgCode;
    dirty += m.guestDirty;
    shared += m.guestSharedPss;
  }
  const per = (b: number) => Number((b / running / MiB).toFixed(1));
  const total = before.available - after.available;
  rows.running = {
    hostMiBEach: per(total),
    vmmOwnMiB: per(own),
    tcgCodeMiB: per(tcg),
    guestDirtiedMiB: per(dirty),
    sharedImageMiB: per(shared),
    blockdMiB: per(pss(blockdPid) - blockdBefore),
    pageCacheGrowthMiB: per(after.cached - before.cached),
    vmms: pids.length,
    goalMiB: GOAL_MIB,
    running,
    met: running === COUNT && total / running / MiB <= GOAL_MIB,
  };
  // Paused: what pausing --paused of them gives back, each.
  const pausing = sandboxes.splice(0, Math.min(PAUSED, sandboxes.length));
  const p0 = meminfo();
  for (const s of pausing) await s.pause();
  await Bun.sleep(5000);
  const p1 = meminfo();
  const n = Math.max(1, pausing.length);
  rows.paused = { count: pausing.length, freedMiBEach: Number(((p1.available - p0.available) / n / MiB).toFixed(1)), leftMiBEach: Number(((total / running - (p1.available - p0.available) / n) / MiB).toFixed(1)) };
  for (const s of pausing) await s.kill();
} finally {
  for (const s of sandboxes) await s.kill().catch(() => {});
  await stopNode(node, setup);
}

if (argv.includes("--json")) console.log(JSON.stringify(rows));
else {
  const r = rows.running as Record<string, number | boolean>;
  console.log(`density: ${r.running} of ${COUNT} idle sandboxes of '${TEMPLATE}' running at once${rows.stoppedAt ? ` (the next create failed: ${(rows.stoppedAt as { why: string }).why})` : ""}`);
  console.log(`  create rate: ${(rows.createRate as { upTo: number; perSecond: number }[]).map((x) => `${x.upTo}: ${x.perSecond}/s`).join(", ")}`);
  console.log(`  commands: ${JSON.stringify(rows.commands)}`);
  console.log(`  host memory per running sandbox: ${r.hostMiBEach} MiB (goal ≤ ${GOAL_MIB}: ${r.met ? "met" : "missed"})`);
  console.log(`    VMM's own ${r.vmmOwnMiB} | TCG's translated code ${r.tcgCodeMiB} | guest pages dirtied since restore ${r.guestDirtiedMiB} | shared memory image ${r.sharedImageMiB} | blockd ${r.blockdMiB} | page cache growth ${r.pageCacheGrowthMiB} (MiB each)`);
  console.log(`  paused: ${JSON.stringify(rows.paused)}`);
}
