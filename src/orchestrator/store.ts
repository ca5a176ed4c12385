// SandboxStore: the node's sandbox table in bun:sqlite. Every state change is a compare-and-set on
// the stored state (`transition`), so two requests racing on one sandbox cannot both win; list order
// and its cursor follow E2B's (startedAt desc, then id; base64url "<startedAt>__<id>__<list scope>").
import { Database } from "bun:sqlite";
import { createHash } from "node:crypto";

export const SANDBOX_STATES = [
  "creating", "running", "pausing", "paused", "resuming", "snapshotting", "forking", "killing",
] as const;
export type SandboxState = (typeof SANDBOX_STATES)[number];

/** What the E2B API reports: transitional states read as the state they come from or go to. */
export function publicState(s: SandboxState): "running" | "paused" {
  return s === "paused" || s === "pausing" ? "paused" : "running";
}

export interface SandboxRecord {
  id: string;
  state: SandboxState;
  templateId: string;
  alias: string | null;
  metadata: Record<string, string>;
  envVars: Record<string, string>;
  /** Unix ms; unique and increasing across the table (the list order depends on it). */
  startedAt: number;
  /** Unix ms. */
  endAt: number;
  cpuCount: number;
  memoryMB: number;
  diskSizeMB: number;
  envdVersion: string;
  envdAccessToken: string;
  trafficAccessToken: string | null;
  /** On expiry: pause (true) or kill (false, E2B's default). */
  autoPause: boolean;
  /** An expiry's pause keeps memory (true, E2B's default) or is filesystem-only (E2B `autoPauseMemory: false`); absent in old rows: true. */
  autoPauseMemory?: boolean;
  autoResume: boolean;
  allowInternetAccess: boolean | null;
  /** The create request's `network`, stored for the egress policy. */
  network: unknown;
  /** Where the orchestrator keeps what it needs to find the sandbox's parts again (slot, devices, VMM). */
  runtime: unknown;
  /** AgentENV's customExtensionParams: opaque JSON kept with the sandbox (fork children inherit it); absent: `{}`. */
  customExtensionParams?: Record<string, unknown>;
  /** E2B volumeMounts: each volume (by name) at its guest path; absent in old rows: none. */
  volumeMounts?: VolumeMount[];
}

export interface VolumeMount {
  name: string;
  path: string;
}

export class StoreError extends Error {
  constructor(message: string) { super(message); this.name = "StoreError"; }
}

export interface ListQuery {
  states?: ("running" | "paused")[];
  metadata?: Record<string, string>;
  template?: string;
  /** Unix ms, inclusive. */
  startedAfter?: number;
  order?: "asc" | "desc";
  limit: number;
  nextToken?: string;
}

/** Bounds on what one list call reads: E2B's limit range. */
export const LIST_LIMIT_MAX = 100;

interface Row {
  id: string; state: string; template_id: string; alias: string | null; metadata: string; env_vars: string;
  started_at: number; end_at: number; cpu_count: number; memory_mb: number; disk_size_mb: number;
  envd_version: string; envd_access_token: string; traffic_access_token: string | null;
  auto_pause: number; auto_resume: number; allow_internet_access: number | null; network: string; runtime: string;
  custom_extension_params: string; auto_pause_memory: number; volume_mounts: string;
}

const SCHEMA = `
CREATE TABLE IF NOT EXISTS sandboxes (
  id TEXT PRIMARY KEY,
  state TEXT NOT NULL,
  template_id TEXT NOT NULL,
  alias TEXT,
  metadata TEXT NOT NULL,
  env_vars TEXT NOT NULL,
  started_at INTEGER NOT NULL UNIQUE,
  end_at INTEGER NOT NULL,
  cpu_count INTEGER NOT NULL,
  memory_mb INTEGER NOT NULL,
  disk_size_mb INTEGER NOT NULL,
  envd_version TEXT NOT NULL,
  envd_access_token TEXT NOT NULL,
  traffic_access_token TEXT,
  auto_pause INTEGER NOT NULL,
  auto_resume INTEGER NOT NULL,
  allow_internet_access INTEGER,
  network TEXT NOT NULL,
  runtime TEXT NOT NULL,
  custom_extension_params TEXT NOT NULL DEFAULT '{}',
  auto_pause_memory INTEGER NOT NULL DEFAULT 1,
  volume_mounts TEXT NOT NULL DEFAULT '[]'
);
CREATE INDEX IF NOT EXISTS sandboxes_end_at ON sandboxes (end_at);
`;

function toRecord(r: Row): SandboxRecord {
  return {
    id: r.id,
    state: r.state as SandboxState,
    templateId: r.template_id,
    alias: r.alias,
    metadata: JSON.parse(r.metadata),
    envVars: JSON.parse(r.env_vars),
    startedAt: r.started_at,
    endAt: r.end_at,
    cpuCount: r.cpu_count,
    memoryMB: r.memory_mb,
    diskSizeMB: r.disk_size_mb,
    envdVersion: r.envd_version,
    envdAccessToken: r.envd_access_token,
    trafficAccessToken: r.traffic_access_token,
    autoPause: r.auto_pause === 1,
    autoResume: r.auto_resume === 1,
    allowInternetAccess: r.allow_internet_access === null ? null : r.allow_internet_access === 1,
    network: JSON.parse(r.network),
    runtime: JSON.parse(r.runtime),
    customExtensionParams: JSON.parse(r.custom_extension_params),
    autoPauseMemory: r.auto_pause_memory !== 0,
    volumeMounts: JSON.parse(r.volume_mounts),
  };
}

/**
 * A list's page token: base64url of `<at>__<id>__<scope>`, the last item's sort key (unix ms) and
 * ID, and the list it was issued for (`listScope`), so it is good for that list only.
 */
export function encodeCursor(at: number, id: string, scope: string): string {
  return Buffer.from(`${at}__${id}__${scope}`).toString("base64url");
}

/** A list's scope: its kind and a hash of its filters and order (16 hex digits). */
export function listScope(kind: string, filters: unknown): string {
  return `${kind}.${createHash("sha256").update(JSON.stringify(filters)).digest("hex").slice(0, 16)}`;
}

/** Where a token of the list `scope` points; a StoreError (400) when it does not decode or belongs to another list. */
export function decodeCursor(token: string, scope: string): { at: number; id: string } {
  const m = /^(\d{1,16})__([A-Za-z0-9_.-]{1,128}?)__([a-z0-9]+\.[0-9a-f]{16})$/.exec(Buffer.from(token, "base64url").toString("utf8"));
  if (!m) throw new StoreError("nextToken is not a token this node issued");
  if (m[3] !== scope) throw new StoreError("nextToken belongs to another list (other filters or order): list again without it");
  return { at: Number(m[1]), id: m[2]! };
}

export class SandboxStore {
  readonly db: Database;
  private lastStartedAt = 0;

  constructor(path: string) {
    this.db = new Database(path, { create: true, strict: true });
    // First: a connection opening the file while another one recovers its WAL waits (up to 5 s)
    // rather than failing with SQLITE_BUSY_RECOVERY, as the journal_mode pragma did.
    this.db.run("PRAGMA busy_timeout = 5000");
    this.db.run("PRAGMA journal_mode = WAL");
    this.db.run("PRAGMA synchronous = NORMAL");
    this.db.run(SCHEMA);
    // Databases made before a column: added in place, with its default.
    const cols = this.db.query<{ name: string }, []>("PRAGMA table_info(sandboxes)").all().map((c) => c.name);
    if (!cols.includes("custom_extension_params")) this.db.run("ALTER TABLE sandboxes ADD COLUMN custom_extension_params TEXT NOT NULL DEFAULT '{}'");
    if (!cols.includes("auto_pause_memory")) this.db.run("ALTER TABLE sandboxes ADD COLUMN auto_pause_memory INTEGER NOT NULL DEFAULT 1");
    if (!cols.includes("volume_mounts")) this.db.run("ALTER TABLE sandboxes ADD COLUMN volume_mounts TEXT NOT NULL DEFAULT '[]'");
    const max = this.db.query<{ m: number | null }, []>("SELECT MAX(started_at) AS m FROM sandboxes").get();
    this.lastStartedAt = max?.m ?? 0;
  }

  close(): void { this.db.close(); }

  /** A startedAt for a new sandbox: now, or one past the newest, so the order is strict. */
  nextStartedAt(now = Date.now()): number {
    this.lastStartedAt = Math.max(now, this.lastStartedAt + 1);
    return this.lastStartedAt;
  }

  insert(rec: SandboxRecord): void {
    try {
      this.db.query(`INSERT INTO sandboxes (id, state, template_id, alias, metadata, env_vars, started_at, end_at,
        cpu_count, memory_mb, disk_size_mb, envd_version, envd_access_token, traffic_access_token, auto_pause,
        auto_resume, allow_internet_access, network, runtime, custom_extension_params, auto_pause_memory, volume_mounts)
        VALUES ($id, $state, $template_id, $alias, $metadata, $env_vars,
        $started_at, $end_at, $cpu_count, $memory_mb, $disk_size_mb, $envd_version, $envd_access_token,
        $traffic_access_token, $auto_pause, $auto_resume, $allow_internet_access, $network, $runtime, $custom_extension_params,
        $auto_pause_memory, $volume_mounts)`).run({
        id: rec.id, state: rec.state, template_id: rec.templateId, alias: rec.alias,
        metadata: JSON.stringify(rec.metadata), env_vars: JSON.stringify(rec.envVars),
        started_at: rec.startedAt, end_at: rec.endAt, cpu_count: rec.cpuCount, memory_mb: rec.memoryMB,
        disk_size_mb: rec.diskSizeMB, envd_version: rec.envdVersion, envd_access_token: rec.envdAccessToken,
        traffic_access_token: rec.trafficAccessToken, auto_pause: rec.autoPause ? 1 : 0,
        auto_resume: rec.autoResume ? 1 : 0,
        allow_internet_access: rec.allowInternetAccess === null ? null : rec.allowInternetAccess ? 1 : 0,
        network: JSON.stringify(rec.network ?? null), runtime: JSON.stringify(rec.runtime ?? null),
        custom_extension_params: JSON.stringify(rec.customExtensionParams ?? {}),
        auto_pause_memory: rec.autoPauseMemory === false ? 0 : 1,
        volume_mounts: JSON.stringify(rec.volumeMounts ?? []),
      });
    } catch (e) {
      throw new StoreError(`insert ${rec.id}: ${(e as Error).message}`);
    }
  }

  get(id: string): SandboxRecord | undefined {
    const r = this.db.query<Row, [string]>("SELECT * FROM sandboxes WHERE id = ?").get(id);
    return r ? toRecord(r) : undefined;
  }

  /**
   * Compare-and-set: moves `id` to `to` only if its state is one of `from`, and applies `patch`
   * (endAt, runtime) in the same statement. Returns the new record, or undefined when the row is
   * missing or in another state (the caller reads it again to say which).
   */
  transition(id: string, from: readonly SandboxState[], to: SandboxState,
    patch: { endAt?: number; runtime?: unknown } = {}): SandboxRecord | undefined {
    if (from.length === 0) throw new StoreError("transition needs at least one source state");
    const marks = from.map((_, i) => `$f${i}`).join(", ");
    const params: Record<string, string | number | null> = { id, to };
    from.forEach((s, i) => { params[`f${i}`] = s; });
    let sets = "state = $to";
    if (patch.endAt !== undefined) { sets += ", end_at = $end_at"; params.end_at = patch.endAt; }
    if (patch.runtime !== undefined) { sets += ", runtime = $runtime"; params.runtime = JSON.stringify(patch.runtime); }
    const r = this.db.query<Row, any>(`UPDATE sandboxes SET ${sets} WHERE id = $id AND state IN (${marks}) RETURNING *`).get(params);
    return r ? toRecord(r) : undefined;
  }

  /** Sets endAt in any state except killing; `extendOnly` keeps the later of the two (connect). */
  setEndAt(id: string, endAt: number, extendOnly: boolean): SandboxRecord | undefined {
    const expr = extendOnly ? "MAX(end_at, $end_at)" : "$end_at";
    const r = this.db.query<Row, any>(`UPDATE sandboxes SET end_at = ${expr} WHERE id = $id AND state != 'killing' RETURNING *`)
      .get({ id, end_at: endAt });
    return r ? toRecord(r) : undefined;
  }

  /** Replaces the sandbox's network settings (PUT /sandboxes/{id}/network); undefined when it is gone. */
  setNetwork(id: string, allowInternetAccess: boolean | null, network: unknown): SandboxRecord | undefined {
    const r = this.db.query<Row, any>("UPDATE sandboxes SET allow_internet_access = $a, network = $n WHERE id = $id AND state != 'killing' RETURNING *")
      .get({ id, a: allowInternetAccess === null ? null : allowInternetAccess ? 1 : 0, n: JSON.stringify(network ?? null) });
    return r ? toRecord(r) : undefined;
  }

  /** Replaces the customExtensionParams of a running sandbox; undefined when it is gone or not running. */
  setExtensionParams(id: string, params: Record<string, unknown>): SandboxRecord | undefined {
    const r = this.db.query<Row, any>("UPDATE sandboxes SET custom_extension_params = $p WHERE id = $id AND state = 'running' RETURNING *")
      .get({ id, p: JSON.stringify(params) });
    return r ? toRecord(r) : undefined;
  }

  /** Records what the sandbox holds (slot, devices, VMM), whatever its state. */
  setRuntime(id: string, runtime: unknown): void {
    this.db.query("UPDATE sandboxes SET runtime = ? WHERE id = ?").run(JSON.stringify(runtime ?? null), id);
  }

  delete(id: string): boolean {
    return this.db.query("DELETE FROM sandboxes WHERE id = ?").run(id).changes === 1;
  }

  /** Running sandboxes whose endAt has passed, oldest deadline first, at most `limit`. */
  expired(now: number, limit: number): SandboxRecord[] {
    return this.db.query<Row, [number, number]>(
      "SELECT * FROM sandboxes WHERE state = 'running' AND end_at <= ? ORDER BY end_at LIMIT ?").all(now, limit).map(toRecord);
  }

  all(): SandboxRecord[] {
    return this.db.query<Row, []>("SELECT * FROM sandboxes ORDER BY started_at").all().map(toRecord);
  }

  count(): number {
    return this.db.query<{ n: number }, []>("SELECT COUNT(*) AS n FROM sandboxes").get()!.n;
  }

  /**
   * One page of the E2B list. Metadata and state filters run in SQL only as far as they are cheap;
   * the metadata match (every pair equal) runs on the page's candidates, reading on until the page
   * is full, so the token always points just past the last item returned.
   */
  list(q: ListQuery): { items: SandboxRecord[]; nextToken?: string } {
    if (!(q.limit >= 1 && q.limit <= LIST_LIMIT_MAX)) throw new StoreError(`limit ${q.limit} is outside 1..${LIST_LIMIT_MAX}`);
    const desc = (q.order ?? "desc") === "desc";
    const where: string[] = [];
    const params: Record<string, string | number> = {};
    if (q.states && q.states.length === 1) {
      where.push(q.states[0] === "paused" ? "state IN ('paused', 'pausing')" : "state NOT IN ('paused', 'pausing')");
    }
    if (q.template !== undefined) { where.push("(template_id = $tpl OR alias = $tpl)"); params.tpl = q.template; }
    if (q.startedAfter !== undefined) { where.push("started_at >= $after"); params.after = q.startedAfter; }
    // A token belongs to the list of these filters and this order.
    const state = q.states?.length === 1 ? q.states[0] : "";
    const scope = listScope("sandboxes", [desc, state, Object.entries(q.metadata ?? {}).sort(), q.template ?? null, q.startedAfter ?? null]);
    if (q.nextToken !== undefined) {
      const c = decodeCursor(q.nextToken, scope);
      // startedAt is unique, so it alone orders; the id is kept in the token for readability.
      where.push(desc ? "started_at < $cur" : "started_at > $cur");
      params.cur = c.at;
    }
    const sql = `SELECT * FROM sandboxes ${where.length ? "WHERE " + where.join(" AND ") : ""}
      ORDER BY started_at ${desc ? "DESC" : "ASC"}`;
    const items: SandboxRecord[] = [];
    let more = false;
    for (const row of this.db.query<Row, any>(sql).iterate(params)) {
      const rec = toRecord(row);
      if (q.metadata && !Object.entries(q.metadata).every(([k, v]) => rec.metadata[k] === v)) continue;
      if (items.length === q.limit) { more = true; break; }
      items.push(rec);
    }
    const last = items[items.length - 1];
    return more && last ? { items, nextToken: encodeCursor(last.startedAt, last.id, scope) } : { items };
  }
}
