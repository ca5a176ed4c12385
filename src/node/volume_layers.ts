// What the node's volumes (src/orchestrator/volumes.ts) get from the parts the orchestrator may not
// import: the empty ext4 layer at the bottom of every volume (src/template's, made once per size in
// its own layer cache under $AENV_HOME/volumes/empty) and the commit of a volume's stack into one
// layer (src/storage's Image.commit), which bounds how many layers a volume stacks.
import { join } from "node:path";
import type { BlockdClient } from "../blockdev/client.ts";
import { Image } from "../storage/image.ts";
import { LocalFile } from "../storage/local_file.ts";
import { emptyExt4Layer } from "../template/convert.ts";
import { LayerCache } from "../template/layer_cache.ts";
import { VOLUME_EMPTY_DIR, type VolumeStoreOptions } from "../orchestrator/volumes.ts";

/** Empty ext4 layers kept (one per volume size asked; each holds its journal and metadata: ~70 MiB for 2 GiB). */
const EMPTY_CACHE_BYTES = 4 * 2 ** 30;

/** The empty layer and the commit for the volumes in `volumesDir` ($AENV_HOME/volumes). */
export function volumeLayers(volumesDir: string, blockd: BlockdClient): Pick<VolumeStoreOptions, "emptyLayer" | "commit"> {
  const cache = new LayerCache(join(volumesDir, VOLUME_EMPTY_DIR), { capacityBytes: EMPTY_CACHE_BYTES });
  return {
    emptyLayer: async (sizeBytes) => (await emptyExt4Layer({ cache, blockd }, sizeBytes)).path,
    commit: commitLayers,
  };
}

/** `layers` (lowest first) as one dense sealed layer in `out` (synced before it returns). */
export async function commitLayers(layers: string[], out: string): Promise<void> {
  const image = await Image.open({ lowers: layers.map((file) => ({ file })) });
  try {
    const f = LocalFile.open(out, { write: true, create: true, mode: 0o644 });
    try {
      await image.commit(f);
      await f.fdatasync();
    } finally {
      await f.close();
    }
  } finally {
    await image.close();
  }
}
