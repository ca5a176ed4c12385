// The gateway's view of the cluster: live nodes, sandbox bindings, published templates and who
// holds each shared volume, loaded once and then kept by
// one etcd watch on the cluster's prefix. A binding the view lacks is read from etcd (a quorum
// read) before a request is answered 404, so a create answered a moment ago routes at once.
import { EtcdClient, type KeyValue } from "../../src/cluster/etcd_client.ts";
import {
  NODES, ROOT, SANDBOXES, TEMPLATES, VOLUME_HOLDERS, parseBinding, parseNode, parseTemplate, parseVolumeHolder, sandboxKey,
  type Binding, type NodeRecord, type TemplateEntry, type VolumeHolderEntry,
} from "../../src/cluster/records.ts";

/** Bindings kept in memory; past it new ones are read from etcd at each use (a cluster of 256 nodes × 4096 sandboxes fits). */
export const MAX_CACHED_BINDINGS = 1 << 20;
/** Published templates kept (a cluster's templates, not its sandboxes). */
export const MAX_TEMPLATES = 10_000;
/** Volume holders kept (a cluster keeps at most 1024 volumes, docs/volumes.md). */
export const MAX_VOLUME_HOLDERS = 4096;
/** The watch broken for longer than this makes /health 503 (the view may be stale). */
const STALE_AFTER_MS = 15_000;

export type Owner =
  | { kind: "live"; node: NodeRecord; binding: Binding }
  | { kind: "lost"; nodeId: string; binding: Binding }
  | { kind: "none"; binding?: undefined };

export class ClusterView {
  readonly nodes = new Map<string, NodeRecord>();
  readonly bindings = new Map<string, Binding>();
  /** Templates one node built and published for the others, by ID. */
  readonly templates = new Map<string, TemplateEntry>();
  /** Who holds each shared volume (docs/volumes.md, In a cluster), by volume ID: its calls go there. */
  readonly volumeHolders = new Map<string, VolumeHolderEntry>();
  private loaded = false;
  private brokenSince: number | undefined;
  private lastError = "";
  private watch: { close(): void } | undefined;

  constructor(readonly etcd: EtcdClient, private readonly log: (line: string) => void = () => {}) {}

  /** Loads nodes and bindings, then follows changes. Retries until etcd answers. */
  async start(): Promise<void> {
    for (;;) {
      try {
        const rev = await this.load();
        this.watch = this.etcd.watch(ROOT, rev + 1, {
          events: (events) => {
            this.brokenSince = undefined;
            for (const e of events) this.apply(e.type, e.kv);
          },
          resync: () => this.load(),
          broken: (e) => {
            this.brokenSince ??= performance.now();
            this.lastError = e.message;
          },
        });
        return;
      } catch (e) {
        this.lastError = (e as Error).message;
        this.log(`gateway: etcd: ${this.lastError}; retrying`);
        await Bun.sleep(1000);
      }
    }
  }

  close(): void {
    this.watch?.close();
  }

  /** Why the gateway cannot route now, or undefined when it can. */
  notReady(): string | undefined {
    if (!this.loaded) return `loading the cluster's state from etcd${this.lastError ? ` (${this.lastError})` : ""}`;
    if (this.brokenSince !== undefined && performance.now() - this.brokenSince > STALE_AFTER_MS) return `etcd watch broken for ${Math.round((performance.now() - this.brokenSince) / 1000)} s: ${this.lastError}`;
    return undefined;
  }

  private async load(): Promise<number> {
    const nodes = await this.etcd.range(NODES, { prefix: true });
    const bindings = await this.etcd.range(SANDBOXES, { prefix: true });
    const templates = await this.etcd.range(TEMPLATES, { prefix: true, limit: MAX_TEMPLATES });
    const holders = await this.etcd.range(VOLUME_HOLDERS, { prefix: true, limit: MAX_VOLUME_HOLDERS });
    this.nodes.clear();
    for (const kv of nodes.kvs) this.apply("put", kv);
    this.bindings.clear();
    for (const kv of bindings.kvs) this.apply("put", kv);
    this.templates.clear();
    for (const kv of templates.kvs) this.apply("put", kv);
    this.volumeHolders.clear();
    for (const kv of holders.kvs) this.apply("put", kv);
    this.loaded = true;
    return Math.max(nodes.revision, bindings.revision, templates.revision, holders.revision);
  }

  private apply(type: "put" | "delete", kv: KeyValue): void {
    if (kv.key.startsWith(NODES)) this.follow(this.nodes, NODES, Infinity, parseNode, type, kv);
    else if (kv.key.startsWith(TEMPLATES)) this.follow(this.templates, TEMPLATES, MAX_TEMPLATES, parseTemplate, type, kv);
    else if (kv.key.startsWith(SANDBOXES)) this.follow(this.bindings, SANDBOXES, MAX_CACHED_BINDINGS, parseBinding, type, kv);
    else if (kv.key.startsWith(VOLUME_HOLDERS)) this.follow(this.volumeHolders, VOLUME_HOLDERS, MAX_VOLUME_HOLDERS, parseVolumeHolder, type, kv);
  }

  /** One event into one map: a delete forgets the key, a put parses its record (one that does not parse is logged and skipped) while the map is under `max`. */
  private follow<T>(map: Map<string, T>, prefix: string, max: number, parse: (text: string) => T, type: "put" | "delete", kv: KeyValue): void {
    const id = kv.key.slice(prefix.length);
    if (type === "delete") {
      map.delete(id);
      return;
    }
    if (map.size >= max && !map.has(id)) return;
    try {
      map.set(id, parse(kv.value));
    } catch (e) {
      this.log(`gateway: ${kv.key}: ${(e as Error).message}; ignored`);
    }
  }

  /** A binding learnt from a create's answer, before the watch brings it. */
  learn(id: string, b: Binding): void {
    if (this.bindings.size < MAX_CACHED_BINDINGS) this.bindings.set(id, b);
  }

  forget(id: string): void {
    this.bindings.delete(id);
  }

  /** Who owns sandbox `id`: a live node, a node whose lease is gone, or nobody (after a quorum read). */
  async owner(id: string): Promise<Owner> {
    let b = this.bindings.get(id);
    if (!b) {
      const kv = await this.etcd.get(sandboxKey(id));
      if (!kv) return { kind: "none" };
      b = parseBinding(kv.value);
      this.learn(id, b);
    }
    const node = this.nodes.get(b.node);
    return node ? { kind: "live", node, binding: b } : { kind: "lost", nodeId: b.node, binding: b };
  }

  /** The published template `ref` names (ID, alias or `name:tag`), if any. */
  template(ref: string): TemplateEntry | undefined {
    const byId = this.templates.get(ref);
    if (byId) return byId;
    const name = ref.includes(":") ? ref : `${ref}:default`;
    for (const t of this.templates.values()) if (t.alias === ref || t.names.includes(name)) return t;
    return undefined;
  }

  liveNodes(): NodeRecord[] {
    return [...this.nodes.values()];
  }

  /** Bindings whose node has no live record: their sandboxes are lost (listed so, never silently gone). */
  lost(): [string, Binding][] {
    return [...this.bindings].filter(([, b]) => !this.nodes.has(b.node));
  }
}

