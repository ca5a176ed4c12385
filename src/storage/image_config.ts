// The image config (config.v1.json) that names a stack: read-only lowers, base first, and an
// optional writable upper (docs/formats.md, Image config). Fields we do not serve yet are refused by name.

import { existsSync } from "node:fs";
import { isAbsolute, join, resolve } from "node:path";
import { ConfigError } from "./errors.ts";
import { type RemoteLayerSpec, parseRemoteSpec, remoteLayerPath } from "./remote/spec.ts";

export interface LayerRef {
  file?: string;
  dir?: string;
  digest?: string;
  size?: number;
  uuid?: string;
  /** The layer lives elsewhere (needs digest and size): where to fetch it, where to cache it. */
  remote?: RemoteLayerSpec;
}

export interface UpperRef {
  index: string;
  data: string;
  mode?: "logStructured";
}

export interface ImageConfig {
  repoBlobUrl?: string;
  lowers: LayerRef[];
  upper?: UpperRef;
  resultFile?: string;
}

/** C++ limit: tags are 8 bits. */
export const MAX_LOWERS = 255;
const TURBO_OCI = ["targetFile", "targetDigest", "gzipIndex"];

/** Validate a parsed config. Relative paths are taken from baseDir (the config file's folder). */
export function parseImageConfig(raw: unknown, baseDir = process.cwd()): ImageConfig {
  const where = "image config";
  if (!raw || typeof raw !== "object" || Array.isArray(raw)) throw new ConfigError(`${where} must be a JSON object`);
  const o = raw as Record<string, unknown>;
  const lowersRaw = o.lowers ?? [];
  if (!Array.isArray(lowersRaw)) throw new ConfigError(`${where}: "lowers" must be an array`);
  if (lowersRaw.length > MAX_LOWERS) throw new ConfigError(`${where}: ${lowersRaw.length} lowers exceed ${MAX_LOWERS}`);
  const abs = (p: string) => (isAbsolute(p) ? p : resolve(baseDir, p));
  const lowers = lowersRaw.map((l, i): LayerRef => {
    if (!l || typeof l !== "object") throw new ConfigError(`${where}: lowers[${i}] must be an object`);
    const r = l as Record<string, unknown>;
    for (const k of TURBO_OCI)
      if (r[k] !== undefined) throw new ConfigError(`${where}: lowers[${i}].${k}: turboOCI layers are not supported`);
    const ref: LayerRef = {};
    for (const k of ["file", "dir", "digest", "uuid"] as const) {
      if (r[k] === undefined) continue;
      if (typeof r[k] !== "string" || !r[k]) throw new ConfigError(`${where}: lowers[${i}].${k} must be a non-empty string`);
      ref[k] = k === "file" || k === "dir" ? abs(r[k] as string) : (r[k] as string);
    }
    if (r.size !== undefined) {
      if (!Number.isSafeInteger(r.size) || (r.size as number) < 0) throw new ConfigError(`${where}: lowers[${i}].size must be a byte count`);
      ref.size = r.size as number;
    }
    if (r.remote !== undefined) ref.remote = parseRemoteSpec(r.remote, r.digest, r.size, `${where}: lowers[${i}]`);
    if (!ref.file && !ref.dir && !ref.remote) throw new ConfigError(`${where}: lowers[${i}] names neither "file" nor "dir"`);
    return ref;
  });
  const cfg: ImageConfig = { lowers };
  if (o.repoBlobUrl !== undefined) {
    if (typeof o.repoBlobUrl !== "string") throw new ConfigError(`${where}: "repoBlobUrl" must be a string`);
    cfg.repoBlobUrl = o.repoBlobUrl;
  }
  if (o.resultFile !== undefined) {
    if (typeof o.resultFile !== "string") throw new ConfigError(`${where}: "resultFile" must be a string`);
    cfg.resultFile = abs(o.resultFile);
  }
  if (o.upper !== undefined && o.upper !== null) {
    const u = o.upper as Record<string, unknown>;
    if (typeof u !== "object") throw new ConfigError(`${where}: "upper" must be an object`);
    if (u.target !== undefined || u.gzipIndex !== undefined) throw new ConfigError(`${where}: turboOCI uppers are not supported`);
    if (typeof u.index !== "string" || typeof u.data !== "string" || !u.index || !u.data)
      throw new ConfigError(`${where}: "upper" needs both "index" and "data" paths`);
    if (u.mode !== undefined && u.mode !== "logStructured")
      throw new ConfigError(`${where}: upper.mode ${JSON.stringify(u.mode)} is not supported (only "logStructured")`);
    cfg.upper = { index: abs(u.index), data: abs(u.data) };
  }
  return cfg;
}

export async function loadImageConfig(path: string): Promise<ImageConfig> {
  let raw: unknown;
  try {
    raw = JSON.parse(await Bun.file(path).text());
  } catch (e) {
    throw new ConfigError(`cannot read image config: ${(e as Error).message}`, path);
  }
  return parseImageConfig(raw, resolve(path, ".."));
}

/**
 * The local file of a lower: `file`, else dir/overlaybd.commit, dir/.commit, dir/overlaybd.sealed;
 * for a remote lower without those, its promoted file or `remote:<digest>` (open_layer.ts).
 */
export function resolveLayerPath(ref: LayerRef, i: number): string {
  const candidates = [ref.file, ...(ref.dir ? ["overlaybd.commit", ".commit", "overlaybd.sealed"].map((n) => join(ref.dir!, n)) : [])];
  for (const c of candidates) if (c && existsSync(c)) return c;
  if (ref.remote && ref.digest) return remoteLayerPath(ref.digest, ref.remote);
  if (ref.digest) throw new ConfigError(`lowers[${i}] (${ref.digest}) is remote; remote layers need a remote backend`);
  throw new ConfigError(`lowers[${i}]: no layer file at ${candidates.filter(Boolean).join(", ")}`);
}
