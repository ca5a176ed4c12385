// The converted-layer cache: sealed overlaybd layers by chain ID (OCI's: the sha256 chain of the
// diffIDs with the parent's chain, here with the empty-ext4 layer at the bottom), so a layer shared
// by several images is converted once. An entry is published by link(2) from a finished, fsync'd
// file in a work folder: it exists whole or not at all, and a second process finishing the same
// chain keeps the first file. Garbage collection runs between a high and a low watermark of the
// capacity, least recently used first, and never drops a pinned layer or one a conversion is using.

import { link, mkdir, open, readdir, rm, stat, utimes } from "node:fs/promises";
import { join } from "node:path";
import { ConvertError } from "./convert_error.ts";

export interface LayerCacheOptions {
  /** Bytes of layer files the cache aims to stay under [64 GiB]. */
  capacityBytes?: number;
  /** GC starts above this fraction of the capacity [0.9]… */
  highWatermark?: number;
  /** …and removes layers until the cache is below this fraction [0.7]. */
  lowWatermark?: number;
  /** Layer paths (or chain IDs) a template or snapshot references: never collected. */
  pinned?: () => Set<string>;
}

export interface CacheStats {
  /** Layers this process converted (or made: the empty ext4 layers). */
  conversions: number;
  /** Lookups answered by an existing layer. */
  hits: number;
  /** Calls that waited for the same layer's conversion in this process. */
  joined: number;
  /** Layers removed by GC. */
  collected: number;
}

const SHA256 = /^sha256:[0-9a-f]{64}$/;
/** Work folders are `<pid>-<random>`: a folder whose process is gone is a crashed conversion's. */
const WORK = "work";
const LAYERS = "layers";

/** OCI's chain ID step: sha256 over "<parent chain> <diffID>". */
export function chainId(parent: string, diffId: string): string {
  return `sha256:${new Bun.CryptoHasher("sha256").update(`${parent} ${diffId}`).digest("hex")}`;
}

export class LayerCache {
  readonly stats: CacheStats = { conversions: 0, hits: 0, joined: 0, collected: 0 };
  readonly capacityBytes: number;
  private readonly high: number;
  private readonly low: number;
  private inFlight = new Map<string, Promise<string>>();
  /** Chain IDs being made or used as a conversion's parents right now. */
  private busy = new Map<string, number>();
  private gcRunning: Promise<number> | null = null;
  private ready: Promise<void> | null = null;

  constructor(
    readonly dir: string,
    private readonly opts: LayerCacheOptions = {},
  ) {
    this.capacityBytes = opts.capacityBytes ?? 64 * 2 ** 30;
    this.high = opts.highWatermark ?? 0.9;
    this.low = opts.lowWatermark ?? 0.7;
    if (!(this.low > 0 && this.low < this.high && this.high <= 1)) throw new RangeError(`watermarks must satisfy 0 < low < high <= 1 (low ${this.low}, high ${this.high})`);
  }

  /** The file a chain's layer lives in (whether or not it exists yet). */
  layerPath(chain: string): string {
    if (!SHA256.test(chain)) throw new ConvertError("CacheCorrupt", `not a sha256 chain ID: ${chain}`);
    return join(this.dir, LAYERS, `${chain.slice(7)}.layer`);
  }

  /** The cache's folders exist; work folders of processes that are gone are removed (once per process). */
  init(sweep?: (workDir: string) => Promise<void>): Promise<void> {
    this.ready ??= (async () => {
      await mkdir(join(this.dir, LAYERS), { recursive: true });
      await mkdir(join(this.dir, WORK), { recursive: true });
      for (const name of await readdir(join(this.dir, WORK))) {
        const pid = Number.parseInt(name, 10);
        if (Number.isInteger(pid) && pid > 0 && processAlive(pid)) continue;
        const w = join(this.dir, WORK, name);
        await sweep?.(w).catch(() => {}); // best effort: what it cannot undo is tried again next start
        await rm(w, { recursive: true, force: true }).catch(() => {});
      }
    })();
    return this.ready;
  }

  /** A fresh work folder on the cache's file system (blockd's restack and link need that). */
  async workDir(): Promise<string> {
    await this.init();
    const w = join(this.dir, WORK, `${process.pid}-${crypto.randomUUID().slice(0, 8)}`);
    await mkdir(w);
    return w;
  }

  /** The layer of `chain`, made by `make` (which returns a finished file in a work folder) unless cached. */
  async get(chain: string, make: () => Promise<string>): Promise<{ path: string; made: boolean }> {
    await this.init();
    const path = this.layerPath(chain);
    if (await this.touch(path)) {
      this.stats.hits++;
      return { path, made: false };
    }
    const running = this.inFlight.get(chain);
    if (running) {
      this.stats.joined++;
      return { path: await running, made: false };
    }
    const p = (async () => {
      const tmp = await make();
      await syncPath(tmp);
      try {
        await link(tmp, path);
      } catch (e) {
        // Another process published the same chain first: its file stands.
        if ((e as NodeJS.ErrnoException).code !== "EEXIST") throw e;
      }
      await syncPath(join(this.dir, LAYERS));
      this.stats.conversions++;
      return path;
    })();
    this.inFlight.set(chain, p);
    this.hold([chain]);
    try {
      return { path: await p, made: true };
    } finally {
      this.inFlight.delete(chain);
      this.release([chain]);
    }
  }

  /** Chains a conversion reads (its parents) are not collected while it runs. */
  hold(chains: string[]): void {
    for (const c of chains) this.busy.set(c, (this.busy.get(c) ?? 0) + 1);
  }
  release(chains: string[]): void {
    for (const c of chains) {
      const n = (this.busy.get(c) ?? 1) - 1;
      if (n <= 0) this.busy.delete(c);
      else this.busy.set(c, n);
    }
  }

  /** Bytes the layer files take on disk. */
  async usedBytes(): Promise<number> {
    let total = 0;
    for (const l of await this.list()) total += l.bytes;
    return total;
  }

  /**
   * Above the high watermark, remove unpinned, unused layers, least recently used first, until
   * below the low one. Returns the bytes freed. One GC at a time; a caller during one joins it.
   */
  gc(): Promise<number> {
    this.gcRunning ??= this.gc_().finally(() => {
      this.gcRunning = null;
    });
    return this.gcRunning;
  }

  private async gc_(): Promise<number> {
    await this.init();
    const layers = await this.list();
    let used = layers.reduce((s, l) => s + l.bytes, 0);
    if (used <= this.high * this.capacityBytes) return 0;
    const pinned = this.opts.pinned?.() ?? new Set<string>();
    let freed = 0;
    for (const l of layers.sort((a, b) => a.usedAt - b.usedAt)) {
      if (used <= this.low * this.capacityBytes) break;
      if (pinned.has(l.path) || pinned.has(l.chain) || this.busy.has(l.chain)) continue;
      await rm(l.path, { force: true });
      used -= l.bytes;
      freed += l.bytes;
      this.stats.collected++;
    }
    return freed;
  }

  private async list(): Promise<{ chain: string; path: string; bytes: number; usedAt: number }[]> {
    const dir = join(this.dir, LAYERS);
    const out = [];
    for (const name of await readdir(dir)) {
      if (!name.endsWith(".layer")) continue;
      const path = join(dir, name);
      try {
        const s = await stat(path);
        out.push({ chain: `sha256:${name.slice(0, -6)}`, path, bytes: s.blocks * 512, usedAt: s.mtimeMs });
      } catch {} // removed meanwhile
    }
    return out;
  }

  /** Mark a layer used now (its mtime orders GC); false when it does not exist. */
  private async touch(path: string): Promise<boolean> {
    try {
      const now = new Date();
      await utimes(path, now, now);
      return true;
    } catch (e) {
      if ((e as NodeJS.ErrnoException).code === "ENOENT") return false;
      throw e;
    }
  }
}

/** fsync (a file's data, or a folder's entries) so a published name points at durable bytes. */
export async function syncPath(path: string): Promise<void> {
  const fh = await open(path, "r");
  try {
    await fh.sync();
  } finally {
    await fh.close();
  }
}

/** Whether a process with this pid exists (EPERM: it does, owned by someone else). */
export function processAlive(pid: number): boolean {
  try {
    process.kill(pid, 0);
    return true;
  } catch (e) {
    return (e as NodeJS.ErrnoException).code === "EPERM";
  }
}
