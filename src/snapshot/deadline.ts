// Every store operation runs against one deadline: a base time plus time proportional to the
// bytes it moves, so a multi-GiB put is not cut short and a stalled one still ends.
import { SnapshotStoreError } from "./errors.ts";

export interface StoreLimits {
  /** Time every operation gets before its bytes are counted. */
  baseMs: number;
  /** The slowest transfer rate an operation is allowed: its bytes add bytes / rate seconds. */
  minBytesPerS: number;
}

/** 60 s plus one second per 16 MiB moved: a 4 GiB memory image gets about 5 minutes. */
export const DEFAULT_LIMITS: StoreLimits = { baseMs: 60_000, minBytesPerS: 16 << 20 };

export class Deadline {
  readonly at: number;

  constructor(
    readonly what: string,
    limits: StoreLimits,
    bytes = 0,
  ) {
    if (!(limits.baseMs > 0) || !(limits.minBytesPerS > 0)) throw new SnapshotStoreError("BadConfig", `${what}: limits must be positive`);
    this.at = Date.now() + limits.baseMs + Math.ceil((bytes * 1000) / limits.minBytesPerS);
  }

  get leftMs(): number {
    return this.at - Date.now();
  }

  timeout(): SnapshotStoreError {
    return new SnapshotStoreError("Timeout", `${this.what}: past its deadline`);
  }

  /** Throws Timeout once the deadline has passed: called between chunks of a transfer. */
  check(): void {
    if (Date.now() >= this.at) throw this.timeout();
  }

  /**
   * `p`, or Timeout when the deadline comes first (for calls that take no signal, such as Bun's
   * S3 requests). The abandoned call's own result or error is dropped.
   */
  race<T>(p: Promise<T>): Promise<T> {
    const left = this.leftMs;
    if (left <= 0) {
      p.catch(() => {});
      return Promise.reject(this.timeout());
    }
    let timer: Timer | undefined;
    const late = new Promise<never>((_, reject) => {
      timer = setTimeout(() => reject(this.timeout()), left);
    });
    return Promise.race([p, late]).finally(() => clearTimeout(timer));
  }
}
