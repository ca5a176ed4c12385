// A remote lower for blockd tests and benches: a sealed layer of random bytes served by a loopback
// origin (test/storage/remote_origin.ts), named by a spec whose block cache is a folder of its own.
import { readFileSync } from "node:fs";
import { open } from "node:fs/promises";
import { join } from "node:path";
import { WritableLayer } from "../../src/storage/lsmt/writable_layer.ts";
import { randomBytes } from "./memfile.ts";
import { startBlobOrigin, type BlobOrigin } from "../storage/remote_origin.ts";

export interface RemoteLayerFixture {
  /** The device's bytes (the layer's virtual disk). */
  data: Uint8Array;
  origin: BlobOrigin;
  /** A lower over the origin with an empty block cache in `cacheDir` (no background download). */
  lower(cacheDir: string): Record<string, unknown>;
}

/** `mib` MiB of random bytes as a sealed layer under `dir`, served by a loopback origin. */
export async function remoteLayer(dir: string, mib: number, seed = 7): Promise<RemoteLayerFixture> {
  const data = randomBytes(mib << 20, seed);
  const p = join(dir, `remote-${seed}.layer`);
  const w = await WritableLayer.create(`${p}.data`, `${p}.index`, { virtualSize: data.length });
  await w.write(data, 0);
  await w.seal();
  await w.close();
  const bytes = new Uint8Array(readFileSync(`${p}.data`)); // the sealed layer file: what the origin serves
  const origin = startBlobOrigin(bytes);
  return {
    data,
    origin,
    lower: (cacheDir) => ({ digest: origin.digest, size: bytes.length, remote: { sources: [{ kind: "http", url: origin.url }], cache: { dir: cacheDir, capacity: 1 << 30 }, download: false } }),
  };
}

/** Read `length` bytes of a device file at `at` off the event loop (a pread on the fs thread pool). */
export async function preadDevice(path: string, at: number, length: number): Promise<Uint8Array> {
  const f = await open(path, "r");
  try {
    const b = new Uint8Array(length);
    let done = 0;
    while (done < length) {
      const { bytesRead } = await f.read(b, done, length - done, at + done);
      if (bytesRead <= 0) break;
      done += bytesRead;
    }
    return b.subarray(0, done);
  } finally {
    await f.close();
  }
}
