// Prefetch traces (docs/blockd.md, Prefetch traces): the order in which a device's granules were
// first read, recorded in its worker while a VM starts, and replayed later as reads through the
// device's Image ahead of the guest, so that a remote layer's chunks are in the block cache (and
// local layers' pages in the page cache) by the time the guest asks for them.

import { TRACE_MAX_ENTRIES, type Trace, checkGranule } from "../storage/trace_file.ts";

/** Default granule: first reads are noted per 64 KiB of the device. */
export const TRACE_GRANULE = 64 * 1024;
/** A recording ends by itself this long after it started (its next new granule ends it), unless stopped first. */
export const TRACE_DEFAULT_MS = 120_000;
export const TRACE_MAX_MS = 600_000;
/** Prefetch reads in flight per device, at most. */
export const PREFETCH_IN_FLIGHT = 4;
/** Neighbouring granules of a trace go in one prefetch read of at most this (a remote layer's chunk). */
export const PREFETCH_MAX_READ = 1 << 20;
/** While the guest has more reads than this in flight on the device, prefetch issues none. */
export const PREFETCH_YIELD_AT = 8;

/** Notes the granules of a device's reads the first time each is read, in order, until full or past its time. */
export class TraceRecorder {
  private readonly seen: Uint8Array; // a bit per granule
  private readonly order: Uint32Array;
  private count = 0;
  private readonly shift: number;
  private readonly until: number;
  ended = false;

  constructor(
    readonly size: number,
    readonly granule: number,
    readonly maxEntries = TRACE_MAX_ENTRIES,
    forMs = TRACE_DEFAULT_MS,
  ) {
    checkGranule(granule);
    this.shift = Math.log2(granule);
    this.seen = new Uint8Array(Math.ceil(Math.ceil(size / granule) / 8));
    this.order = new Uint32Array(maxEntries);
    this.until = Date.now() + forMs;
  }

  /** A read of [offset, offset+length); false once the recording has ended (full or past its time). */
  note(offset: number, length: number): boolean {
    if (this.ended) return false;
    const last = Math.min(Math.floor((offset + length - 1) / this.granule), this.seen.length * 8 - 1);
    for (let g = Math.floor(offset / this.granule); g <= last; g++) {
      const bit = 1 << (g & 7);
      if (this.seen[g >> 3]! & bit) continue;
      // The time bound is checked only on a new granule: reads of what is known cost one bit test.
      if (this.count >= this.maxEntries || Date.now() > this.until) {
        this.ended = true;
        return false;
      }
      this.seen[g >> 3]! |= bit;
      this.order[this.count++] = g;
    }
    return true;
  }

  get entries(): number {
    return this.count;
  }

  trace(): Trace {
    return { size: this.size, granule: this.granule, entries: this.order.slice(0, this.count) };
  }
}

export interface PrefetchStats {
  /** Granules in the trace. */
  planned: number;
  /** Granules prefetch read. */
  fetched: number;
  /** Granules prefetch left out: the guest had read them first, or had read past them in the trace. */
  skipped: number;
  bytes: number;
  errors: number;
  active: boolean;
}

/**
 * Replays a trace as reads through `read`, in its order, PREFETCH_IN_FLIGHT at a time, neighbours
 * joined up to PREFETCH_MAX_READ. Below the guest: it issues nothing while the guest has more than
 * PREFETCH_YIELD_AT reads in flight, and when the guest first reads a granule further on in the
 * trace than prefetch has come, prefetch goes on from there (what lies before it was the guest's to
 * read already). A failed read is counted and logged once, never passed on.
 */
export class Prefetcher {
  private readonly pos = new Map<number, number>(); // granule → its place in the trace
  private readonly done: Uint8Array; // per place: read by prefetch or by the guest
  private cursor = 0;
  private inFlight = 0;
  private stopped = false;
  private idle: (() => void)[] = [];
  private buffers: Uint8Array[] = [];
  /** The guest's reads in flight on the device (the worker counts them). */
  guestInFlight = 0;
  readonly stats: PrefetchStats;

  constructor(
    private readonly trace: Trace,
    private readonly read: (buf: Uint8Array, offset: number) => Promise<void>,
    private readonly deviceSize: number,
    private readonly log: (line: string) => void,
  ) {
    trace.entries.forEach((g, i) => this.pos.set(g, i));
    this.done = new Uint8Array(trace.entries.length);
    this.stats = { planned: trace.entries.length, fetched: 0, skipped: 0, bytes: 0, errors: 0, active: true };
  }

  start(): void {
    this.pump();
  }

  /** A guest read of [offset, offset+length): its granules need no prefetch, and prefetch moves past them. */
  guestRead(offset: number, length: number): void {
    const g0 = Math.floor(offset / this.trace.granule);
    const g1 = Math.floor((offset + length - 1) / this.trace.granule);
    for (let g = g0; g <= g1; g++) {
      const p = this.pos.get(g);
      if (p === undefined || this.done[p]) continue;
      // Not done means not passed yet (the cursor moves only over done places): the guest is ahead.
      for (let i = this.cursor; i <= p; i++) if (!this.done[i]) (this.done[i] = 1), this.stats.skipped++;
      this.cursor = p + 1;
    }
  }

  /** Issue reads while there is room; called on start, after each read, and when the guest's load drops. */
  pump(): void {
    const g = this.trace.granule;
    const most = PREFETCH_MAX_READ / g;
    while (!this.stopped && this.inFlight < PREFETCH_IN_FLIGHT && this.guestInFlight <= PREFETCH_YIELD_AT) {
      while (this.cursor < this.done.length && this.done[this.cursor]) this.cursor++;
      if (this.cursor >= this.done.length) break;
      const first = this.trace.entries[this.cursor]!;
      let n = 1;
      this.done[this.cursor++] = 1;
      // Neighbours in the trace that continue each other on the device go in the same read.
      while (n < most && this.cursor < this.done.length && !this.done[this.cursor] && this.trace.entries[this.cursor] === first + n) {
        this.done[this.cursor++] = 1;
        n++;
      }
      const offset = first * g;
      const length = Math.min(n * g, this.deviceSize - offset);
      if (length <= 0) continue;
      this.issue(offset, length, n);
    }
    if (this.inFlight === 0 && (this.stopped || this.cursor >= this.done.length)) this.finish();
  }

  private issue(offset: number, length: number, granules: number): void {
    this.inFlight++;
    const buf = this.buffer(length);
    this.read(buf, offset).then(
      () => {
        this.stats.fetched += granules;
        this.stats.bytes += length;
      },
      (e: Error) => {
        if (this.stats.errors++ === 0) this.log(`prefetch read at ${offset}+${length}: ${e.name}: ${e.message} (later failures are counted, not logged)`);
      },
    ).finally(() => {
      this.inFlight--;
      if (buf.length === PREFETCH_MAX_READ) this.buffers.push(buf);
      this.pump();
    });
  }

  /** Reads land in scratch buffers nobody looks at; full-size ones are reused. */
  private buffer(length: number): Uint8Array {
    if (length === PREFETCH_MAX_READ) return this.buffers.pop() ?? new Uint8Array(PREFETCH_MAX_READ);
    return new Uint8Array(length);
  }

  private finish(): void {
    if (!this.stats.active) return;
    this.stats.active = false;
    this.buffers = [];
    for (const f of this.idle.splice(0)) f();
  }

  /** No new reads; resolves once those in flight have settled (before the image closes or changes). */
  stop(): Promise<void> {
    this.stopped = true;
    if (this.inFlight === 0) this.finish();
    if (!this.stats.active) return Promise.resolve();
    return new Promise((r) => this.idle.push(r));
  }
}
