// IoLimiter: a counting semaphore in a SharedArrayBuffer, so every device worker of a blockd
// draws remote-layer I/O (registry ranges, S3, peers) from one bounded budget, separate from the
// per-device work those workers do. Create it once, pass `shared` to each worker, attach there.

const PERMITS = 0; // Int32 slot: permits left
const WAITERS = 1; // Int32 slot: tasks sleeping on PERMITS

export class IoLimiter {
  private readonly cells: Int32Array;

  private constructor(readonly shared: SharedArrayBuffer) {
    this.cells = new Int32Array(shared);
  }

  static create(permits: number): IoLimiter {
    if (!Number.isInteger(permits) || permits < 1) throw new RangeError(`IoLimiter needs at least 1 permit, got ${permits}`);
    const l = new IoLimiter(new SharedArrayBuffer(8));
    Atomics.store(l.cells, PERMITS, permits);
    return l;
  }

  /** The same limiter, seen from another worker. */
  static attach(shared: SharedArrayBuffer): IoLimiter {
    return new IoLimiter(shared);
  }

  get available(): number {
    return Atomics.load(this.cells, PERMITS);
  }

  /** Wait for a permit; the returned function gives it back (call it exactly once). */
  async acquire(): Promise<() => void> {
    for (;;) {
      const n = Atomics.load(this.cells, PERMITS);
      if (n > 0) {
        if (Atomics.compareExchange(this.cells, PERMITS, n, n - 1) === n) return this.releaser();
        continue;
      }
      Atomics.add(this.cells, WAITERS, 1);
      // Sleep while the count is still 0; a release in between makes waitAsync return at once.
      const w = Atomics.waitAsync(this.cells, PERMITS, 0);
      if (w.async) await w.value;
      Atomics.sub(this.cells, WAITERS, 1);
    }
  }

  /** Run fn holding a permit. */
  async run<T>(fn: () => Promise<T>): Promise<T> {
    const release = await this.acquire();
    try {
      return await fn();
    } finally {
      release();
    }
  }

  private releaser(): () => void {
    let done = false;
    return () => {
      if (done) throw new Error("IoLimiter permit released twice");
      done = true;
      Atomics.add(this.cells, PERMITS, 1);
      if (Atomics.load(this.cells, WAITERS) > 0) Atomics.notify(this.cells, PERMITS, 1);
    };
  }
}
