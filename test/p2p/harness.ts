// Peers for the p2p tests: in-process PeerNodes on loopback, peers in their own `bun` process,
// and real sealed overlaybd layers (random data, so every block is stored) as payloads.
import { writeFileSync } from "node:fs";
import { join } from "node:path";
import { LayerShelf, PeerNode, type PeerConfig, type PeerNodeOptions } from "../../p2p/index.ts";
import { sealedLayer } from "../../src/template/artifacts.ts";
import type { LayerDigest } from "../../src/storage/remote/source.ts";
import { prng, scratchDir } from "../helpers/tmp.ts";

export interface Layer { path: string; digest: LayerDigest; size: number }

/** A sealed layer over `mib` MiB of seeded random bytes. */
export async function randomLayer(dir: string, mib: number, seed: number): Promise<Layer> {
  const raw = join(dir, `raw-${seed}.img`);
  const next = prng(seed);
  const b = new Uint8Array(mib << 20);
  const w = new Uint32Array(b.buffer);
  for (let i = 0; i < w.length; i++) w[i] = (next() * 4294967296) >>> 0;
  writeFileSync(raw, b);
  const path = await sealedLayer(raw, join(dir, `layer-${seed}.sealed`));
  const shelf = new LayerShelf();
  const digest = await shelf.add(path);
  return { path, digest, size: Bun.file(path).size };
}

/** An in-process peer on loopback with its own home and shelf. */
export async function localPeer(label: string, o: Partial<PeerNodeOptions> = {}): Promise<{ node: PeerNode; shelf: LayerShelf; home: string }> {
  const home = scratchDir(`p2p-${label}`);
  const shelf = new LayerShelf();
  const node = await PeerNode.start({ home, bindAddr: "127.0.0.1:0", layers: shelf.provider, ...o });
  return { node, shelf, home };
}

export interface PeerProcess { peer: PeerConfig; proc: Bun.Subprocess<"ignore", "pipe", "inherit">; home: string }

/** A peer in its own bun process serving `files` to `allow`. */
export async function peerProcess(label: string, allow: string[], files: string[]): Promise<PeerProcess> {
  const home = scratchDir(`p2p-${label}`);
  const proc = Bun.spawn([process.execPath, join(import.meta.dir, "peer_process.ts"), home, allow.join(","), ...files], {
    stdin: "ignore", stdout: "pipe", stderr: "inherit",
  });
  const reader = proc.stdout.getReader();
  let text = "";
  const deadline = Date.now() + 30_000;
  while (!text.includes("\n")) {
    if (Date.now() > deadline) throw new Error(`peer process ${label} did not start`);
    const { value, done } = await reader.read();
    if (done) throw new Error(`peer process ${label} exited before it listened`);
    text += new TextDecoder().decode(value);
  }
  reader.releaseLock();
  return { peer: JSON.parse(text.slice(0, text.indexOf("\n"))) as PeerConfig, proc, home };
}
