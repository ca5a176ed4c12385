// The node's peers (src/node/peers.ts) with real iroh endpoints on loopback: node B's facade, the
// http source blockd's workers use over a unix socket, reads a layer node A pushed or promoted;
// a layer no peer holds answers 404 at once, so a RemoteFile goes on to its origin; bad requests
// and a facade that is gone fail clearly. A snapshot in S3 whose shared files a peer holds is
// materialized with those files from the peer, not from S3.
import { Database } from "bun:sqlite";
import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { mkdirSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { SecretKey } from "@number0/iroh";
import { loadOrCreateSecretKey } from "../../p2p/index.ts";
import { NodePeers, PeersConfigError, parsePeers } from "../../src/node/peers.ts";
import { BlockCache } from "../../src/storage/remote/block_cache.ts";
import { RegistryRangeSource } from "../../src/storage/remote/http_source.ts";
import { originSource } from "../../src/storage/remote/layer.ts";
import { RemoteFile } from "../../src/storage/remote/remote_file.ts";
import { openSnapshotStore, S3SnapshotStore } from "../../src/snapshot/index.ts";
import { startS3Server, type TestS3 } from "../snapshot/s3_server.ts";
import { SourceError, type LayerDigest } from "../../src/storage/remote/source.ts";
import { scratchDir, sha256 } from "../helpers/tmp.ts";
import { startBlobOrigin } from "../storage/remote_origin.ts";

const MiB = 2 ** 20;
const idOf = async (home: string) => SecretKey.fromBytes(await loadOrCreateSecretKey(home)).public().toString();
const port = () => 20_000 + Math.floor(Math.random() * 30_000);

describe("the node's peers: the facade blockd reads through", () => {
  const dir = scratchDir("node-peers");
  let a: NodePeers;
  let b: NodePeers;
  const pushed = crypto.getRandomValues(new Uint8Array(6 * MiB + 12345));
  const pushedDigest = `sha256:${sha256(pushed)}` as LayerDigest;
  const promoted = crypto.getRandomValues(new Uint8Array(2 * MiB));
  const promotedDigest = `sha256:${sha256(promoted)}` as LayerDigest;
  let s3: TestS3;
  let storeA: S3SnapshotStore;
  let storeB: S3SnapshotStore;
  const facadeRead = (digest: string, offset: number, length: number) =>
    originSource(b.originFor(digest)).read(digest as LayerDigest, offset, length, AbortSignal.timeout(20_000));

  beforeAll(async () => {
    const homeA = join(dir, "a");
    const homeB = join(dir, "b");
    const [idA, idB] = [await idOf(homeA), await idOf(homeB)];
    const bindA = `127.0.0.1:${port()}`;
    const cacheA = { dir: join(homeA, "block-cache"), capacity: 256 * MiB };
    mkdirSync(join(dir, "s3"), { recursive: true });
    s3 = await startS3Server(join(dir, "s3"));
    const s3Settings = { accessKeyId: "S3RVER", secretAccessKey: "S3RVER", region: "us-east-1", endpoint: s3.endpoint };
    storeA = openSnapshotStore("s3://snapshots/peers", { home: homeA, s3: s3Settings }) as S3SnapshotStore;
    storeB = openSnapshotStore("s3://snapshots/peers", { home: homeB, s3: s3Settings, fromPeers: (h, size, dest, signal) => b.fetchBlob(h, size, dest, signal) }) as S3SnapshotStore;
    a = await NodePeers.start({
      home: homeA, db: new Database(join(dir, "a.db")), bindAddr: bindA, peers: [], allow: [idB], relayUrls: [], cache: cacheA, socketPath: join(dir, "a.sock"),
      blobDirs: [storeA.blobsDir],
    });
    b = await NodePeers.start({
      home: homeB, db: new Database(join(dir, "b.db")), bindAddr: "127.0.0.1:0", peers: [{ id: idA, addrs: [bindA] }], allow: [], relayUrls: [],
      cache: { dir: join(homeB, "block-cache"), capacity: 256 * MiB }, socketPath: join(dir, "b.sock"),
    });
    expect(a.worker.id).toBe(idA);
    // A pushed one layer file (its digest known from the push) and promoted another in its block cache.
    writeFileSync(join(dir, "pushed.layer"), pushed);
    a.addPushed([{ digest: pushedDigest, path: join(dir, "pushed.layer"), size: pushed.length }]);
    const cache = await BlockCache.shared(cacheA);
    mkdirSync(join(cacheA.dir, "layers"), { recursive: true });
    writeFileSync(cache.promotedPath(promotedDigest), promoted);
  }, 60_000);
  afterAll(async () => {
    await b?.close();
    await a?.close();
    await s3?.stop();
  }, 30_000);

  test("ranges of a pushed and of a promoted layer come from peer A through B's facade", async () => {
    const got = await facadeRead(pushedDigest, 3 * MiB - 100, 2 * MiB);
    expect(sha256(got)).toBe(sha256(pushed.subarray(3 * MiB - 100, 5 * MiB - 100)));
    const tail = await facadeRead(pushedDigest, 6 * MiB, 12345);
    expect(sha256(tail)).toBe(sha256(pushed.subarray(6 * MiB)));
    expect(sha256(await facadeRead(promotedDigest, 0, promoted.length))).toBe(sha256(promoted));
    expect((await b.stats()).facade.bytes).toBeGreaterThanOrEqual(2 * MiB + 12345 + promoted.length);
    expect((await a.stats()).endpoint.bytesServed).toBeGreaterThanOrEqual(2 * MiB + 12345 + promoted.length);
  }, 60_000);

  test("a RemoteFile whose origin is down reads the whole layer from the peer", async () => {
    const cache = await BlockCache.open({ dir: join(dir, "rf-cache"), capacity: 64 * MiB });
    const dead = new RegistryRangeSource({ url: `http://127.0.0.1:1/v2/x/blobs/${pushedDigest}` });
    const f = RemoteFile.open({ digest: pushedDigest, size: pushed.length, sources: [originSource(b.originFor(pushedDigest)), dead], cache });
    const buf = new Uint8Array(pushed.length);
    expect(await f.pread(buf, 0)).toBe(pushed.length);
    expect(sha256(buf)).toBe(pushedDigest.slice(7));
    expect(f.stats.failures).toEqual({});
    await f.close();
  }, 60_000);

  test("a layer no peer holds is a 404 within the have? bound: the RemoteFile goes on to its origin", async () => {
    const other = crypto.getRandomValues(new Uint8Array(MiB));
    const origin = startBlobOrigin(other);
    try {
      const cache = await BlockCache.open({ dir: join(dir, "miss-cache"), capacity: 64 * MiB });
      const f = RemoteFile.open({ digest: origin.digest, size: other.length, sources: [originSource(b.originFor(origin.digest)), new RegistryRangeSource({ url: origin.url })], cache });
      const t0 = performance.now();
      const buf = new Uint8Array(other.length);
      expect(await f.pread(buf, 0)).toBe(other.length);
      expect(performance.now() - t0).toBeLessThan(5_000);
      expect(sha256(buf)).toBe(origin.digest.slice(7));
      // The facade's miss counted once, not retried.
      expect(Object.values(f.stats.failures)).toEqual([1]);
      expect(origin.bytesSent).toBe(other.length);
      await f.close();
    } finally {
      origin.stop();
    }
  }, 30_000);

  test("a snapshot in S3: its shared file comes from the peer that holds it, the rest from S3", async () => {
    const layer = crypto.getRandomValues(new Uint8Array(3 * MiB + 4096));
    const state = crypto.getRandomValues(new Uint8Array(64 << 10));
    writeFileSync(join(dir, "mem-layer-0"), layer);
    writeFileSync(join(dir, "vmstate"), state);
    await storeA.put("snap-p2p", [{ name: "mem-layer-0", path: join(dir, "mem-layer-0"), shared: true }, { name: "vmstate", path: join(dir, "vmstate") }], {});
    // A holds the shared file once it has the snapshot in its cache.
    await storeA.get("snap-p2p");
    const got = await storeB.get("snap-p2p");
    expect(sha256(await Bun.file(got.paths["mem-layer-0"]!).bytes())).toBe(sha256(layer));
    expect(sha256(await Bun.file(got.paths.vmstate!).bytes())).toBe(sha256(state));
    expect(storeB.cache.peerBytes).toBe(layer.length);
    expect(storeB.cache.fetchedBytes).toBe(state.length);
  }, 60_000);

  test("bad requests to the facade: no Range, too large a Range, another path", async () => {
    const url = `http://peers/layers/${pushedDigest}`;
    expect((await fetch(url, { unix: b.socketPath })).status).toBe(416);
    expect((await fetch(url, { unix: b.socketPath, headers: { range: `bytes=0-${64 * MiB}` } })).status).toBe(416);
    expect((await fetch("http://peers/other", { unix: b.socketPath })).status).toBe(400);
    expect((await fetch(url, { unix: b.socketPath, method: "POST", headers: { range: "bytes=0-1" } })).status).toBe(400);
  });

  test("a facade socket with nothing behind it fails at once, not retried", async () => {
    const gone = originSource({ kind: "http", url: `http://peers/layers/${pushedDigest}`, unix: join(dir, "nobody.sock") });
    const e = await gone.read(pushedDigest, 0, 4096, AbortSignal.timeout(5_000)).catch((x: Error) => x);
    expect(e).toBeInstanceOf(SourceError);
    expect((e as SourceError).retryable).toBe(false);
  });

  test("AENV_P2P_PEERS: well-formed entries parse, others are a PeersConfigError", () => {
    const id = "ab".repeat(32);
    expect(parsePeers(`${id}@127.0.0.1:7000, ${id}@10.0.0.1:1;[::1]:2`)).toEqual([
      { id, addrs: ["127.0.0.1:7000"] },
      { id, addrs: ["10.0.0.1:1", "[::1]:2"] },
    ]);
    expect(parsePeers("")).toEqual([]);
    for (const bad of ["nope", `${id}`, `${id}@`, `${id}@host:1`, `xyz@127.0.0.1:1`, `${id}@127.0.0.1`])
      expect(() => parsePeers(bad)).toThrow(PeersConfigError);
  });
});
