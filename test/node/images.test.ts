// The node's image pulls (src/node/images.ts) on real parts: its settings, a blockd started here,
// Debian's docker-registry on loopback, the node's sqlite tables. A pull collects the layer cache
// first: between the watermarks of AENV_LAYER_CACHE_MB the least recently used layers go, but never
// one a template, a snapshot's checkpoint or a sandbox references.
import { describe, expect, test } from "bun:test";
import { existsSync, writeFileSync } from "node:fs";
import { utimes, writeFile } from "node:fs/promises";
import { join } from "node:path";
import { loadConfig } from "../../src/node/config.ts";
import { nodeImages } from "../../src/node/images.ts";
import { SandboxStore } from "../../src/orchestrator/store.ts";
import { TemplateStore, type TemplateRecord } from "../../src/orchestrator/templates.ts";
import { RegistryClient } from "../../src/template/registry.ts";
import { haveFuse, haveLoop, startBlockd } from "../blockdev/harness.ts";
import { scratchDir } from "../helpers/tmp.ts";
import { BUSYBOX_CONFIG, busyboxRoot, pushImage, registrySkipReason, startRegistry } from "../template/registry_harness.ts";

describe("the image-layer cache's capacity", () => {
  test("AENV_LAYER_CACHE_MB or node.toml's layer_cache_mb, 64 GiB by default; out of range is an error naming it", () => {
    const home = scratchDir("layer-cache-cfg");
    expect(loadConfig({ AENV_HOME: home }).layerCacheMB).toBe(65536);
    writeFileSync(join(home, "node.toml"), "layer_cache_mb = 2048\n");
    expect(loadConfig({ AENV_HOME: home }).layerCacheMB).toBe(2048);
    expect(loadConfig({ AENV_HOME: home, AENV_LAYER_CACHE_MB: "4096" }).layerCacheMB).toBe(4096);
    expect(() => loadConfig({ AENV_HOME: home, AENV_LAYER_CACHE_MB: "10" })).toThrow(/AENV_LAYER_CACHE_MB=10/);
  });
});

const skip = !(haveFuse && haveLoop) ? "needs root, /dev/fuse and /dev/loop-control" : registrySkipReason();
describe.skipIf(!!skip)(skip ? `the node's image pulls (skipped: ${skip})` : "the node's image pulls", async () => {
  if (skip) return void test.skip(skip, () => {});
  const { dir, client: blockd } = await startBlockd("node-images");
  const reg = await startRegistry({ dir: join(dir, "registry") });

  test("a pull collects between the watermarks: layers a template, a snapshot's checkpoint or a sandbox references stay, the least recently used others go; the image's config comes through", async () => {
    try {
      const store = new SandboxStore(join(dir, "node.db"));
      const templates = new TemplateStore(store.db);
      const logs: string[] = [];
      const { cache, source } = nodeImages({ dir: join(dir, "image-layers"), capacityMB: 64, templates, sandboxes: store, blockd, registry: { dockerConfigPath: null, insecureRegistries: [reg.host] } });
      expect(cache.capacityBytes).toBe(64 * 2 ** 20);
      await cache.init();
      // Eight 8 MiB layers, oldest first: 64 MiB, above 90 % of 64 MiB.
      const layers = Array.from({ length: 8 }, (_, i) => cache.layerPath(`sha256:${String(i).repeat(64)}`));
      for (const [i, l] of layers.entries()) {
        await writeFile(l, new Uint8Array(8 << 20).fill(1));
        const t = new Date(Date.UTC(2020, 0, 1 + i));
        await utimes(l, t, t);
      }
      const rec = (id: string, kind: TemplateRecord["kind"], stack: string[], checkpoint: string[] | null): TemplateRecord => ({
        id, alias: id, kind, names: [`${id}:default`], cpuCount: 1, memoryMB: 256, diskSizeMB: 64, layers: stack,
        checkpoint: checkpoint ? { dir: join(dir, "cp", id), layers: checkpoint, envdToken: null } : null,
        sourceSandboxId: null, envdVersion: "0.6.13", createdAt: Date.now(),
      });
      // 0: a template's stack; 1: only in a snapshot's checkpoint; 2: a paused sandbox's checkpoint.
      templates.insert(rec("tpl", "template", [layers[0]!], null));
      templates.insert(rec("snap", "snapshot", [], [layers[1]!]));
      store.insert({
        id: "sbx1", state: "paused", templateId: "tpl", alias: null, metadata: {}, envVars: {}, startedAt: Date.now(), endAt: Date.now() + 60_000,
        cpuCount: 1, memoryMB: 256, diskSizeMB: 64, envdVersion: "0.6.13", envdAccessToken: "t", trafficAccessToken: null, autoPause: true,
        autoResume: false, allowInternetAccess: null, network: null,
        runtime: { slot: null, toolsDevice: null, rootfsDevice: null, upperDir: null, layers: [], vmPid: null, runDir: null, checkpoints: [], paused: { dir: join(dir, "cp", "sbx1"), layers: [layers[2]!], envdToken: null } },
      });

      const root = await busyboxRoot(join(dir, "root"));
      const config = { ...BUSYBOX_CONFIG, Entrypoint: ["/bin/sh", "-c"], ExposedPorts: { "8080/tcp": {} }, Labels: { "org.example.k": "v" } };
      const img = await pushImage(new RegistryClient({ dockerConfigPath: null, insecureRegistries: [reg.host] }), `${reg.host}/gc/busybox:1`, { layers: [root], config });
      const pulled = await source.pull(img.ref, undefined, (m) => logs.push(m), new AbortController().signal);

      // 64 MiB → at most 70 % (44.8 MiB): 3, 4 and 5 go; 0, 1, 2 are referenced; 6 and 7 are newer.
      expect(layers.map((l) => existsSync(l))).toEqual([true, true, true, false, false, false, true, true]);
      expect(cache.stats.collected).toBe(3);
      expect(pulled.layers.every((l) => typeof l === "string" && existsSync(l))).toBe(true);
      expect(pulled).toMatchObject({ env: { FOO: "bar" }, workdir: "/work", entrypoint: ["/bin/sh", "-c"], cmd: ["/bin/sh"], exposedPorts: ["8080/tcp"], labels: { "org.example.k": "v" } });
      expect(logs.at(-1)).toMatch(/^pull done: 1\/1 layers \(0 cached\), [\d.]+\/[\d.]+ MiB, [\d.]+ MiB\/s$/);

      // Below the high watermark now: the next pull collects nothing, the pulled layers are cached.
      const again = await source.pull(img.ref, undefined, () => {}, new AbortController().signal);
      expect(again.layers).toEqual(pulled.layers);
      expect(cache.stats.collected).toBe(3);
      store.close();
    } finally {
      await reg.stop();
    }
  }, 120_000);
});
