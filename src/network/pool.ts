// SlotPool: keeps `size` slots built and ready so a sandbox start only takes one; refills in the
// background one slot per event-loop turn so the loop is never blocked for long.

import { existsSync } from "node:fs";
import { NETNS_DIR, resolveConfig, slotFor, slotIdOf, slotName, type NetworkConfig, type NetworkConfigInput, type Slot } from "./addressing.ts";
import { NetworkError } from "./command.ts";
import {
  applyHostTable,
  checkHostCidrFree,
  createSlot,
  linkExists,
  listOurs,
  netnsPids,
  removeHostTable,
  removeSlotByName,
  scrubSlot,
} from "./slot.ts";

export interface SlotPoolOptions extends NetworkConfigInput {
  /** Ready slots to keep built; released slots beyond this are destroyed. Default 2. */
  size?: number;
}

export interface ReconcileReport {
  /** Our names (namespaces / host veths) found and removed. */
  removed: string[];
  /** Slots kept because the caller re-adopted their sandboxes; they count as leased. */
  adopted: Slot[];
  /** Removed namespaces that still had processes (orphan VMMs the caller may want to kill). */
  orphanPids: Record<string, number[]>;
  /** Host links with one of our names that are not veths: left alone, and their slot numbers unused. */
  skipped: string[];
}

export interface PoolStats {
  size: number;
  ready: number;
  leased: number;
}

export class SlotPool {
  readonly config: NetworkConfig;
  readonly size: number;
  private readonly ready: Slot[] = [];
  private readonly leased = new Map<number, Slot>();
  private state: "new" | "started" | "destroyed" = "new";
  private refillTimer: ReturnType<typeof setTimeout> | undefined;
  private reconciled: ReconcileReport | undefined;
  /** Slot numbers whose names something else already uses on this host. */
  private readonly blockedIds = new Set<number>();
  /** The last background refill failure; acquire() still builds on demand and throws its own. */
  lastRefillError: Error | undefined;

  constructor(opts: SlotPoolOptions = {}) {
    this.config = resolveConfig(opts);
    this.size = opts.size ?? 2;
    if (!Number.isInteger(this.size) || this.size < 0) throw new NetworkError("BadConfig", `size must be a whole number ≥ 0: ${opts.size}`);
  }

  /**
   * Remove everything with our prefix left by an earlier run (a crash), except the slots named in
   * `adopt` (sandboxes whose VMMs outlived the node), which become leased slots of this pool.
   * Never touches a namespace or interface whose name is not `${prefix}<n>`.
   */
  reconcile(opts: { adopt?: Iterable<string> } = {}): ReconcileReport {
    if (this.state !== "new" || this.reconciled) throw new NetworkError("BadState", "reconcile() runs once, before start() hands out slots");
    const adoptNames = new Set(opts.adopt ?? []);
    const { netns, links } = listOurs(this.config);
    const report: ReconcileReport = { removed: [], adopted: [], orphanPids: {}, skipped: [] };
    for (const name of new Set([...netns, ...links])) {
      const complete = netns.includes(name) && links.includes(name);
      if (adoptNames.has(name) && complete) {
        const slot = slotFor(this.config, slotIdOf(this.config, name)!);
        this.leased.set(slot.id, slot);
        report.adopted.push(slot);
        continue;
      }
      const pids = netns.includes(name) ? netnsPids(name) : [];
      try {
        removeSlotByName(this.config, name);
      } catch (e) {
        if (!(e instanceof NetworkError && e.code === "NotOurs")) throw e;
        report.skipped.push(name);
        this.blockedIds.add(slotIdOf(this.config, name)!);
        continue;
      }
      if (pids.length > 0) report.orphanPids[name] = pids;
      report.removed.push(name);
    }
    // With adopted slots the old table keeps guarding them until start() replaces it atomically.
    if (report.adopted.length === 0) removeHostTable(this.config);
    this.reconciled = report;
    return report;
  }

  /** Reconcile (unless already done), install the host table and build `size` ready slots. */
  async start(opts: { adopt?: Iterable<string> } = {}): Promise<ReconcileReport> {
    if (this.state !== "new") throw new NetworkError("BadState", `start() on a ${this.state} pool`);
    const report = this.reconciled ?? this.reconcile(opts);
    checkHostCidrFree(this.config);
    applyHostTable(this.config);
    this.state = "started";
    while (this.ready.length < this.size) {
      this.ready.push(createSlot(this.config, this.freeId()));
      await Bun.sleep(0);
    }
    return report;
  }

  /** A ready slot (built on the spot when none is ready); the pool refills in the background. */
  async acquire(): Promise<Slot> {
    this.mustBeStarted();
    const slot = this.ready.shift() ?? createSlot(this.config, this.freeId());
    this.leased.set(slot.id, slot);
    this.scheduleRefill();
    return slot;
  }

  /**
   * Give a slot back. Stop its VMM first: a namespace with processes in it is refused (SlotBusy)
   * and stays leased. Otherwise it is scrubbed and kept ready, or removed when `size` are ready;
   * if scrubbing fails the slot is removed and the error thrown.
   */
  async release(slot: Slot): Promise<void> {
    this.mustBeStarted();
    const own = this.leased.get(slot.id);
    if (!own || own.netns !== slot.netns) throw new NetworkError("NotLeased", `slot ${slot.netns} is not leased from this pool`);
    if (this.ready.length >= this.size) {
      const pids = netnsPids(own.netns);
      if (pids.length > 0) throw new NetworkError("SlotBusy", `namespace ${own.netns} still has processes ${pids.join(",")}; stop the VMM before releasing`);
      this.leased.delete(own.id);
      removeSlotByName(this.config, own.netns);
      return;
    }
    try {
      scrubSlot(this.config, own);
    } catch (e) {
      if (e instanceof NetworkError && e.code === "SlotBusy") throw e;
      this.leased.delete(own.id);
      removeSlotByName(this.config, own.netns);
      throw e;
    }
    this.leased.delete(own.id);
    this.ready.push(own);
  }

  /** Remove every slot this pool holds (ready and leased) and the host table. */
  async destroy(): Promise<void> {
    if (this.state === "destroyed") return;
    this.state = "destroyed";
    if (this.refillTimer) clearTimeout(this.refillTimer);
    this.refillTimer = undefined;
    const errors: Error[] = [];
    for (const slot of [...this.ready, ...this.leased.values()]) {
      try {
        removeSlotByName(this.config, slot.netns);
      } catch (e) {
        errors.push(e as Error);
      }
    }
    this.ready.length = 0;
    this.leased.clear();
    try {
      removeHostTable(this.config);
    } catch (e) {
      errors.push(e as Error);
    }
    if (errors.length > 0) throw new NetworkError("DestroyIncomplete", errors.map((e) => e.message).join("; "));
  }

  /** Resolves once `size` slots are ready; throws the background refill's error if it stopped. */
  async whenFilled(timeoutMs = 30_000): Promise<void> {
    const until = Date.now() + timeoutMs;
    while (this.state === "started" && this.ready.length < this.size) {
      if (this.lastRefillError) throw this.lastRefillError;
      if (Date.now() > until) throw new NetworkError("Timeout", `pool not filled after ${timeoutMs} ms (${this.ready.length}/${this.size})`);
      this.scheduleRefill();
      await Bun.sleep(10);
    }
  }

  stats(): PoolStats {
    return { size: this.size, ready: this.ready.length, leased: this.leased.size };
  }

  private mustBeStarted(): void {
    if (this.state !== "started") throw new NetworkError("BadState", `pool is ${this.state}; call start() first`);
  }

  private freeId(): number {
    const used = new Set<number>([...this.blockedIds, ...this.leased.keys(), ...this.ready.map((s) => s.id)]);
    for (let id = 0; id < this.config.maxSlots; id++) {
      if (used.has(id)) continue;
      // Something not tracked by this pool already holds the name: leave it be.
      const name = slotName(this.config, id);
      if (linkExists(name) || existsSync(`${NETNS_DIR}/${name}`)) continue;
      return id;
    }
    throw new NetworkError("Exhausted", `all ${this.config.maxSlots} slots are in use`);
  }

  private scheduleRefill(): void {
    if (this.refillTimer || this.state !== "started" || this.ready.length >= this.size) return;
    this.refillTimer = setTimeout(() => {
      this.refillTimer = undefined;
      if (this.state !== "started" || this.ready.length >= this.size) return;
      try {
        this.ready.push(createSlot(this.config, this.freeId()));
        this.lastRefillError = undefined;
      } catch (e) {
        // Stop refilling; the next acquire() builds on demand and reports the cause itself.
        this.lastRefillError = e as Error;
        return;
      }
      this.scheduleRefill();
    }, 0);
    // A pending refill must not keep a finished process alive.
    (this.refillTimer as { unref?: () => void }).unref?.();
  }
}
