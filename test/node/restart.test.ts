// Restarts of `bun run node` that the acceptance test does not make: a kill -9 while a sandbox is
// paused (it is listed paused again and resumes with its files), and a graceful SIGTERM, which
// leaves the running sandboxes running for the next node to adopt. Two sandboxes serve both.
import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { Sandbox } from "e2b";
import { qemuPids } from "../vmm/harness.ts";
import { FIRST_START_MS, nodeSetup, nodeSkipReason, startNode, stopNode, type NodeProc } from "./harness.ts";

const skip = nodeSkipReason();
const KEY = "e2b_" + "3d".repeat(20);
/** A restart re-attaches blockd and adopts VMs: no template build, no boot. */
const RESTART_MS = 5 * 60_000;

describe.skipIf(!!skip)("node restarts", () => {
  if (skip) return void test.skip(skip!, () => {});
  const setup = nodeSetup("art", 227, KEY);
  const { tag, env, runDir } = setup;
  let node: NodeProc;
  const opts = () => ({ apiKey: KEY, apiUrl: node.base, sandboxUrl: node.base, requestTimeoutMs: 180_000 });
  let running: Sandbox;
  let paused: Sandbox;
  let bgPid = 0;

  beforeAll(async () => {
    node = await startNode(env, FIRST_START_MS);
  }, FIRST_START_MS + 60_000);

  afterAll(() => stopNode(node, setup), 180_000);

  const states = async () => {
    const out: Record<string, string> = {};
    for (const s of await Sandbox.list({ ...opts(), query: { metadata: { tag } } }).nextItems()) out[s.sandboxId] = s.state;
    return out;
  };

  test("kill -9 while a sandbox is paused: the next node lists it paused, connect resumes it with its files", async () => {
    running = await Sandbox.create({ ...opts(), metadata: { tag } });
    await running.files.write("/tmp/kept", "running one");
    bgPid = (await running.commands.run("sleep 3600", { background: true, timeoutMs: 0 })).pid;
    paused = await Sandbox.create({ ...opts(), metadata: { tag } });
    await paused.files.write("/tmp/kept", "paused one");
    expect(await paused.pause()).toBe(true);

    node.proc.kill("SIGKILL");
    await node.proc.exited;
    node = await startNode(env, RESTART_MS);
    expect(node.log).toContain("  recovered: 1 running, 1 paused, 0 lost");
    expect(await states()).toEqual({ [running.sandboxId]: "running", [paused.sandboxId]: "paused" });
    const envd = await fetch(`${node.base}/health`, { headers: { "e2b-sandbox-id": paused.sandboxId } });
    expect(envd.status).toBe(502); // isRunning() false: not resumed by the restart

    paused = await Sandbox.connect(paused.sandboxId, opts());
    expect(await paused.files.read("/tmp/kept")).toBe("paused one");
    running = await Sandbox.connect(running.sandboxId, opts());
    expect(await running.files.read("/tmp/kept")).toBe("running one");
  }, 600_000);

  test("SIGTERM stops the node only: its sandboxes keep running and the next node adopts them", async () => {
    const vms = qemuPids(runDir).sort();
    expect(vms.length).toBe(2);
    node.proc.kill("SIGTERM");
    expect(await node.proc.exited).toBe(0);
    expect(qemuPids(runDir).sort()).toEqual(vms); // the same VMM processes, with no node

    node = await startNode(env, RESTART_MS);
    expect(node.log).toContain("  recovered: 2 running, 0 paused, 0 lost");
    expect(await states()).toEqual({ [running.sandboxId]: "running", [paused.sandboxId]: "running" });
    // The node listens on a new port: the SDK's handles are made again.
    running = await Sandbox.connect(running.sandboxId, opts());
    paused = await Sandbox.connect(paused.sandboxId, opts());
    for (const [s, text] of [[running, "running one"], [paused, "paused one"]] as const) {
      expect(await s.files.read("/tmp/kept")).toBe(text);
      expect((await s.commands.run("echo answers")).stdout).toBe("answers\n");
    }
    expect((await running.commands.list()).some((p) => p.pid === bgPid)).toBe(true);
    expect(qemuPids(runDir).sort()).toEqual(vms);
    expect(await running.kill()).toBe(true);
    expect(await paused.kill()).toBe(true);
  }, 600_000);
});
