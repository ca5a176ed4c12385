// blockd's other calls while it writes memory layers (docs/blockd.md, memoryLayer): `list` round
// trips, one after another, during --writes memory layer writes of --mib MiB (half the MiB random
// data, half zeros, as a guest's memory holds), against the same round trips while blockd is idle,
// in the same run: p50, p99 and max in ms, and p99 as a ratio to idle (target: ≤ 3×; the writes
// run on memory writer threads, so the main loop never waits on their I/O).
//   npx bun bench/blockdev/rpc_during_memory.ts [--mib N] [--writes N] [--json]
import { closeSync, mkdirSync, openSync, rmSync, writeSync } from "node:fs";
import { join } from "node:path";
import { BlockdClient } from "../../src/blockdev/client.ts";

const arg = (n: string, d: number) => {
  const i = process.argv.indexOf(`--${n}`);
  return i >= 0 ? Number(process.argv[i + 1]) : d;
};
const MIB = arg("mib", 256);
const WRITES = arg("writes", 3);
const IDLE_MS = 1500;
const dir = `/var/tmp/aenv-bench-rpc-memory-${process.pid}`;

const pct = (xs: number[], p: number) => [...xs].sort((a, b) => a - b)[Math.min(xs.length - 1, Math.floor(xs.length * p))]!;
const r2 = (x: number) => Math.round(x * 100) / 100;
const summary = (xs: number[]) => ({ n: xs.length, p50: r2(pct(xs, 0.5)), p99: r2(pct(xs, 0.99)), max: r2(pct(xs, 1)) });

mkdirSync(join(dir, "state"), { recursive: true });
const image = join(dir, "mem.raw");
const fd = openSync(image, "w");
const chunk = new Uint8Array(1 << 20);
for (let i = 0; i < MIB; i++) {
  if (i % 2 === 0) (crypto.getRandomValues(chunk.subarray(0, 65536)), chunk.fill(7, 65536));
  else chunk.fill(0);
  writeSync(fd, chunk);
}
closeSync(fd);
const client = await BlockdClient.ensure(join(dir, "state"), { pool: 2 });
try {
  await Bun.sleep(1000); // the pool's workers start
  /** `list` round trips, 1 ms apart, until `until` says stop. */
  const roundTrips = async (until: () => boolean) => {
    const ms: number[] = [];
    while (!until()) {
      const t = performance.now();
      await client.call("list");
      ms.push(performance.now() - t);
      await Bun.sleep(1);
    }
    return ms;
  };
  const end = performance.now() + IDLE_MS;
  const idle = await roundTrips(() => performance.now() > end);
  const during: number[] = [];
  for (let k = 0; k < WRITES; k++) {
    let done = false;
    const write = client.call("memoryLayer", { out: join(dir, `layer-${k}`), size: MIB << 20, from: { file: image } }).finally(() => (done = true));
    during.push(...(await roundTrips(() => done)));
    await write;
  }
  const result = { mib: MIB, writes: WRITES, idle: summary(idle), during: summary(during), p99Ratio: r2(pct(during, 0.99) / pct(idle, 0.99)), target: "≤ 3×" };
  console.log(process.argv.includes("--json") ? JSON.stringify(result) : Object.entries(result).map(([k, v]) => `${k}: ${JSON.stringify(v)}`).join("\n"));
} finally {
  await client.call("shutdown").catch(() => {});
  client.close();
  await Bun.sleep(300);
  rmSync(dir, { recursive: true, force: true });
}
