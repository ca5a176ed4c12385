// Volumes in a cluster (docs/volumes.md, In a cluster): what the node's VolumeStore asks of the
// cluster's shared record of a volume, handed in by the node (src/node/volume_cluster.ts keeps it
// in etcd and the shared snapshot store). A node claims a volume before it opens its device and
// publishes its new layers when it closes it: the claim is a fence, so a node whose claim lapsed
// (its lease expired) publishes nothing, and a volume's layers change only by its holder.
import { copyFile, link, mkdir, rename, rm } from "node:fs/promises";
import { join } from "node:path";
import { OrchestratorError } from "./errors.ts";

/** How long a call waits for another node's content calls to let the volume go (they close it 10 s after their last); then 409. */
export const VOLUME_CLAIM_WAIT_MS = 30_000;
/** How often a waiting call tries the claim again. */
const CLAIM_RETRY_MS = 250;
/** A layer file the node sealed and has not published: a six-digit sequence number. */
export const SEQ_LAYER = /^\d{6}\.layer$/;
/** A published layer's file in a volume's folder: its sha256. */
export const digestName = (sha256: string) => `${sha256}.layer`;

/** A volume as the cluster records it. */
export interface SharedVolume {
  id: string;
  name: string;
  token: string;
  sizeMB: number;
  createdAt: number;
  /** Its sealed layers by sha256 (hex), lowest first. */
  layers: string[];
  /** A sandbox held it last: the journal its guest left is replayed before the next host call. */
  replay: boolean;
  /** How many times its layers changed: a claim that lapsed is taken again with its writes only while this is the same. */
  epoch: number;
}

/** Who holds a volume now: a node, and the sandbox there that mounts it (null: its content calls). */
export interface SharedHolder {
  node: string;
  sandbox: string | null;
}

/** A claim this node holds on a volume. */
export interface VolumeClaim {
  /** The revision that made the holder key: a release names it, so a lapsed claim changes nothing. */
  fence: number;
  /** The lease the holder key is on: the claim lapses with it. */
  lease: string;
  /** The volume's layers (sha256) when the claim was taken. */
  base: string[];
  /** The volume's epoch when the claim was taken. */
  epoch: number;
}

/** A claim lapsed (the node's lease expired, or the volume went): nothing of it was published. */
export class ClaimLapsed extends Error {
  override name = "ClaimLapsed";
}

export interface SharedVolumes {
  /** sha256 (hex) of a sealed layer file. */
  digest(path: string): Promise<string>;
  /** Records a new volume whose only layer is `bottom` (a local file of digest v.layers[0]), its name with it: 409 when the name is taken. */
  create(v: SharedVolume, bottom: string): Promise<void>;
  get(id: string): Promise<SharedVolume | undefined>;
  byName(name: string): Promise<SharedVolume | undefined>;
  /** Every volume of the cluster (at most `max`). */
  list(max: number): Promise<SharedVolume[]>;
  /**
   * Takes volume `id` for `sandbox` (null: content calls) on this node's lease, when nobody holds
   * it or this node does: the claim and the volume as it is now; else who holds it; undefined
   * when there is no such volume.
   */
  claim(id: string, sandbox: string | null): Promise<{ claim: VolumeClaim; volume: SharedVolume } | { holder: SharedHolder } | undefined>;
  /** The claim is now for `sandbox` (null: content calls); ClaimLapsed when it lapsed. */
  relabel(id: string, claim: VolumeClaim, sandbox: string | null): Promise<void>;
  /** Whether the claim's lease is no longer this node's live lease (it lapsed, or etcd has not confirmed it for a lease's time). */
  lapsed(claim: VolumeClaim): boolean;
  /** Sealed layer `digest` of volume `id` from the shared store into `dest`, checked against its digest. */
  fetchLayer(id: string, digest: string, dest: string): Promise<void>;
  /**
   * Ends the claim: the layers the store lacks put into it, then the volume's layers become
   * `layers` (lowest first) with `replay`, and the holder goes, in one transaction fenced by the
   * claim. ClaimLapsed when it lapsed: nothing was published. Layers the volume named before and
   * no longer does are deleted from the store after.
   */
  release(id: string, claim: VolumeClaim, layers: { digest: string; path: string }[], replay: boolean): Promise<void>;
  /** The volume, its name and the claim gone in one fenced transaction, then its layers in the store; ClaimLapsed when it lapsed. */
  destroy(id: string, claim: VolumeClaim): Promise<void>;
}

/** Store IDs of volume layers begin so (`vol.<volume id>.<sha256>`): no snapshot of the store's. */
export const VOLUME_LAYER_STORE_PREFIX = "vol.";

/** The claim for `sandbox`: 404 no such volume; 409 a sandbox of another node mounts it, or that node's content calls kept it past VOLUME_CLAIM_WAIT_MS. */
export async function waitForClaim(shared: SharedVolumes, v: { id: string; name: string }, sandbox: string | null): Promise<{ claim: VolumeClaim; volume: SharedVolume }> {
  const until = Date.now() + VOLUME_CLAIM_WAIT_MS;
  for (;;) {
    const got = await shared.claim(v.id, sandbox);
    if (!got) throw new OrchestratorError(404, `volume ${v.name} not found`);
    if ("claim" in got) return got;
    const h = got.holder;
    if (h.sandbox !== null) throw new OrchestratorError(409, `volume ${v.name} is mounted by sandbox ${h.sandbox} on node ${h.node}`);
    if (Date.now() >= until) throw new OrchestratorError(409, `volume ${v.name} is busy with content calls on node ${h.node}; send them there, or try again`);
    await Bun.sleep(CLAIM_RETRY_MS);
  }
}

/** The layers `digests` as files of the volume's folder `dir`: those it lacks fetched from the shared store (checked). */
export async function fetchMissing(shared: SharedVolumes, id: string, dir: string, digests: string[]): Promise<void> {
  await mkdir(dir, { recursive: true });
  for (const d of new Set(digests)) {
    const f = join(dir, digestName(d));
    if (!(await Bun.file(f).exists())) await shared.fetchLayer(id, d, f);
  }
}

/** The stack `layers` (file names in `dir`), each sealed-and-unpublished one renamed to its sha256: every layer's digest and path. */
export async function nameByContent(shared: SharedVolumes, dir: string, layers: string[]): Promise<{ digest: string; path: string }[]> {
  const out: { digest: string; path: string }[] = [];
  for (const l of layers) {
    if (!SEQ_LAYER.test(l)) {
      out.push({ digest: l.slice(0, -".layer".length), path: join(dir, l) });
      continue;
    }
    const digest = await shared.digest(join(dir, l));
    await rename(join(dir, l), join(dir, digestName(digest)));
    out.push({ digest, path: join(dir, digestName(digest)) });
  }
  return out;
}

/**
 * A new volume of the cluster in its folder `dir`: the empty ext4 (`empty`, a sealed layer file)
 * linked in under its sha256, put into the shared store and recorded with `v` (409 when the name
 * is taken); the folder goes when it fails.
 */
export async function makeSharedVolume(shared: SharedVolumes, v: Omit<SharedVolume, "layers">, dir: string, empty: () => Promise<string>): Promise<SharedVolume> {
  await mkdir(dir, { recursive: true });
  try {
    const file = await empty();
    const digest = await shared.digest(file);
    const bottom = join(dir, digestName(digest));
    await link(file, bottom).catch(() => copyFile(file, bottom));
    const s: SharedVolume = { ...v, layers: [digest] };
    await shared.create(s, bottom);
    return s;
  } catch (e) {
    await rm(dir, { recursive: true, force: true });
    throw e;
  }
}
