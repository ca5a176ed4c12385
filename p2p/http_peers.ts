// Peers over plain HTTP: the other nodes of a cluster, which reach each other directly, serve
// their verified layers at `GET|HEAD /v1/layers/sha256:<hex>` on their API port (the cluster's API
// key; HEAD answers the size in x-aenv-layer-size), Range reads of at most MAX_READ bytes. A PeerChunkSource over this client reads and
// verifies as it does over iroh (a whole layer is hashed before it appears); iroh stays for peers
// only it reaches.
import type { LayerDigest } from "../src/storage/remote/source.ts";
import type { RequestOptions } from "./node.ts";
import type { HaveEntry } from "./protocol.ts";
import { MAX_READ } from "./protocol.ts";
import type { PeerClient } from "./worker.ts";

/** Nodes this client asks at most (a cluster's nodes, from its records). */
export const MAX_HTTP_PEERS = 1024;
/** A request's bound unless its caller gives one. */
const DEFAULT_TIMEOUT_MS = 10_000;

export class HttpPeerError extends Error {
  override name = "HttpPeerError";
}

export class HttpPeers implements PeerClient {
  readonly id = "http";
  private peers = new Map<string, string>();

  constructor(private readonly apiKey: string) {}

  /** The nodes to ask: ID → API URL (http://host:port); this node left out by the caller. */
  setPeers(peers: { id: string; url: string }[]): void {
    this.peers = new Map(peers.slice(0, MAX_HTTP_PEERS).map((p) => [p.id, p.url]));
  }

  peerIds(): string[] {
    return [...this.peers.keys()];
  }

  /** Where `peerId` serves `digest` (a reader with the cluster's key may read it there directly). */
  url(peerId: string, digest: LayerDigest): string {
    const base = this.peers.get(peerId);
    if (!base) throw new HttpPeerError(`${peerId} is not a peer`);
    return `${base}/v1/layers/${digest}`;
  }

  private signal(o: RequestOptions | undefined): AbortSignal {
    const t = AbortSignal.timeout(o?.timeoutMs ?? DEFAULT_TIMEOUT_MS);
    return o?.signal ? AbortSignal.any([o.signal, t]) : t;
  }

  async have(peerId: string, digests: LayerDigest[], o?: RequestOptions): Promise<HaveEntry[]> {
    const out: HaveEntry[] = [];
    for (const digest of digests) {
      const r = await fetch(this.url(peerId, digest), { method: "HEAD", headers: { "x-api-key": this.apiKey }, signal: this.signal(o) });
      if (r.status === 404) continue;
      if (!r.ok) throw new HttpPeerError(`${peerId}: HEAD ${digest}: ${r.status}`);
      const size = Number(r.headers.get("x-aenv-layer-size") ?? NaN);
      if (!Number.isSafeInteger(size) || size < 0) throw new HttpPeerError(`${peerId}: HEAD ${digest}: no size`);
      out.push({ digest, size });
    }
    return out;
  }

  /**
   * A range of up to `maxBytes` from `peerId` as its response streams (no copy in between): the
   * peer facade passes it on, unverified as every range it serves is. Throws when the peer does
   * not answer 206 with exactly that range.
   */
  async stream(peerId: string, digest: LayerDigest, start: number, end: number, o?: RequestOptions): Promise<Response> {
    const r = await fetch(this.url(peerId, digest), {
      headers: { "x-api-key": this.apiKey, range: `bytes=${start}-${end}` }, signal: this.signal(o),
    });
    if (r.status !== 206 || Number(r.headers.get("content-length")) !== end - start + 1) {
      await r.body?.cancel().catch(() => {});
      throw new HttpPeerError(`${peerId}: GET ${digest} ${start}-${end}: ${r.status}`);
    }
    return r;
  }

  async read(peerId: string, digest: LayerDigest, offset: number, length: number, o?: RequestOptions): Promise<{ data: Uint8Array; size: number }> {
    if (length < 1 || length > MAX_READ) throw new HttpPeerError(`a read of ${length} bytes: 1..${MAX_READ}`);
    const r = await fetch(this.url(peerId, digest), {
      headers: { "x-api-key": this.apiKey, range: `bytes=${offset}-${offset + length - 1}` }, signal: this.signal(o),
    });
    if (r.status !== 206) throw new HttpPeerError(`${peerId}: GET ${digest} ${offset}+${length}: ${r.status}`);
    const total = Number(/\/(\d+)$/.exec(r.headers.get("content-range") ?? "")?.[1]);
    const data = new Uint8Array(await r.arrayBuffer());
    if (data.length !== length) throw new HttpPeerError(`${peerId}: GET ${digest} ${offset}+${length}: ${data.length} bytes came`);
    return { data, size: total };
  }
}
