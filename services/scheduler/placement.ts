// Placement: best-of-K over the live nodes, scored on free memory, CPU, sandbox slots and disk,
// plus a cache bonus for the bytes of the template's layers a node already holds. Never a hard
// cache filter: a new empty node still wins when the holders are full. Draining and cordoned nodes
// get nothing. Reservations (creates in flight, from every gateway) count as used, so two gateways
// placing at once see each other's creates.
import type { NodeRecord, Reservation } from "../../src/cluster/records.ts";

/** Nodes sampled per placement (E2B's best-of-K uses 3): the best of them leads, the rest follow as fallbacks. */
export const BEST_OF_K = 3;
/** A node is not given a sandbox that would leave it less free disk than this. */
export const MIN_DISK_FREE_MB = 2048;
/** Weight of the cache bonus against a score in 0..1 per resource (4 resources): a full cache hit outweighs one resource's headroom. */
export const CACHE_WEIGHT = 1.5;

export interface Need {
  /** Template or snapshot reference as the create names it (ID or alias). */
  template: string;
  cpus: number;
  memoryMB: number;
  /** The template's image layers when the cluster published it: a node that holds some of them gets their bytes as its bonus. */
  layers?: { digest: string; size: number }[];
}

/** Bytes of `need`'s template a node holds: its own count for the template, or the published layers it serves, whichever is more. */
export function cachedBytes(n: NodeRecord, need: Need): number {
  const own = n.cached[need.template] ?? 0;
  if (!need.layers?.length || !n.layers?.length) return own;
  const held = new Set(n.layers);
  return Math.max(own, need.layers.reduce((sum, l) => sum + (held.has(l.digest) ? l.size : 0), 0));
}

export interface PlacementOptions {
  k?: number;
  /** 0 turns the cache bonus off (bench/cluster compares both). */
  cacheWeight?: number;
  random?: () => number;
}

export interface Scored {
  node: NodeRecord;
  score: number;
  cacheBytes: number;
}

/** What a node has left once its reservations count. */
export function headroom(n: NodeRecord, held: Reservation[]) {
  const cpus = held.reduce((s, r) => s + r.cpus, 0);
  const mem = held.reduce((s, r) => s + r.memoryMB, 0);
  return {
    slots: n.capacity.maxSandboxes - n.used.sandboxes - held.length,
    memoryMB: n.capacity.memoryMB - n.used.memoryMB - mem,
    cpus: n.capacity.cpus - n.used.cpus - cpus,
    diskMB: n.capacity.diskFreeMB,
  };
}

/** Whether `n` can take `need` at all: ready, a free slot, disk above the floor. Memory and CPU overcommit, so they only score. */
export function eligible(n: NodeRecord, held: Reservation[]): boolean {
  if (n.status !== "ready") return false;
  const h = headroom(n, held);
  return h.slots > 0 && h.diskMB >= MIN_DISK_FREE_MB;
}

/** A node's score for `need` (higher is better); cacheBytes is what the bonus counted. */
export function score(n: NodeRecord, held: Reservation[], need: Need, maxCache: number, cacheWeight: number): Scored {
  const h = headroom(n, held);
  const frac = (left: number, total: number) => (total > 0 ? Math.max(0, Math.min(1, left / total)) : 0);
  const cacheBytes = cachedBytes(n, need);
  const s =
    frac(h.memoryMB - need.memoryMB, n.capacity.memoryMB) +
    frac(h.cpus - need.cpus, n.capacity.cpus * 4) + // vCPUs overcommit 4:1 before this term reaches 0
    frac(h.slots - 1, n.capacity.maxSandboxes) +
    Math.min(1, h.diskMB / (256 * 1024)) + // 256 GiB free and up score the same
    (maxCache > 0 ? cacheWeight * (cacheBytes / maxCache) : 0);
  return { node: n, score: s, cacheBytes };
}

/**
 * Candidates for `need`, best first: the best of K sampled eligible nodes leads (and the rest of
 * the sample after it, by score), then every other eligible node by score, so a create that a
 * node refuses moves on without asking the scheduler again.
 */
export function rank(nodes: NodeRecord[], reservations: Map<string, Reservation[]>, need: Need, o: PlacementOptions = {}): Scored[] {
  const k = o.k ?? BEST_OF_K;
  const random = o.random ?? Math.random;
  const weight = o.cacheWeight ?? CACHE_WEIGHT;
  const ok = nodes.filter((n) => eligible(n, reservations.get(n.id) ?? []));
  const maxCache = ok.reduce((m, n) => Math.max(m, cachedBytes(n, need)), 0);
  const scored = ok.map((n) => score(n, reservations.get(n.id) ?? [], need, maxCache, weight));
  // Fisher–Yates over the first k positions: a uniform sample without replacement.
  for (let i = 0; i < Math.min(k, scored.length); i++) {
    const j = i + Math.floor(random() * (scored.length - i));
    [scored[i], scored[j]] = [scored[j]!, scored[i]!];
  }
  const byScore = (a: Scored, b: Scored) => b.score - a.score || a.node.id.localeCompare(b.node.id);
  const sample = scored.slice(0, k).sort(byScore);
  const rest = scored.slice(k).sort(byScore);
  return [...sample, ...rest];
}
