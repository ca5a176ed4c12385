// The node's memory devices (docs/vmm.md, "Memory layers"): one blockd read-only device per memory
// stack, shared by every VM restored from it. The node takes it from blockd's pool (`acquire`
// without an upper: 2–7 ms, against 24–34 ms for a `createReadOnly` that mounts a new device) and
// counts the VMs on it itself, so a restore of a stack already open costs no blockd round trip. A
// device stays open only while it is wanted: a VM maps it, it is pinned (a template's, a fork's
// while its children start), or it is kept warm for a paused sandbox's resume (the
// MEMORY_DEVICES_WARM paused last). Any other goes back to the pool at once, so no device holds
// the layer files of a checkpoint that is gone.

import type { BlockdClient } from "../blockdev/client.ts";

/** Unused, unpinned memory devices kept warm for paused sandboxes' resumes, at most. */
export const MEMORY_DEVICES_WARM = 16;
/** Memory devices open at once, at most (users, pins and warm ones together). */
export const MEMORY_DEVICES_MAX = 4096;

/** A device over a stack's first layers, taken ahead of the stack (see MemoryDevices.ahead). */
export interface AheadDevice {
  readonly prefix: string[];
  readonly made: Promise<{ id: string; path: string }>;
  /** Grown into a pinned stack's device (pin took it): drop leaves it alone. */
  used: boolean;
  /** The device's id once blockd answered. */
  id?: string;
}

interface Entry {
  key: string;
  made: Promise<{ id: string; path: string }>;
  id?: string;
  /** Who maps it: sandbox ids (a set, so giving back twice is harmless). */
  users: Set<string>;
  pinned: boolean;
  /** Paused sandboxes whose resume it is kept open for (warm). */
  warmFor: Set<string>;
  leftAt: number;
}

export class MemoryDevices {
  private readonly open = new Map<string, Entry>();
  /** Devices taken ahead and neither grown nor given back yet. */
  private readonly aheads = new Set<AheadDevice>();

  constructor(private readonly blockd: BlockdClient) {}

  /** A device over `stack` for `holder`'s VM; give it back with release(holder). */
  async take(stack: string[], holder: string): Promise<{ id: string; path: string }> {
    const e = this.entry(stack);
    e.users.add(holder);
    e.warmFor.delete(holder); // its resume maps the device it was kept warm for
    this.forget(holder, e); // or another stack's, which then goes
    try {
      return await e.made;
    } catch (err) {
      e.users.delete(holder);
      this.closeIfUnwanted(e);
      throw err;
    }
  }

  /** `holder`'s VM is gone (idempotent); a device nobody wants any more closes. */
  release(holder: string): void {
    for (const e of this.open.values()) {
      if (!e.users.delete(holder)) continue;
      if (e.users.size === 0) e.leftAt = Date.now();
      this.closeIfUnwanted(e);
      return;
    }
  }

  /** Keep `stack` open for paused sandbox `holder`'s resume (opened now if it is not). */
  warm(stack: string[], holder: string): void {
    const e = this.entry(stack);
    e.warmFor.add(holder);
    this.forget(holder, e);
    e.leftAt = Date.now();
    e.made.catch(() => {});
    this.trim();
  }

  /** `holder` no longer wants a device kept warm (killed, or resumed: take calls it), but for `except`'s; idempotent. */
  forget(holder: string, except?: Entry): void {
    for (const e of [...this.open.values()]) if (e !== except && e.warmFor.delete(holder)) this.closeIfUnwanted(e);
  }

  /**
   * A device over `prefix` taken now, for a stack that will be `prefix` and more: a fork's, over its
   * source's memory layers, opened while the VMM writes the new one, so the stack's device then
   * opens only that layer (blockd's acquire `onto`). pin(stack, it) grows it; drop(it) gives back
   * one that was not grown. One per fork in flight.
   */
  ahead(prefix: string[]): AheadDevice {
    if (!prefix.length) throw new Error("a memory device needs at least one layer");
    const made = this.blockd.call<{ id: string; path: string }>("acquire", { lowers: prefix });
    const ahead: AheadDevice = { prefix, made, used: false };
    this.aheads.add(ahead);
    made.then((d) => (ahead.id = d.id), () => this.aheads.delete(ahead));
    return ahead;
  }

  /** `ahead` back to blockd's pool unless pin grew it (idempotent). */
  drop(ahead: AheadDevice): void {
    if (ahead.used) return;
    ahead.used = true;
    this.aheads.delete(ahead);
    ahead.made
      .then((d) => this.blockd.call("release", { id: d.id }))
      .catch((err) => console.error(`orchestrator: giving back a memory device taken ahead: ${(err as Error).message}`));
  }

  /**
   * Keep `stack` open until unpin (a template's, a fork's while its children start). `ahead`: a
   * device over its first layers to grow into it, when it is not open already.
   * Resolves once the device is open (or rejects: a pin that failed to open is gone).
   */
  pin(stack: string[], ahead?: AheadDevice): Promise<void> {
    const e = this.entry(stack, ahead);
    e.pinned = true;
    const open = e.made.then(() => {});
    open.catch(() => {});
    return open;
  }

  unpin(stack: string[]): void {
    const e = this.open.get(JSON.stringify(stack));
    if (!e?.pinned) return;
    e.pinned = false;
    if (e.users.size === 0) e.leftAt = Date.now();
    this.closeIfUnwanted(e);
  }

  /** At recovery: `holder`'s running VM maps blockd device `id` over `stack` (opened before the node's restart). */
  adopt(id: string, path: string, stack: string[], holder: string): void {
    const key = JSON.stringify(stack);
    const e = this.open.get(key) ?? { key, made: Promise.resolve({ id, path }), id, users: new Set<string>(), pinned: false, warmFor: new Set<string>(), leftAt: 0 };
    this.open.set(key, e);
    e.users.add(holder);
  }

  /** The stacks pinned now. */
  pinnedStacks(): string[][] {
    return [...this.open.values()].filter((e) => e.pinned).map((e) => JSON.parse(e.key) as string[]);
  }

  /** Ids of the devices this node holds. */
  ids(): Set<string> {
    return new Set(this.holders().keys());
  }

  /** Each device this node holds, with why: the VMs that map it, pinned, warm for paused sandboxes, or taken ahead for a fork. */
  holders(): Map<string, string> {
    const out = new Map<string, string>();
    for (const e of this.open.values()) {
      if (!e.id) continue;
      const why = [...(e.users.size ? [`mapped by ${[...e.users].join(", ")}`] : []), ...(e.pinned ? ["pinned"] : []), ...(e.warmFor.size ? [`warm for ${[...e.warmFor].join(", ")}`] : [])];
      out.set(e.id, `memory: ${why.join("; ") || "closing"}`);
    }
    for (const a of this.aheads) if (a.id) out.set(a.id, "memory: taken ahead for a fork");
    return out;
  }

  private entry(stack: string[], ahead?: AheadDevice): Entry {
    if (!stack.length) throw new Error("a memory device needs at least one layer");
    const key = JSON.stringify(stack);
    let e = this.open.get(key);
    if (e) return e;
    if (this.open.size >= MEMORY_DEVICES_MAX) throw new Error(`${MEMORY_DEVICES_MAX} memory devices are open`);
    const grows = ahead && !ahead.used && ahead.prefix.length < stack.length && ahead.prefix.every((l, i) => l === stack[i]);
    const made = grows ? this.grow(ahead, stack) : this.blockd.call<{ id: string; path: string }>("acquire", { lowers: stack });
    const entry: Entry = { key, made, users: new Set(), pinned: false, warmFor: new Set(), leftAt: Date.now() };
    made.then(
      (d) => (entry.id = d.id),
      () => this.open.get(key) === entry && this.open.delete(key),
    );
    this.open.set(key, entry);
    return entry;
  }

  /** `ahead`'s device grown into `stack`'s; where that fails, it goes back and a fresh one opens. */
  private grow(ahead: AheadDevice, stack: string[]): Promise<{ id: string; path: string }> {
    ahead.used = true;
    this.aheads.delete(ahead);
    return ahead.made
      .then((d) =>
        this.blockd.call<{ id: string; path: string }>("acquire", { lowers: stack, onto: d.id }).catch((err) => {
          console.error(`orchestrator: growing memory device ${d.id}: ${(err as Error).message}; opening the stack anew`);
          void this.blockd.call("release", { id: d.id }).catch(() => {});
          return Promise.reject(err);
        }),
      )
      .catch(() => this.blockd.call<{ id: string; path: string }>("acquire", { lowers: stack }));
  }

  /** Warm devices (unused, unpinned) past MEMORY_DEVICES_WARM go, the longest unused first. */
  private trim(): void {
    const idle = [...this.open.values()].filter((e) => e.users.size === 0 && !e.pinned).sort((a, b) => a.leftAt - b.leftAt);
    for (const e of idle.slice(0, Math.max(0, idle.length - MEMORY_DEVICES_WARM))) this.close(e);
  }

  /** A device no VM maps, not pinned and warm for no paused sandbox goes back now. */
  private closeIfUnwanted(e: Entry): void {
    if (this.open.get(e.key) === e && e.users.size === 0 && !e.pinned && e.warmFor.size === 0) this.close(e);
  }

  private close(e: Entry): void {
    this.open.delete(e.key);
    e.made
      .then((d) => this.blockd.call("release", { id: d.id }))
      .catch((err) => console.error(`orchestrator: closing memory device ${e.id ?? e.key}: ${(err as Error).message}`));
  }
}
