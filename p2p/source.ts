// PeerChunkSource: layer bytes from the peers that hold them. Which peers hold a layer is asked
// with have? in parallel (first yes wins, each peer bounded by its own timeout); ranges are read
// from those peers in turn; a peer that fails, times out or answers short is put in a penalty box
// for that layer for a while. fetchLayer brings a whole layer to a local file and verifies its
// sha256 before the file appears; a mismatch drops the copy and blames the peers that served it.

import { open, rename, rm } from "node:fs/promises";
import type { ChunkSource, LayerDigest } from "../src/storage/remote/source.ts";
import { NoPeerError, PeerDigestMismatchError, PeerError, ShortReadError } from "./errors.ts";
import type { PeerClient } from "./worker.ts";
import { MAX_READ } from "./protocol.ts";
import { sha256OfFile } from "./shelf.ts";

export interface PeerSourceOptions {
  /** Each peer's have? answer is waited for this long. */
  haveTimeoutMs: number;
  /** One read request (up to MAX_READ bytes). */
  readTimeoutMs: number;
  /** A failed peer is skipped for that layer this long. */
  penaltyMs: number;
  /** Entries of the penalty box; the oldest go first. */
  maxPenalties: number;
  /** Who holds a layer is remembered this long… */
  holdersTtlMs: number;
  /** …for at most this many layers. */
  maxLayers: number;
  /** Read requests one fetchLayer (or one large read) keeps in flight. */
  streams: number;
}

export const DEFAULT_SOURCE_OPTIONS: PeerSourceOptions = {
  haveTimeoutMs: 2_000,
  readTimeoutMs: 30_000,
  penaltyMs: 30_000,
  maxPenalties: 4_096,
  holdersTtlMs: 10_000,
  maxLayers: 4_096,
  streams: 8,
};

interface Holders {
  /** peer ID → the layer size it announced, in the order the answers came. */
  peers: Map<string, number>;
  /** Settles when every asked peer answered or timed out. */
  done: Promise<void>;
  at: number;
}

export interface FetchOptions {
  signal?: AbortSignal;
  /** Asked for the ranges no peer could serve (the registry or S3). */
  origin?: ChunkSource;
  /** The layer's size when known: it wins over what holders announce (required when no peer may hold it and an origin is given). */
  size?: number;
  /** Called after each range is written. */
  onProgress?: (p: { offset: number; length: number; from: string }) => void;
}

export interface FetchResult {
  path: string;
  size: number;
  /** The peers that served ranges of it. */
  peers: string[];
  /** Bytes that came from the origin. */
  originBytes: number;
}

export class PeerChunkSource implements ChunkSource {
  readonly name: string;
  readonly opts: PeerSourceOptions;
  private readonly holders = new Map<LayerDigest, Holders>();
  private readonly penalties = new Map<string, number>();
  private turn = 0;

  constructor(private readonly node: PeerClient, opts: Partial<PeerSourceOptions> = {}) {
    this.opts = { ...DEFAULT_SOURCE_OPTIONS, ...opts };
    this.name = `peers of ${node.id.slice(0, 10)}`;
  }

  /** Skip this peer for this layer for penaltyMs. */
  penalize(peerId: string, digest: LayerDigest): void {
    const key = `${peerId} ${digest}`;
    this.penalties.delete(key);
    this.penalties.set(key, Date.now() + this.opts.penaltyMs);
    while (this.penalties.size > this.opts.maxPenalties) this.penalties.delete(this.penalties.keys().next().value!);
    this.holders.get(digest)?.peers.delete(peerId);
  }

  penalized(peerId: string, digest: LayerDigest): boolean {
    const key = `${peerId} ${digest}`;
    const until = this.penalties.get(key);
    if (until === undefined) return false;
    if (until > Date.now()) return true;
    this.penalties.delete(key);
    return false;
  }

  /**
   * The peers holding the layer: resolves on the first peer that says yes (the others keep
   * answering into the same map), or when all have answered.
   */
  async find(digest: LayerDigest, signal?: AbortSignal): Promise<Holders> {
    const known = this.holders.get(digest);
    if (known && Date.now() - known.at < this.opts.holdersTtlMs) {
      if (known.peers.size === 0) await known.done;
      return known;
    }
    const peers = new Map<string, number>();
    let firstYes!: () => void;
    const first = new Promise<void>((r) => (firstYes = r));
    const asks = this.node.peerIds().filter((p) => !this.penalized(p, digest)).map(async (p) => {
      try {
        const have = await this.node.have(p, [digest], { timeoutMs: this.opts.haveTimeoutMs, signal });
        const h = have.find((e) => e.digest === digest);
        if (h && !this.penalized(p, digest)) {
          peers.set(p, h.size);
          firstYes();
        }
      } catch {
        this.penalize(p, digest);
      }
    });
    const entry: Holders = { peers, done: Promise.all(asks).then(() => {}), at: Date.now() };
    this.holders.delete(digest);
    this.holders.set(digest, entry);
    while (this.holders.size > this.opts.maxLayers) this.holders.delete(this.holders.keys().next().value!);
    await Promise.race([first, entry.done]);
    return entry;
  }

  /** The layer's size as its holders announce it, or undefined when no peer holds it. */
  async size(digest: LayerDigest, signal?: AbortSignal): Promise<number | undefined> {
    const h = await this.find(digest, signal);
    return h.peers.values().next().value;
  }

  /** Exactly `length` bytes at `offset` (ChunkSource), split into MAX_READ requests spread over the holders. */
  async read(digest: LayerDigest, offset: number, length: number, signal: AbortSignal): Promise<Uint8Array> {
    if (length <= MAX_READ) return (await this.readPiece(digest, offset, length, signal)).data;
    const out = new Uint8Array(length);
    const starts: number[] = [];
    for (let o = 0; o < length; o += MAX_READ) starts.push(o);
    await pool(starts, this.opts.streams, async (o) => {
      out.set((await this.readPiece(digest, offset + o, Math.min(MAX_READ, length - o), signal)).data, o);
    });
    return out;
  }

  /** Bring the whole layer to `dest`, verified; the file appears only once its sha256 matches. */
  async fetchLayer(digest: LayerDigest, dest: string, o: FetchOptions = {}): Promise<FetchResult> {
    const signal = o.signal ?? new AbortController().signal;
    // A size the caller knows (a manifest's) wins over the holders' word: a peer announcing less
    // would otherwise cut the layer short, and the digest check then blames every contributor.
    const size = o.size ?? (await this.size(digest, signal));
    if (size === undefined) throw new NoPeerError(digest, "no peer holds it and its size is unknown");
    const tmp = `${dest}.p2p-${process.pid}-${Math.random().toString(36).slice(2)}`;
    const fh = await open(tmp, "wx", 0o644);
    const contributors = new Set<string>();
    let originBytes = 0;
    try {
      const starts: number[] = [];
      for (let off = 0; off < size; off += MAX_READ) starts.push(off);
      await pool(starts, this.opts.streams, async (off) => {
        const len = Math.min(MAX_READ, size - off);
        let data: Uint8Array, from: string;
        try {
          ({ data, from } = await this.readPiece(digest, off, len, signal));
          contributors.add(from);
        } catch (e) {
          if (!o.origin || signal.aborted) throw e;
          data = await o.origin.read(digest, off, len, signal);
          if (data.length !== len) throw new ShortReadError(data.length, len, o.origin.name);
          from = o.origin.name;
          originBytes += len;
        }
        await fh.write(data, 0, len, off);
        o.onProgress?.({ offset: off, length: len, from });
      });
      await fh.sync();
    } catch (e) {
      await fh.close();
      await rm(tmp, { force: true });
      throw e;
    }
    await fh.close();
    const got = await sha256OfFile(tmp);
    if (got.digest !== digest || got.size !== size) {
      await rm(tmp, { force: true });
      const peers = [...contributors];
      for (const p of peers) this.penalize(p, digest);
      throw new PeerDigestMismatchError(digest, got.digest, peers.length ? peers : [o.origin?.name ?? "origin"]);
    }
    await rename(tmp, dest);
    return { path: dest, size, peers: [...contributors], originBytes };
  }

  /** One request's worth from the next healthy holder, moving on to the others as each fails. */
  private async readPiece(digest: LayerDigest, offset: number, length: number, signal: AbortSignal): Promise<{ data: Uint8Array; from: string }> {
    const tried = new Set<string>();
    const failures: string[] = [];
    for (;;) {
      const h = await this.find(digest, signal);
      let candidates = [...h.peers.keys()].filter((p) => !tried.has(p) && !this.penalized(p, digest));
      if (candidates.length === 0) {
        await h.done; // slower peers may still say yes
        candidates = [...h.peers.keys()].filter((p) => !tried.has(p) && !this.penalized(p, digest));
      }
      if (candidates.length === 0) {
        throw new NoPeerError(digest, failures.length ? failures.join("; ") : "no configured peer holds it");
      }
      const peer = candidates[this.turn++ % candidates.length]!;
      tried.add(peer);
      try {
        const { data } = await this.node.read(peer, digest, offset, length, { timeoutMs: this.opts.readTimeoutMs, signal });
        if (data.length !== length) throw new ShortReadError(data.length, length, peer);
        return { data, from: peer };
      } catch (e) {
        if (signal.aborted) throw e;
        this.penalize(peer, digest);
        failures.push(e instanceof PeerError ? e.message : `peer ${peer.slice(0, 10)}: ${(e as Error).message}`);
      }
    }
  }
}

/** Run fn over items with at most `width` in flight; the first failure stops new starts and rejects. */
async function pool<T>(items: T[], width: number, fn: (item: T) => Promise<void>): Promise<void> {
  let next = 0;
  let failed: unknown;
  const lane = async () => {
    while (failed === undefined && next < items.length) {
      const item = items[next++]!;
      try {
        await fn(item);
      } catch (e) {
        failed ??= e;
      }
    }
  };
  await Promise.all(Array.from({ length: Math.min(width, items.length) }, lane));
  if (failed !== undefined) throw failed;
}
