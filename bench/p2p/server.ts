// The serving process of bench/p2p: one layer file over iroh (a PeerNode on the main thread and
// one per worker) and over raw TCP (one request "offset length" as two u64 BE, answered with the
// bytes), so both paths run between the same two processes; PeerWorkers serve the worker rows. Prints its addresses as one JSON line.
// Usage: bun bench/p2p/server.ts DIR LAYER DIGEST ALLOW_ID[,…] WORKER_ALLOW_ID[,…]
import { open } from "node:fs/promises";
import { join } from "node:path";
import { PeerNode, PeerWorker } from "../../p2p/index.ts";
import type { LayerDigest } from "../../src/storage/remote/source.ts";

const [dir, path, digest, allow, workerAllow] = process.argv.slice(2) as [string, string, LayerDigest, string, string];
const size = Bun.file(path).size;
const layer = { path, digest, size };
const main = await PeerNode.start({ home: join(dir, "srv-main"), bindAddr: "127.0.0.1:0", allow: allow.split(","),
  layers: async (d) => (d === digest ? layer : undefined) });
// One serving PeerWorker per fetching worker, each allowing just that one.
const workers = await Promise.all(workerAllow.split(",").filter(Boolean).map((id, i) =>
  PeerWorker.start({ home: join(dir, `srv-w${i}`), bindAddr: "127.0.0.1:0", allow: [id], layers: async (d) => (d === digest ? layer : undefined) })));

interface Conn { buf: Uint8Array; pending: Uint8Array | undefined; off: number; end: number; head: number[]; busy: boolean }
const fh = await open(path, "r");
const CHUNK = 1 << 20;
const tcp = Bun.listen<Conn>({
  hostname: "127.0.0.1", port: 0,
  socket: {
    open(s) { s.data = { buf: new Uint8Array(CHUNK), pending: undefined, off: 0, end: 0, head: [], busy: false }; },
    async data(s, d) {
      s.data.head.push(...d);
      if (s.data.head.length < 16) return;
      const v = new DataView(new Uint8Array(s.data.head.slice(0, 16)).buffer);
      s.data.off = Number(v.getBigUint64(0));
      s.data.end = s.data.off + Number(v.getBigUint64(8));
      await pump(s);
    },
    async drain(s) { await pump(s); },
  },
});

/** Write file bytes until the socket pushes back; drain resumes. */
async function pump(s: Bun.Socket<Conn>): Promise<void> {
  if (s.data.busy) return;
  s.data.busy = true;
  try { await pumpOnce(s); } finally { s.data.busy = false; }
}

async function pumpOnce(s: Bun.Socket<Conn>): Promise<void> {
  for (;;) {
    if (!s.data.pending) {
      if (s.data.off >= s.data.end) { s.end(); return; }
      const n = Math.min(CHUNK, s.data.end - s.data.off);
      const { bytesRead } = await fh.read(s.data.buf, 0, n, s.data.off);
      s.data.off += bytesRead;
      s.data.pending = s.data.buf.subarray(0, bytesRead);
    }
    const w = s.write(s.data.pending);
    if (w < s.data.pending.length) { s.data.pending = s.data.pending.subarray(w); return; }
    s.data.pending = undefined;
  }
}

console.log(JSON.stringify({ tcpPort: tcp.port, main: main.self(), workers: workers.map((w) => w.self()) }));
