// Devices nobody holds (docs/node.md, Resource bounds): blockd's list against what the node says it
// holds. A device unheld in two listings at least the grace apart, each taken with no acquire in
// flight, is an orphan: a leak of ours or an acquire whose answer never arrived. It goes back and
// is counted, so a future leak is both visible (aenv_orphans_reclaimed_total) and bounded.

/** A device as blockd's `list` describes it (the fields the node reads). */
export interface ListedDevice {
  id: string;
  kind: string;
  path: string;
  readOnly: boolean;
  acquired?: boolean;
  refs: number;
  config?: { lowers?: unknown[]; upper?: { data?: string } } | null;
}

/** How long a device must stay unheld before it is reclaimed: past an acquire's answer and its record (milliseconds). */
export const ORPHAN_GRACE_MS = 10_000;
/** Devices remembered as unheld at once, at most (blockd's own table is smaller). */
const ORPHANS_TRACKED_MAX = 4096;

/** Who holds a device, or why nobody needs to: blockd's own pool, or a template conversion's writable device. */
export function ownedByBlockd(d: ListedDevice): string | undefined {
  if (d.kind === "pool" && !d.acquired) return d.config ? "blockd: prepared" : "blockd: pool";
  if (d.kind === "rw") return "blockd create: a template conversion";
  return undefined;
}

export class OrphanSweep {
  /** Unheld devices by id: when first seen unheld in a quiet listing. */
  private readonly since = new Map<string, number>();
  /** Devices given back as orphans since the node started. */
  reclaimed = 0;

  /**
   * The devices to reclaim now, from a listing and the holders read after it. `quiet`: no acquire
   * was in flight while the listing was taken (else nothing is picked, and nothing is learnt).
   */
  pick(devices: ListedDevice[], held: (d: ListedDevice) => boolean, quiet: boolean, now: number, graceMs: number): ListedDevice[] {
    if (!quiet) return [];
    const unheld = devices.filter((d) => !ownedByBlockd(d) && !held(d));
    const ids = new Set(unheld.map((d) => d.id));
    for (const id of this.since.keys()) if (!ids.has(id)) this.since.delete(id);
    const out: ListedDevice[] = [];
    for (const d of unheld) {
      const first = this.since.get(d.id);
      if (first === undefined) {
        if (this.since.size < ORPHANS_TRACKED_MAX) this.since.set(d.id, now);
        if (graceMs > 0) continue;
      } else if (now - first < graceMs) continue;
      out.push(d);
    }
    return out;
  }

  /** `id` was given back (or is gone): forgotten. */
  done(id: string): void {
    this.since.delete(id);
  }
}
