// The template builds' step cache: a step's sealed rootfs layer (or none, for a step that changes no
// file), found by the step's key and the exact layer file it was built on. Keying on the parent's
// file, not only on the parent step's key, matters: a layer holds block-level changes over the one
// under it, so a child made over one copy of a step is wrong over another copy of the same step
// (two racing builds, a forced rebuild). Collection keeps the cache under its capacity, least
// recently used first; a layer a template uses, or one a running build holds, is never removed.
import type { Database } from "bun:sqlite";
import { createHash } from "node:crypto";
import { mkdirSync } from "node:fs";
import { readdir, rm, stat } from "node:fs/promises";
import { join } from "node:path";

/** A file in the cache folder no row names is left alone this long (a build may be sealing it). */
const UNNAMED_GRACE_MS = 10 * 60_000;

export class StepCache {
  /** Layer files a running build is writing or stacks its VM on (a count per file): never collected. */
  private readonly held = new Map<string, number>();
  private collecting: Promise<string[]> | undefined;

  constructor(
    private readonly db: Database,
    readonly dir: string,
    private readonly capacityBytes: number,
    /** Layer files templates use (their stacks and checkpoints). */
    private readonly inUse: () => Set<string>,
  ) {
    mkdirSync(dir, { recursive: true });
    // Rows of the first schema were keyed by the step alone (unsafe over another parent copy): dropped.
    db.run("DROP TABLE IF EXISTS template_steps");
    db.run(`CREATE TABLE IF NOT EXISTS template_step_layers (
      key TEXT PRIMARY KEY,
      layer TEXT,
      used_at INTEGER NOT NULL
    )`);
  }

  /** The row key of a step over the layer stack whose top file is `parent`. */
  static key(stepKey: string, parent: string | undefined): string {
    return createHash("sha256").update(`${stepKey}\n${parent ?? ""}`).digest("hex");
  }

  /**
   * The cached result of `stepKey` over `parent`: a layer path, null (the step changed no file), or
   * undefined on a miss (no row, or its file is gone).
   */
  async get(stepKey: string, parent: string | undefined): Promise<string | null | undefined> {
    const key = StepCache.key(stepKey, parent);
    const row = this.db.query<{ layer: string | null }, [string]>("SELECT layer FROM template_step_layers WHERE key = ?").get(key);
    if (!row) return undefined;
    if (row.layer !== null && !(await stat(row.layer).then(() => true, () => false))) {
      this.db.query("DELETE FROM template_step_layers WHERE key = ?").run(key);
      return undefined;
    }
    this.db.query("UPDATE template_step_layers SET used_at = ? WHERE key = ?").run(Date.now(), key);
    return row.layer;
  }

  /** Where a new layer for `stepKey` goes; it is held (see hold) for the caller. */
  newLayer(stepKey: string): string {
    const path = join(this.dir, `${stepKey.slice(0, 32)}-${crypto.randomUUID().slice(0, 8)}.layer`);
    this.hold([path]);
    return path;
  }

  /** Keeps layers from collection while a build uses them; each hold is ended by one release. */
  hold(layers: string[]): void {
    for (const l of layers) this.held.set(l, (this.held.get(l) ?? 0) + 1);
  }

  release(layers: string[]): void {
    for (const l of layers) {
      const n = (this.held.get(l) ?? 0) - 1;
      if (n > 0) this.held.set(l, n);
      else this.held.delete(l);
    }
  }

  /** Records a step's result (replacing an older one: a forced step refreshes the cache). */
  put(stepKey: string, parent: string | undefined, layer: string | null): void {
    this.db.query("INSERT OR REPLACE INTO template_step_layers VALUES (?, ?, ?)").run(StepCache.key(stepKey, parent), layer, Date.now());
  }

  /**
   * Removes layers until the cache is under its capacity, least recently used first, then files
   * no row and no template names (older than UNNAMED_GRACE_MS). One collection at a time.
   */
  collect(): Promise<string[]> {
    this.collecting ??= this.collectOnce().finally(() => { this.collecting = undefined; });
    return this.collecting;
  }

  private async collectOnce(): Promise<string[]> {
    const used = this.inUse();
    const removed: string[] = [];
    const rows = this.db.query<{ key: string; layer: string }, []>("SELECT key, layer FROM template_step_layers WHERE layer IS NOT NULL ORDER BY used_at").all();
    const sizes = await Promise.all(rows.map((r) => stat(r.layer).then((s) => s.size, () => -1)));
    let total = sizes.reduce((a, s) => a + Math.max(0, s), 0);
    for (const [i, r] of rows.entries()) {
      if (sizes[i]! < 0) {
        this.db.query("DELETE FROM template_step_layers WHERE key = ?").run(r.key);
        continue;
      }
      if (total <= this.capacityBytes) continue;
      if (used.has(r.layer) || this.held.has(r.layer)) continue;
      this.db.query("DELETE FROM template_step_layers WHERE layer = ?").run(r.layer);
      await rm(r.layer, { force: true });
      total -= sizes[i]!;
      removed.push(r.layer);
    }
    const named = new Set(this.db.query<{ layer: string }, []>("SELECT layer FROM template_step_layers WHERE layer IS NOT NULL").all().map((r) => r.layer));
    for (const name of await readdir(this.dir).catch(() => [] as string[])) {
      const path = join(this.dir, name);
      if (named.has(path) || used.has(path) || this.held.has(path)) continue;
      const st = await stat(path).catch(() => undefined);
      if (!st || Date.now() - st.mtimeMs < UNNAMED_GRACE_MS) continue;
      await rm(path, { recursive: true, force: true });
      removed.push(path);
    }
    return removed;
  }
}
