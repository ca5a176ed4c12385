// Child of remote.test.ts: downloads one remote layer into a block cache until killed.
// usage: remote_download_child.ts URL DIGEST SIZE CACHE_DIR
import { BlockCache } from "../../src/storage/remote/block_cache.ts";
import { RegistryRangeSource } from "../../src/storage/remote/http_source.ts";
import { RemoteFile } from "../../src/storage/remote/remote_file.ts";

const [url, digest, size, dir] = process.argv.slice(2);
const cache = await BlockCache.open({ dir: dir!, capacity: 256 << 20 });
const f = RemoteFile.open({ digest: digest as `sha256:${string}`, size: Number(size), cache, sources: [new RegistryRangeSource({ url: url! })] });
await f.download();
