// Sandbox memory on a real node: memory layers stacked by pauses and compacted past the node's
// bound (data intact through every resume); and host memory pressure: with the threshold above
// what this host has available, the reaper's pass inflates every running sandbox's balloon to
// half its memory (the guest sees that much less free memory) and the sandbox keeps working.

import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { join } from "node:path";
import { Sandbox } from "e2b";
import type { SlotPool } from "../../src/network/index.ts";
import type { Orchestrator } from "../../src/orchestrator/orchestrator.ts";
import type { SandboxStore } from "../../src/orchestrator/store.ts";
import { startBlockd } from "../blockdev/harness.ts";
import { nodeParts, sandboxSkipReason, serveParts } from "./harness.ts";
import { rmrf, runRoot, until } from "../vmm/harness.ts";

const skip = sandboxSkipReason();
const KEY = "e2b_" + "bd".repeat(20);
const tag = ((process.pid + 11) % 46656).toString(36).padStart(3, "0");

describe.skipIf(!!skip)("sandbox memory: layers and balloons", async () => {
  if (skip) return void test.skip(skip!, () => {});
  const { dir, client } = await startBlockd("balloon", { pool: 1 });
  const root = runRoot("balloon");
  let orch: Orchestrator;
  let pool: SlotPool;
  let store: SandboxStore;
  let base = "";
  let stopServer = () => {};
  const opts = () => ({ apiKey: KEY, apiUrl: base, sandboxUrl: base, requestTimeoutMs: 120_000 });

  beforeAll(async () => {
    // 99 %: this host always counts as under pressure, so balloons inflate and never deflate.
    // 3 memory layers at most: the third pause of a sandbox compacts.
    ({ orch, pool, store } = await nodeParts({ dir, runRoot: root, slotPrefix: `abl${tag}-`, slotCidr: `10.216.${process.pid % 250}.0/24` }, client, { balloonPressurePct: 99, memoryLayersMax: 3 }));
    const served = serveParts(orch, KEY);
    base = served.base;
    stopServer = served.stop;
    orch.startReaper(200);
  }, 300_000);

  afterAll(async () => {
    await orch?.killAll();
    orch?.close();
    stopServer();
    await pool?.destroy().catch(() => {});
    rmrf(root);
  });

  test("each pause stacks one memory layer; past the bound a pause writes one base; every file survives", async () => {
    const sbx = await Sandbox.create("busybox", opts());
    const layers = () => (store.get(sbx.sandboxId)!.runtime as { paused: { memLayers: string[] } }).paused.memLayers;
    const counts: number[] = [];
    for (let i = 1; i <= 4; i++) {
      await sbx.commands.run(`head -c 2097152 /dev/urandom > /dev/shm/m${i} && md5sum /dev/shm/m${i} > /dev/shm/m${i}.md5`);
      expect(await sbx.pause()).toBe(true);
      counts.push(layers().length);
      await Sandbox.connect(sbx.sandboxId, opts());
      const check = await sbx.commands.run(`for f in /dev/shm/m*.md5; do md5sum -c $f; done`);
      expect(check.stdout.split("\n").filter((l) => l.endsWith(": OK")).length).toBe(i);
    }
    // The template's base + 1, + 2; then 3 layers below: one fresh base; then that + 1.
    expect(counts).toEqual([2, 3, 1, 2]);
    expect(await sbx.kill()).toBe(true);
  }, 300_000);

  test("a running sandbox's balloon takes half its memory; the sandbox keeps answering", async () => {
    const sbx = await Sandbox.create("busybox", opts());
    const free = async () => Number((await sbx.commands.run("awk '/MemFree/ {print $2}' /proc/meminfo")).stdout.trim()) / 1024;
    const before = await free();
    // The reaper samples every 5 s; the guest hands its pages over in steps.
    let now = before;
    await until(async () => (now = await free()) < before - 96, 60_000, "the balloon to inflate");
    console.log(`  guest MemFree: ${before.toFixed(0)} MiB before, ${now.toFixed(0)} MiB with the balloon inflated (256 MiB guest)`);
    expect((await sbx.commands.run("echo still here")).stdout.trim()).toBe("still here");
    expect(await sbx.kill()).toBe(true);
  }, 240_000);
});
