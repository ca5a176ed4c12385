import { describe, expect, test } from "bun:test";
import { join } from "node:path";
import { Database } from "bun:sqlite";
import { SandboxStore, StoreError, decodeCursor, encodeCursor, listScope, publicState, type SandboxRecord } from "../../src/orchestrator/store.ts";
import { scratchDir } from "../helpers/tmp.ts";

const dir = scratchDir("store");
let n = 0;

function record(store: SandboxStore, over: Partial<SandboxRecord> = {}): SandboxRecord {
  const startedAt = store.nextStartedAt();
  return {
    id: `sbx${n++}`, state: "running", templateId: "tpl1", alias: "base", metadata: {}, envVars: {},
    startedAt, endAt: startedAt + 300_000, cpuCount: 2, memoryMB: 512, diskSizeMB: 1024,
    envdVersion: "0.6.13", envdAccessToken: "tok", trafficAccessToken: null, autoPause: false,
    autoResume: false, allowInternetAccess: null, network: null, runtime: { slot: 3 }, customExtensionParams: {},
    autoPauseMemory: true, volumeMounts: [], ...over,
  };
}

describe("SandboxStore", () => {
  test("insert, get, fields round-trip; a second insert of one id is a StoreError", () => {
    const s = new SandboxStore(join(dir, "a.db"));
    const r = record(s, { metadata: { k: "v w" }, envVars: { A: "B" }, allowInternetAccess: false, network: { denyOut: ["0.0.0.0/0"] }, autoPauseMemory: false, volumeMounts: [{ name: "v", path: "/data" }] });
    s.insert(r);
    expect(s.get(r.id)).toEqual(r);
    expect(() => s.insert(r)).toThrow(StoreError);
    expect(s.get("nope")).toBeUndefined();
    s.close();
  });

  test("transition is compare-and-set: only the listed source states move", () => {
    const s = new SandboxStore(join(dir, "b.db"));
    const r = record(s);
    s.insert(r);
    expect(s.transition(r.id, ["paused"], "resuming")).toBeUndefined();
    expect(s.get(r.id)!.state).toBe("running");
    const p = s.transition(r.id, ["running"], "pausing", { runtime: { snap: "x" } });
    expect(p?.state).toBe("pausing");
    expect(p?.runtime).toEqual({ snap: "x" });
    expect(s.transition(r.id, ["running"], "pausing")).toBeUndefined();
    expect(s.transition("missing", ["running"], "killing")).toBeUndefined();
    s.close();
  });

  test("two connections racing to pause one sandbox: exactly one wins, both get an answer", async () => {
    const path = join(dir, "race.db");
    const s = new SandboxStore(path);
    const ids: string[] = [];
    for (let i = 0; i < 50; i++) { const r = record(s); s.insert(r); ids.push(r.id); }
    s.close();
    // Two processes, each with its own connection, race over the same 50 rows.
    const script = `
      const { SandboxStore } = await import(${JSON.stringify(join(import.meta.dir, "../../src/orchestrator/store.ts"))});
      const s = new SandboxStore(process.argv[2]);
      const won = [];
      for (const id of JSON.parse(process.argv[3])) if (s.transition(id, ["running"], "pausing")) won.push(id);
      console.log(JSON.stringify(won));`;
    const file = join(dir, "racer.ts");
    await Bun.write(file, script);
    const run = () => Bun.spawn([process.execPath, file, path, JSON.stringify(ids)], { stdout: "pipe" });
    const [a, b] = [run(), run()];
    const [wa, wb] = await Promise.all([new Response(a.stdout).json(), new Response(b.stdout).json()]) as [string[], string[]];
    expect(await a.exited).toBe(0);
    expect(await b.exited).toBe(0);
    expect(wa.length + wb.length).toBe(50);
    expect(new Set([...wa, ...wb]).size).toBe(50);
    const s2 = new SandboxStore(path);
    expect(s2.all().every((r) => r.state === "pausing")).toBe(true);
    s2.close();
  }, 30_000);

  test("four processes opening the database a killed node left (its WAL to recover) all open it and see every row", async () => {
    // One of them recovers the WAL while the others open: they wait for it (busy_timeout) instead
    // of failing with SQLITE_BUSY_RECOVERY, which 5 of 80 such rounds did when the timeout was set
    // after the journal mode.
    const store = JSON.stringify(join(import.meta.dir, "../../src/orchestrator/store.ts"));
    const writer = join(dir, "killed-writer.ts");
    await Bun.write(writer, `
      const { SandboxStore } = await import(${store});
      const s = new SandboxStore(process.argv[2]);
      for (let i = 0; i < 50; i++) s.db.run("INSERT INTO sandboxes (id, state, template_id, metadata, env_vars, started_at, end_at, cpu_count, memory_mb, disk_size_mb, envd_version, envd_access_token, auto_pause, auto_resume, network, runtime) VALUES (?, 'running', 't', '{}', '{}', ?, 0, 1, 1, 1, '0.6.13', 'x', 0, 0, 'null', 'null')", ["w" + i, i]);
      process.kill(process.pid, "SIGKILL");`);
    const opener = join(dir, "opener.ts");
    await Bun.write(opener, `
      const { SandboxStore } = await import(${store});
      console.log(new SandboxStore(process.argv[2]).all().length);`);
    for (let round = 0; round < 20; round++) {
      const path = join(dir, `recover-${round}.db`);
      await Bun.spawn([process.execPath, writer, path]).exited;
      const ps = Array.from({ length: 4 }, () => Bun.spawn([process.execPath, opener, path], { stdout: "pipe", stderr: "pipe" }));
      const outs = await Promise.all(ps.map(async (p) => ({ rc: await p.exited, rows: (await new Response(p.stdout).text()).trim(), err: await new Response(p.stderr).text() })));
      for (const o of outs) expect(o).toEqual({ rc: 0, rows: "50", err: "" });
    }
  }, 120_000);

  test("startedAt is strictly increasing even within one millisecond, and across reopen", () => {
    const path = join(dir, "c.db");
    const s = new SandboxStore(path);
    const t = Date.now() + 60_000;
    const a = s.nextStartedAt(t), b = s.nextStartedAt(t), c = s.nextStartedAt(t - 5);
    expect(b).toBe(a + 1);
    expect(c).toBe(b + 1);
    s.insert(record(s, { startedAt: c }));
    s.close();
    const s2 = new SandboxStore(path);
    expect(s2.nextStartedAt(t)).toBe(c + 1);
    s2.close();
  });

  test("setEndAt: extend-only keeps the later deadline, set may shorten", () => {
    const s = new SandboxStore(join(dir, "d.db"));
    const r = record(s);
    s.insert(r);
    expect(s.setEndAt(r.id, r.endAt - 1000, true)!.endAt).toBe(r.endAt);
    expect(s.setEndAt(r.id, r.endAt + 1000, true)!.endAt).toBe(r.endAt + 1000);
    expect(s.setEndAt(r.id, r.endAt - 1000, false)!.endAt).toBe(r.endAt - 1000);
    s.transition(r.id, ["running"], "killing");
    expect(s.setEndAt(r.id, r.endAt, false)).toBeUndefined();
    s.close();
  });

  test("expired lists running sandboxes past their deadline, oldest first, bounded", () => {
    const s = new SandboxStore(join(dir, "e.db"));
    const now = Date.now();
    const late = record(s, { endAt: now - 10 }), later = record(s, { endAt: now - 20 });
    const paused = record(s, { endAt: now - 30, state: "paused" }), live = record(s, { endAt: now + 10_000 });
    for (const r of [late, later, paused, live]) s.insert(r);
    expect(s.expired(now, 10).map((r) => r.id)).toEqual([later.id, late.id]);
    expect(s.expired(now, 1).map((r) => r.id)).toEqual([later.id]);
    s.close();
  });

  test("list: state, template (id or alias), metadata (all pairs), startedAfter, order, pagination", () => {
    const s = new SandboxStore(join(dir, "f.db"));
    const rs = [
      record(s, { metadata: { team: "a", k: "1" } }),
      record(s, { metadata: { team: "a" }, state: "paused" }),
      record(s, { metadata: { team: "b" }, templateId: "tpl2", alias: null }),
      record(s, { metadata: { team: "a", k: "1" }, state: "pausing" }),
    ];
    for (const r of rs) s.insert(r);
    const ids = (q: Parameters<SandboxStore["list"]>[0]) => s.list(q).items.map((r) => r.id);
    expect(ids({ limit: 100 })).toEqual(rs.map((r) => r.id).reverse());
    expect(ids({ limit: 100, order: "asc" })).toEqual(rs.map((r) => r.id));
    expect(ids({ limit: 100, states: ["paused"] })).toEqual([rs[3]!.id, rs[1]!.id]);
    expect(ids({ limit: 100, states: ["running"] })).toEqual([rs[2]!.id, rs[0]!.id]);
    expect(ids({ limit: 100, states: ["running", "paused"] }).length).toBe(4);
    expect(ids({ limit: 100, template: "tpl2" })).toEqual([rs[2]!.id]);
    expect(ids({ limit: 100, template: "base" }).length).toBe(3);
    expect(ids({ limit: 100, template: "unknown" })).toEqual([]);
    expect(ids({ limit: 100, metadata: { team: "a", k: "1" } })).toEqual([rs[3]!.id, rs[0]!.id]);
    expect(ids({ limit: 100, startedAfter: rs[2]!.startedAt })).toEqual([rs[3]!.id, rs[2]!.id]);
    // Pagination under a metadata filter: the token points just past the last item returned,
    // and the last page carries none.
    const p1 = s.list({ limit: 1, metadata: { team: "a" } });
    expect(p1.items.map((r) => r.id)).toEqual([rs[3]!.id]);
    expect(p1.nextToken).toBeDefined();
    const p2 = s.list({ limit: 1, metadata: { team: "a" }, nextToken: p1.nextToken });
    expect(p2.items.map((r) => r.id)).toEqual([rs[1]!.id]);
    const p3 = s.list({ limit: 1, metadata: { team: "a" }, nextToken: p2.nextToken });
    expect(p3.items.map((r) => r.id)).toEqual([rs[0]!.id]);
    expect(p3.nextToken).toBeUndefined();
    expect(() => s.list({ limit: 0 })).toThrow(StoreError);
    expect(() => s.list({ limit: 101 })).toThrow(StoreError);
    expect(() => s.list({ limit: 1, nextToken: "garbage!" })).toThrow(StoreError);
    s.close();
  });

  test("cursor encoding round-trips and refuses foreign tokens and other lists' tokens", () => {
    const scope = listScope("sandboxes", ["desc"]);
    expect(decodeCursor(encodeCursor(1700000000123, "abc9", scope), scope)).toEqual({ at: 1700000000123, id: "abc9" });
    expect(decodeCursor(encodeCursor(5, "tpl_a.b-c", scope), scope)).toEqual({ at: 5, id: "tpl_a.b-c" });
    expect(() => decodeCursor(Buffer.from("x__y").toString("base64url"), scope)).toThrow("not a token this node issued");
    expect(() => decodeCursor("", scope)).toThrow(StoreError);
    expect(() => decodeCursor(encodeCursor(5, "abc9", listScope("snapshots", [])), scope)).toThrow("another list");
    const s = new SandboxStore(join(dir, "scope.db"));
    for (let i = 0; i < 3; i++) s.insert(record(s, { metadata: { team: "a" } }));
    const page = s.list({ limit: 1 });
    expect(page.nextToken).toBeDefined();
    expect(s.list({ limit: 1, nextToken: page.nextToken }).items.length).toBe(1);
    // The token of the default list (desc, no filters) is no page of another order or filter.
    expect(() => s.list({ limit: 1, order: "asc", nextToken: page.nextToken })).toThrow("another list");
    expect(() => s.list({ limit: 1, metadata: { team: "a" }, nextToken: page.nextToken })).toThrow("another list");
    expect(() => s.list({ limit: 1, states: ["running"], nextToken: page.nextToken })).toThrow("another list");
    s.close();
  });

  test("customExtensionParams: kept with the row, replaced only while running; an older table gains the column", () => {
    const path = join(dir, "ext.db");
    // A table as it was before the column existed, with one row.
    const old = new Database(path, { create: true });
    old.run(`CREATE TABLE sandboxes (id TEXT PRIMARY KEY, state TEXT NOT NULL, template_id TEXT NOT NULL, alias TEXT, metadata TEXT NOT NULL,
      env_vars TEXT NOT NULL, started_at INTEGER NOT NULL UNIQUE, end_at INTEGER NOT NULL, cpu_count INTEGER NOT NULL, memory_mb INTEGER NOT NULL,
      disk_size_mb INTEGER NOT NULL, envd_version TEXT NOT NULL, envd_access_token TEXT NOT NULL, traffic_access_token TEXT,
      auto_pause INTEGER NOT NULL, auto_resume INTEGER NOT NULL, allow_internet_access INTEGER, network TEXT NOT NULL, runtime TEXT NOT NULL)`);
    old.run(`INSERT INTO sandboxes VALUES ('oldrow', 'running', 't', NULL, '{}', '{}', 1, 2, 1, 256, 64, '0.6.13', 'tok', NULL, 0, 0, NULL, 'null', 'null')`);
    old.close();
    const s = new SandboxStore(path);
    expect(s.get("oldrow")!.customExtensionParams).toEqual({});
    // And the later columns, with their defaults: a memory pause, no volumes.
    expect(s.get("oldrow")!.autoPauseMemory).toBe(true);
    expect(s.get("oldrow")!.volumeMounts).toEqual([]);
    const r = record(s, { customExtensionParams: { gpu: { count: 1 } } });
    s.insert(r);
    expect(s.get(r.id)!.customExtensionParams).toEqual({ gpu: { count: 1 } });
    expect(s.setExtensionParams(r.id, { gpu: null, b: [1] })!.customExtensionParams).toEqual({ gpu: null, b: [1] });
    s.transition(r.id, ["running"], "paused");
    expect(s.setExtensionParams(r.id, {})).toBeUndefined();
    expect(s.get(r.id)!.customExtensionParams).toEqual({ gpu: null, b: [1] });
    s.close();
  });

  test("publicState maps transitional states as E2B reports them", () => {
    expect(publicState("pausing")).toBe("paused");
    expect(publicState("paused")).toBe("paused");
    for (const s of ["creating", "running", "resuming", "snapshotting", "forking", "killing"] as const) expect(publicState(s)).toBe("running");
  });
});
