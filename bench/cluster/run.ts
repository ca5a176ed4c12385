// The gateway's cost, each row a ratio against the same thing done straight to a node in the same
// run, the two sides alternated: etcd (1 member), two nodes (`bun run node`) and one gateway
// (`bun run gateway`) on loopback, driven by the stock e2b SDK.
// - create → first command: through the gateway vs to the node (medians; target ≥ 0.9× as a rate);
// - a by-ID call (GET /sandboxes/{id}): the latency the gateway adds (median, p99; target ≤ 1 ms median);
// - a download from envd through the gateway's relay vs through the node's proxy alone (target ≥ 0.9×);
// - etcd on Bun: a put, a quorum read and a binding transaction (median ms) over the JSON gateway.
//   npx bun bench/cluster/run.ts [--creates 8] [--requests 1000] [--download-mib 256] [--json]
import { Sandbox } from "e2b";
import { EtcdMembers } from "../../services/cluster/etcd.ts";
import { GATEWAY_ENTRY, startService } from "../../services/cluster/procs.ts";
import { EtcdClient, cmp, op } from "../../services/etcd/client.ts";
import { intFlag } from "../flags.ts";
import { scratchDir } from "../../test/helpers/tmp.ts";
import { FIRST_START_MS, nodeSetup, startNode, stopNode, until, type NodeProc } from "../../test/node/harness.ts";

const argv = process.argv.slice(2);
const CREATES = intFlag(argv, "--creates", 8);
const REQUESTS = intFlag(argv, "--requests", 1000);
const DOWNLOAD_MIB = intFlag(argv, "--download-mib", 256);
const KEY = "e2b_" + "be".repeat(20);

const pct = (xs: number[], p: number) => [...xs].sort((a, b) => a - b)[Math.min(xs.length - 1, Math.floor(xs.length * p))]!;
const median = (xs: number[]) => pct(xs, 0.5);
const r2 = (x: number) => Math.round(x * 100) / 100;
const results: Record<string, unknown> = {};

const etcd = await EtcdMembers.start({ dir: scratchDir("bench-cluster-etcd"), members: 1, host: "127.0.0.1", basePort: 24790 });
const setups = [0, 1].map((i) => nodeSetup(`bc${"ab"[i]}`, 247 + i, KEY, { AENV_CLUSTER: etcd.endpoints, AENV_NODE_ID: `b${i}`, AENV_MAX_SANDBOXES: "16" }));
const nodes: NodeProc[] = [];
let gw: Awaited<ReturnType<typeof startService>> | undefined;
try {
  for (const s of setups) nodes.push(await startNode(s.env, FIRST_START_MS));
  gw = await startService(GATEWAY_ENTRY, { ...process.env, AENV_CLUSTER: etcd.endpoints, AENV_API_KEY: KEY, HOST: "127.0.0.1", PORT: "0" });
  await until(async () => (await (await fetch(`${gw!.url}/metrics`)).text()).includes("aenv_gateway_nodes 2"), 30_000, "the gateway sees both nodes");
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
} finally {
  gw?.proc.kill(9);
  for (let i = 0; i < setups.length; i++) await stopNode(nodes[i], setups[i]!);
  await etcd.stop();
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
  console.log(`etcd over its JSON gateway on Bun: put ${e.putMs} ms, quorum read ${e.quorumReadMs} ms, binding txn ${e.bindTxnMs} ms (medians)`);
}
