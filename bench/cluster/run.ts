// The gateway's cost, each row a ratio against the same thing done straight to a node in the same
// run, the two sides alternated: etcd (1 member), two nodes (`bun run node`) and one gateway
// (`bun run gateway`) on loopback, driven by the stock e2b SDK.
// - create → first command: through the gateway vs to the node (medians; target ≥ 0.9× as a rate);
// - a by-ID call (GET /sandboxes/{id}): the latency the gateway adds (median, p99; target ≤ 1 ms median);
// - a download from envd through the gateway's relay vs through the node's proxy alone (target ≥ 0.9×);
// - etcd on Bun: a put, a quorum read and a binding transaction (median ms) over the JSON gateway;
// - cache-aware placement: creates from a snapshot that 1 of 3 nodes holds, through a gateway with
//   the cache bonus and through one without (AENV_CACHE_WEIGHT=0), alternated: p50/p99 create time
//   and how many creates were first sent to a node without it (the gateway's retries).
// - layer bytes between two nodes: a layer node 0 holds read as blockd on node 1 reads it (node 0's
//   /v1/layers, the first source of a remote layer in a cluster), and through node 1's peer facade
//   (the fallback), vs the same file over loopback TCP (a plain HTTP server on the file), the same
//   range size, alternated (target ≥ 0.8×).
//   npx bun bench/cluster/run.ts [--creates 8] [--requests 1000] [--download-mib 256] [--placement-creates 12] [--json]
import { readdirSync, rmSync, statSync } from "node:fs";
import { join } from "node:path";
import { Sandbox } from "e2b";
import { EtcdMembers } from "../../services/cluster/etcd.ts";
import { GATEWAY_ENTRY, startService } from "../../services/cluster/procs.ts";
import { EtcdClient, cmp, op } from "../../src/cluster/etcd_client.ts";
import { intFlag } from "../flags.ts";
import { scratchDir } from "../../test/helpers/tmp.ts";
import { FIRST_START_MS, nodeSetup, startNode, stopNode, until, type NodeProc } from "../../test/node/harness.ts";

const argv = process.argv.slice(2);
const CREATES = intFlag(argv, "--creates", 8);
const REQUESTS = intFlag(argv, "--requests", 1000);
const DOWNLOAD_MIB = intFlag(argv, "--download-mib", 256);
const PLACEMENT_CREATES = intFlag(argv, "--placement-creates", 12);
const KEY = "e2b_" + "be".repeat(20);

const pct = (xs: number[], p: number) => [...xs].sort((a, b) => a - b)[Math.min(xs.length - 1, Math.floor(xs.length * p))]!;
const median = (xs: number[]) => pct(xs, 0.5);
const r2 = (x: number) => Math.round(x * 100) / 100;
const results: Record<string, unknown> = {};

const etcdDir = scratchDir("bench-cluster-etcd", { keep: true });
const etcd = await EtcdMembers.start({ dir: etcdDir, members: 1, host: "127.0.0.1", basePort: 24790 });
const setups = [0, 1, 2].map((i) => nodeSetup(`bc${"abc"[i]}`, 247 + i, KEY, { AENV_CLUSTER: etcd.endpoints, AENV_NODE_ID: `b${i}`, AENV_MAX_SANDBOXES: "16" }));
const nodes: NodeProc[] = [];
let gw: Awaited<ReturnType<typeof startService>> | undefined;
let gwFlat: Awaited<ReturnType<typeof startService>> | undefined;
try {
  for (const s of setups) nodes.push(await startNode(s.env, FIRST_START_MS));
  gw = await startService(GATEWAY_ENTRY, { ...process.env, AENV_CLUSTER: etcd.endpoints, AENV_API_KEY: KEY, HOST: "127.0.0.1", PORT: "0" });
  gwFlat = await startService(GATEWAY_ENTRY, { ...process.env, AENV_CLUSTER: etcd.endpoints, AENV_API_KEY: KEY, HOST: "127.0.0.1", PORT: "0", AENV_CACHE_WEIGHT: "0" });
  for (const g of [gw, gwFlat]) await until(async () => (await (await fetch(`${g.url}/metrics`)).text()).includes("aenv_gateway_nodes 3"), 30_000, "the gateways see the three nodes");
  const via = (base: string) => ({ apiKey: KEY, apiUrl: base, sandboxUrl: base, requestTimeoutMs: 180_000 });

  // ---- etcd on Bun ---------------------------------------------------------------------------
  {
    const c = EtcdClient.parse(etcd.endpoints);
    const put: number[] = [], get: number[] = [], txn: number[] = [];
    for (let i = 0; i < 300; i++) {
      let t = performance.now();
      await c.put(`/bench/k${i}`, "v".repeat(400));
      put.push(performance.now() - t);
      t = performance.now();
      await c.get(`/bench/k${i}`);
      get.push(performance.now() - t);
      t = performance.now();
      await c.txn([cmp.absent(`/bench/b${i}`)], [op.put(`/bench/b${i}`, "x")], [op.get(`/bench/b${i}`)]);
      txn.push(performance.now() - t);
    }
    results.etcd = { putMs: r2(median(put)), quorumReadMs: r2(median(get)), bindTxnMs: r2(median(txn)) };
  }

  // ---- create → first command ------------------------------------------------------------------
  {
    const direct: number[] = [], gateway: number[] = [];
    for (let i = 0; i < CREATES; i++) {
      for (const [side, base] of (i % 2 ? [["gw", gw.url], ["node", nodes[i % 2]!.base]] : [["node", nodes[i % 2]!.base], ["gw", gw.url]]) as [string, string][]) {
        const t0 = performance.now();
        const s = await Sandbox.create(via(base));
        await s.commands.run("true");
        (side === "gw" ? gateway : direct).push(performance.now() - t0);
        await s.kill();
      }
    }
    results.createToFirstCommand = { nodeMs: Math.round(median(direct)), gatewayMs: Math.round(median(gateway)), ratio: r2(median(direct) / median(gateway)) };
  }

  // ---- by-ID latency, proxy throughput -------------------------------------------------------------
  const s = await Sandbox.create(via(nodes[0]!.base));
  try {
    const direct: number[] = [], gateway: number[] = [];
    const h = { "x-api-key": KEY };
    for (let i = 0; i < REQUESTS; i++) {
      for (const [arr, base] of (i % 2 ? [[gateway, gw.url], [direct, nodes[0]!.base]] : [[direct, nodes[0]!.base], [gateway, gw.url]]) as [number[], string][]) {
        const t0 = performance.now();
        const r = await fetch(`${base}/sandboxes/${s.sandboxId}`, { headers: h });
        await r.arrayBuffer();
        arr.push(performance.now() - t0);
      }
    }
    results.byId = { nodeP50Ms: r2(median(direct)), gatewayP50Ms: r2(median(gateway)), addedP50Ms: r2(median(gateway) - median(direct)), nodeP99Ms: r2(pct(direct, 0.99)), gatewayP99Ms: r2(pct(gateway, 0.99)) };

    await s.commands.run(`head -c ${DOWNLOAD_MIB}M /dev/zero > /tmp/big`);
    const down = async (base: string) => {
      const sb = await Sandbox.connect(s.sandboxId, via(base));
      const t0 = performance.now();
      const stream = await sb.files.read("/tmp/big", { format: "stream" });
      let n = 0;
      for await (const chunk of stream) n += chunk.byteLength;
      if (n !== DOWNLOAD_MIB * 2 ** 20) throw new Error(`read ${n} bytes`);
      return (n / 2 ** 20) / ((performance.now() - t0) / 1000);
    };
    const mbps: { node: number[]; gw: number[] } = { node: [], gw: [] };
    for (let i = 0; i < 3; i++) {
      mbps.node.push(await down(nodes[0]!.base));
      mbps.gw.push(await down(gw.url));
    }
    results.download = { nodeMiBps: Math.round(median(mbps.node)), gatewayMiBps: Math.round(median(mbps.gw)), ratio: r2(median(mbps.gw) / median(mbps.node)) };
  } finally {
    await s.kill().catch(() => {});
  }

  // ---- cache-aware placement ------------------------------------------------------------------------
  {
    const src = await Sandbox.create(via(nodes[0]!.base));
    const snap = (await (await fetch(`${nodes[0]!.base}/sandboxes/${src.sandboxId}/snapshots`, { method: "POST", headers: { "x-api-key": KEY, "content-type": "application/json" }, body: "{}" })).json()) as { snapshotID: string };
    await src.kill();
    // The holder's record lists the snapshot within a renewal (3 s).
    await Bun.sleep(4000);
    const retried = async (url: string) => Number(/aenv_gateway_creates_total\{outcome="retried"\} (\d+)/.exec(await (await fetch(`${url}/metrics`)).text())?.[1] ?? 0);
    const times: { bonus: number[]; flat: number[] } = { bonus: [], flat: [] };
    const misses = { bonus: -(await retried(gw.url)), flat: -(await retried(gwFlat.url)) };
    for (let i = 0; i < PLACEMENT_CREATES; i++) {
      for (const [side, g] of (i % 2 ? [["flat", gwFlat], ["bonus", gw]] : [["bonus", gw], ["flat", gwFlat]]) as ["bonus" | "flat", typeof gw][]) {
        const t0 = performance.now();
        const s = await Sandbox.create({ ...via(g.url), template: snap.snapshotID });
        times[side].push(performance.now() - t0);
        await s.kill();
      }
    }
    misses.bonus += await retried(gw.url);
    misses.flat += await retried(gwFlat.url);
    results.placement = {
      creates: PLACEMENT_CREATES,
      bonusP50Ms: Math.round(median(times.bonus)), bonusP99Ms: Math.round(pct(times.bonus, 0.99)), bonusMisses: misses.bonus,
      flatP50Ms: Math.round(median(times.flat)), flatP99Ms: Math.round(pct(times.flat, 0.99)), flatMisses: misses.flat,
    };
  }

  // ---- layer bytes between two nodes ------------------------------------------------------------------
  {
    // The largest verified file node 0 serves: a snapshot's layer in its store's blobs.
    const blobs = join(setups[0]!.home, "snapshots", "blobs");
    const files = readdirSync(blobs).filter((n) => /^[0-9a-f]{64}$/.test(n)).map((n) => ({ n, size: statSync(join(blobs, n)).size })).sort((a, b) => b.size - a.size);
    const layer = files[0]!;
    const RANGE = 8 << 20;
    const tcp = Bun.serve({
      hostname: "127.0.0.1", port: 0,
      fetch(req) {
        const m = /^bytes=(\d+)-(\d+)$/.exec(req.headers.get("range") ?? "")!;
        return new Response(Bun.file(join(blobs, layer.n)).slice(Number(m[1]), Number(m[2]) + 1), { status: 206 });
      },
    });
    const readAll = async (get: (start: number, end: number) => Promise<Response>) => {
      const t0 = performance.now();
      let n = 0;
      for (let off = 0; off < layer.size; off += RANGE) {
        const end = Math.min(layer.size, off + RANGE) - 1;
        const r = await get(off, end);
        if (r.status !== 206) throw new Error(`range ${off}-${end}: ${r.status} ${await r.text()}`);
        n += (await r.arrayBuffer()).byteLength;
      }
      if (n !== layer.size) throw new Error(`read ${n} of ${layer.size} bytes`);
      return layer.size / 2 ** 20 / ((performance.now() - t0) / 1000);
    };
    const facade = join(setups[1]!.runDir, "peers.sock");
    const viaCluster = (s: number, e: number) => fetch(`http://peers/layers/sha256:${layer.n}`, { unix: facade, headers: { range: `bytes=${s}-${e}` } } as RequestInit);
    const viaTcp = (s: number, e: number) => fetch(`http://127.0.0.1:${tcp.port}/`, { headers: { range: `bytes=${s}-${e}` } });
    // The holder's route alone (one hop: what a reader that asks the holder itself gets).
    const direct = (s: number, e: number) => fetch(`${nodes[0]!.base}/v1/layers/sha256:${layer.n}`, { headers: { "x-api-key": KEY, range: `bytes=${s}-${e}` } });
    await readAll(viaCluster); // the first finds the holder
    const mbps = { cluster: [] as number[], tcp: [] as number[], direct: [] as number[] };
    for (let i = 0; i < 5; i++) {
      mbps.tcp.push(await readAll(viaTcp));
      mbps.cluster.push(await readAll(viaCluster));
      mbps.direct.push(await readAll(direct));
    }
    tcp.stop(true);
    results.layerBytes = {
      layerMiB: Math.round(layer.size / 2 ** 20), tcpMiBps: Math.round(median(mbps.tcp)), clusterMiBps: Math.round(median(mbps.cluster)), ratio: r2(median(mbps.cluster) / median(mbps.tcp)),
      directMiBps: Math.round(median(mbps.direct)), directRatio: r2(median(mbps.direct) / median(mbps.tcp)),
    };
  }
} finally {
  gw?.proc.kill(9);
  gwFlat?.proc.kill(9);
  for (let i = 0; i < setups.length; i++) await stopNode(nodes[i], setups[i]!);
  await etcd.stop();
  rmSync(etcdDir, { recursive: true, force: true });
}

if (argv.includes("--json")) console.log(JSON.stringify(results));
else {
  const e = results.etcd as Record<string, number>;
  const c = results.createToFirstCommand as Record<string, number>;
  const b = results.byId as Record<string, number>;
  const d = results.download as Record<string, number>;
  console.log(`row | straight to a node | through the gateway | ratio or added | target`);
  console.log(`create → first command (median) | ${c.nodeMs} ms | ${c.gatewayMs} ms | ${c.ratio}× | ≥ 0.9×`);
  console.log(`GET /sandboxes/{id} p50 (p99) | ${b.nodeP50Ms} (${b.nodeP99Ms}) ms | ${b.gatewayP50Ms} (${b.gatewayP99Ms}) ms | +${b.addedP50Ms} ms | ≤ 1 ms`);
  console.log(`download ${DOWNLOAD_MIB} MiB from envd | ${d.nodeMiBps} MiB/s | ${d.gatewayMiBps} MiB/s | ${d.ratio}× | ≥ 0.9×`);
  const pl = results.placement as Record<string, number>;
  console.log(`creates from a snapshot on 1 of 3 nodes (${pl.creates} each) | without the cache bonus: p50 ${pl.flatP50Ms} ms, p99 ${pl.flatP99Ms} ms, ${pl.flatMisses} first sent to a node without it | with it: p50 ${pl.bonusP50Ms} ms, p99 ${pl.bonusP99Ms} ms, ${pl.bonusMisses} | fewer misses`);
  const lb = results.layerBytes as Record<string, number>;
  console.log(`a ${lb.layerMiB} MiB layer from another node, 8 MiB ranges | loopback TCP ${lb.tcpMiBps} MiB/s | as blockd reads it (the holder's /v1/layers, one hop) ${lb.directMiBps} MiB/s | ${lb.directRatio}× | ≥ 0.8×`);
  console.log(`  through the node's peer facade (holders not yet known to the view) | ${lb.clusterMiBps} MiB/s | ${lb.ratio}×`);
  console.log(`etcd over its JSON gateway on Bun: put ${e.putMs} ms, quorum read ${e.quorumReadMs} ms, binding txn ${e.bindTxnMs} ms (medians)`);
}
