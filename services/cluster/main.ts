// `bun run cluster`: a whole cluster on one machine for development and tests — etcd (1 or 3
// members), N nodes each in its own network namespace with its own address, home, ports, slot
// names and /run paths, and G gateways on loopback. It prints the endpoint and the API key and
// stays in the foreground; Ctrl-C or `bun run cluster down` stops everything (VMs and blockd
// included). State: --dir (default /var/tmp/aenv-cluster), cluster.json there says what runs.
import { existsSync, mkdirSync, readFileSync, readdirSync, rmSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { BlockdClient } from "../../src/blockdev/client.ts";
import { EtcdMembers } from "./etcd.ts";
import { run } from "../../src/network/command.ts";
import { createBridge, createNodeNetns, destroyClusterNet, inNodeNetns, nodeAddress, bridgeAddress, type ClusterNet } from "./netns.ts";
import { GATEWAY_ENTRY, NODE_ENTRY, startService, type ServiceProc } from "./procs.ts";

/** A node's start: the first builds the base template into the shared cache (minutes on 2 cores). */
const NODE_START_MS = 30 * 60_000;
const NODE_PORT = 3000;

interface Plan {
  dir: string;
  name: string;
  etcdPort: number;
  nodes: number;
  gateways: number;
  etcd: 1 | 3;
  gatewayPort: number;
  net: ClusterNet;
}

interface Running {
  plan: Plan;
  apiKey: string;
  pids: { etcd: number[]; nodes: number[]; gateways: number[]; supervisor: number };
}

function usage(): never {
  console.error(`usage: bun run cluster [up] [--nodes N (2)] [--gateways G (2)] [--etcd 1|3 (1)] [--port P (8080)] [--dir DIR]
                         [--name NAME (aenvc)] [--subnet A.B.C (10.251.0)] [--etcd-port P (23790)]
       bun run cluster down [--dir DIR]
NAME (2-5 letters) names the bridge (NAME0), the nodes' namespaces (NAME-n0…), slots (NAME0-…) and /run/NAME-n0…:
two clusters on one machine need two names, two subnets and two ports.`);
  process.exit(2);
}

function parseArgs(argv: string[]): { verb: "up" | "down"; plan: Plan } {
  let verb: "up" | "down" = "up";
  const plan: Plan = { dir: "/var/tmp/aenv-cluster", name: "aenvc", etcdPort: 23790, nodes: 2, gateways: 2, etcd: 1, gatewayPort: 8080, net: { bridge: "aenvc0", subnet: "10.251.0", prefix: "aenvc-" } };
  for (let i = 0; i < argv.length; i++) {
    const a = argv[i]!;
    const val = () => argv[++i] ?? usage();
    if (a === "up" || a === "down") verb = a;
    else if (a === "--nodes") plan.nodes = Number(val());
    else if (a === "--gateways") plan.gateways = Number(val());
    else if (a === "--etcd") plan.etcd = Number(val()) as 1 | 3;
    else if (a === "--port") plan.gatewayPort = Number(val());
    else if (a === "--dir") plan.dir = val();
    else if (a === "--name") plan.name = val();
    else if (a === "--subnet") plan.net.subnet = val();
    else if (a === "--etcd-port") plan.etcdPort = Number(val());
    else usage();
  }
  if (!/^[a-z]{2,5}$/.test(plan.name) || !/^10\.\d{1,3}\.\d{1,3}$/.test(plan.net.subnet) || !(plan.etcdPort > 1024 && plan.etcdPort < 65000)) usage();
  plan.net.bridge = `${plan.name}0`;
  plan.net.prefix = `${plan.name}-`;
  if (!(plan.nodes >= 1 && plan.nodes <= 32) || !(plan.gateways >= 1 && plan.gateways <= 8) || (plan.etcd !== 1 && plan.etcd !== 3)) usage();
  return { verb, plan };
}

const slotPrefix = (p: Plan, i: number) => `${p.name}${i}-`;
const runDir = (p: Plan, i: number) => `/run/${p.name}-n${i}`;

function nodeEnv(p: Plan, i: number, etcd: string, apiKey: string): Record<string, string | undefined> {
  return {
    ...process.env,
    AENV_HOME: join(p.dir, `node-${i}`),
    HOST: "0.0.0.0",
    PORT: String(NODE_PORT),
    AENV_API_KEY: apiKey,
    AENV_CLUSTER: etcd,
    AENV_NODE_ID: `n${i}`,
    AENV_ADVERTISE_URL: `http://${nodeAddress(p.net, i)}:${NODE_PORT}`,
    // Built once for all nodes (or given): the base template and the guest's kernel and tools disk.
    AENV_TEMPLATE_CACHE: process.env.AENV_TEMPLATE_CACHE || join(p.dir, "templates"),
    AENV_GUEST_CACHE: process.env.AENV_GUEST_CACHE || join(p.dir, "guest"),
    AENV_RUN_DIR: runDir(p, i),
    AENV_SLOT_PREFIX: slotPrefix(p, i),
    AENV_SLOT_CIDR: `10.${210 + i}.0.0/16`,
    AENV_EGRESS_UPLINKS: "none",
    // One snapshot store for every node (a shared filesystem here): a paused sandbox resumes on any node, and volumes are the cluster's.
    AENV_SNAPSHOT_STORE: join(p.dir, "snapshots"),
    AENV_RESUME_ANYWHERE: "1",
  };
}

async function up(p: Plan): Promise<void> {
  if (process.getuid?.() !== 0) throw new Error("bun run cluster needs root (network namespaces, FUSE, VMs)");
  if (existsSync(join(p.dir, "cluster.json"))) {
    const old = JSON.parse(readFileSync(join(p.dir, "cluster.json"), "utf8")) as Running;
    if (alive(old.pids.supervisor)) throw new Error(`a cluster already runs from ${p.dir} (pid ${old.pids.supervisor}): bun run cluster down --dir ${p.dir}`);
  }
  mkdirSync(p.dir, { recursive: true, mode: 0o700 });
  const keyPath = join(p.dir, "api-key");
  const apiKey = existsSync(keyPath) ? readFileSync(keyPath, "utf8").trim() : "e2b_" + Buffer.from(crypto.getRandomValues(new Uint8Array(20))).toString("hex");
  writeFileSync(keyPath, apiKey + "\n", { mode: 0o600 });

  console.log(`network: bridge ${p.net.bridge} ${bridgeAddress(p.net)}/24, ${p.nodes} node namespaces`);
  await createBridge(p.net);
  for (let i = 0; i < p.nodes; i++) await createNodeNetns(p.net, i);
  const etcd = await EtcdMembers.start({ dir: join(p.dir, "etcd"), members: p.etcd, host: bridgeAddress(p.net), basePort: p.etcdPort });
  console.log(`etcd: ${etcd.endpoints}`);
  const state: Running = { plan: p, apiKey, pids: { etcd: [], nodes: [], gateways: [], supervisor: process.pid } };
  for (let i = 0; i < p.etcd; i++) state.pids.etcd.push(etcd.pid(i)!);
  const save = () => writeFileSync(join(p.dir, "cluster.json"), JSON.stringify(state, null, 2) + "\n", { mode: 0o600 });
  save();

  const nodes: ServiceProc[] = [];
  for (let i = 0; i < p.nodes; i++) {
    // One at a time: the first builds what the others restore.
    const n = await startService(NODE_ENTRY, nodeEnv(p, i, etcd.endpoints, apiKey), { wrap: inNodeNetns(p.net, i), timeoutMs: 60_000 });
    nodes.push(n);
    state.pids.nodes.push(n.proc.pid);
    save();
    const url = `http://${nodeAddress(p.net, i)}:${NODE_PORT}`;
    const t0 = performance.now();
    for (;;) {
      const r = await fetch(`${url}/health`).catch(() => undefined);
      if (r?.status === 200) break;
      if (n.proc.exitCode !== null) throw new Error(`node n${i} exited:\n${n.log.slice(-30).join("\n")}`);
      if (performance.now() - t0 > NODE_START_MS) throw new Error(`node n${i} not ready in ${NODE_START_MS / 60_000} min`);
      await Bun.sleep(500);
    }
    console.log(`node n${i}: ${url} ready (${((performance.now() - t0) / 1000).toFixed(1)} s)`);
  }
  const gateways: ServiceProc[] = [];
  for (let g = 0; g < p.gateways; g++) {
    const gw = await startService(GATEWAY_ENTRY, { ...process.env, AENV_CLUSTER: etcd.endpoints, AENV_API_KEY: apiKey, HOST: "127.0.0.1", PORT: String(p.gatewayPort + g) });
    gateways.push(gw);
    state.pids.gateways.push(gw.proc.pid);
    save();
  }
  console.log(`
cluster up: ${p.nodes} nodes, ${p.gateways} gateways, etcd ${p.etcd === 3 ? "3 members" : "1 member"}
  endpoint: ${gateways.map((g) => g.url).join(", ")}
  API key:  ${apiKey}   (also in ${keyPath})
  e2b SDK:  E2B_API_URL=${gateways[0]!.url} E2B_SANDBOX_URL=${gateways[0]!.url} E2B_API_KEY=${apiKey}
  stop:     Ctrl-C here, or bun run cluster down${p.dir === "/var/tmp/aenv-cluster" ? "" : ` --dir ${p.dir}`}`);
  let stopping = false;
  const stop = async () => {
    if (stopping) return;
    stopping = true;
    await down(p.dir);
    process.exit(0);
  };
  process.on("SIGINT", stop);
  process.on("SIGTERM", stop);
  // A child that dies is reported (a node restart is the user's call: `kill -9` tests do it on purpose).
  for (const [i, n] of nodes.entries()) void n.proc.exited.then((c) => !stopping && console.log(`node n${i} exited (${c})`));
  for (const [g, gw] of gateways.entries()) void gw.proc.exited.then((c) => !stopping && console.log(`gateway ${g} exited (${c})`));
  await new Promise(() => {});
}

function alive(pid: number): boolean {
  try {
    process.kill(pid, 0);
    return true;
  } catch {
    return false;
  }
}

async function killAndWait(pids: number[], signal: NodeJS.Signals, ms: number): Promise<void> {
  for (const pid of pids) try { process.kill(pid, signal); } catch { /* gone */ }
  const until = Date.now() + ms;
  while (pids.some(alive) && Date.now() < until) await Bun.sleep(50);
  for (const pid of pids.filter(alive)) try { process.kill(pid, "SIGKILL"); } catch { /* gone */ }
}

/** Waits up to `ms` for `pids` to exit on their own. */
async function waitGone(pids: number[], ms: number): Promise<void> {
  const until = Date.now() + ms;
  while (pids.some(alive) && Date.now() < until) await Bun.sleep(100);
}

/** Mount points under `dir` (deepest first), from /proc/mounts. */
function mountsUnder(dir: string): string[] {
  return readFileSync("/proc/mounts", "utf8").split("\n").map((l) => l.split(" ")[1] ?? "").map((m) => m.replace(/\\040/g, " "))
    .filter((m) => m.startsWith(dir + "/")).sort((a, b) => b.length - a.length);
}

/** PIDs whose command line mentions `needle` (a node's VMMs name its run directory). */
function pidsMentioning(needle: string): number[] {
  const out: number[] = [];
  for (const name of readdirSync("/proc")) {
    if (!/^\d+$/.test(name)) continue;
    try {
      if (readFileSync(`/proc/${name}/cmdline`, "utf8").includes(needle)) out.push(Number(name));
    } catch { /* gone */ }
  }
  return out;
}

/** Stops everything a cluster started from `dir`: gateways, nodes, their VMs and blockd, etcd, the namespaces. */
async function down(dir: string): Promise<void> {
  const path = join(dir, "cluster.json");
  if (!existsSync(path)) {
    console.log(`no cluster in ${dir}`);
    return;
  }
  const s = JSON.parse(readFileSync(path, "utf8")) as Running;
  const p = s.plan;
  if (s.pids.supervisor !== process.pid && alive(s.pids.supervisor)) await killAndWait([s.pids.supervisor], "SIGTERM", 60_000);
  await killAndWait(s.pids.gateways, "SIGKILL", 1000);
  await killAndWait(s.pids.nodes, "SIGTERM", 15_000);
  for (let i = 0; i < p.nodes; i++) {
    await killAndWait(pidsMentioning(runDir(p, i)), "SIGKILL", 5000);
    try {
      const c = await BlockdClient.connect(join(p.dir, `node-${i}`, "blockd", "blockd.sock"));
      await c.call("shutdown", {}, { timeoutMs: 10_000 });
      c.close();
    } catch { /* not serving */ }
    // blockd unmounts its devices as it exits; one killed leaves its FUSE mounts, unmounted here.
    await waitGone(pidsMentioning(join(p.dir, `node-${i}`, "blockd")), 15_000);
    await killAndWait(pidsMentioning(join(p.dir, `node-${i}`, "blockd")), "SIGKILL", 5000);
    for (const mount of mountsUnder(join(p.dir, `node-${i}`))) await run([Bun.which("umount") ?? "/usr/bin/umount", "-l", mount], { alsoOk: [1, 32] }).catch(() => {});
    rmSync(runDir(p, i), { recursive: true, force: true });
  }
  await killAndWait(s.pids.etcd, "SIGKILL", 5000);
  await destroyClusterNet(p.net, p.nodes, Array.from({ length: p.nodes }, (_, i) => slotPrefix(p, i)));
  rmSync(path, { force: true });
  console.log(`cluster in ${dir} stopped (state kept: ${dir})`);
}

const { verb, plan } = parseArgs(process.argv.slice(2));
try {
  if (verb === "down") await down(plan.dir);
  else await up(plan);
} catch (e) {
  console.error(`aenv cluster: ${(e as Error).message}`);
  if (verb === "up") await down(plan.dir).catch(() => {});
  process.exit(1);
}
