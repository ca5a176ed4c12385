// Checks of an RPC's parameters that more than one call shares: each throws BadRequest (or the
// storage engine's ConfigError for a lower that is missing) before the call makes anything.

import { isAbsolute, join } from "node:path";
import { type ImageConfig, type LayerRef, parseImageConfig, resolveLayerPath } from "../storage/image_config.ts";
import { WRITABLE_DATA, WRITABLE_INDEX } from "../storage/lsmt/writable_layer.ts";
import { ID_RE } from "./device_table.ts";
import { BlockdError } from "./protocol.ts";

export function checkId(id: unknown): string {
  if (typeof id !== "string" || !ID_RE.test(id)) throw new BlockdError("BadRequest", `"id" must match ${ID_RE}`);
  return id;
}

export function checkLowers(lowers: unknown): LayerRef[] {
  if (lowers === undefined) return [];
  if (!Array.isArray(lowers)) throw new BlockdError("BadRequest", `"lowers" must be an array of layers`);
  return lowers.map((l) => (typeof l === "string" ? { file: l } : l)) as LayerRef[];
}

export function checkSize(size: unknown): number {
  if (!Number.isSafeInteger(size) || (size as number) <= 0 || (size as number) % 512)
    throw new BlockdError("BadRequest", `"size" must be a positive multiple of 512`);
  return size as number;
}

/** Absolute: blockd's working directory is not the caller's. */
export function checkUpperDir(dir: unknown): string {
  if (typeof dir !== "string" || !isAbsolute(dir)) throw new BlockdError("BadRequest", `"upperDir" must be an absolute directory path`);
  return dir;
}

/** A stack whose every lower exists (missing → ConfigError), with the upper of upperDir if given. */
export function checkConfig(lowers: unknown, upperDir?: string): ImageConfig {
  const upper = upperDir === undefined ? undefined : { data: join(upperDir, WRITABLE_DATA), index: join(upperDir, WRITABLE_INDEX) };
  const config = parseImageConfig({ lowers: checkLowers(lowers), upper });
  config.lowers.forEach((l, i) => resolveLayerPath(l, i));
  return config;
}
