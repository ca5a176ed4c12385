// Reservations: a create in flight toward a node, written to `reservations/{node}` by compare-and-
// swap before the gateway forwards it, so every gateway counts every other's creates. A reservation
// that would take the node's last slot is refused here, before the node is asked; it is dropped
// when the create answers, or after RESERVATION_TTL_MS if its gateway died.
import { EtcdClient, cmp, op } from "../../src/cluster/etcd_client.ts";
import { parseReservations, reservationsKey, type NodeRecord, type Reservation } from "../../src/cluster/records.ts";
import { headroom } from "./placement.ts";

/** A reservation counts this long at most (a create through TCG takes seconds; a stuck one must not hold a slot). */
export const RESERVATION_TTL_MS = 60_000;
/** Reservations one node's key holds at most (the node's own bound on sandboxes is far lower). */
const MAX_PER_NODE = 4096;
/** Compare-and-swap retries against other gateways before the reservation is given up. */
const CAS_TRIES = 8;

export class ReservationError extends Error {
  override name = "ReservationError";
}

export class Reservations {
  constructor(private readonly etcd: EtcdClient) {}

  /** The live reservations of every node (one range). */
  async all(): Promise<Map<string, Reservation[]>> {
    const { kvs } = await this.etcd.range(reservationsKey(""), { prefix: true, serializable: true });
    const now = Date.now();
    const out = new Map<string, Reservation[]>();
    for (const kv of kvs) {
      const node = kv.key.slice(reservationsKey("").length);
      try {
        out.set(node, parseReservations(kv.value).filter((r) => r.until > now));
      } catch { /* unreadable: counts nothing, rewritten by the next reserve */ }
    }
    return out;
  }

  /**
   * Reserves a slot on `node` for `r`: false when the node has none left (its record's count plus
   * the live reservations), true once the reservation is written.
   */
  async reserve(node: NodeRecord, r: Omit<Reservation, "until">): Promise<boolean> {
    const key = reservationsKey(node.id);
    for (let i = 0; i < CAS_TRIES; i++) {
      const kv = await this.etcd.get(key);
      const now = Date.now();
      let held: Reservation[] = [];
      try {
        held = kv ? parseReservations(kv.value).filter((x) => x.until > now) : [];
      } catch { /* rewritten below */ }
      if (headroom(node, held).slots <= 0 || held.length >= MAX_PER_NODE) return false;
      const next = JSON.stringify([...held, { ...r, until: now + RESERVATION_TTL_MS }]);
      const t = await this.etcd.txn([kv ? cmp.modRevision(key, kv.modRevision) : cmp.absent(key)], [op.put(key, next)]);
      if (t.succeeded) return true;
    }
    throw new ReservationError(`node ${node.id}: reservations kept changing under ${CAS_TRIES} tries`);
  }

  /** Drops reservation `id` of `node` (best effort: an expired one counts nothing anyway). */
  async release(nodeId: string, id: string): Promise<void> {
    const key = reservationsKey(nodeId);
    for (let i = 0; i < CAS_TRIES; i++) {
      const kv = await this.etcd.get(key);
      if (!kv) return;
      const now = Date.now();
      let held: Reservation[] = [];
      try {
        held = parseReservations(kv.value);
      } catch { /* rewritten */ }
      const next = held.filter((x) => x.id !== id && x.until > now);
      const t = await this.etcd.txn([cmp.modRevision(key, kv.modRevision)], [next.length ? op.put(key, JSON.stringify(next)) : op.del(key)]);
      if (t.succeeded) return;
    }
  }
}
