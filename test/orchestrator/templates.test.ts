// TemplateStore on a real sqlite file: a database from before the config column is migrated in
// place, rows round-trip with their config, upsert replaces a build, name:tag resolves by tags.
import { Database } from "bun:sqlite";
import { describe, expect, test } from "bun:test";
import { join } from "node:path";
import { TemplateStore, TemplateStoreError, type TemplateRecord } from "../../src/orchestrator/templates.ts";
import { scratchDir } from "../helpers/tmp.ts";

const dir = scratchDir("templates");

function record(over: Partial<TemplateRecord> = {}): TemplateRecord {
  return {
    id: "tpl1", alias: "app", kind: "template", names: ["app:default"], cpuCount: 2, memoryMB: 512, diskSizeMB: 2048,
    layers: ["/l/a.layer"], checkpoint: null, sourceSandboxId: null, envdVersion: "0.6.13", createdAt: 1, config: null, ...over,
  };
}

describe("TemplateStore", () => {
  test("a database made before the config column gets it in place; old rows read with config null", () => {
    const path = join(dir, "old.db");
    const old = new Database(path);
    old.run(`CREATE TABLE templates (id TEXT PRIMARY KEY, alias TEXT UNIQUE, kind TEXT NOT NULL, names TEXT NOT NULL,
      cpu_count INTEGER NOT NULL, memory_mb INTEGER NOT NULL, disk_size_mb INTEGER NOT NULL, layers TEXT NOT NULL,
      checkpoint TEXT NOT NULL, source_sandbox_id TEXT, envd_version TEXT NOT NULL, created_at INTEGER NOT NULL)`);
    old.run(`INSERT INTO templates VALUES ('base1', 'base', 'template', '["base:default"]', 2, 512, 2048, '["/l/base.layer"]', 'null', NULL, '0.6.13', 5)`);
    old.close();
    const db = new Database(path);
    const s = new TemplateStore(db);
    expect(s.resolve("base")).toEqual({ ...record({ id: "base1", alias: "base", names: ["base:default"], layers: ["/l/base.layer"], createdAt: 5 }) });
    // Opening it again finds the column there.
    const again = new TemplateStore(db);
    again.insert(record({ config: { env: { A: "1" }, user: "worker", workdir: "/app", tags: [{ tag: "v1", createdAt: 7 }] } }));
    expect(again.resolve("app")!.config).toEqual({ env: { A: "1" }, user: "worker", workdir: "/app", tags: [{ tag: "v1", createdAt: 7 }] });
    db.close();
  });

  test("upsert replaces a template's build in place; an alias taken by another is refused", () => {
    const s = new TemplateStore(new Database(join(dir, "upsert.db")));
    s.upsert(record());
    s.upsert(record({ layers: ["/l/a.layer", "/l/step.layer"], names: ["app:default", "app:v2"], createdAt: 9 }));
    expect(s.list("template").map((t) => [t.id, t.layers.length, t.createdAt])).toEqual([["tpl1", 2, 9]]);
    s.insert(record({ id: "tpl2", alias: "other", names: ["other:default"] }));
    expect(() => s.upsert(record({ id: "tpl2", alias: "app" }))).toThrow(TemplateStoreError);
  });

  test("name:tag resolves when the template lists the tag; default always does", () => {
    const s = new TemplateStore(new Database(join(dir, "tags.db")));
    s.insert(record({ names: ["app:default", "app:prod"] }));
    expect(s.resolve("app:prod")?.id).toBe("tpl1");
    expect(s.resolve("app:default")?.id).toBe("tpl1");
    expect(s.resolve("tpl1:default")?.id).toBe("tpl1");
    expect(s.resolve("app:staging")).toBeUndefined();
    expect(s.resolve("nope")).toBeUndefined();
  });
});
