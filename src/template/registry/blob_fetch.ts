// A blob download to a file: bytes go to `<dest>.partial`, hashed (sha256) as they arrive; a
// dropped connection resumes with `Range: bytes=N-` (a partial left by an earlier run is re-hashed
// first, so the hash always covers the whole file, and when the whole does not match, the blob is
// downloaded once more from byte 0); a descriptor above the transport's maxBlobBytes is refused
// before any request, an answer whose Content-Length is past the descriptor's size before its body
// is read, and the registry may send at most the descriptor's size; the file is renamed to dest
// only when its digest matches. A mismatch deletes the partial.
// One download per dest at a time in this process: a second caller for the same dest waits for it.
import { open, rename, rm, stat } from "node:fs/promises";
import { resolve as resolvePath } from "node:path";
import { RegistryError } from "./errors.ts";
import type { Descriptor } from "./manifest.ts";
import { formatImageRef, type ImageRef, SHA256_DIGEST } from "./reference.ts";
import { Retryable, type Transport } from "./transport.ts";

export interface FetchBlobOptions {
  /** Called as bytes arrive: bytes in the file so far, and the descriptor's size. */
  onProgress?: (bytes: number, total: number) => void;
  /** No bytes for this long ends the connection (and a resume follows) [the transport's timeoutMs]. */
  idleTimeoutMs?: number;
}

export interface FetchedBlob {
  path: string;
  digest: string;
  size: number;
  /** Bytes that came over the network in this call (0 when dest already held the blob). */
  downloaded: number;
}

const inflight = new Map<string, { digest: string; done: Promise<FetchedBlob> }>();

async function sizeOf(path: string): Promise<number | undefined> {
  try {
    return (await stat(path)).size;
  } catch (e) {
    if ((e as { code?: string }).code === "ENOENT") return undefined;
    throw e;
  }
}

/** sha256 of a file's first `length` bytes, as a running hasher. */
async function hashPrefix(path: string, length: number): Promise<Bun.CryptoHasher> {
  const h = new Bun.CryptoHasher("sha256");
  if (length === 0) return h;
  for await (const chunk of Bun.file(path).slice(0, length).stream()) h.update(chunk);
  return h;
}

export async function fetchBlobToFile(t: Transport, ref: ImageRef, desc: Descriptor, destPath: string, opts: FetchBlobOptions = {}): Promise<FetchedBlob> {
  const key = resolvePath(destPath);
  const running = inflight.get(key);
  if (running) {
    if (running.digest !== desc.digest) {
      throw new RegistryError("Protocol", `blob ${desc.digest} of ${formatImageRef(ref)}: ${destPath} is being fetched for ${running.digest}`);
    }
    const r = await running.done;
    opts.onProgress?.(r.size, r.size);
    return { ...r, downloaded: 0 };
  }
  const done = download(t, ref, desc, key, opts).finally(() => inflight.delete(key));
  inflight.set(key, { digest: desc.digest, done });
  return done;
}

async function download(t: Transport, ref: ImageRef, desc: Descriptor, dest: string, opts: FetchBlobOptions, carried = 0): Promise<FetchedBlob> {
  const what = `blob ${desc.digest} of ${formatImageRef(ref)}`;
  if (!SHA256_DIGEST.test(desc.digest)) throw new RegistryError("Protocol", `${what}: not a sha256 digest`);
  if (!Number.isSafeInteger(desc.size) || desc.size < 0) throw new RegistryError("Protocol", `${what}: size ${desc.size} is not a byte count`);
  if (desc.size > t.maxBlobBytes) throw new RegistryError("TooLarge", `${what}: the manifest names ${desc.size} bytes, more than this node's max_blob_mb (${t.maxBlobBytes} bytes)`);
  const want = desc.digest.slice("sha256:".length);
  const total = desc.size;

  // A file at dest was renamed there after verifying; it is checked again, as it costs one read.
  const existing = await sizeOf(dest);
  if (existing !== undefined) {
    if (existing === total && (await hashPrefix(dest, total)).digest("hex") === want) {
      opts.onProgress?.(total, total);
      return { path: dest, digest: desc.digest, size: total, downloaded: 0 };
    }
    await rm(dest, { force: true });
  }

  const partial = `${dest}.partial`;
  let offset = (await sizeOf(partial)) ?? 0;
  if (offset > total) offset = 0;
  const resumedFrom = offset;
  let hasher = await hashPrefix(partial, offset);
  const file = await open(partial, offset === 0 ? "w" : "r+");
  let downloaded = carried;
  try {
    if (offset === 0) await file.truncate(0);
    let failures = 0;
    while (offset < total || total === 0) {
      const before = offset;
      try {
        const answer = await t.attempt({
          ref,
          method: "GET",
          path: `blobs/${desc.digest}`,
          headers: offset > 0 ? { range: `bytes=${offset}-` } : {},
          actions: "pull",
          what,
          expect: [200, 206],
        });
        const res = answer.res;
        if (res.status === 200 && offset > 0) {
          // The registry ignored the Range: start over.
          offset = 0;
          hasher = new Bun.CryptoHasher("sha256");
          await file.truncate(0);
        } else if (res.status === 206) {
          const m = /^bytes (\d+)-/.exec(res.headers.get("content-range") ?? "");
          if (!m || Number(m[1]) !== offset) {
            await res.body?.cancel().catch(() => {});
            throw new RegistryError("Protocol", `${what}: asked for bytes ${offset}- and got Content-Range ${JSON.stringify(res.headers.get("content-range"))}`);
          }
        }
        const declared = Number(res.headers.get("content-length") ?? "NaN");
        if (Number.isFinite(declared) && declared > total - offset) {
          await res.body?.cancel().catch(() => {});
          await rm(partial, { force: true });
          throw new RegistryError("TooLarge", `${what}: registry ${ref.endpoint} announced ${declared} bytes from byte ${offset}, past the ${total} bytes the manifest names`);
        }
        const idleMs = opts.idleTimeoutMs ?? t.timeoutMs;
        let idle = setTimeout(() => answer.controller.abort(), idleMs);
        try {
          const reader = res.body!.getReader();
          for (;;) {
            let chunk: Awaited<ReturnType<typeof reader.read>>;
            try {
              chunk = await reader.read();
            } catch (e) {
              throw new Retryable(new RegistryError("Unreachable", `${what}: connection to ${ref.endpoint} dropped at byte ${offset} of ${total} (${(e as Error).message})`));
            }
            const { done, value } = chunk;
            if (done) break;
            clearTimeout(idle);
            idle = setTimeout(() => answer.controller.abort(), idleMs);
            if (offset + value.length > total) {
              await reader.cancel().catch(() => {});
              await rm(partial, { force: true });
              throw new RegistryError("TooLarge", `${what}: registry ${ref.endpoint} sent more than the ${total} bytes the manifest names`);
            }
            await file.write(value, 0, value.length, offset);
            hasher.update(value);
            offset += value.length;
            downloaded += value.length;
            opts.onProgress?.(offset, total);
          }
        } finally {
          clearTimeout(idle);
        }
        if (offset < total) {
          throw new Retryable(new RegistryError("Unreachable", `${what}: connection to ${ref.endpoint} ended at byte ${offset} of ${total}`));
        }
        break;
      } catch (e) {
        if (!(e instanceof Retryable)) throw e;
        // A try that brought bytes is progress, not a failure: only tries in a row without any count.
        failures = offset > before ? 1 : failures + 1;
        if (failures >= t.tries) {
          e.error.message += ` (after ${failures} tries without progress)`;
          throw e.error;
        }
        await new Promise((r) => setTimeout(r, t.backoffMs(failures, e.retryAfterMs)));
      }
    }
    await file.sync();
  } finally {
    await file.close();
  }
  const got = hasher.digest("hex");
  if (got !== want) {
    await rm(partial, { force: true });
    // The partial an earlier run left may be what was wrong: one more download, from byte 0.
    if (resumedFrom > 0) return download(t, ref, desc, dest, opts, downloaded);
    throw new RegistryError("DigestMismatch", `${what}: registry ${ref.endpoint} sent bytes whose sha256 is ${got}`);
  }
  await rename(partial, dest);
  return { path: dest, digest: desc.digest, size: total, downloaded };
}
