// A node's membership (src/node/cluster.ts) against a real etcd, with the node's store reduced to
// a list of records: registering on a lease, bindings fenced by it, a restart taking the lease
// back, etcd lost and back (no new sandboxes meanwhile, every sandbox re-bound after).
import { beforeAll, describe, expect, test } from "bun:test";
import { join } from "node:path";
import { ApiError } from "../../src/api/errors.ts";
import { ClusterMember } from "../../src/node/cluster.ts";
import type { SandboxRecord } from "../../src/orchestrator/store.ts";
import type { EtcdMembers } from "../../services/cluster/etcd.ts";
import { EtcdClient } from "../../src/cluster/etcd_client.ts";
import { nodeKey, parseBinding, parseNode, sandboxKey } from "../../src/cluster/records.ts";
import { scratchDir } from "../helpers/tmp.ts";
import { etcdSkipReason, etcdSuite } from "../services/harness.ts";

const skip = etcdSkipReason();

const rec = (id: string, state: SandboxRecord["state"] = "running"): SandboxRecord => ({
  id, state, templateId: "base", alias: "base", metadata: { k: id }, envVars: {}, startedAt: Date.now(), endAt: Date.now() + 60_000,
  cpuCount: 2, memoryMB: 512, diskSizeMB: 1024, envdVersion: "0.6.13", envdAccessToken: "t", trafficAccessToken: null,
  autoPause: false, autoResume: false, allowInternetAccess: null, network: null, runtime: null,
});

describe.skipIf(skip !== undefined)("a node's cluster membership", () => {
  const suite = etcdSuite("member-etcd");
  let etcd: EtcdMembers;
  let client: EtcdClient;
  const home = scratchDir("member");
  const held: SandboxRecord[] = [];
  const member = (id = "m1", etcdClient = EtcdClient.parse(etcd.endpoints, 1500)) => new ClusterMember({
    etcd: etcdClient, nodeId: id, apiUrl: "http://127.0.0.1:3999", version: "t", home, leaseFile: join(home, `lease-${id}`),
    maxSandboxes: 8, sandboxes: () => held, running: () => held.length, cached: () => ({ base: 123 }),
  });

  beforeAll(() => {
    etcd = suite.etcd();
    client = suite.client();
  });

  test("registers on a lease, binds before answering, refuses a second process with its ID, unbinds", async () => {
    const m = member();
    await m.start();
    expect(m.registered).toBe(true);
    const kv = (await client.get(nodeKey("m1")))!;
    expect(kv.lease).not.toBe("0");
    const n = parseNode(kv.value);
    expect(n).toMatchObject({ id: "m1", apiUrl: "http://127.0.0.1:3999", status: "ready", cached: { base: 123 } });
    const a = rec("sa");
    held.push(a);
    await m.bind(a);
    expect(parseBinding((await client.get(sandboxKey("sa")))!.value)).toMatchObject({ node: "m1", lease: kv.lease, metadata: { k: "sa" } });
    await m.bind(a); // a retry of its own write
    // Another node cannot bind what m1 holds.
    const other = member("m2");
    await other.start();
    await expect(other.bind(a)).rejects.toMatchObject({ status: 409 });
    await other.close({ leave: true });
    // A second process with m1's ID (another home) is not registered while m1's lease lives.
    const twin = new ClusterMember({
      etcd: EtcdClient.parse(etcd.endpoints), nodeId: "m1", apiUrl: "http://127.0.0.1:4000", version: "t", home, leaseFile: join(home, "twin-lease"),
      maxSandboxes: 8, sandboxes: () => [], running: () => 0, cached: () => ({}),
    });
    await twin.start().catch(() => {});
    expect(twin.registered).toBe(false);
    expect(() => twin.admit()).toThrow(ApiError);
    await twin.close();
    m.unbind("sa");
    held.length = 0;
    const t0 = performance.now();
    while (await client.get(sandboxKey("sa"))) {
      expect(performance.now() - t0).toBeLessThan(5000);
      await Bun.sleep(50);
    }
    await m.close();
  });

  test("a restart takes its live lease back: the record never leaves", async () => {
    const m = member();
    await m.start();
    const lease = (await client.get(nodeKey("m1")))!.lease;
    await m.close(); // keeps the lease
    const again = member();
    await again.start();
    expect((await client.get(nodeKey("m1")))!.lease).toBe(lease);
    await again.close({ leave: true });
    expect(await client.get(nodeKey("m1"))).toBeUndefined();
  });

  test("draining: the record says so and creates are refused", async () => {
    const m = member("m3");
    await m.start();
    await m.setStatus("draining");
    expect(parseNode((await client.get(nodeKey("m3")))!.value).status).toBe("draining");
    expect(() => m.admit()).toThrow(/draining/);
    await m.setStatus("ready");
    m.admit();
    await m.close({ leave: true });
  });

  test("etcd gone past the lease's TTL: no new sandboxes, none killed; etcd back: registered again and every sandbox re-bound", async () => {
    const m = member("m4");
    await m.start();
    const a = rec("sb4");
    held.push(a);
    await m.bind(a);
    const oldLease = (await client.get(nodeKey("m4")))!.lease;
    await etcd.kill(0);
    const t0 = performance.now();
    while (m.registered) {
      expect(performance.now() - t0).toBeLessThan(30_000);
      await Bun.sleep(200);
    }
    expect(() => m.admit()).toThrow(/not in the cluster/);
    etcd.restart(0);
    await etcd.healthy(30_000);
    // The lease expired while etcd was down (its TTL runs on etcd's clock after a restart too).
    const t1 = performance.now();
    while (!m.registered) {
      expect(performance.now() - t1).toBeLessThan(40_000);
      await Bun.sleep(200);
    }
    m.admit();
    const b = parseBinding((await client.get(sandboxKey("sb4")))!.value);
    expect(b.node).toBe("m4");
    const lease = (await client.get(nodeKey("m4")))!.lease;
    expect(b.lease).toBe(lease);
    console.log(`  lease ${oldLease} → ${lease}`);
    held.length = 0;
    await m.close({ leave: true });
  }, 90_000);
});
