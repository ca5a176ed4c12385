// Layers between a cluster's nodes over HTTP: a node's `/v1/layers` route (behind its API key)
// and the HttpPeers client under a PeerChunkSource, which verifies a whole layer against its
// digest as it does over iroh: a node serving other bytes is caught and penalised.
import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { writeFileSync } from "node:fs";
import { join } from "node:path";
import { createApi } from "../../src/api/app.ts";
import { layerRoutes } from "../../src/api/layers.ts";
import { HttpPeers } from "../../p2p/http_peers.ts";
import { PeerChunkSource } from "../../p2p/source.ts";
import { PeerDigestMismatchError } from "../../p2p/errors.ts";
import { prng, scratchDir, sha256 } from "../helpers/tmp.ts";

const KEY = "e2b_" + "7c".repeat(20);

describe("layers over HTTP between nodes", () => {
  const dir = scratchDir("http-peers");
  const rnd = prng(3);
  const bytes = new Uint8Array(9 << 20).map(() => Math.floor(rnd() * 256));
  const digest = `sha256:${sha256(bytes)}` as const;
  const good = join(dir, "good");
  const bad = join(dir, "bad");
  let servers: ReturnType<typeof Bun.serve>[] = [];
  const node = (path: string) => {
    const app = createApi({ apiKey: KEY, maxBodyBytes: 1 << 20, notReadyReason: () => undefined, version: "t" })
      .use(layerRoutes({ provide: async (d) => (d === digest ? { path, size: bytes.length } : undefined) }));
    const s = Bun.serve({ hostname: "127.0.0.1", port: 0, fetch: (r) => app.handle(r) });
    servers.push(s);
    return `http://127.0.0.1:${s.port}`;
  };
  beforeAll(() => {
    writeFileSync(good, bytes);
    const other = Uint8Array.from(bytes);
    other[5 << 20] ^= 1;
    writeFileSync(bad, other);
  });
  afterAll(() => {
    for (const s of servers) s.stop(true);
    servers = [];
  });

  test("the route: the key is required, HEAD gives the size, GET one bounded Range; an unknown layer is 404", async () => {
    const url = node(good);
    expect((await fetch(`${url}/v1/layers/${digest}`, { method: "HEAD" })).status).toBe(401);
    const head = await fetch(`${url}/v1/layers/${digest}`, { method: "HEAD", headers: { "x-api-key": KEY } });
    expect(head.status).toBe(200);
    expect(head.headers.get("x-aenv-layer-size")).toBe(String(bytes.length));
    const r = await fetch(`${url}/v1/layers/${digest}`, { headers: { "x-api-key": KEY, range: "bytes=10-19" } });
    expect(r.status).toBe(206);
    expect(new Uint8Array(await r.arrayBuffer())).toEqual(bytes.subarray(10, 20));
    expect((await fetch(`${url}/v1/layers/${digest}`, { headers: { "x-api-key": KEY } })).status).toBe(416);
    expect((await fetch(`${url}/v1/layers/${digest}`, { headers: { "x-api-key": KEY, range: `bytes=0-${bytes.length}` } })).status).toBe(416);
    expect((await fetch(`${url}/v1/layers/sha256:${"0".repeat(64)}`, { headers: { "x-api-key": KEY, range: "bytes=0-1" } })).status).toBe(404);
  });

  test("a whole layer from a node, verified; a node that serves other bytes fails the digest and is named", async () => {
    const peers = new HttpPeers(KEY);
    peers.setPeers([{ id: "a", url: node(good) }]);
    const src = new PeerChunkSource(peers);
    const got = await src.fetchLayer(digest, join(dir, "fetched"));
    expect(got.size).toBe(bytes.length);
    expect(got.peers).toEqual(["a"]);
    const liar = new HttpPeers(KEY);
    liar.setPeers([{ id: "liar", url: node(bad) }]);
    const e = await new PeerChunkSource(liar).fetchLayer(digest, join(dir, "fetched-bad")).catch((x: unknown) => x);
    expect(e).toBeInstanceOf(PeerDigestMismatchError);
    expect((e as Error).message).toContain("liar");
  });

  test("a wrong key is refused: the layer is not found through that node", async () => {
    const peers = new HttpPeers("e2b_" + "00".repeat(20));
    peers.setPeers([{ id: "a", url: node(good) }]);
    expect(await new PeerChunkSource(peers).size(digest)).toBeUndefined();
  });
});
