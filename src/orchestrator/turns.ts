// Turns on one thing (a volume), in order: a bounded queue of callers, each with a deadline.
import { OrchestratorError } from "./errors.ts";

/**
 * Turns on one volume, in order: each caller waits for the one before. At most `max` wait
 * (else 429), each at most `waitMs` (else 503, and its turn is passed on when it comes).
 */
export class Turns {
  private tail: Promise<void> = Promise.resolve();
  waiting = 0;
  busy = false;

  async take(max: number, waitMs: number, what: string): Promise<() => void> {
    if (this.waiting >= max) throw new OrchestratorError(429, `${what}: ${max} calls are waiting; try again later`);
    this.waiting++;
    let release!: () => void;
    const mine = new Promise<void>((r) => (release = r));
    const before = this.tail;
    this.tail = before.then(() => mine);
    let timer: Timer | undefined;
    const timeout = new Promise<never>((_, reject) => {
      timer = setTimeout(() => reject(new OrchestratorError(503, `${what}: not its turn within ${waitMs} ms`)), waitMs);
    });
    try {
      await Promise.race([before, timeout]);
    } catch (e) {
      this.waiting--;
      void before.then(release); // its turn is passed on once it comes
      throw e;
    } finally {
      clearTimeout(timer);
    }
    this.waiting--;
    this.busy = true;
    return () => {
      this.busy = false;
      release();
    };
  }
}
