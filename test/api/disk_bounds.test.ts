// The node's disk bounds without a VM: a create below disk_reserve_mb of free space, or of a
// template whose disk is above max_disk_size_mb, is 507 {code, message}; /metrics exports each
// sandbox's upper layer bytes on disk (allocated blocks, not apparent sizes).
import { afterAll, describe, expect, test } from "bun:test";
import { mkdirSync, writeFileSync } from "node:fs";
import { statfs, truncate } from "node:fs/promises";
import { join } from "node:path";
import { createApi } from "../../src/api/app.ts";
import { nodeRoutes } from "../../src/api/nodes.ts";
import { sandboxRoutes } from "../../src/api/sandboxes.ts";
import { sandboxUpperBytes } from "../../src/node/upper_usage.ts";
import { checkDiskReserve, checkDiskSize } from "../../src/orchestrator/disk_guard.ts";
import { OrchestratorError, type Orchestrator } from "../../src/orchestrator/orchestrator.ts";
import { SandboxStore, type SandboxRecord } from "../../src/orchestrator/store.ts";
import { TemplateStore } from "../../src/orchestrator/templates.ts";
import { scratchDir } from "../helpers/tmp.ts";

const KEY = "e2b_" + "9c".repeat(20);
const MiB = 2 ** 20;

const rejection = async (p: Promise<unknown> | (() => unknown)) => {
  try {
    await (typeof p === "function" ? p() : p);
  } catch (e) {
    return e as OrchestratorError;
  }
  throw new Error("expected a rejection");
};

describe("disk bounds of creates", () => {
  const home = scratchDir("disk-bounds");

  test("checkDiskReserve: 507 naming the setting when less than the reserve is free; passes otherwise", async () => {
    const fs = await statfs(home);
    const free = fs.bavail * fs.bsize;
    const e = await rejection(checkDiskReserve(home, free + 1024 * MiB));
    expect(e).toBeInstanceOf(OrchestratorError);
    expect(e.status).toBe(507);
    expect(e.message).toContain("disk_reserve_mb");
    expect(e.message).toContain(home);
    await checkDiskReserve(home, 0);
  });

  test("checkDiskSize: 507 above max_disk_size_mb", async () => {
    checkDiskSize(65536, 65536, "base");
    const e = await rejection(() => checkDiskSize(65537, 65536, "big"));
    expect(e.status).toBe(507);
    expect(e.message).toBe("template 'big' has a disk of 65537 MiB, more than this node's max_disk_size_mb (65536 MiB)");
  });

  test("a create the reserve refuses answers 507 {code, message}", async () => {
    const orch = { create: () => checkDiskReserve(home, Number.MAX_SAFE_INTEGER) } as unknown as Orchestrator;
    const api = createApi({ apiKey: KEY, maxBodyBytes: 4096, notReadyReason: () => undefined, version: "0.0.0-test" })
      .use(sandboxRoutes(() => orch, { domain: null, defaultTimeoutS: 300 }))
      .listen({ hostname: "127.0.0.1", port: 0 });
    try {
      const r = await fetch(`http://127.0.0.1:${api.server!.port}/sandboxes`, { method: "POST", headers: { "x-api-key": KEY, "content-type": "application/json" }, body: JSON.stringify({ templateID: "base" }) });
      expect(r.status).toBe(507);
      const body = (await r.json()) as { code: number; message: string };
      expect(body.code).toBe(507);
      expect(body.message).toContain("disk_reserve_mb");
    } finally {
      api.stop(true);
    }
  });
});

describe("/metrics: each sandbox's upper layer on disk", () => {
  const home = scratchDir("upper-metrics");
  const store = new SandboxStore(join(home, "node.db"));
  const templates = new TemplateStore(store.db);
  afterAll(() => store.close());
  const rec = (id: string): SandboxRecord => ({
    id, state: "running", templateId: "base", alias: "base", metadata: {}, envVars: {}, startedAt: store.nextStartedAt(), endAt: Date.now() + 60_000,
    cpuCount: 1, memoryMB: 256, diskSizeMB: 1024, envdVersion: "0.6.13", envdAccessToken: "t", trafficAccessToken: null, autoPause: false,
    autoResume: false, allowInternetAccess: null, network: null, runtime: null, customExtensionParams: {},
  });

  test("sandboxUpperBytes counts allocated blocks of every upper folder's data and index files; aenv_sandbox_upper_bytes exports it", async () => {
    const a = "a".repeat(20);
    const b = "b".repeat(20);
    store.insert(rec(a));
    store.insert(rec(b));
    const upper = join(home, "sandboxes", a, "upper");
    const held = join(home, "sandboxes", a, "upper-x1y2z3");
    mkdirSync(upper, { recursive: true });
    mkdirSync(held, { recursive: true });
    writeFileSync(join(upper, "writable_data"), new Uint8Array(3 * MiB).fill(7));
    writeFileSync(join(upper, "writable_index"), new Uint8Array(64 * 1024).fill(1));
    writeFileSync(join(held, "writable_data"), new Uint8Array(MiB).fill(7));
    // Sparse: 1 GiB apparent, nothing allocated.
    writeFileSync(join(held, "writable_index"), "");
    await truncate(join(held, "writable_index"), 1024 * MiB);
    writeFileSync(join(home, "sandboxes", a, "not-an-upper"), new Uint8Array(MiB));
    const bytes = await sandboxUpperBytes(home, a);
    expect(bytes).toBeGreaterThanOrEqual(4 * MiB + 64 * 1024);
    expect(bytes).toBeLessThan(5 * MiB);
    expect(await sandboxUpperBytes(home, b)).toBe(0);
    expect(await sandboxUpperBytes(home, "../x")).toBe(0);

    const api = createApi({ apiKey: KEY, maxBodyBytes: 4096, notReadyReason: () => undefined, version: "0.0.0-test" })
      .use(nodeRoutes({ store, templates, orch: () => undefined, status: () => "ready", openStreams: () => undefined, version: "0.0.0-test", home, upperBytes: (id) => sandboxUpperBytes(home, id) }))
      .listen({ hostname: "127.0.0.1", port: 0 });
    try {
      const text = await (await fetch(`http://127.0.0.1:${api.server!.port}/metrics`)).text();
      expect(text).toContain("# TYPE aenv_sandbox_upper_bytes gauge");
      expect(text).toContain(`aenv_sandbox_upper_bytes{sandbox="${a}"} ${bytes}\n`);
      expect(text).toContain(`aenv_sandbox_upper_bytes{sandbox="${b}"} 0\n`);
    } finally {
      api.stop(true);
    }
  });
});
