// Where an operation's time goes, phase by phase (slot, devices, vmm, guest, …), kept for the
// last TIMING_LOG_MAX operations: bench/node splits node-side time from VMM and guest time with it.

/** Operations whose timings are kept. */
export const TIMING_LOG_MAX = 256;

/**
 * Phases spent in the VMM or the guest, or writing the guest's dirty memory (the snapshot's
 * payload: it grows with what the guest dirtied), not in the node, or (a fork child's
 * "checkpoint") waiting for the source's checkpoint, timed in its own row: the rest is our own
 * overhead.
 */
export const EXTERNAL_PHASES = new Set(["vmm", "guest", "init", "memory", "checkpoint"]);

export class PhaseClock {
  private t = performance.now();
  private readonly t0 = this.t;
  readonly phases: Record<string, number> = {};

  /** Charges the time since the last lap to `name`. */
  lap(name: string): void {
    const now = performance.now();
    this.phases[name] = (this.phases[name] ?? 0) + (now - this.t);
    this.t = now;
  }

  get totalMs(): number {
    return performance.now() - this.t0;
  }
}

export interface OpTiming {
  op: string;
  id: string;
  totalMs: number;
  phases: Record<string, number>;
}

export class TimingLog {
  private readonly entries: OpTiming[] = [];

  add(op: string, id: string, clock: PhaseClock): void {
    this.entries.push({ op, id, totalMs: clock.totalMs, phases: { ...clock.phases } });
    if (this.entries.length > TIMING_LOG_MAX) this.entries.shift();
  }

  recent(op?: string): OpTiming[] {
    return op === undefined ? [...this.entries] : this.entries.filter((e) => e.op === op);
  }
}
