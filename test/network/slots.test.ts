// Network slots on real namespaces, veths, TAPs and nftables. Traffic goes only to addresses on
// namespaces and veths these tests create. A fake guest (its own namespace behind the slot's TAP
// name, harness.ts) stands in for the VM, so guest traffic crosses the slot as a VM's does.

import { describe, expect, test } from "bun:test";
import { existsSync, readFileSync, readdirSync, writeFileSync } from "node:fs";
import { GATEWAY_IP, NAMESPACE_SYSCTLS, NetworkError, SLOT_TABLE, SlotPool, netnsExecArgv, type Slot } from "../../src/network/index.ts";
import {
  GUEST_PORT,
  HOST_TABLE,
  PREFIX,
  canRun,
  slotSuite,
  census,
  eventually,
  hostCounter,
  must,
  probe,
  sh,
  slotTestScaffold,
  startFakeGuest,
  startGuest,
  testPoolOptions,
  vanishGuest,
} from "./harness.ts";

const IP_FORWARD = "/proc/sys/net/ipv4/ip_forward";

async function fetchText(url: string): Promise<string> {
  // No keep-alive: a pooled connection to a slot's previous tenant is reset by the slot.
  const res = await fetch(url, { signal: AbortSignal.timeout(20_000), keepalive: false, headers: { Connection: "close" } });
  return res.text();
}

/** A TCP server in the guest that prints every byte it receives. */
const RECORDER = `Bun.listen({ hostname: "0.0.0.0", port: ${GUEST_PORT}, socket: { data: (_s, d) => void process.stdout.write(d) } }); console.log("listening");`;

/** Packets from the host's port `sport` that reached the guest's interface (counted before any rule of the guest's). */
function watchGuestArrivals(guestNetns: string, sport: number): () => number {
  must(netnsExecArgv({ netns: guestNetns }, ["nft", "-f", "-"]), `table inet watch {\n chain in {\n type filter hook prerouting priority -310;\n tcp sport ${sport} counter\n }\n}\n`);
  return () => {
    const out = must(netnsExecArgv({ netns: guestNetns }, ["nft", "list", "table", "inet", "watch"]));
    return Number(/counter packets (\d+)/.exec(out)![1]);
  };
}

describe.skipIf(!canRun)(slotSuite("network slots"), () => {
  const t = slotTestScaffold();

  test("host reaches a guest port through the slot's DNAT", async () => {
    const pool = t.newPool({ size: 0 });
    await pool.start();
    const slot = await pool.acquire();
    // Plain comparisons: toMatchObject with an asymmetric matcher wrote the matcher into `slot` (Bun 1.4.5).
    expect(slot.netns).toBe(`${PREFIX}${slot.id}`);
    expect([slot.tap, slot.guestIp]).toEqual(["tap0", "169.254.0.21"]);

    const tap = sh(["ip", "-n", slot.netns, "-d", "address", "show", "dev", "tap0"]).out;
    expect(tap).toContain("tun type tap");
    expect(tap).toContain("inet 169.254.0.22/30");
    expect(tap).toContain("link/ether 06:00:a9:fe:00:16"); // one gateway MAC in every slot (restores move)
    // The helper the VMM driver uses to start QEMU/Firecracker inside the namespace.
    const inside = sh(netnsExecArgv(slot, ["ip", "-br", "address", "show", "dev", "vpeer"]));
    expect(inside.out).toContain(`${slot.nsIp}/31`);
    expect(readFileSync(`/proc/sys/net/ipv6/conf/${slot.hostVeth}/disable_ipv6`, "utf8").trim()).toBe("1");

    const guest = t.keep(await startFakeGuest(slot, "ok"));
    expect(await fetchText(`http://${slot.nsIp}:${GUEST_PORT}/`)).toBe("ok");

    await vanishGuest(slot, guest);
    await pool.release(slot);
    await pool.destroy();
    expect(census()).toEqual(t.census());
  }, 60_000);

  test("slots reach neither each other nor the host; the guest's egress is masqueraded", async () => {
    const pool = t.newPool({ size: 0 });
    await pool.start();
    const a = await pool.acquire();
    const b = await pool.acquire();
    const guestA = t.keep(await startFakeGuest(a, "A"));
    t.keep(await startFakeGuest(b, "B"));
    expect(await fetchText(`http://${a.nsIp}:${GUEST_PORT}/`)).toBe("A");
    expect(await fetchText(`http://${b.nsIp}:${GUEST_PORT}/`)).toBe("B");

    // Host services on each slot's host address: the guest must not reach them by default.
    const seenByA: string[] = [];
    const onA = Bun.listen({ hostname: a.hostIp, port: 0, socket: { open: (s) => void seenByA.push(s.remoteAddress), data() {} } });
    const onB = Bun.listen({ hostname: b.hostIp, port: 0, socket: { data() {} } });
    try {
      const fromA = probe(guestA.netns, [
        { host: b.nsIp, port: GUEST_PORT },
        { host: b.hostIp, port: onB.port },
        { host: a.hostIp, port: onA.port },
        { host: a.guestIp, port: GUEST_PORT }, // control: the probe itself works
      ]);
      expect(fromA.slice(0, 3).every((o) => o !== "connected")).toBe(true);
      expect(fromA[3]).toBe("connected");
      expect(seenByA).toEqual([]);
      expect(hostCounter("slot_to_host")).toBeGreaterThan(0);

      // The namespace guard: only the slot's own host address may open connections into it.
      const fromHost = probe(undefined, [
        { host: b.nsIp, port: GUEST_PORT, localAddress: a.hostIp },
        { host: b.nsIp, port: GUEST_PORT },
      ]);
      expect(fromHost).toEqual(["timeout", "connected"]);

      // The egress layer's hook: once host_services lets a port in, guest traffic arrives from nsIp.
      const allow = sh(["nft", "add", "rule", "inet", HOST_TABLE, "host_services", "iifname", a.hostVeth, "tcp", "dport", String(onA.port), "accept"]);
      expect(allow.err).toBe("");
      expect(probe(guestA.netns, [{ host: a.hostIp, port: onA.port }])).toEqual(["connected"]);
      await eventually(() => seenByA.length > 0, "the host service sees the guest");
      expect(seenByA).toEqual([a.nsIp]);
    } finally {
      onA.stop(true);
      onB.stop(true);
    }
    await pool.destroy();
  }, 60_000);

  test("the namespace offers the guest nothing: listeners on the gateway address and nsIp are unreachable", async () => {
    const pool = t.newPool({ size: 0 });
    await pool.start();
    const a = await pool.acquire();
    const guest = t.keep(await startFakeGuest(a, "A"));
    // Something listening inside the slot's namespace, on every address it has.
    const port = GUEST_PORT + 1;
    const inNs = t.keep(
      Bun.spawn(netnsExecArgv(a, [process.execPath, "-e", `for (const h of ${JSON.stringify([GATEWAY_IP, a.nsIp])}) Bun.listen({ hostname: h, port: ${port}, socket: { data() {} } }); console.log("listening");`]), {
        stdout: "pipe",
      }),
    );
    const reader = inNs.stdout.getReader();
    expect(new TextDecoder().decode((await reader.read()).value)).toContain("listening");
    reader.releaseLock();
    // The same probe from the namespace itself connects: the listeners are there.
    expect(probe(a.netns, [{ host: GATEWAY_IP, port }, { host: a.nsIp, port }])).toEqual(["connected", "connected"]);

    const fromGuest = probe(guest.netns, [
      { host: GATEWAY_IP, port },
      { host: a.nsIp, port },
      { host: GATEWAY_IP, port: 22 },
    ]);
    expect(fromGuest.filter((o) => o === "connected")).toEqual([]);
    // From the host nsIp:P is the guest's port P (DNAT), never the namespace's listener.
    expect(probe(undefined, [{ host: a.nsIp, port }])).toEqual(["refused"]); // the guest has nothing on it
    // What the slot is for still works.
    expect(await fetchText(`http://${a.nsIp}:${GUEST_PORT}/`)).toBe("A");
    expect(probe(guest.netns, [{ host: a.guestIp, port: GUEST_PORT }])).toEqual(["connected"]);
    await pool.destroy();
  }, 60_000);

  test("with host forwarding on, the host table still keeps slots apart", async () => {
    const pool = t.newPool({ size: 0 });
    await pool.start();
    const a = await pool.acquire();
    const b = await pool.acquire();
    const guestA = t.keep(await startFakeGuest(a, "A"));
    t.keep(await startFakeGuest(b, "B"));
    const current = readFileSync(IP_FORWARD, "utf8").trim();
    // Forwarding is off by default (egress is a later layer); turn it on only for this test.
    if (current !== "1") {
      writeFileSync(IP_FORWARD, "1");
      t.after(() => writeFileSync(IP_FORWARD, current));
    }
    const dropsBefore = hostCounter("slot_to_slot");
    expect(probe(guestA.netns, [{ host: b.nsIp, port: GUEST_PORT }])).toEqual(["timeout"]);
    expect(hostCounter("slot_to_slot")).toBeGreaterThan(dropsBefore);
    expect(probe(undefined, [{ host: b.nsIp, port: GUEST_PORT }])).toEqual(["connected"]);
    await pool.destroy();
  }, 60_000);

  // A host connection to tenant A outlives A's VM (it vanished without a FIN). Whichever way the
  // slot comes back, nothing of that connection may reach tenant B, and B cannot answer into it.
  for (const path of ["scrub and re-lease", "remove and recreate"] as const) {
    test(`a host connection to one tenant never reaches the next (${path})`, async () => {
      // maxSlots 1: the next lease is the same slot, so the same nsIp. size 1 keeps it (scrub); 0 removes it.
      const pool = t.newPool({ size: path === "scrub and re-lease" ? 1 : 0, maxSlots: 1 });
      await pool.start();
      const a = await pool.acquire();
      const guestA = t.keep(await startGuest(a, RECORDER));

      const events: string[] = [];
      const old = await Bun.connect({
        hostname: a.nsIp,
        port: GUEST_PORT,
        socket: { data() {}, close: () => void events.push("close"), error: (_s, e) => void events.push(`error ${e.message}`), end: () => void events.push("end") },
      });
      old.write("hello-A");
      const oldPort = old.localPort;
      await eventually(() => guestA.output().includes("hello-A"), "tenant A receives its data");

      await vanishGuest(a, guestA);
      await pool.release(a);
      const b = await pool.acquire();
      expect(b.nsIp).toBe(a.nsIp);
      const guestB = t.keep(await startGuest(b, RECORDER));
      const arrivals = watchGuestArrivals(guestB.netns, oldPort);

      old.write("secret-of-A");
      // Control, sent after it on the same path: a new connection to B delivers.
      const fresh = await Bun.connect({ hostname: b.nsIp, port: GUEST_PORT, socket: { data() {} } });
      fresh.write("hello-B");
      await eventually(() => guestB.output().includes("hello-B"), "tenant B receives a new connection's data");
      fresh.end();

      expect(guestB.output()).not.toContain("secret");
      expect(arrivals()).toBe(0);
      // The release closed the host's socket (ss -K); had it not, the slot would reset it: either
      // way it fails instead of hanging.
      await eventually(() => events.length > 0, "the host's stale socket is closed or reset");
      old.terminate();
      await vanishGuest(b, guestB);
      await pool.destroy();
    }, 60_000);
  }

  test("release closes the host's own sockets to the slot, so no keep-alive pool reuses one with the next tenant", async () => {
    const pool = t.newPool({ size: 1, maxSlots: 1 });
    await pool.start();
    const a = await pool.acquire();
    const guestA = t.keep(await startGuest(a, RECORDER));
    const events: string[] = [];
    const idle = await Bun.connect({
      hostname: a.nsIp,
      port: GUEST_PORT,
      socket: { data() {}, close: () => void events.push("close"), error: (_s, e) => void events.push(`error ${e.message}`), end: () => void events.push("end") },
    });
    idle.write("hello-A");
    await eventually(() => guestA.output().includes("hello-A"), "tenant A receives its data");
    await vanishGuest(a, guestA);
    expect(events).toEqual([]); // the guest vanished without a word: the socket looks alive
    await pool.release(a);
    // Closed by the release itself, before anyone writes on it again.
    await eventually(() => events.length > 0, "the idle host socket is closed by the release");
    idle.terminate();
    await pool.destroy();
  }, 60_000);

  test("release rebuilds the namespace: a tenant's tables, sysctls, links and routes do not survive", async () => {
    const pool = t.newPool({ size: 1, maxSlots: 1 });
    await pool.start();
    const a = await pool.acquire();
    const rulesBefore = sh(netnsExecArgv(a, ["nft", "list", "ruleset"])).out;
    expect(rulesBefore).toContain(`table inet ${SLOT_TABLE}`);
    // What a tenant's policy or a compromised VMM with CAP_NET_ADMIN in the namespace could leave.
    must(netnsExecArgv(a, ["nft", "add", "table", "ip", "tenant_nat"]));
    must(netnsExecArgv(a, ["nft", "add", "chain", "inet", SLOT_TABLE, "tenant_policy"]));
    must(netnsExecArgv(a, ["sysctl", "-q", "-w", "net.ipv4.ip_forward=0", "net.netfilter.nf_conntrack_tcp_loose=1"]));
    must(["ip", "-n", a.netns, "link", "add", "extra0", "type", "veth", "peer", "name", "extra1"]);
    must(["ip", "-n", a.netns, "route", "add", "192.0.2.0/24", "via", a.hostIp]);
    must(["ip", "-n", a.netns, "address", "add", "192.0.2.9/32", "dev", "vpeer"]);
    must(["ip", "-n", a.netns, "neighbour", "add", "169.254.0.21", "lladdr", a.guestMac, "dev", "tap0"]);

    await pool.release(a);
    const b = await pool.acquire();
    expect(b.netns).toBe(a.netns);
    expect(sh(netnsExecArgv(b, ["nft", "list", "ruleset"])).out).toBe(rulesBefore);
    for (const [k, v] of Object.entries(NAMESPACE_SYSCTLS)) expect(must(netnsExecArgv(b, ["sysctl", "-n", k])).trim()).toBe(v);
    expect(must(["ip", "-n", b.netns, "-br", "link", "show"]).split("\n").filter(Boolean).map((l) => l.split(/[\s@]+/)[0]).sort()).toEqual(["lo", "tap0", "vpeer"]);
    expect(must(["ip", "-n", b.netns, "route", "show"])).not.toContain("192.0.2.0");
    expect(must(["ip", "-n", b.netns, "address", "show", "dev", "vpeer"])).not.toContain("192.0.2.9");
    expect(must(["ip", "-n", b.netns, "neighbour", "show", "dev", "tap0"]).trim()).toBe("");
    // And it still serves a sandbox.
    const guest = t.keep(await startFakeGuest(b, "next"));
    expect(await fetchText(`http://${b.nsIp}:${GUEST_PORT}/`)).toBe("next");
    await vanishGuest(b, guest);
    await pool.destroy();
  }, 60_000);

  test("pool: acquire, refill, SlotBusy, scrub on release, over-capacity removal, destroy", async () => {
    // maxSlots 3: with all three leased no refill can race the releases below.
    const pool = t.newPool({ size: 2, maxSlots: 3 });
    await pool.start();
    expect(pool.stats()).toEqual({ size: 2, ready: 2, leased: 0 });
    const a = await pool.acquire();
    await pool.whenFilled();
    expect(pool.stats()).toEqual({ size: 2, ready: 2, leased: 1 });

    // Leave traces a previous tenant would: connections, a neighbour, a policy chain.
    const guest = t.keep(await startFakeGuest(a, "ok"));
    expect(await fetchText(`http://${a.nsIp}:${GUEST_PORT}/`)).toBe("ok");
    expect(sh(netnsExecArgv(a, ["nft", "add", "chain", "inet", SLOT_TABLE, "tenant_policy"])).err).toBe("");
    expect(sh(netnsExecArgv(a, ["conntrack", "-L"])).out).toContain(a.nsIp);
    expect(sh(["conntrack", "-L", "-d", a.nsIp]).out).toContain(a.nsIp);

    // A VMM still running in the namespace: the release is refused and the slot stays leased.
    const vmm = t.keep(Bun.spawn(netnsExecArgv(a, ["sleep", "60"])));
    await eventually(() => sh(["ip", "netns", "pids", a.netns]).out.includes(String(vmm.pid)), "the VMM stand-in is in the namespace");
    await expect(pool.release(a)).rejects.toMatchObject({ code: "SlotBusy" });
    expect(pool.stats().leased).toBe(1);
    vmm.kill(9);
    await vmm.exited;
    await vanishGuest(a, guest);

    // Both ready slots leased, so release() finds room and keeps `a` (scrubbed) ready.
    const b = await pool.acquire();
    const c = await pool.acquire();
    await pool.release(a);
    expect(pool.stats()).toEqual({ size: 2, ready: 1, leased: 2 });
    expect(existsSync(a.netnsPath)).toBe(true);
    expect(sh(netnsExecArgv(a, ["nft", "list", "table", "inet", SLOT_TABLE])).out).not.toContain("tenant_policy");
    expect(sh(netnsExecArgv(a, ["conntrack", "-L"])).out).toBe("");
    expect(sh(["conntrack", "-L", "-d", a.nsIp]).out).toBe("");

    await pool.release(b);
    await pool.release(c); // beyond `size` ready: removed
    expect(pool.stats()).toEqual({ size: 2, ready: 2, leased: 0 });
    expect(existsSync(b.netnsPath)).toBe(true);
    expect(existsSync(c.netnsPath)).toBe(false);
    await expect(pool.release(c)).rejects.toMatchObject({ code: "NotLeased" });

    // A recycled slot still works for the next sandbox.
    const again = await pool.acquire();
    const guest2 = t.keep(await startFakeGuest(again, "again"));
    expect(await fetchText(`http://${again.nsIp}:${GUEST_PORT}/`)).toBe("again");
    await vanishGuest(again, guest2);

    await pool.destroy();
    await expect(pool.acquire()).rejects.toBeInstanceOf(NetworkError);
    expect(census()).toEqual(t.census());
  }, 60_000);

  test("reconcile removes a crashed run's slots, keeps adopted ones, never touches others", async () => {
    // A crash: this pool is never destroyed (the sweep after the test is the only cleanup it gets).
    const crashed = new SlotPool(testPoolOptions({ size: 2 }));
    await crashed.start();
    const kept = await crashed.acquire();
    const orphaned = await crashed.acquire();
    await crashed.whenFilled();
    t.keep(await startFakeGuest(kept, "kept"));
    const orphanVmm = t.keep(Bun.spawn(netnsExecArgv(orphaned, ["sleep", "60"])));
    await eventually(() => sh(["ip", "netns", "pids", orphaned.netns]).out.includes(String(orphanVmm.pid)), "the orphan VMM is in its namespace");

    // Look-alikes that are not ours: non-canonical names and a non-veth link with a slot name.
    const decoyNs = [`${PREFIX}01`, `${PREFIX}x`];
    for (const n of decoyNs) {
      expect(sh(["ip", "netns", "add", n]).code).toBe(0);
      t.undo(["ip", "netns", "delete", n]);
    }
    const decoyTap = `${PREFIX}4`;
    expect(sh(["ip", "tuntap", "add", "dev", decoyTap, "mode", "tap"]).code).toBe(0);
    t.undo(["ip", "link", "delete", decoyTap]);
    const decoyVeth = `${PREFIX}d`;
    expect(sh(["ip", "link", "add", decoyVeth, "type", "veth", "peer", "name", `${PREFIX}e`]).code).toBe(0);
    t.undo(["ip", "link", "delete", decoyVeth]);

    const leftovers = readdirSync("/run/netns").filter((n) => new RegExp(`^${PREFIX}(0|[1-9]\\d*)$`).test(n));
    expect(leftovers.length).toBe(4);
    const pool = t.newPool({ size: 1 });
    const report = await pool.reconcile({ adopt: [kept.netns] });
    expect(report.adopted.map((s: Slot) => s.netns)).toEqual([kept.netns]);
    expect(report.adopted[0]).toEqual(kept);
    expect(report.removed.sort()).toEqual(leftovers.filter((n) => n !== kept.netns).sort());
    expect(report.orphanPids[orphaned.netns]).toContain(orphanVmm.pid);
    expect(report.skipped).toEqual([decoyTap]);
    for (const n of decoyNs) expect(existsSync(`/run/netns/${n}`)).toBe(true);
    for (const l of [decoyTap, decoyVeth, `${PREFIX}e`]) expect(existsSync(`/sys/class/net/${l}`)).toBe(true);

    // A host CIDR something else routes is refused rather than hijacked.
    const inUse = kept.hostIp.replace(/\.\d+$/, ".200");
    expect(sh(["ip", "address", "add", `${inUse}/32`, "dev", decoyVeth]).code).toBe(0);
    await expect(pool.start()).rejects.toMatchObject({ code: "CidrInUse" });
    sh(["ip", "address", "delete", `${inUse}/32`, "dev", decoyVeth]);

    await pool.start();
    // The adopted sandbox kept working across the restart and is released like any lease.
    expect(await fetchText(`http://${kept.nsIp}:${GUEST_PORT}/`)).toBe("kept");
    orphanVmm.kill(9);
    const guestProcs = sh(["ip", "netns", "pids", kept.netns]).out.trim();
    expect(guestProcs).toBe("");
    await pool.release(kept);
    const fresh: Slot[] = [];
    for (let i = 0; i < 5; i++) fresh.push(await pool.acquire());
    expect(fresh.map((s) => s.id)).not.toContain(4); // the decoy's slot number stays unused
    await pool.destroy();
  }, 60_000);
});
