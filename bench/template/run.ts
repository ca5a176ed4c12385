// Template benchmarks (issue 10), each against a baseline measured in the same run:
// - convert: our OCI layer converter (the empty ext4 layer, then per layer a blockd device, the tar
//   applied on a worker, sealed by restack, fsync'd) vs GNU tar extracting the same gzip'd layers
//   onto a plain ext4 image (mkfs, loop mount, umount, fsync); real content (pieces of /usr/lib and
//   /usr/share), the blobs in the page cache before either side runs, nothing converted before a
//   round; --rounds rounds alternating which side goes first; medians; target ≥ 0.8×;
// - pull: a never-seen image pushed to a loopback docker-registry, made a template by the node's
//   pull route (the e2b SDK's Template.build fromImage, the request `aenv pull` sends), then a
//   sandbox's first command: split into pull (resolve, download), convert, build, first command;
// - rebuild: a template with steps built, then built again unchanged (every step from the cache).
// The pull and rebuild rows run a whole `bun run node` (test/node/harness.ts).
//   npx bun bench/template/run.ts [--rounds N] [--only convert,pull,rebuild] [--json]
import { chmodSync, mkdirSync, mkdtempSync, rmSync, statSync } from "node:fs";
import { readFile } from "node:fs/promises";
import { join } from "node:path";
import { Sandbox, Template, type LogEntry } from "e2b";
import { BlockdClient } from "../../src/blockdev/client.ts";
import { convertLayer, DEFAULT_DISK_BYTES, emptyExt4Layer, MKFS_ARGS, type ConvertContext, type ConvertedLayer } from "../../src/template/convert.ts";
import { LayerCache, syncPath } from "../../src/template/layer_cache.ts";
import { diffIdOf } from "../../src/template/layer_stream.ts";
import { RegistryClient } from "../../src/template/registry.ts";
import { FIRST_START_MS, nodeSetup, nodeSkipReason, startNode, stopNode, type NodeProc } from "../../test/node/harness.ts";
import { BUSYBOX_CONFIG, busyboxRoot, pushImage, registrySkipReason, startRegistry } from "../../test/template/registry_harness.ts";

const argv = process.argv.slice(2);
const arg = (name: string, dflt: number) => {
  const i = argv.indexOf(`--${name}`);
  return i >= 0 ? Number(argv[i + 1]) : dflt;
};
const ROUNDS = arg("rounds", 5);
const ROWS = ["convert", "pull", "rebuild"];
const only = argv.includes("--only") ? (argv[argv.indexOf("--only") + 1] ?? "").split(",") : ROWS;
for (const r of only) if (!ROWS.includes(r)) throw new Error(`--only: ${r} is not one of ${ROWS.join(", ")}`);
const want = (row: string) => only.includes(row);
/** Layers of the conversion row: what images carry (a language runtime, docs and locales, a toolchain). */
const LAYER_DIRS = [["usr/lib/python3.11", "usr/lib/python3"], ["usr/share/doc", "usr/share/man", "usr/share/locale"], ["usr/lib/gcc", "usr/share/perl"]];
const SBIN_PATH = `${process.env.PATH}:/usr/local/sbin:/usr/sbin:/sbin`;
const KEY = "e2b_" + "be".repeat(20);

const median = (xs: number[]) => [...xs].sort((a, b) => a - b)[Math.floor(xs.length / 2)]!;
const r1 = (x: number) => Math.round(x * 10) / 10;
const r2 = (x: number) => Math.round(x * 100) / 100;
const s = (ms: number) => `${(ms / 1000).toFixed(1)} s`;
const results: Record<string, unknown> = {};

async function sh(cmd: string[], cwd?: string): Promise<string> {
  const p = Bun.spawn(cmd, { cwd, stdout: "pipe", stderr: "pipe", env: { ...process.env, PATH: SBIN_PATH, LC_ALL: "C" } });
  const [out, err, code] = await Promise.all([new Response(p.stdout).text(), new Response(p.stderr).text(), p.exited]);
  if (code !== 0) throw new Error(`${cmd.join(" ")} exited ${code}: ${err.slice(-2000)}`);
  return out;
}

mkdirSync("/var/tmp/aenv-bench", { recursive: true });
const work = mkdtempSync("/var/tmp/aenv-bench/template-");
process.on("exit", () => rmSync(work, { recursive: true, force: true }));

// ---- convert: ours vs GNU tar onto a plain ext4 image ---------------------------------------------
if (want("convert")) {
  const blobs: { path: string; diffId: string; tarBytes: number }[] = [];
  for (const [i, dirs] of LAYER_DIRS.entries()) {
    const present = dirs.filter((d) => statSync(`/${d}`, { throwIfNoEntry: false })?.isDirectory());
    if (present.length === 0) continue;
    const path = join(work, `layer-${i}.tar.gz`);
    await sh(["tar", "--format=posix", "--numeric-owner", "--xattrs", "--xattrs-include=*", "-C", "/", "-czf", path, ...present]);
    const tarBytes = Number((await sh(["sh", "-c", `gzip -dc '${path}' | wc -c`])).trim());
    blobs.push({ path, diffId: await diffIdOf(path), tarBytes });
  }
  const tarBytes = blobs.reduce((a, b) => a + b.tarBytes, 0);
  const blobBytes = blobs.reduce((a, b) => a + statSync(b.path).size, 0);
  const files = Number((await sh(["sh", "-c", `for b in ${blobs.map((b) => `'${b.path}'`).join(" ")}; do tar -tzf "$b"; done | wc -l`])).trim());
  for (const b of blobs) await readFile(b.path); // both sides read the blobs from the page cache
  console.log(`# convert: ${blobs.length} layers, ${files} entries, ${r1(tarBytes / 2 ** 20)} MiB of tar (${r1(blobBytes / 2 ** 20)} MiB gzip'd), ${DEFAULT_DISK_BYTES / 2 ** 30} GiB ext4; ${ROUNDS} rounds`);

  const state = join(work, "blockd");
  mkdirSync(state, { recursive: true });
  const blockd = await BlockdClient.ensure(state, { pool: 0 });
  /** Ours: the empty layer and every layer converted into a cache that holds nothing yet. */
  const ours = async (round: number) => {
    const cache = new LayerCache(join(work, `cache-${round}`));
    const ctx: ConvertContext = { cache, blockd };
    const t0 = performance.now();
    const stack: ConvertedLayer[] = [await emptyExt4Layer(ctx, DEFAULT_DISK_BYTES)];
    const t1 = performance.now();
    for (const b of blobs) stack.push(await convertLayer(ctx, stack, { blob: b.path, diffId: b.diffId }, DEFAULT_DISK_BYTES));
    const t2 = performance.now();
    if (stack.some((l, i) => i > 0 && !l.converted)) throw new Error("a layer came from the cache: the round is not cold");
    rmSync(cache.dir, { recursive: true, force: true });
    return { totalMs: t2 - t0, layersMs: t2 - t1 };
  };
  /** GNU tar: mkfs on a plain sparse file, loop-mounted with the converter's options, every layer extracted, umount, fsync. */
  const gnuTar = async (round: number) => {
    const img = join(work, `plain-${round}.img`);
    const mnt = join(work, `mnt-${round}`);
    mkdirSync(mnt, { recursive: true });
    const t0 = performance.now();
    await sh(["mkfs.ext4", ...MKFS_ARGS, img, `${DEFAULT_DISK_BYTES / 1024}k`]);
    await sh(["mount", "-t", "ext4", "-o", "loop,noatime,nobarrier", img, mnt]);
    const t1 = performance.now();
    try {
      for (const b of blobs) await sh(["tar", "--numeric-owner", "--xattrs", "--xattrs-include=*", "-xzpf", b.path, "-C", mnt]);
    } finally {
      await sh(["umount", mnt]);
    }
    await syncPath(img);
    const t2 = performance.now();
    rmSync(img, { force: true });
    return { totalMs: t2 - t0, layersMs: t2 - t1 };
  };
  const o: { totalMs: number; layersMs: number }[] = [];
  const g: { totalMs: number; layersMs: number }[] = [];
  try {
    for (let r = 0; r < ROUNDS; r++) {
      for (const side of r % 2 === 0 ? ["ours", "tar"] : ["tar", "ours"]) {
        await sh(["sync"]); // the other side's writeback is not this side's cost
        if (side === "ours") o.push(await ours(r));
        else g.push(await gnuTar(r));
      }
      console.log(`  round ${r + 1}: ours ${s(o.at(-1)!.totalMs)}, GNU tar ${s(g.at(-1)!.totalMs)}`);
    }
  } finally {
    await blockd.call("shutdown").catch(() => {});
  }
  const mibs = (ms: number) => tarBytes / 2 ** 20 / (ms / 1000);
  const ratios = o.map((x, i) => g[i]!.totalMs / x.totalMs);
  const ratio = median(ratios);
  const layerRatio = median(o.map((x, i) => g[i]!.layersMs / x.layersMs));
  console.log(
    `conversion throughput                    ours ${r1(mibs(median(o.map((x) => x.totalMs))))} MiB/s  GNU tar ${r1(mibs(median(g.map((x) => x.totalMs))))} MiB/s  ratio ${r2(ratio)}× ` +
      `(range ${r2(Math.min(...ratios))}–${r2(Math.max(...ratios))})  (target ≥ 0.8×${ratio >= 0.8 ? "" : "  MISSED"})`,
  );
  console.log(`  the layers alone (no mkfs)              ours ${r1(mibs(median(o.map((x) => x.layersMs))))} MiB/s  GNU tar ${r1(mibs(median(g.map((x) => x.layersMs))))} MiB/s  ratio ${r2(layerRatio)}×`);
  results.convert = {
    layers: blobs.length, entries: files, tarMiB: r1(tarBytes / 2 ** 20), gzipMiB: r1(blobBytes / 2 ** 20), rounds: ROUNDS,
    oursMs: Math.round(median(o.map((x) => x.totalMs))), gnuTarMs: Math.round(median(g.map((x) => x.totalMs))), ratio: r2(ratio), layersOnlyRatio: r2(layerRatio), target: "≥ 0.8×",
  };
}

// ---- pull and rebuild: a whole node ----------------------------------------------------------------
if (want("pull") || want("rebuild")) {
  const skip = nodeSkipReason() ?? (want("pull") ? registrySkipReason() : undefined);
  if (skip) throw new Error(`the pull and rebuild rows need a node: ${skip} (or run --only convert)`);
  const reg = want("pull") ? await startRegistry({ dir: join(work, "registry") }) : undefined;
  const setup = nodeSetup("btp", 219, KEY, reg ? { AENV_INSECURE_REGISTRIES: reg.host } : {});
  let node: NodeProc | undefined;
  try {
    const t0 = performance.now();
    node = await startNode(setup.env, FIRST_START_MS);
    console.log(`# node ready in ${s(performance.now() - t0)}`);
    const opts = { apiKey: KEY, apiUrl: node.base, sandboxUrl: node.base, requestTimeoutMs: 30 * 60_000 };

    if (want("pull") && reg) {
      // Never seen: a busybox base plus a layer of real content (Python 3.11's library, GCC's), and a file no image has.
      const root = await busyboxRoot(join(work, "image", "root"));
      await Bun.write(join(root, "bin/bash"), '#!/bin/sh\nexec /bin/busybox sh "$@"\n');
      chmodSync(join(root, "bin/bash"), 0o755);
      const top = join(work, "image", "top");
      mkdirSync(join(top, "usr/lib"), { recursive: true });
      await sh(["cp", "-a", "/usr/lib/python3.11", "/usr/lib/gcc", join(top, "usr/lib/")]);
      await Bun.write(join(top, "etc/bench-id"), `${crypto.randomUUID()}\n`);
      const ref = `${reg.host}/bench/app:${process.pid}`;
      const pushed = await pushImage(new RegistryClient({ dockerConfigPath: null, insecureRegistries: [reg.host] }), ref, { layers: [root, top], config: BUSYBOX_CONFIG });
      const imageMiB = pushed.layers.reduce((a, l) => a + l.size, 0) / 2 ** 20;

      const logs: LogEntry[] = [];
      const start = Date.now();
      await Template.build(Template().fromImage(ref), "bench-pull", { ...opts, onBuildLogs: (l) => logs.push(l) });
      const built = Date.now();
      const sbx = await Sandbox.create("bench-pull", opts);
      const out = (await sbx.commands.run("cat /etc/bench-id")).stdout;
      const first = Date.now();
      await sbx.kill();
      if (!out.trim()) throw new Error("the first command printed nothing");
      const at = (test: (m: string) => boolean, what: string) => {
        const e = logs.find((l) => test(l.message));
        if (!e) throw new Error(`no build log line for ${what}: ${logs.map((l) => l.message).join(" | ")}`);
        return e.timestamp.getTime();
      };
      const downloaded = at((m) => /^pull layers: .* ([\d.]+)\/\1 MiB/.test(m) || m.startsWith("pull done"), "the downloads' end");
      const converted = at((m) => m.startsWith("pull done"), "the pull's end");
      const row = { pullMs: downloaded - start, convertMs: converted - downloaded, buildMs: built - converted, firstCommandMs: first - built, totalMs: first - start };
      console.log(
        `pull → first command (${r1(imageMiB)} MiB, 2 layers)   ${s(row.totalMs)}: pull ${s(row.pullMs)}, convert ${s(row.convertMs)}, build ${s(row.buildMs)}, first command ${s(row.firstCommandMs)}`,
      );
      results.pull = { imageMiB: r1(imageMiB), layers: 2, ...row };
    }

    if (want("rebuild")) {
      const ctx = join(work, "rebuild-context");
      await Bun.write(join(ctx, "app", "main.py"), "print('hello from the app')\n");
      const template = () => Template({ fileContextPath: ctx }).fromTemplate("base")
        .setEnvs({ MODE: "bench" })
        .runCmd("cp -a /usr/lib/python3.11 /tmp/py && python3 -m compileall -q -f /tmp/py >/dev/null && rm -rf /tmp/py", { user: "root" })
        .runCmd("head -c 64M /dev/urandom > /home/user/blob")
        .setWorkdir("/home/user/app")
        .copy("app", "/home/user/app")
        .setStartCmd("python3 -m http.server 8080 --bind 127.0.0.1", "curl -sf http://127.0.0.1:8080/ >/dev/null");
      const t1 = performance.now();
      await Template.build(template(), "bench-rebuild", opts);
      const firstMs = performance.now() - t1;
      const logs: LogEntry[] = [];
      const t2 = performance.now();
      await Template.build(template(), "bench-rebuild", { ...opts, onBuildLogs: (l) => logs.push(l) });
      const againMs = performance.now() - t2;
      const cached = logs.filter((l) => l.message.startsWith("CACHED ")).length;
      console.log(`unchanged rebuild vs first build          first ${s(firstMs)}  rebuild ${s(againMs)}  ratio ${r2(againMs / firstMs)}× (${cached}/5 steps cached)`);
      results.rebuild = { firstMs: Math.round(firstMs), rebuildMs: Math.round(againMs), ratio: r2(againMs / firstMs), stepsCached: cached };
    }
  } finally {
    await stopNode(node, setup);
    await reg?.stop();
  }
}

if (argv.includes("--json")) console.log(JSON.stringify(results, null, 1));
