// PeerWorker: a PeerNode on a Bun Worker thread of its own. The binding moves every byte as a JS
// number (about 30 CPU seconds per GiB on each side, docs/p2p.md), so on the owning thread a
// transfer would take that thread's whole time; on a worker it costs the owner one transferred
// buffer per read. The owner keeps the LayerShelf: the worker asks it which file holds a digest.
import type { LayerDigest } from "../src/storage/remote/source.ts";
import * as errors from "./errors.ts";
import type { LayerProvider, PeerConfig, PeerNodeOptions, PeerNodeStats, RequestOptions } from "./node.ts";
import { DEFAULT_LIMITS } from "./node.ts";
import type { HaveEntry } from "./protocol.ts";

/** What PeerChunkSource needs of a node: a PeerNode or a PeerWorker. */
export interface PeerClient {
  readonly id: string;
  peerIds(): string[];
  have(peerId: string, digests: LayerDigest[], o?: RequestOptions): Promise<HaveEntry[]>;
  read(peerId: string, digest: LayerDigest, offset: number, length: number, o?: RequestOptions): Promise<{ data: Uint8Array; size: number }>;
}

export type FromHost =
  | { type: "start"; id: number; opts: Omit<PeerNodeOptions, "layers">; serves: boolean }
  | { type: "setPeers"; id: number; peers: PeerConfig[] }
  | { type: "have"; id: number; peerId: string; digests: LayerDigest[]; timeoutMs?: number }
  | { type: "read"; id: number; peerId: string; digest: LayerDigest; offset: number; length: number; timeoutMs?: number }
  | { type: "stats"; id: number }
  | { type: "close"; id: number }
  | { type: "cancel"; id: number }
  | { type: "provided"; id: number; layer: { path: string; size: number } | undefined };

export type ToHost =
  | { type: "result"; id: number; ok: true; value: unknown }
  | { type: "result"; id: number; ok: false; error: { name: string; message: string; fields: Record<string, unknown> } }
  | { type: "provide"; id: number; digest: LayerDigest };

/** Calls in flight to one worker. */
export const MAX_WORKER_CALLS = 1024;
/** A call's backstop beyond its own request timeout (the worker answers every call itself). */
const BACKSTOP_MS = 5_000;

const errorClasses: Record<string, { prototype: Error }> = {
  PeerError: errors.PeerError, MalformedFrameError: errors.MalformedFrameError, UnknownDigestError: errors.UnknownDigestError,
  PeerRangeError: errors.PeerRangeError, PeerTimeoutError: errors.PeerTimeoutError, ShortReadError: errors.ShortReadError,
  PeerRefusedError: errors.PeerRefusedError,
};

/** The worker's error as the same named class on this thread. */
function revive(e: { name: string; message: string; fields: Record<string, unknown> }): Error {
  const cls = errorClasses[e.name];
  const err: Error = cls ? Object.create(cls.prototype) : new errors.PeerError(e.message, String(e.fields.peerId ?? ""));
  Object.defineProperty(err, "message", { value: e.message, enumerable: false, writable: true });
  Object.assign(err, e.fields);
  err.stack = `${e.name}: ${e.message}\n    at PeerWorker (worker thread)`;
  return err;
}

export class PeerWorker implements PeerClient {
  private readonly calls = new Map<number, { resolve: (v: unknown) => void; reject: (e: Error) => void; timer: ReturnType<typeof setTimeout> }>();
  private nextId = 0;
  private peers: string[] = [];
  id = "";
  private sockets: string[] = [];
  private closed = false;

  private constructor(private readonly worker: Worker, private readonly layers: LayerProvider | undefined, private readonly answerMs: number) {
    worker.onmessage = (ev: MessageEvent<ToHost>) => this.onMessage(ev.data);
    worker.onerror = (ev) => this.failAll(new errors.PeerError(`worker thread failed: ${ev.message}`, ""));
  }

  static async start(opts: PeerNodeOptions): Promise<PeerWorker> {
    const worker = new Worker(new URL("./worker_host.ts", import.meta.url).href);
    const { layers, ...rest } = opts;
    const w = new PeerWorker(worker, layers, opts.limits?.answerMs ?? DEFAULT_LIMITS.answerMs);
    try {
      const r = (await w.call({ type: "start", id: 0, opts: rest, serves: layers !== undefined }, 30_000)) as { id: string; addrs: string[] };
      w.id = r.id;
      w.sockets = r.addrs;
      w.peers = (opts.peers ?? []).map((p) => p.id).filter((id) => id !== r.id);
    } catch (e) {
      worker.terminate();
      throw e;
    }
    return w;
  }

  addrs(): string[] {
    return this.sockets;
  }

  self(): PeerConfig {
    return { id: this.id, addrs: this.sockets };
  }

  peerIds(): string[] {
    return this.peers;
  }

  async setPeers(peers: PeerConfig[]): Promise<void> {
    await this.call({ type: "setPeers", id: 0, peers }, BACKSTOP_MS);
    this.peers = peers.map((p) => p.id).filter((id) => id !== this.id);
  }

  have(peerId: string, digests: LayerDigest[], o: RequestOptions = {}): Promise<HaveEntry[]> {
    return this.call({ type: "have", id: 0, peerId, digests, timeoutMs: o.timeoutMs }, (o.timeoutMs ?? this.answerMs) + BACKSTOP_MS, o.signal) as Promise<HaveEntry[]>;
  }

  read(peerId: string, digest: LayerDigest, offset: number, length: number, o: RequestOptions = {}): Promise<{ data: Uint8Array; size: number }> {
    return this.call({ type: "read", id: 0, peerId, digest, offset, length, timeoutMs: o.timeoutMs }, (o.timeoutMs ?? this.answerMs) + BACKSTOP_MS, o.signal) as Promise<{ data: Uint8Array; size: number }>;
  }

  stats(): Promise<PeerNodeStats> {
    return this.call({ type: "stats", id: 0 }, BACKSTOP_MS) as Promise<PeerNodeStats>;
  }

  /**
   * Closes the endpoint; the thread is then left idle and unref'd (it never holds the process up)
   * instead of terminated: tearing down a Bun worker that loaded the iroh binding runs the
   * binding's environment cleanup while other threads still use it, which corrupts the heap.
   */
  async close(): Promise<void> {
    if (this.closed) return;
    try {
      await this.call({ type: "close", id: 0 }, 10_000);
    } finally {
      this.closed = true;
      this.failAll(new errors.PeerError("the peer worker is closed", "", false));
      this.worker.onmessage = null;
      this.worker.unref();
    }
  }

  private call(m: FromHost & { id: number }, ms: number, signal?: AbortSignal): Promise<unknown> {
    if (this.closed) return Promise.reject(new errors.PeerError("the peer worker is closed", "", false));
    if (this.calls.size >= MAX_WORKER_CALLS) return Promise.reject(new errors.PeerError(`${MAX_WORKER_CALLS} calls in flight to the peer worker`, "", true));
    if (signal?.aborted) return Promise.reject(signal.reason);
    const id = ++this.nextId;
    return new Promise((resolve, reject) => {
      const done = () => { clearTimeout(timer); this.calls.delete(id); signal?.removeEventListener("abort", onAbort); };
      const onAbort = () => { done(); this.worker.postMessage({ type: "cancel", id } satisfies FromHost); reject(signal!.reason instanceof Error ? signal!.reason : new errors.PeerTimeoutError(`${m.type} (aborted)`, ms, "")); };
      const timer = setTimeout(() => { done(); reject(new errors.PeerTimeoutError(`peer worker ${m.type}`, ms, "")); }, ms);
      this.calls.set(id, { resolve: (v) => { done(); resolve(v); }, reject: (e) => { done(); reject(e); }, timer });
      signal?.addEventListener("abort", onAbort, { once: true });
      this.worker.postMessage({ ...m, id });
    });
  }

  private onMessage(m: ToHost): void {
    if (m.type === "provide") {
      const answer = (layer: { path: string; size: number } | undefined) => this.worker.postMessage({ type: "provided", id: m.id, layer } satisfies FromHost);
      (this.layers?.(m.digest) ?? Promise.resolve(undefined)).then(answer, () => answer(undefined));
      return;
    }
    const c = this.calls.get(m.id);
    if (!c) return; // timed out or aborted already
    if (m.ok) c.resolve(m.value);
    else c.reject(revive(m.error));
  }

  private failAll(e: Error): void {
    for (const c of [...this.calls.values()]) c.reject(e);
  }
}
