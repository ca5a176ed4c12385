// A remote layer whose only source is peers (no origin): the storage engine's RemoteFile reads it
// through PeerChunkSource from a peer in another process, opens it as a sealed layer, and its
// background download is verified and promoted into the block cache.
import { afterAll, beforeAll, expect, test } from "bun:test";
import { join } from "node:path";
import { PeerChunkSource, sha256OfFile } from "../../p2p/index.ts";
import { LocalFile } from "../../src/storage/local_file.ts";
import { ReadOnlyLayer } from "../../src/storage/lsmt/readonly_layer.ts";
import { BlockCache } from "../../src/storage/remote/block_cache.ts";
import { RemoteFile } from "../../src/storage/remote/remote_file.ts";
import { prng, scratchDir } from "../helpers/tmp.ts";
import { localPeer, peerProcess, randomLayer, type Layer, type PeerProcess } from "./harness.ts";

const dir = scratchDir("p2p-remote");
let layer: Layer;
let a: PeerProcess | undefined;

beforeAll(async () => {
  layer = await randomLayer(dir, 16, 11);
}, 120_000);
afterAll(() => { a?.proc.kill(9); });

test("RemoteFile over peers only: ranged reads fetch part of the layer, it opens as a sealed layer, the download is promoted verified", async () => {
  const b = await localPeer("remote-b");
  try {
    a = await peerProcess("remote-a", [b.node.id], [layer.path]);
    b.node.setPeers([a.peer]);
    const peers = new PeerChunkSource(b.node);
    const cache = await BlockCache.open({ dir: join(dir, "cache"), capacity: 64 << 20 });
    const f = RemoteFile.open({ digest: layer.digest, size: layer.size, sources: [peers], cache });
    try {
      const ro = await ReadOnlyLayer.open(f);
      const local = await ReadOnlyLayer.open(LocalFile.open(layer.path));
      expect(ro.virtualSize).toBe(local.virtualSize);
      expect(ro.index.length).toBe(local.index.length);
      await local.close();
      const whole = new Uint8Array(await Bun.file(layer.path).arrayBuffer());
      const next = prng(3);
      for (let i = 0; i < 8; i++) {
        const len = 1 + Math.floor(next() * 200_000);
        const off = Math.floor(next() * (layer.size - len));
        const buf = new Uint8Array(len);
        expect(await f.pread(buf, off)).toBe(len);
        expect(buf).toEqual(whole.subarray(off, off + len));
      }
      expect(f.stats.bytesFetched).toBeLessThan(layer.size);
      const promoted = await f.download();
      expect((await sha256OfFile(promoted)).digest).toBe(layer.digest);
      expect(f.stats.failures).toEqual({});
    } finally {
      await f.close();
    }
  } finally {
    await b.node.close();
  }
}, 120_000);
