// SlotPool under failure and contention, on real namespaces: tool runs that never block the event
// loop, a scrub that fails, a refill that fails and recovers, exhaustion, callers racing for the
// last slot, destroy while slots are being built.

import { describe, expect, test } from "bun:test";
import { existsSync } from "node:fs";
import { NetworkError, type Slot } from "../../src/network/index.ts";
import { run } from "../../src/network/command.ts";
import { GUEST_PORT, PREFIX, canRun, slotSuite, eventually, must, sh, slotTestScaffold, startFakeGuest, vanishGuest } from "./harness.ts";

describe.skipIf(!canRun)(slotSuite("slot pool"), () => {
  const t = slotTestScaffold();

  test("tool runs are awaited: timers keep firing while slots are built, scrubbed and removed", async () => {
    let ticks = 0;
    const timer = setInterval(() => ticks++, 1);
    try {
      const pool = t.newPool({ size: 1, maxSlots: 2 });
      const phases: [string, () => Promise<unknown>][] = [];
      let a: Slot | undefined;
      phases.push(["start", () => pool.start()]);
      phases.push(["acquire (build on the spot)", async () => ((a = await pool.acquire()), await pool.acquire())]);
      phases.push(["release (scrub)", () => pool.release(a!)]);
      phases.push(["destroy (remove)", () => pool.destroy()]);
      for (const [name, phase] of phases) {
        const before = ticks;
        await phase();
        // A spawnSync-based step would hold the loop for the whole phase: no tick at all.
        expect({ name, ticked: ticks > before }).toEqual({ name, ticked: true });
      }
    } finally {
      clearInterval(timer);
    }
  }, 60_000);

  test("a tool that fails or hangs gives a named error with its stderr; a hung one is killed", async () => {
    const failed = await run(["ip", "link", "show", "dev", `${PREFIX}none`]).catch((e) => e);
    expect(failed).toBeInstanceOf(NetworkError);
    expect(failed.code).toBe("CommandFailed");
    expect(failed.detail.stderr).toContain("does not exist");
    const hung = await run(["/bin/sleep", "30"], { timeoutMs: 200 }).catch((e) => e);
    expect(hung).toBeInstanceOf(NetworkError);
    expect(hung.code).toBe("Timeout");
  }, 60_000);

  test("a scrub that fails removes the slot: it is never handed out again half-clean", async () => {
    const pool = t.newPool({ size: 1, maxSlots: 1 });
    await pool.start();
    const a = await pool.acquire();
    // The host end of the pair goes (an operator, or a tenant with CAP_NET_ADMIN in the namespace): vpeer goes with it.
    must(["ip", "link", "delete", a.hostVeth]);
    const err = await pool.release(a).catch((e) => e);
    expect(err).toBeInstanceOf(NetworkError);
    expect(err.code).toBe("SlotBroken");
    expect(existsSync(a.netnsPath)).toBe(false);
    expect(pool.stats().leased).toBe(0);
    // The pool builds a fresh one in its place, and that one works.
    await pool.whenFilled();
    const b = await pool.acquire();
    expect(b.id).toBe(a.id);
    const guest = t.keep(await startFakeGuest(b, "fresh"));
    const res = await fetch(`http://${b.nsIp}:${GUEST_PORT}/`, { signal: AbortSignal.timeout(20_000), keepalive: false });
    expect(await res.text()).toBe("fresh");
    await vanishGuest(b, guest);
    await pool.destroy();
  }, 60_000);

  test("a refill that fails is reported and retried until it succeeds", async () => {
    const failures: Error[] = [];
    const pool = t.newPool({ size: 1, maxSlots: 2, onRefillError: (e: Error) => void failures.push(e) });
    await pool.start();
    // Slot 1's name is held as another link's altname: invisible in /sys/class/net, so the refill
    // tries it and `ip link add` fails.
    const decoy = `${PREFIX}d`;
    must(["ip", "link", "add", decoy, "type", "veth", "peer", "name", `${PREFIX}e`]);
    t.undo(["ip", "link", "delete", decoy]);
    must(["ip", "link", "property", "add", "dev", decoy, "altname", `${PREFIX}1`]);

    const a = await pool.acquire();
    await eventually(() => failures.length >= 2, "the refill fails, reports, and tries again");
    expect(failures[0]).toBeInstanceOf(NetworkError);
    expect((failures[0] as NetworkError).detail.stderr).toContain("File exists");
    expect(pool.lastRefillError).toBe(failures.at(-1)!);
    const waited = await pool.whenFilled(300).catch((e) => e);
    expect(waited.code).toBe("Timeout");
    expect(waited.message).toContain("File exists");

    must(["ip", "link", "property", "del", "dev", decoy, "altname", `${PREFIX}1`]);
    await pool.whenFilled();
    expect(pool.stats()).toEqual({ size: 1, ready: 1, leased: 1 });
    expect(pool.lastRefillError).toBeUndefined();
    await pool.release(a);
    await pool.destroy();
  }, 60_000);

  test("exhaustion: Exhausted after a bounded wait; callers racing for the last slot each get a correct answer", async () => {
    const pool = t.newPool({ size: 0, maxSlots: 2, acquireTimeoutMs: 300 });
    await pool.start();
    const first = await pool.acquire();

    // Two callers, one slot left: one gets it, the other waits out its bound and is told why.
    const raced = await Promise.allSettled([pool.acquire(), pool.acquire()]);
    const won = raced.filter((r) => r.status === "fulfilled").map((r) => (r as PromiseFulfilledResult<Slot>).value);
    const lost = raced.filter((r) => r.status === "rejected").map((r) => (r as PromiseRejectedResult).reason);
    expect(won.map((s) => s.id)).toEqual([1]);
    expect(lost.map((e) => [e instanceof NetworkError, e.code])).toEqual([[true, "Exhausted"]]);

    const t0 = performance.now();
    await expect(pool.acquire()).rejects.toMatchObject({ code: "Exhausted" });
    expect(performance.now() - t0).toBeGreaterThanOrEqual(250); // it waited for a release first

    // Two releases of one slot at once: one does it, the other is told it is no longer leased.
    const twice = await Promise.allSettled([pool.release(first), pool.release(first)]);
    expect(twice.map((r) => r.status).sort()).toEqual(["fulfilled", "rejected"]);
    expect((twice.find((r) => r.status === "rejected") as PromiseRejectedResult).reason.code).toBe("NotLeased");
    await pool.release(won[0]!);
    await pool.destroy();
  }, 60_000);

  test("waiters get slots as they are released, each a different one", async () => {
    const pool = t.newPool({ size: 0, maxSlots: 2, acquireTimeoutMs: 30_000 });
    await pool.start();
    const a = await pool.acquire();
    const b = await pool.acquire();
    const waiting = [pool.acquire(), pool.acquire()];
    await pool.release(a);
    await pool.release(b);
    const got = await Promise.all(waiting);
    expect(got.map((s) => s.id).sort()).toEqual([0, 1]);
    expect(pool.stats()).toEqual({ size: 0, ready: 0, leased: 2 });
    for (const s of got) await pool.release(s);
    await pool.destroy();
  }, 60_000);

  test("destroy while slots are being built leaves nothing behind; waiting callers are told", async () => {
    const pool = t.newPool({ size: 3, maxSlots: 4, acquireTimeoutMs: 30_000 });
    await pool.start();
    const leased = [await pool.acquire(), await pool.acquire(), await pool.acquire(), await pool.acquire()];
    const waiter = pool.acquire().catch((e) => e);
    // Releases under way (scrubs) and refills racing with destroy.
    const releases = leased.map((s) => pool.release(s).catch((e) => e));
    await pool.destroy();
    await Promise.all(releases);
    const err = await waiter;
    expect(err instanceof NetworkError || (err as Slot).id !== undefined).toBe(true);
    if (err instanceof NetworkError) expect(err.code).toBe("BadState");
    expect(sh(["ip", "netns", "list"]).out).not.toContain(PREFIX);
  }, 60_000);
});
