// The cluster end to end with real processes: three etcd members (Debian's etcd-server), two
// nodes (`bun run node`, real VMs) and two gateways (`bun run gateway`), driven by the stock e2b
// SDK through a gateway, a volume the nodes share among it. Then the failures: a gateway killed,
// etcd's leader killed and its quorum lost, a node process killed and restarted, a node killed
// whole (its sandboxes listed as lost), and two gateways racing for a node's last slots.
import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { writeFileSync } from "node:fs";
import { join } from "node:path";
import { Sandbox, SandboxNotFoundError, Template, Volume } from "e2b";
import { EtcdMembers } from "../../services/cluster/etcd.ts";
import { GATEWAY_ENTRY, startService, type ServiceProc } from "../../services/cluster/procs.ts";
import { EtcdClient } from "../../src/cluster/etcd_client.ts";
import { NODES, SANDBOXES, parseBinding, parseNode } from "../../src/cluster/records.ts";
import { scratchDir } from "../helpers/tmp.ts";
import { qemuPids } from "../vmm/harness.ts";
import { FIRST_START_MS, nodeSetup, nodeSkipReason, startNode, stopNode, until, type NodeProc, type NodeSetup } from "../node/harness.ts";
import { freePortBase } from "./harness.ts";
import { registrySkipReason, registrySuite } from "../template/registry_harness.ts";

const skip = nodeSkipReason() ?? registrySkipReason() ?? (Bun.which("etcd") ? undefined : "etcd is missing (Debian's etcd-server, see .ci/deps)");
const KEY = "e2b_" + "c1".repeat(20);

describe.skipIf(!!skip)("a cluster: etcd, two nodes, two gateways, the stock e2b SDK", () => {
  if (skip) return void test.skip(skip!, () => {});
  const etcdDir = scratchDir("cluster-etcd");
  const sharedStore = scratchDir("cluster-store");
  // The cluster's templates location: a template built on one node is pushed here for the others.
  const registry = registrySuite("cluster-templates-registry");
  let etcd: EtcdMembers;
  let client: EtcdClient;
  const setups: NodeSetup[] = [];
  const nodes: (NodeProc | undefined)[] = [];
  const gateways: (ServiceProc | undefined)[] = [];
  const opts = (g = 0) => ({ apiKey: KEY, apiUrl: gateways[g]!.url, sandboxUrl: gateways[g]!.url, requestTimeoutMs: 180_000 });
  const gatewayEnv = () => ({ ...process.env, AENV_CLUSTER: etcd.endpoints, AENV_API_KEY: KEY, HOST: "127.0.0.1", PORT: "0" });
  const metric = async (g: number, name: string) => {
    const text = await (await fetch(`${gateways[g]!.url}/metrics`)).text();
    return Number(new RegExp(`^${name} (\\d+)$`, "m").exec(text)?.[1] ?? NaN);
  };
  const bindingOf = async (id: string) => {
    const kv = await client.get(`${SANDBOXES}${id}`);
    return kv ? parseBinding(kv.value) : undefined;
  };
  const startClusterNode = (i: number) => startNode(setups[i]!.env, FIRST_START_MS);

  beforeAll(async () => {
    etcd = await EtcdMembers.start({ dir: etcdDir, members: 3, host: "127.0.0.1", basePort: await freePortBase(6) });
    client = EtcdClient.parse(etcd.endpoints);
    for (const [i, octet] of [[0, 245], [1, 246]] as const) {
      // One snapshot store for both (a shared filesystem): a paused sandbox resumes on either node.
      setups[i] = nodeSetup(`cl${"ab"[i]}`, octet, KEY, {
        AENV_CLUSTER: etcd.endpoints, AENV_NODE_ID: `n${i + 1}`, AENV_MAX_SANDBOXES: "3", AENV_REAPER_INTERVAL_MS: "200",
        AENV_SNAPSHOT_STORE: sharedStore, AENV_RESUME_ANYWHERE: "1",
        AENV_CLUSTER_TEMPLATES: `${registry().reg.host}/cluster-templates`, AENV_INSECURE_REGISTRIES: registry().insecure.join(","),
      });
    }
    // One at a time: the first start may build the base template into the shared cache.
    for (let i = 0; i < 2; i++) nodes[i] = await startClusterNode(i);
    for (let g = 0; g < 2; g++) gateways[g] = await startService(GATEWAY_ENTRY, gatewayEnv());
    await until(async () => (await metric(0, "aenv_gateway_nodes")) === 2 && (await metric(1, "aenv_gateway_nodes")) === 2, 30_000, "both gateways see both nodes");
  }, 2 * FIRST_START_MS);

  afterAll(async () => {
    for (const g of gateways) g?.proc.kill(9);
    for (let i = 0; i < 2; i++) if (setups[i]) await stopNode(nodes[i], setups[i]!);
    client?.close();
    await etcd?.stop();
  }, 180_000);

  test("each node registered on a lease with its address, capacity and p2p endpoint", async () => {
    const { kvs } = await client.range(NODES, { prefix: true });
    const recs = kvs.map((kv) => parseNode(kv.value)).sort((a, b) => a.id.localeCompare(b.id));
    expect(recs.map((r) => r.id)).toEqual(["n1", "n2"]);
    for (const [i, r] of recs.entries()) {
      expect(r.apiUrl).toBe(nodes[i]!.base);
      expect(r.status).toBe("ready");
      expect(r.capacity.maxSandboxes).toBe(3);
      expect(r.cached.base).toBeGreaterThan(0);
      expect(kvs.find((kv) => kv.key === `${NODES}${r.id}`)!.lease).not.toBe("0");
    }
    // The gateway's Swagger is the node's document.
    const doc = (await (await fetch(`${gateways[0]!.url}/swagger/json`)).json()) as { paths: Record<string, unknown> };
    expect(Object.keys(doc.paths)).toEqual(expect.arrayContaining(["/v2/sandboxes", "/sandboxes/{sandboxID}/fork"]));
    expect((await fetch(`${gateways[0]!.url}/v2/sandboxes`)).status).toBe(401);
  });

  let a: Sandbox;
  let b: Sandbox;
  test("through a gateway: create, commands, files, list once each, pause, resume, fork, kill", async () => {
    a = await Sandbox.create({ ...opts(0), metadata: { suite: "cluster", n: "a" } });
    b = await Sandbox.create({ ...opts(1), metadata: { suite: "cluster", n: "b" } });
    expect((await a.commands.run("echo from-a")).stdout).toBe("from-a\n");
    await b.files.write("/tmp/x", "bee");
    expect(await b.files.read("/tmp/x")).toBe("bee");
    // Bound before the create answered, to the node that runs it.
    const ba = (await bindingOf(a.sandboxId))!;
    expect(["n1", "n2"]).toContain(ba.node);
    const listed = await Sandbox.list({ ...opts(1), query: { metadata: { suite: "cluster" } } }).nextItems();
    expect(listed.map((s) => s.sandboxId).sort()).toEqual([a.sandboxId, b.sandboxId].sort());
    // A page of one: both pages together hold each sandbox once.
    const pager = Sandbox.list({ ...opts(0), limit: 1, query: { metadata: { suite: "cluster" } } });
    const seen: string[] = [];
    while (pager.hasNext) seen.push(...(await pager.nextItems()).map((s) => s.sandboxId));
    expect(seen.sort()).toEqual([a.sandboxId, b.sandboxId].sort());

    await a.pause();
    expect((await Sandbox.getInfo(a.sandboxId, opts(1))).state).toBe("paused");
    const resumed = await Sandbox.connect(a.sandboxId, opts(1));
    expect((await resumed.commands.run("echo back")).stdout).toBe("back\n");

    const r = await fetch(`${gateways[1]!.url}/sandboxes/${b.sandboxId}/fork`, { method: "POST", headers: { "x-api-key": KEY, "content-type": "application/json" }, body: JSON.stringify({ count: 1 }) });
    expect(r.status).toBe(201);
    const [child] = (await r.json()) as { sandbox: { sandboxID: string } }[];
    const c = await Sandbox.connect(child!.sandbox.sandboxID, opts(0));
    expect(await c.files.read("/tmp/x")).toBe("bee");
    expect((await bindingOf(c.sandboxId))!.node).toBe((await bindingOf(b.sandboxId))!.node);
    await c.kill();
    // The node deletes the binding once the sandbox's row is gone.
    await until(async () => (await bindingOf(c.sandboxId)) === undefined, 10_000, "the killed child's binding is gone");
    await expect(Sandbox.getInfo(c.sandboxId, opts(0))).rejects.toBeInstanceOf(SandboxNotFoundError);
  }, 300_000);

  test("a template built through a gateway (a COPY uploaded through it) starts through the other gateway", async () => {
    const ctx = scratchDir("cluster-tpl");
    writeFileSync(join(ctx, "hello.txt"), "copied through the gateway\n");
    const name = `cl-tpl-${process.pid}`;
    const t = Template({ fileContextPath: ctx }).fromTemplate("base").copy("hello.txt", "/home/user/hello.txt").runCmd("echo built > /tmp/built");
    await Template.build(t, name, opts(0));
    const s = await Sandbox.create(name, opts(1));
    expect((await s.commands.run("cat /home/user/hello.txt /tmp/built")).stdout).toBe("copied through the gateway\nbuilt\n");
    await s.kill();
    // Pushed to the cluster's templates location and published: the other node imports it under the same ID.
    let entry: { id: string; node: string } | undefined;
    await until(async () => {
      const kv = (await client.range("/aenv/templates/", { prefix: true })).kvs.find((k) => (JSON.parse(k.value) as { alias: string }).alias === name);
      entry = kv ? (JSON.parse(kv.value) as { id: string; node: string }) : undefined;
      return entry !== undefined;
    }, 120_000, "the template is published in etcd");
    // The builder's record lists the pushed layers among those it serves (the bonus for nodes that hold them).
    const published = JSON.parse((await client.get(`/aenv/templates/${entry!.id}`))!.value) as { layers: { digest: string }[] };
    expect(published.layers.length).toBeGreaterThan(0);
    await until(async () => {
      const rec = JSON.parse((await client.get(`/aenv/nodes/${entry!.node}`))!.value) as { layers?: string[] };
      return published.layers.every((l) => rec.layers?.includes(l.digest));
    }, 15_000, "the builder's record lists the pushed layers");
    const other = entry!.node === "n1" ? 1 : 0;
    const there = await Sandbox.create(name, { ...opts(0), apiUrl: nodes[other]!.base });
    expect((await there.commands.run("cat /home/user/hello.txt /tmp/built")).stdout).toBe("copied through the gateway\nbuilt\n");
    await there.kill();
    const idOn = async (k: number) => ((await (await fetch(`${nodes[k]!.base}/templates/${name}`, { headers: { "x-api-key": KEY } })).json()) as { templateID: string }).templateID;
    expect(await idOn(other)).toBe(entry!.id);
    expect(await idOn(1 - other)).toBe(entry!.id);
  }, 600_000);

  test("a volume through the gateways: written there, mounted by a sandbox on either node, what its guest wrote read through the other gateway once it is killed", async () => {
    // The content API goes through the gateways too (the SDK's E2B_VOLUME_API_URL).
    const vopts = (g: number) => ({ ...opts(g), apiUrl: gateways[g]!.url });
    const vol = await Volume.create("cluster-vol", vopts(0));
    await vol.writeFile("/seed.txt", "from the content API", vopts(0));
    // The node the sandbox lands on claims the volume (waiting out another node's content calls) and fetches its layers.
    const sbx = await Sandbox.create("base", { ...opts(1), volumeMounts: { "/data": vol } });
    try {
      expect(await sbx.files.read("/data/seed.txt")).toBe("from the content API");
      await sbx.commands.run("echo written-in-vm > /data/vm.txt && sync");
      const holder = JSON.parse((await client.get(`/aenv/volume-holders/${vol.volumeId}`))!.value) as { node: string; sandbox: string };
      expect(holder).toMatchObject({ node: (await bindingOf(sbx.sandboxId))!.node, sandbox: sbx.sandboxId });
      // Mounted: the content API is 409 through either gateway, and so is a second sandbox on any node.
      expect(await vol.readFile("/seed.txt", vopts(1)).then(() => "read", (e: Error) => e.message)).toMatch(/409|mounted/);
      const second = await Sandbox.create("base", { ...opts(0), volumeMounts: { "/v": vol } }).then(() => "created", (e: Error) => e.message);
      expect(second).toMatch(/409|mounted by sandbox/);
    } finally {
      await Sandbox.kill(sbx.sandboxId, opts(0));
    }
    // Its kill published the guest's writes: any node reads them.
    expect(await vol.readFile("/vm.txt", vopts(1))).toBe("written-in-vm\n");
    expect((await Volume.list(vopts(1))).map((v) => v.name)).toContain("cluster-vol");
    expect(await Volume.destroy(vol.volumeId, vopts(0))).toBe(true);
  }, 300_000);

  test("kill -9 of a gateway during traffic: the other answers; a restarted one routes at once", async () => {
    const loop = (async () => {
      let ok = 0;
      for (let i = 0; i < 20; i++) {
        ok += (await a.commands.run(`echo ${i}`)).stdout === `${i}\n` ? 1 : 0;
      }
      return ok;
    })().catch(() => -1); // calls in flight on the killed gateway may fail; none may hang
    gateways[0]!.proc.kill(9);
    await gateways[0]!.proc.exited;
    // The SDK's sandbox `a` was made through gateway 0; its traffic now goes through gateway 1.
    const viaOther = await Sandbox.connect(a.sandboxId, opts(1));
    expect((await viaOther.commands.run("echo other")).stdout).toBe("other\n");
    await loop;
    gateways[0] = await startService(GATEWAY_ENTRY, gatewayEnv());
    await until(async () => (await fetch(`${gateways[0]!.url}/health`)).status === 200, 15_000, "restarted gateway healthy");
    const again = await Sandbox.connect(a.sandboxId, opts(0));
    expect((await again.commands.run("echo restarted")).stdout).toBe("restarted\n");
    a = again;
  }, 180_000);

  test("etcd: the leader killed, creates go on; quorum lost, creates answer 503 and sandboxes stay reachable; quorum back, all resumes", async () => {
    const leader = (await etcd.leader())!;
    await etcd.kill(leader);
    const t0 = performance.now();
    const s = await Sandbox.create({ ...opts(0), metadata: { suite: "cluster", n: "leaderless" } });
    console.log(`  create with etcd's leader killed: ${Math.round(performance.now() - t0)} ms`);
    expect(await bindingOf(s.sandboxId)).toBeDefined();
    await s.kill();
    etcd.restart(leader);
    await etcd.healthy(30_000);
    // Two of three down: no quorum.
    const others = [0, 1, 2].filter((i) => i !== leader).slice(0, 2);
    for (const i of others) await etcd.kill(i);
    const r = await fetch(`${gateways[0]!.url}/v2/sandboxes`, { method: "POST", headers: { "x-api-key": KEY, "content-type": "application/json" }, body: JSON.stringify({ templateID: "base" }) });
    expect(r.status).toBe(503);
    const body = (await r.json()) as { code: number; message: string };
    expect(body.code).toBe(503);
    expect(body.message).toMatch(/etcd|cluster/);
    // Running sandboxes answer through the gateway's view.
    expect((await a.commands.run("echo still")).stdout).toBe("still\n");
    for (const i of others) etcd.restart(i);
    await etcd.healthy(30_000);
    // The nodes' leases may have lapsed: they register again and take creates.
    await until(async () => {
      const x = await Sandbox.create({ ...opts(1), metadata: { suite: "cluster", n: "after" } }).catch(() => undefined);
      if (x) await x.kill();
      return x !== undefined;
    }, 60_000, "a create after quorum is back");
    expect((await bindingOf(a.sandboxId))?.node).toBeDefined();
  }, 240_000);

  test("kill -9 of a node process: its sandbox keeps running; restarted, the node takes it back and it routes again", async () => {
    const owner = (await bindingOf(a.sandboxId))!.node;
    const i = owner === "n1" ? 0 : 1;
    nodes[i]!.proc.kill(9);
    await nodes[i]!.proc.exited;
    expect(qemuPids(setups[i]!.runDir).length).toBeGreaterThan(0);
    nodes[i] = await startClusterNode(i);
    // The gateways learn its address again from its record.
    await until(async () => {
      const r = await a.commands.run("echo adopted").catch(() => undefined);
      return r?.stdout === "adopted\n";
    }, 60_000, "sandbox a answers through the gateway after its node restarted");
    expect((await bindingOf(a.sandboxId))!.node).toBe(owner);
  }, 240_000);

  test("two gateways create on a nearly full node at once: never more than its max; each create answered 201 or 429", async () => {
    // n1 and n2 hold 3 each; what runs now is `a` (and b). Fill up with creates racing through both gateways.
    const before = (await Sandbox.list({ ...opts(0), query: { state: ["running", "paused"] } }).nextItems()).length;
    const free = 6 - before;
    const tries = free + 2;
    const results = await Promise.all(Array.from({ length: tries }, (_, k) =>
      fetch(`${gateways[k % 2]!.url}/v2/sandboxes`, { method: "POST", headers: { "x-api-key": KEY, "content-type": "application/json" }, body: JSON.stringify({ templateID: "base", metadata: { suite: "cluster", n: "race" } }) })
        .then(async (r) => ({ status: r.status, body: (await r.json()) as { sandboxID?: string } }))));
    const created = results.filter((r) => r.status === 201);
    expect(results.every((r) => r.status === 201 || r.status === 429)).toBe(true);
    expect(created.length).toBe(free);
    for (const n of await Promise.all([0, 1].map(async (k) => (await (await fetch(`${nodes[k]!.base}/v2/sandboxes`, { headers: { "x-api-key": KEY } })).json()) as unknown[])))
      expect(n.length).toBeLessThanOrEqual(3);
    for (const c of created) await Sandbox.kill(c.body.sandboxID!, opts(0));
  }, 300_000);

  test("drain: no creates go to a draining node; its paused sandbox resumes on the other node on connect", async () => {
    const owner = (await bindingOf(a.sandboxId))!.node;
    const i = owner === "n1" ? 0 : 1;
    await a.files.write("/tmp/drained", "state before the drain");
    await a.pause();
    await until(async () => (await bindingOf(a.sandboxId))?.exported === true, 60_000, "the paused sandbox is in the shared store");
    const r = await fetch(`${gateways[0]!.url}/nodes/${owner}`, { method: "POST", headers: { "x-api-key": KEY, "content-type": "application/json" }, body: JSON.stringify({ status: "draining" }) });
    expect(r.status).toBe(200);
    await until(async () => ((await (await fetch(`${gateways[1]!.url}/nodes`, { headers: { "x-api-key": KEY } })).json()) as { id: string; status: string }[]).some((n) => n.id === owner && n.status === "draining"), 10_000, "the node drains");
    await until(async () => {
      const s = await Sandbox.create({ ...opts(1), metadata: { suite: "cluster", n: "while-draining" } });
      const placed = (await bindingOf(s.sandboxId))!.node;
      await s.kill();
      return placed !== owner;
    }, 30_000, "a create avoids the draining node");
    const moved = await Sandbox.connect(a.sandboxId, opts(0));
    expect((await bindingOf(a.sandboxId))!.node).not.toBe(owner);
    expect(await moved.files.read("/tmp/drained")).toBe("state before the drain");
    // The drained node gave its copy back.
    await until(async () => (await (await fetch(`${nodes[i]!.base}/sandboxes/${a.sandboxId}`, { headers: { "x-api-key": KEY } })).status) === 404, 15_000, "the draining node's copy is gone");
    expect((await fetch(`${gateways[0]!.url}/nodes/${owner}`, { method: "POST", headers: { "x-api-key": KEY, "content-type": "application/json" }, body: JSON.stringify({ status: "ready" }) })).status).toBe(200);
    a = moved;
  }, 240_000);

  test("a node killed whole (process, VMs): its lease expires, its running sandboxes are listed as lost, its paused one resumes on the other node", async () => {
    const owner = (await bindingOf(b.sandboxId))!.node;
    const i = owner === "n1" ? 0 : 1;
    // A sandbox on the same node, paused with a process and a file: both must come back elsewhere.
    // Created on that node's own API (bound as any), used through the gateway.
    const p = await Sandbox.create({ ...opts(0), apiUrl: nodes[i]!.base, metadata: { suite: "cluster", n: "paused-away" } });
    expect((await bindingOf(p.sandboxId))!.node).toBe(owner);
    await p.files.write("/tmp/kept", "kept across nodes");
    const bg = await p.commands.run("sleep 3600", { background: true, timeoutMs: 0 });
    await p.pause();
    await until(async () => (await bindingOf(p.sandboxId))?.exported === true, 60_000, "the paused sandbox is in the shared store");
    nodes[i]!.proc.kill(9);
    await nodes[i]!.proc.exited;
    for (const pid of qemuPids(setups[i]!.runDir)) try { process.kill(pid, "SIGKILL"); } catch {}
    await until(async () => (await metric(0, "aenv_gateway_nodes")) === 1, 30_000, "the node's lease expired");
    const r = await fetch(`${gateways[0]!.url}/v2/sandboxes?metadata=${encodeURIComponent("suite=cluster")}`, { headers: { "x-api-key": KEY } });
    const listed = (await r.json()) as { sandboxID: string; state: string }[];
    expect(listed.find((s) => s.sandboxID === b.sandboxId)?.state).toBe("lost");
    const info = await fetch(`${gateways[1]!.url}/sandboxes/${b.sandboxId}`, { headers: { "x-api-key": KEY } });
    expect(info.status).toBe(502);
    expect(((await info.json()) as { message: string }).message).toMatch(/lost/);
    // A kill forgets it.
    expect((await fetch(`${gateways[1]!.url}/sandboxes/${b.sandboxId}`, { method: "DELETE", headers: { "x-api-key": KEY } })).status).toBe(204);
    expect(await bindingOf(b.sandboxId)).toBeUndefined();
    // Creates go to the node that is left.
    const s = await Sandbox.create({ ...opts(0), metadata: { suite: "cluster", n: "survivor" } });
    expect((await bindingOf(s.sandboxId))!.node).not.toBe(owner);
    await s.kill();
    // The paused one is listed paused (resumable), and resumes on the node that is left: its file and its process are there.
    expect(listed.find((x) => x.sandboxID === p.sandboxId)?.state).toBe("paused");
    const back = await Sandbox.connect(p.sandboxId, opts(1));
    expect((await bindingOf(p.sandboxId))!.node).not.toBe(owner);
    expect(await back.files.read("/tmp/kept")).toBe("kept across nodes");
    expect((await back.commands.list()).some((x) => x.pid === bg.pid)).toBe(true);
    await back.kill();
    nodes[i] = undefined;
  }, 180_000);
});
