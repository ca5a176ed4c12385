// Time to first command on a cold node, with and without the template's boot trace, at the node:
// node A builds a template from a busybox image whose ready command reads --files files (64–512 KiB
// each, 112 MiB by default) and pushes it to a loopback docker-registry with its boot trace;
// a copy of the manifest without the trace's annotations names the same blobs. Each round starts a
// fresh node B (empty home and block cache, AENV_BLOCK_CACHE_DOWNLOAD=0, no peers) per side and
// times POST /sandboxes-cold → the first command's output (a read of those files), counting the
// layer bytes the registry served until then. B reaches the registry through a proxy in this
// process that holds each answer --delay ms (an origin's round trip; loopback has none).
//   npx bun bench/remote/prefetch_node.ts [--delay 0,20] [--rounds 3] [--files 384] [--verbose]
import { randomBytes } from "node:crypto";
import { chmodSync, mkdirSync, readdirSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { Sandbox } from "e2b";
import { BlockdClient } from "../../src/blockdev/client.ts";
import { RegistryClient } from "../../src/template/registry.ts";
import { MEDIA } from "../../src/template/registry/manifest.ts";
import { prng } from "../../test/helpers/tmp.ts";
import { FIRST_START_MS, nodeSetup, nodeSkipReason, startNode, stopNode, type NodeProc, type NodeSetup } from "../../test/node/harness.ts";
import { BUSYBOX_CONFIG, blobBytesServed, busyboxRoot, pushImage, registrySkipReason, startRegistry } from "../../test/template/registry_harness.ts";

const argv = process.argv.slice(2);
const arg = (name: string, dflt: string) => {
  const i = argv.indexOf(`--${name}`);
  return i >= 0 ? argv[i + 1]! : dflt;
};
const DELAYS = arg("delay", "0,20").split(",").map(Number);
const ROUNDS = Number(arg("rounds", "3"));
const FILES = Number(arg("files", "384"));
/** Print B's log lines during each cold start, with the ms since the POST they showed up at. */
const VERBOSE = argv.includes("--verbose");
const KEY_A = "e2b_" + "d4".repeat(20);
const KEY_B = "e2b_" + "e5".repeat(20);
const MiB = 2 ** 20;
/** A build (pull, convert, boot, ready, checkpoint) and a cold start each end within this. */
const STEP_MS = 10 * 60_000;
/** The first command reads the files in name order: what the template's ready command read on A. */
const READ = "cat /data/f/* | md5sum";

const skip = nodeSkipReason() ?? registrySkipReason();
if (skip) {
  console.log(`skipped: ${skip}`);
  process.exit(0);
}

const dir = join("/var/tmp/aenv-bench", `prefetch-node-${process.pid}`);
mkdirSync(dir, { recursive: true });
const reg = await startRegistry({ dir: join(dir, "registry"), accessLog: true });
const client = new RegistryClient({ dockerConfigPath: null, insecureRegistries: [reg.host] });

/** The proxy B pulls through: each answer waits `delayMs`, then the registry's answer streams on. */
let delayMs = 0;
const proxy = Bun.serve({
  hostname: "127.0.0.1",
  port: 0,
  idleTimeout: 120,
  async fetch(req) {
    const u = new URL(req.url);
    const headers = new Headers(req.headers);
    headers.delete("host");
    const up = await fetch(`http://${reg.host}${u.pathname}${u.search}`, {
      method: req.method, headers, redirect: "manual",
      ...(req.method === "GET" || req.method === "HEAD" ? {} : { body: await req.arrayBuffer() }),
      signal: AbortSignal.timeout(60_000),
    });
    if (delayMs > 0) await Bun.sleep(delayMs);
    return new Response(up.body, { status: up.status, headers: up.headers });
  },
});
const via = `127.0.0.1:${proxy.port}`;

const post = (n: NodeProc, key: string, path: string, body: unknown) =>
  fetch(`${n.base}${path}`, { method: "POST", body: JSON.stringify(body), headers: { "x-api-key": key, "content-type": "application/json" }, signal: AbortSignal.timeout(STEP_MS) });
const sdk = (n: NodeProc, key: string) => ({ apiKey: key, apiUrl: n.base, sandboxUrl: n.base, requestTimeoutMs: 180_000 });

/** Node processes of this home (`bun src/node/main.ts` with AENV_HOME=home), from /proc. */
function nodePids(home: string): number[] {
  const out: number[] = [];
  for (const d of readdirSync("/proc")) {
    if (!/^\d+$/.test(d)) continue;
    try {
      const cmd = readFileSync(`/proc/${d}/cmdline`, "utf8");
      if (cmd.includes("src/node/main.ts") && readFileSync(`/proc/${d}/environ`, "utf8").split("\0").includes(`AENV_HOME=${home}`)) out.push(Number(d));
    } catch {} // gone, or not ours to read
  }
  return out;
}

/** A template built on A from `image` whose ready command reads the files; its ID. */
async function buildOnA(a: NodeProc, image: string): Promise<string> {
  const req = await post(a, KEY_A, "/v3/templates", { name: "traced" });
  if (req.status !== 202) throw new Error(`POST /v3/templates: ${req.status} ${await req.text()}`);
  const { templateID, buildID } = (await req.json()) as { templateID: string; buildID: string };
  const start = await post(a, KEY_A, `/v2/templates/${templateID}/builds/${buildID}`, { fromImage: image, readyCmd: `${READ} > /dev/null` });
  if (start.status !== 202) throw new Error(`starting the build: ${start.status} ${await start.text()}`);
  const until = Date.now() + STEP_MS;
  for (;;) {
    const s = (await (await fetch(`${a.base}/templates/${templateID}/builds/${buildID}/status`, { headers: { "x-api-key": KEY_A } })).json()) as { status: string; reason?: { message: string } };
    if (s.status === "ready") return templateID;
    if (s.status === "error") throw new Error(`the build failed: ${s.reason?.message}`);
    if (Date.now() > until) throw new Error("the build did not finish");
    await Bun.sleep(500);
  }
}

let a: NodeProc | undefined;
const setupA = nodeSetup("pfa", 243, KEY_A, { AENV_INSECURE_REGISTRIES: reg.host });
try {
  // The image: busybox, a bash that is busybox's sh (the build's login shell), the files the boot reads, and 16 MiB nobody reads.
  const root = await busyboxRoot(join(dir, "root"));
  writeFileSync(join(root, "bin/bash"), '#!/bin/sh\nexec /bin/busybox sh "$@"\n');
  chmodSync(join(root, "bin/bash"), 0o755);
  mkdirSync(join(root, "data/f"), { recursive: true });
  const rnd = prng(7);
  const hasher = new Bun.CryptoHasher("md5");
  let readBytes = 0;
  const names = Array.from({ length: FILES }, (_, i) => `${String(i).padStart(4, "0")}`);
  for (const name of names) {
    const size = (64 + Math.floor(rnd() * 449)) * 1024;
    const bytes = randomBytes(size);
    writeFileSync(join(root, "data/f", name), bytes);
    hasher.update(bytes);
    readBytes += size;
  }
  const md5 = hasher.digest("hex");
  writeFileSync(join(root, "data/unread"), randomBytes(16 * MiB));
  const image = `${reg.host}/pf/busybox:1`;
  await pushImage(client, image, { layers: [root], config: BUSYBOX_CONFIG, compression: "none" });

  a = await startNode(setupA.env, FIRST_START_MS);
  const templateID = await buildOnA(a, image);
  const traced = `${reg.host}/pf/traced:1`;
  const pushed = await post(a, KEY_A, `/templates/${templateID}/push`, { ref: traced });
  const answer = (await pushed.json()) as { manifestDigest: string; layers: { digest: string; size: number }[]; trace?: { digest: string; size: number } };
  if (pushed.status !== 200 || !answer.trace) throw new Error(`push: ${pushed.status} ${JSON.stringify(answer)}`);
  await stopNode(a, setupA);
  a = undefined;
  // The same blobs without the trace: its manifest less the annotations, in the same repository (a registry links blobs per repository).
  const manifest = JSON.parse(new TextDecoder().decode((await client.getManifest(traced)).bytes)) as Record<string, unknown>;
  delete manifest.annotations;
  const plain = `${reg.host}/pf/traced:plain`;
  await client.pushManifest(plain, manifest, MEDIA.ociManifest);
  const digests = answer.layers.map((l) => l.digest);
  const layerBytes = answer.layers.reduce((s, l) => s + l.size, 0);
  console.log(`template: ${answer.layers.length} layers, ${(layerBytes / MiB).toFixed(1)} MiB; the ready command reads ${FILES} files, ${(readBytes / MiB).toFixed(1)} MiB; boot trace ${answer.trace.size} bytes`);

  /** One fresh node B: POST /sandboxes-cold of `ref` (through the proxy) to the first command's output. */
  const coldStart = async (ref: string): Promise<{ ms: number; bytes: number; createMs: number }> => {
    const setupB: NodeSetup = nodeSetup("pfb", 244, KEY_B, { AENV_BLOCK_CACHE_DOWNLOAD: "0", AENV_P2P: "0", AENV_INSECURE_REGISTRIES: `${reg.host},${via}` });
    let b: NodeProc | undefined;
    try {
      b = await startNode(setupB.env, FIRST_START_MS);
      const node = b;
      const before = await blobBytesServed(reg, digests);
      const t0 = performance.now();
      const seen: string[] = [];
      let at = b.log.length;
      // --verbose: B's log lines and its devices' prefetch counters as they change.
      const bd = VERBOSE ? await BlockdClient.connect(join(setupB.home, "blockd", "blockd.sock"), { timeoutMs: 5_000 }) : undefined;
      const last = new Map<string, string>();
      let polling = false;
      const sample = VERBOSE ? setInterval(() => {
        const ms = (performance.now() - t0).toFixed(0);
        for (; at < node.log.length; at++) seen.push(`    +${ms} ms ${node.log[at]!.slice(0, 200)}`);
        if (polling || !bd) return;
        polling = true;
        void (async () => {
          for (const d of await bd.call<{ id: string }[]>("list")) {
            const st = await bd.call<Record<string, number>>("stats", { id: d.id }).catch(() => undefined);
            if (st?.prefetchPlanned === undefined) continue;
            const line = `planned ${st.prefetchPlanned} fetched ${st.prefetchFetched} skipped ${st.prefetchSkipped} bytes ${st.prefetchBytes} errors ${st.prefetchErrors} active ${st.prefetchActive}`;
            if (last.get(d.id) !== line) seen.push(`    +${(performance.now() - t0).toFixed(0)} ms device ${d.id}: ${line}`), last.set(d.id, line);
          }
        })().catch(() => {}).finally(() => (polling = false));
      }, 20) : undefined;
      const made = await post(b, KEY_B, "/sandboxes-cold", { image: ref.replace(reg.host, via) });
      if (made.status !== 201) throw new Error(`POST /sandboxes-cold: ${made.status} ${await made.text()}`);
      const { sandboxID } = (await made.json()) as { sandboxID: string };
      const createMs = performance.now() - t0;
      const sbx = await Sandbox.connect(sandboxID, sdk(b, KEY_B));
      const r = await sbx.commands.run(READ, { timeoutMs: 300_000 });
      const ms = performance.now() - t0;
      if (r.stdout.trim() !== `${md5}  -`) throw new Error(`the first command read ${r.stdout.trim()}, not ${md5}`);
      clearInterval(sample);
      bd?.close();
      if (VERBOSE) console.log(seen.join("\n"));
      const bytes = (await blobBytesServed(reg, digests)) - before;
      const failed = b.log.filter((l) => /orchestrator: (prefetch|recording|writing the boot trace)|prefetch trace .* ignored/.test(l));
      if (failed.length) console.log(`  B said: ${failed.slice(0, 3).join(" | ")}`);
      return { ms, bytes, createMs };
    } finally {
      // A node whose start failed is still running: the harness does not stop it.
      if (!b) for (const pid of nodePids(setupB.home)) process.kill(pid, "SIGTERM");
      await stopNode(b, setupB);
    }
  };

  const median = (xs: number[]) => [...xs].sort((x, y) => x - y)[Math.floor(xs.length / 2)]!;
  const range = (xs: number[], f: (x: number) => string) => `${f(Math.min(...xs))}–${f(Math.max(...xs))}`;
  const mib = (x: number) => (x / MiB).toFixed(1);
  const rows: string[] = [];
  for (const d of DELAYS) {
    delayMs = d;
    const off: { ms: number; bytes: number; createMs: number }[] = [];
    const on: { ms: number; bytes: number; createMs: number }[] = [];
    for (let r = 0; r < ROUNDS; r++) {
      // Sides alternate: this host drifts, so neither may always go first.
      for (const withTrace of r % 2 === 0 ? [false, true] : [true, false]) {
        const x = await coldStart(withTrace ? traced : plain);
        (withTrace ? on : off).push(x);
        console.log(`  delay ${d} ms, round ${r + 1}, ${withTrace ? "with" : "without"} the trace: ${(x.ms / 1000).toFixed(2)} s (the create answered at ${(x.createMs / 1000).toFixed(2)} s), ${mib(x.bytes)} MiB from the registry`);
      }
    }
    const ratios = off.map((o, i) => on[i]!.ms / o.ms);
    const s = (xs: { ms: number }[]) => `${(median(xs.map((x) => x.ms)) / 1000).toFixed(2)} s (${range(xs.map((x) => x.ms / 1000), (x) => x.toFixed(2))})`;
    // The create's answer to the command's output: where the files' reads land (the trace's gain, less the VM's noise).
    const cmd = (xs: { ms: number; createMs: number }[]) => s(xs.map((x) => ({ ms: x.ms - x.createMs })));
    rows.push(`| ${d} ms | ${s(off)} | ${cmd(off)} | ${range(off.map((x) => x.bytes), mib)} | ${s(on)} | ${cmd(on)} | ${range(on.map((x) => x.bytes), mib)} | ${median(ratios).toFixed(2)}× (${range(ratios, (x) => x.toFixed(2))}) |`);
  }
  console.log(`${ROUNDS} rounds, a fresh node B per side and round`);
  console.log("| origin delay | without the trace: POST → first output | of it, the command | MiB from the registry | with it | of it, the command | MiB from the registry | ratio of the totals (with/without) |");
  console.log("|---|---|---|---|---|---|---|---|");
  for (const r of rows) console.log(r);
} finally {
  if (a) await stopNode(a, setupA);
  proxy.stop(true);
  await reg.stop();
  rmSync(dir, { recursive: true, force: true });
}
