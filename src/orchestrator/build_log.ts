// A template build's status and its log: E2B's build states, and a bounded list of entries that a
// status call pages through by level (entries past the bound are dropped, counted per level).
import type { BuildSpec } from "./builder.ts";

export type BuildStatus = "waiting" | "building" | "ready" | "error";
export type LogLevel = "debug" | "info" | "warn" | "error";
/** Lowest first: a status call's `level` returns that level and the ones after it. */
export const LOG_LEVELS: readonly LogLevel[] = ["debug", "info", "warn", "error"];
/** Entries one status call returns (E2B's page size). */
export const LOG_PAGE = 100;

export interface BuildLogEntry {
  timestamp: string;
  level: LogLevel;
  message: string;
  step?: string;
}

export class Build {
  status: BuildStatus = "waiting";
  reason: { message: string; step?: string } | undefined;
  spec: BuildSpec | undefined;
  started = false;
  readonly createdAt = Date.now();
  updatedAt = Date.now();
  /** Entries dropped by the bound that count at each level (debug: all of them, the index of logs[0]). */
  private readonly dropped: Record<LogLevel, number> = { debug: 0, info: 0, warn: 0, error: 0 };
  private readonly logs: BuildLogEntry[] = [];

  constructor(readonly templateId: string, readonly buildId: string, private readonly maxLogs: number) {}

  log(level: LogLevel, message: string, step?: string): void {
    this.logs.push({ timestamp: new Date().toISOString(), level, message, ...(step !== undefined ? { step } : {}) });
    if (this.logs.length > this.maxLogs) {
      const gone = this.logs.shift()!;
      for (const l of LOG_LEVELS) if (LOG_LEVELS.indexOf(gone.level) >= LOG_LEVELS.indexOf(l)) this.dropped[l]++;
    }
  }

  /**
   * Entries at `level` and above (every entry without one), as E2B filters: `offset` counts only
   * those (dropped ones are skipped), at most `limit` come back.
   */
  entries(offset: number, limit: number, level: LogLevel = "debug"): BuildLogEntry[] {
    const from = Math.max(0, offset - this.dropped[level]);
    if (level === "debug") return this.logs.slice(from, from + limit);
    const min = LOG_LEVELS.indexOf(level);
    return this.logs.filter((e) => LOG_LEVELS.indexOf(e.level) >= min).slice(from, from + limit);
  }

  finished(): boolean {
    return this.status === "ready" || this.status === "error";
  }
}
