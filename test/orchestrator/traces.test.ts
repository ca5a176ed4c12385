// Prefetch traces on a real node: the first sandbox of a template records its rootfs and memory
// devices' first reads into the template's checkpoint folder; the next sandbox's memory device
// replays its trace (blockd counts what it read), and both sandboxes work.
import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { existsSync, readFileSync } from "node:fs";
import { join } from "node:path";
import { Sandbox } from "e2b";
import { decodeTrace } from "../../src/storage/trace_file.ts";
import type { SlotPool } from "../../src/network/index.ts";
import type { Orchestrator, SandboxRuntime } from "../../src/orchestrator/orchestrator.ts";
import { MEMORY_TRACE, ROOTFS_TRACE } from "../../src/orchestrator/start_traces.ts";
import type { SandboxStore } from "../../src/orchestrator/store.ts";
import type { TemplateStore } from "../../src/orchestrator/templates.ts";
import { startBlockd } from "../blockdev/harness.ts";
import { nodeParts, sandboxSkipReason, serveParts } from "./harness.ts";
import { rmrf, runRoot, until } from "../vmm/harness.ts";

const skip = sandboxSkipReason();
const KEY = "e2b_" + "ae".repeat(20);
const tag = ((process.pid + 13) % 46656).toString(36).padStart(3, "0");
/** Recording window: a pause inside it has 60 s from envd's answer, whatever the host's load. */
const WINDOW_MS = 60_000;

describe.skipIf(!!skip)("prefetch traces of a template's starts", async () => {
  if (skip) return void test.skip(skip!, () => {});
  const { dir, client } = await startBlockd("traces", { pool: 1 });
  const root = runRoot("traces");
  let orch: Orchestrator;
  let pool: SlotPool;
  let store: SandboxStore;
  let templates: TemplateStore;
  let base = "";
  let stopServer = () => {};
  const opts = () => ({ apiKey: KEY, apiUrl: base, sandboxUrl: base, requestTimeoutMs: 120_000 });

  beforeAll(async () => {
    ({ orch, pool, store, templates } = await nodeParts({ dir, runRoot: root, slotPrefix: `atr${tag}-`, slotCidr: `10.217.${process.pid % 250}.0/24` }, client, { traceWindowMs: WINDOW_MS }));
    const served = serveParts(orch, KEY);
    base = served.base;
    stopServer = served.stop;
  }, 300_000);

  afterAll(async () => {
    await orch?.killAll();
    orch?.close();
    stopServer();
    await pool?.destroy().catch(() => {});
    rmrf(root);
  });

  test("the first start records both traces; the next one replays the memory trace", async () => {
    const first = await Sandbox.create("busybox", opts());
    expect((await first.commands.run("ls / | wc -l")).exitCode).toBe(0);
    const cp = templates.resolve("busybox")!.checkpoint!;
    const traces = [ROOTFS_TRACE, MEMORY_TRACE].map((f) => join(cp.dir, f));
    await until(() => traces.every((p) => existsSync(p)), WINDOW_MS + 20_000, "both traces written");
    const [rootfs, memory] = traces.map((p) => decodeTrace(new Uint8Array(readFileSync(p))));
    expect(rootfs!.entries.length).toBeGreaterThan(0);
    expect(rootfs!.size).toBe(templates.resolve("busybox")!.diskSizeMB * 1024 * 1024);
    expect(memory!.entries.length).toBeGreaterThan(0);
    expect(memory!.size).toBe(templates.resolve("busybox")!.memoryMB * 1024 * 1024);

    const second = await Sandbox.create("busybox", opts());
    expect((await second.commands.run("echo ok")).stdout).toBe("ok\n");
    const memDevice = (store.get(second.sandboxId)!.runtime as { memDevice: string }).memDevice;
    await until(async () => (await client.call("stats", { id: memDevice })).prefetchActive === 0, 30_000, "the memory prefetch to end");
    const s = await client.call("stats", { id: memDevice });
    expect(s.prefetchPlanned).toBe(memory!.entries.length);
    expect(s.prefetchErrors).toBe(0);
    expect(await second.kill()).toBe(true);
    expect(await first.kill()).toBe(true);
  }, 300_000);

  test("a sandbox paused inside its recording window leaves its rootfs trace as far as it got", async () => {
    // A snapshot's checkpoint has no traces yet: its first start records them.
    const src = await Sandbox.create("busybox", opts());
    const snap = await src.createSnapshot();
    expect(await src.kill()).toBe(true);
    const cpDir = templates.resolve(snap.snapshotId.replace(/:default$/, ""))!.checkpoint!.dir;
    const s = await Sandbox.create(snap.snapshotId, opts());
    const rootfsDevice = (store.get(s.sandboxId)!.runtime as SandboxRuntime).rootfsDevice!;
    expect((await client.call("stats", { id: rootfsDevice })).traceEntries).toBeGreaterThan(0);
    expect(existsSync(join(cpDir, ROOTFS_TRACE))).toBe(false);
    // The pause restacks the device, which would drop the recording: it is written first, inside
    // the window (WINDOW_MS after envd answered).
    expect(await s.pause()).toBe(true);
    await until(() => existsSync(join(cpDir, ROOTFS_TRACE)), 1_000, "the rootfs trace written at the pause");
    expect(decodeTrace(new Uint8Array(readFileSync(join(cpDir, ROOTFS_TRACE)))).entries.length).toBeGreaterThan(0);
    expect(await Sandbox.kill(s.sandboxId, opts())).toBe(true);
    expect(await Sandbox.deleteSnapshot(snap.snapshotId, opts())).toBe(true);
  }, 300_000);
});
