// A node killed with -9 while a sandbox runs: blockd and the VM outlive it; the next node process
// takes the VM back (recover), and the sandbox still answers with its files and processes. Paused,
// it resumes after a restart on the rootfs device it held; a kill -9 mid-resume leaves it paused.
import { afterAll, describe, expect, test } from "bun:test";
import { mkdirSync } from "node:fs";
import { join } from "node:path";
import { Sandbox } from "e2b";
import type { SandboxRuntime } from "../../src/orchestrator/orchestrator.ts";
import { type DeviceView, startBlockd } from "../blockdev/harness.ts";
import { qemuPids, rmrf, runRoot } from "../vmm/harness.ts";
import { nodeParts, serveParts, sandboxSkipReason } from "./harness.ts";

const skip = sandboxSkipReason();
const KEY = "e2b_" + "9a".repeat(20);
const tag = ((process.pid + 11) % 46656).toString(36).padStart(3, "0");

describe.skipIf(!!skip)("node restart: kill -9, then the next node process recovers running sandboxes", async () => {
  if (skip) return void test.skip(skip!, () => {});
  const { dir, state, client } = await startBlockd("recover", { pool: 1 });
  const root = runRoot("recover");
  const dirs = { dir, runRoot: root, slotPrefix: `arc${tag}-`, slotCidr: `10.218.${process.pid % 250}.0/24` };
  const cleanup: (() => Promise<void> | void)[] = [];
  afterAll(async () => {
    for (const c of cleanup.reverse()) await c();
    rmrf(root);
  });

  /** A node process (crash_child.ts) and the line it prints when it is ready to be killed. */
  const nodeChild = async <T>(extra: { resume?: string } = {}) => {
    const child = Bun.spawn([process.execPath, join(import.meta.dir, "crash_child.ts"), JSON.stringify({ ...dirs, ...extra, blockdSock: join(state, "blockd.sock"), apiKey: KEY })], { stdout: "pipe", stderr: "inherit" });
    cleanup.push(() => { if (child.exitCode === null) child.kill("SIGKILL"); });
    const reader = child.stdout.getReader();
    let line = "";
    while (!line.includes("\n")) {
      const { done, value } = await reader.read();
      if (done) throw new Error(`the node child exited (${await child.exited}) before it printed its line`);
      line += new TextDecoder().decode(value);
    }
    return { child, said: JSON.parse(line.trim()) as T };
  };

  test("the sandbox keeps answering, with its file and its background process", async () => {
    const { child, said: made } = await nodeChild<{ id: string; pid: number }>();
    const vmsBefore = qemuPids(root);
    expect(vmsBefore.length).toBe(1);

    child.kill("SIGKILL");
    await child.exited;
    // The VM outlived its node.
    expect(qemuPids(root)).toEqual(vmsBefore);

    const { orch, pool, store } = await nodeParts(dirs, client);
    cleanup.push(async () => { await orch.killAll(); orch.close(); await pool.destroy().catch(() => {}); });
    const report = await orch.recover();
    expect(report.adopted).toEqual([made.id]);
    expect(report.lost).toEqual([]);
    expect(store.get(made.id)!.state).toBe("running");
    const { base, stop } = serveParts(orch, KEY);
    cleanup.push(stop);
    const opts = { apiKey: KEY, apiUrl: base, sandboxUrl: base, requestTimeoutMs: 60_000 };
    const sbx = await Sandbox.connect(made.id, opts);
    expect(await sbx.files.read("/tmp/before-crash.txt")).toBe("written before kill -9");
    expect((await sbx.commands.list()).some((p) => p.pid === made.pid)).toBe(true);
    // The adopted VM is fully ours again: pause, resume, kill.
    expect(await sbx.pause()).toBe(true);
    await orch.settledCleanups();
    const held = (store.get(made.id)!.runtime as SandboxRuntime).resumeDevice!;
    expect(held.id).toBeString();
    // The node stops with the sandbox paused; the next one finds the device acquired for its resume
    // (blockd kept it) and resumes on it, and is killed -9 with the VM restored but envd not yet
    // answering.
    orch.close();
    stop();
    await pool.destroy();
    const mid = await nodeChild<{ held: unknown; rootfsDevice: string; state: string }>({ resume: made.id });
    expect(mid.said).toEqual({ held, rootfsDevice: held.id, state: "resuming" });
    mid.child.kill("SIGKILL");
    await mid.child.exited;
    // The node after it pauses the sandbox again (the restored VM stopped, its device given back),
    // and a resume brings it back with its file.
    // And a device acquired for a sandbox that no row names (a node killed between blockd's answer
    // and its record) is given back.
    const strayUpper = join(dir, "home", "sandboxes", "strayone", "upper-x");
    mkdirSync(join(strayUpper, ".."), { recursive: true });
    const stray = await client.call<{ id: string }>("acquire", { lowers: (store.get(made.id)!.runtime as SandboxRuntime).paused!.layers, upperDir: strayUpper, size: 64 << 20 });
    const next = await nodeParts(dirs, client);
    cleanup.push(async () => { await next.orch.killAll(); next.orch.close(); await next.pool.destroy().catch(() => {}); });
    expect(await next.orch.recover()).toEqual({ adopted: [], lost: [], paused: [made.id] });
    expect(qemuPids(root)).toEqual([]);
    const rt = next.store.get(made.id)!.runtime as SandboxRuntime;
    expect([rt.rootfsDevice, rt.slot, rt.resumeDevice ?? null]).toEqual([null, null, null]);
    const listed = await client.call<DeviceView[]>("list");
    for (const [id, upper] of [[held.id, held.upperDir], [stray.id, strayUpper]] as const) {
      const d = listed.find((l) => l.id === id);
      expect(d?.acquired && d.config?.upper?.data.startsWith(`${upper}/`)).toBeFalsy();
    }
    const served = serveParts(next.orch, KEY);
    cleanup.push(served.stop);
    const back = await Sandbox.connect(made.id, { ...opts, apiUrl: served.base, sandboxUrl: served.base });
    expect(await back.files.read("/tmp/before-crash.txt")).toBe("written before kill -9");
    expect(await back.kill()).toBe(true);
    expect(qemuPids(root)).toEqual([]);
  }, 300_000);
});
