// The etcd client against real etcd members (Debian's etcd-server): transactions that race, leases
// that expire, a watch that survives its member's death, and quorum loss answered with a named error.
import { beforeAll, describe, expect, test } from "bun:test";
import { EtcdClient, EtcdError, cmp, op, type WatchEvent } from "../../src/cluster/etcd_client.ts";
import { etcdSkipReason, etcdSuite } from "./harness.ts";

const skip = etcdSkipReason();

describe.skipIf(skip !== undefined)("etcd client, one member", () => {
  const suite = etcdSuite("etcd1");
  let c: EtcdClient;
  beforeAll(() => void (c = suite.client()));

  test("put, get, prefix range and delete", async () => {
    await c.put("/t/a/1", "one");
    await c.put("/t/a/2", "two");
    await c.put("/t/b", "other");
    expect((await c.get("/t/a/1"))?.value).toBe("one");
    const r = await c.range("/t/a/", { prefix: true });
    expect(r.kvs.map((k) => `${k.key}=${k.value}`)).toEqual(["/t/a/1=one", "/t/a/2=two"]);
    expect(await c.delete("/t/a/", { prefix: true })).toBe(2);
    expect(await c.get("/t/a/1")).toBeUndefined();
  });

  test("two creates of one key race: exactly one wins, the loser reads the winner's value", async () => {
    const create = (v: string) => c.txn([cmp.absent("/t/race")], [op.put("/t/race", v)], [op.get("/t/race")]);
    const [a, b] = await Promise.all([create("a"), create("b")]);
    expect([a.succeeded, b.succeeded].filter(Boolean).length).toBe(1);
    const loser = a.succeeded ? b : a;
    expect(loser.gets[0]![0]!.value).toBe(a.succeeded ? "a" : "b");
  });

  test("a key on a lease goes when the lease expires; keepalive then answers 0", async () => {
    const lease = await c.leaseGrant(2);
    await c.put("/t/leased", "x", lease);
    expect(await c.leaseKeepAlive(lease)).toBeGreaterThan(0);
    expect((await c.get("/t/leased"))?.lease).toBe(lease);
    const t0 = performance.now();
    while ((await c.get("/t/leased")) !== undefined) {
      expect(performance.now() - t0).toBeLessThan(10_000);
      await Bun.sleep(200);
    }
    expect(await c.leaseKeepAlive(lease)).toBe(0);
    // A fence on the dead lease fails.
    const r = await c.txn([cmp.lease("/t/leased", lease)], [op.put("/t/fenced", "no")]);
    expect(r.succeeded).toBe(false);
  });

  test("a watch sees puts and deletes in order, from a given revision", async () => {
    const start = (await c.range("/w/", { prefix: true })).revision + 1;
    const seen: WatchEvent[] = [];
    const w = c.watch("/w/", start, { events: (e) => seen.push(...e) });
    await c.put("/w/1", "a");
    await c.put("/w/2", "b");
    await c.delete("/w/1");
    const t0 = performance.now();
    while (seen.length < 3 && performance.now() - t0 < 5000) await Bun.sleep(20);
    w.close();
    expect(seen.map((e) => `${e.type} ${e.kv.key}`)).toEqual(["put /w/1", "put /w/2", "delete /w/1"]);
  });

  test("an unreachable endpoint is an EtcdError 'unavailable', within the deadline", async () => {
    const dead = new EtcdClient(["http://127.0.0.1:1"], 1000);
    const t0 = performance.now();
    const e = await dead.get("/x").catch((x: unknown) => x);
    expect(e).toBeInstanceOf(EtcdError);
    expect((e as EtcdError).reason).toBe("unavailable");
    expect(performance.now() - t0).toBeLessThan(1500);
  });

  test("bad endpoints are refused at once", () => {
    expect(() => EtcdClient.parse("localhost:2379")).toThrow(EtcdError);
    expect(() => EtcdClient.parse("")).toThrow(/no etcd endpoints/);
  });
});

describe.skipIf(skip !== undefined)("etcd client, three members", () => {
  const suite = etcdSuite("etcd3", 3, 3000);
  let c: EtcdClient;
  let etcd: ReturnType<typeof suite.etcd>;
  beforeAll(() => {
    c = suite.client();
    etcd = suite.etcd();
  });

  test("the leader killed: writes go on within seconds and the watch keeps every event", async () => {
    const start = (await c.range("/k/", { prefix: true })).revision + 1;
    const seen: string[] = [];
    const w = c.watch("/k/", start, { events: (e) => seen.push(...e.map((x) => x.kv.key)) });
    await c.put("/k/before", "1");
    const leader = await etcd.leader();
    expect(leader).toBeDefined();
    await etcd.kill(leader!);
    const t0 = performance.now();
    let wrote = false;
    while (!wrote && performance.now() - t0 < 15_000) {
      try {
        await c.put("/k/after", "2");
        wrote = true;
      } catch (e) {
        expect(e).toBeInstanceOf(EtcdError);
      }
    }
    expect(wrote).toBe(true);
    console.log(`  a write after the leader's kill: ${Math.round(performance.now() - t0)} ms`);
    const t1 = performance.now();
    while (seen.length < 2 && performance.now() - t1 < 10_000) await Bun.sleep(50);
    w.close();
    expect(seen).toEqual(["/k/before", "/k/after"]);
    etcd.restart(leader!);
    await etcd.healthy(20_000);
  }, 60_000);

  test("quorum lost: a quorum read fails with an EtcdError; quorum back: it answers", async () => {
    await c.put("/q/x", "kept");
    await etcd.kill(1);
    await etcd.kill(2);
    const e = await c.get("/q/x").catch((x: unknown) => x);
    expect(e).toBeInstanceOf(EtcdError);
    expect(["timeout", "unavailable"]).toContain((e as EtcdError).reason);
    // A member's own copy still answers a serializable read.
    expect((await c.get("/q/x", { serializable: true }))?.value).toBe("kept");
    etcd.restart(1);
    etcd.restart(2);
    await etcd.healthy(30_000);
    expect((await c.get("/q/x"))?.value).toBe("kept");
  }, 90_000);
});
