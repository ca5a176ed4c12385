// A node killed with -9 while a sandbox runs: blockd and the VM outlive it; the next node process
// takes the VM back (recover), and the sandbox still answers with its files and processes.
import { afterAll, describe, expect, test } from "bun:test";
import { join } from "node:path";
import { Sandbox } from "e2b";
import { startBlockd } from "../blockdev/harness.ts";
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

  test("the sandbox keeps answering, with its file and its background process", async () => {
    const child = Bun.spawn([process.execPath, join(import.meta.dir, "crash_child.ts"), JSON.stringify({ ...dirs, blockdSock: join(state, "blockd.sock"), apiKey: KEY })], { stdout: "pipe", stderr: "inherit" });
    cleanup.push(() => { if (child.exitCode === null) child.kill("SIGKILL"); });
    const reader = child.stdout.getReader();
    let line = "";
    while (!line.includes("\n")) {
      const { done, value } = await reader.read();
      if (done) throw new Error(`the node child exited (${await child.exited}) before it created its sandbox`);
      line += new TextDecoder().decode(value);
    }
    const made = JSON.parse(line.trim()) as { id: string; pid: number };
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
    const back = await Sandbox.connect(made.id, opts);
    expect(await back.files.read("/tmp/before-crash.txt")).toBe("written before kill -9");
    expect(await back.kill()).toBe(true);
    expect(qemuPids(root)).toEqual([]);
  }, 300_000);
});
