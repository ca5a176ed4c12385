// The wire format of `aenv/layers/1` (docs/p2p.md has it byte by byte). One request per QUIC
// bidirectional stream: the client writes one header frame and finishes its side; the server
// answers with one header frame, then (for a read) exactly the announced bytes, and finishes.
// A frame is a 4-byte big-endian length (1..MAX_FRAME) and that many bytes of UTF-8 JSON.

import type { RecvStream, SendStream } from "@number0/iroh";
import { isLayerDigest, type LayerDigest } from "../src/storage/remote/source.ts";
import { MalformedFrameError, PeerError, PeerRangeError, PeerTimeoutError, ShortReadError, UnknownDigestError } from "./errors.ts";

export const LAYERS_ALPN = "aenv/layers/1";
/** The binding takes ALPNs as plain number arrays. */
export const LAYERS_ALPN_BYTES: number[] = Array.from(new TextEncoder().encode(LAYERS_ALPN));

/** Largest header frame either side accepts: a have? of MAX_HAVE digests is about 75 KiB of JSON. */
export const MAX_FRAME = 128 << 10;
/** Digests in one have? request. */
export const MAX_HAVE = 1024;
/** Bytes one read request may ask for. */
export const MAX_READ = 4 << 20;
/** Bytes handed to the binding per write/read call: its per-call overhead is paid once per this. */
export const WIRE_CHUNK = 256 << 10;

export type Request =
  | { op: "have"; digests: LayerDigest[] }
  | { op: "read"; digest: LayerDigest; offset: number; length: number };

export interface HaveEntry { digest: LayerDigest; size: number }

export type Response =
  | { ok: true; have: HaveEntry[] }
  | { ok: true; length: number; size: number }
  | { ok: false; error: ErrorCode; message: string };

/** The error names a server may answer with; the client turns each into its named error class. */
export type ErrorCode = "MalformedFrame" | "UnknownDigest" | "Range" | "Internal";

/** Uint8Array → the number[] the binding takes. A plain loop: about twice as fast as Array.from here. */
export function toNumbers(b: Uint8Array): number[] {
  const a = new Array<number>(b.length);
  for (let i = 0; i < b.length; i++) a[i] = b[i]!;
  return a;
}

export function encodeFrame(value: unknown): number[] {
  const body = new TextEncoder().encode(JSON.stringify(value));
  if (body.length > MAX_FRAME) throw new MalformedFrameError(`frame of ${body.length} bytes (at most ${MAX_FRAME})`);
  const out = new Array<number>(4 + body.length);
  const n = body.length;
  out[0] = n >>> 24; out[1] = (n >>> 16) & 255; out[2] = (n >>> 8) & 255; out[3] = n & 255;
  for (let i = 0; i < n; i++) out[4 + i] = body[i]!;
  return out;
}

/**
 * Resolve with p, or reject with PeerTimeoutError after ms / with the signal's reason; onStop runs
 * once on either (it stops the stream, which also settles p).
 */
export async function bounded<T>(p: Promise<T>, ms: number, what: string, peerId: string, signal?: AbortSignal, onStop?: () => void): Promise<T> {
  let timer: ReturnType<typeof setTimeout> | undefined;
  let onAbort: (() => void) | undefined;
  const stop = new Promise<never>((_, reject) => {
    const fail = (e: Error) => { try { onStop?.(); } catch { /* the stream is gone already */ } reject(e); };
    timer = setTimeout(() => fail(new PeerTimeoutError(what, ms, peerId)), ms);
    if (signal) {
      onAbort = () => fail(signal.reason instanceof Error ? signal.reason : new PeerTimeoutError(`${what} (aborted)`, ms, peerId));
      if (signal.aborted) onAbort(); else signal.addEventListener("abort", onAbort, { once: true });
    }
  });
  try {
    return await Promise.race([p, stop]);
  } finally {
    clearTimeout(timer);
    if (onAbort) signal?.removeEventListener("abort", onAbort);
    p.catch(() => {}); // settled by onStop; its late rejection is not news
  }
}

/** Read one frame and parse its JSON; a bad length, a stream that ends inside it, or bad JSON is MalformedFrameError. */
export async function readFrame(recv: RecvStream, peerId = ""): Promise<Record<string, unknown>> {
  let head: number[];
  try {
    head = await recv.readExact(4);
  } catch (e) {
    throw new MalformedFrameError(`stream ended before a frame (${(e as Error).message.split("\n")[0]})`, peerId);
  }
  const n = ((head[0]! << 24) >>> 0) + (head[1]! << 16) + (head[2]! << 8) + head[3]!;
  if (n < 1 || n > MAX_FRAME) throw new MalformedFrameError(`frame length ${n} (1..${MAX_FRAME})`, peerId);
  let body: number[];
  try {
    body = await recv.readExact(n);
  } catch {
    throw new MalformedFrameError(`stream ended inside a frame of ${n} bytes`, peerId);
  }
  let v: unknown;
  try {
    v = JSON.parse(new TextDecoder("utf-8", { fatal: true }).decode(new Uint8Array(body)));
  } catch {
    throw new MalformedFrameError("frame is not UTF-8 JSON", peerId);
  }
  if (typeof v !== "object" || v === null || Array.isArray(v)) throw new MalformedFrameError("frame is not a JSON object", peerId);
  return v as Record<string, unknown>;
}

function isCount(v: unknown): v is number {
  return typeof v === "number" && Number.isSafeInteger(v) && v >= 0;
}

/** Check a request frame against docs/p2p.md; anything else is MalformedFrameError. */
export function parseRequest(v: Record<string, unknown>): Request {
  if (v.op === "have") {
    const d = v.digests;
    if (!Array.isArray(d) || d.length > MAX_HAVE || !d.every(isLayerDigest)) {
      throw new MalformedFrameError(`have? needs "digests": up to ${MAX_HAVE} sha256:<64 hex> strings`);
    }
    return { op: "have", digests: d };
  }
  if (v.op === "read") {
    if (!isLayerDigest(v.digest) || !isCount(v.offset) || !isCount(v.length)) {
      throw new MalformedFrameError(`read needs "digest" (sha256:<64 hex>), "offset" and "length" (integers ≥ 0)`);
    }
    if (v.length > MAX_READ) throw new PeerRangeError(`read of ${v.length} bytes (at most ${MAX_READ} per request)`);
    return { op: "read", digest: v.digest, offset: v.offset, length: v.length };
  }
  throw new MalformedFrameError(`unknown op ${JSON.stringify(v.op)}`);
}

/** A server's error frame → the client's named error. */
export function errorFromFrame(v: Record<string, unknown>, peerId: string, digest?: string): PeerError {
  const msg = typeof v.message === "string" ? v.message : "";
  switch (v.error) {
    case "MalformedFrame": return new MalformedFrameError(`the peer says: ${msg}`, peerId);
    case "UnknownDigest": return new UnknownDigestError(digest ?? msg, peerId);
    case "Range": return new PeerRangeError(msg, peerId);
    default: return new PeerError(`${String(v.error)}: ${msg}`, peerId, true);
  }
}

/** Read exactly `want` bytes of a read answer into a fresh buffer; fewer before the stream ends is ShortReadError. */
export async function readData(recv: RecvStream, want: number, peerId: string): Promise<Uint8Array> {
  const out = new Uint8Array(want);
  let pos = 0;
  while (pos < want) {
    let a: number[];
    try {
      a = await recv.read(Math.min(WIRE_CHUNK, want - pos));
    } catch {
      throw new ShortReadError(pos, want, peerId);
    }
    if (a.length === 0) throw new ShortReadError(pos, want, peerId);
    out.set(a, pos);
    pos += a.length;
  }
  return out;
}

/** Write b in WIRE_CHUNK pieces. */
export async function writeData(send: SendStream, b: Uint8Array): Promise<void> {
  for (let pos = 0; pos < b.length; pos += WIRE_CHUNK) {
    await send.writeAll(toNumbers(b.subarray(pos, Math.min(b.length, pos + WIRE_CHUNK))));
  }
}
