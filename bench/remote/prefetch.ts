// Time to first command from a cold block cache, with and without a prefetch trace, at the device
// level: a real blockd device over a remote layer served by a loopback origin (each answer delayed
// by --rtt ms, a registry's round trip), and a boot-like read pattern standing in for the guest
// (runs of 4–64 KiB reads, one at a time, scattered over the layer's first --span MiB, with a
// --think ms pause every 8 reads). The pattern is recorded once as a trace (traceStart/traceStop);
// then each round starts one device with an empty block cache and no trace and one with it
// (prefetch), alternating which goes first, and reports for both the time from the device's start
// to the pattern's last read ("first command") and the bytes the origin sent until then.
//   npx bun bench/remote/prefetch.ts [--mib 256] [--span 128] [--reads 600] [--rtt 0,5] [--think 1] [--rounds 3]
import { existsSync, mkdirSync, rmSync } from "node:fs";
import { open } from "node:fs/promises";
import { join } from "node:path";
import { BlockdClient } from "../../src/blockdev/client.ts";
import { prng } from "../../test/helpers/tmp.ts";
import { remoteLayer } from "../../test/helpers/remote_layer.ts";

const argv = process.argv.slice(2);
const arg = (name: string, dflt: string) => {
  const i = argv.indexOf(`--${name}`);
  return i >= 0 ? argv[i + 1]! : dflt;
};
const MIB = Number(arg("mib", "256"));
const SPAN = Number(arg("span", "128"));
const READS = Number(arg("reads", "600"));
const RTTS = arg("rtt", "0,5").split(",").map(Number);
const THINK_MS = Number(arg("think", "1"));
const ROUNDS = Number(arg("rounds", "3"));
const KiB = 1024;

mkdirSync("/var/tmp/aenv-bench", { recursive: true });
const dir = join("/var/tmp/aenv-bench", `prefetch-${process.pid}`);
const state = join(dir, "state");
mkdirSync(state, { recursive: true });
let stopped = false;
const cleanup = async () => {
  if (stopped) return;
  stopped = true;
  // blockd flushes and stops its devices, then exits; the folder goes once it has.
  await client.call("shutdown").catch(() => {});
  for (let i = 0; i < 600 && existsSync(join(state, "blockd.sock")); i++) await Bun.sleep(50);
  rmSync(dir, { recursive: true, force: true });
};
process.on("SIGINT", () => void cleanup().then(() => process.exit(130)));

/** A boot's reads: a file at a time (2–8 sequential reads of 4–64 KiB), files scattered over the span. */
function bootPattern(): [number, number][] {
  const rnd = prng(11);
  const out: [number, number][] = [];
  while (out.length < READS) {
    let at = Math.floor(rnd() * ((SPAN << 20) / 4096 - 64)) * 4096;
    const n = 2 + Math.floor(rnd() * 7);
    for (let i = 0; i < n && out.length < READS; i++) {
      const len = 4096 << Math.floor(rnd() * 5); // 4..64 KiB
      out.push([at, len]);
      at += len;
    }
  }
  return out;
}

const layer = await remoteLayer(dir, MIB);
const client = await BlockdClient.ensure(state);
const pattern = bootPattern();
let n = 0;

async function device() {
  const k = ++n;
  return client.call<{ id: string; path: string }>("create", { lowers: [layer.lower(join(dir, `cache-${k}`))], upperDir: join(dir, `upper-${k}`), size: layer.data.length });
}

/** The guest: the pattern, one read at a time, a pause every 8 reads. */
async function boot(path: string): Promise<void> {
  const f = await open(path, "r");
  const buf = new Uint8Array(64 * KiB);
  try {
    for (let i = 0; i < pattern.length; i++) {
      const [at, len] = pattern[i]!;
      await f.read(buf, 0, len, at);
      if (THINK_MS && i % 8 === 7) await Bun.sleep(THINK_MS);
    }
  } finally {
    await f.close();
  }
}

const trace = join(dir, "boot.trace");

/** One cold start: device made, prefetch asked for (or not), the pattern read; ms and origin bytes until its end. */
async function coldStart(withTrace: boolean): Promise<{ ms: number; bytes: number; skipped: number }> {
  const before = layer.origin.bytesSent;
  const t0 = performance.now();
  const d = await device();
  if (withTrace) await client.call("prefetch", { id: d.id, trace });
  await boot(d.path);
  const out = { ms: performance.now() - t0, bytes: layer.origin.bytesSent - before, skipped: 0 };
  if (withTrace) out.skipped = (await client.call("stats", { id: d.id })).prefetchSkipped ?? 0;
  await client.call("delete", { id: d.id });
  return out;
}

const median = (xs: number[]) => [...xs].sort((a, b) => a - b)[Math.floor(xs.length / 2)]!;
const range = (xs: number[], f: (x: number) => string) => `${f(Math.min(...xs))}–${f(Math.max(...xs))}`;
const mib = (b: number) => (b / (1 << 20)).toFixed(1);
try {
  {
    const d = await device();
    await client.call("traceStart", { id: d.id });
    await boot(d.path);
    const r = await client.call("traceStop", { id: d.id, out: trace });
    console.log(`trace: ${r.entries} granules of 64 KiB (${(r.entries / 16).toFixed(0)} MiB) from ${pattern.length} reads, ${r.bytes} bytes of file`);
    await client.call("delete", { id: d.id });
  }
  console.log(`layer ${MIB} MiB, pattern ${pattern.length} reads over ${SPAN} MiB, think ${THINK_MS} ms per 8 reads, ${ROUNDS} rounds`);
  console.log("| origin delay | without trace: ms (median, range) | MiB fetched | with trace: ms | MiB fetched | ratio (with/without, median of rounds) | granules the guest read first |");
  console.log("|---|---|---|---|---|---|---|");
  for (const rtt of RTTS) {
    layer.origin.delayMs = rtt;
    const off: { ms: number; bytes: number; skipped: number }[] = [];
    const on: { ms: number; bytes: number; skipped: number }[] = [];
    for (let r = 0; r < ROUNDS; r++) {
      // Sides alternate: this host drifts, so neither may always go first.
      if (r % 2 === 0) off.push(await coldStart(false)), on.push(await coldStart(true));
      else on.push(await coldStart(true)), off.push(await coldStart(false));
    }
    const ratios = off.map((o, i) => on[i]!.ms / o.ms);
    const ms = (xs: { ms: number }[]) => `${median(xs.map((x) => x.ms)).toFixed(0)} (${range(xs.map((x) => x.ms), (x) => x.toFixed(0))})`;
    const by = (xs: { bytes: number }[]) => range(xs.map((x) => x.bytes), mib);
    console.log(`| ${rtt} ms | ${ms(off)} | ${by(off)} | ${ms(on)} | ${by(on)} | ${median(ratios).toFixed(2)}× (${range(ratios, (x) => x.toFixed(2))}) | ${range(on.map((x) => x.skipped), String)} |`);
  }
} finally {
  layer.origin.stop();
  await cleanup();
}
