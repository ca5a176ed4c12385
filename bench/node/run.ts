// The node's own costs, measured in one run against what it drives (VMM and guest time, envd
// reached directly), through the real API and proxy with the e2b SDK:
// - create (restore of the template checkpoint), pause, resume, fork per child (N = 1, 4, 16):
//   our overhead (slot, devices, records, restack, release) vs VMM time vs guest time, medians;
// - proxy: a download through the proxy vs straight from envd (throughput ratio), and the latency
//   the proxy adds to a small request (p50/p99);
// - 32 creates at once: all succeed, p50/p99;
// - host memory per running sandbox (VMM PSS) and per paused one (page cache of its checkpoint);
// - run-queue wait of the node's and blockd's main threads over the lifecycle rows (ready, off the CPU).
//   npx bun bench/node/run.ts [--download-mib N] [--concurrent N] [--only lifecycle,proxy,concurrent] [--json]
// `--only proxy`: one sandbox, the proxy rows alone (a 1 GiB download from envd directly and one
// through the proxy, three times, then 1000 small requests each way, interleaved).
import { mkdirSync, mkdtempSync, readdirSync, readFileSync, rmSync, statSync } from "node:fs";
import { join } from "node:path";
import { Sandbox } from "e2b";
import { debianKernel, envdToolsDisk, guestCmdline, sealedLayer, testRootfs } from "../../src/template/artifacts.ts";
import { createApi } from "../../src/api/app.ts";
import { SandboxProxy } from "../../src/api/proxy.ts";
import { sandboxRoutes } from "../../src/api/sandboxes.ts";
import { serveNode } from "../../src/api/server.ts";
import { BlockdClient } from "../../src/blockdev/client.ts";
import { SlotPool } from "../../src/network/index.ts";
import { Orchestrator } from "../../src/orchestrator/orchestrator.ts";
import { SandboxStore } from "../../src/orchestrator/store.ts";
import { TemplateStore } from "../../src/orchestrator/templates.ts";
import { EXTERNAL_PHASES, type OpTiming } from "../../src/orchestrator/timings.ts";
import { QemuDriver } from "../../src/vmm/qemu.ts";
import { SETTINGS } from "../../src/node/config.ts";

const argv = process.argv.slice(2);
const flag = (name: string, dflt: number) => {
  const i = argv.indexOf(name);
  return i >= 0 ? Number(argv[i + 1]) : dflt;
};
const DOWNLOAD_MIB = flag("--download-mib", 1024);
const CONCURRENT = flag("--concurrent", 32);
const ROWS = ["lifecycle", "proxy", "concurrent"];
const only = argv.includes("--only") ? (argv[argv.indexOf("--only") + 1] ?? "").split(",") : ROWS;
for (const r of only) if (!ROWS.includes(r)) throw new Error(`--only: ${r} is not one of ${ROWS.join(", ")}`);
const want = (row: string) => only.includes(row);
const KEY = "e2b_" + "ef".repeat(20);
const MEM_MIB = 256;
/** Small requests per side for the latency the proxy adds (p99 is then the 10th slowest). */
const LATENCY_REQUESTS = 1000;

const pct = (xs: number[], p: number) => [...xs].sort((a, b) => a - b)[Math.min(xs.length - 1, Math.floor(xs.length * p))]!;
const median = (xs: number[]) => pct(xs, 0.5);
const r1 = (x: number) => Math.round(x * 10) / 10;
const results: Record<string, unknown> = {};

/** Splits timings into our overhead and the VMM's / guest's share, medians in ms. */
function split(ts: OpTiming[]) {
  const ours = ts.map((t) => Object.entries(t.phases).filter(([k]) => !EXTERNAL_PHASES.has(k)).reduce((a, [, v]) => a + v, 0));
  const vmm = ts.map((t) => t.phases.vmm ?? 0);
  const guest = ts.map((t) => (t.phases.guest ?? 0) + (t.phases.init ?? 0));
  const names = [...new Set(ts.flatMap((t) => Object.keys(t.phases)))];
  const phases = Object.fromEntries(names.map((k) => [k, r1(median(ts.map((t) => t.phases[k] ?? 0)))]));
  return { n: ts.length, total: r1(median(ts.map((t) => t.totalMs))), ours: r1(median(ours)), vmm: r1(median(vmm)), guest: r1(median(guest)), phases };
}

// ---- setup ----------------------------------------------------------------------------------------
const kernel = await debianKernel();
const rootfsLayer = await sealedLayer(await testRootfs());
const toolsLayer = await sealedLayer(await envdToolsDisk());
mkdirSync("/var/tmp/aenv-bench", { recursive: true });
const work = mkdtempSync("/var/tmp/aenv-bench/node-");
const runRoot = mkdtempSync("/dev/shm/aenv-bench-node-");
const state = join(work, "blockd");
mkdirSync(state, { recursive: true });
// blockd's pool and prepared devices as `bun run node` keeps them (device_pool).
const DEVICE_POOL = Number(SETTINGS.devicePool.default);
const blockd = await BlockdClient.ensure(state, { pool: DEVICE_POOL });
const store = new SandboxStore(join(work, "node.db"));
const templates = new TemplateStore(store.db);
const pool = new SlotPool({ size: 4, prefix: "abn-", hostCidr: "10.217.0.0/24", hostTable: "aenv_bench_node" });
await pool.start();
// VMMs at the node's default niceness, as `bun run node` starts them.
const orch = new Orchestrator(store, templates, blockd, pool, new QemuDriver({ nice: Number(SETTINGS.vmmNice.default) }), {
  kernel: kernel.vmlinux, initrd: kernel.initrd, toolsLayer,
  cmdline: (s) => guestCmdline({ ip: `${s.guestIp}/${s.guestPrefixLen}`, gw: s.gatewayIp }),
}, { home: join(work, "home"), runRoot, defaultTimeoutS: 3600, maxSandboxes: CONCURRENT + 24, forkParallelism: 4, preparedDevices: DEVICE_POOL });
// The busybox image keeps boots short.
templates.insert({
  id: "benchtpl", alias: "bench", kind: "template", names: ["bench:default"], cpuCount: 1, memoryMB: MEM_MIB,
  diskSizeMB: 64, layers: [rootfsLayer], checkpoint: null, sourceSandboxId: null, envdVersion: "0.6.13", createdAt: Date.now(),
});
let proxy: SandboxProxy | undefined = new SandboxProxy(orch, { domain: "" });
const app = createApi({ apiKey: KEY, maxBodyBytes: 1 << 20, notReadyReason: () => undefined, version: "bench" })
  .use(sandboxRoutes(() => orch, { domain: null, defaultTimeoutS: 3600 }));
const server = serveNode(app, { hostname: "127.0.0.1", port: 0, proxy: () => proxy });
const base = `http://127.0.0.1:${server.port}`;
const opts = { apiKey: KEY, apiUrl: base, sandboxUrl: base, requestTimeoutMs: 600_000 };

try {
  // ---- create / pause / resume ----------------------------------------------------------------
  const first = await Sandbox.create("bench", opts); // boots the template once and checkpoints it
  await first.kill();
  const sbxs: Sandbox[] = [];
  for (let i = 0; i < (want("lifecycle") ? 5 : 1); i++) sbxs.push(await Sandbox.create("bench", opts));
  const src = sbxs[0]!;
  if (want("lifecycle")) {
    // Run-queue wait of the node's and blockd's main threads over the lifecycle rows: time each was
    // ready to run but off the CPU (schedstat's second field), which the phases above include.
    const blockdPid = Number(readFileSync(join(state, "blockd.pid"), "utf8").trim());
    const waited = (pid: number | "self") => Number(readFileSync(`/proc/${pid}/schedstat`, "utf8").split(" ")[1]) / 1e6;
    const wait0 = { node: waited("self"), blockd: waited(blockdPid), at: performance.now() };
    results.create = split(orch.timings.recent("create").slice(-5));
    for (const s of sbxs) await s.pause();
    results.pause = split(orch.timings.recent("pause"));
    await orch.settledCleanups(); // the page-cache drop runs after each pause's answer

    // Host memory a paused sandbox still holds: page cache of its checkpoint (its VMM is gone).
    const cached = (dir: string) => {
      let bytes = 0;
      for (const f of readdirSync(dir)) {
        const r = Bun.spawnSync(["fincore", "--bytes", "--noheadings", "--output", "RES", join(dir, f)], { stdout: "pipe" });
        bytes += Number(r.stdout.toString().trim() || 0);
      }
      return bytes;
    };
    const pausedHeld = sbxs.map((s) => {
      const rt = store.get(s.sandboxId)!.runtime as { paused: { dir: string } };
      return cached(rt.paused.dir);
    });
    results.pausedMemory = { medianMiB: r1(median(pausedHeld) / 2 ** 20), ofGuest: r1((median(pausedHeld) / (MEM_MIB * 2 ** 20)) * 100) + " %", target: "≤ 5 %" };
    for (const s of sbxs) await Sandbox.connect(s.sandboxId, opts);
    results.resume = split(orch.timings.recent("resume"));

    // Host memory per running sandbox: the VMM's proportional set size.
    const pss = sbxs.map((s) => {
      const pid = (store.get(s.sandboxId)!.runtime as { vmPid: number }).vmPid;
      const t = readFileSync(`/proc/${pid}/smaps_rollup`, "utf8");
      return Number(/^Pss:\s+(\d+)/m.exec(t)?.[1] ?? 0) / 1024;
    });
    results.runningMemory = { medianPssMiB: r1(median(pss)) };

    // ---- fork -------------------------------------------------------------------------------
    const forks: Record<string, unknown> = {};
    for (const n of [1, 4, 16]) {
      const before = orch.timings.recent("fork-child").length;
      const t0 = performance.now();
      const r = await fetch(`${base}/sandboxes/${src.sandboxId}/fork`, { method: "POST", headers: { "x-api-key": KEY, "content-type": "application/json" }, body: JSON.stringify({ count: n }) });
      const kids = (await r.json()) as { sandbox?: { sandboxID: string }; error?: unknown }[];
      const wall = performance.now() - t0;
      const ok = kids.filter((k) => k.sandbox).length;
      forks[`N=${n}`] = { ok, wallMs: Math.round(wall), perChildMs: Math.round(wall / n), checkpoint: split(orch.timings.recent("fork-checkpoint").slice(-1)), child: split(orch.timings.recent("fork-child").slice(before)) };
      for (const k of kids) if (k.sandbox) await orch.kill(k.sandbox.sandboxID);
    }
    results.fork = forks;
    results.runQueueWait = { overMs: Math.round(performance.now() - wait0.at), nodeMainMs: Math.round(waited("self") - wait0.node), blockdMainMs: Math.round(waited(blockdPid) - wait0.blockd) };
  }
  for (const s of sbxs.slice(1)) await s.kill();

  // ---- proxy --------------------------------------------------------------------------------
  if (want("proxy")) {
    // A sparse file: the guest reads holes without disk I/O, so the row measures envd, the slot's
    // network and the proxy, which is what differs between the two sides.
    await src.commands.run(`truncate -s ${DOWNLOAD_MIB}M /root/big`, { user: "root" });
    const rec = store.get(src.sandboxId)!;
    const direct = `http://${(rec.runtime as { slot: { nsIp: string } }).slot.nsIp}:49983`;
    const download = async (url: string, headers: Record<string, string>) => {
      const t0 = performance.now();
      const r = await fetch(`${url}/files?path=/root/big&username=root`, { headers: { ...headers, "x-access-token": rec.envdAccessToken } });
      if (!r.ok) throw new Error(`download: HTTP ${r.status} ${await r.text()}`);
      let n = 0;
      for await (const chunk of r.body!) n += chunk.byteLength;
      if (n !== DOWNLOAD_MIB * 2 ** 20) throw new Error(`download got ${n} bytes`);
      return (n / 2 ** 20) / ((performance.now() - t0) / 1000);
    };
    const viaProxy: number[] = [];
    const straight: number[] = [];
    for (let i = 0; i < 3; i++) {
      straight.push(await download(direct, {}));
      viaProxy.push(await download(base, { "e2b-sandbox-id": src.sandboxId }));
    }
    results.proxyDownload = { mib: DOWNLOAD_MIB, directMiBs: r1(median(straight)), proxyMiBs: r1(median(viaProxy)), ratio: Math.round((median(viaProxy) / median(straight)) * 100) / 100, target: "≥ 0.9×" };
    const once = async (url: string, headers: Record<string, string>) => {
      const t0 = performance.now();
      const r = await fetch(`${url}/health`, { headers });
      await r.arrayBuffer();
      return performance.now() - t0;
    };
    // Interleaved, so load on the shared cores falls on both sides alike.
    const dl: number[] = [];
    const pl: number[] = [];
    for (let i = 0; i < LATENCY_REQUESTS; i++) {
      dl.push(await once(direct, {}));
      pl.push(await once(base, { "e2b-sandbox-id": src.sandboxId }));
    }
    results.proxyLatencyAdded = {
      n: LATENCY_REQUESTS, p50Ms: r1(median(pl) - median(dl)), p99Ms: r1(pct(pl, 0.99) - pct(dl, 0.99)),
      directP50Ms: r1(median(dl)), directP99Ms: r1(pct(dl, 0.99)), proxyP50Ms: r1(median(pl)), proxyP99Ms: r1(pct(pl, 0.99)),
    };
  }
  await src.kill();

  // ---- concurrent creates -------------------------------------------------------------------
  if (want("concurrent")) {
    const t0 = performance.now();
    const settled = await Promise.allSettled(Array.from({ length: CONCURRENT }, async () => {
      const s0 = performance.now();
      const s = await Sandbox.create("bench", opts);
      return { s, ms: performance.now() - s0 };
    }));
    const okc = settled.filter((x) => x.status === "fulfilled") as PromiseFulfilledResult<{ s: Sandbox; ms: number }>[];
    results.concurrentCreates = {
      n: CONCURRENT, ok: okc.length, wallMs: Math.round(performance.now() - t0),
      p50Ms: Math.round(pct(okc.map((x) => x.value.ms), 0.5)), p99Ms: Math.round(pct(okc.map((x) => x.value.ms), 0.99)),
      errors: settled.filter((x) => x.status === "rejected").map((x) => String((x as PromiseRejectedResult).reason)).slice(0, 3),
    };
    for (const x of okc) await x.value.s.kill().catch(() => {});
  }
} finally {
  await orch.killAll();
  orch.close();
  server.stop(true);
  proxy = undefined;
  await pool.destroy().catch(() => {});
  await blockd.call("shutdown").catch(() => {});
  await Bun.sleep(500);
  rmSync(runRoot, { recursive: true, force: true });
  try { if (statSync(work)) rmSync(work, { recursive: true, force: true }); } catch {}
}

if (argv.includes("--json")) console.log(JSON.stringify(results, null, 1));
else for (const [k, v] of Object.entries(results)) console.log(`${k}: ${JSON.stringify(v)}`);
