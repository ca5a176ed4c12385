// A snapshot description that came from elsewhere (a shared snapshot store, written by any node
// that reaches it) names host paths the VMM would open: it is confined before it is used here
// (docs/vmm.md, Snapshots from a store). Its files must lie in this node's checkpoint directory,
// its kernel and initrd in this node's guest directories; the paths of the VM it was taken from
// (drives, run directory, RAM file, network namespace, a Firecracker memory base), which a restore
// replaces with its own, are dropped, so nothing later can open them by mistake.

import { realpathSync } from "node:fs";
import { isAbsolute, relative, resolve } from "node:path";
import type { SnapshotInfo, VmSpec } from "./types.ts";

export class SnapshotPathError extends Error {
  constructor(message: string) {
    super(message);
    this.name = "SnapshotPathError";
  }
}

/** Where a confined snapshot's paths may lead. */
export interface SnapshotPlaces {
  /** The checkpoint directory the snapshot's files were put in: `dir`, `statePath`, `memPath` lie in it. */
  checkpointDir: string;
  /** Directories the kernel and initrd may be in (this node's guest cache, e.g. the directory of its own kernel). */
  bootDirs: readonly string[];
}

/** `path` (absolute, and as its symlinks resolve where it exists) is `dir` or below it. */
export function isInside(path: string, dir: string): boolean {
  if (!isAbsolute(path) || path.includes("\0")) return false;
  const below = (p: string, d: string) => {
    const rel = relative(d, p);
    return rel === "" || (!rel.startsWith("..") && !isAbsolute(rel));
  };
  if (!below(resolve(path), resolve(dir))) return false;
  const real = (p: string) => {
    try {
      return realpathSync(p);
    } catch {
      return undefined;
    }
  };
  const realPath = real(path);
  return realPath === undefined || below(realPath, real(dir) ?? resolve(dir));
}

function field(what: string, v: unknown): string {
  if (typeof v !== "string" || v === "") throw new SnapshotPathError(`snapshot ${what} is not a path: ${JSON.stringify(v)?.slice(0, 200)}`);
  return v;
}

/** SnapshotPathError unless the spec's kernel and initrd lie in one of `bootDirs`. */
export function checkBootFiles(spec: Pick<VmSpec, "kernel" | "initrd">, bootDirs: readonly string[]): void {
  const inBootDirs = (what: string, v: unknown) => {
    const p = field(what, v);
    if (!bootDirs.some((d) => isInside(p, d)))
      throw new SnapshotPathError(`snapshot ${what} ${JSON.stringify(p)} is outside this node's guest files (${bootDirs.join(", ")}): refused`);
  };
  inBootDirs("kernel", spec.kernel);
  if (spec.initrd !== undefined) inBootDirs("initrd", spec.initrd);
}

/**
 * The snapshot as this node may restore it, or SnapshotPathError naming the first path that leads
 * out of its places. Checked: `dir`, `statePath`, `memPath` (in the checkpoint directory),
 * `spec.kernel`, `spec.initrd` (in a boot directory). Dropped: the source VM's drive paths (kept
 * as empty names with their flags: a restore brings its own), `runDir` (the checkpoint directory
 * stands in), `memFile`, `netnsPath`, `extra.base`.
 */
export function confineSnapshot(info: SnapshotInfo, places: SnapshotPlaces): SnapshotInfo {
  const cp = places.checkpointDir;
  const inCheckpoint = (what: string, v: unknown) => {
    const p = field(what, v);
    if (!isInside(p, cp)) throw new SnapshotPathError(`snapshot ${what} ${JSON.stringify(p)} is outside its checkpoint directory ${cp}`);
    return p;
  };
  if (info === null || typeof info !== "object" || info.spec === null || typeof info.spec !== "object") throw new SnapshotPathError("snapshot description without a VM spec");
  inCheckpoint("dir", info.dir);
  inCheckpoint("statePath", info.statePath);
  if (info.memPath !== undefined) inCheckpoint("memPath", info.memPath);
  const s = info.spec;
  checkBootFiles(s, places.bootDirs);
  if (!Array.isArray(s.drives)) throw new SnapshotPathError("snapshot spec without a drive list");
  const { memFile: _m, netnsPath: _n, ...kept } = s;
  const spec: VmSpec = { ...kept, runDir: cp, drives: s.drives.map((d) => ({ ...d, path: "" })) };
  const { base: _b, ...extra } = info.extra ?? {};
  return { ...info, spec, ...(info.extra ? { extra } : {}) };
}
