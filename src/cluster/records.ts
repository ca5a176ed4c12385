// The cluster's keys in etcd and the records under them: what nodes, gateways and the scheduler
// agree on. Every record is JSON, checked when read (a record that does not parse is skipped and
// named, never trusted).
//
//   /aenv/nodes/{node}        NodeRecord, on the node's lease (gone ~10 s after the node is)
//   /aenv/sandboxes/{id}      Binding: the node that owns the sandbox, fenced by that node's lease
//   /aenv/reservations/{node} Reservations: creates in flight toward the node (compare-and-swap)
//   /aenv/templates/{id}      TemplateEntry: a template one node built and pushed, for the others
//   /aenv/volumes/{id}        VolumeEntry: a volume's name, token, size and sealed layers (by sha256)
//   /aenv/volume-names/{name} the volume ID the name belongs to (made with the entry, in one transaction)
//   /aenv/volume-holders/{id} VolumeHolderEntry: the node (and sandbox) holding the volume, on that node's volume lease

export const ROOT = "/aenv/";
export const NODES = `${ROOT}nodes/`;
export const SANDBOXES = `${ROOT}sandboxes/`;
export const RESERVATIONS = `${ROOT}reservations/`;
export const TEMPLATES = `${ROOT}templates/`;
export const VOLUMES = `${ROOT}volumes/`;
export const VOLUME_NAMES = `${ROOT}volume-names/`;
export const VOLUME_HOLDERS = `${ROOT}volume-holders/`;

export const nodeKey = (id: string) => `${NODES}${id}`;
export const sandboxKey = (id: string) => `${SANDBOXES}${id}`;
export const reservationsKey = (node: string) => `${RESERVATIONS}${node}`;
export const templateKey = (id: string) => `${TEMPLATES}${id}`;
export const volumeKey = (id: string) => `${VOLUMES}${id}`;
export const volumeNameKey = (name: string) => `${VOLUME_NAMES}${name}`;
export const volumeHolderKey = (id: string) => `${VOLUME_HOLDERS}${id}`;

/** Node IDs: what Kubernetes node names and hostnames allow, bounded. */
export const NODE_ID = /^[a-z0-9]([a-z0-9.-]{0,61}[a-z0-9])?$/;

/** A node's lease TTL: it is gone from placement this long after its last renewal. */
export const NODE_LEASE_TTL_S = 10;

export type NodeStatus = "ready" | "draining" | "cordoned";

export interface NodeRecord {
  id: string;
  /** Where gateways reach its API and proxy: http://ip:port. */
  apiUrl: string;
  status: NodeStatus;
  version: string;
  /** Its iroh endpoint, for peers to fetch layers from. */
  p2p?: { id: string; addrs: string[] };
  capacity: { cpus: number; memoryMB: number; diskFreeMB: number; maxSandboxes: number };
  /** What it holds now (running and paused; running sandboxes' nominal CPUs and memory). */
  used: { sandboxes: number; running: number; cpus: number; memoryMB: number };
  /** Templates (IDs and aliases) whose layers it holds, with their bytes on its disk: the cache bonus (at most MAX_CACHED entries). */
  cached: Record<string, number>;
  /** Digests of the layers it serves verified (pushed, promoted, the snapshot store's; at most MAX_LAYER_DIGESTS): the cache bonus for a template it has not imported yet. */
  layers?: string[];
  /** When it last wrote this record (unix ms). */
  at: number;
}

/** Bound on a node record's `cached` map (a record stays far below etcd's 1.5 MiB value limit). */
export const MAX_CACHED = 2048;
/** Bound on a node record's `layers` (72 bytes each: 300 KiB at most). */
export const MAX_LAYER_DIGESTS = 4096;

export interface Binding {
  node: string;
  /** The owning node's lease when it wrote the binding: its fence. */
  lease: string;
  templateId: string;
  alias?: string;
  cpuCount: number;
  memoryMB: number;
  diskSizeMB: number;
  metadata: Record<string, string>;
  envdVersion: string;
  startedAt: number;
  endAt: number;
  /** Set while the sandbox is paused and its export is complete in the shared snapshot store: another node may take it. */
  exported?: boolean;
  /** Its traffic resumes it when paused (E2B's autoResume): a gateway moves it for a request too. */
  autoResume?: boolean;
}

/** A template built on one node and pushed (overlaybd) to the cluster's templates location: any node imports it under the same ID. */
export interface TemplateEntry {
  id: string;
  alias: string;
  /** `name:tag` names it answers to. */
  names: string[];
  /** Where its image is (a registry reference or s3://…): what the other nodes pull lazily. */
  ref: string;
  cpuCount: number;
  memoryMB: number;
  startCmd?: string;
  readyCmd?: string;
  /** Its image's layers (base first), so placement counts the bytes a node already holds. */
  layers?: { digest: string; size: number }[];
  /** The node that built it. */
  node: string;
  at: number;
}

/** A volume shared by the cluster's nodes (docs/volumes.md, In a cluster): its layers live in the shared snapshot store. */
export interface VolumeEntry {
  id: string;
  name: string;
  /** The content API's bearer token: any node answers GET /volumes/{id} with it. */
  token: string;
  sizeMB: number;
  createdAt: number;
  /** Its sealed layers by sha256 (hex), lowest first. */
  layers: string[];
  /** A sandbox held it last: the journal its guest left is replayed before the next host call. */
  replay: boolean;
  /** How many times its layers changed (each publish adds one). */
  epoch: number;
  /** The node that last published it (its folder caches the layers). */
  node: string;
  at: number;
}

/** Who holds a volume: a node, and the sandbox there that mounts it (null: the node's content calls). */
export interface VolumeHolderEntry {
  node: string;
  sandbox: string | null;
  at: number;
}

export interface Reservation {
  /** Unique per create (the gateway's request). */
  id: string;
  cpus: number;
  memoryMB: number;
  /** Unix ms after which it no longer counts (a gateway that died mid-create). */
  until: number;
}

const isObj = (v: unknown): v is Record<string, unknown> => typeof v === "object" && v !== null && !Array.isArray(v);
const isNum = (v: unknown): v is number => typeof v === "number" && Number.isFinite(v);

export class RecordError extends Error {
  override name = "RecordError";
}

function parse(text: string, what: string): Record<string, unknown> {
  let v: unknown;
  try {
    v = JSON.parse(text);
  } catch {
    throw new RecordError(`${what}: not JSON`);
  }
  if (!isObj(v)) throw new RecordError(`${what}: not a JSON object`);
  return v;
}

export function parseNode(text: string): NodeRecord {
  const v = parse(text, "node record");
  const cap = v.capacity, used = v.used;
  if (typeof v.id !== "string" || !NODE_ID.test(v.id)) throw new RecordError("node record: bad id");
  if (typeof v.apiUrl !== "string" || !/^https?:\/\/[^/]+$/.test(v.apiUrl)) throw new RecordError(`node record ${v.id}: bad apiUrl`);
  if (v.status !== "ready" && v.status !== "draining" && v.status !== "cordoned") throw new RecordError(`node record ${v.id}: bad status`);
  if (!isObj(cap) || !isNum(cap.cpus) || !isNum(cap.memoryMB) || !isNum(cap.diskFreeMB) || !isNum(cap.maxSandboxes)) throw new RecordError(`node record ${v.id}: bad capacity`);
  if (!isObj(used) || !isNum(used.sandboxes) || !isNum(used.running) || !isNum(used.cpus) || !isNum(used.memoryMB)) throw new RecordError(`node record ${v.id}: bad used`);
  if (!isObj(v.cached)) throw new RecordError(`node record ${v.id}: bad cached`);
  return v as unknown as NodeRecord;
}

export function parseBinding(text: string): Binding {
  const v = parse(text, "binding");
  if (typeof v.node !== "string" || !NODE_ID.test(v.node) || typeof v.lease !== "string") throw new RecordError("binding: bad node or lease");
  if (typeof v.templateId !== "string" || !isNum(v.startedAt) || !isNum(v.endAt) || !isObj(v.metadata)) throw new RecordError("binding: bad sandbox fields");
  return v as unknown as Binding;
}

export function parseReservations(text: string): Reservation[] {
  let v: unknown;
  try {
    v = JSON.parse(text);
  } catch {
    throw new RecordError("reservations: not JSON");
  }
  if (!Array.isArray(v)) throw new RecordError("reservations: not an array");
  return v.filter((r): r is Reservation => isObj(r) && typeof r.id === "string" && isNum(r.cpus) && isNum(r.memoryMB) && isNum(r.until));
}

export function parseTemplate(text: string): TemplateEntry {
  const v = parse(text, "template entry");
  if (typeof v.id !== "string" || !/^[A-Za-z0-9._-]{1,128}$/.test(v.id) || typeof v.alias !== "string" || typeof v.ref !== "string" || !Array.isArray(v.names))
    throw new RecordError("template entry: bad id, alias, ref or names");
  if (!isNum(v.cpuCount) || !isNum(v.memoryMB)) throw new RecordError(`template entry ${v.id}: bad size`);
  return v as unknown as TemplateEntry;
}

const SHA256 = /^[0-9a-f]{64}$/;

export function parseVolume(text: string): VolumeEntry {
  const v = parse(text, "volume entry");
  if (typeof v.id !== "string" || typeof v.name !== "string" || typeof v.token !== "string" || !isNum(v.sizeMB) || !isNum(v.createdAt))
    throw new RecordError("volume entry: bad id, name, token, size or creation time");
  if (!Array.isArray(v.layers) || v.layers.length === 0 || !v.layers.every((l) => typeof l === "string" && SHA256.test(l))) throw new RecordError(`volume entry ${v.id}: bad layers`);
  if (typeof v.replay !== "boolean" || !isNum(v.epoch)) throw new RecordError(`volume entry ${v.id}: bad replay or epoch`);
  return v as unknown as VolumeEntry;
}

export function parseVolumeHolder(text: string): VolumeHolderEntry {
  const v = parse(text, "volume holder");
  if (typeof v.node !== "string" || !NODE_ID.test(v.node) || (v.sandbox !== null && typeof v.sandbox !== "string")) throw new RecordError("volume holder: bad node or sandbox");
  return v as unknown as VolumeHolderEntry;
}
