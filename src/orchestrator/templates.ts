// TemplateStore: what a sandbox can start from, in the node's database. A template is a stack of
// read-only rootfs layers (lowest first) plus, once booted, a VM snapshot whose memory and device
// state every create restores; a snapshot taken from a sandbox is a template of kind "snapshot".
import type { Database } from "bun:sqlite";
import type { LayerRef } from "../storage/image_config.ts";

export type TemplateKind = "template" | "snapshot";

/**
 * A layer left in a registry (a lazy pull): blockd's workers read it by Range through the node's
 * block cache; as a blockd lower it is passed as it is (docs/storage.md, Remote layers).
 */
export type RemoteLayer = Required<Pick<LayerRef, "digest" | "size" | "remote">>;
/** One rootfs layer: a sealed layer file's path, or a remote layer. */
export type TemplateLayer = string | RemoteLayer;

export const isRemoteLayer = (l: TemplateLayer): l is RemoteLayer => typeof l !== "string";
/** A layer's name in keys and pin sets: its path, or `remote:<digest>`. */
export const layerKey = (l: TemplateLayer): string => (typeof l === "string" ? l : `remote:${l.digest}`);
/** The layer files of a stack (a remote layer has none here). */
export const localLayers = (ls: readonly TemplateLayer[]): string[] => ls.filter((l): l is string => typeof l === "string");

export interface VmCheckpoint {
  /** Directory of the VMM's snapshot (snapshot.json, device state, memory). */
  dir: string;
  /** Rootfs layers at the checkpoint, lowest first: the template's plus the sealed upper. */
  layers: TemplateLayer[];
  /** The access token envd held when checkpointed: a restore re-initialises envd with it. */
  envdToken: string | null;
  /** Memory layers, lowest first: restores map a blockd read-only device over them (none: the snapshot's own memory file). */
  memLayers?: string[];
  /** No VM state to restore: a start boots the template's kernel on `layers` (a filesystem-only pause, a sandbox with volumes). */
  boot?: true;
}

export interface TemplateRecord {
  id: string;
  /** Unique among live templates; E2B's alias / snapshot name. */
  alias: string | null;
  kind: TemplateKind;
  /** Full names with tag, as E2B lists them (`name:default`). */
  names: string[];
  cpuCount: number;
  memoryMB: number;
  diskSizeMB: number;
  /** The rootfs stack a cold boot starts from, lowest first. */
  layers: TemplateLayer[];
  /** Set once the template has been booted and checkpointed; creates restore it. */
  checkpoint: VmCheckpoint | null;
  /** The sandbox a snapshot was taken from. */
  sourceSandboxId: string | null;
  envdVersion: string;
  createdAt: number;
  /** What its sandboxes start with (a built or pulled template); null: envd's defaults. */
  config?: TemplateConfig | null;
}

/**
 * A template's run-time defaults, from its image's OCI config or its build's ENV/USER/WORKDIR:
 * envd gets them at every create (`/init` env vars, default user and working directory).
 */
export interface TemplateConfig {
  env: Record<string, string>;
  user?: string;
  workdir?: string;
  startCmd?: string;
  readyCmd?: string;
  /** The image's ExposedPorts and Labels plus EXPOSE and LABEL steps: kept, not acted on (no readyCmd comes of a port). */
  exposed?: string[];
  labels?: Record<string, string>;
  /** The image's Entrypoint and Cmd: run only when the build asked (imageCmd), then as startCmd. */
  entrypoint?: string[];
  cmd?: string[];
  /** The build that made it (E2B's buildID). */
  buildId?: string;
  /** Tags (E2B `name:tag`): each names this template's one kept build; `default` always does. */
  tags?: { tag: string; createdAt: number }[];
}

export class TemplateStoreError extends Error {
  constructor(message: string) { super(message); this.name = "TemplateStoreError"; }
}

interface Row {
  id: string; alias: string | null; kind: string; names: string; cpu_count: number; memory_mb: number;
  disk_size_mb: number; layers: string; checkpoint: string; source_sandbox_id: string | null;
  envd_version: string; created_at: number; config: string | null;
}

function toRecord(r: Row): TemplateRecord {
  return {
    id: r.id, alias: r.alias, kind: r.kind as TemplateKind, names: JSON.parse(r.names), cpuCount: r.cpu_count,
    memoryMB: r.memory_mb, diskSizeMB: r.disk_size_mb, layers: JSON.parse(r.layers), checkpoint: JSON.parse(r.checkpoint),
    sourceSandboxId: r.source_sandbox_id, envdVersion: r.envd_version, createdAt: r.created_at,
    config: r.config === null ? null : JSON.parse(r.config),
  };
}

export class TemplateStore {
  constructor(private readonly db: Database) {
    db.run(`CREATE TABLE IF NOT EXISTS templates (
      id TEXT PRIMARY KEY,
      alias TEXT UNIQUE,
      kind TEXT NOT NULL,
      names TEXT NOT NULL,
      cpu_count INTEGER NOT NULL,
      memory_mb INTEGER NOT NULL,
      disk_size_mb INTEGER NOT NULL,
      layers TEXT NOT NULL,
      checkpoint TEXT NOT NULL,
      source_sandbox_id TEXT,
      envd_version TEXT NOT NULL,
      created_at INTEGER NOT NULL,
      config TEXT
    )`);
    // Databases made before the config column: added in place (NULL: envd's defaults).
    const cols = db.query<{ name: string }, []>("PRAGMA table_info(templates)").all().map((c) => c.name);
    if (!cols.includes("config")) db.run("ALTER TABLE templates ADD COLUMN config TEXT");
  }

  insert(t: TemplateRecord): void {
    try {
      this.db.query(`INSERT INTO templates (id, alias, kind, names, cpu_count, memory_mb, disk_size_mb, layers, checkpoint,
        source_sandbox_id, envd_version, created_at, config) VALUES ($id, $alias, $kind, $names, $cpu, $mem, $disk, $layers, $checkpoint, $src, $envd, $created, $config)`).run(this.params(t));
    } catch (e) {
      const msg = (e as Error).message;
      if (msg.includes("templates.alias")) throw new TemplateStoreError(`alias '${t.alias}' is taken`);
      throw new TemplateStoreError(`insert template ${t.id}: ${msg}`);
    }
  }

  private params(t: TemplateRecord) {
    return {
      id: t.id, alias: t.alias, kind: t.kind, names: JSON.stringify(t.names), cpu: t.cpuCount, mem: t.memoryMB,
      disk: t.diskSizeMB, layers: JSON.stringify(t.layers), checkpoint: JSON.stringify(t.checkpoint),
      src: t.sourceSandboxId, envd: t.envdVersion, created: t.createdAt, config: t.config ? JSON.stringify(t.config) : null,
    };
  }

  /** A finished build in place of the template's previous one (same id), or a new template. */
  upsert(t: TemplateRecord): void {
    if (!this.db.query("SELECT 1 FROM templates WHERE id = ?").get(t.id)) return this.insert(t);
    try {
      this.db.query(`UPDATE templates SET alias = $alias, kind = $kind, names = $names, cpu_count = $cpu, memory_mb = $mem,
        disk_size_mb = $disk, layers = $layers, checkpoint = $checkpoint, source_sandbox_id = $src, envd_version = $envd,
        created_at = $created, config = $config WHERE id = $id`).run(this.params(t));
    } catch (e) {
      const msg = (e as Error).message;
      if (msg.includes("templates.alias")) throw new TemplateStoreError(`alias '${t.alias}' is taken`);
      throw new TemplateStoreError(`update template ${t.id}: ${msg}`);
    }
  }

  /**
   * By id, alias, or a tag-qualified name (`name:tag`, `id:tag`): `default` names every template,
   * another tag only a template whose `names` list it.
   */
  resolve(ref: string): TemplateRecord | undefined {
    const colon = ref.lastIndexOf(":");
    const bare = colon < 0 ? ref : ref.slice(0, colon);
    const tag = colon < 0 ? "default" : ref.slice(colon + 1);
    const r = this.db.query<Row, [string, string]>("SELECT * FROM templates WHERE id = ? OR alias = ? LIMIT 1").get(bare, bare);
    if (!r) return undefined;
    const t = toRecord(r);
    if (tag === "default" || t.names.includes(`${t.alias ?? t.id}:${tag}`)) return t;
    return undefined;
  }

  setCheckpoint(id: string, checkpoint: VmCheckpoint | null): void {
    this.db.query("UPDATE templates SET checkpoint = ? WHERE id = ?").run(JSON.stringify(checkpoint), id);
  }

  delete(id: string): boolean {
    return this.db.query("DELETE FROM templates WHERE id = ?").run(id).changes === 1;
  }

  list(kind: TemplateKind, filter: { sourceSandboxId?: string; name?: string } = {}): TemplateRecord[] {
    return this.db.query<Row, [string]>("SELECT * FROM templates WHERE kind = ? ORDER BY created_at DESC, id").all(kind).map(toRecord)
      .filter((t) => filter.sourceSandboxId === undefined || t.sourceSandboxId === filter.sourceSandboxId)
      .filter((t) => {
        if (filter.name === undefined) return true;
        const n = filter.name.endsWith(":default") ? filter.name.slice(0, -":default".length) : filter.name;
        return t.id === n || t.alias === n || t.names.includes(filter.name);
      });
  }

  /** Layer files any template still uses (remote layers as `remote:<digest>`): a layer outlives the sandbox that sealed it while listed here. */
  layersInUse(): Set<string> {
    const used = new Set<string>();
    for (const r of this.db.query<{ layers: string; checkpoint: string }, []>("SELECT layers, checkpoint FROM templates").all()) {
      for (const l of JSON.parse(r.layers) as TemplateLayer[]) used.add(layerKey(l));
      const cp = JSON.parse(r.checkpoint) as VmCheckpoint | null;
      for (const l of cp?.layers ?? []) used.add(layerKey(l));
    }
    return used;
  }

  /** Every remote layer templates name (their stacks and checkpoints), once per digest. */
  remoteLayers(): RemoteLayer[] {
    const out = new Map<string, RemoteLayer>();
    for (const r of this.db.query<{ layers: string; checkpoint: string }, []>("SELECT layers, checkpoint FROM templates").all()) {
      const cp = JSON.parse(r.checkpoint) as VmCheckpoint | null;
      for (const l of [...(JSON.parse(r.layers) as TemplateLayer[]), ...(cp?.layers ?? [])]) if (isRemoteLayer(l)) out.set(l.digest, l);
    }
    return [...out.values()];
  }
}
