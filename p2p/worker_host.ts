// The thread side of PeerWorker (p2p/worker.ts): one PeerNode on this Bun Worker. Calls come in
// as messages and go back with their result (a read's bytes transferred, not copied); the node's
// LayerProvider asks the owning thread, which holds the shelf.
import type { LayerDigest } from "../src/storage/remote/source.ts";
import { PeerNode, type PeerNodeOptions } from "./node.ts";
import type { FromHost, ToHost } from "./worker.ts";

declare const self: Worker;

let node: PeerNode | undefined;
const provided = new Map<number, (l: { path: string; size: number } | undefined) => void>();
let nextAsk = 0;
/** Requests in flight, so the owner can cancel one (its signal aborted). */
const running = new Map<number, AbortController>();
/** Provider questions waiting for the owning thread, and how long each may wait. */
const MAX_ASKS = 1024;
const ASK_MS = 5_000;

function post(m: ToHost, transfer: ArrayBuffer[] = []): void {
  self.postMessage(m, transfer);
}

async function ask(digest: LayerDigest): Promise<{ path: string; size: number } | undefined> {
  if (provided.size >= MAX_ASKS) return undefined;
  const id = nextAsk++;
  return new Promise((resolve) => {
    const timer = setTimeout(() => { provided.delete(id); resolve(undefined); }, ASK_MS);
    provided.set(id, (l) => { clearTimeout(timer); provided.delete(id); resolve(l); });
    post({ type: "provide", id, digest });
  });
}

function errorOut(e: unknown): { name: string; message: string; fields: Record<string, unknown> } {
  const err = e as Error & Record<string, unknown>;
  const fields: Record<string, unknown> = {};
  for (const k of ["peerId", "retryable", "digest", "got", "want", "ms", "status"]) if (k in err) fields[k] = err[k];
  return { name: err.name ?? "Error", message: err.message ?? String(e), fields };
}

self.onmessage = async (ev: MessageEvent<FromHost>) => {
  const m = ev.data;
  if (m.type === "provided") return provided.get(m.id)?.(m.layer);
  if (m.type === "cancel") return running.get(m.id)?.abort();
  const ctl = new AbortController();
  running.set(m.id, ctl);
  try {
    switch (m.type) {
      case "start": {
        const opts: PeerNodeOptions = { ...m.opts, layers: m.serves ? ask : undefined };
        node = await PeerNode.start(opts);
        return post({ type: "result", id: m.id, ok: true, value: { id: node.id, addrs: node.addrs() } });
      }
      case "setPeers":
        node!.setPeers(m.peers);
        return post({ type: "result", id: m.id, ok: true, value: null });
      case "have":
        return post({ type: "result", id: m.id, ok: true, value: await node!.have(m.peerId, m.digests, { timeoutMs: m.timeoutMs, signal: ctl.signal }) });
      case "read": {
        const r = await node!.read(m.peerId, m.digest, m.offset, m.length, { timeoutMs: m.timeoutMs, signal: ctl.signal });
        return post({ type: "result", id: m.id, ok: true, value: r }, [r.data.buffer as ArrayBuffer]);
      }
      case "stats":
        return post({ type: "result", id: m.id, ok: true, value: node!.stats() });
      case "close":
        await node?.close();
        return post({ type: "result", id: m.id, ok: true, value: null });
    }
  } catch (e) {
    post({ type: "result", id: m.id, ok: false, error: errorOut(e) });
  } finally {
    running.delete(m.id);
  }
};
