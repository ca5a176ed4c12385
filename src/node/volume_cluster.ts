// Volumes shared by a cluster's nodes (docs/volumes.md, In a cluster): each volume's record in
// etcd (`/aenv/volumes/{id}`, its name in `/aenv/volume-names/{name}`, made together) and its
// sealed layers in the shared snapshot store (`vol.<id>.<sha256>`, files stored once by content),
// for the node's VolumeStore (src/orchestrator/volume_shared.ts). A claim is the holder key
// `/aenv/volume-holders/{id}`, created only when absent, on this node process's volume lease: a
// node that dies lets its volumes go when that lease expires. The holder key's create revision
// fences every change: a node whose claim lapsed publishes nothing.
import { readFile, rename, rm, stat, writeFile } from "node:fs/promises";
import { relative } from "node:path";
import { cmp, EtcdError, op, type EtcdClient } from "../cluster/etcd_client.ts";
import {
  NODE_LEASE_TTL_S, parseVolume, parseVolumeHolder, VOLUMES, volumeHolderKey, volumeKey, volumeNameKey, type VolumeEntry,
} from "../cluster/records.ts";
import { OrchestratorError } from "../orchestrator/errors.ts";
import {
  ClaimLapsed, VOLUME_LAYER_STORE_PREFIX, type SharedHolder, type SharedVolume, type SharedVolumes, type VolumeClaim,
} from "../orchestrator/volume_shared.ts";
import { DEFAULT_LIMITS, SnapshotStoreError, type SnapshotStore } from "../snapshot/index.ts";
import { Deadline } from "../snapshot/deadline.ts";
import { copySparse, sha256File } from "../snapshot/files.ts";
import { DigestCache } from "../snapshot/store.ts";

/** Lease renewals: three within a TTL (NODE_LEASE_TTL_S), so one slow renewal never costs the lease. */
const RENEW_MS = 3_000;
/** Tries of one claim when the holder key changes under it (released, or this node's own). */
const CLAIM_TRIES = 3;
/** The one file of a layer's entry in the store. */
const LAYER = "layer";

/** A volume layer's ID in the shared snapshot store. */
export const layerStoreId = (volumeId: string, sha256: string) => `${VOLUME_LAYER_STORE_PREFIX}${volumeId}.${sha256}`;

/**
 * Whether a node's volumes are the cluster's: it is in a cluster and its snapshot store is not
 * under its own home (a shared directory or S3, as the cluster's nodes share it).
 */
export function sharesVolumes(cfg: { cluster: string[]; snapshotStore: string; home: string }): boolean {
  if (cfg.cluster.length === 0) return false;
  const s = cfg.snapshotStore.trim();
  if (s.startsWith("s3://")) return true;
  return s !== "" && relative(cfg.home, s).startsWith("..");
}

export interface ClusterVolumesOptions {
  etcd: EtcdClient;
  store: SnapshotStore;
  nodeId: string;
  /** Where the volume lease's ID is kept, so a restart within its TTL takes it back with its claims. */
  leaseFile: string;
  log?: (line: string) => void;
}

const toShared = (e: VolumeEntry): SharedVolume => ({
  id: e.id, name: e.name, token: e.token, sizeMB: e.sizeMB, createdAt: e.createdAt, layers: e.layers, replay: e.replay, epoch: e.epoch,
});
const sameList = (a: string[], b: string[]) => a.length === b.length && a.every((x, i) => x === b[i]);
const leaseGone = (e: unknown) => e instanceof EtcdError && e.reason === "rejected" && /lease not found/i.test(e.message);

export class ClusterVolumes implements SharedVolumes {
  private current: string | undefined;
  private taking: Promise<string> | undefined;
  /** When etcd last confirmed the lease (performance.now()). */
  private confirmedAt = 0;
  private timer: ReturnType<typeof setTimeout> | undefined;
  private closed = false;
  private readonly digests = new DigestCache();

  constructor(private readonly o: ClusterVolumesOptions) {}

  /** Takes back the lease a previous run left (with its claims) or makes one; when etcd does not answer, the first claim does. */
  async start(): Promise<void> {
    await this.lease().catch((e) => this.o.log?.(`volumes: no volume lease yet: ${(e as Error).message}`));
  }

  /** Stops renewing: the lease lapses within its TTL unless a restart takes it back. */
  close(): void {
    this.closed = true;
    clearTimeout(this.timer);
  }

  // ─── the volume lease ──────────────────────────────────────────────────────

  private unconfirmed(): boolean {
    return performance.now() - this.confirmedAt > NODE_LEASE_TTL_S * 1000;
  }

  lapsed(claim: VolumeClaim): boolean {
    return claim.lease !== this.current || this.unconfirmed();
  }

  private lease(): Promise<string> {
    if (this.current && !this.unconfirmed()) return Promise.resolve(this.current);
    this.taking ??= this.takeLease().finally(() => (this.taking = undefined));
    return this.taking;
  }

  private async takeLease(): Promise<string> {
    if (this.current) {
      if ((await this.o.etcd.leaseKeepAlive(this.current)) > 0) {
        this.confirmedAt = performance.now();
        return this.current;
      }
      this.lost("expired");
    }
    const left = (await readFile(this.o.leaseFile, "utf8").catch(() => "")).trim();
    let lease: string;
    if (/^\d{1,20}$/.test(left) && (await this.o.etcd.leaseKeepAlive(left)) > 0) lease = left;
    else {
      lease = await this.o.etcd.leaseGrant(NODE_LEASE_TTL_S);
      await writeFile(`${this.o.leaseFile}.tmp`, `${lease}\n`, { mode: 0o600 });
      await rename(`${this.o.leaseFile}.tmp`, this.o.leaseFile);
    }
    this.current = lease;
    this.confirmedAt = performance.now();
    this.renewLater();
    return lease;
  }

  private lost(why: string): void {
    this.o.log?.(`volumes: volume lease ${this.current} ${why}: the claims on it lapsed`);
    this.current = undefined;
  }

  private renewLater(): void {
    clearTimeout(this.timer);
    if (this.closed) return;
    this.timer = setTimeout(() => void this.renew(), RENEW_MS);
    this.timer.unref?.();
  }

  private async renew(): Promise<void> {
    const lease = this.current;
    if (!lease || this.closed) return;
    try {
      if ((await this.o.etcd.leaseKeepAlive(lease)) <= 0) {
        if (this.current === lease) this.lost("expired");
        return; // the next claim takes a new one
      }
      if (this.current === lease) this.confirmedAt = performance.now();
    } catch (e) {
      if (this.unconfirmed()) this.o.log?.(`volumes: volume lease ${lease} not renewed for ${NODE_LEASE_TTL_S} s: ${(e as Error).message}`);
    }
    if (this.current === lease) this.renewLater();
  }

  // ─── records ───────────────────────────────────────────────────────────────

  /** `fn`, with etcd's failures as 503 (the caller may retry) and records that do not parse as 500. */
  private async etcd<T>(what: string, fn: () => Promise<T>): Promise<T> {
    try {
      return await fn();
    } catch (e) {
      if (e instanceof EtcdError) throw new OrchestratorError(503, `${what}: the cluster store (etcd) did not answer: ${e.message}`);
      throw e;
    }
  }

  async get(id: string): Promise<SharedVolume | undefined> {
    const kv = await this.etcd(`volume ${id}`, () => this.o.etcd.get(volumeKey(id)));
    return kv ? toShared(parseVolume(kv.value)) : undefined;
  }

  async byName(name: string): Promise<SharedVolume | undefined> {
    const kv = await this.etcd(`volume ${name}`, () => this.o.etcd.get(volumeNameKey(name)));
    return kv ? this.get(kv.value) : undefined;
  }

  async list(max: number): Promise<SharedVolume[]> {
    const { kvs } = await this.etcd("volumes", () => this.o.etcd.range(VOLUMES, { prefix: true, limit: max }));
    const out: SharedVolume[] = [];
    for (const kv of kvs) {
      try {
        out.push(toShared(parseVolume(kv.value)));
      } catch (e) {
        this.o.log?.(`volumes: ${kv.key}: ${(e as Error).message}; skipped`);
      }
    }
    return out;
  }

  async create(v: SharedVolume, bottom: string): Promise<void> {
    await this.putLayer(v.id, v.layers[0]!, bottom);
    const entry: VolumeEntry = { ...v, node: this.o.nodeId, at: Date.now() };
    const r = await this.etcd(`volume ${v.name}`, () => this.o.etcd.txn(
      [cmp.absent(volumeKey(v.id)), cmp.absent(volumeNameKey(v.name))],
      [op.put(volumeKey(v.id), JSON.stringify(entry)), op.put(volumeNameKey(v.name), v.id)],
    ));
    if (!r.succeeded) {
      await this.o.store.delete(layerStoreId(v.id, v.layers[0]!)).catch(() => false);
      throw new OrchestratorError(409, `a volume named ${v.name} exists`);
    }
  }

  // ─── claims ────────────────────────────────────────────────────────────────

  private holderValue(sandbox: string | null): string {
    return JSON.stringify({ node: this.o.nodeId, sandbox, at: Date.now() });
  }

  async claim(id: string, sandbox: string | null): Promise<{ claim: VolumeClaim; volume: SharedVolume } | { holder: SharedHolder } | undefined> {
    const hk = volumeHolderKey(id);
    const rk = volumeKey(id);
    for (let i = 0; i < CLAIM_TRIES; i++) {
      const lease = await this.etcd(`volume ${id}: the volume lease`, () => this.lease());
      let r;
      try {
        r = await this.o.etcd.txn([cmp.absent(hk), cmp.present(rk)], [op.put(hk, this.holderValue(sandbox), lease), op.get(rk), op.get(hk)], [op.get(rk), op.get(hk)]);
      } catch (e) {
        if (leaseGone(e)) {
          if (this.current === lease) this.lost("is gone");
          continue;
        }
        throw new OrchestratorError(503, `volume ${id}: the cluster store (etcd) did not answer: ${(e as Error).message}`);
      }
      const rec = r.gets[0]?.[0];
      if (!rec) return undefined;
      const volume = toShared(parseVolume(rec.value));
      const held = r.gets[1]?.[0];
      if (!held) continue; // let go between the compare and the read
      if (r.succeeded) return { claim: { fence: held.createRevision, lease, base: volume.layers, epoch: volume.epoch }, volume };
      const h = parseVolumeHolder(held.value);
      if (h.node === this.o.nodeId && held.lease === lease) {
        // This node's own claim that its row lost (a crash between the two): taken over as it is.
        const again = await this.etcd(`volume ${id}`, () => this.o.etcd.txn([cmp.createRevision(hk, held.createRevision)], [op.put(hk, this.holderValue(sandbox), lease)]));
        if (again.succeeded) return { claim: { fence: held.createRevision, lease, base: volume.layers, epoch: volume.epoch }, volume };
        continue;
      }
      return { holder: { node: h.node, sandbox: h.sandbox } };
    }
    throw new OrchestratorError(503, `volume ${id}: its holder kept changing; try again`);
  }

  async relabel(id: string, claim: VolumeClaim, sandbox: string | null): Promise<void> {
    const hk = volumeHolderKey(id);
    let ok = false;
    try {
      ok = (await this.o.etcd.txn([cmp.createRevision(hk, claim.fence)], [op.put(hk, this.holderValue(sandbox), claim.lease)])).succeeded;
    } catch (e) {
      if (!leaseGone(e)) throw new OrchestratorError(503, `volume ${id}: the cluster store (etcd) did not answer: ${(e as Error).message}`);
    }
    if (!ok) throw new ClaimLapsed(`this node's claim on volume ${id} lapsed (its volume lease expired)`);
  }

  async release(id: string, claim: VolumeClaim, layers: { digest: string; path: string }[], replay: boolean): Promise<void> {
    const hk = volumeHolderKey(id);
    const rk = volumeKey(id);
    const kv = await this.etcd(`volume ${id}`, () => this.o.etcd.get(rk));
    if (!kv) throw new ClaimLapsed(`volume ${id} was deleted meanwhile`);
    const rec = parseVolume(kv.value);
    const digests = layers.map((l) => l.digest);
    if (sameList(digests, claim.base) && sameList(digests, rec.layers) && rec.replay === replay) {
      // Nothing written: the claim just ends (one that lapsed has nothing to lose).
      await this.etcd(`volume ${rec.name}`, () => this.o.etcd.txn([cmp.createRevision(hk, claim.fence)], [op.del(hk)]));
      return;
    }
    const fresh: string[] = [];
    for (const l of layers) {
      if (rec.layers.includes(l.digest) || fresh.includes(l.digest)) continue;
      if (await this.putLayer(id, l.digest, l.path)) fresh.push(l.digest);
    }
    const next: VolumeEntry = { ...rec, layers: digests, replay, epoch: rec.epoch + 1, node: this.o.nodeId, at: Date.now() };
    const r = await this.etcd(`volume ${rec.name}`, () => this.o.etcd.txn(
      [cmp.createRevision(hk, claim.fence), cmp.modRevision(rk, kv.modRevision)],
      [op.put(rk, JSON.stringify(next)), op.del(hk)],
    ));
    if (!r.succeeded) {
      for (const d of fresh) await this.o.store.delete(layerStoreId(id, d)).catch(() => false);
      throw new ClaimLapsed(`this node's claim on volume ${rec.name} lapsed (its volume lease expired) before it published`);
    }
    // A commit's old layers: no record names them now.
    for (const d of rec.layers) {
      if (!digests.includes(d)) await this.o.store.delete(layerStoreId(id, d)).catch((e) => this.o.log?.(`volumes: ${rec.name}: old layer ${d} stays in the store: ${(e as Error).message}`));
    }
  }

  async destroy(id: string, claim: VolumeClaim): Promise<void> {
    const hk = volumeHolderKey(id);
    const rk = volumeKey(id);
    const kv = await this.etcd(`volume ${id}`, () => this.o.etcd.get(rk));
    if (!kv) throw new ClaimLapsed(`volume ${id} was deleted meanwhile`);
    const rec = parseVolume(kv.value);
    const r = await this.etcd(`volume ${rec.name}`, () => this.o.etcd.txn(
      [cmp.createRevision(hk, claim.fence), cmp.modRevision(rk, kv.modRevision)],
      [op.del(rk), op.del(volumeNameKey(rec.name)), op.del(hk)],
    ));
    if (!r.succeeded) throw new ClaimLapsed(`this node's claim on volume ${rec.name} lapsed (its volume lease expired)`);
    // Its layers: those its record named, and any a publish cut short left.
    const prefix = `${VOLUME_LAYER_STORE_PREFIX}${id}.`;
    const ids = await this.o.store.list().then((all) => all.filter((x) => x.startsWith(prefix)), () => rec.layers.map((d) => layerStoreId(id, d)));
    for (const x of ids) await this.o.store.delete(x).catch((e) => this.o.log?.(`volumes: ${rec.name}: layer ${x} stays in the store: ${(e as Error).message}`));
  }

  // ─── layers ────────────────────────────────────────────────────────────────

  async digest(path: string): Promise<string> {
    const st = await stat(path);
    const key = DigestCache.key(st);
    const known = this.digests.get(key);
    if (known) return known;
    const { sha256 } = await sha256File(path, new Deadline(`hash of ${path}`, DEFAULT_LIMITS, st.size));
    this.digests.set(key, sha256);
    return sha256;
  }

  /** Layer `sha256` of volume `id` into the store (its bytes once, by content): true when this put made it, false when it was there. */
  private async putLayer(id: string, sha256: string, path: string): Promise<boolean> {
    try {
      const r = await this.o.store.put(layerStoreId(id, sha256), [{ name: LAYER, path, shared: true }], { volume: id, sha256 });
      if (r.files[LAYER]?.sha256 !== sha256) {
        await this.o.store.delete(layerStoreId(id, sha256)).catch(() => false);
        throw new OrchestratorError(500, `volume ${id}: layer ${path} is not what was sealed (sha256 ${r.files[LAYER]?.sha256}, not ${sha256})`);
      }
      return true;
    } catch (e) {
      if (e instanceof SnapshotStoreError && e.code === "Exists") return false;
      if (e instanceof SnapshotStoreError) throw new OrchestratorError(503, `volume ${id}: the shared store did not take layer ${sha256}: ${e.message}`);
      throw e;
    }
  }

  async fetchLayer(id: string, sha256: string, dest: string): Promise<void> {
    let from: string;
    let size: number;
    try {
      const m = await this.o.store.get(layerStoreId(id, sha256));
      from = m.paths[LAYER]!;
      size = m.record.files[LAYER]?.size ?? 0;
    } catch (e) {
      if (e instanceof SnapshotStoreError && e.code === "NotFound") throw new OrchestratorError(500, `volume ${id}: its layer ${sha256} is not in the shared store ${this.o.store.location}`);
      if (e instanceof SnapshotStoreError) throw new OrchestratorError(503, `volume ${id}: the shared store did not give layer ${sha256}: ${e.message}`);
      throw e;
    }
    const part = `${dest}.part`;
    const got = await copySparse(from, part, new Deadline(`volume ${id}: fetch of layer ${sha256}`, DEFAULT_LIMITS, size), { hash: true });
    if (got !== sha256) {
      await rm(part, { force: true });
      throw new OrchestratorError(500, `volume ${id}: layer ${sha256} from the shared store has sha256 ${got}`);
    }
    await rename(part, dest);
  }
}
