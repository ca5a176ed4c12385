// Sandbox egress: what the domain proxy and the host table's per-slot rules cost.
//   npx bun bench/network/run.ts [--conns 200] [--mib 64] [--runs 5] [--rounds 5] [--slots 1000]
// A fake guest behind a real slot (test/network/harness.ts) talks to the test "internet"
// (test/network/internet.ts: a namespace of this run on a veth of this run) with client.ts.
// Rows, each against the same server in the same run:
//   1. HTTP and HTTPS, direct (allowed by a CIDR: forwarded by the kernel) against through the
//      domain proxy (allowed by name: redirected, sniffed, the name resolved and checked, bytes
//      passed on), and HTTPS terminated by a header rule (TLS both ways, requests rewritten):
//      latency of a new connection (connect to last byte of GET /, p50 and p90) and throughput of
//      one download (--mib MiB, median of --runs); the paths take turns for --rounds rounds and
//      each figure is the median of the rounds' (the machine is shared: turns spread its noise);
//   2. Egress.apply replacing a policy of 1, 1,000 CIDRs and 1,000 domains (median of --runs);
//   3. the direct rows again with --slots other slots' sets, chains and map entries loaded.
// Needs root (namespaces, nftables).
import { join } from "node:path";
import { DEFAULT_ALWAYS_DENIED, Egress, EgressCa, EgressProxy, SlotPool, netnsExecArgv, parseEgressPolicy, type Slot } from "../../src/network/index.ts";
import { run } from "../../src/network/command.ts";
import { canRun, startFakeGuest, sweep, testPoolOptions } from "../../test/network/harness.ts";
import { startInternet } from "../../test/network/internet.ts";

const arg = (name: string, dflt: number) => {
  const i = process.argv.indexOf(`--${name}`);
  return i > 0 ? Number(process.argv[i + 1]) : dflt;
};
const CONNS = arg("conns", 200);
const MIB = arg("mib", 64);
const RUNS = arg("runs", 5);
const SLOTS = arg("slots", 1000);
const ROUNDS = arg("rounds", 5);

if (!canRun) {
  console.log("bench/network: needs root, /dev/net/tun, ip, nft, sysctl and conntrack; skipped");
  process.exit(0);
}

const median = (xs: number[]) => xs.sort((a, b) => a - b)[Math.floor(xs.length / 2)]!;
const net = await startInternet();
const pool = new SlotPool(testPoolOptions({ size: 0 }));
const ca = EgressCa.generate();
const proxy = new EgressProxy({ resolvers: [net.ips[0]!], ca, upstreamCa: [net.certPem] }).listen();
let guestProc: Bun.Subprocess | undefined;
try {
  await pool.start();
  const egress = new Egress(pool.config, { alwaysDenied: DEFAULT_ALWAYS_DENIED, resolvers: [net.ips[0]!], uplinks: [net.uplink], proxyPort: proxy.port });
  proxy.use(egress);
  await egress.start();
  const slot = await pool.acquire();
  const guest = await startFakeGuest(slot, "bench");
  guestProc = guest.proc;
  const a = net.ips[0]!;

  const client = async (o: { port: number; tls: boolean; n: number; bytes: number }) => {
    const p = Bun.spawn(netnsExecArgv({ netns: guest.netns }, [process.execPath, join(import.meta.dir, "client.ts"), JSON.stringify({ ip: a, host: "a.test", ...o })]),
      { stdout: "pipe", stderr: "pipe" });
    const [out, err, code] = await Promise.all([new Response(p.stdout).text(), new Response(p.stderr).text(), p.exited]);
    if (code !== 0) throw new Error(`client ${JSON.stringify(o)} exited ${code}: ${err}`);
    return JSON.parse(out) as { p50?: number; p90?: number; mbps?: number };
  };
  const measure = async (label: string) => {
    const row: Record<string, string> = { path: label };
    for (const [proto, port, tls] of [["HTTP", 80, false], ["HTTPS", 443, true]] as const) {
      const lat = await client({ port, tls, n: CONNS, bytes: 0 });
      const thr = await client({ port, tls, n: RUNS, bytes: MIB << 20 });
      row[`${proto} p50 ms`] = lat.p50!.toFixed(2);
      row[`${proto} p90 ms`] = lat.p90!.toFixed(2);
      row[`${proto} MB/s`] = thr.mbps!.toFixed(0);
    }
    return row;
  };

  // 1. Direct against the domain proxy.
  const direct = parseEgressPolicy(false, { allowOut: [`${a}/32`] });
  const byName = parseEgressPolicy(false, { allowOut: ["a.test"] });
  const terminated = parseEgressPolicy(false, { allowOut: ["a.test"], rules: { "a.test": [{ transform: { headers: { "X-Extra": "v" } }, tls: "terminate" }] } });
  /** Each path measured once per round, in turns; the median of each figure over the rounds. */
  const turns = async (paths: [string, () => Promise<void>][]) => {
    const got: Record<string, string>[][] = paths.map(() => []);
    for (let r = 0; r < ROUNDS; r++) {
      for (const [i, [label, prepare]] of paths.entries()) {
        await prepare();
        got[i]!.push(await measure(label));
      }
    }
    return got.map((rs) => Object.fromEntries(Object.keys(rs[0]!).map((k) => [k, k === "path" ? rs[0]![k]! : median(rs.map((r) => Number(r[k]))).toFixed(k.includes("MB/s") ? 0 : 2)])));
  };
  const rows = await turns([
    ["direct (CIDR)", () => egress.apply(slot, "bench", direct)],
    ["domain proxy", () => egress.apply(slot, "bench", byName)],
    ["header rule, TLS terminated", () => egress.apply(slot, "bench", terminated)],
  ]);
  const ratio = (k: string, up: boolean) => {
    const d = Number(rows[0]![k]);
    return rows.slice(1).map((r) => (up ? Number(r[k]) / d : d / Number(r[k])).toFixed(2)).join(" / ");
  };
  console.log(`\nproxy vs direct, ${CONNS} connections for latency, ${RUNS} × ${MIB} MiB for throughput, median of ${ROUNDS} rounds`);
  console.table(rows);
  console.log(`throughput ratio to direct (proxy / terminated): HTTP ${ratio("HTTP MB/s", true)}, HTTPS ${ratio("HTTPS MB/s", true)} (target ≥ 0.8)`);
  console.log(`added p50 latency per connection (proxy / terminated): HTTP ${rows.slice(1).map((r) => (Number(r["HTTP p50 ms"]) - Number(rows[0]!["HTTP p50 ms"])).toFixed(2)).join(" / ")} ms, ` +
    `HTTPS ${rows.slice(1).map((r) => (Number(r["HTTPS p50 ms"]) - Number(rows[0]!["HTTPS p50 ms"])).toFixed(2)).join(" / ")} ms`);

  // 2. Policy updates.
  const cidrs = (n: number, third: number) => Array.from({ length: n }, (_, i) => `203.${third}.${i >> 8}.${i & 255}`);
  const update: Record<string, string>[] = [];
  for (const [label, policy] of [
    ["1 CIDR", parseEgressPolicy(true, { allowOut: ["203.0.113.1"] })],
    ["1,000 CIDRs (500 allow, 500 deny)", parseEgressPolicy(true, { allowOut: cidrs(500, 0), denyOut: cidrs(500, 1) })],
    ["1,000 domains", parseEgressPolicy(true, { allowOut: Array.from({ length: 1000 }, (_, i) => `h${i}.example.com`) })],
  ] as const) {
    const ms: number[] = [];
    for (let i = 0; i < RUNS; i++) {
      await egress.apply(slot, "bench", direct);
      const t0 = performance.now();
      await egress.apply(slot, "bench", policy);
      ms.push(performance.now() - t0);
    }
    update.push({ policy: label, "apply ms (median)": median(ms).toFixed(1) });
  }
  console.log("\nEgress.apply replacing the policy in force (one nft transaction, conntrack cut included)");
  console.table(update);

  // 3. The direct path with many slots' state in the host table, loaded and removed in turns.
  await egress.apply(slot, "bench", direct);
  const tx = egress as unknown as { slotTransaction(s: Slot, p: unknown, prev: unknown): string };
  const fakes: Slot[] = [];
  let loadMs = 0;
  /** SLOTS other slots' policies (10 CIDRs each, a domain rule on every fourth), 100 per nft transaction. */
  const load = async () => {
    const t0 = performance.now();
    const batch: string[] = [];
    for (let i = 0; i < SLOTS; i++) {
      // A slot number and interface name no real slot has: the map entry matches no packet of ours.
      const fake = { ...slot, id: 5000 + i, hostVeth: `${pool.config.prefix}x${i}` } as Slot;
      fakes.push(fake);
      const p = parseEgressPolicy(i % 2 === 0, { allowOut: [...cidrs(5, 2 + (i % 50)), ...(i % 4 === 0 ? ["a.example.com"] : [])], denyOut: cidrs(5, 60 + (i % 50)) });
      batch.push(tx.slotTransaction(fake, p, undefined));
      if (batch.length === 100 || i === SLOTS - 1) {
        await run(["nft", "-f", "-"], { stdin: batch.join("") });
        batch.length = 0;
      }
    }
    loadMs = performance.now() - t0;
  };
  const unload = async () => {
    if (!fakes.length) return;
    const t = `inet ${pool.config.hostTable}`;
    const lines = fakes.splice(0).flatMap((f) => [
      `delete element ${t} egress_slots { "${f.hostVeth}" }`, `delete chain ${t} s${f.id}`, `delete set ${t} s${f.id}_allow`,
      `delete set ${t} s${f.id}_deny`, `delete counter ${t} s${f.id}_refused`,
      ...(f.id % 4 === 0 ? [`delete element ${t} redirect_slots { "${f.hostVeth}" }`, `delete chain ${t} r${f.id}`] : []),
    ]);
    await run(["nft", "-f", "-"], { stdin: lines.join("\n") + "\n" });
  };
  const [alone, many] = await turns([["1 slot", unload], [`${SLOTS + 1} slots`, load]]);
  await unload();
  console.log(`\nthe direct path with ${SLOTS} other slots' sets, chains and map entries loaded (${loadMs.toFixed(0)} ms to load)`);
  console.table([alone!, many!]);
  console.log(`ratio (many / one): HTTP MB/s ${(Number(many!["HTTP MB/s"]) / Number(alone!["HTTP MB/s"])).toFixed(2)}, HTTPS MB/s ${(Number(many!["HTTPS MB/s"]) / Number(alone!["HTTPS MB/s"])).toFixed(2)}, ` +
    `HTTP p50 ${(Number(many!["HTTP p50 ms"]) / Number(alone!["HTTP p50 ms"])).toFixed(2)}×`);
} finally {
  guestProc?.kill(9);
  await guestProc?.exited;
  proxy.stop();
  await pool.destroy().catch(() => {});
  await net.stop();
  sweep();
}
