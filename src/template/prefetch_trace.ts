// A template's boot trace travels with its image (docs/templates.md, Prefetch traces in images):
// a push uploads the trace file (AETRACE1, src/storage/trace_file.ts) as one more blob and names it
// in two manifest annotations; a lazy pull fetches it, bounded, digest and checksum checked, and hands
// the bytes on for the build VM's rootfs device to replay. Best effort both ways: a trace that is
// missing, too large, unreadable or not a trace is logged and left out, never a failed push or pull.

import { readFile, rm, stat } from "node:fs/promises";
import { join } from "node:path";
import type { ImageLocation } from "./image_location.ts";
import type { Descriptor } from "./registry/manifest.ts";
import { isLayerDigest } from "../storage/remote/source.ts";
import { TRACE_MAX_FILE, TRACE_MIN_FILE, decodeTrace } from "../storage/trace_file.ts";

/** The trace blob's media type (ours). */
export const PREFETCH_TRACE_MEDIA = "application/vnd.aenv.prefetch-trace.v1";
/** Manifest annotations: the rootfs boot trace's blob digest, and its size in bytes. */
export const PREFETCH_ROOTFS_ANNOTATION = "org.aenv.prefetch.rootfs";
export const PREFETCH_ROOTFS_SIZE_ANNOTATION = "org.aenv.prefetch.rootfs.size";
/** A pull waits at most this long for the trace blob (its transport retries inside it). */
export const TRACE_FETCH_MS = 15_000;

/** Why `b` is not a whole trace file (TraceError's message), or undefined when it is one; blockd checks its fit to the device. */
function notATrace(b: Uint8Array): string | undefined {
  try {
    decodeTrace(b);
    return undefined;
  } catch (e) {
    return (e as Error).message;
  }
}

/** A trace file for a push: its bytes, or undefined (missing: silently; too large or not a trace: said why). */
export async function traceForPush(path: string | undefined, say: (m: string) => void): Promise<Uint8Array | undefined> {
  if (!path) return undefined;
  const st = await stat(path).catch(() => undefined);
  if (!st?.isFile()) return undefined;
  if (st.size > TRACE_MAX_FILE) {
    say(`prefetch trace ${path} left out: ${st.size} bytes, more than ${TRACE_MAX_FILE}`);
    return undefined;
  }
  const bytes = new Uint8Array(await readFile(path).catch(() => new Uint8Array()));
  const bad = notATrace(bytes);
  if (bad) {
    say(`prefetch trace ${path} left out: ${bad}`);
    return undefined;
  }
  return bytes;
}

/** The trace descriptor a manifest's annotations name, or undefined; a malformed pair is said and ignored. */
export function traceDescriptor(annotations: Record<string, string> | undefined, say: (m: string) => void): Descriptor | undefined {
  const digest = annotations?.[PREFETCH_ROOTFS_ANNOTATION];
  if (digest === undefined) return undefined;
  const size = Number(annotations?.[PREFETCH_ROOTFS_SIZE_ANNOTATION]);
  if (!isLayerDigest(digest) || !Number.isSafeInteger(size) || size < TRACE_MIN_FILE || size > TRACE_MAX_FILE) {
    say(`prefetch trace ignored: annotations ${PREFETCH_ROOTFS_ANNOTATION}=${digest.slice(0, 80)}, ${PREFETCH_ROOTFS_SIZE_ANNOTATION}=${annotations?.[PREFETCH_ROOTFS_SIZE_ANNOTATION]?.slice(0, 20)} (a sha256 digest and ${TRACE_MIN_FILE}..${TRACE_MAX_FILE} bytes)`);
    return undefined;
  }
  return { mediaType: PREFETCH_TRACE_MEDIA, digest, size };
}

/**
 * The trace blob `desc` from `from`, through a file in `work` (removed after), within TRACE_FETCH_MS;
 * undefined (said why) when it cannot be read, does not match its digest, or is not a trace.
 */
export async function fetchTrace(from: ImageLocation, desc: Descriptor, work: string, say: (m: string) => void): Promise<Uint8Array | undefined> {
  const dest = join(work, "rootfs.trace");
  let timer: Timer | undefined;
  try {
    const fetched = from.fetchBlob(desc, dest);
    fetched.catch(() => {}); // a fetch past the deadline settles unobserved
    const late = new Promise<never>((_, reject) => {
      timer = setTimeout(() => reject(new Error(`no answer within ${TRACE_FETCH_MS} ms`)), TRACE_FETCH_MS);
    });
    await Promise.race([fetched, late]);
    const bytes = new Uint8Array(await readFile(dest));
    const bad = notATrace(bytes);
    if (bad) {
      say(`prefetch trace ${desc.digest} of ${from.name} ignored: ${bad}`);
      return undefined;
    }
    return bytes;
  } catch (e) {
    say(`prefetch trace ${desc.digest} of ${from.name} ignored: ${(e as Error).message}`);
    return undefined;
  } finally {
    clearTimeout(timer);
    await rm(dest, { force: true }).catch(() => {});
    await rm(`${dest}.partial`, { force: true }).catch(() => {});
  }
}
