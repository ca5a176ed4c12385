// Placement (best-of-K with a cache bonus) on records, and reservations racing in a real etcd.
import { describe, expect, test } from "bun:test";
import { EtcdClient } from "../../src/cluster/etcd_client.ts";
import type { NodeRecord } from "../../src/cluster/records.ts";
import { rank } from "../../services/scheduler/placement.ts";
import { Reservations } from "../../services/scheduler/reservations.ts";
import { prng } from "../helpers/tmp.ts";
import { etcdSkipReason, etcdSuite } from "./harness.ts";

const node = (id: string, o: Partial<{ used: number; max: number; mem: number; status: NodeRecord["status"]; cached: Record<string, number>; disk: number }> = {}): NodeRecord => ({
  id, apiUrl: "http://127.0.0.1:1", status: o.status ?? "ready", version: "t",
  capacity: { cpus: 16, memoryMB: 65536, diskFreeMB: o.disk ?? 500_000, maxSandboxes: o.max ?? 64 },
  used: { sandboxes: o.used ?? 0, running: o.used ?? 0, cpus: o.used ?? 0, memoryMB: o.mem ?? 0 },
  cached: o.cached ?? {}, at: 0,
});
const need = { template: "tpl", cpus: 1, memoryMB: 512 };

describe("placement", () => {
  test("draining, cordoned, full and disk-starved nodes get nothing", () => {
    const got = rank([node("a", { status: "draining" }), node("b", { status: "cordoned" }), node("c", { used: 64 }), node("d", { disk: 100 }), node("e")], new Map(), need);
    expect(got.map((s) => s.node.id)).toEqual(["e"]);
  });

  test("the cache bonus wins among equals, and is no filter: a full holder loses to an empty node", () => {
    const holder = node("holder", { cached: { tpl: 4 * 2 ** 30 } });
    const empty = node("empty");
    expect(rank([empty, holder], new Map(), need, { k: 2 })[0]!.node.id).toBe("holder");
    expect(rank([empty, holder], new Map(), need, { k: 2, cacheWeight: 0 }).map((s) => s.cacheBytes)).toContain(4 * 2 ** 30);
    const fullHolder = node("holder", { cached: { tpl: 4 * 2 ** 30 }, used: 64 });
    expect(rank([empty, fullHolder], new Map(), need, { k: 2 }).map((s) => s.node.id)).toEqual(["empty"]);
  });

  test("best of K: with K = 2 of 10 nodes the choice spreads, and every eligible node follows as a fallback", () => {
    const nodes = Array.from({ length: 10 }, (_, i) => node(`n${i}`, { used: i }));
    const rnd = prng(7);
    const firsts = new Set<string>();
    for (let i = 0; i < 200; i++) {
      const r = rank(nodes, new Map(), need, { k: 2, random: rnd });
      expect(r.length).toBe(10);
      firsts.add(r[0]!.node.id);
    }
    expect(firsts.size).toBeGreaterThan(5);
    // n9 (the fullest) only ever leads when both sampled nodes are worse — never, as it is the worst.
    expect(firsts.has("n9")).toBe(false);
  });

  test("a published template's layers count for the node that holds them, though it never imported the template", () => {
    const layers = [{ digest: `sha256:${"a".repeat(64)}`, size: 3 * 2 ** 30 }, { digest: `sha256:${"b".repeat(64)}`, size: 2 ** 30 }];
    const holder = { ...node("holder"), layers: [layers[0]!.digest] };
    const got = rank([node("empty"), holder], new Map(), { ...need, layers }, { k: 2 });
    expect(got[0]!.node.id).toBe("holder");
    expect(got[0]!.cacheBytes).toBe(3 * 2 ** 30);
    expect(got[1]!.cacheBytes).toBe(0);
  });

  test("reservations count as used", () => {
    const n = node("a", { used: 63 });
    expect(rank([n], new Map([["a", [{ id: "r", cpus: 1, memoryMB: 512, until: Date.now() + 1000 }]]]), need)).toEqual([]);
  });
});

describe.skipIf(etcdSkipReason() !== undefined)("reservations in etcd", () => {
  const suite = etcdSuite("res-etcd");

  test("eight gateways race for a node's last three slots: exactly three reservations win", async () => {
    const n = node("racy", { used: 61 });
    const gateways = Array.from({ length: 8 }, () => new Reservations(EtcdClient.parse(suite.etcd().endpoints)));
    const won = await Promise.all(gateways.map((g, i) => g.reserve(n, { id: `r${i}`, cpus: 1, memoryMB: 512 })));
    expect(won.filter(Boolean).length).toBe(3);
    const held = (await gateways[0]!.all()).get("racy")!;
    expect(held.length).toBe(3);
    // Released ones free their slot.
    const winner = won.findIndex(Boolean);
    await gateways[winner]!.release("racy", `r${winner}`);
    expect((await gateways[0]!.all()).get("racy")!.length).toBe(2);
    expect(await gateways[0]!.reserve(n, { id: "again", cpus: 1, memoryMB: 512 })).toBe(true);
  });
});
