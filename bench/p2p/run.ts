// Peer transfer of one sealed layer over iroh against raw loopback TCP between the same two
// processes (this one fetches, bench/p2p/server.ts serves), each fetch written to a file and
// verified by sha256. Rows: TCP (one connection), iroh with 1 and 8 streams on one connection
// (PeerChunkSource.fetchLayer on the main thread), and iroh with W PeerWorkers on each side (a Bun
// Worker each, with its own endpoint).
//   bun bench/p2p/run.ts [--mib 256] [--workers 1,2,4]
import { mkdirSync, rmSync } from "node:fs";
import { open } from "node:fs/promises";
import { join } from "node:path";
import { SecretKey } from "@number0/iroh";
import { loadOrCreateSecretKey, MAX_READ, PeerChunkSource, PeerNode, PeerWorker, type PeerConfig, sha256OfFile } from "../../p2p/index.ts";
import type { LayerDigest } from "../../src/storage/remote/source.ts";
import { sealedLayer } from "../../src/template/artifacts.ts";

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
const raw = join(dir, "raw.img");
{
  const fh = await open(raw, "w");
  const block = new Uint8Array(16 << 20);
  for (let off = 0; off < MIB << 20; off += block.length) {
    for (let i = 0; i < block.length; i += 65536) crypto.getRandomValues(block.subarray(i, i + 65536));
    await fh.write(block, 0, block.length, off);
  }
  await fh.close();
}
const layerPath = await sealedLayer(raw, join(dir, "layer.sealed"));
rmSync(raw);
const { digest, size } = await sha256OfFile(layerPath);

const idOf = async (home: string) => SecretKey.fromBytes(await loadOrCreateSecretKey(home)).public().toString();
const maxW = Math.max(...WORKERS);
const clientHomes = Array.from({ length: maxW }, (_, i) => join(dir, `cli-w${i}`));
const workerIds = await Promise.all(clientHomes.map(idOf));
const client = await PeerNode.start({ home: join(dir, "cli-main"), bindAddr: "127.0.0.1:0" });

const server = Bun.spawn([process.execPath, join(import.meta.dir, "server.ts"), dir, layerPath, digest, client.id, workerIds.join(",")],
  { stdout: "pipe", stderr: "inherit" });
const line = await (async () => {
  let text = "";
  const r = server.stdout.getReader();
  while (!text.includes("\n")) {
    const { value, done } = await r.read();
    if (done) throw new Error("bench server exited");
    text += new TextDecoder().decode(value);
  }
  return text.slice(0, text.indexOf("\n"));
})();
const srv = JSON.parse(line) as { tcpPort: number; main: PeerConfig; workers: PeerConfig[] };
client.setPeers([srv.main]);

async function verify(path: string): Promise<void> {
  const got = await sha256OfFile(path);
  if (got.digest !== digest) throw new Error(`${path}: ${got.digest}, want ${digest}`);
  rmSync(path);
}

/** The baseline: one TCP connection, received into 4 MiB staging buffers written to the file as each fills. */
async function tcpFetch(dest: string): Promise<void> {
  const fh = await open(dest, "w");
  const STAGE = 4 << 20;
  let stage = new Uint8Array(STAGE), fill = 0, pos = 0, writing = Promise.resolve();
  const flush = () => {
    const b = stage.subarray(0, fill), at = pos - fill;
    writing = writing.then(() => fh.write(b, 0, b.length, at).then(() => {}));
    stage = new Uint8Array(STAGE);
    fill = 0;
  };
  await new Promise<void>((resolve, reject) => {
    Bun.connect({
      hostname: "127.0.0.1", port: srv.tcpPort,
      socket: {
        open(s) {
          const h = new DataView(new ArrayBuffer(16));
          h.setBigUint64(0, 0n); h.setBigUint64(8, BigInt(size));
          s.write(new Uint8Array(h.buffer));
        },
        data(_s, d) {
          for (let i = 0; i < d.length;) {
            const n = Math.min(d.length - i, STAGE - fill);
            stage.set(d.subarray(i, i + n), fill);
            fill += n; pos += n; i += n;
            if (fill === STAGE) flush();
          }
        },
        close() { if (fill) flush(); pos === size ? resolve() : reject(new Error(`TCP ended at ${pos} of ${size}`)); },
        error(_s, e) { reject(e); },
      },
    }).catch(reject);
  });
  await writing;
  await fh.close();
  await verify(dest);
}

/** W PeerWorkers here, each reading every W-th range from its own serving PeerWorker there, 4 requests in flight each. */
async function workerFetch(w: number, dest: string): Promise<void> {
  const fh = await open(dest, "w");
  await fh.truncate(size);
  const ranges: [number, number][][] = Array.from({ length: w }, () => []);
  let i = 0;
  for (let off = 0; off < size; off += MAX_READ) ranges[i++ % w]!.push([off, Math.min(MAX_READ, size - off)]);
  const fetchers = await Promise.all(ranges.map((_, k) =>
    PeerWorker.start({ home: clientHomes[k]!, bindAddr: "127.0.0.1:0", peers: [srv.workers[k]!] })));
  try {
    await Promise.all(ranges.flatMap((r, k) => Array.from({ length: 4 }, async () => {
      for (let next = r.shift(); next; next = r.shift()) {
        const [off, len] = next;
        const { data } = await fetchers[k]!.read(srv.workers[k]!.id, digest as LayerDigest, off, len);
        if (data.length !== len) throw new Error(`short read at ${off}`);
        await fh.write(data, 0, len, off);
      }
    })));
  } finally {
    await Promise.all(fetchers.map((f) => f.close()));
    await fh.close();
  }
  await verify(dest);
}

/** CPU seconds (user + system) of the server process so far, from /proc. */
async function serverCpu(): Promise<number> {
  const f = (await Bun.file(`/proc/${server.pid}/stat`).text()).split(") ")[1]!.split(" ");
  return (Number(f[11]) + Number(f[12])) / 100; // utime, stime in clock ticks (100 Hz)
}

interface Row { name: string; s: number; cpuClient: number; cpuServer: number }
async function timed(name: string, fn: () => Promise<void>): Promise<Row> {
  const c0 = process.cpuUsage(), s0 = await serverCpu(), t = performance.now();
  await fn();
  const s = (performance.now() - t) / 1000, c = process.cpuUsage(c0);
  return { name, s, cpuClient: (c.user + c.system) / 1e6, cpuServer: (await serverCpu()) - s0 };
}

const rows: Row[] = [];
rows.push(await timed("raw TCP, 1 connection", () => tcpFetch(join(dir, "tcp.out"))));
const tcp = rows[0]!.s;
for (const streams of [1, 8]) {
  const src = new PeerChunkSource(client, { streams });
  rows.push(await timed(`iroh, main thread, ${streams} stream(s)`, async () => verify((await src.fetchLayer(digest, join(dir, `iroh${streams}.out`))).path)));
}
for (const w of WORKERS) rows.push(await timed(`iroh, ${w} worker(s) per side`, () => workerFetch(w, join(dir, `w${w}.out`))));

console.log(`peer transfer of a ${(size / 2 ** 20).toFixed(0)} MiB sealed layer (fetched to a file, sha256 verified), ${navigator.hardwareConcurrency} CPUs`);
console.log(`${"path".padEnd(32)} ${"time".padStart(8)} ${"MB/s".padStart(8)}  ${"vs TCP".padStart(7)}  CPU s per GiB: fetcher, server`);
for (const r of rows) {
  const perGiB = (x: number) => (x / (size / 2 ** 30)).toFixed(1).padStart(6);
  console.log(`${r.name.padEnd(32)} ${r.s.toFixed(2).padStart(7)}s ${(size / r.s / 1e6).toFixed(1).padStart(8)}  ${(tcp / r.s).toFixed(3).padStart(6)}×  ${perGiB(r.cpuClient)} ${perGiB(r.cpuServer)}`);
}
await client.close();
server.kill();
process.exit(0);
