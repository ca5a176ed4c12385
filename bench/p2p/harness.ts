// The machinery of peer-transfer benchmarks, shared by bench/p2p and bench/remote: a sealed layer
// of random bytes, the serving process (bench/p2p/server.ts: iroh and raw TCP from one process),
// and the fetching paths (raw TCP, W PeerWorkers per side), each written to a file and verified.
import { open } from "node:fs/promises";
import { join } from "node:path";
import { rmSync } from "node:fs";
import { MAX_READ, PeerWorker, type PeerConfig, sha256OfFile } from "../../p2p/index.ts";
import type { LayerDigest } from "../../src/storage/remote/source.ts";
import { sealedLayer } from "../../src/template/artifacts.ts";

export interface BenchLayer {
  path: string;
  digest: LayerDigest;
  size: number;
}

/** A sealed overlaybd layer over `mib` MiB of random bytes (every block stored), in `dir`. */
export async function randomSealedLayer(dir: string, mib: number, name = "layer.sealed"): Promise<BenchLayer> {
  const raw = join(dir, `${name}.raw`);
  const fh = await open(raw, "w");
  const block = new Uint8Array(16 << 20);
  for (let off = 0; off < mib << 20; off += block.length) {
    for (let i = 0; i < block.length; i += 65536) crypto.getRandomValues(block.subarray(i, i + 65536));
    await fh.write(block, 0, Math.min(block.length, (mib << 20) - off), off);
  }
  await fh.close();
  const path = await sealedLayer(raw, join(dir, name));
  rmSync(raw);
  const { digest, size } = await sha256OfFile(path);
  return { path, digest: digest as LayerDigest, size };
}

export interface PeerBenchServer {
  tcpPort: number;
  /** The serving PeerNode on its main thread. */
  main: PeerConfig;
  /** One serving PeerWorker per fetching worker id given at start. */
  workers: PeerConfig[];
  /** CPU seconds (user + system) the serving process has spent so far. */
  cpu(): Promise<number>;
  stop(): void;
}

/** Spawn bench/p2p/server.ts serving `layer` to `allowId` (main thread) and `workerIds` (one PeerWorker each). */
export async function startPeerBenchServer(dir: string, layer: BenchLayer, allowId: string, workerIds: string[]): Promise<PeerBenchServer> {
  const proc = Bun.spawn([process.execPath, join(import.meta.dir, "server.ts"), dir, layer.path, layer.digest, allowId, workerIds.join(",")],
    { stdout: "pipe", stderr: "inherit" });
  let text = "";
  const r = proc.stdout.getReader();
  while (!text.includes("\n")) {
    const { value, done } = await r.read();
    if (done) throw new Error("bench server exited");
    text += new TextDecoder().decode(value);
  }
  r.releaseLock();
  const srv = JSON.parse(text.slice(0, text.indexOf("\n"))) as { tcpPort: number; main: PeerConfig; workers: PeerConfig[] };
  return {
    ...srv,
    async cpu() {
      const f = (await Bun.file(`/proc/${proc.pid}/stat`).text()).split(") ")[1]!.split(" ");
      return (Number(f[11]) + Number(f[12])) / 100; // utime, stime in clock ticks (100 Hz)
    },
    stop: () => proc.kill(),
  };
}

/** The fetched file hashes to `digest` (else throws); it is removed after. */
export async function verifyFetched(path: string, digest: string): Promise<void> {
  const got = await sha256OfFile(path);
  if (got.digest !== digest) throw new Error(`${path}: ${got.digest}, want ${digest}`);
  rmSync(path);
}

/** The baseline: one TCP connection, received into 4 MiB staging buffers written to the file as each fills. */
export async function tcpFetch(port: number, layer: BenchLayer, dest: string): Promise<void> {
  const size = layer.size;
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
      hostname: "127.0.0.1", port,
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
  await verifyFetched(dest, layer.digest);
}

/** W PeerWorkers here (homes `clientHomes[0..w)`), each reading every W-th range from its own serving PeerWorker there, 4 requests in flight each. */
export async function workerFetch(srv: PeerBenchServer, clientHomes: string[], layer: BenchLayer, w: number, dest: string): Promise<void> {
  const size = layer.size;
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
        const { data } = await fetchers[k]!.read(srv.workers[k]!.id, layer.digest, off, len);
        if (data.length !== len) throw new Error(`short read at ${off}`);
        await fh.write(data, 0, len, off);
      }
    })));
  } finally {
    await Promise.all(fetchers.map((f) => f.close()));
    await fh.close();
  }
  await verifyFetched(dest, layer.digest);
}

export interface TimedRow { name: string; s: number; cpuClient: number; cpuServer: number }

/** Wall seconds of `fn` and the CPU seconds this process and the server spent in it. */
export async function timed(name: string, srv: PeerBenchServer, fn: () => Promise<void>): Promise<TimedRow> {
  const c0 = process.cpuUsage(), s0 = await srv.cpu(), t = performance.now();
  await fn();
  const s = (performance.now() - t) / 1000, c = process.cpuUsage(c0);
  return { name, s, cpuClient: (c.user + c.system) / 1e6, cpuServer: (await srv.cpu()) - s0 };
}
