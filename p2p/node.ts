// PeerNode: this node's iroh endpoint. It serves `aenv/layers/1` (have? and read, docs/p2p.md) to
// allow-listed endpoints out of the verified layers its LayerProvider names, and asks the peers it
// was configured with. Relays and discovery are off unless relay URLs are given.

import { open } from "node:fs/promises";
import {
  type BiStream,
  type Connection,
  Endpoint,
  EndpointAddr,
  EndpointId,
  type Incoming,
  presetMinimal,
  RelayMode,
} from "@number0/iroh";
import type { LayerDigest } from "../src/storage/remote/source.ts";
import { MalformedFrameError, PeerError, PeerRangeError, PeerRefusedError, UnknownDigestError } from "./errors.ts";
import { loadOrCreateSecretKey } from "./key.ts";
import {
  bounded,
  encodeFrame,
  errorFromFrame,
  type ErrorCode,
  type HaveEntry,
  LAYERS_ALPN_BYTES,
  MAX_HAVE,
  MAX_READ,
  parseRequest,
  readData,
  readFrame,
  writeData,
} from "./protocol.ts";

/** A peer from configuration: its endpoint ID (64 hex digits) and where to dial it. */
export interface PeerConfig {
  id: string;
  /** "ip:port" socket addresses. */
  addrs: string[];
  relayUrl?: string;
}

/** A local layer file that verified against its digest, or undefined when this node has none. */
export type LayerProvider = (digest: LayerDigest) => Promise<{ path: string; size: number } | undefined>;

export interface PeerLimits {
  /** Incoming connections held at once; more are refused before their handshake. */
  maxConnections: number;
  /** Read answers being prepared or sent at once, node-wide (each holds up to MAX_READ bytes); more wait. */
  maxReads: number;
  /** Requests (bidirectional streams) one connection may have open at once, both directions. */
  streamsPerConnection: number;
  /** A server waits this long for a request frame. */
  requestMs: number;
  /** A whole answer (frame and up to MAX_READ bytes) must go out within this. */
  answerMs: number;
  /** Dialing a peer, handshake included. */
  connectMs: number;
}

export const DEFAULT_LIMITS: PeerLimits = {
  maxConnections: 64,
  maxReads: 64,
  streamsPerConnection: 32,
  requestMs: 5_000,
  answerMs: 60_000,
  connectMs: 5_000,
};

export interface PeerNodeOptions {
  /** `$AENV_HOME`: the secret key lives in `p2p/secret-key` under it. */
  home: string;
  /** Serves this node's verified layers (absent: this node serves nothing). */
  layers?: LayerProvider;
  /** Peers to ask; their IDs are allow-listed too. */
  peers?: PeerConfig[];
  /** More endpoint IDs that may connect (besides `peers`). */
  allow?: string[];
  /** "ip:port" to bind (default 0.0.0.0:0: every interface, a free port). */
  bindAddr?: string;
  /** Relay servers for nodes behind NAT; none by default. */
  relayUrls?: string[];
  limits?: Partial<PeerLimits>;
}

export interface PeerNodeStats {
  connections: number;
  refused: number;
  malformed: number;
  haveRequests: number;
  readRequests: number;
  bytesServed: number;
  errors: number;
}

/** QUIC application close codes this protocol uses. */
export const CLOSE_NOT_ALLOWED = 1n;
export const CLOSE_SHUTDOWN = 0n;
const NOT_ALLOWED_REASON = "not on the allow-list";
/** close() waits at most this long for the endpoint to shut down. */
export const CLOSE_WAIT_MS = 3_000;

export interface RequestOptions {
  timeoutMs?: number;
  signal?: AbortSignal;
}

const enc = new TextEncoder();

export class PeerNode {
  readonly id: string;
  readonly limits: PeerLimits;
  private readonly peers = new Map<string, PeerConfig>();
  private readonly allowed = new Set<string>();
  /** Accepted connections → the remote's endpoint ID. */
  private readonly incoming = new Map<Connection, string>();
  private readsInFlight = 0;
  private readonly readWaiters: (() => void)[] = [];
  private readonly outgoing = new Map<string, Promise<Connection>>();
  private readonly counters: PeerNodeStats = { connections: 0, refused: 0, malformed: 0, haveRequests: 0, readRequests: 0, bytesServed: 0, errors: 0 };
  private closed = false;
  private readonly acceptLoop: Promise<void>;

  private constructor(
    private readonly endpoint: Endpoint,
    private readonly opts: PeerNodeOptions,
  ) {
    this.id = endpoint.id().toString();
    this.limits = { ...DEFAULT_LIMITS, ...opts.limits };
    for (const a of opts.allow ?? []) this.allowed.add(a);
    this.setPeers(opts.peers ?? []);
    this.acceptLoop = this.accept();
  }

  static async start(opts: PeerNodeOptions): Promise<PeerNode> {
    const key = await loadOrCreateSecretKey(opts.home);
    const b = Endpoint.builder();
    presetMinimal(b);
    b.secretKey(key);
    b.alpns([LAYERS_ALPN_BYTES]);
    b.relayMode(opts.relayUrls?.length ? RelayMode.customFromUrls(opts.relayUrls) : RelayMode.disabled());
    b.bindAddr(opts.bindAddr ?? "0.0.0.0:0");
    return new PeerNode(await b.bind(), opts);
  }

  /** The "ip:port" sockets this endpoint listens on (what a peer's config lists as its addrs). */
  addrs(): string[] {
    return this.endpoint.boundSockets();
  }

  /** This node as a peer entry for others' configuration. */
  self(): PeerConfig {
    return { id: this.id, addrs: this.addrs() };
  }

  /**
   * Replace the configured peers (their IDs become allow-listed; `allow` entries stay). A
   * connection from an ID that is no longer allowed is closed as a refused one.
   */
  setPeers(peers: PeerConfig[]): void {
    for (const p of peers) EndpointId.fromString(p.id); // a malformed ID throws here, before anything changes
    for (const id of this.peers.keys()) if (!(this.opts.allow ?? []).includes(id)) this.allowed.delete(id);
    this.peers.clear();
    for (const p of peers) {
      if (p.id === this.id) continue;
      this.peers.set(p.id, p);
      this.allowed.add(p.id);
    }
    for (const [id, conn] of this.outgoing) {
      if (this.peers.has(id)) continue;
      this.outgoing.delete(id); // no longer a peer: its connection goes
      conn.then((c) => c.close(CLOSE_SHUTDOWN, []), () => {});
    }
    for (const [conn, remote] of this.incoming) {
      if (!this.allowed.has(remote)) conn.close(CLOSE_NOT_ALLOWED, Array.from(enc.encode(NOT_ALLOWED_REASON)));
    }
  }

  peerIds(): string[] {
    return [...this.peers.keys()];
  }

  stats(): PeerNodeStats {
    return { ...this.counters, connections: this.incoming.size };
  }

  /** Which of `digests` the peer holds verified, with their sizes. */
  async have(peerId: string, digests: LayerDigest[], o: RequestOptions = {}): Promise<HaveEntry[]> {
    if (digests.length > MAX_HAVE) throw new PeerRangeError(`have? of ${digests.length} digests (at most ${MAX_HAVE})`, peerId);
    return this.request(peerId, { op: "have", digests }, o, async (bi, head) => {
      const have = head.have;
      if (!Array.isArray(have)) throw new MalformedFrameError("have answer without \"have\"", peerId);
      const asked = new Set<string>(digests);
      return have.filter((h): h is HaveEntry =>
        typeof h === "object" && h !== null && asked.has((h as HaveEntry).digest) && Number.isSafeInteger((h as HaveEntry).size) && (h as HaveEntry).size >= 0);
    });
  }

  /**
   * `length` bytes of the layer at `offset` from the peer (fewer only where the layer ends;
   * length ≤ MAX_READ).
   */
  async read(peerId: string, digest: LayerDigest, offset: number, length: number, o: RequestOptions = {}): Promise<{ data: Uint8Array; size: number }> {
    if (length > MAX_READ) throw new PeerRangeError(`read of ${length} bytes (at most ${MAX_READ})`, peerId);
    return this.request(peerId, { op: "read", digest, offset, length }, o, async (bi, head) => {
      const n = head.length, size = head.size;
      if (typeof n !== "number" || !Number.isSafeInteger(n) || n < 0 || n > length || typeof size !== "number" || !Number.isSafeInteger(size)) {
        throw new MalformedFrameError(`read answer with length ${String(n)}, size ${String(size)}`, peerId);
      }
      if (n < length && offset + n !== size) throw new MalformedFrameError(`read answer of ${n} bytes before the layer's end (${size})`, peerId);
      return { data: await readData(bi.recv, n, peerId), size };
    }, digest);
  }

  async close(): Promise<void> {
    if (this.closed) return;
    this.closed = true;
    for (const c of this.incoming.keys()) c.close(CLOSE_SHUTDOWN, []);
    for (const p of this.outgoing.values()) p.then((c) => c.close(CLOSE_SHUTDOWN, []), () => {});
    // QUIC's close waits for the peers to acknowledge it; a peer that died never does.
    let timer: ReturnType<typeof setTimeout> | undefined;
    await Promise.race([
      this.endpoint.close().then(() => this.acceptLoop).catch(() => {}),
      new Promise<void>((r) => (timer = setTimeout(r, CLOSE_WAIT_MS))),
    ]);
    clearTimeout(timer);
  }

  // ---- client side ----

  private async request<T>(peerId: string, req: object, o: RequestOptions,
    answer: (bi: BiStream, head: Record<string, unknown>) => Promise<T>, digest?: string): Promise<T> {
    const ms = o.timeoutMs ?? this.limits.answerMs;
    const conn = await bounded(this.connection(peerId), this.limits.connectMs, "connect", peerId, o.signal);
    let bi: BiStream | undefined;
    const stop = () => {
      bi?.recv.stop(0n).catch(() => {});
      bi?.send.reset(0n).catch(() => {});
    };
    try {
      return await bounded((async () => {
        bi = await conn.openBi();
        await bi.send.writeAll(encodeFrame(req));
        await bi.send.finish();
        const head = await readFrame(bi.recv, peerId);
        if (head.ok !== true) throw errorFromFrame(head, peerId, digest);
        return answer(bi, head);
      })(), ms, (req as { op: string }).op, peerId, o.signal, stop);
    } catch (e) {
      const reason = conn.closeReason();
      if (reason !== null) {
        this.outgoing.delete(peerId);
        if (reason.includes(NOT_ALLOWED_REASON)) throw new PeerRefusedError(peerId, NOT_ALLOWED_REASON);
        if (!(e instanceof PeerError)) throw new PeerError(`connection lost: ${reason.split("\n")[0]}`, peerId);
      }
      if (e instanceof PeerError) throw e;
      throw new PeerError((e as Error).message.split("\n")[0]!, peerId);
    }
  }

  private connection(peerId: string): Promise<Connection> {
    if (this.closed) return Promise.reject(new PeerError("this node is closed", peerId, false));
    const have = this.outgoing.get(peerId);
    if (have) return have;
    const peer = this.peers.get(peerId);
    if (!peer) return Promise.reject(new PeerError("not a configured peer", peerId, false));
    const p = this.endpoint.connect(new EndpointAddr(EndpointId.fromString(peer.id), peer.relayUrl ?? null, peer.addrs), LAYERS_ALPN_BYTES)
      .then((c) => {
        c.setMaxConcurrentBiStreams(BigInt(this.limits.streamsPerConnection));
        c.closed().then(() => { if (this.outgoing.get(peerId) === p) this.outgoing.delete(peerId); }, () => { if (this.outgoing.get(peerId) === p) this.outgoing.delete(peerId); });
        return c;
      });
    p.catch(() => { if (this.outgoing.get(peerId) === p) this.outgoing.delete(peerId); });
    this.outgoing.set(peerId, p);
    return p;
  }

  // ---- server side ----

  private async accept(): Promise<void> {
    while (!this.closed) {
      let inc: Incoming | null;
      try {
        inc = await this.endpoint.acceptNext();
      } catch {
        if (this.closed) return;
        continue;
      }
      if (!inc) return;
      if (this.incoming.size >= this.limits.maxConnections) {
        this.counters.refused++;
        inc.refuse().catch(() => {});
        continue;
      }
      this.serveConnection(inc).catch(() => { this.counters.errors++; });
    }
  }

  private async serveConnection(inc: Incoming): Promise<void> {
    const conn = await bounded((async () => (await inc.accept()).connect())(), this.limits.connectMs, "handshake", "");
    const remote = conn.remoteId().toString();
    // The remote's ID is known once the handshake proves it holds the key; no stream is read before this check.
    if (!this.allowed.has(remote)) {
      this.counters.refused++;
      conn.close(CLOSE_NOT_ALLOWED, Array.from(enc.encode(NOT_ALLOWED_REASON)));
      return;
    }
    conn.setMaxConcurrentBiStreams(BigInt(this.limits.streamsPerConnection));
    this.incoming.set(conn, remote);
    try {
      for (;;) {
        let bi: BiStream;
        try {
          bi = await conn.acceptBi();
        } catch {
          return; // closed by the peer, or by close()
        }
        this.serveStream(bi, remote).catch(() => { this.counters.errors++; });
      }
    } finally {
      this.incoming.delete(conn);
    }
  }

  private async serveStream(bi: BiStream, remote: string): Promise<void> {
    const stop = () => {
      bi.recv.stop(0n).catch(() => {});
      bi.send.reset(0n).catch(() => {});
    };
    let head: Record<string, unknown>;
    try {
      head = await bounded(readFrame(bi.recv, remote), this.limits.requestMs, "request frame", remote, undefined, stop);
    } catch (e) {
      if (e instanceof MalformedFrameError) return this.refuseStream(bi, "MalformedFrame", e.message);
      return;
    }
    let req;
    try {
      req = parseRequest(head);
    } catch (e) {
      if (e instanceof PeerRangeError) return this.refuseStream(bi, "Range", e.message);
      return this.refuseStream(bi, "MalformedFrame", (e as Error).message);
    }
    await bounded(this.answer(bi, req), this.limits.answerMs, `answer to ${req.op}`, remote, undefined, stop);
  }

  private async answer(bi: BiStream, req: ReturnType<typeof parseRequest>): Promise<void> {
    const layers = this.opts.layers;
    if (req.op === "have") {
      this.counters.haveRequests++;
      const have: HaveEntry[] = [];
      for (const d of req.digests) {
        const l = await layers?.(d);
        if (l) have.push({ digest: d, size: l.size });
      }
      await bi.send.writeAll(encodeFrame({ ok: true, have }));
      await bi.send.finish();
      return;
    }
    this.counters.readRequests++;
    await this.readSlot();
    try {
      await this.answerRead(bi, req);
    } finally {
      this.readsInFlight--;
      this.readWaiters.shift()?.();
    }
  }

  /** Wait for one of maxReads slots (the wait counts against the answer's timeout). */
  private async readSlot(): Promise<void> {
    while (this.readsInFlight >= this.limits.maxReads) await new Promise<void>((r) => this.readWaiters.push(r));
    this.readsInFlight++;
  }

  private async answerRead(bi: BiStream, req: { digest: LayerDigest; offset: number; length: number }): Promise<void> {
    const l = await this.opts.layers?.(req.digest);
    if (!l) return this.answerError(bi, "UnknownDigest", new UnknownDigestError(req.digest).message);
    if (req.offset > l.size) return this.answerError(bi, "Range", `offset ${req.offset} past the layer's end (${l.size})`);
    const n = Math.min(req.length, l.size - req.offset);
    const data = new Uint8Array(n);
    const fh = await open(l.path, "r");
    try {
      let got = 0;
      while (got < n) {
        const { bytesRead } = await fh.read(data, got, n - got, req.offset + got);
        if (bytesRead <= 0) break;
        got += bytesRead;
      }
      if (got < n) return this.answerError(bi, "Internal", `the local copy ends at ${req.offset + got}`);
    } finally {
      await fh.close();
    }
    await bi.send.writeAll(encodeFrame({ ok: true, length: n, size: l.size }));
    await writeData(bi.send, data);
    await bi.send.finish();
    this.counters.bytesServed += n;
  }

  private async refuseStream(bi: BiStream, code: ErrorCode, message: string): Promise<void> {
    if (code === "MalformedFrame") this.counters.malformed++;
    await bounded(this.answerError(bi, code, message), this.limits.requestMs, "error answer", "").catch(() => {});
    bi.recv.stop(0n).catch(() => {});
  }

  private async answerError(bi: BiStream, error: ErrorCode, message: string): Promise<void> {
    await bi.send.writeAll(encodeFrame({ ok: false, error, message }));
    await bi.send.finish();
  }
}
