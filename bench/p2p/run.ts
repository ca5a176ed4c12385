// Peer transfer of one sealed layer over iroh against raw loopback TCP between the same two
// processes (this one fetches, bench/p2p/server.ts serves), each fetch written to a file and
// verified by sha256. Rows: TCP (one connection), iroh with 1 and 8 streams on one connection
// (PeerChunkSource.fetchLayer on the main thread), and iroh with W PeerWorkers on each side (a Bun
// Worker each, with its own endpoint). The paths live in bench/p2p/harness.ts (bench/remote uses them too).
//   bun bench/p2p/run.ts [--mib 256] [--workers 1,2,4]
import { mkdirSync, rmSync } from "node:fs";
import { join } from "node:path";
import { SecretKey } from "@number0/iroh";
import { loadOrCreateSecretKey, PeerChunkSource, PeerNode } from "../../p2p/index.ts";
import { randomSealedLayer, startPeerBenchServer, tcpFetch, timed, verifyFetched, workerFetch, type TimedRow as Row } from "./harness.ts";

const arg = (name: string, dflt: string) => {
  const i = process.argv.indexOf(`--${name}`);
  return i > 0 ? process.argv[i + 1]! : dflt;
};
const MIB = Number(arg("mib", "256"));
const WORKERS = arg("workers", "1,2,4").split(",").map(Number);
const dir = join("/var/tmp", `aenv-bench-p2p-${process.pid}`);
mkdirSync(dir, { recursive: true });
process.on("exit", () => rmSync(dir, { recursive: true, force: true }));

// The payload: a sealed overlaybd layer over random bytes (every block stored).
const layer = await randomSealedLayer(dir, MIB);
const { digest, size } = layer;

const idOf = async (home: string) => SecretKey.fromBytes(await loadOrCreateSecretKey(home)).public().toString();
const maxW = Math.max(...WORKERS);
const clientHomes = Array.from({ length: maxW }, (_, i) => join(dir, `cli-w${i}`));
const workerIds = await Promise.all(clientHomes.map(idOf));
const client = await PeerNode.start({ home: join(dir, "cli-main"), bindAddr: "127.0.0.1:0" });

const srv = await startPeerBenchServer(dir, layer, client.id, workerIds);
client.setPeers([srv.main]);

const rows: Row[] = [];
rows.push(await timed("raw TCP, 1 connection", srv, () => tcpFetch(srv.tcpPort, layer, join(dir, "tcp.out"))));
const tcp = rows[0]!.s;
for (const streams of [1, 8]) {
  const src = new PeerChunkSource(client, { streams });
  rows.push(await timed(`iroh, main thread, ${streams} stream(s)`, srv, async () => verifyFetched((await src.fetchLayer(digest, join(dir, `iroh${streams}.out`))).path, digest)));
}
for (const w of WORKERS) rows.push(await timed(`iroh, ${w} worker(s) per side`, srv, () => workerFetch(srv, clientHomes, layer, w, join(dir, `w${w}.out`))));

console.log(`peer transfer of a ${(size / 2 ** 20).toFixed(0)} MiB sealed layer (fetched to a file, sha256 verified), ${navigator.hardwareConcurrency} CPUs`);
console.log(`${"path".padEnd(32)} ${"time".padStart(8)} ${"MB/s".padStart(8)}  ${"vs TCP".padStart(7)}  CPU s per GiB: fetcher, server`);
for (const r of rows) {
  const perGiB = (x: number) => (x / (size / 2 ** 30)).toFixed(1).padStart(6);
  console.log(`${r.name.padEnd(32)} ${r.s.toFixed(2).padStart(7)}s ${(size / r.s / 1e6).toFixed(1).padStart(8)}  ${(tcp / r.s).toFixed(3).padStart(6)}×  ${perGiB(r.cpuClient)} ${perGiB(r.cpuServer)}`);
}
await client.close();
srv.stop();
process.exit(0);
