// The node's peers (docs/p2p.md, "The node's peers"): an iroh endpoint on a worker thread
// (PeerWorker) that serves this node's verified layers, and a loopback HTTP facade on a unix
// socket through which blockd's workers read remote layers from the peers. blockd knows no peers:
// each remote lower the node hands it lists the facade as its first source (an http source with
// `unix`), so a chunk comes from the block cache, else from the peers, else from the origin.
//
// The facade answers `GET /layers/sha256:<hex>` with `Range: bytes=a-b` (at most MAX_FACADE_READ
// bytes): 206 and the bytes; 404 when no peer holds the layer or every holder failed (blockd moves
// on to the origin at once); 416/400 for a request it cannot serve; 503 past MAX_FACADE_READS.
//
// What this node serves: layers a block cache promoted whole (verified against their digest when
// promoted), the layer files this node pushed (hashed when pushed, recorded in node.db's
// `peer_layers`, at most MAX_SHELF rows), and the snapshot store's shared files (rootfs and memory
// layers, named by their sha256 and verified when they arrived). The snapshot cache asks the peers
// for a shared file before S3 (fetchBlob).
import type { Database } from "bun:sqlite";
import { mkdir, readdir, rm, stat } from "node:fs/promises";
import { dirname, join } from "node:path";
import { LayerShelf, MAX_SHELF, NoPeerError, PeerChunkSource, PeerWorker, type PeerConfig } from "../../p2p/index.ts";
import { HttpPeers } from "../../p2p/http_peers.ts";
import { BlockCache, type BlockCacheOptions } from "../storage/remote/block_cache.ts";
import { isLayerDigest, type LayerDigest } from "../storage/remote/source.ts";
import type { OriginSpec } from "../storage/remote/spec.ts";
import { SOCKET_ADDR } from "./config.ts";

/** Bytes one facade request may ask (a block cache fetch is 1–8 MiB). */
export const MAX_FACADE_READ = 16 << 20;
/** Facade requests at once; past it 503 (retryable for blockd). */
export const MAX_FACADE_READS = 64;
/** A facade request's bound, the peers' reads included. */
const FACADE_TIMEOUT_MS = 30_000;
/** Peers asked whether they hold a layer wait this long for each answer (a miss costs at most this). */
const HAVE_TIMEOUT_MS = 500;
/** One peer read (up to 4 MiB); a slow peer is then skipped for the layer. */
const READ_TIMEOUT_MS = 10_000;

export interface NodePeersOptions {
  /** $AENV_HOME: the secret key is $AENV_HOME/p2p/secret-key. */
  home: string;
  db: Database;
  /** "ip:port" the endpoint binds (AENV_P2P_BIND). */
  bindAddr: string;
  peers: PeerConfig[];
  /** Endpoint IDs that may connect without being asked (AENV_P2P_ALLOW). */
  allow: string[];
  relayUrls: string[];
  /** The node's block cache: its promoted layers are served. */
  cache: BlockCacheOptions;
  /** The facade's unix socket. */
  socketPath: string;
  /** Folders of verified files named by their sha256 in hex (the snapshot store's blobs). */
  blobDirs?: string[];
  /** In a cluster: the other nodes over HTTP (asked before the iroh peers). */
  httpPeers?: HttpPeers;
}

/** `AENV_P2P_PEERS`: comma-separated `ID@ip:port`, several addresses of one peer joined by `;`. */
export function parsePeers(raw: string): PeerConfig[] {
  const out: PeerConfig[] = [];
  for (const entry of raw.split(",").map((s) => s.trim()).filter(Boolean)) {
    const at = entry.indexOf("@");
    const id = at > 0 ? entry.slice(0, at) : "";
    const addrs = at > 0 ? entry.slice(at + 1).split(";").filter(Boolean) : [];
    if (!/^[0-9a-f]{64}$/.test(id) || addrs.length === 0 || !addrs.every((a) => SOCKET_ADDR.test(a)))
      throw new PeersConfigError(`peer ${JSON.stringify(entry)}: expected <64 hex ID>@<ip:port>[;<ip:port>…]`);
    out.push({ id, addrs });
  }
  return out;
}

export class PeersConfigError extends Error {
  override name = "PeersConfigError";
}

export class NodePeers {
  private readsInFlight = 0;
  private served = { requests: 0, bytes: 0, misses: 0, blobs: 0 };
  /** Bytes this node served the other nodes of its cluster over HTTP (`/v1/layers`). */
  private httpServed = 0;

  private constructor(
    readonly worker: PeerWorker,
    readonly source: PeerChunkSource,
    private readonly shelf: LayerShelf,
    private readonly cache: BlockCache,
    private readonly facade: ReturnType<typeof Bun.serve>,
    readonly socketPath: string,
    private readonly db: Database,
    /** What this node serves: a verified file of the layer, or undefined. */
    readonly provide: (digest: LayerDigest) => Promise<{ path: string; size: number } | undefined>,
    /** The cluster's nodes over HTTP, when it is in one: asked first. */
    private readonly httpSource: PeerChunkSource | undefined,
    private readonly httpPeers: HttpPeers | undefined,
    private readonly blobDirs: string[],
  ) {}

  static async start(o: NodePeersOptions): Promise<NodePeers> {
    o.db.run("CREATE TABLE IF NOT EXISTS peer_layers (digest TEXT PRIMARY KEY, path TEXT NOT NULL, size INTEGER NOT NULL)");
    const shelf = new LayerShelf();
    for (const r of o.db.query("SELECT digest, path, size FROM peer_layers LIMIT ?").all(MAX_SHELF) as { digest: LayerDigest; path: string; size: number }[])
      shelf.addVerified(r.digest, r.path, r.size);
    const cache = await BlockCache.shared(o.cache);
    // Served: what this node pushed, else a layer its block cache promoted (hashed to its digest then).
    const provide = async (digest: LayerDigest) => {
      const pushed = await shelf.provider(digest);
      if (pushed) return pushed;
      for (const path of [cache.promotedPath(digest), ...(o.blobDirs ?? []).map((d) => join(d, digest.slice(7)))]) {
        const st = await stat(path).catch(() => undefined);
        if (st?.isFile()) return { path, size: st.size };
      }
      return undefined;
    };
    const worker = await PeerWorker.start({ home: o.home, layers: provide, peers: o.peers, allow: o.allow, bindAddr: o.bindAddr, relayUrls: o.relayUrls });
    const source = new PeerChunkSource(worker, { haveTimeoutMs: HAVE_TIMEOUT_MS, readTimeoutMs: READ_TIMEOUT_MS });
    await mkdir(dirname(o.socketPath), { recursive: true });
    await rm(o.socketPath, { force: true });
    let self!: NodePeers;
    const facade = Bun.serve({ unix: o.socketPath, fetch: (req) => self.answer(req) });
    const httpSource = o.httpPeers ? new PeerChunkSource(o.httpPeers, { haveTimeoutMs: HAVE_TIMEOUT_MS, readTimeoutMs: READ_TIMEOUT_MS }) : undefined;
    self = new NodePeers(worker, source, shelf, cache, facade, o.socketPath, o.db, provide, httpSource, o.httpPeers, o.blobDirs ?? []);
    return self;
  }

  /** The source blockd puts first for a remote layer: the facade, as an http source over the socket. */
  originFor(digest: string): OriginSpec {
    return { kind: "http", url: `http://peers/layers/${digest}`, unix: this.socketPath };
  }

  /** Layer files this node pushed: served to peers from now on (and after a restart). */
  addPushed(layers: { digest: string; path: string; size: number }[]): void {
    const put = this.db.prepare("INSERT OR REPLACE INTO peer_layers (digest, path, size) VALUES (?, ?, ?)");
    for (const l of layers) {
      if (!isLayerDigest(l.digest)) continue;
      this.shelf.addVerified(l.digest, l.path, l.size);
      put.run(l.digest, l.path, l.size);
    }
  }

  /**
   * A whole file from the peers into `dest`, verified against its sha256 (hex) before it appears;
   * false when no peer holds it or every holder failed (the caller goes to its store).
   */
  async fetchBlob(sha256: string, size: number, dest: string, signal: AbortSignal): Promise<boolean> {
    const digest = `sha256:${sha256}` as LayerDigest;
    if (!isLayerDigest(digest)) return false;
    for (const source of this.sources()) {
      if ((await source.size(digest, signal)) === undefined) continue;
      try {
        await source.fetchLayer(digest, dest, { signal, size });
        this.served.blobs++;
        return true;
      } catch (e) {
        console.error(`p2p: ${digest} from ${source.name} failed: ${(e as Error).message}`);
      }
    }
    return false;
  }

  /**
   * A range straight from a cluster node that holds the layer, its response streamed through as
   * it comes (the fast path: one pass through this process); undefined when none holds it or the
   * holder failed (the general path then asks every source).
   */
  private async streamFromCluster(digest: LayerDigest, start: number, end: number, signal: AbortSignal): Promise<Response | undefined> {
    if (!this.httpSource || !this.httpPeers) return undefined;
    const holders = await this.httpSource.find(digest, signal);
    for (const [peer, size] of holders.peers) {
      if (end >= size) continue;
      try {
        const r = await this.httpPeers.stream(peer, digest, start, end, { signal, timeoutMs: READ_TIMEOUT_MS });
        this.served.bytes += end - start + 1;
        return new Response(r.body, { status: 206, headers: { "content-range": `bytes ${start}-${end}/${size}` } });
      } catch {
        this.httpSource.penalize(peer, digest);
      }
    }
    return undefined;
  }

  /**
   * The cluster's nodes that hold `digest`, as URLs of their `/v1/layers` route: blockd reads
   * them directly (one hop, with the cluster's key from a headers file) before this facade.
   * Found by one HEAD to each node (500 ms bound, remembered 10 s); empty outside a cluster.
   */
  async clusterHolders(digest: LayerDigest): Promise<string[]> {
    if (!this.httpSource || !this.httpPeers) return [];
    const holders = await this.httpSource.find(digest);
    return [...holders.peers.keys()].map((p) => this.httpPeers!.url(p, digest));
  }

  /**
   * Digests of the layers this node serves verified (pushed, promoted by the block cache, the
   * snapshot store's shared files), at most `max`: its record's summary for cache-aware placement.
   */
  async heldDigests(max: number): Promise<string[]> {
    const out = new Set<string>(this.shelf.digests().slice(0, max));
    for (const dir of [dirname(this.cache.promotedPath(`sha256:${"0".repeat(64)}`)), ...this.blobDirs]) {
      if (out.size >= max) break;
      for (const name of await readdir(dir).catch(() => [] as string[])) {
        if (out.size >= max) break;
        if (/^[0-9a-f]{64}$/.test(name)) out.add(`sha256:${name}`);
      }
    }
    return [...out];
  }

  /** Where layers come from, in order: the cluster's nodes over HTTP, then the iroh peers. */
  private sources(): PeerChunkSource[] {
    return this.httpSource ? [this.httpSource, this.source] : [this.source];
  }

  /** `/v1/layers` served `n` bytes to another node. */
  countHttpServed(n: number): void {
    this.httpServed += n;
  }

  async stats() {
    return { id: this.worker.id, addrs: this.worker.addrs(), facade: { ...this.served }, httpServed: this.httpServed, endpoint: await this.worker.stats() };
  }

  private async answer(req: Request): Promise<Response> {
    const m = /^\/layers\/(sha256:[0-9a-f]{64})$/.exec(new URL(req.url).pathname);
    if (req.method !== "GET" || !m) return new Response("GET /layers/sha256:<hex> only\n", { status: 400 });
    const r = /^bytes=(\d+)-(\d+)$/.exec(req.headers.get("range") ?? "");
    const start = r ? Number(r[1]) : NaN;
    const end = r ? Number(r[2]) : NaN;
    if (!(end >= start) || end - start + 1 > MAX_FACADE_READ) return new Response(`a Range of 1..${MAX_FACADE_READ} bytes is required\n`, { status: 416 });
    if (this.readsInFlight >= MAX_FACADE_READS) return new Response("busy\n", { status: 503 });
    this.readsInFlight++;
    this.served.requests++;
    const digest = m[1] as LayerDigest;
    try {
      const signal = AbortSignal.any([req.signal, AbortSignal.timeout(FACADE_TIMEOUT_MS)]);
      const streamed = await this.streamFromCluster(digest, start, end, signal);
      if (streamed) return streamed;
      let data: Uint8Array | undefined;
      let size: number | undefined;
      let lastError: unknown = new NoPeerError(digest, "no peer holds it");
      // The cluster's nodes over HTTP first (direct and fast), then the iroh peers.
      for (const source of this.sources()) {
        try {
          data = await source.read(digest, start, end - start + 1, signal);
          size = await source.size(digest);
          break;
        } catch (e) {
          lastError = e;
        }
      }
      if (!data) throw lastError;
      this.served.bytes += data.length;
      return new Response(data, { status: 206, headers: { "content-range": `bytes ${start}-${end}/${size ?? "*"}` } });
    } catch (e) {
      this.served.misses++;
      // No holder left (or none at all): blockd goes to the origin without retrying the peers.
      if (e instanceof NoPeerError) return new Response(`${e.message}\n`, { status: 404 });
      return new Response(`${(e as Error).name}: ${(e as Error).message}\n`, { status: 502 });
    } finally {
      this.readsInFlight--;
    }
  }

  async close(): Promise<void> {
    this.facade.stop(true);
    await rm(this.socketPath, { force: true }).catch(() => {});
    await this.worker.close().catch(() => {});
  }
}

/** The facade's socket path under the node's run directory. */
export function facadeSocket(runDir: string): string {
  return join(runDir, "peers.sock");
}
