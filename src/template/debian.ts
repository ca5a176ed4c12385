// Builds a template from the Debian archive: mmdebstrap installs the definition's packages into a
// directory, setup.sh runs in it under chroot, mkfs.ext4 -d turns it into a sparse raw image of
// diskSizeMB, and the image becomes one sealed overlaybd layer. The result is cached under
// cacheDir by the definition's key: a build works in a temporary folder renamed into place at the
// end, so a crash leaves no half template, and concurrent calls for one key share one build.
import { mkdir, open, readdir, readFile, rename, rm, stat, writeFile } from "node:fs/promises";
import { join } from "node:path";
import { loadDefinition, TemplateBuildError, type BuildStep, type LoadedDefinition } from "./definition.ts";
import { processAlive } from "./layer_cache.ts";
import { runStep } from "./step.ts";

export { TemplateBuildError, type BuildStep } from "./definition.ts";

/** templates/base in this checkout: the default sandbox template. */
export const BASE_TEMPLATE_DIR = join(import.meta.dir, "..", "..", "templates", "base");

export interface BuildProgress {
  step: BuildStep;
  /** image: bytes the image takes on disk; layer: the layer file's size. */
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
  /** The sealed overlaybd layer: the template's one rootfs layer. */
  layer: string;
  /** The raw ext4 image the layer was made from. */
  image: string;
  cpuCount: number;
  memoryMB: number;
  diskSizeMB: number;
  /** built: this call ran the build; joined: it waited for a concurrent call's; cache: found built. */
  source: "built" | "joined" | "cache";
}

export interface BuildOptions {
  /** Where built templates live (the node passes `$AENV_HOME/templates`). */
  cacheDir: string;
  /** Called at each step and on each status line; exceptions it throws are ignored. */
  onProgress?: (p: BuildProgress) => void;
}

/** Per-step limits. mmdebstrap took 1.5 min here for base; 30 min covers a slow mirror on 2 loaded cores. */
export const STEP_TIMEOUT_MS = { bootstrap: 30 * 60_000, setup: 5 * 60_000, image: 10 * 60_000, layer: 10 * 60_000 } as const;

const IMAGE = "rootfs.ext4";
const LAYER = "rootfs.layer";
const MANIFEST = "template.json";
/** Prefix of a build's temporary folder; its name carries the building process's pid. */
const BUILDING = ".building-";

type Manifest = Omit<BuiltTemplate, "source" | "layer" | "image"> & { builtAt: string; imageBytes: number; layerBytes: number };

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
    result: build_(def, opts.cacheDir, entry, (p) => {
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
    const [image, layer] = [join(entry, IMAGE), join(entry, LAYER)];
    if ((await stat(layer)).size !== m.layerBytes) throw new Error(`${LAYER} is not ${m.layerBytes} bytes`);
    if ((await stat(image)).size !== m.diskSizeMB * 1024 * 1024) throw new Error(`${IMAGE} is not ${m.diskSizeMB} MiB`);
    return { name: m.name, key: m.key, layer, image, cpuCount: m.cpuCount, memoryMB: m.memoryMB, diskSizeMB: m.diskSizeMB };
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

async function build_(def: LoadedDefinition, cacheDir: string, entry: string, say: (p: Omit<BuildProgress, "elapsedMs">) => void): Promise<Omit<BuiltTemplate, "source">> {
  const d = def.definition;
  for (const [tool, pkg] of [["mmdebstrap", "mmdebstrap"], ["mkfs.ext4", "e2fsprogs"], ["chroot", "coreutils"]] as const) {
    if (!haveTool(tool)) throw new TemplateBuildError("MissingTool", "resolving", `${tool} not found (Debian package ${pkg})`);
  }
  if (process.getuid?.() !== 0) throw new TemplateBuildError("NotRoot", "resolving", "building a template needs root (mmdebstrap's root mode, chroot, file owners)");
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
    const image = join(work, IMAGE);
    await runStep({
      step: "image",
      // -m 0: no blocks reserved for root, the sandbox's user gets the whole disk.
      argv: ["mkfs.ext4", "-q", "-F", "-L", "rootfs", "-m", "0", "-d", tree, image, `${d.diskSizeMB}M`],
      timeoutMs: STEP_TIMEOUT_MS.image,
    });
    await removeTree(tree);
    await syncFile(image);
    const imageBytes = (await stat(image)).blocks * 512;
    say({ step: "image", bytes: imageBytes });

    say({ step: "layer" });
    const layer = join(work, LAYER);
    await sealInWorker(image, layer);
    const layerBytes = (await stat(layer)).size;
    say({ step: "layer", bytes: layerBytes });

    const manifest: Manifest = {
      name: d.name, key: def.key, cpuCount: d.cpuCount, memoryMB: d.memoryMB, diskSizeMB: d.diskSizeMB,
      builtAt: new Date().toISOString(), imageBytes, layerBytes,
    };
    await writeFile(join(work, MANIFEST), JSON.stringify(manifest, null, 2) + "\n");
    await syncFile(join(work, MANIFEST));
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
    await syncFile(cacheDir);
    return { name: d.name, key: def.key, layer: join(entry, LAYER), image: join(entry, IMAGE), cpuCount: d.cpuCount, memoryMB: d.memoryMB, diskSizeMB: d.diskSizeMB };
  } catch (e) {
    await removeTree(work).catch(() => {});
    throw e;
  }
}

/** The image as one sealed layer (artifacts.ts's sealedLayer), on a worker thread, bounded in time. */
async function sealInWorker(image: string, out: string): Promise<void> {
  const worker = new Worker(new URL("./seal_worker.ts", import.meta.url).href);
  let timer: ReturnType<typeof setTimeout> | undefined;
  try {
    await new Promise<void>((resolve, reject) => {
      const fail = (why: string, code: "StepFailed" | "Timeout" = "StepFailed") => reject(new TemplateBuildError(code, "layer", `sealing ${image}: ${why}`));
      timer = setTimeout(() => fail(`not done within ${STEP_TIMEOUT_MS.layer} ms`, "Timeout"), STEP_TIMEOUT_MS.layer);
      worker.onmessage = (ev: MessageEvent<{ ok: boolean; error?: string }>) => (ev.data.ok ? resolve() : fail(ev.data.error ?? "failed"));
      worker.onerror = (ev) => fail(ev.message);
      worker.addEventListener("close", () => fail("its worker ended without an answer"));
      worker.postMessage({ image, out });
    });
  } finally {
    clearTimeout(timer);
    worker.terminate();
  }
}

/** fdatasync (fsync for a folder) so the rename publishes only durable bytes. */
async function syncFile(path: string): Promise<void> {
  const fh = await open(path, "r");
  try {
    await fh.sync();
  } finally {
    await fh.close();
  }
}

/** Mount points at or under dir, deepest first (a killed mmdebstrap can leave proc/sys/dev mounted). */
async function mountsUnder(dir: string): Promise<string[]> {
  const text = await readFile("/proc/self/mountinfo", "utf8");
  const points = text.split("\n").map((l) => l.split(" ")[4]).filter((p): p is string => !!p)
    // mountinfo escapes space, tab, newline and backslash as octal.
    .map((p) => p.replace(/\\([0-7]{3})/g, (_, o: string) => String.fromCharCode(parseInt(o, 8))))
    .filter((p) => p === dir || p.startsWith(dir + "/"));
  return points.sort((a, b) => b.length - a.length);
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
