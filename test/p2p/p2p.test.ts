// Peers over iroh on loopback: real endpoints, real sealed layers, peers in separate processes.
import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { copyFileSync, existsSync, openSync, closeSync, writeSync, statSync } from "node:fs";
import { join } from "node:path";
import { Endpoint, EndpointAddr, EndpointId, presetMinimal, RelayMode, SecretKey } from "@number0/iroh";
import {
  encodeFrame,
  keyPath,
  LayerShelf,
  LAYERS_ALPN_BYTES,
  MAX_READ,
  NoPeerError,
  PeerChunkSource,
  PeerDigestMismatchError,
  PeerNode,
  PeerRefusedError,
  PeerWorker,
  readFrame,
  sha256OfFile,
  UnknownDigestError,
} from "../../p2p/index.ts";
import { RemoteFile } from "../../src/storage/remote/remote_file.ts";
import type { ChunkSource, LayerDigest } from "../../src/storage/remote/source.ts";
import { scratchDir } from "../helpers/tmp.ts";
import { localPeer, peerProcess, randomLayer, type Layer, type PeerProcess } from "./harness.ts";

const dir = scratchDir("p2p");
let layer: Layer;
const nodes: PeerNode[] = [];
const procs: PeerProcess[] = [];

async function peer(label: string, o: Parameters<typeof localPeer>[1] = {}) {
  const p = await localPeer(label, o);
  nodes.push(p.node);
  return p;
}

beforeAll(async () => {
  layer = await randomLayer(dir, 24, 7); // 24 MiB of data: 6 reads of MAX_READ
}, 120_000);

afterAll(async () => {
  for (const p of procs) p.proc.kill(9);
  await Promise.all(nodes.map((n) => n.close()));
}, 30_000);

describe("identity", () => {
  test("the secret key is made once, mode 0600, and the endpoint ID survives a restart", async () => {
    const home = scratchDir("p2p-key");
    const a = await PeerNode.start({ home, bindAddr: "127.0.0.1:0" });
    const id = a.id;
    await a.close();
    expect(statSync(keyPath(home)).mode & 0o777).toBe(0o600);
    const racing = await Promise.all([PeerNode.start({ home, bindAddr: "127.0.0.1:0" }), PeerNode.start({ home, bindAddr: "127.0.0.1:0" })]);
    expect(racing.map((n) => n.id)).toEqual([id, id]);
    await Promise.all(racing.map((n) => n.close()));
  });
});

describe("fetching layers", () => {
  test("B fetches a layer from A in another process (no origin); two racing fetches to one file both succeed", async () => {
    const b = await peer("b");
    const a = await peerProcess("a", [b.node.id], [layer.path]);
    procs.push(a);
    b.node.setPeers([a.peer]);
    const src = new PeerChunkSource(b.node);
    expect(await src.size(layer.digest)).toBe(layer.size);
    const dest = join(dir, "b.layer");
    const [r1, r2] = await Promise.all([src.fetchLayer(layer.digest, dest), src.fetchLayer(layer.digest, dest)]);
    expect(r1.peers).toEqual([a.peer.id]);
    expect(r2.size).toBe(layer.size);
    expect((await sha256OfFile(dest)).digest).toBe(layer.digest);
    // A range through the ChunkSource seam: exactly the bytes of the local file.
    const want = new Uint8Array(await Bun.file(layer.path).slice(5 << 20, (5 << 20) + 123_457).arrayBuffer());
    expect(await src.read(layer.digest, 5 << 20, 123_457, AbortSignal.timeout(30_000))).toEqual(want);
  }, 120_000);

  test("C fetches from A (own process) and B; both serve ranges; B serves the copy it fetched and verified", async () => {
    const b = await peer("b2");
    const c = await peer("c");
    const a = await peerProcess("a2", [b.node.id, c.node.id], [layer.path]);
    procs.push(a);
    b.node.setPeers([a.peer]);
    const fromA = await new PeerChunkSource(b.node).fetchLayer(layer.digest, join(dir, "b2.layer"));
    b.shelf.addVerified(layer.digest, fromA.path, fromA.size);
    b.node.setPeers([a.peer, c.node.self()]); // C may now ask B
    c.node.setPeers([a.peer, b.node.self()]);
    const src = new PeerChunkSource(c.node);
    await (await src.find(layer.digest)).done; // both have answered
    const r = await src.fetchLayer(layer.digest, join(dir, "c.layer"));
    expect(r.peers.sort()).toEqual([a.peer.id, b.node.id].sort());
    expect((await sha256OfFile(r.path)).digest).toBe(layer.digest);
    expect(b.node.stats().bytesServed).toBeGreaterThan(0);
  }, 120_000);

  test("a peer serving corrupt bytes is caught and blamed; nothing is left at the destination", async () => {
    const bad = join(dir, "corrupt.layer");
    copyFileSync(layer.path, bad);
    const fd = openSync(bad, "r+");
    writeSync(fd, new Uint8Array([0xde, 0xad]), 0, 2, 9 << 20);
    closeSync(fd);
    const d = await peer("d");
    const liar = await peer("liar", {
      allow: [d.node.id],
      layers: async (digest) => (digest === layer.digest ? { path: bad, size: layer.size } : undefined),
    });
    d.node.setPeers([liar.node.self()]);
    const src = new PeerChunkSource(d.node);
    const dest = join(dir, "d.layer");
    const err = await src.fetchLayer(layer.digest, dest).catch((e) => e);
    expect(err).toBeInstanceOf(PeerDigestMismatchError);
    expect((err as PeerDigestMismatchError).peerId).toBe(liar.node.id);
    expect(existsSync(dest)).toBe(false);
    expect(src.penalized(liar.node.id, layer.digest)).toBe(true);
  }, 120_000);

  test("a peer killed mid-transfer is replaced by another peer", async () => {
    const e = await peer("e");
    const f = await peer("f", { allow: [e.node.id] });
    await f.shelf.add(layer.path);
    const a = await peerProcess("a3", [e.node.id], [layer.path]);
    procs.push(a);
    e.node.setPeers([a.peer, f.node.self()]);
    const src = new PeerChunkSource(e.node, { readTimeoutMs: 5_000, streams: 2 });
    await (await src.find(layer.digest)).done;
    let killed = false;
    const r = await src.fetchLayer(layer.digest, join(dir, "e.layer"), {
      onProgress: ({ from }) => { if (from === a.peer.id && !killed) { killed = true; a.proc.kill(9); } },
    });
    expect(killed).toBe(true);
    expect(r.peers).toContain(f.node.id);
    expect((await sha256OfFile(r.path)).digest).toBe(layer.digest);
    expect(src.penalized(a.peer.id, layer.digest)).toBe(true);
  }, 120_000);

  test("with the only peer killed mid-transfer, the origin serves the rest", async () => {
    const g = await peer("g");
    const a = await peerProcess("a4", [g.node.id], [layer.path]);
    procs.push(a);
    g.node.setPeers([a.peer]);
    let originReads = 0;
    // The origin stands in for the registry or S3: the layer's bytes from a file.
    const origin: ChunkSource = {
      name: "origin file",
      async read(_d, offset, length) {
        originReads++;
        return new Uint8Array(await Bun.file(layer.path).slice(offset, offset + length).arrayBuffer());
      },
    };
    const src = new PeerChunkSource(g.node, { readTimeoutMs: 5_000, streams: 1 });
    let killed = false;
    const r = await src.fetchLayer(layer.digest, join(dir, "g.layer"), {
      origin,
      onProgress: ({ from }) => { if (from === a.peer.id && !killed) { killed = true; a.proc.kill(9); } },
    });
    expect(killed).toBe(true);
    expect(originReads).toBeGreaterThan(0);
    expect(r.originBytes).toBeGreaterThan(0);
    expect((await sha256OfFile(r.path)).digest).toBe(layer.digest);
  }, 120_000);
});

describe("short answers", () => {
  test("a peer that answers short for a layer is skipped for that layer; another peer, then the origin, answers", async () => {
    const whole = new Uint8Array(await Bun.file(layer.path).arrayBuffer());
    // The short peer holds the right file but announces it cut at `cut`: a read across the cut comes
    // back as the layer's end, fewer bytes than asked (the client's node takes it as EOF; the source must not).
    const cut = (9 << 20) + 12_345;
    const client = await peer("short-client");
    const short = await peer("short", {
      allow: [client.node.id],
      layers: async (digest) => (digest === layer.digest ? { path: layer.path, size: cut } : undefined),
    });
    const good = await peer("good", { allow: [client.node.id] });
    await good.shelf.add(layer.path);
    client.node.setPeers([short.node.self(), good.node.self()]);
    const direct = await client.node.read(short.node.id, layer.digest, cut - 5_000, 70_000);
    expect(direct.data.length).toBe(5_000); // what the short peer answers, with no error
    const baseline = short.node.stats().readRequests;

    // Two holders: reads take turns between them, so one of the first two is asked of the short peer.
    const src = new PeerChunkSource(client.node);
    await (await src.find(layer.digest)).done; // both have answered have?
    const ranges: [number, number][] = [[cut - 5_000, 70_000], [cut - 100_000, 200_000], [cut - 1, 2], [cut - 65_536, 65_536 + 4096], [cut - 300_000, 1 << 20]];
    for (const [off, len] of ranges) {
      expect(await src.read(layer.digest, off, len, AbortSignal.timeout(30_000))).toEqual(whole.subarray(off, off + len));
      if (off === ranges[1]![0]) {
        expect(src.penalized(short.node.id, layer.digest)).toBe(true);
        expect(src.penalized(good.node.id, layer.digest)).toBe(false);
      }
    }
    // Asked once, then skipped for the layer: the good peer served every read.
    expect(short.node.stats().readRequests - baseline).toBe(1);
    expect(good.node.stats().readRequests).toBe(ranges.length);
    expect(src.penalized(short.node.id, layer.digest)).toBe(true);

    // A whole-layer fetch given the layer's size: the short peer's smaller size does not cut the
    // layer; its short answers put it in the penalty box and the good peer serves the rest.
    const fetcher = new PeerChunkSource(client.node);
    const dest = join(scratchDir("p2p-short-fetch"), "layer");
    const got = await fetcher.fetchLayer(layer.digest, dest, { size: layer.size });
    expect(got.size).toBe(layer.size);
    expect(await sha256OfFile(dest)).toEqual({ digest: layer.digest, size: layer.size });
    expect(fetcher.penalized(good.node.id, layer.digest)).toBe(false);
    expect(got.peers).toContain(good.node.id);

    // Through RemoteFile, with the short peer the only one: the peer source fails (short, then no peer
    // left, a final answer), the origin after it answers, and the short peer is in the penalty box.
    client.node.setPeers([short.node.self()]);
    const beforeFile = short.node.stats().readRequests;
    const peers = new PeerChunkSource(client.node);
    let originReads = 0;
    const origin: ChunkSource = {
      name: "origin file",
      async read(_d, offset, length) {
        originReads++;
        return whole.slice(offset, offset + length);
      },
    };
    const f = RemoteFile.open({ digest: layer.digest, size: layer.size, sources: [peers, origin], backoffBaseMs: 5 });
    try {
      const buf = new Uint8Array(8192);
      expect(await f.pread(buf, cut - 4096)).toBe(buf.length);
      expect(buf).toEqual(whole.subarray(cut - 4096, cut + 4096));
      expect(peers.penalized(short.node.id, layer.digest)).toBe(true);
      expect(originReads).toBe(1);
      expect(f.stats.failures).toEqual({ [peers.name]: 1 });
      expect(short.node.stats().readRequests - beforeFile).toBe(1);
    } finally {
      await f.close();
    }
  }, 120_000);
});

describe("bounds", () => {
  test("with one read slot on the server, racing reads wait their turn and each gets its own bytes", async () => {
    const asker = await peer("asker");
    const narrow = await peer("narrow", { allow: [asker.node.id], limits: { maxReads: 1 } });
    await narrow.shelf.add(layer.path);
    asker.node.setPeers([narrow.node.self()]);
    const offsets = [0, 3 << 20, 7 << 20, 11 << 20, 19 << 20];
    const got = await Promise.all(offsets.map((o) => asker.node.read(narrow.node.id, layer.digest, o, 1 << 20)));
    const file = Bun.file(layer.path);
    for (const [i, o] of offsets.entries()) {
      expect(got[i]!.data).toEqual(new Uint8Array(await file.slice(o, o + (1 << 20)).arrayBuffer()));
    }
    expect(narrow.node.stats().readRequests).toBe(offsets.length);
  }, 60_000);
});

describe("worker threads", () => {
  test("a PeerWorker serves (asking its owner's shelf) and fetches; its errors keep their classes", async () => {
    const shelf = new LayerShelf();
    await shelf.add(layer.path);
    const server = await PeerWorker.start({ home: scratchDir("p2p-ws"), bindAddr: "127.0.0.1:0", layers: shelf.provider });
    const fetcher = await PeerWorker.start({ home: scratchDir("p2p-wc"), bindAddr: "127.0.0.1:0", peers: [server.self()] });
    try {
      await server.setPeers([fetcher.self()]);
      const r = await new PeerChunkSource(fetcher).fetchLayer(layer.digest, join(dir, "worker.layer"));
      expect(r.peers).toEqual([server.id]);
      expect((await sha256OfFile(r.path)).digest).toBe(layer.digest);
      expect((await server.stats()).bytesServed).toBe(layer.size);
      // An aborted read rejects with the signal's reason (the worker is told to stop it) and the next one works.
      const ctl = new AbortController();
      const aborted = fetcher.read(server.id, layer.digest, 0, MAX_READ, { signal: ctl.signal }).catch((e) => e);
      ctl.abort(new Error("caller gave up"));
      expect(((await aborted) as Error).message).toBe("caller gave up");
      expect((await fetcher.read(server.id, layer.digest, 4096, 4096)).data).toEqual(new Uint8Array(await Bun.file(layer.path).slice(4096, 8192).arrayBuffer()));
      const unknown = `sha256:${"1".repeat(64)}` as LayerDigest;
      const err = await fetcher.read(server.id, unknown, 0, 10).catch((e) => e);
      expect(err).toBeInstanceOf(UnknownDigestError);
      expect((err as UnknownDigestError).peerId).toBe(server.id);
    } finally {
      await Promise.all([server.close(), fetcher.close()]);
    }
  }, 120_000);
});

describe("bad input", () => {
  let server: Awaited<ReturnType<typeof peer>>;
  let rawKey: SecretKey;
  let raw: Endpoint;

  beforeAll(async () => {
    rawKey = SecretKey.generate();
    server = await peer("srv", { allow: [rawKey.public().toString()] });
    await server.shelf.add(layer.path);
    const b = Endpoint.builder();
    presetMinimal(b);
    b.secretKey(rawKey.toBytes());
    b.relayMode(RelayMode.disabled());
    b.bindAddr("127.0.0.1:0");
    raw = await b.bind();
  });
  afterAll(async () => { await raw?.close(); });

  test("a node configured with relay URLs still serves peers that dial it directly", async () => {
    const relayed = await peer("relayed", { relayUrls: ["http://127.0.0.1:9/"] }); // no relay there: direct paths only
    relayed.node.setPeers([server.node.self()]);
    server.node.setPeers([relayed.node.self()]);
    expect(await relayed.node.have(server.node.id, [layer.digest])).toEqual([{ digest: layer.digest, size: layer.size }]);
  }, 60_000);

  test("a peer not on the allow-list is refused at accept, with a named error", async () => {
    const stranger = await peer("stranger");
    stranger.node.setPeers([server.node.self()]);
    const before = server.node.stats().refused;
    const err = await stranger.node.have(server.node.id, [layer.digest]).catch((e) => e);
    expect(err).toBeInstanceOf(PeerRefusedError);
    expect(server.node.stats().refused).toBe(before + 1);
    const src = new PeerChunkSource(stranger.node);
    expect(await src.read(layer.digest, 0, 4096, AbortSignal.timeout(10_000)).catch((e) => e)).toBeInstanceOf(NoPeerError);
  }, 60_000);

  test("a peer taken off the allow-list loses its open connection and is refused from then on", async () => {
    const friend = await peer("friend");
    friend.node.setPeers([server.node.self()]);
    server.node.setPeers([friend.node.self()]);
    expect(await friend.node.have(server.node.id, [layer.digest])).toEqual([{ digest: layer.digest, size: layer.size }]);
    server.node.setPeers([]);
    const err = await friend.node.have(server.node.id, [layer.digest]).catch((e) => e);
    expect(err).toBeInstanceOf(PeerRefusedError);
  }, 60_000);

  test("malformed frames get a named error answer and the server keeps serving the same connection", async () => {
    const conn = await raw.connect(new EndpointAddr(EndpointId.fromString(server.node.id), null, server.node.addrs()), LAYERS_ALPN_BYTES);
    const ask = async (bytes: number[]) => {
      const bi = await conn.openBi();
      await bi.send.writeAll(bytes);
      await bi.send.finish();
      return readFrame(bi.recv);
    };
    const text = (s: string) => Array.from(new TextEncoder().encode(s));
    const cases: [string, number[], string][] = [
      ["length past the bound", [0xff, 0xff, 0xff, 0xff, 1, 2, 3], "MalformedFrame"],
      ["zero length", [0, 0, 0, 0], "MalformedFrame"],
      ["stream ends inside the frame", [0, 0, 0, 50, ...text("{\"op\"")], "MalformedFrame"],
      ["not JSON", [0, 0, 0, 5, ...text("hello")], "MalformedFrame"],
      ["unknown op", encodeFrame({ op: "delete", digest: layer.digest }), "MalformedFrame"],
      ["bad digest", encodeFrame({ op: "read", digest: "sha256:xyz", offset: 0, length: 1 }), "MalformedFrame"],
      ["negative offset", encodeFrame({ op: "read", digest: layer.digest, offset: -1, length: 1 }), "MalformedFrame"],
      ["read past the bound", encodeFrame({ op: "read", digest: layer.digest, offset: 0, length: MAX_READ + 1 }), "Range"],
      ["offset past the end", encodeFrame({ op: "read", digest: layer.digest, offset: layer.size + 1, length: 1 }), "Range"],
    ];
    const before = server.node.stats().malformed;
    for (const [why, bytes, code] of cases) {
      const answer = await ask(bytes);
      expect({ why, ok: answer.ok, error: answer.error }).toEqual({ why, ok: false, error: code });
      // …and a good request on the same connection still works.
      const good = await ask(encodeFrame({ op: "have", digests: [layer.digest] }));
      expect(good).toEqual({ ok: true, have: [{ digest: layer.digest, size: layer.size }] });
    }
    expect(server.node.stats().malformed - before).toBe(7);
    conn.close(0n, []);
  }, 60_000);

  test("unknown digest: have? leaves it out, read is UnknownDigestError, the source says NoPeerError", async () => {
    const client = await peer("client");
    server.node.setPeers([client.node.self()]); // allow-lists the client
    client.node.setPeers([server.node.self()]);
    const unknown = `sha256:${"0".repeat(64)}` as LayerDigest;
    expect(await client.node.have(server.node.id, [unknown, layer.digest])).toEqual([{ digest: layer.digest, size: layer.size }]);
    const err = await client.node.read(server.node.id, unknown, 0, 4096).catch((e) => e);
    expect(err).toBeInstanceOf(UnknownDigestError);
    expect((err as UnknownDigestError).peerId).toBe(server.node.id);
    const src = new PeerChunkSource(client.node);
    expect(await src.read(unknown, 0, 4096, AbortSignal.timeout(10_000)).catch((e) => e)).toBeInstanceOf(NoPeerError);
    expect(await src.fetchLayer(unknown, join(dir, "unknown.layer")).catch((e) => e)).toBeInstanceOf(NoPeerError);
  }, 60_000);
});
