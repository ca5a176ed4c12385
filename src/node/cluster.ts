// A node in a cluster (AENV_CLUSTER, docs/cluster.md): it registers `nodes/{id}` on a lease it
// renews every RENEW_MS, writes each sandbox's binding before the create's answer (fenced by that
// lease), and deletes it when the sandbox is gone. A node whose lease is lost takes no new
// sandboxes (503), keeps the ones it runs, and registers again when etcd answers; on registering
// it re-binds its sandboxes to its new lease. It never kills a sandbox over a binding.
import { readFile, rename, statfs, writeFile } from "node:fs/promises";
import { cpus, totalmem } from "node:os";
import { ApiError } from "../api/errors.ts";
import type { Placement } from "../api/sandboxes.ts";
import { OrchestratorError } from "../orchestrator/errors.ts";
import type { SandboxRecord } from "../orchestrator/store.ts";
import { EtcdClient, EtcdError, cmp, op } from "../cluster/etcd_client.ts";
import {
  MAX_CACHED, MAX_LAYER_DIGESTS, NODES, NODE_LEASE_TTL_S, TEMPLATES, nodeKey, parseBinding, parseNode, parseTemplate, sandboxKey, templateKey,
  type Binding, type NodeRecord, type NodeStatus, type TemplateEntry,
} from "../cluster/records.ts";

/** Lease renewals: three within a TTL, so one slow renewal never costs the lease. */
const RENEW_MS = 3_000;
/** Unbinds that failed (etcd away) and wait for the next pass; past it the oldest is dropped (a re-register re-reads every binding). */
const MAX_PENDING_UNBINDS = 4096;
/** Paused sandboxes waiting to be put into the shared store; past it a pause is not exported (it resumes here only). */
const MAX_PENDING_EXPORTS = 256;
/** Template entries a lookup by name reads at most (a cluster's templates, not its sandboxes). */
const MAX_TEMPLATES_SCANNED = 10_000;
/** Changes (a bind, an unbind) reach the node's record within this, coalesced. */
const RECORD_SOON_MS = 200;

export interface ClusterMemberOptions {
  etcd: EtcdClient;
  nodeId: string;
  apiUrl: string;
  version: string;
  home: string;
  /** Where the lease ID is kept, so a restarted node takes its live lease back instead of waiting out its TTL. */
  leaseFile: string;
  maxSandboxes: number;
  /** Every sandbox the node holds (running and paused). */
  sandboxes: () => SandboxRecord[];
  running: () => number;
  /** Digests of the layers this node serves verified (read at each record write). */
  layers?: () => Promise<string[]>;
  /** Templates' IDs, aliases and names with the bytes of their layers on this node (read at each record write). */
  cached: () => Promise<Record<string, number>> | Record<string, number>;
  /** This node's iroh endpoint, when it has one. */
  p2p?: () => { id: string; addrs: string[] } | undefined;
  /**
   * Resume anywhere (a shared snapshot store): puts a paused sandbox into the store, takes one
   * from it, drops this node's copy of one another node took. Absent: paused sandboxes stay here.
   */
  moves?: {
    exportPaused(id: string): Promise<void>;
    adoptPaused(id: string): Promise<SandboxRecord>;
    dropMoved(id: string): Promise<boolean>;
    forgetExport(id: string): Promise<void>;
  };
  /** Called with the other nodes' iroh endpoints and API URLs whenever they change. */
  onPeers?: (peers: { id: string; addrs: string[] }[], nodes: { id: string; url: string }[]) => void;
  log?: (line: string) => void;
}

export class ClusterMember implements Placement {
  private lease: string | undefined;
  private status: NodeStatus = "ready";
  private lastError = "not registered yet";
  private timer: ReturnType<typeof setTimeout> | undefined;
  private closed = false;
  private readonly pendingUnbinds = new Set<string>();
  /** Paused sandboxes whose binding says `exported` (another node may take them); checked each pass. */
  private readonly exported = new Set<string>();
  /** Exports waiting or running, one at a time (each reads the whole paused state). */
  private exports: Promise<void> = Promise.resolve();
  private exportsQueued = 0;
  private peersSeen = "";
  /** When etcd last confirmed the lease (a renewal or a registration). */
  private renewedAt = performance.now();

  constructor(private readonly o: ClusterMemberOptions) {}

  /** Registers now if etcd answers (else keeps trying every RENEW_MS), then renews for as long as the node runs. */
  async start(): Promise<void> {
    await this.pass();
    const loop = async () => {
      if (this.closed) return;
      await this.pass().catch((e) => this.o.log?.(`cluster: ${(e as Error).message}`));
      if (!this.closed) this.timer = setTimeout(loop, RENEW_MS);
    };
    this.timer = setTimeout(loop, RENEW_MS);
  }

  /** Whether this node holds a live lease now. */
  get registered(): boolean {
    return this.lease !== undefined;
  }

  get nodeStatus(): NodeStatus {
    return this.status;
  }

  /** ready, draining (no new placements; its sandboxes stay) or cordoned; written at once. */
  async setStatus(s: NodeStatus): Promise<void> {
    this.status = s;
    if (this.lease) await this.writeRecord();
  }

  /** Placement: whether this node may take a new sandbox now (503 with the reason when not). */
  admit(): void {
    if (!this.lease) throw new ApiError(503, `node ${this.o.nodeId} is not in the cluster: ${this.lastError}; it takes no new sandboxes until it registers again`);
    if (this.status !== "ready") throw new ApiError(503, `node ${this.o.nodeId} is ${this.status}: it takes no new sandboxes`);
  }

  /** Placement: the sandbox's binding, written before the create's answer, fenced by this node's lease. */
  async bind(rec: SandboxRecord): Promise<void> {
    const lease = this.lease;
    if (!lease) throw new ApiError(503, `node ${this.o.nodeId} lost its cluster lease: ${this.lastError}`);
    const key = sandboxKey(rec.id);
    const value = JSON.stringify(this.bindingOf(rec, lease));
    let r;
    try {
      r = await this.o.etcd.txn([cmp.absent(key), cmp.lease(nodeKey(this.o.nodeId), lease)], [op.put(key, value)], [op.get(key)]);
    } catch (e) {
      throw new ApiError(503, `the cluster store did not take sandbox ${rec.id}'s binding: ${(e as Error).message}`);
    }
    if (r.succeeded) {
      this.recordSoon();
      return;
    }
    const held = r.gets[0]?.[0];
    if (held && parseBinding(held.value).node === this.o.nodeId) return; // a retry of our own write
    throw new ApiError(held ? 409 : 503, held ? `sandbox ${rec.id} is bound to another node` : `node ${this.o.nodeId}'s lease expired while binding sandbox ${rec.id}`);
  }

  private recordTimer: ReturnType<typeof setTimeout> | undefined;
  /** The record's counts written within RECORD_SOON_MS of a change, so placements see a create before the next renewal. */
  private recordSoon(): void {
    if (this.recordTimer || !this.lease) return;
    this.recordTimer = setTimeout(() => {
      this.recordTimer = undefined;
      if (this.lease && !this.closed) void this.writeRecord().catch(() => {});
    }, RECORD_SOON_MS);
  }

  /** Resume anywhere: a pause finished; the paused sandbox goes into the store, then its binding says so. */
  paused(id: string): void {
    const m = this.o.moves;
    if (!m || this.exportsQueued >= MAX_PENDING_EXPORTS) return;
    this.exportsQueued++;
    this.exports = this.exports.then(async () => {
      try {
        await m.exportPaused(id);
        await this.setExported(id, true);
      } catch (e) {
        this.o.log?.(`cluster: sandbox ${id} not put into the snapshot store: ${(e as Error).message}`);
      } finally {
        this.exportsQueued--;
      }
    });
  }

  /**
   * Resume anywhere: before sandbox `id` resumes here, its binding stops saying `exported`, so no
   * other node takes it from now on. One another node took is dropped here (409); while etcd does
   * not answer, an exported sandbox does not resume (503), since another node may be taking it.
   */
  async resuming(id: string): Promise<void> {
    if (!this.exported.has(id)) return;
    const kv = await this.o.etcd.get(sandboxKey(id)).catch((e: Error) => {
      throw new OrchestratorError(503, `sandbox ${id} may be resumed by another node and etcd does not answer: ${e.message}`);
    });
    const b = kv ? parseBinding(kv.value) : undefined;
    if (b && b.node !== this.o.nodeId) {
      this.exported.delete(id);
      void this.o.moves?.dropMoved(id);
      throw new OrchestratorError(409, `sandbox ${id} moved to node ${b.node}`);
    }
    const lease = this.lease;
    if (!lease) throw new OrchestratorError(503, `node ${this.o.nodeId} is not in the cluster: sandbox ${id} may be resumed by another node`);
    const rec = this.o.sandboxes().find((r) => r.id === id);
    if (!rec) return;
    const r = await this.o.etcd.txn(kv ? [cmp.modRevision(sandboxKey(id), kv.modRevision)] : [cmp.absent(sandboxKey(id))], [op.put(sandboxKey(id), JSON.stringify(this.bindingOf(rec, lease)))]);
    if (!r.succeeded) throw new OrchestratorError(409, `sandbox ${id}'s binding changed while it was resuming; try again`);
    this.exported.delete(id);
    void this.o.moves?.forgetExport(id);
  }

  private async setExported(id: string, on: boolean): Promise<void> {
    const lease = this.lease;
    const rec = this.o.sandboxes().find((r) => r.id === id);
    if (!lease || !rec || (on && rec.state !== "paused")) return;
    const key = sandboxKey(id);
    const kv = await this.o.etcd.get(key);
    if (kv && parseBinding(kv.value).node !== this.o.nodeId) return;
    const r = await this.o.etcd.txn([kv ? cmp.modRevision(key, kv.modRevision) : cmp.absent(key)], [op.put(key, JSON.stringify(this.bindingOf(rec, lease, on)))]);
    if (r.succeeded && on) this.exported.add(id);
  }

  /**
   * Takes paused sandbox `id` from the shared store onto this node, when its binding names a node
   * that left the cluster or drains and says `exported`; the binding moves here by compare-and-swap
   * (so two nodes taking it at once: one wins, the other gives its copy back).
   */
  async adopt(id: string): Promise<SandboxRecord> {
    const m = this.o.moves;
    if (!m) throw new ApiError(409, `node ${this.o.nodeId} has no shared snapshot store (AENV_RESUME_ANYWHERE): it cannot take sandbox ${id}`);
    this.admit();
    const key = sandboxKey(id);
    const kv = await this.o.etcd.get(key);
    if (!kv) throw new ApiError(404, `sandbox ${id} not found`);
    const b = parseBinding(kv.value);
    if (b.node === this.o.nodeId) throw new ApiError(409, `sandbox ${id} is on this node already`);
    if (!b.exported) throw new ApiError(409, `sandbox ${id} is not in the shared store (it runs, or its pause has not been put there)`);
    const owner = await this.o.etcd.get(nodeKey(b.node));
    if (owner && parseNode(owner.value).status === "ready") throw new ApiError(409, `sandbox ${id}'s node ${b.node} is in the cluster and ready: resume it there`);
    const rec = await m.adoptPaused(id);
    const lease = this.lease!;
    const r = await this.o.etcd.txn([cmp.modRevision(key, kv.modRevision), cmp.lease(nodeKey(this.o.nodeId), lease)], [op.put(key, JSON.stringify(this.bindingOf(rec, lease, true)))]);
    if (!r.succeeded) {
      await m.dropMoved(id).catch(() => {});
      throw new ApiError(409, `sandbox ${id} was taken by another node meanwhile`);
    }
    this.exported.add(id);
    this.o.log?.(`cluster: sandbox ${id} taken from node ${b.node}`);
    return rec;
  }

  /** A template this node built and pushed: the other nodes import it from `entry.ref` under its ID. */
  async publishTemplate(entry: Omit<TemplateEntry, "node" | "at">): Promise<void> {
    await this.o.etcd.put(templateKey(entry.id), JSON.stringify({ ...entry, node: this.o.nodeId, at: Date.now() }));
  }

  /** The cluster's template that `ref` (an ID, an alias or `name:tag`) names, if one node published it. */
  async findTemplate(ref: string): Promise<TemplateEntry | undefined> {
    const direct = await this.o.etcd.get(templateKey(ref)).catch(() => undefined);
    if (direct) return parseTemplate(direct.value);
    const { kvs } = await this.o.etcd.range(TEMPLATES, { prefix: true, serializable: true, limit: MAX_TEMPLATES_SCANNED });
    const name = ref.includes(":") ? ref : `${ref}:default`;
    for (const kv of kvs) {
      try {
        const t = parseTemplate(kv.value);
        if (t.alias === ref || t.names.includes(name)) return t;
      } catch { /* skipped */ }
    }
    return undefined;
  }

  /** Each pass: a paused sandbox another node took is dropped here. */
  private async dropTaken(): Promise<void> {
    for (const id of [...this.exported]) {
      const kv = await this.o.etcd.get(sandboxKey(id));
      const b = kv ? parseBinding(kv.value) : undefined;
      if (b && b.node !== this.o.nodeId) {
        this.exported.delete(id);
        if (await this.o.moves?.dropMoved(id)) this.o.log?.(`cluster: sandbox ${id} went to node ${b.node}; this node's copy is given back`);
      } else if (!this.o.sandboxes().some((r) => r.id === id && r.state === "paused")) this.exported.delete(id);
    }
  }

  /** The sandbox is gone from this node: its binding goes (retried on later passes while etcd is away). */
  unbind(id: string): void {
    this.recordSoon();
    this.exported.delete(id);
    void this.deleteBinding(id).then((ours) => {
      // Its export goes with it, unless another node took the sandbox (its export is that node's now).
      if (ours) void this.o.moves?.forgetExport(id);
    }, () => {
      if (this.pendingUnbinds.size >= MAX_PENDING_UNBINDS) this.pendingUnbinds.delete(this.pendingUnbinds.values().next().value!);
      this.pendingUnbinds.add(id);
    });
  }

  /** Deletes the binding when this node owns it (or it is absent or unreadable): whether the sandbox was this node's. */
  private async deleteBinding(id: string): Promise<boolean> {
    const key = sandboxKey(id);
    const kv = await this.o.etcd.get(key);
    if (!kv) return true;
    let b: Binding;
    try {
      b = parseBinding(kv.value);
    } catch {
      return true;
    }
    if (b.node !== this.o.nodeId) return false; // another node owns it now
    await this.o.etcd.txn([cmp.modRevision(key, kv.modRevision)], [op.del(key)]);
    return true;
  }

  private bindingOf(rec: SandboxRecord, lease: string, exported = false): Binding {
    return {
      ...(exported ? { exported: true } : {}),
      ...(rec.autoResume ? { autoResume: true } : {}),
      node: this.o.nodeId, lease, templateId: rec.templateId, ...(rec.alias ? { alias: rec.alias } : {}),
      cpuCount: rec.cpuCount, memoryMB: rec.memoryMB, diskSizeMB: rec.diskSizeMB, metadata: rec.metadata,
      envdVersion: rec.envdVersion, startedAt: rec.startedAt, endAt: rec.endAt,
    };
  }

  /** One renewal: keep the lease (or register anew), refresh the record, retry unbinds, follow peers. */
  private async pass(): Promise<void> {
    try {
      if (this.lease) {
        const ttl = await this.o.etcd.leaseKeepAlive(this.lease);
        if (ttl <= 0) {
          this.lastError = "its lease expired (etcd was out of reach for longer than the TTL)";
          this.o.log?.(`cluster: node ${this.o.nodeId}: ${this.lastError}; registering again`);
          this.lease = undefined;
        }
      }
      if (!this.lease) await this.register();
      else await this.writeRecord();
      for (const id of [...this.pendingUnbinds]) {
        if (await this.deleteBinding(id)) void this.o.moves?.forgetExport(id);
        this.pendingUnbinds.delete(id);
      }
      await this.followPeers();
      await this.dropTaken();
    } catch (e) {
      this.lastError = e instanceof EtcdError ? `etcd: ${e.message}` : (e as Error).message;
      // A lease etcd has not confirmed for a TTL is as good as gone: no new sandboxes until it is.
      if (this.lease && performance.now() - this.renewedAt > NODE_LEASE_TTL_S * 1000) {
        this.o.log?.(`cluster: node ${this.o.nodeId}: no renewal for ${NODE_LEASE_TTL_S} s (${this.lastError}); taking no new sandboxes`);
        this.lease = undefined;
      }
      throw e;
    }
    this.renewedAt = performance.now();
  }

  /** The lease a previous run of this node left, when it is still live and still holds the node's record. */
  private async leftLease(): Promise<string | undefined> {
    const left = await readFile(this.o.leaseFile, "utf8").then((t) => t.trim(), () => "");
    if (!/^\d{1,20}$/.test(left)) return undefined;
    if ((await this.o.etcd.leaseKeepAlive(left)) <= 0) return undefined;
    const kv = await this.o.etcd.get(nodeKey(this.o.nodeId));
    return kv?.lease === left ? left : undefined;
  }

  private async register(): Promise<void> {
    const key = nodeKey(this.o.nodeId);
    const left = await this.leftLease();
    if (left) {
      this.lease = left;
      await this.writeRecord();
      this.renewedAt = performance.now();
      this.o.log?.(`cluster: node ${this.o.nodeId} took its lease back (${left}, ${this.o.apiUrl})`);
      await this.rebind(left);
      return;
    }
    const lease = await this.o.etcd.leaseGrant(NODE_LEASE_TTL_S);
    // One process per node ID: a record on another live lease is another process.
    const r = await this.o.etcd.txn([cmp.absent(key)], [op.put(key, JSON.stringify(await this.record()), lease)], [op.get(key)]);
    if (!r.succeeded) {
      await this.o.etcd.leaseRevoke(lease).catch(() => {});
      throw new EtcdError("rejected", `node ID ${this.o.nodeId} is registered by another process (its lease has not expired); retrying`);
    }
    this.lease = lease;
    this.renewedAt = performance.now();
    const tmp = `${this.o.leaseFile}.tmp`;
    await writeFile(tmp, lease + "\n", { mode: 0o600 });
    await rename(tmp, this.o.leaseFile);
    this.o.log?.(`cluster: node ${this.o.nodeId} registered (lease ${lease}, ${this.o.apiUrl})`);
    await this.rebind(lease);
  }

  /** After registering: every sandbox this node holds is bound to it under the new lease; one another node owns is left (and logged). */
  private async rebind(lease: string): Promise<void> {
    for (const rec of this.o.sandboxes()) {
      if (rec.state === "creating" || rec.state === "killing") continue;
      const key = sandboxKey(rec.id);
      const value = JSON.stringify(this.bindingOf(rec, lease));
      const kv = await this.o.etcd.get(key);
      if (!kv) {
        await this.o.etcd.txn([cmp.absent(key), cmp.lease(nodeKey(this.o.nodeId), lease)], [op.put(key, value)]);
        continue;
      }
      let owner: string | undefined;
      try {
        owner = parseBinding(kv.value).node;
      } catch { /* unreadable: ours to rewrite */ }
      if (owner !== undefined && owner !== this.o.nodeId) {
        // Another node took it (resume anywhere) while this one was away: a paused copy goes; one running here is kept and logged.
        if (rec.state === "paused" && this.o.moves && (await this.o.moves.dropMoved(rec.id))) this.o.log?.(`cluster: sandbox ${rec.id} went to node ${owner}; this node's copy is given back`);
        else this.o.log?.(`cluster: sandbox ${rec.id} is bound to node ${owner}; this node keeps its copy and does not route it`);
        continue;
      }
      const wasExported = (() => { try { return parseBinding(kv.value).exported === true; } catch { return false; } })();
      const r = await this.o.etcd.txn([cmp.modRevision(key, kv.modRevision), cmp.lease(nodeKey(this.o.nodeId), lease)], [op.put(key, JSON.stringify(this.bindingOf(rec, lease, wasExported && rec.state === "paused")))]);
      if (r.succeeded && wasExported && rec.state === "paused") this.exported.add(rec.id);
    }
  }

  private async writeRecord(): Promise<void> {
    const lease = this.lease!;
    const key = nodeKey(this.o.nodeId);
    const r = await this.o.etcd.txn([cmp.lease(key, lease)], [op.put(key, JSON.stringify(await this.record()), lease)]);
    if (!r.succeeded) {
      this.lastError = "its record was gone (lease expired)";
      this.lease = undefined;
    }
  }

  private async record(): Promise<NodeRecord> {
    const all = this.o.sandboxes();
    const running = all.filter((r) => r.state !== "paused" && r.state !== "pausing");
    let diskFreeMB = 0;
    try {
      const s = await statfs(this.o.home);
      diskFreeMB = Math.floor((s.bavail * s.bsize) / 2 ** 20);
    } catch { /* unknown: 0 */ }
    const cached = Object.fromEntries(Object.entries(await this.o.cached()).slice(0, MAX_CACHED));
    return {
      id: this.o.nodeId, apiUrl: this.o.apiUrl, status: this.status, version: this.o.version,
      ...(this.o.p2p?.() ? { p2p: this.o.p2p()! } : {}),
      capacity: { cpus: cpus().length, memoryMB: Math.floor(totalmem() / 2 ** 20), diskFreeMB, maxSandboxes: this.o.maxSandboxes },
      used: {
        sandboxes: all.length, running: this.o.running(),
        cpus: running.reduce((n, r) => n + r.cpuCount, 0), memoryMB: running.reduce((n, r) => n + r.memoryMB, 0),
      },
      cached, ...(this.o.layers ? { layers: (await this.o.layers()).slice(0, MAX_LAYER_DIGESTS) } : {}), at: Date.now(),
    };
  }

  /** The other nodes' iroh endpoints from their records: the node's peers (no static list needed). */
  private async followPeers(): Promise<void> {
    if (!this.o.onPeers) return;
    const { kvs } = await this.o.etcd.range(NODES, { prefix: true, serializable: true });
    const peers: { id: string; addrs: string[] }[] = [];
    const nodes: { id: string; url: string }[] = [];
    for (const kv of kvs) {
      try {
        const n = parseNode(kv.value);
        if (n.id === this.o.nodeId) continue;
        if (n.p2p) peers.push(n.p2p);
        nodes.push({ id: n.id, url: n.apiUrl });
      } catch { /* skipped */ }
    }
    peers.sort((a, b) => a.id.localeCompare(b.id));
    const seen = JSON.stringify([peers, nodes]);
    if (seen === this.peersSeen) return;
    this.peersSeen = seen;
    this.o.onPeers(peers, nodes);
  }

  /**
   * Stops renewing. The lease is kept (the sandboxes keep running, and a restart within its TTL
   * takes it back); `leave` gives it back, so the record goes at once.
   */
  async close(o: { leave?: boolean } = {}): Promise<void> {
    this.closed = true;
    clearTimeout(this.timer);
    clearTimeout(this.recordTimer);
    if (o.leave && this.lease) await this.o.etcd.leaseRevoke(this.lease).catch(() => {});
    this.lease = undefined;
  }
}
