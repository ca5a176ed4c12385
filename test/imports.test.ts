// The one-way import rule (docs/architecture.md): api → orchestrator → {vmm, network, snapshot,
// template, blockdev client} → storage → ffi. Each folder lists the folders its files may import
// from; a new folder fails here until it is given a row.
import { expect, test } from "bun:test";
import { readdirSync, readFileSync, statSync } from "node:fs";
import { dirname, join, relative, resolve } from "node:path";

const root = resolve(import.meta.dir, "..");

// Folder (relative to the repo root) → folders it may import from. The longest matching folder
// decides, so `src/blockdev/client.ts` can be allowed where the rest of blockd is not.
const allowed: Record<string, string[]> = {
  "ffi": ["ffi"],
  "src/storage": ["src/storage", "ffi"],
  "src/blockdev": ["src/blockdev", "src/storage", "ffi"],
  "src/vmm": ["src/vmm", "ffi"],
  "src/network": ["src/network", "ffi"],
  "src/snapshot": ["src/snapshot", "src/storage/s3_url.ts", "ffi"],
  // The orchestrator never touches a layer's bytes: of storage it may know only image configs.
  "src/orchestrator": ["src/orchestrator", "src/vmm", "src/network", "src/snapshot", "src/blockdev/client.ts",
    "src/blockdev/protocol.ts", "src/storage/image_config.ts", "ffi"],
  "src/api": ["src/api", "src/orchestrator"],
  // Template builds and the host-side builders of the guest's artifacts (kernel, tools disk, sealed layers);
  // OCI layer conversion asks blockd for the devices it mounts and seals (its client only).
  "src/template": ["src/template", "src/storage", "src/blockdev/client.ts", "ffi"],
  // The node's composition root wires every part together.
  "src/node": ["src", "ffi", "guest", "p2p", "package.json"],
  // A cluster's state in etcd: the client and the records nodes, gateways and the scheduler agree on.
  "src/cluster": ["src/cluster"],
  // The CLI reads a local node's settings to find its API key (src/node/config.ts).
  "src/cli": ["src/cli", "src/node/config.ts", "src/storage", "src/blockdev/client.ts", "src/blockdev/protocol.ts", "ffi", "package.json"],
  // envd is compiled into the guest's tools disk on its own: nothing of the host's code.
  "guest/envd": ["guest/envd"],
  // What runs inside the VM: nothing of the host's code (its host-side builders are src/template/artifacts.ts).
  "guest": ["guest"],
  // Peers share verified layers over iroh: the ChunkSource seam and layer files of storage, nothing above it.
  "p2p": ["p2p", "src/storage", "ffi"],
  // bench/template drives a whole node and a loopback registry through the tests' harnesses;
  // bench/remote starts the tests' s3rver; bench/memory drives VMs with the VM tests' guest helpers.
  "bench": ["bench", "src", "ffi", "guest", "test/helpers", "test/node/harness.ts", "test/template/registry_harness.ts", "test/network/harness.ts", "test/network/internet.ts", "test/snapshot/s3_server.ts", "test/vmm/harness.ts", "p2p", "services"],
  "test": ["test", "src", "ffi", "guest", "bench", "p2p", "services"],
  // Placement over the live nodes etcd lists.
  "services/scheduler": ["services/scheduler", "src/cluster"],
  // The gateway serves the node's own routes (src/api) and forwards what they ask to the owning node.
  "services/gateway": ["services/gateway", "services/scheduler", "src/cluster", "src/api", "src/orchestrator/store.ts", "package.json"],
  // `bun run cluster`: etcd, gateways and nodes on one machine (a development composition root).
  "services/cluster": ["services", "src/cluster", "src/network/command.ts", "src/blockdev/client.ts", "package.json"],
};

function ruleFor(file: string): [string, string[]] | undefined {
  let best: string | undefined;
  for (const dir of Object.keys(allowed)) {
    if ((file === dir || file.startsWith(dir + "/")) && (best === undefined || dir.length > best.length)) best = dir;
  }
  return best === undefined ? undefined : [best, allowed[best]!];
}

function sources(dir: string, out: string[] = []): string[] {
  for (const name of readdirSync(dir)) {
    if (name === "node_modules" || name.startsWith(".")) continue;
    const p = join(dir, name);
    if (statSync(p).isDirectory()) sources(p, out);
    else if (p.endsWith(".ts")) out.push(p);
  }
  return out;
}

// Static imports, re-exports, `import("…")` and `new URL("…", import.meta.url)` (Worker entry points).
const specifier = /(?:\bfrom\s*|\bimport\s*\(\s*|\bimport\s+|new URL\(\s*)["']([^"']+)["']/g;

const topLevel = ["ffi", "src", "guest", "bench", "test", "p2p", "services", "templates"];

test("every import runs one way (docs/architecture.md)", () => {
  const files = topLevel.flatMap((d) => {
    try { return sources(join(root, d)); } catch { return []; }
  });
  expect(files.length).toBeGreaterThan(50);
  const wrong: string[] = [];
  let checked = 0;
  for (const abs of files) {
    const file = relative(root, abs);
    const rule = ruleFor(file);
    if (rule === undefined) { wrong.push(`${file}: its folder has no row in test/imports.test.ts`); continue; }
    const text = readFileSync(abs, "utf8");
    for (const m of text.matchAll(specifier)) {
      const spec = m[1]!;
      if (!spec.startsWith(".")) continue; // packages and builtins
      checked++;
      const target = relative(root, resolve(dirname(abs), spec));
      const ok = rule[1].some((d) => target === d || target.startsWith(d + "/"));
      if (!ok) wrong.push(`${file} imports ${target} (${rule[0]} may import ${rule[1].join(", ")})`);
    }
  }
  expect(checked).toBeGreaterThan(200);
  expect(wrong).toEqual([]);
});

test("the rule table catches a wrong-way import", () => {
  const rule = ruleFor("src/storage/image.ts")!;
  expect(rule[0]).toBe("src/storage");
  expect(rule[1].some((d) => "src/blockdev/server.ts".startsWith(d + "/"))).toBe(false);
  expect(ruleFor("guest/envd/files.ts")![0]).toBe("guest/envd");
});
