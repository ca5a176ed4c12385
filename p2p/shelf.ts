// LayerShelf: the verified layer files this node may serve to peers. A file goes on the shelf only
// after its bytes hash to its digest; `provider` is the PeerNode's LayerProvider over it.

import { stat } from "node:fs/promises";
import { isLayerDigest, type LayerDigest } from "../src/storage/remote/source.ts";
import type { LayerProvider } from "./node.ts";

/** Layers one shelf holds. */
export const MAX_SHELF = 65_536;

export class ShelfError extends Error {
  override name = "ShelfError";
  constructor(readonly path: string, why: string) {
    super(`${path}: ${why}`);
  }
}

/** sha256 of a file, read as a stream (never the whole file in memory). */
export async function sha256OfFile(path: string): Promise<{ digest: LayerDigest; size: number }> {
  const h = new Bun.CryptoHasher("sha256");
  let size = 0;
  for await (const chunk of Bun.file(path).stream()) {
    h.update(chunk);
    size += chunk.length;
  }
  return { digest: `sha256:${h.digest("hex")}`, size };
}

export class LayerShelf {
  private readonly layers = new Map<LayerDigest, { path: string; size: number }>();

  /** Hash the file and shelve it; with `expect`, a different hash is refused. */
  async add(path: string, expect?: LayerDigest): Promise<LayerDigest> {
    if (expect !== undefined && !isLayerDigest(expect)) throw new ShelfError(path, `${expect} is not a sha256 digest`);
    const { digest, size } = await sha256OfFile(path);
    if (expect !== undefined && digest !== expect) throw new ShelfError(path, `hashes to ${digest}, not ${expect}`);
    this.put(digest, path, size);
    return digest;
  }

  /** Shelve a file its caller has just verified (a layer a PeerChunkSource fetched and hashed). */
  addVerified(digest: LayerDigest, path: string, size: number): void {
    this.put(digest, path, size);
  }

  remove(digest: LayerDigest): boolean {
    return this.layers.delete(digest);
  }

  get(digest: LayerDigest): { path: string; size: number } | undefined {
    return this.layers.get(digest);
  }

  /** The digests on the shelf (at most MAX_SHELF). */
  digests(): LayerDigest[] {
    return [...this.layers.keys()];
  }

  /** Served only while the file is still there with its verified size. */
  readonly provider: LayerProvider = async (digest) => {
    const l = this.layers.get(digest);
    if (!l) return undefined;
    const st = await stat(l.path).catch(() => undefined);
    if (!st || st.size !== l.size) {
      this.layers.delete(digest);
      return undefined;
    }
    return l;
  };

  private put(digest: LayerDigest, path: string, size: number): void {
    if (!this.layers.has(digest) && this.layers.size >= MAX_SHELF) throw new ShelfError(path, `the shelf holds ${MAX_SHELF} layers already`);
    this.layers.set(digest, { path, size });
  }
}
