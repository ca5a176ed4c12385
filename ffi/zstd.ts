// libzstd (libzstd.so.1) through bun:ffi: zstd frames decoded straight into a caller's buffer with
// one decompression context per JS thread, reused. Bun.zstdDecompressSync makes a context and an
// output buffer per call: ~2 µs of the ~11 µs a 4 KiB block costs (bench/storage).

import { FFIType, dlopen, ptr } from "bun:ffi";

function load() {
  try {
    return dlopen("libzstd.so.1", {
      ZSTD_createDCtx: { args: [], returns: FFIType.ptr },
      // size_t results as i64: a count, or an error code, which is (size_t)-n: negative here.
      ZSTD_decompressDCtx: { args: [FFIType.ptr, FFIType.ptr, FFIType.u64, FFIType.ptr, FFIType.u64], returns: FFIType.i64_fast },
      ZSTD_getErrorName: { args: [FFIType.i64_fast], returns: FFIType.cstring },
    }).symbols;
  } catch {
    return null; // no libzstd on this host: callers use Bun's decoder
  }
}

const lib = load();
// Module state is per JS thread (each Worker loads its own copy): a context is never shared.
const dctx = lib?.ZSTD_createDCtx() ?? null;

const NO_BYTES = new Uint8Array(1);

/** Whether libzstd loaded and gave this thread a context. */
export const zstdLibLoaded = dctx !== null;

/**
 * Decode the zstd frame(s) in `src` into `dst`; returns the bytes written. Output that would not
 * fit `dst` is an error, so a frame never makes the decoder write past it. Throws an Error named
 * after zstd's error text. Call only when zstdLibLoaded.
 */
export function zstdDecompressInto(dst: Uint8Array, src: Uint8Array): number {
  if (!lib || !dctx) throw new Error("libzstd is not loaded");
  // An empty view has no address for bun:ffi: a byte of our own stands in, with length 0.
  const n = lib.ZSTD_decompressDCtx(dctx, ptr(dst.length ? dst : NO_BYTES), dst.length, ptr(src.length ? src : NO_BYTES), src.length) as number;
  if (n < 0) throw new Error(String(lib.ZSTD_getErrorName(n)));
  return n;
}
