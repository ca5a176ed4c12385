// blockd entry point: `bun src/blockdev/main.ts --state DIR [--pool N]`.
import { Blockd } from "./server.ts";

const arg = (name: string) => {
  const i = process.argv.indexOf(`--${name}`);
  return i > 0 ? process.argv[i + 1] : undefined;
};
const stateDir = arg("state");
/** Pool devices are one worker and ~8 MiB each: a pool past this is a typo. */
const MAX_POOL = 256;
const pool = Number(arg("pool") ?? 0);
if (!stateDir || !Number.isInteger(pool) || pool < 0 || pool > MAX_POOL) {
  console.error(`usage: blockd --state DIR [--pool N]   (N: 0..${MAX_POOL})`);
  process.exit(2);
}
// A start that fails says why in one line and exits non-zero (Blockd.start lets an idle keeper go).
// AENV_BLOCKD_POOL_IDLE_MS: how long the pool's surplus stays (test-only, not a node setting).
const poolIdleEnv = process.env.AENV_BLOCKD_POOL_IDLE_MS;
const poolIdleMs = poolIdleEnv === undefined ? undefined : Number(poolIdleEnv);
if (poolIdleMs !== undefined && !(Number.isInteger(poolIdleMs) && poolIdleMs >= 100)) {
  console.error(`AENV_BLOCKD_POOL_IDLE_MS=${poolIdleEnv}: expected an integer of at least 100 (ms)`);
  process.exit(2);
}
const blockd = await Blockd.start({ stateDir, pool, poolIdleMs }).catch((e: Error) => {
  console.error(`blockd: start failed: ${e.name === "Error" ? "" : `${e.name}: `}${e.message}`);
  process.exit(1);
});
for (const sig of ["SIGTERM", "SIGINT"] as const) process.on(sig, () => void blockd.shutdown());
console.log(`blockd ${process.pid} listening on ${blockd.socketPath}`);
