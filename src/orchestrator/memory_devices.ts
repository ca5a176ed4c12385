// The node's memory devices (docs/vmm.md, "Memory layers"): one blockd read-only device per memory
// stack, shared by every VM restored from it. The node takes it from blockd's pool (`acquire`
// without an upper: 2–7 ms, against 24–34 ms for a `createReadOnly` that mounts a new device) and
// counts the VMs on it itself, so a restore of a stack already open costs no blockd round trip. A
// pinned stack (a template's, a fork's while its children start) stays open; of the unpinned ones
// nobody uses, the MEMORY_DEVICES_WARM left last stay open (a paused sandbox's own stack: its
// resume finds the device ready), the older ones go back to the pool.

import type { BlockdClient } from "../blockdev/client.ts";

/** Unused, unpinned memory devices kept open, at most. */
export const MEMORY_DEVICES_WARM = 16;
/** Memory devices open at once, at most (users, pins and warm ones together). */
export const MEMORY_DEVICES_MAX = 4096;

/** A device over a stack's first layers, taken ahead of the stack (see MemoryDevices.ahead). */
export interface AheadDevice {
  readonly prefix: string[];
  readonly made: Promise<{ id: string; path: string }>;
  /** Grown into a pinned stack's device (pin took it): drop leaves it alone. */
  used: boolean;
}

interface Entry {
  key: string;
  made: Promise<{ id: string; path: string }>;
  id?: string;
  /** Who maps it: sandbox ids (a set, so giving back twice is harmless). */
  users: Set<string>;
  pinned: boolean;
  leftAt: number;
}

export class MemoryDevices {
  private readonly open = new Map<string, Entry>();

  constructor(private readonly blockd: BlockdClient) {}

  /** A device over `stack` for `holder`'s VM; give it back with release(holder). */
  async take(stack: string[], holder: string): Promise<{ id: string; path: string }> {
    const e = this.entry(stack);
    e.users.add(holder);
    try {
      return await e.made;
    } catch (err) {
      e.users.delete(holder);
      throw err;
    }
  }

  /** `holder`'s VM is gone (idempotent). */
  release(holder: string): void {
    for (const e of this.open.values()) {
      if (!e.users.delete(holder)) continue;
      if (e.users.size === 0) e.leftAt = Date.now();
      this.trim();
      return;
    }
  }

  /** Open `stack` ahead of a VM (after a pause: its resume's), as an unused device. */
  warm(stack: string[]): void {
    const e = this.entry(stack);
    if (e.users.size === 0 && !e.pinned) e.leftAt = Date.now();
    e.made.catch(() => {});
    this.trim();
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
    made.catch(() => {});
    return { prefix, made, used: false };
  }

  /** `ahead` back to blockd's pool unless pin grew it (idempotent). */
  drop(ahead: AheadDevice): void {
    if (ahead.used) return;
    ahead.used = true;
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
    this.trim();
  }

  /** Close `stack`'s device now if nothing uses or pins it (the paused sandbox it was warm for is gone). */
  forget(stack: string[]): void {
    const e = this.open.get(JSON.stringify(stack));
    if (e && e.users.size === 0 && !e.pinned) this.close(e);
  }

  /** At recovery: `holder`'s running VM maps blockd device `id` over `stack` (opened before the node's restart). */
  adopt(id: string, path: string, stack: string[], holder: string): void {
    const key = JSON.stringify(stack);
    const e = this.open.get(key) ?? { key, made: Promise.resolve({ id, path }), id, users: new Set<string>(), pinned: false, leftAt: 0 };
    this.open.set(key, e);
    e.users.add(holder);
  }

  /** The stacks pinned now. */
  pinnedStacks(): string[][] {
    return [...this.open.values()].filter((e) => e.pinned).map((e) => JSON.parse(e.key) as string[]);
  }

  /** Ids of the devices this node holds. */
  ids(): Set<string> {
    return new Set([...this.open.values()].flatMap((e) => (e.id ? [e.id] : [])));
  }

  private entry(stack: string[], ahead?: AheadDevice): Entry {
    if (!stack.length) throw new Error("a memory device needs at least one layer");
    const key = JSON.stringify(stack);
    let e = this.open.get(key);
    if (e) return e;
    if (this.open.size >= MEMORY_DEVICES_MAX) throw new Error(`${MEMORY_DEVICES_MAX} memory devices are open`);
    const grows = ahead && !ahead.used && ahead.prefix.length < stack.length && ahead.prefix.every((l, i) => l === stack[i]);
    const made = grows ? this.grow(ahead, stack) : this.blockd.call<{ id: string; path: string }>("acquire", { lowers: stack });
    const entry: Entry = { key, made, users: new Set(), pinned: false, leftAt: Date.now() };
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

  /** Unused, unpinned devices past MEMORY_DEVICES_WARM go, the longest unused first. */
  private trim(): void {
    const idle = [...this.open.values()].filter((e) => e.users.size === 0 && !e.pinned).sort((a, b) => a.leftAt - b.leftAt);
    for (const e of idle.slice(0, Math.max(0, idle.length - MEMORY_DEVICES_WARM))) this.close(e);
  }

  private close(e: Entry): void {
    this.open.delete(e.key);
    e.made
      .then((d) => this.blockd.call("release", { id: d.id }))
      .catch((err) => console.error(`orchestrator: closing memory device ${e.id ?? e.key}: ${(err as Error).message}`));
  }
}
