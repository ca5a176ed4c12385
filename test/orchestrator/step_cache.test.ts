// StepCache on a real sqlite file and real layer files: rows tie a step to the exact layer under
// it, a missing file is a miss, collection keeps the capacity least recently used first and never
// takes a layer a template uses or one being written.
import { Database } from "bun:sqlite";
import { describe, expect, test } from "bun:test";
import { existsSync, utimesSync, writeFileSync } from "node:fs";
import { rm } from "node:fs/promises";
import { join } from "node:path";
import { StepCache } from "../../src/orchestrator/step_cache.ts";
import { scratchDir } from "../helpers/tmp.ts";

const dir = scratchDir("step-cache");
const KiB = 1024;

function layer(cache: StepCache, step: string, bytes: number): string {
  const path = cache.newLayer(step);
  writeFileSync(path, Buffer.alloc(bytes, 1));
  return path;
}

describe("StepCache", () => {
  test("a step's row is found only over the layer it was sealed on; a missing file is a miss", async () => {
    const c = new StepCache(new Database(join(dir, "a.db")), join(dir, "a"), 1 << 30, () => new Set());
    const a1 = layer(c, "s1", KiB);
    c.put("s1", "/base.layer", a1);
    c.put("s2", a1, null);
    expect(await c.get("s1", "/base.layer")).toBe(a1);
    expect(await c.get("s2", a1)).toBeNull();
    // The same step over another copy of its parent step is a miss.
    const b1 = layer(c, "s1", KiB);
    expect(await c.get("s2", b1)).toBeUndefined();
    // A forced rebuild replaces the row.
    c.put("s1", "/base.layer", b1);
    expect(await c.get("s1", "/base.layer")).toBe(b1);
    await rm(b1);
    expect(await c.get("s1", "/base.layer")).toBeUndefined();
  });

  test("collection: least recently used first, down to the capacity; used and held layers stay; stray files go after their grace", async () => {
    const used = new Set<string>();
    const c = new StepCache(new Database(join(dir, "b.db")), join(dir, "b"), 3 * KiB, () => used);
    const l = [0, 1, 2, 3, 4].map((i) => layer(c, `s${i}`, KiB));
    for (const [i, p] of l.entries()) c.put(`s${i}`, i === 0 ? undefined : l[i - 1], p);
    c.release(l); // the build that wrote them ended
    used.add(l[0]!); // a template's stack
    await Bun.sleep(5);
    await c.get("s1", l[0]); // s1 is now the most recently used
    const writing = c.newLayer("s9");
    writeFileSync(writing, "x");
    utimesSync(writing, new Date(0), new Date(0)); // held: kept however old
    const stray = join(c.dir, "left-by-a-crash.layer");
    writeFileSync(stray, "y");
    const old = join(c.dir, "old-stray.layer");
    writeFileSync(old, "z");
    utimesSync(old, new Date(0), new Date(0));
    const removed = await c.collect();
    // 5 KiB over a 3 KiB capacity: s2 and s3 go (l0 is used, s1 was touched last).
    expect(removed.filter((p) => l.includes(p)).sort()).toEqual([l[2]!, l[3]!].sort());
    expect([l[0], l[1], l[4]].every((p) => existsSync(p!))).toBe(true);
    expect(await c.get("s2", l[1])).toBeUndefined();
    expect(existsSync(writing)).toBe(true);
    expect(existsSync(stray)).toBe(true); // younger than the grace: maybe a build's
    expect(existsSync(old)).toBe(false);
    c.release([writing]);
    expect(await c.collect()).toContain(writing);
    // Two collections at once share one run.
    const [x, y] = [c.collect(), c.collect()];
    expect(x).toBe(y);
    await x;
  });

  test("the first schema's table is dropped", () => {
    const db = new Database(join(dir, "c.db"));
    db.run("CREATE TABLE template_steps (key TEXT PRIMARY KEY, layer TEXT, created_at INTEGER NOT NULL)");
    new StepCache(db, join(dir, "c"), 1, () => new Set());
    expect(db.query("SELECT name FROM sqlite_master WHERE name = 'template_steps'").get()).toBeNull();
  });
});
