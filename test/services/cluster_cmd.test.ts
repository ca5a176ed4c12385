// `bun run cluster` as a user runs it: etcd, two nodes each in its own network namespace, one
// gateway; the stock e2b SDK through the gateway; a node cut off (its namespace's link down) and
// back; then `bun run cluster down` leaves nothing of it running: no VMM, no blockd, no etcd, no
// namespace, no bridge.
import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { existsSync, readFileSync } from "node:fs";
import { join } from "node:path";
import { Sandbox } from "e2b";
import { setNodeLink } from "../../services/cluster/netns.ts";
import { EtcdClient } from "../../src/cluster/etcd_client.ts";
import { SANDBOXES, parseBinding } from "../../src/cluster/records.ts";
import { guestCache } from "../../src/template/artifacts.ts";
import { scratchDir } from "../helpers/tmp.ts";
import { FIRST_START_MS, TEMPLATE_CACHE, nodeSkipReason, until } from "../node/harness.ts";
import { freePortBase } from "./harness.ts";

const skip = nodeSkipReason() ?? (Bun.which("etcd") ? undefined : "etcd is missing (Debian's etcd-server, see .ci/deps)") ?? (Bun.which("nsenter") ? undefined : "nsenter is missing (util-linux)");
const ROOT = join(import.meta.dir, "../..");
const NAME = "aect";
const SUBNET = "10.252.7";
const net = { bridge: `${NAME}0`, subnet: SUBNET, prefix: `${NAME}-` };

async function sh(argv: string[]): Promise<string> {
  const p = Bun.spawn(argv, { stdout: "pipe", stderr: "pipe" });
  const out = await new Response(p.stdout).text();
  await p.exited;
  return out;
}

describe.skipIf(!!skip)("bun run cluster: namespaces, a cut-off node, down", () => {
  if (skip) return void test.skip(skip!, () => {});
  const dir = scratchDir("cluster-cmd");
  let up: ReturnType<typeof Bun.spawn>;
  const log: string[] = [];
  let endpoint = "";
  let key = "";
  let etcdPort = 0;
  let gwPort = 0;
  const opts = () => ({ apiKey: key, apiUrl: endpoint, sandboxUrl: endpoint, requestTimeoutMs: 180_000 });

  beforeAll(async () => {
    etcdPort = await freePortBase(2);
    gwPort = await freePortBase(1);
    up = Bun.spawn([process.execPath, "services/cluster/main.ts", "--nodes", "2", "--gateways", "1", "--dir", dir, "--name", NAME, "--subnet", SUBNET, "--etcd-port", String(etcdPort), "--port", String(gwPort)], {
      cwd: ROOT, env: { ...process.env, AENV_TEMPLATE_CACHE: TEMPLATE_CACHE, AENV_GUEST_CACHE: guestCache() }, stdout: "pipe", stderr: "pipe",
    });
    const pump = async (s: ReadableStream<Uint8Array>) => {
      const dec = new TextDecoder();
      for await (const c of s) for (const line of dec.decode(c, { stream: true }).split("\n")) if (line) {
        log.push(line);
        const e = /endpoint: (http:\/\/[^\s,]+)/.exec(line);
        if (e) endpoint = e[1]!;
        const k = /API key:\s+(\S+)/.exec(line);
        if (k) key = k[1]!;
      }
    };
    void pump(up.stdout as ReadableStream<Uint8Array>);
    void pump(up.stderr as ReadableStream<Uint8Array>);
    await until(() => {
      if (up.exitCode !== null) throw new Error(`bun run cluster exited:\n${log.slice(-40).join("\n")}`);
      return endpoint !== "" && key !== "";
    }, 2 * FIRST_START_MS, "bun run cluster prints its endpoint and key");
    await until(async () => (await (await fetch(`${endpoint}/metrics`)).text()).includes("aenv_gateway_nodes 2"), 30_000, "the gateway sees both nodes");
  }, 2 * FIRST_START_MS + 60_000);

  afterAll(async () => {
    if (up && up.exitCode === null) {
      await sh([process.execPath, join(ROOT, "services/cluster/main.ts"), "down", "--dir", dir]);
    }
  }, 120_000);

  test("each node runs in its own namespace at its own address; the SDK works through the gateway", async () => {
    const ns = await sh(["ip", "netns", "list"]);
    expect(ns).toContain(`${NAME}-n0`);
    expect(ns).toContain(`${NAME}-n1`);
    const state = JSON.parse(readFileSync(join(dir, "cluster.json"), "utf8")) as { pids: { nodes: number[] } };
    // A node's network namespace is not the host's; its mount namespace is.
    for (const pid of state.pids.nodes) {
      expect(await sh(["readlink", `/proc/${pid}/ns/net`])).not.toBe(await sh(["readlink", "/proc/self/ns/net"]));
      expect(await sh(["readlink", `/proc/${pid}/ns/mnt`])).toBe(await sh(["readlink", "/proc/self/ns/mnt"]));
    }
    const s = await Sandbox.create(opts());
    expect((await s.commands.run("echo in-cluster")).stdout).toBe("in-cluster\n");
    await s.kill();
  }, 300_000);

  test("a node cut off: its lease expires, its sandbox is listed lost and nothing is placed twice; back: it re-binds and the sandbox runs", async () => {
    const client = EtcdClient.parse(`http://${SUBNET}.1:${etcdPort}`);
    const s = await Sandbox.create(opts());
    const b = parseBinding((await client.get(`${SANDBOXES}${s.sandboxId}`))!.value);
    const i = Number(b.node.slice(1));
    await setNodeLink(net, i, false);
    try {
      await until(async () => (await (await fetch(`${endpoint}/metrics`)).text()).includes("aenv_gateway_nodes 1"), 30_000, "the cut-off node's lease expired");
      const listed = (await (await fetch(`${endpoint}/v2/sandboxes`, { headers: { "x-api-key": key } })).json()) as { sandboxID: string; state: string }[];
      expect(listed.filter((x) => x.sandboxID === s.sandboxId).map((x) => x.state)).toEqual(["lost"]);
      // A create now goes to the other node.
      const other = await Sandbox.create(opts());
      expect(parseBinding((await client.get(`${SANDBOXES}${other.sandboxId}`))!.value).node).not.toBe(b.node);
      await other.kill();
    } finally {
      await setNodeLink(net, i, true);
    }
    await until(async () => (await (await fetch(`${endpoint}/metrics`)).text()).includes("aenv_gateway_nodes 2"), 60_000, "the node registered again");
    const back = parseBinding((await client.get(`${SANDBOXES}${s.sandboxId}`))!.value);
    expect(back.node).toBe(b.node);
    const again = await Sandbox.connect(s.sandboxId, opts());
    expect((await again.commands.run("echo rejoined")).stdout).toBe("rejoined\n");
    const listed = (await (await fetch(`${endpoint}/v2/sandboxes`, { headers: { "x-api-key": key } })).json()) as { sandboxID: string; state: string }[];
    expect(listed.filter((x) => x.sandboxID === s.sandboxId).map((x) => x.state)).toEqual(["running"]);
    await again.kill();
    client.close();
  }, 240_000);

  test("bun run cluster down: every process, namespace and the bridge are gone", async () => {
    const state = JSON.parse(readFileSync(join(dir, "cluster.json"), "utf8")) as { pids: { etcd: number[]; nodes: number[]; gateways: number[] } };
    const out = await sh([process.execPath, join(ROOT, "services/cluster/main.ts"), "down", "--dir", dir]);
    expect(out).toContain("stopped");
    await up.exited;
    for (const pid of [...state.pids.etcd, ...state.pids.nodes, ...state.pids.gateways]) expect(existsSync(`/proc/${pid}`)).toBe(false);
    const procs = await sh(["ps", "-eo", "args"]);
    expect(procs).not.toContain(`/run/${NAME}-n`);
    expect(procs).not.toContain(join(dir, "node-0", "blockd"));
    const ns = await sh(["ip", "netns", "list"]);
    expect(ns).not.toContain(`${NAME}-`);
    expect(ns).not.toContain(`${NAME}0-`);
    expect(await sh(["ip", "link", "show", `${NAME}0`])).toBe("");
    expect(existsSync(join(dir, "cluster.json"))).toBe(false);
    // No device of a node's blockd is left mounted.
    expect(readFileSync("/proc/mounts", "utf8")).not.toContain(dir);
  }, 120_000);
});
