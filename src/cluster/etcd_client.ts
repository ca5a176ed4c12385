// etcd v3 over its own HTTP/JSON gateway (`/v3/kv/*`, `/v3/lease/*`, `/v3/watch`), on fetch:
// no gRPC stack in the node or the gateway. Keys and values travel base64; int64s travel as
// decimal strings (lease IDs stay strings, revisions fit a double until 2^53). Every call has a
// deadline and fails with an EtcdError saying why; a call that cannot reach one endpoint moves to
// the next, and the endpoint that answered last is asked first.

/** Why an etcd call failed: the endpoints could not be reached or did not answer in time, or etcd refused the request. */
export type EtcdFailure = "unavailable" | "timeout" | "rejected";

export class EtcdError extends Error {
  override name = "EtcdError";
  constructor(readonly reason: EtcdFailure, message: string) {
    super(message);
  }
}

/** A call's deadline unless it names its own (etcd answers a healthy write in milliseconds; a leader election takes ~1 s). */
export const ETCD_CALL_TIMEOUT_MS = 5_000;
/** One attempt at one member (a healthy member answers in milliseconds; one without quorum holds a request ~7 s). */
const ATTEMPT_MS = 1_500;
/** Pause between rounds over every member, growing to 500 ms. */
const ROUND_PAUSE_MS = 100;
/** Largest answer read from etcd (a range of every node and binding of a big cluster stays far below). */
const MAX_ANSWER_BYTES = 64 << 20;
/** Largest line of a watch stream (one batch of events). */
const MAX_WATCH_LINE = 16 << 20;
/** A broken watch reconnects after this, doubling to WATCH_RETRY_MAX_MS while it keeps failing. */
const WATCH_RETRY_MS = 200;
const WATCH_RETRY_MAX_MS = 3_000;

export interface KeyValue {
  key: string;
  value: string;
  createRevision: number;
  modRevision: number;
  version: number;
  /** The lease the key is bound to ("0": none). */
  lease: string;
}

export interface RangeResult {
  kvs: KeyValue[];
  /** The store's revision when it answered. */
  revision: number;
  more: boolean;
}

export interface WatchEvent {
  type: "put" | "delete";
  kv: KeyValue;
}

type Json = Record<string, unknown>;

const enc = (s: string) => Buffer.from(s, "utf8").toString("base64");
const dec = (s: unknown) => (typeof s === "string" ? Buffer.from(s, "base64").toString("utf8") : "");
const num = (s: unknown) => (s === undefined ? 0 : Number(s));

/** The key just past every key starting with `prefix` (etcd's range_end of a prefix). */
export function prefixEnd(prefix: string): string {
  const b = Buffer.from(prefix, "utf8");
  for (let i = b.length - 1; i >= 0; i--) {
    if (b[i]! < 0xff) {
      const out = Buffer.from(b.subarray(0, i + 1));
      out[i]! += 1;
      return out.toString("base64");
    }
  }
  return Buffer.from([0]).toString("base64"); // every key
}

function kvOf(j: Json): KeyValue {
  return {
    key: dec(j.key), value: dec(j.value),
    createRevision: num(j.create_revision), modRevision: num(j.mod_revision), version: num(j.version),
    lease: typeof j.lease === "string" ? j.lease : "0",
  };
}

/** A comparison of a transaction (etcd's Compare). */
export interface Compare {
  key: string;
  target: "CREATE" | "MOD" | "VERSION" | "VALUE" | "LEASE";
  result: "EQUAL" | "NOT_EQUAL" | "GREATER" | "LESS";
  value: string | number;
}

export const cmp = {
  /** The key does not exist (its create revision is 0). */
  absent: (key: string): Compare => ({ key, target: "CREATE", result: "EQUAL", value: 0 }),
  /** The key exists (its create revision is past 0). */
  present: (key: string): Compare => ({ key, target: "CREATE", result: "GREATER", value: 0 }),
  /** The key is the one created at revision `rev` (not deleted and made again since): a fence. */
  createRevision: (key: string, rev: number): Compare => ({ key, target: "CREATE", result: "EQUAL", value: rev }),
  modRevision: (key: string, rev: number): Compare => ({ key, target: "MOD", result: "EQUAL", value: rev }),
  value: (key: string, value: string): Compare => ({ key, target: "VALUE", result: "EQUAL", value }),
  /** The key is bound to this lease (a live holder's fence). */
  lease: (key: string, lease: string): Compare => ({ key, target: "LEASE", result: "EQUAL", value: lease }),
};

/** An operation of a transaction (etcd's RequestOp). */
export type Op = { put: { key: string; value: string; lease?: string } } | { del: { key: string; prefix?: boolean } } | { get: { key: string } };

export const op = {
  put: (key: string, value: string, lease?: string): Op => ({ put: { key, value, lease } }),
  del: (key: string, prefix = false): Op => ({ del: { key, prefix } }),
  get: (key: string): Op => ({ get: { key } }),
};

function compareJson(c: Compare): Json {
  const field = { CREATE: "create_revision", MOD: "mod_revision", VERSION: "version", VALUE: "value", LEASE: "lease" }[c.target];
  return { key: enc(c.key), target: c.target, result: c.result, [field]: c.target === "VALUE" ? enc(String(c.value)) : String(c.value) };
}

function opJson(o: Op): Json {
  if ("put" in o) return { request_put: { key: enc(o.put.key), value: enc(o.put.value), ...(o.put.lease ? { lease: o.put.lease } : {}) } };
  if ("del" in o) return { request_delete_range: { key: enc(o.del.key), ...(o.del.prefix ? { range_end: prefixEnd(o.del.key) } : {}) } };
  return { request_range: { key: enc(o.get.key) } };
}

export interface TxnResult {
  succeeded: boolean;
  revision: number;
  /** The key-values of the `get`s of the branch that ran, in order (an empty array for a key that is absent). */
  gets: KeyValue[][];
}

export interface Watch {
  close(): void;
}

export interface WatchHandlers {
  events(events: WatchEvent[], revision: number): void;
  /** The watch lost history it cannot replay (compaction): the caller reads the range again and returns the revision it read at; the watch goes on after it. */
  resync?(): Promise<number>;
  /** The stream broke (it reconnects by itself); for logs and health. */
  broken?(e: EtcdError): void;
}

export class EtcdClient {
  private preferred = 0;
  private closed = false;

  constructor(readonly endpoints: string[], private readonly timeoutMs = ETCD_CALL_TIMEOUT_MS) {
    if (endpoints.length === 0) throw new EtcdError("rejected", "no etcd endpoints given");
    for (const e of endpoints) if (!/^https?:\/\/[^/]+$/.test(e)) throw new EtcdError("rejected", `etcd endpoint '${e}': expected http(s)://host:port`);
  }

  /** `AENV_CLUSTER`'s form: comma-separated http(s)://host:port. */
  static parse(raw: string, timeoutMs?: number): EtcdClient {
    return new EtcdClient(raw.split(",").map((s) => s.trim().replace(/\/+$/, "")).filter(Boolean), timeoutMs);
  }

  close(): void {
    this.closed = true;
  }

  /**
   * One call to `/v3/<path>`: each endpoint in turn, round after round until the deadline, so an
   * election (about a second) or a dead member costs time, not the call. A retried write may have
   * been applied once already: callers write with compares that make a second application a no-op.
   */
  async call(path: string, body: Json, timeoutMs = this.timeoutMs): Promise<Json> {
    const deadline = performance.now() + timeoutMs;
    let last: EtcdError | undefined;
    for (let round = 0; ; round++) {
      for (let i = 0; i < this.endpoints.length; i++) {
        const at = (this.preferred + i) % this.endpoints.length;
        const left = deadline - performance.now();
        if (left <= 0) throw last ?? new EtcdError("timeout", `etcd: no answer to ${path} in ${timeoutMs} ms`);
        // One attempt never takes more than ATTEMPT_MS, so a member that hangs cannot eat the deadline.
        const slice = Math.min(left, ATTEMPT_MS);
        try {
          const res = await fetch(`${this.endpoints[at]}/v3/${path}`, {
            method: "POST", body: JSON.stringify(body), headers: { "content-type": "application/json" },
            signal: AbortSignal.timeout(slice),
          });
          const text = await res.text();
          if (text.length > MAX_ANSWER_BYTES) throw new EtcdError("rejected", `etcd answered ${text.length} bytes for ${path}`);
          const j = (text ? JSON.parse(text) : {}) as Json;
          if (res.ok) {
            this.preferred = at;
            return j;
          }
          const message = String(j.message ?? j.error ?? text).slice(0, 300);
          // No leader or no quorum: another member, or a later round, may have one; anything else is the request's fault.
          if (res.status >= 500 && /timed out|no leader|leader changed|unavailable|not capable|too many requests|stopped/i.test(message)) {
            last = new EtcdError(/timed out/i.test(message) ? "timeout" : "unavailable", `etcd ${this.endpoints[at]}: ${message}`);
            continue;
          }
          throw new EtcdError("rejected", `etcd ${path}: ${res.status} ${message}`);
        } catch (e) {
          if (e instanceof EtcdError) {
            if (e.reason === "rejected") throw e;
            last = e;
          } else if ((e as Error).name === "TimeoutError") last = new EtcdError("timeout", `etcd ${this.endpoints[at]}: no answer to ${path} in ${Math.round(slice)} ms`);
          else last = new EtcdError("unavailable", `etcd ${this.endpoints[at]}: ${(e as Error).message}`);
        }
      }
      await Bun.sleep(Math.min(ROUND_PAUSE_MS * (round + 1), 500));
    }
  }

  /**
   * Keys equal to `key`, or starting with it when `prefix`. Linearizable (a quorum read) unless
   * `serializable`, which any member answers from its own copy.
   */
  async range(key: string, o: { prefix?: boolean; limit?: number; serializable?: boolean; fromKey?: string } = {}): Promise<RangeResult> {
    const j = await this.call("kv/range", {
      key: enc(o.fromKey ?? key),
      ...(o.prefix ? { range_end: prefixEnd(key) } : {}),
      ...(o.limit ? { limit: String(o.limit) } : {}),
      ...(o.serializable ? { serializable: true } : {}),
    });
    return { kvs: ((j.kvs as Json[] | undefined) ?? []).map(kvOf), revision: num((j.header as Json | undefined)?.revision), more: j.more === true };
  }

  async get(key: string, o: { serializable?: boolean } = {}): Promise<KeyValue | undefined> {
    return (await this.range(key, o)).kvs[0];
  }

  async put(key: string, value: string, lease?: string): Promise<number> {
    const j = await this.call("kv/put", { key: enc(key), value: enc(value), ...(lease ? { lease } : {}) });
    return num((j.header as Json | undefined)?.revision);
  }

  async delete(key: string, o: { prefix?: boolean } = {}): Promise<number> {
    const j = await this.call("kv/deleterange", { key: enc(key), ...(o.prefix ? { range_end: prefixEnd(key) } : {}) });
    return num(j.deleted);
  }

  /** If every compare holds, `success` runs, else `failure`; atomically. */
  async txn(compare: Compare[], success: Op[], failure: Op[] = []): Promise<TxnResult> {
    const j = await this.call("kv/txn", { compare: compare.map(compareJson), success: success.map(opJson), failure: failure.map(opJson) });
    const gets: KeyValue[][] = [];
    for (const r of (j.responses as Json[] | undefined) ?? []) {
      const range = r.response_range as Json | undefined;
      if (range) gets.push(((range.kvs as Json[] | undefined) ?? []).map(kvOf));
    }
    return { succeeded: j.succeeded === true, revision: num((j.header as Json | undefined)?.revision), gets };
  }

  /** A new lease of `ttlS` seconds: its ID. */
  async leaseGrant(ttlS: number): Promise<string> {
    const j = await this.call("lease/grant", { TTL: String(ttlS) });
    if (typeof j.ID !== "string") throw new EtcdError("rejected", `etcd lease/grant: no ID in ${JSON.stringify(j).slice(0, 200)}`);
    return j.ID;
  }

  /** Renews lease `id`: its TTL in seconds, 0 when it has expired (or never existed). */
  async leaseKeepAlive(id: string): Promise<number> {
    const j = await this.call("lease/keepalive", { ID: id });
    const r = (j.result ?? j) as Json;
    if (r.error) throw new EtcdError("unavailable", `etcd lease/keepalive: ${JSON.stringify(r.error).slice(0, 200)}`);
    return num(r.TTL);
  }

  async leaseRevoke(id: string): Promise<void> {
    try {
      await this.call("lease/revoke", { ID: id });
    } catch (e) {
      // An expired lease is already gone: what a revoke wanted.
      if (!(e instanceof EtcdError && e.reason === "rejected" && /not found/i.test(e.message))) throw e;
    }
  }

  /**
   * Watches every key under `prefix` from revision `fromRevision` on: events arrive in order, each
   * batch with the revision it brings the caller to. A broken stream reconnects from the next
   * revision; history etcd no longer has makes it call `resync` and go on from the store's present.
   */
  watch(prefix: string, fromRevision: number, h: WatchHandlers): Watch {
    let next = fromRevision;
    let stop = false;
    let abort: AbortController | undefined;
    const run = async () => {
      let delay = WATCH_RETRY_MS;
      for (let i = 0; !stop && !this.closed; i++) {
        const at = (this.preferred + i) % this.endpoints.length;
        abort = new AbortController();
        try {
          const res = await fetch(`${this.endpoints[at]}/v3/watch`, {
            method: "POST", signal: abort.signal, headers: { "content-type": "application/json" },
            body: JSON.stringify({ create_request: { key: enc(prefix), range_end: prefixEnd(prefix), start_revision: String(next), progress_notify: true } }),
          });
          if (!res.ok || !res.body) throw new EtcdError("unavailable", `etcd watch: ${res.status}`);
          const decoder = new TextDecoder();
          let buf = "";
          for await (const chunk of res.body) {
            buf += decoder.decode(chunk as Uint8Array, { stream: true });
            if (buf.length > MAX_WATCH_LINE) throw new EtcdError("rejected", `etcd watch: a line over ${MAX_WATCH_LINE} bytes`);
            let nl: number;
            while ((nl = buf.indexOf("\n")) >= 0) {
              const line = buf.slice(0, nl).trim();
              buf = buf.slice(nl + 1);
              if (!line) continue;
              const j = JSON.parse(line) as Json;
              if (j.error) throw new EtcdError("unavailable", `etcd watch: ${JSON.stringify(j.error).slice(0, 200)}`);
              const r = (j.result ?? {}) as Json;
              const rev = num((r.header as Json | undefined)?.revision);
              if (num(r.compact_revision) > 0 || (r.canceled === true && /compact/i.test(String(r.cancel_reason ?? "")))) {
                // History before compact_revision is gone: the caller reads the present and the watch goes on from there.
                next = h.resync ? (await h.resync()) + 1 : Math.max(num(r.compact_revision), rev + 1);
                throw new EtcdError("unavailable", "etcd watch: compacted; resynced");
              }
              if (r.canceled === true) throw new EtcdError("unavailable", `etcd watch canceled: ${String(r.cancel_reason ?? "")}`);
              delay = WATCH_RETRY_MS;
              const events = ((r.events as Json[] | undefined) ?? []).map((e): WatchEvent => ({ type: e.type === "DELETE" ? "delete" : "put", kv: kvOf(e.kv as Json) }));
              if (events.length > 0) {
                next = Math.max(next, events[events.length - 1]!.kv.modRevision + 1);
                h.events(events, next - 1);
              } else if (rev > 0 && r.created !== true) {
                // A progress notification: nothing under the prefix changed up to rev.
                next = Math.max(next, rev + 1);
              }
            }
          }
          throw new EtcdError("unavailable", "etcd watch: the stream ended");
        } catch (e) {
          if (stop || this.closed) return;
          const err = e instanceof EtcdError ? e : new EtcdError("unavailable", `etcd watch: ${(e as Error).message}`);
          h.broken?.(err);
          await Bun.sleep(delay);
          delay = Math.min(delay * 2, WATCH_RETRY_MAX_MS);
        }
      }
    };
    void run();
    return {
      close: () => {
        stop = true;
        abort?.abort();
      },
    };
  }
}
