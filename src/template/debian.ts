// Builds a template from the Debian archive: mmdebstrap installs the definition's packages into a
// directory, setup.sh runs in it under chroot, GNU tar makes the tree one layer tar, and that tar
// is applied as an OCI layer onto the empty ext4 layer of diskSizeMB by the same converter image
// pulls use (convert.ts): the template's layers are [empty ext4, rootfs]. The result is cached
// under cacheDir by the definition's key: a build works in a temporary folder renamed into place
// at the end, so a crash leaves no half template, and concurrent calls for one key share one build.
import { link, mkdir, readdir, readFile, rename, rm, stat, writeFile } from "node:fs/promises";
import { join } from "node:path";
import type { BlockdClient } from "../blockdev/client.ts";
import { convertLayer, emptyExt4Layer, mountsUnder } from "./convert.ts";
import { ConvertError } from "./convert_error.ts";
import { loadDefinition, TemplateBuildError, type BuildStep, type LoadedDefinition } from "./definition.ts";
import { LayerCache, processAlive, syncPath } from "./layer_cache.ts";
import { diffIdOf } from "./layer_stream.ts";
import { runStep } from "./step.ts";

export { TemplateBuildError, type BuildStep } from "./definition.ts";

/** templates/base in this checkout: the default sandbox template. */
export const BASE_TEMPLATE_DIR = join(import.meta.dir, "..", "..", "templates", "base");

export interface BuildProgress {
  step: BuildStep;
  /** image: the root's tar; layer: the template's layer files. */
  bytes?: number;
  /** Since the build started. */
  elapsedMs: number;
  /** The tool's own status line (mmdebstrap's `I: downloading packages with apt...`). */
  detail?: string;
}

export interface BuiltTemplate {
  name: string;
  /** sha256 of the definition files: the cache key. */
  key: string;
  /** Sealed overlaybd layers, lowest first: the empty ext4 file system of diskSizeMB, then the root's files. */
  layers: string[];
  cpuCount: number;
  memoryMB: number;
  diskSizeMB: number;
  /** built: this call ran the build; joined: it waited for a concurrent call's; cache: found built. */
  source: "built" | "joined" | "cache";
}

export interface BuildOptions {
  /** Where built templates live (the node passes `$AENV_HOME/templates`). */
  cacheDir: string;
  /** The blockd whose devices the root's tar is applied on. */
  blockd: BlockdClient;
  /** Converted layers (the empty ext4 layer is shared with image pulls of the same size) [<cacheDir>/.layers]. */
  layerCache?: LayerCache;
  /** Called at each step and on each status line; exceptions it throws are ignored. */
  onProgress?: (p: BuildProgress) => void;
}

/** Per-step limits. mmdebstrap took 1.5 min here for base; 30 min covers a slow mirror on 2 loaded cores. */
export const STEP_TIMEOUT_MS = { bootstrap: 30 * 60_000, setup: 5 * 60_000, image: 10 * 60_000, layer: 10 * 60_000 } as const;

const TAR = "rootfs.tar";
/** The entry's layers are hard links to the converted files: the layer cache's GC cannot take them. */
const layerName = (i: number) => `layer-${i}.layer`;
const MANIFEST = "template.json";
/** Prefix of a build's temporary folder; its name carries the building process's pid. */
const BUILDING = ".building-";

type Manifest = Omit<BuiltTemplate, "source" | "layers"> & { builtAt: string; tarBytes: number; layerBytes: number[] };

interface InFlight {
  result: Promise<Omit<BuiltTemplate, "source">>;
  listeners: Set<(p: BuildProgress) => void>;
}

/** Builds running in this process by entry folder; an entry lives only while its build runs. */
const inFlight = new Map<string, InFlight>();

/** The default template, `templates/base`. */
export function buildBaseTemplate(opts: BuildOptions): Promise<BuiltTemplate> {
  return buildTemplate({ ...opts, definitionDir: BASE_TEMPLATE_DIR });
}

/**
 * The template defined in definitionDir, built or from the cache. TemplateBuildError names the
 * failing step; a failed build leaves no cache entry.
 */
export async function buildTemplate(opts: BuildOptions & { definitionDir: string }): Promise<BuiltTemplate> {
  const started = performance.now();
  const say = (p: Omit<BuildProgress, "elapsedMs">) => notify(opts.onProgress, { ...p, elapsedMs: Math.round(performance.now() - started) });
  say({ step: "resolving" });
  const def = await loadDefinition(opts.definitionDir);
  const entry = join(opts.cacheDir, `${def.definition.name}-${def.key.slice(0, 16)}`);

  const running = inFlight.get(entry);
  if (running) return { ...(await joinBuild(running, opts.onProgress)), source: "joined" };
  const cached = await readEntry(entry, def, say);
  if (cached) return { ...cached, source: "cache" };
  // Checked again after the await above: from here to inFlight.set nothing yields.
  const raced = inFlight.get(entry);
  if (raced) return { ...(await joinBuild(raced, opts.onProgress)), source: "joined" };

  const listeners = new Set<(p: BuildProgress) => void>();
  if (opts.onProgress) listeners.add(opts.onProgress);
  const build: InFlight = {
    listeners,
    result: build_(def, opts, entry, (p) => {
      for (const l of listeners) notify(l, { ...p, elapsedMs: Math.round(performance.now() - started) });
    }),
  };
  inFlight.set(entry, build);
  try {
    return { ...(await build.result), source: "built" };
  } finally {
    inFlight.delete(entry);
  }
}

function notify(fn: ((p: BuildProgress) => void) | undefined, p: BuildProgress): void {
  try {
    fn?.(p);
  } catch {
    // A progress callback's failure is the caller's; it must not break the build.
  }
}

async function joinBuild(running: InFlight, onProgress?: (p: BuildProgress) => void) {
  if (onProgress) running.listeners.add(onProgress);
  try {
    return await running.result;
  } finally {
    if (onProgress) running.listeners.delete(onProgress);
  }
}

/**
 * A finished entry, or null when there is none. A damaged one (files missing or cut short) is
 * removed and rebuilt, since the cache holds only what a build can make again; one that cannot be
 * read at all is CacheCorrupt.
 */
async function readEntry(entry: string, def: LoadedDefinition, say: (p: Omit<BuildProgress, "elapsedMs">) => void): Promise<Omit<BuiltTemplate, "source"> | null> {
  let text: string;
  try {
    text = await readFile(join(entry, MANIFEST), "utf8");
  } catch (e) {
    const code = (e as NodeJS.ErrnoException).code;
    if (code === "ENOENT" && !(await exists(entry))) return null;
    if (code !== "ENOENT") throw new TemplateBuildError("CacheCorrupt", "resolving", `${entry}: ${(e as Error).message}`);
    return dropDamaged(entry, "no manifest", say);
  }
  try {
    const m = JSON.parse(text) as Manifest;
    if (m.key !== def.key) throw new Error(`manifest key ${m.key} is not ${def.key}`);
    if (!Array.isArray(m.layerBytes) || m.layerBytes.length === 0) throw new Error("manifest lists no layers");
    const layers = m.layerBytes.map((_, i) => join(entry, layerName(i)));
    for (const [i, l] of layers.entries()) {
      if ((await stat(l)).size !== m.layerBytes[i]) throw new Error(`${layerName(i)} is not ${m.layerBytes[i]} bytes`);
    }
    return { name: m.name, key: m.key, layers, cpuCount: m.cpuCount, memoryMB: m.memoryMB, diskSizeMB: m.diskSizeMB };
  } catch (e) {
    return dropDamaged(entry, (e as Error).message, say);
  }
}

async function dropDamaged(entry: string, why: string, say: (p: Omit<BuildProgress, "elapsedMs">) => void): Promise<null> {
  say({ step: "resolving", detail: `removing damaged cache entry ${entry}: ${why}` });
  await removeTree(entry);
  return null;
}

async function exists(path: string): Promise<boolean> {
  try {
    await stat(path);
    return true;
  } catch {
    return false;
  }
}

function haveTool(name: string): boolean {
  return Bun.which(name, { PATH: `${process.env.PATH ?? ""}:/usr/local/sbin:/usr/sbin:/sbin` }) !== null;
}

async function build_(def: LoadedDefinition, opts: BuildOptions, entry: string, say: (p: Omit<BuildProgress, "elapsedMs">) => void): Promise<Omit<BuiltTemplate, "source">> {
  const d = def.definition;
  const cacheDir = opts.cacheDir;
  for (const [tool, pkg] of [["mmdebstrap", "mmdebstrap"], ["mkfs.ext4", "e2fsprogs"], ["chroot", "coreutils"], ["tar", "tar"], ["mount", "mount"]] as const) {
    if (!haveTool(tool)) throw new TemplateBuildError("MissingTool", "resolving", `${tool} not found (Debian package ${pkg})`);
  }
  if (process.getuid?.() !== 0) throw new TemplateBuildError("NotRoot", "resolving", "building a template needs root (mmdebstrap's root mode, chroot, file owners, mounts)");
  await mkdir(cacheDir, { recursive: true });
  await removeAbandonedBuilds(cacheDir);

  const work = join(cacheDir, `${BUILDING}${process.pid}-${d.name}-${def.key.slice(0, 16)}-${crypto.randomUUID().slice(0, 8)}`);
  const tree = join(work, "tree");
  await mkdir(work);
  try {
    say({ step: "bootstrap" });
    await runStep({
      step: "bootstrap",
      argv: ["mmdebstrap", `--variant=${d.variant}`, `--include=${d.packages.join(",")}`, "--mode=root", "--format=directory", d.suite, tree, ...d.mirrors],
      timeoutMs: STEP_TIMEOUT_MS.bootstrap,
      onLine: (line) => {
        if (line.startsWith("I: ") || line.startsWith("E: ")) say({ step: "bootstrap", detail: line });
      },
    });

    say({ step: "setup" });
    await runStep({
      step: "setup",
      argv: ["chroot", tree, "/bin/bash", "-s"],
      stdin: def.setupScript,
      env: { HOME: "/root", DEBIAN_FRONTEND: "noninteractive" },
      timeoutMs: STEP_TIMEOUT_MS.setup,
    });

    say({ step: "image" });
    const tar = join(work, TAR);
    await runStep({
      step: "image",
      // An OCI layer as image builders write one: PAX, numeric owners, xattrs, hard links kept.
      argv: ["tar", "--create", `--file=${tar}`, `--directory=${tree}`, "--format=posix", "--pax-option=delete=atime,delete=ctime",
        "--numeric-owner", "--xattrs", "--xattrs-include=*", "--one-file-system", "--sort=name", "."],
      timeoutMs: STEP_TIMEOUT_MS.image,
    });
    await removeTree(tree);
    const tarBytes = (await stat(tar)).size;
    say({ step: "image", bytes: tarBytes });

    say({ step: "layer" });
    const layers = await convertRoot(opts, tar, d.diskSizeMB);
    const layerBytes: number[] = [];
    for (const [i, l] of layers.entries()) {
      await link(l, join(work, layerName(i)));
      layerBytes.push((await stat(l)).size);
    }
    await rm(tar, { force: true });
    say({ step: "layer", bytes: layerBytes.reduce((a, b) => a + b, 0) });

    const manifest: Manifest = {
      name: d.name, key: def.key, cpuCount: d.cpuCount, memoryMB: d.memoryMB, diskSizeMB: d.diskSizeMB,
      builtAt: new Date().toISOString(), tarBytes, layerBytes,
    };
    await writeFile(join(work, MANIFEST), JSON.stringify(manifest, null, 2) + "\n");
    await syncPath(join(work, MANIFEST));
    await syncPath(work);
    try {
      await rename(work, entry);
    } catch (e) {
      // Another process finished the same key first: its entry stands, this build is dropped.
      const code = (e as NodeJS.ErrnoException).code;
      if (code !== "ENOTEMPTY" && code !== "EEXIST") throw e;
      await removeTree(work);
      const theirs = await readEntry(entry, def, say);
      if (theirs) return theirs;
      throw new TemplateBuildError("CacheCorrupt", "layer", `${entry} appeared while building and vanished again`);
    }
    await syncPath(cacheDir);
    return { name: d.name, key: def.key, layers: layerBytes.map((_, i) => join(entry, layerName(i))), cpuCount: d.cpuCount, memoryMB: d.memoryMB, diskSizeMB: d.diskSizeMB };
  } catch (e) {
    await removeTree(work).catch(() => {});
    throw e;
  }
}

/** The root's tar as an OCI layer onto the empty ext4 layer of diskSizeMB: [empty, root]. */
async function convertRoot(opts: BuildOptions, tar: string, diskSizeMB: number): Promise<string[]> {
  const ctx = { cache: opts.layerCache ?? new LayerCache(join(opts.cacheDir, ".layers")), blockd: opts.blockd };
  let timer: ReturnType<typeof setTimeout> | undefined;
  const limit = new Promise<never>((_, reject) => {
    timer = setTimeout(() => reject(new TemplateBuildError("Timeout", "layer", `not converted within ${STEP_TIMEOUT_MS.layer} ms`)), STEP_TIMEOUT_MS.layer);
  });
  try {
    return await Promise.race([limit, (async () => {
      const empty = await emptyExt4Layer(ctx, diskSizeMB * 2 ** 20);
      const root = await convertLayer(ctx, [empty], { blob: tar, diffId: await diffIdOf(tar) }, diskSizeMB * 2 ** 20);
      return [empty.path, root.path];
    })()]);
  } catch (e) {
    if (e instanceof ConvertError) throw new TemplateBuildError("StepFailed", "layer", `converting the root's tar: ${e.message}`);
    throw e;
  } finally {
    clearTimeout(timer);
  }
}

/**
 * Remove a build folder, after unmounting anything mounted inside it: removing through a
 * leftover /dev or /sys bind mount would reach the host's own files.
 */
async function removeTree(dir: string): Promise<void> {
  for (const point of await mountsUnder(dir)) {
    await runStep({ step: "resolving", argv: ["umount", "--lazy", point], timeoutMs: 30_000 });
  }
  if ((await mountsUnder(dir)).length > 0) throw new TemplateBuildError("CacheCorrupt", "resolving", `${dir} still has mounts; left in place`);
  await rm(dir, { recursive: true, force: true });
}

/** Build folders whose process is gone (crashed or killed mid-build) are removed. */
async function removeAbandonedBuilds(cacheDir: string): Promise<void> {
  for (const name of await readdir(cacheDir)) {
    if (!name.startsWith(BUILDING)) continue;
    const pid = Number.parseInt(name.slice(BUILDING.length), 10);
    if (Number.isInteger(pid) && pid > 0 && processAlive(pid)) continue;
    // Best effort: one that cannot be removed (still mounted) is tried again by the next build.
    await removeTree(join(cacheDir, name)).catch(() => {});
  }
}
