// One PeerNode on a Bun Worker thread, for the worker data path of bench/p2p: the binding moves
// bytes as number arrays on the calling thread, so each thread with its own endpoint adds one
// thread's worth of marshalling. "serve" serves a layer file; "fetch" reads the given ranges from
// one peer into a shared file.
import { open } from "node:fs/promises";
import { PeerNode, type PeerConfig } from "../../p2p/index.ts";
import type { LayerDigest } from "../../src/storage/remote/source.ts";

declare const self: Worker;

export type WorkerJob =
  | { role: "serve"; home: string; allow: string[]; layer: { path: string; digest: LayerDigest; size: number } }
  | { role: "fetch"; home: string; peer: PeerConfig; digest: LayerDigest; dest: string; ranges: [number, number][]; streams: number };

let node: PeerNode | undefined;

self.onmessage = async (ev: MessageEvent<WorkerJob>) => {
  const job = ev.data;
  try {
    if (job.role === "serve") {
      const l = job.layer;
      node = await PeerNode.start({ home: job.home, bindAddr: "127.0.0.1:0", allow: job.allow,
        layers: async (d) => (d === l.digest ? { path: l.path, size: l.size } : undefined) });
      self.postMessage({ ok: true, peer: node.self() });
      return;
    }
    node = await PeerNode.start({ home: job.home, bindAddr: "127.0.0.1:0", peers: [job.peer] });
    const fh = await open(job.dest, "r+");
    let next = 0;
    await Promise.all(Array.from({ length: job.streams }, async () => {
      while (next < job.ranges.length) {
        const [off, len] = job.ranges[next++]!;
        const { data } = await node!.read(job.peer.id, job.digest, off, len);
        if (data.length !== len) throw new Error(`short read at ${off}`);
        await fh.write(data, 0, len, off);
      }
    }));
    await fh.close();
    await node.close();
    self.postMessage({ ok: true });
  } catch (e) {
    self.postMessage({ ok: false, error: `${(e as Error).name}: ${(e as Error).message}` });
  }
};
