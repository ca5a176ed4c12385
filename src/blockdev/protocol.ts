// blockd's RPC: length-prefixed JSON over a unix socket. A frame is a u32 big-endian byte count
// then a UTF-8 JSON object. Requests {v, id, method, params}; replies {v, id, result} or
// {v, id, error: {code, message}}. Every request gets exactly one reply.

export const PROTOCOL_VERSION = 1;
/** Frames above this are refused (a device table or image config is far smaller). */
export const MAX_FRAME = 4 << 20;

export class BlockdError extends Error {
  constructor(
    readonly code: string,
    message: string,
  ) {
    super(message);
    this.name = code;
  }
}

export interface Request {
  v: number;
  id: number;
  method: string;
  params?: Record<string, unknown>;
}

export interface Reply {
  v: number;
  id: number;
  result?: unknown;
  error?: { code: string; message: string };
}

export function encodeFrame(obj: unknown): Uint8Array {
  const body = new TextEncoder().encode(JSON.stringify(obj));
  if (body.length > MAX_FRAME) throw new BlockdError("FrameTooLarge", `frame of ${body.length} bytes exceeds ${MAX_FRAME}`);
  const out = new Uint8Array(4 + body.length);
  new DataView(out.buffer).setUint32(0, body.length, false);
  out.set(body, 4);
  return out;
}

/** Accumulates socket bytes and yields whole frames; a bad length poisons the stream. */
export class FrameReader {
  private buf = new Uint8Array(0);
  push(chunk: Uint8Array): Uint8Array[] {
    const merged = new Uint8Array(this.buf.length + chunk.length);
    merged.set(this.buf);
    merged.set(chunk, this.buf.length);
    this.buf = merged;
    const frames: Uint8Array[] = [];
    for (;;) {
      if (this.buf.length < 4) break;
      const n = new DataView(this.buf.buffer, this.buf.byteOffset).getUint32(0, false);
      if (n > MAX_FRAME) throw new BlockdError("FrameTooLarge", `frame of ${n} bytes exceeds ${MAX_FRAME}`);
      if (this.buf.length < 4 + n) break;
      frames.push(this.buf.slice(4, 4 + n));
      this.buf = this.buf.slice(4 + n);
    }
    return frames;
  }
}
