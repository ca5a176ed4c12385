// SlotPool: keeps `size` slots built and ready so a sandbox start only takes one; refills in the
// background (one slot at a time, retried with backoff after a failure). Every slot number is in
// exactly one of ready, leased or busy (being built, scrubbed or removed), so two callers never
// get the same slot, and acquire() waits a bounded time for one when all are in use.

import { resolveConfig, slotFor, slotIdOf, type NetworkConfig, type NetworkConfigInput, type Slot } from "./addressing.ts";
import { NetworkError } from "./command.ts";
import {
  applyHostTable,
  assertNoProcesses,
  checkHostCidrFree,
  createSlot,
  listOurs,
  netnsPids,
  removeHostTable,
  removeSlotByName,
  scrubSlot,
  slotNamesTaken,
} from "./slot.ts";

export interface SlotPoolOptions extends NetworkConfigInput {
  /** Ready slots to keep built; released slots beyond this are destroyed. Default 2. */
  size?: number;
  /** How long acquire() waits for a slot while all `maxSlots` are in use, then Exhausted. Default 10 s. */
  acquireTimeoutMs?: number;
  /** Told of every background refill failure; the refill retries with backoff either way. */
  onRefillError?: (e: Error) => void;
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

export const DEFAULT_ACQUIRE_TIMEOUT_MS = 10_000;
/** Callers waiting in acquire() at once; more are refused (Exhausted) rather than queued. */
export const MAX_WAITERS = 256;
/** Refill backoff after a failure: doubles from the first to the last figure. */
export const REFILL_BACKOFF_MS = [100, 5_000] as const;

export class SlotPool {
  readonly config: NetworkConfig;
  readonly size: number;
  readonly acquireTimeoutMs: number;
  private readonly ready: Slot[] = [];
  private readonly leased = new Map<number, Slot>();
  /** Slot numbers being built, scrubbed or removed: neither ready nor leased, never handed out. */
  private readonly busy = new Set<number>();
  /** Builds, releases and refills under way; destroy() waits for them. */
  private readonly inflight = new Set<Promise<unknown>>();
  private waiters: (() => void)[] = [];
  private state: "new" | "started" | "destroyed" = "new";
  private refillTimer: ReturnType<typeof setTimeout> | undefined;
  private refilling = false;
  private refillBackoffMs = 0;
  private reconciled: ReconcileReport | undefined;
  /** Slot numbers whose names something else already uses on this host. */
  private readonly blockedIds = new Set<number>();
  /** The last background refill failure, cleared by the next success. */
  lastRefillError: Error | undefined;

  constructor(private readonly opts: SlotPoolOptions = {}) {
    this.config = resolveConfig(opts);
    this.size = opts.size ?? 2;
    if (!Number.isInteger(this.size) || this.size < 0) throw new NetworkError("BadConfig", `size must be a whole number ≥ 0: ${opts.size}`);
    this.acquireTimeoutMs = opts.acquireTimeoutMs ?? DEFAULT_ACQUIRE_TIMEOUT_MS;
    if (!(this.acquireTimeoutMs >= 0)) throw new NetworkError("BadConfig", `acquireTimeoutMs must be ≥ 0: ${opts.acquireTimeoutMs}`);
  }

  /**
   * Remove everything with our prefix left by an earlier run (a crash), except the slots named in
   * `adopt` (sandboxes whose VMMs outlived the node), which become leased slots of this pool.
   * Never touches a namespace or interface whose name is not `${prefix}<n>`.
   */
  async reconcile(opts: { adopt?: Iterable<string> } = {}): Promise<ReconcileReport> {
    if (this.state !== "new" || this.reconciled) throw new NetworkError("BadState", "reconcile() runs once, before start() hands out slots");
    const report: ReconcileReport = { removed: [], adopted: [], orphanPids: {}, skipped: [] };
    // Set before the first await so a concurrent call is refused; undone if this one fails.
    this.reconciled = report;
    try {
      await this.reconcileInto(report, new Set(opts.adopt ?? []));
    } catch (e) {
      this.reconciled = undefined;
      for (const s of report.adopted) this.leased.delete(s.id);
      for (const name of report.skipped) this.blockedIds.delete(slotIdOf(this.config, name)!);
      throw e;
    }
    return report;
  }

  private async reconcileInto(report: ReconcileReport, adoptNames: Set<string>): Promise<void> {
    const { netns, links } = await listOurs(this.config);
    for (const name of new Set([...netns, ...links])) {
      const complete = netns.includes(name) && links.includes(name);
      if (adoptNames.has(name) && complete) {
        const slot = slotFor(this.config, slotIdOf(this.config, name)!);
        this.leased.set(slot.id, slot);
        report.adopted.push(slot);
        continue;
      }
      const pids = netns.includes(name) ? await netnsPids(name) : [];
      try {
        await removeSlotByName(this.config, name);
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
    if (report.adopted.length === 0) await removeHostTable(this.config);
  }

  /**
   * Reconcile (unless already done), install the host table and build `size` ready slots. On a
   * failure the slots it built are removed again and the pool stays unstarted.
   */
  async start(opts: { adopt?: Iterable<string> } = {}): Promise<ReconcileReport> {
    if (this.state !== "new") throw new NetworkError("BadState", `start() on a ${this.state} pool`);
    const report = this.reconciled ?? (await this.reconcile(opts));
    await checkHostCidrFree(this.config);
    await applyHostTable(this.config);
    this.state = "started";
    try {
      while (this.ready.length < this.size) {
        const id = await this.reserveId();
        if (id === undefined) throw new NetworkError("Exhausted", `only ${this.ready.length} of ${this.size} slots fit in ${this.config.maxSlots}`);
        try {
          this.ready.push(await this.track(this.build(id)));
        } finally {
          this.busy.delete(id);
        }
      }
    } catch (e) {
      if (this.state === "started") {
        this.state = "new";
        for (const s of this.ready.splice(0)) await removeSlotByName(this.config, s.netns).catch(() => {});
        if (report.adopted.length === 0) await removeHostTable(this.config).catch(() => {});
      }
      throw e;
    }
    return report;
  }

  /**
   * A ready slot, or one built on the spot when none is ready. While every slot number is in use
   * it waits up to acquireTimeoutMs for a release, then throws Exhausted. The pool refills behind.
   */
  async acquire(): Promise<Slot> {
    this.mustBeStarted();
    const until = Date.now() + this.acquireTimeoutMs;
    for (;;) {
      const ready = this.ready.shift();
      if (ready) {
        this.leased.set(ready.id, ready);
        this.scheduleRefill();
        return ready;
      }
      const id = await this.reserveId();
      if (this.state !== "started" && id !== undefined) this.busy.delete(id);
      this.mustBeStarted();
      if (id !== undefined) {
        let slot: Slot;
        try {
          slot = await this.track(this.build(id));
        } catch (e) {
          this.busy.delete(id);
          this.notify();
          throw e;
        }
        // Leased and unreserved in one step: no other caller can see the number free in between.
        this.leased.set(id, slot);
        this.busy.delete(id);
        this.scheduleRefill();
        return slot;
      }
      const left = until - Date.now();
      if (left <= 0 || this.waiters.length >= MAX_WAITERS) {
        throw new NetworkError("Exhausted", `all ${this.config.maxSlots} slots are in use (${this.leased.size} leased, ${this.busy.size} being built or recycled); none came free within ${this.acquireTimeoutMs} ms`);
      }
      await this.nextChange(left);
      this.mustBeStarted();
    }
  }

  /**
   * Give a slot back. Stop its VMM first: a namespace with processes in it is refused (SlotBusy)
   * and stays leased. Otherwise it is scrubbed and kept ready, or removed when `size` are ready;
   * if scrubbing fails the slot is removed (never handed out half-clean) and the error thrown.
   */
  async release(slot: Slot): Promise<void> {
    this.mustBeStarted();
    const own = this.leased.get(slot.id);
    if (!own || own.netns !== slot.netns) throw new NetworkError("NotLeased", `slot ${slot.netns} is not leased from this pool`);
    // Out of leased before the first await, so a second release() of it is NotLeased.
    this.leased.delete(own.id);
    this.busy.add(own.id);
    try {
      await this.track(this.recycle(own));
    } finally {
      this.busy.delete(own.id);
      this.notify();
      this.scheduleRefill();
    }
  }

  private async recycle(own: Slot): Promise<void> {
    try {
      await assertNoProcesses(own);
    } catch (e) {
      // Still the caller's (and, if the pool is being destroyed, removed with the other leases).
      this.leased.set(own.id, own);
      throw e;
    }
    if (this.state !== "started" || this.ready.length >= this.size) {
      await removeSlotByName(this.config, own.netns);
      return;
    }
    try {
      await scrubSlot(this.config, own);
    } catch (e) {
      await removeSlotByName(this.config, own.netns).catch(() => {});
      throw e;
    }
    if (this.state === "started" && this.ready.length < this.size) this.ready.push(own);
    else await removeSlotByName(this.config, own.netns);
  }

  /** Remove every slot this pool holds (ready and leased) and the host table. */
  async destroy(): Promise<void> {
    if (this.state === "destroyed") return;
    this.state = "destroyed";
    if (this.refillTimer) clearTimeout(this.refillTimer);
    this.refillTimer = undefined;
    this.notify();
    // Builds and releases under way finish first; each removes its own slot once it sees "destroyed".
    await Promise.allSettled([...this.inflight]);
    const errors: Error[] = [];
    for (const slot of [...this.ready, ...this.leased.values()]) {
      try {
        await removeSlotByName(this.config, slot.netns);
      } catch (e) {
        errors.push(e as Error);
      }
    }
    this.ready.length = 0;
    this.leased.clear();
    try {
      await removeHostTable(this.config);
    } catch (e) {
      errors.push(e as Error);
    }
    if (errors.length > 0) throw new NetworkError("DestroyIncomplete", errors.map((e) => e.message).join("; "));
  }

  /** Resolves once `size` slots are ready; Timeout (naming the last refill failure) after timeoutMs. */
  async whenFilled(timeoutMs = 30_000): Promise<void> {
    const until = Date.now() + timeoutMs;
    while (this.state === "started" && this.ready.length < this.size) {
      const left = until - Date.now();
      if (left <= 0) {
        const why = this.lastRefillError ? `; last refill failure: ${this.lastRefillError.message}` : "";
        throw new NetworkError("Timeout", `pool not filled after ${timeoutMs} ms (${this.ready.length}/${this.size})${why}`);
      }
      this.scheduleRefill();
      await this.nextChange(left);
    }
  }

  stats(): PoolStats {
    return { size: this.size, ready: this.ready.length, leased: this.leased.size };
  }

  private mustBeStarted(): void {
    if (this.state !== "started") throw new NetworkError("BadState", `pool is ${this.state}; call start() first`);
  }

  /** Build slot `id` (reserved by the caller); if the pool was destroyed meanwhile, remove it again. */
  private async build(id: number): Promise<Slot> {
    const slot = await createSlot(this.config, id);
    if (this.state === "destroyed") {
      await removeSlotByName(this.config, slot.netns).catch(() => {});
      throw new NetworkError("BadState", "pool was destroyed while a slot was being built");
    }
    return slot;
  }

  /**
   * Reserve the lowest free slot number (in `busy`, before any await, so a racing caller skips
   * it); undefined when every number is in use. The caller moves it out of `busy`.
   */
  private async reserveId(): Promise<number | undefined> {
    for (let id = 0; id < this.config.maxSlots; id++) {
      if (this.blockedIds.has(id) || this.busy.has(id) || this.leased.has(id) || this.ready.some((s) => s.id === id)) continue;
      this.busy.add(id);
      // Something this pool does not track already holds the name: leave it be.
      if (!(await slotNamesTaken(this.config, id))) return id;
      this.busy.delete(id);
    }
    return undefined;
  }

  private track<T>(p: Promise<T>): Promise<T> {
    this.inflight.add(p);
    const done = () => void this.inflight.delete(p);
    p.then(done, done);
    return p;
  }

  /** Resolves at the next change of ready/busy/state, or after ms. */
  private nextChange(ms: number): Promise<void> {
    return new Promise((resolve) => {
      const wake = () => {
        clearTimeout(timer);
        this.waiters = this.waiters.filter((w) => w !== wake);
        resolve();
      };
      const timer = setTimeout(wake, ms);
      this.waiters.push(wake);
    });
  }

  private notify(): void {
    for (const wake of this.waiters.splice(0)) wake();
  }

  private scheduleRefill(delayMs = 0): void {
    if (this.refillTimer || this.refilling || this.state !== "started" || this.ready.length >= this.size) return;
    this.refillTimer = setTimeout(() => {
      this.refillTimer = undefined;
      void this.track(this.refillOne());
    }, delayMs);
    // A pending refill must not keep a finished process alive.
    (this.refillTimer as { unref?: () => void }).unref?.();
  }

  /** Build one ready slot; on failure report it and try again after a growing pause. */
  private async refillOne(): Promise<void> {
    if (this.refilling || this.state !== "started" || this.ready.length >= this.size) return;
    this.refilling = true;
    let failed = false;
    try {
      // undefined: every number is in use; release() schedules the next refill.
      const id = await this.reserveId();
      if (id === undefined) return;
      try {
        const slot = await this.build(id);
        this.lastRefillError = undefined;
        this.refillBackoffMs = 0;
        // A release may have filled the pool meanwhile: never more than `size` ready.
        if (this.ready.length < this.size) this.ready.push(slot);
        else await removeSlotByName(this.config, slot.netns);
      } finally {
        this.busy.delete(id);
      }
    } catch (e) {
      if (this.state !== "started") return;
      failed = true;
      this.lastRefillError = e as Error;
      this.refillBackoffMs = Math.min(REFILL_BACKOFF_MS[1], Math.max(REFILL_BACKOFF_MS[0], this.refillBackoffMs * 2));
      try {
        this.opts.onRefillError?.(e as Error);
      } catch {}
    } finally {
      this.refilling = false;
      this.notify();
      this.scheduleRefill(failed ? this.refillBackoffMs : 0);
    }
  }
}
