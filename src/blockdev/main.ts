// blockd entry point: `bun src/blockdev/main.ts --state DIR [--pool N]`.
import { Blockd } from "./server.ts";

const arg = (name: string) => {
  const i = process.argv.indexOf(`--${name}`);
  return i > 0 ? process.argv[i + 1] : undefined;
};
const stateDir = arg("state") ?? process.env.AENV_BLOCKD_STATE;
if (!stateDir) {
  console.error("usage: blockd --state DIR [--pool N]");
  process.exit(2);
}
const blockd = await Blockd.start({ stateDir, pool: Number(arg("pool") ?? 0) });
for (const sig of ["SIGTERM", "SIGINT"] as const) process.on(sig, () => void blockd.shutdown());
console.log(`blockd ${process.pid} listening on ${blockd.socketPath}`);
