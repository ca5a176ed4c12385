// Volumes (docs/volumes.md): E2B's persistent volumes, each an ext4 file system on a stack of
// sealed overlaybd layers under $AENV_HOME/volumes/<id>/, lowest first, the node's empty ext4
// layer at the bottom. A volume is opened as a blockd writable device over its stack and closed
// by sealing that device's upper into one more layer (only when it was written); past
// layersMax layers a close commits the stack into one. One writer at a time: a sandbox that
// mounts the volume holds it (attach .. detach) and the content API answers 409 meanwhile;
// content calls run one at a time per volume (a bounded queue) on a device kept open for a
// short idle time. Records live in the node's database; the holder survives a node restart.
// In a cluster (`shared`, volume_shared.ts) the record is the cluster's: a node claims a volume
// before it opens its device (its layers fetched from the shared store), and publishes the layers
// it sealed when it closes it; the node's row is its cache of the record and of the claim.

import type { Database } from "bun:sqlite";
import { randomUUID } from "node:crypto";
import { copyFile, link, mkdir, open, readdir, rename, rm } from "node:fs/promises";
import { basename, dirname, join } from "node:path";
import type { BlockdClient } from "../blockdev/client.ts";
import { asOrchestratorError, OrchestratorError } from "./errors.ts";
import { randomId } from "./ids.ts";
import { Turns } from "./turns.ts";
import type { ListedDevice } from "./orphans.ts";
import { type EntryMeta, type VolumeEntry, VolumeFs, volumePath } from "./volume_fs.ts";
import {
  ClaimLapsed, digestName, fetchMissing, makeSharedVolume, nameByContent, SEQ_LAYER, waitForClaim, type SharedVolume, type SharedVolumes, type VolumeClaim,
} from "./volume_shared.ts";

/** Volumes one node keeps (in a cluster: the cluster keeps); past it a create is 429. */
export const VOLUMES_MAX = 1024;
/** Sealed layers a volume stacks before a close commits them into one. */
export const VOLUME_LAYERS_MAX = 16;
/** A volume's device stays open this long after its last content call. */
export const VOLUME_IDLE_MS = 10_000;
/** Content calls waiting on one volume; past it: 429. */
export const VOLUME_QUEUE_MAX = 64;
/** How long a call waits for its turn on a volume before it gives up (503). */
export const VOLUME_WAIT_MS = 5 * 60_000;
/** Volumes open for content calls at once (a blockd device and worker each); past it the idlest closes, or 429. */
export const VOLUMES_OPEN_MAX = 16;
/** File uploads being received at once (each a temporary file up to a volume's size); past it: 429. */
export const UPLOADS_MAX = 8;
/** E2B's NewVolume name, at most 128 characters. */
export const VOLUME_NAME = /^[a-zA-Z0-9_-]{1,128}$/;

const MiB = 2 ** 20;
/** The writable upper of an open volume's device, in its folder. */
const UPPER = "upper";
/** Beside the volumes' folders: the cache of empty ext4 layers (the node's volume_layers.ts), uploads being received. */
export const VOLUME_EMPTY_DIR = "empty";
const UPLOADS_DIR = "uploads";
/** Layer files: a six-digit sequence number (the bottom, the empty ext4, 000000), or in a cluster the sha256 of a published one. */
const LAYER_FILE = /^(\d{6}|[0-9a-f]{64})\.layer$/;
const layerName = (n: number) => `${String(n).padStart(6, "0")}.layer`;
/** A content API token: 32 random bytes. */
const newToken = () => Buffer.from(crypto.getRandomValues(new Uint8Array(32))).toString("base64url");
/** A volume's blockd device id: found again in blockd's table after a node restart. */
const DEVICE_PREFIX = "vol-";

export interface VolumeRecord {
  id: string;
  name: string;
  /** The content API's bearer token (E2B's VolumeAndToken.token). */
  token: string;
  sizeMB: number;
  /** Layer files in the volume's folder, lowest first. */
  layers: string[];
  /** The sandbox that has it mounted; null: none. */
  holder: string | null;
  /** The blockd device open over the stack, if one is. */
  device: { id: string; path: string } | null;
  /** A sandbox used it since the last host call: its journal is replayed first. */
  replay: boolean;
  /** In a cluster: this node's claim on it (kept across a node restart). */
  claim: VolumeClaim | null;
  createdAt: number;
}

export interface VolumeStoreOptions {
  /** $AENV_HOME/volumes. */
  dir: string;
  /** Size of a new volume's file system (AENV_VOLUME_SIZE_MB). */
  sizeMB: number;
  /** The sealed empty ext4 layer of `sizeBytes`, made once (src/template's, handed in by the node). */
  emptyLayer: (sizeBytes: number) => Promise<string>;
  /** `layers` (lowest first) committed into one sealed layer file `out` (src/storage's, handed in by the node). */
  commit: (layers: string[], out: string) => Promise<void>;
  /** Default VOLUME_LAYERS_MAX. */
  layersMax?: number;
  /** Default VOLUME_IDLE_MS. */
  idleMs?: number;
  /** In a cluster whose nodes share the snapshot store: the cluster's record of each volume (the node's). */
  shared?: SharedVolumes;
}

interface Row {
  id: string; name: string; token: string; size_mb: number; layers: string; holder: string | null;
  device: string | null; replay: number; claim: string | null; created_at: number;
}

const toRecord = (r: Row): VolumeRecord => ({
  id: r.id, name: r.name, token: r.token, sizeMB: r.size_mb, layers: JSON.parse(r.layers), holder: r.holder,
  device: r.device === null ? null : JSON.parse(r.device), replay: r.replay !== 0,
  claim: r.claim === null ? null : JSON.parse(r.claim), createdAt: r.created_at,
});

/** What the node holds in memory for a volume: its turns, its open device, whether that was written, its claim in a cluster. */
interface Live {
  turns: Turns;
  claim?: VolumeClaim;
  device?: { id: string; path: string };
  dirty: boolean;
  idle?: Timer;
  lastUsed: number;
}

export class VolumeStore {
  private readonly live = new Map<string, Live>();
  private uploads = 0;
  readonly layersMax: number;
  private readonly idleMs: number;

  constructor(private readonly db: Database, private readonly blockd: BlockdClient, private readonly opts: VolumeStoreOptions) {
    this.layersMax = opts.layersMax ?? VOLUME_LAYERS_MAX;
    this.idleMs = opts.idleMs ?? VOLUME_IDLE_MS;
    db.run(`CREATE TABLE IF NOT EXISTS volumes (
      id TEXT PRIMARY KEY,
      name TEXT NOT NULL UNIQUE,
      token TEXT NOT NULL,
      size_mb INTEGER NOT NULL,
      layers TEXT NOT NULL,
      holder TEXT,
      device TEXT,
      replay INTEGER NOT NULL DEFAULT 0,
      claim TEXT,
      created_at INTEGER NOT NULL
    )`);
    // A database from before claims: the column is added (empty).
    if (!db.query<{ name: string }, []>("PRAGMA table_info(volumes)").all().some((c) => c.name === "claim")) db.run("ALTER TABLE volumes ADD COLUMN claim TEXT");
  }

  // ─── records ───────────────────────────────────────────────────────────────

  get(id: string): VolumeRecord | undefined {
    const r = this.db.query<Row, [string]>("SELECT * FROM volumes WHERE id = ?").get(id);
    return r ? toRecord(r) : undefined;
  }

  byName(name: string): VolumeRecord | undefined {
    const r = this.db.query<Row, [string]>("SELECT * FROM volumes WHERE name = ?").get(name);
    return r ? toRecord(r) : undefined;
  }

  list(): VolumeRecord[] {
    return this.db.query<Row, []>("SELECT * FROM volumes ORDER BY created_at, id").all().map(toRecord);
  }

  /** The volume, or 404. */
  info(id: string): VolumeRecord {
    const r = this.get(id);
    if (!r) throw new OrchestratorError(404, `volume ${id} not found`);
    return r;
  }

  /** The volume as the routes see it: in a cluster the cluster's record (this node's row made from it), else the row. */
  async find(id: string): Promise<VolumeRecord | undefined> {
    const shared = this.opts.shared;
    if (!shared) return this.get(id);
    const s = await shared.get(id);
    if (!s) {
      await this.forgetStale(id);
      return undefined;
    }
    return this.mirror(s);
  }

  /** find, or 404. */
  async describe(id: string): Promise<VolumeRecord> {
    const r = await this.find(id);
    if (!r) throw new OrchestratorError(404, `volume ${id} not found`);
    return r;
  }

  /** The volumes the routes list: in a cluster every node's, else this node's. */
  async catalog(): Promise<{ id: string; name: string }[]> {
    const shared = this.opts.shared;
    if (!shared) return this.list().map((r) => ({ id: r.id, name: r.name }));
    const all = await shared.list(VOLUMES_MAX);
    return all.sort((a, b) => a.createdAt - b.createdAt || a.id.localeCompare(b.id)).map((r) => ({ id: r.id, name: r.name }));
  }

  /** A volume named or with the ID `nameOrId` (a name first): in a cluster from its record. */
  private async lookup(nameOrId: string): Promise<VolumeRecord | undefined> {
    const shared = this.opts.shared;
    if (!shared) return this.byName(nameOrId) ?? this.get(nameOrId);
    const s = (await shared.byName(nameOrId)) ?? (await shared.get(nameOrId));
    return s ? this.mirror(s) : undefined;
  }

  /** This node's row for a volume of the cluster: made (no layers cached yet) when it has none; a stale row of the same name goes. */
  private mirror(s: SharedVolume): VolumeRecord {
    const have = this.get(s.id);
    if (have) return have;
    const stale = this.byName(s.name);
    if (stale) void this.forgetStale(stale.id);
    this.db.query(`INSERT INTO volumes (id, name, token, size_mb, layers, holder, device, replay, claim, created_at)
      VALUES ($id, $name, $token, $size_mb, '[]', NULL, NULL, $replay, NULL, $created_at)`).run({
      id: s.id, name: s.name, token: s.token, size_mb: s.sizeMB, replay: s.replay ? 1 : 0, created_at: s.createdAt,
    });
    return this.info(s.id);
  }

  /** The cluster has no volume `id` (deleted on another node): this node's row and cached layers go, unless it has the volume open. */
  private async forgetStale(id: string): Promise<void> {
    const rec = this.get(id);
    const v = this.live.get(id);
    if (!rec || rec.holder || v?.device || v?.claim || v?.turns.busy) return;
    this.db.query("DELETE FROM volumes WHERE id = ?").run(id);
    this.live.delete(id);
    await rm(this.volumeDir(id), { recursive: true, force: true });
  }

  private set(id: string, fields: Partial<Pick<Row, "layers" | "device" | "replay" | "claim">>): void {
    const keys = Object.keys(fields) as (keyof typeof fields)[];
    if (!keys.length) return;
    this.db.query(`UPDATE volumes SET ${keys.map((k) => `${k} = $${k}`).join(", ")} WHERE id = $id`).run({ id, ...fields } as Record<string, string | number | null>);
  }
  private setLayers(rec: VolumeRecord, layers: string[]): void {
    rec.layers = layers;
    this.set(rec.id, { layers: JSON.stringify(layers) });
  }
  private setDevice(id: string, device: { id: string; path: string } | null): void {
    this.set(id, { device: device === null ? null : JSON.stringify(device) });
  }
  private setClaim(rec: VolumeRecord, v: Live, claim: VolumeClaim | undefined): void {
    v.claim = claim;
    rec.claim = claim ?? null;
    this.set(rec.id, { claim: claim ? JSON.stringify(claim) : null });
  }

  private volumeDir(id: string): string {
    return join(this.opts.dir, id);
  }

  private liveOf(id: string): Live {
    let v = this.live.get(id);
    if (!v) this.live.set(id, (v = { turns: new Turns(), dirty: false, lastUsed: 0 }));
    return v;
  }

  /** A new volume: its folder with the empty ext4 layer at the bottom of its stack, then its row. */
  async create(name: string): Promise<VolumeRecord> {
    if (typeof name !== "string" || !VOLUME_NAME.test(name)) throw new OrchestratorError(400, `name: must match ${VOLUME_NAME.source}`);
    if (this.opts.shared) return this.createShared(name, this.opts.shared);
    if (this.byName(name)) throw new OrchestratorError(409, `a volume named ${name} exists`);
    const count = this.db.query<{ n: number }, []>("SELECT COUNT(*) AS n FROM volumes").get()!.n;
    if (count >= VOLUMES_MAX) throw new OrchestratorError(429, `this node keeps at most ${VOLUMES_MAX} volumes`);
    const rec: VolumeRecord = {
      id: randomUUID(), name, token: newToken(), sizeMB: this.opts.sizeMB, layers: [layerName(0)], holder: null, device: null, replay: false, claim: null, createdAt: Date.now(),
    };
    const dir = this.volumeDir(rec.id);
    await mkdir(dir, { recursive: true });
    try {
      const empty = await this.opts.emptyLayer(rec.sizeMB * MiB);
      // A link: the cache may collect its file, the volume keeps its own name for the same bytes.
      await link(empty, join(dir, layerName(0))).catch(() => copyFile(empty, join(dir, layerName(0))));
      this.db.query(`INSERT INTO volumes (id, name, token, size_mb, layers, holder, device, replay, created_at)
        VALUES ($id, $name, $token, $size_mb, $layers, NULL, NULL, 0, $created_at)`).run({
        id: rec.id, name, token: rec.token, size_mb: rec.sizeMB, layers: JSON.stringify(rec.layers), created_at: rec.createdAt,
      });
    } catch (e) {
      await rm(dir, { recursive: true, force: true });
      if (/UNIQUE/.test((e as Error).message)) throw new OrchestratorError(409, `a volume named ${name} exists`);
      throw asOrchestratorError(e, `volume ${name}`);
    }
    return rec;
  }

  /**
   * In a cluster: the bottom layer, the empty ext4, named by its sha256 and put into the shared
   * store with the record; the name is the cluster's (409 when any node has it).
   */
  private async createShared(name: string, shared: SharedVolumes): Promise<VolumeRecord> {
    if (await shared.byName(name)) throw new OrchestratorError(409, `a volume named ${name} exists`);
    if ((await shared.list(VOLUMES_MAX)).length >= VOLUMES_MAX) throw new OrchestratorError(429, `the cluster keeps at most ${VOLUMES_MAX} volumes`);
    const id = randomUUID();
    const s = await makeSharedVolume(shared, { id, name, token: newToken(), sizeMB: this.opts.sizeMB, createdAt: Date.now(), replay: false, epoch: 0 },
      this.volumeDir(id), () => this.opts.emptyLayer(this.opts.sizeMB * MiB)).catch((e) => {
      throw asOrchestratorError(e, `volume ${name}`);
    });
    const rec = this.mirror(s);
    this.setLayers(rec, [digestName(s.layers[0]!)]);
    return rec;
  }

  /** The volume and its layers gone; 409 while a sandbox has it mounted (in a cluster: on any node). */
  async destroy(id: string): Promise<void> {
    const rec = this.opts.shared ? await this.describe(id) : this.info(id);
    this.refuseHeld(rec);
    const v = this.liveOf(id);
    const done = await v.turns.take(Number.POSITIVE_INFINITY, VOLUME_WAIT_MS, `volume ${rec.name}`);
    try {
      const cur = this.info(id);
      this.refuseHeld(cur);
      clearTimeout(v.idle);
      // In a cluster it is claimed first (nobody else has it open), and goes with its claim.
      if (this.opts.shared) await this.claimed(cur, v, null, { fetch: false });
      if (v.device) await this.blockd.call("delete", { id: v.device.id });
      v.device = undefined;
      if (this.opts.shared && v.claim) {
        await this.opts.shared.destroy(id, v.claim).catch((e) => {
          if (e instanceof ClaimLapsed) throw new OrchestratorError(503, `volume ${rec.name}: this node's claim lapsed while deleting it (${e.message}); try again`);
          throw e;
        });
        v.claim = undefined;
      }
      this.db.query("DELETE FROM volumes WHERE id = ?").run(id);
      this.live.delete(id);
    } finally {
      done();
    }
    await rm(this.volumeDir(id), { recursive: true, force: true });
  }

  private refuseHeld(rec: VolumeRecord): void {
    if (rec.holder) throw new OrchestratorError(409, `volume ${rec.name} is mounted by sandbox ${rec.holder}`);
  }

  // ─── sandboxes ─────────────────────────────────────────────────────────────

  /**
   * Sandbox `sandboxId` takes the volume named `nameOrId` (a name first, then an id) for its VM:
   * the device open over the volume's stack. 404 unknown, 409 held by another sandbox; its holder
   * gets the same device again (a resume). It waits for a content call under way; from then on
   * content calls get 409 until detach. In a cluster it is claimed for the sandbox first: 409 while
   * a sandbox of another node mounts it, a wait while another node's content calls have it.
   */
  async attach(nameOrId: string, sandboxId: string): Promise<{ volumeID: string; name: string; devicePath: string }> {
    const rec = await this.lookup(nameOrId);
    if (!rec) throw new OrchestratorError(404, `volume ${nameOrId} not found`);
    const again = rec.holder === sandboxId;
    // Taken in the row at once (compare and set): of two racing attaches one wins, the other is 409.
    if (!again && this.db.query("UPDATE volumes SET holder = ? WHERE id = ? AND holder IS NULL").run(sandboxId, rec.id).changes !== 1) this.refuseHeld(this.info(rec.id));
    const v = this.liveOf(rec.id);
    try {
      const done = await v.turns.take(Number.POSITIVE_INFINITY, VOLUME_WAIT_MS, `volume ${rec.name}`);
      try {
        clearTimeout(v.idle);
        const cur = this.info(rec.id);
        if (cur.holder !== sandboxId) this.refuseHeld(cur);
        await this.claimed(cur, v, sandboxId, { guestHasIt: again && v.device !== undefined });
        if (!v.device) await this.openDevice(cur, v);
        // The guest writes it (its mount alone does) and may stop without unmounting.
        v.dirty = true;
        this.set(rec.id, { replay: 1 });
        return { volumeID: rec.id, name: rec.name, devicePath: v.device!.path };
      } finally {
        done();
      }
    } catch (e) {
      if (!again) this.db.query("UPDATE volumes SET holder = NULL WHERE id = ? AND holder = ?").run(rec.id, sandboxId);
      // A device or claim it took is given back once idle.
      if (!again && (v.device || v.claim)) this.closeLater(rec.id);
      throw asOrchestratorError(e, `volume ${rec.name}`);
    }
  }

  /** Every volume sandbox `sandboxId` holds is closed (its writes sealed) and free again. Idempotent. */
  async detach(sandboxId: string): Promise<void> {
    const failed: string[] = [];
    for (const id of this.heldBy(sandboxId)) {
      const v = this.liveOf(id);
      const done = await v.turns.take(Number.POSITIVE_INFINITY, VOLUME_WAIT_MS, `volume ${id}`);
      try {
        const rec = this.get(id);
        if (!rec || rec.holder !== sandboxId) continue;
        await this.closeDevice(rec, v).catch((e) => failed.push(`volume ${rec.name}: ${(e as Error).message}`));
        // Free even when the seal failed: the upper stays open with the writes, sealed by a later close.
        this.db.query("UPDATE volumes SET holder = NULL WHERE id = ? AND holder = ?").run(id, sandboxId);
      } finally {
        done();
        if (v.device || v.claim) this.closeLater(id);
      }
    }
    if (failed.length) throw new OrchestratorError(500, `detaching sandbox ${sandboxId}: ${failed.join("; ")}`);
  }

  /** Ids of the volumes `sandboxId` holds. */
  heldBy(sandboxId: string): string[] {
    return this.db.query<{ id: string }, [string]>("SELECT id FROM volumes WHERE holder = ? ORDER BY id").all(sandboxId).map((r) => r.id);
  }

  /** Each open volume device with who has it open (the device report and the leak census name them). */
  holders(): Map<string, string> {
    const out = new Map<string, string>();
    for (const [id, v] of this.live) {
      if (!v.device) continue;
      const rec = this.get(id);
      out.set(v.device.id, `volume ${rec?.name ?? "?"} (${id}): ${rec?.holder ? `mounted by sandbox ${rec.holder}` : "content API"}`);
    }
    return out;
  }

  /** Volumes whose holder is not a sandbox of this node any more are detached (after a restart). */
  async detachGone(exists: (sandboxId: string) => boolean): Promise<string[]> {
    const gone = [...new Set(this.list().map((r) => r.holder).filter((h): h is string => h !== null && !exists(h)))];
    for (const h of gone) await this.detach(h).catch((e) => console.error(`volumes: ${(e as Error).message}`));
    return gone;
  }

  // ─── devices ───────────────────────────────────────────────────────────────

  /** The writable device over the volume's stack, a fresh upper in its folder; recorded in its row. */
  private async openDevice(rec: VolumeRecord, v: Live): Promise<void> {
    const dir = this.volumeDir(rec.id);
    const upperDir = join(dir, UPPER);
    await rm(upperDir, { recursive: true, force: true });
    const dev = await this.blockd.call<{ id: string; path: string }>("create", {
      id: DEVICE_PREFIX + rec.id, lowers: rec.layers.map((l) => join(dir, l)), upperDir, size: rec.sizeMB * MiB,
    });
    v.device = { id: dev.id, path: dev.path };
    v.dirty = false;
    this.setDevice(rec.id, v.device);
  }

  /**
   * The device closed: its upper sealed into the next layer when it was written (blockd's
   * restack), the device deleted, its upper removed; past layersMax the stack is committed. In a
   * cluster the claim then ends with the layers published (kept, and tried again at the next
   * close, when the cluster's store does not answer).
   */
  private async closeDevice(rec: VolumeRecord, v: Live): Promise<void> {
    clearTimeout(v.idle);
    if (v.device) {
      const dir = this.volumeDir(rec.id);
      if (v.dirty) {
        const next = this.nextLayer(rec.layers);
        await this.blockd.call("restack", { id: v.device.id, layerPath: join(dir, next) });
        this.setLayers(rec, [...rec.layers, next]);
        v.dirty = false;
      }
      await this.blockd.call("delete", { id: v.device.id });
      v.device = undefined;
      this.setDevice(rec.id, null);
      await rm(join(dir, UPPER), { recursive: true, force: true });
      if (rec.layers.length > this.layersMax) await this.commitStack(rec);
    }
    await this.publish(rec, v);
  }

  /** The next sequence-numbered layer file (a cluster's published layers, named by sha256, do not count). */
  private nextLayer(layers: string[]): string {
    return layerName(Math.max(-1, ...layers.filter((l) => SEQ_LAYER.test(l)).map((l) => Number.parseInt(l, 10))) + 1);
  }

  /** The stack as one sealed layer (the device is closed); on failure the stack stays as it was. */
  private async commitStack(rec: VolumeRecord): Promise<void> {
    const dir = this.volumeDir(rec.id);
    const next = this.nextLayer(rec.layers);
    const tmp = join(dir, `${next}.tmp`);
    try {
      await this.opts.commit(rec.layers.map((l) => join(dir, l)), tmp);
      await rename(tmp, join(dir, next));
    } catch (e) {
      await rm(tmp, { force: true });
      console.error(`volumes: committing the ${rec.layers.length} layers of ${rec.name}: ${(e as Error).message}`);
      return;
    }
    const old = rec.layers;
    this.setLayers(rec, [next]);
    for (const l of old) await rm(join(dir, l), { force: true });
  }

  /** Closes the device once it has been idle for idleMs (a call in between starts the wait again). */
  private closeLater(id: string): void {
    const v = this.live.get(id);
    if (!v) return;
    clearTimeout(v.idle);
    v.idle = setTimeout(() => void this.closeIdle(id), this.idleMs);
    v.idle.unref?.();
  }

  private async closeIdle(id: string): Promise<void> {
    const v = this.live.get(id);
    if ((!v?.device && !v?.claim) || v.turns.waiting > 0 || v.turns.busy) return;
    const done = await v.turns.take(1, VOLUME_WAIT_MS, `volume ${id}`).catch(() => undefined);
    if (!done) return;
    try {
      const rec = this.get(id);
      if (rec && !rec.holder && (v.device || v.claim) && v.turns.waiting === 0) await this.closeDevice(rec, v);
    } catch (e) {
      console.error(`volumes: closing ${id}: ${(e as Error).message}`);
      // A claim not yet given back (the cluster's store did not answer) is tried again.
      if (v.claim && this.live.get(id) === v) this.closeLater(id);
    } finally {
      done();
    }
  }

  /** In a cluster, before the node stops: the devices content calls opened are closed and their claims given back (a sandbox's stay with it). */
  async settle(): Promise<void> {
    if (!this.opts.shared) return;
    for (const [id, v] of this.live) if ((v.device || v.claim) && !this.get(id)?.holder) await this.closeIdle(id);
  }

  /** Room for one more device open for content calls: the idlest one closes, or 429. */
  private async makeRoom(except: string): Promise<void> {
    const open = [...this.live.entries()].filter(([id, v]) => v.device && id !== except && !this.get(id)?.holder);
    if (open.length < VOLUMES_OPEN_MAX) return;
    const idle = open.filter(([, v]) => !v.turns.busy && v.turns.waiting === 0).sort((a, b) => a[1].lastUsed - b[1].lastUsed);
    for (const [id] of idle) {
      await this.closeIdle(id);
      if (!this.live.get(id)?.device) return;
    }
    throw new OrchestratorError(429, `${VOLUMES_OPEN_MAX} volumes are busy with content calls; try again later`);
  }

  // ─── cluster ───────────────────────────────────────────────────────────────

  /**
   * In a cluster, inside the volume's turn: this node holds the claim (for `sandbox`, null: content
   * calls) and, unless `fetch` is false, the layers it names. A claim of this node's that lapsed
   * (its lease expired) is taken again: when nobody changed the volume since, what the node wrote
   * stays its to publish; else it is discarded, and refused (409) when a sandbox's guest has the
   * device (`guestHasIt`), since its memory holds the file system's old state.
   */
  private async claimed(rec: VolumeRecord, v: Live, sandbox: string | null, o: { guestHasIt?: boolean; fetch?: boolean } = {}): Promise<void> {
    const shared = this.opts.shared;
    if (!shared) return;
    if (v.claim && !shared.lapsed(v.claim)) {
      if (sandbox === null) return;
      try {
        return await shared.relabel(rec.id, v.claim, sandbox);
      } catch (e) {
        if (!(e instanceof ClaimLapsed)) throw e;
      }
    }
    const old = v.claim;
    const got = await waitForClaim(shared, rec, sandbox);
    if (old && got.claim.epoch === old.epoch) {
      this.setClaim(rec, v, { ...got.claim, base: old.base });
      return;
    }
    if (old || v.device) {
      if (o.guestHasIt) {
        await this.giveBack(rec.id, got);
        throw new OrchestratorError(409, `volume ${rec.name} changed on another node while this node's claim on it had lapsed: sandbox ${rec.holder} cannot go on with it (what it wrote since is lost); kill it`);
      }
      await this.discard(rec, v, "this node's claim on it lapsed and another node changed it since");
    }
    this.setClaim(rec, v, got.claim);
    if (o.fetch === false) return;
    try {
      await this.takeLayers(rec, got.volume);
    } catch (e) {
      await this.giveBack(rec.id, got);
      this.setClaim(rec, v, undefined);
      throw e;
    }
  }

  /** A claim taken for nothing given back, the volume as it was. */
  private giveBack(id: string, got: { claim: VolumeClaim; volume: SharedVolume }): Promise<void> {
    return this.opts.shared!.release(id, got.claim, got.volume.layers.map((d) => ({ digest: d, path: "" })), got.volume.replay).catch(() => {});
  }

  /** The claimed volume's layers in its folder (those it lacks fetched from the shared store, checked); cached ones it no longer names go. */
  private async takeLayers(rec: VolumeRecord, s: SharedVolume): Promise<void> {
    await fetchMissing(this.opts.shared!, rec.id, this.volumeDir(rec.id), s.layers);
    this.setLayers(rec, s.layers.map(digestName));
    rec.replay = s.replay;
    this.set(rec.id, { replay: s.replay ? 1 : 0 });
    await this.sweepFolder(rec);
  }

  /**
   * In a cluster, the device closed: the layers sealed since the claim are named by their sha256
   * and published with the claim's end. A lapsed claim is taken again when nobody holds or changed
   * the volume since; else it publishes nothing and its writes are discarded (and logged). Another
   * failure keeps the claim, tried again at the next close.
   */
  private async publish(rec: VolumeRecord, v: Live): Promise<void> {
    const shared = this.opts.shared;
    if (!shared || !v.claim) return;
    const layers = await nameByContent(shared, this.volumeDir(rec.id), rec.layers);
    this.setLayers(rec, layers.map((l) => basename(l.path)));
    for (let retaken = false; ; retaken = true) {
      try {
        await shared.release(rec.id, v.claim!, layers, rec.replay);
        break;
      } catch (e) {
        if (!(e instanceof ClaimLapsed)) throw e;
        if (retaken || !(await this.retake(rec, v, shared))) return this.discard(rec, v, e.message);
      }
    }
    this.setClaim(rec, v, undefined);
  }

  /** This node's lapsed claim taken again, with its base, when nobody holds the volume and its epoch is the claim's: whether it was. */
  private async retake(rec: VolumeRecord, v: Live, shared: SharedVolumes): Promise<boolean> {
    const old = v.claim!;
    const got = await shared.claim(rec.id, rec.holder);
    if (!got || !("claim" in got)) return false;
    if (got.claim.epoch !== old.epoch) {
      await this.giveBack(rec.id, got);
      return false;
    }
    this.setClaim(rec, v, { ...got.claim, base: old.base });
    return true;
  }

  /** What this node wrote since it claimed the volume goes (the claim lapsed): its device deleted unsealed, its layers back to the claim's. */
  private async discard(rec: VolumeRecord, v: Live, why: string): Promise<void> {
    console.error(`volumes: ${rec.name} (${rec.id}): ${why}: what this node wrote to it since it took it is discarded`);
    clearTimeout(v.idle);
    if (v.device) await this.blockd.call("delete", { id: v.device.id });
    v.device = undefined;
    v.dirty = false;
    this.setDevice(rec.id, null);
    const base = v.claim?.base ?? [];
    this.setClaim(rec, v, undefined);
    this.setLayers(rec, base.map(digestName));
    await this.sweepFolder(rec);
  }

  // ─── content ───────────────────────────────────────────────────────────────

  /**
   * `fn` on the volume's file system, as the one call on it now: the device opened (the journal
   * a guest left replayed first), kept open for idleMs after. 409 while a sandbox holds it.
   * `write`: the call may change it (its close then seals a layer). The turn ends when `fn`'s
   * promise settles, or, when it returns `hold`, when that settles (a file being read).
   */
  private async onFs<T>(id: string, write: boolean, fn: (fs: VolumeFs) => Promise<T>, hold?: (t: T) => Promise<void>): Promise<T> {
    const rec = this.info(id);
    this.refuseHeld(rec);
    const v = this.liveOf(id);
    const done = await v.turns.take(VOLUME_QUEUE_MAX, VOLUME_WAIT_MS, `volume ${rec.name}`);
    let held = false;
    const finish = () => {
      v.lastUsed = Date.now();
      done();
      if (this.live.get(id) === v) this.closeLater(id);
    };
    try {
      clearTimeout(v.idle);
      const cur = this.info(id);
      this.refuseHeld(cur);
      await this.claimed(cur, v, null);
      if (!v.device) {
        await this.makeRoom(id);
        await this.openDevice(cur, v);
      }
      const fs = new VolumeFs(v.device!.path);
      if (cur.replay) {
        v.dirty = true; // a replay writes the file system
        await fs.replayJournal();
        this.set(id, { replay: 0 });
      }
      if (write) v.dirty = true;
      const out = await fn(fs);
      if (hold) {
        held = true;
        hold(out).catch(() => {}).finally(finish);
      }
      return out;
    } finally {
      if (!held) finish();
    }
  }

  /** GET /volumecontent/{id}/path: the entry itself (a symlink with its target). */
  entry(id: string, path: string): Promise<VolumeEntry> {
    const p = volumePath(path);
    return this.onFs(id, false, async (fs) => {
      const e = await fs.stat(p);
      if (!e) throw new OrchestratorError(404, `path ${p} not found`);
      return e;
    });
  }

  /** GET /volumecontent/{id}/dir: entries `depth` levels under a directory. */
  entries(id: string, path: string, depth: number): Promise<VolumeEntry[]> {
    const p = volumePath(path);
    return this.onFs(id, false, (fs) => fs.list(p, depth));
  }

  /** POST /volumecontent/{id}/dir; `force`: missing parents too. */
  makeDir(id: string, path: string, meta: EntryMeta, force: boolean): Promise<VolumeEntry> {
    const p = volumePath(path);
    return this.onFs(id, true, (fs) => fs.mkdir(p, meta, force));
  }

  /** PATCH /volumecontent/{id}/path. */
  updateEntry(id: string, path: string, meta: EntryMeta): Promise<VolumeEntry> {
    const p = volumePath(path);
    return this.onFs(id, true, (fs) => fs.update(p, meta));
  }

  /** DELETE /volumecontent/{id}/path: a directory with what is under it. */
  removeEntry(id: string, path: string): Promise<void> {
    const p = volumePath(path);
    return this.onFs(id, true, (fs) => fs.remove(p));
  }

  /** GET /volumecontent/{id}/file: the file's size and bytes; the volume is this call's until the stream ends. */
  readFile(id: string, path: string, signal?: AbortSignal): Promise<{ size: number; stream: ReadableStream<Uint8Array> }> {
    const p = volumePath(path);
    return this.onFs(id, false, (fs) => fs.read(p, signal), (r) => r.done);
  }

  /**
   * PUT /volumecontent/{id}/file: the body received into a temporary file first (at most the
   * volume's size, else 413), then written in one call; an existing file is replaced.
   * `force`: missing parent directories are made.
   */
  async writeFile(id: string, path: string, body: ReadableStream<Uint8Array> | null, meta: EntryMeta, force: boolean): Promise<VolumeEntry> {
    const p = volumePath(path);
    const rec = this.info(id);
    this.refuseHeld(rec);
    if (this.uploads >= UPLOADS_MAX) throw new OrchestratorError(429, `${UPLOADS_MAX} uploads are being received; try again later`);
    this.uploads++;
    const tmp = join(this.opts.dir, UPLOADS_DIR, `${rec.id}.${randomId(12)}`);
    try {
      await mkdir(dirname(tmp), { recursive: true });
      const fh = await open(tmp, "w", 0o600);
      try {
        let total = 0;
        const limit = rec.sizeMB * MiB;
        if (body) for await (const chunk of body) {
          total += chunk.byteLength;
          if (total > limit) throw new OrchestratorError(413, `the file is larger than the volume (${rec.sizeMB} MiB)`);
          await fh.write(chunk);
        }
      } finally {
        await fh.close();
      }
      return await this.onFs(id, true, (fs) => fs.write(p, tmp, meta, force));
    } finally {
      this.uploads--;
      await rm(tmp, { force: true });
    }
  }

  // ─── start ─────────────────────────────────────────────────────────────────

  /**
   * At node start (blockd keeps its devices across node restarts): a volume device the last
   * process left open is taken back, its stack read from blockd (a seal the row missed
   * included); one no sandbox holds is closed, one whose holder is gone (`exists`) detached.
   * Files no row names are removed, uploads that were under way too.
   */
  async start(exists: (sandboxId: string) => boolean): Promise<void> {
    await mkdir(this.opts.dir, { recursive: true });
    await rm(join(this.opts.dir, UPLOADS_DIR), { recursive: true, force: true });
    const devices = await this.blockd.call<ListedDevice[]>("list");
    for (const d of devices.filter((x) => x.id.startsWith(DEVICE_PREFIX))) {
      const rec = this.get(d.id.slice(DEVICE_PREFIX.length));
      if (!rec) {
        await this.blockd.call("delete", { id: d.id }).catch((e) => console.error(`volumes: delete ${d.id}: ${(e as Error).message}`));
        continue;
      }
      const dir = this.volumeDir(rec.id);
      const files = (d.config?.lowers ?? []).map((l) => (typeof l === "string" ? l : (l as { file?: string } | null)?.file ?? ""));
      if (files.length && files.every((f) => dirname(f) === dir && LAYER_FILE.test(basename(f)))) this.setLayers(rec, files.map((f) => basename(f)));
      const v = this.liveOf(rec.id);
      v.device = { id: d.id, path: d.path };
      v.dirty = true;
      this.setDevice(rec.id, v.device);
    }
    for (const rec of this.list()) {
      const v = this.liveOf(rec.id);
      if (rec.claim) v.claim = rec.claim;
      if (rec.device && !v.device) {
        // blockd lost it (its state was wiped): what was written since the last seal is gone.
        console.error(`volumes: ${rec.name}: its device ${rec.device.id} is gone; writes since its last close are lost`);
        this.setDevice(rec.id, null);
      }
      await this.sweepFolder(rec);
    }
    const ids = new Set(this.list().map((r) => r.id));
    for (const name of await readdir(this.opts.dir)) {
      if (name !== VOLUME_EMPTY_DIR && !ids.has(name)) await rm(join(this.opts.dir, name), { recursive: true, force: true });
    }
    // In a cluster: rows of volumes another node deleted go (when the cluster's store answers).
    const known = await this.opts.shared?.list(VOLUMES_MAX).catch(() => undefined);
    if (known) for (const rec of this.list()) if (!known.some((k) => k.id === rec.id)) await this.forgetStale(rec.id);
    await this.detachGone(exists);
    for (const rec of this.list()) {
      const v = this.liveOf(rec.id);
      if (!rec.holder && (v.device || v.claim)) await this.closeDevice(rec, v).catch((e) => {
        console.error(`volumes: closing ${rec.name}: ${(e as Error).message}`);
        if (v.claim) this.closeLater(rec.id);
      });
    }
  }

  /** Files in the volume's folder its row does not name (a commit or seal cut short) go. */
  private async sweepFolder(rec: VolumeRecord): Promise<void> {
    const dir = this.volumeDir(rec.id);
    const open = this.live.get(rec.id)?.device !== undefined;
    for (const name of await readdir(dir).catch(() => [] as string[])) {
      if (rec.layers.includes(name) || (name === UPPER && open)) continue;
      await rm(join(dir, name), { recursive: true, force: true });
    }
  }
}
