// OCI layer → sealed overlaybd layer. The bottom of every converted image is one cached empty ext4
// layer (mkfs.ext4 of the virtual size on a blockd device). Each OCI layer then gets a blockd device
// with a fresh writable upper over its parents' layers, loop-mounted as ext4; the tar is applied
// onto the mount on a worker thread (apply_worker.ts, tar_apply.ts), the file system unmounted,
// and the upper sealed into one layer by blockd's restack. Results are cached by chain ID
// (layer_cache.ts): a layer shared by several images is converted once.

import { mkdir, readFile, rm } from "node:fs/promises";
import { basename, dirname, join } from "node:path";
import type { BlockdClient } from "../blockdev/client.ts";
import type { ApplyMessage } from "./apply_worker.ts";
import type { Compression } from "./layer_stream.ts";
import { ConvertError } from "./convert_error.ts";
import { chainId, LayerCache } from "./layer_cache.ts";
import type { ApplyStats } from "./tar_apply.ts";

/** Virtual disk size of a converted image when none is asked: 20 GiB, sparse. */
export const DEFAULT_DISK_BYTES = 20 * 2 ** 30;

/**
 * mkfs.ext4 of the empty layer. -m 0: the sandbox's user gets the whole disk. The file system is
 * made on blockd's device file, a regular file: mke2fs discards it (punched holes read as zeros),
 * so the inode tables count as zeroed and the guest kernel has no lazy init to write.
 */
export const MKFS_ARGS = ["-q", "-F", "-t", "ext4", "-L", "rootfs", "-m", "0"] as const;
/** Mount options while a layer is applied: no atime updates, no cache flushes (the layer is sealed after a clean umount). */
const MOUNT_OPTIONS = "noatime,nobarrier";
/** Bumped when the empty layer's making changes, so old ones are not reused. */
const EMPTY_VERSION = "aenv-empty-ext4 v1";

/** Limits: mkfs of 20 GiB and a mount take seconds; a layer's apply follows its size (a 1 GiB layer takes ~1 min). */
export const CONVERT_TIMEOUT_MS = { mkfs: 10 * 60_000, mount: 2 * 60_000, apply: 30 * 60_000 } as const;

export interface ConvertContext {
  cache: LayerCache;
  blockd: BlockdClient;
}

export interface LayerProgress {
  /** Bytes of the blob read so far, and of the tar it holds. */
  blobBytes: number;
  tarBytes: number;
}

export interface ConvertedLayer {
  chain: string;
  path: string;
  /** Whether this call converted it (false: found in the cache, or joined a running conversion). */
  converted: boolean;
  /** Set when converted: the uncompressed tar's digest and what the apply did. */
  diffId?: string;
  compression?: Compression;
  stats?: ApplyStats;
}

/**
 * The cache ready for this blockd: work folders of conversions whose process died are undone
 * first (their mounts unmounted, their blockd devices deleted), then removed.
 */
export function initCache(ctx: ConvertContext): Promise<void> {
  return ctx.cache.init(async (work) => {
    for (const m of await mountsUnder(work)) await run(["umount", "--lazy", m], CONVERT_TIMEOUT_MS.mount, "umount");
    const devices = await ctx.blockd.call<{ id: string; config: { upper?: { data: string } } | null }[]>("list");
    for (const d of devices) {
      if (d.config?.upper?.data.startsWith(`${work}/`)) await ctx.blockd.call("delete", { id: d.id });
    }
  });
}

/** Mount points at or under dir, deepest first (from /proc/self/mountinfo, octal escapes undone). */
export async function mountsUnder(dir: string): Promise<string[]> {
  const text = await readFile("/proc/self/mountinfo", "utf8");
  const points = text.split("\n").map((l) => l.split(" ")[4]).filter((p): p is string => !!p)
    .map((p) => p.replace(/\\([0-7]{3})/g, (_, o: string) => String.fromCharCode(parseInt(o, 8))))
    .filter((p) => p === dir || p.startsWith(dir + "/"));
  return points.sort((a, b) => b.length - a.length);
}

/** The chain ID of the empty ext4 layer of a virtual size: the bottom of every converted image. */
export function emptyExt4Chain(sizeBytes: number): string {
  return `sha256:${new Bun.CryptoHasher("sha256").update(`${EMPTY_VERSION} ${MKFS_ARGS.join(" ")} ${sizeBytes}`).digest("hex")}`;
}

/** The cached empty ext4 layer of sizeBytes (a multiple of 1 MiB), made once. */
export async function emptyExt4Layer(ctx: ConvertContext, sizeBytes: number): Promise<ConvertedLayer> {
  if (!Number.isSafeInteger(sizeBytes) || sizeBytes < 64 << 20 || sizeBytes % (1 << 20)) {
    throw new RangeError(`virtual disk size must be a whole number of MiB, at least 64 MiB (got ${sizeBytes})`);
  }
  await initCache(ctx);
  const chain = emptyExt4Chain(sizeBytes);
  let out: string | undefined;
  try {
    const r = await ctx.cache.get(chain, async () =>
      (out = await onDevice(ctx, [], sizeBytes, false, async (dev) => {
        await run(["mkfs.ext4", ...MKFS_ARGS, dev.path, `${sizeBytes / 1024}k`], CONVERT_TIMEOUT_MS.mkfs, "mkfs.ext4");
      })),
    );
    return { chain, path: r.path, converted: r.made };
  } finally {
    if (out) await rm(dirname(out), { recursive: true, force: true });
  }
}

export interface LayerInput {
  /** The blob file: a tar, gzip'd or zstd'd (told apart by its bytes); a function is called only when the layer is not cached (a download). */
  blob: string | (() => Promise<string>);
  /** The uncompressed tar's sha256 (the image config's diff_ids entry): the cache key, checked while applying. */
  diffId: string;
  /** The digest of the blob as fetched, for messages. */
  digest?: string;
}

/**
 * One layer applied over `parents` (the chain so far, lowest first, the empty ext4 layer at the
 * bottom). ConvertError DigestMismatch when the tar is not `diffId`; nothing is cached then.
 */
export async function convertLayer(
  ctx: ConvertContext,
  parents: ConvertedLayer[],
  input: LayerInput,
  sizeBytes: number,
  onProgress?: (p: LayerProgress) => void,
): Promise<ConvertedLayer> {
  const parent = parents.at(-1);
  if (!parent) throw new RangeError("convertLayer needs its parents: at least the empty ext4 layer");
  await initCache(ctx);
  const chain = chainId(parent.chain, input.diffId);
  let done: ApplyMessage & { type: "done" } | undefined;
  let out: string | undefined;
  ctx.cache.hold(parents.map((p) => p.chain));
  try {
    const r = await ctx.cache.get(chain, async () => {
      const blob = typeof input.blob === "string" ? input.blob : await input.blob();
      return (out = await onDevice(ctx, parents.map((p) => p.path), sizeBytes, true, async (dev, work) => {
        const mnt = join(work, "mnt");
        await mkdir(mnt);
        await run(["mount", "-t", "ext4", "-o", MOUNT_OPTIONS, dev.loop!, mnt], CONVERT_TIMEOUT_MS.mount, "mount");
        let applied: ApplyMessage & { type: "done" };
        try {
          applied = await applyInWorker(mnt, blob, input.digest ?? input.diffId, onProgress);
        } catch (e) {
          await run(["umount", mnt], CONVERT_TIMEOUT_MS.mount, "umount").catch(() => {}); // the apply's error is the one to report
          throw e;
        }
        // ext4 counts the errors it met (a write the device refused, a journal abort); a layer with any is not kept.
        const errors = await readFile(`/sys/fs/ext4/${basename(dev.loop!)}/errors_count`, "utf8").then(Number, () => 0);
        await run(["umount", mnt], CONVERT_TIMEOUT_MS.mount, "umount");
        if (errors > 0) throw new ConvertError("ApplyFailed", `ext4 reported ${errors} errors while the layer was applied (the block device refused writes; see the kernel log)`, undefined, input.digest ?? input.diffId);
        if (applied.diffId !== input.diffId) {
          throw new ConvertError("DigestMismatch", `the uncompressed layer is ${applied.diffId}, the image's config says ${input.diffId}`, undefined, input.digest);
        }
        done = applied;
      }));
    });
    const d = done as (ApplyMessage & { type: "done" }) | undefined;
    return { chain, path: r.path, converted: r.made, diffId: d?.diffId, compression: d?.compression, stats: d?.stats };
  } finally {
    ctx.cache.release(parents.map((p) => p.chain));
    if (out) await rm(dirname(out), { recursive: true, force: true });
  }
}

interface Device {
  id: string;
  path: string;
  loop: string | null;
}

/**
 * A blockd device with a fresh upper over `lowers`, handed to `use`, then its upper sealed by
 * restack into `<work>/layer.sealed` (returned) and the device deleted. The work folder goes on failure.
 */
async function onDevice(ctx: ConvertContext, lowers: string[], size: number, loop: boolean, use: (dev: Device, work: string) => Promise<void>): Promise<string> {
  const work = await ctx.cache.workDir();
  const out = join(work, "layer.sealed");
  try {
    const dev = await ctx.blockd.call<Device>("create", { lowers, upperDir: join(work, "upper"), size, loop });
    try {
      await use(dev, work);
      await ctx.blockd.call("restack", { id: dev.id, layerPath: out });
    } finally {
      await ctx.blockd.call("delete", { id: dev.id }).catch(() => {});
    }
    // The sealed file stays until the cache has linked it; the caller removes the folder then.
    await rm(join(work, "upper"), { recursive: true, force: true });
    return out;
  } catch (e) {
    await rm(work, { recursive: true, force: true }).catch(() => {});
    throw e;
  }
}

/** Apply a blob onto a mounted root on a worker thread, bounded in time. */
function applyInWorker(root: string, blob: string, layer: string, onProgress?: (p: LayerProgress) => void): Promise<ApplyMessage & { type: "done" }> {
  const worker = new Worker(new URL("./apply_worker.ts", import.meta.url).href);
  let timer: ReturnType<typeof setTimeout> | undefined;
  return new Promise<ApplyMessage & { type: "done" }>((resolve, reject) => {
    timer = setTimeout(() => reject(new ConvertError("Timeout", `not applied within ${CONVERT_TIMEOUT_MS.apply} ms`, undefined, layer)), CONVERT_TIMEOUT_MS.apply);
    worker.onmessage = (ev: MessageEvent<ApplyMessage>) => {
      const m = ev.data;
      if (m.type === "progress") {
        try {
          onProgress?.({ blobBytes: m.blobBytes, tarBytes: m.tarBytes });
        } catch {} // a progress callback's failure is the caller's
      } else if (m.type === "done") resolve(m);
      else reject(new ConvertError(m.code, m.message, m.entry, layer));
    };
    worker.onerror = (ev) => reject(new ConvertError("ApplyFailed", `apply worker: ${ev.message}`, undefined, layer));
    worker.addEventListener("close", () => reject(new ConvertError("ApplyFailed", "apply worker ended without an answer", undefined, layer)));
    worker.postMessage({ root, blob });
  }).finally(() => {
    clearTimeout(timer);
    worker.terminate();
  });
}

/** Output kept for an error: mount and mkfs say what went wrong in their last lines. */
const TAIL_BYTES = 4000;

/** A tool, awaited; MountFailed with its output's tail on a non-zero exit or past timeoutMs (killed). */
async function run(argv: string[], timeoutMs: number, what: string): Promise<void> {
  const p = Bun.spawn(argv, {
    stdout: "pipe", stderr: "pipe",
    env: { PATH: "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", LC_ALL: "C" },
  });
  let timedOut = false;
  const timer = setTimeout(() => {
    timedOut = true;
    p.kill("SIGKILL");
  }, timeoutMs);
  const [out, err] = await Promise.all([new Response(p.stdout).text(), new Response(p.stderr).text(), p.exited]).finally(() => clearTimeout(timer));
  if (timedOut) throw new ConvertError("Timeout", `${what} did not finish within ${timeoutMs} ms (killed)`);
  if (p.exitCode !== 0) throw new ConvertError("MountFailed", `${argv.join(" ")} exited ${p.exitCode ?? p.signalCode}: ${(out + err).trim().slice(-TAIL_BYTES)}`);
}
