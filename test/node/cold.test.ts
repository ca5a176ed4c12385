// POST /sandboxes-cold (AgentENV's): a sandbox straight from an OCI image in a loopback registry.
// The first create pulls, converts and boots the image once into a `cold-…` template; racing
// creates of the same image share that build; later creates restore it. Bad input is refused
// before any build starts; an image the registry does not have is a 400 naming it.
import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { chmodSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { Sandbox } from "e2b";
import { RegistryClient } from "../../src/template/registry.ts";
import { scratchDir } from "../helpers/tmp.ts";
import { BUSYBOX_CONFIG, busyboxRoot, pushImage, registrySkipReason, registrySuite } from "../template/registry_harness.ts";
import { FIRST_START_MS, nodeSetup, nodeSkipReason, startNode, stopNode, type NodeProc } from "./harness.ts";

const skip = nodeSkipReason() ?? registrySkipReason();
const KEY = "e2b_" + "c0".repeat(20);
const BUILD_MS = 10 * 60_000;

describe.skipIf(!!skip)("sandboxes from an OCI image (POST /sandboxes-cold)", () => {
  if (skip) return void test.skip(skip!, () => {});
  const setup = nodeSetup("cld", 233, KEY);
  const registry = registrySuite("cold-registry");
  let node: NodeProc;
  const api = (path: string, body: unknown) =>
    fetch(`${node.base}${path}`, { method: "POST", body: JSON.stringify(body), headers: { "x-api-key": KEY, "content-type": "application/json" } });
  const opts = () => ({ apiKey: KEY, apiUrl: node.base, sandboxUrl: node.base, requestTimeoutMs: 180_000 });
  const coldTemplates = async () => {
    const r = await fetch(`${node.base}/templates`, { headers: { "x-api-key": KEY } });
    return ((await r.json()) as { templateID: string; aliases: string[] }[]).filter((t) => t.aliases.some((a) => a.startsWith("cold-")));
  };

  beforeAll(async () => {
    setup.env.AENV_INSECURE_REGISTRIES = registry().insecure.join(",");
    node = await startNode(setup.env, FIRST_START_MS);
  }, FIRST_START_MS + 60_000);
  afterAll(() => stopNode(node, setup), 180_000);

  test("the first creates build the image's template once (racing ones share it), later ones restore it; the sandbox runs with the image's Env and WorkingDir", async () => {
    const { reg } = registry();
    // A busybox image; /bin/bash hands over to busybox's sh (the SDK's commands run bash).
    const root = await busyboxRoot(join(scratchDir("cold-image"), "root"));
    writeFileSync(join(root, "bin/bash"), '#!/bin/sh\nexec /bin/busybox sh "$@"\n');
    chmodSync(join(root, "bin/bash"), 0o755);
    const ref = `${reg.host}/cold/busybox:1`;
    await pushImage(new RegistryClient({ dockerConfigPath: null, insecureRegistries: [reg.host] }), ref, { layers: [root], config: BUSYBOX_CONFIG });

    const [a, b] = await Promise.all([1, 2].map(() => api("/sandboxes-cold", { image: ref, timeout: 300, metadata: { via: "cold" } })));
    expect([a!.status, b!.status]).toEqual([201, 201]);
    const [sa, sb] = (await Promise.all([a!.json(), b!.json()])) as { sandboxID: string; templateID: string }[];
    expect(sa!.templateID).toBe(sb!.templateID);
    expect(sa!.sandboxID).not.toBe(sb!.sandboxID);
    expect(a!.headers.get("x-agentenv-sandbox-id")).toBe(sa!.sandboxID);
    const cold = await coldTemplates();
    expect(cold.map((t) => t.templateID)).toEqual([sa!.templateID]);

    const sbx = await Sandbox.connect(sa!.sandboxID, opts());
    const r = await sbx.commands.run("pwd; echo $FOO");
    expect(r.stdout).toBe("/work\nbar\n");
    expect((await sbx.getInfo()).metadata).toEqual({ via: "cold" });

    // A later create of the same image and size is a restore of the same template.
    const again = await api("/sandboxes-cold", { image: ref });
    expect(again.status).toBe(201);
    const sc = (await again.json()) as { templateID: string; sandboxID: string };
    expect(sc.templateID).toBe(sa!.templateID);
    expect((await coldTemplates()).length).toBe(1);
    for (const id of [sa!.sandboxID, sb!.sandboxID, sc.sandboxID]) await Sandbox.kill(id, opts());
  }, BUILD_MS);

  test("bad input is refused before any build: missing or empty image, diskSizeMB, attached drives, boot args, wrong types; an image the registry lacks is a 400 naming it", async () => {
    const before = (await coldTemplates()).length;
    for (const [body, field] of [
      [{}, "image"],
      [{ image: "" }, "image"],
      [{ image: "x/y:1", diskSizeMB: 2048 }, "diskSizeMB"],
      [{ image: "x/y:1", attachedDrives: [{ driveID: "d" }] }, "attachedDrives"],
      [{ image: "x/y:1", extraBootArgs: "quiet" }, "extraBootArgs"],
      [{ image: "x/y:1", cpuCount: "two" }, "cpuCount"],
      [{ image: "x/y:1", memoryMB: 64 }, "memoryMB"],
    ] as const) {
      const r = await api("/sandboxes-cold", body);
      const out = (await r.json()) as { code: number; message: string };
      expect({ body, status: r.status, code: out.code }).toEqual({ body, status: 400, code: 400 });
      expect(out.message).toContain(field);
    }
    const { reg } = registry();
    const missing = `${reg.host}/cold/absent:1`;
    const r = await api("/sandboxes-cold", { image: missing });
    const out = (await r.json()) as { code: number; message: string };
    expect(r.status).toBe(400);
    expect(out.message).toContain(missing);
    expect((await coldTemplates()).length).toBe(before);
  }, BUILD_MS);
});
