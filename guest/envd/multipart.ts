// Streaming multipart/form-data reader: parts are handed to the caller as they arrive, so uploads
// of any size go to disk without being buffered in memory.

export class MultipartError extends Error {}

export interface PartSink {
  write(chunk: Uint8Array): Promise<unknown> | unknown;
  end(): Promise<unknown> | unknown;
}

export interface PartHeaders {
  name?: string;
  filename?: string;
  headers: Map<string, string>;
}

const CRLF = new Uint8Array([13, 10]);
const MAX_HEADER_BYTES = 16 * 1024;

export function boundaryOf(contentType: string): string | undefined {
  const m = /;\s*boundary\s*=\s*(?:"([^"]+)"|([^;\s]+))/i.exec(contentType);
  return m ? (m[1] ?? m[2]) : undefined;
}

/** Content-Disposition parameters; filename* (RFC 5987) wins over filename. Values are kept verbatim. */
export function dispositionParams(value: string): Record<string, string> {
  const out: Record<string, string> = {};
  const re = /;\s*([^=;\s]+)\s*=\s*(?:"((?:[^"\\]|\\.)*)"|([^;]*))/g;
  for (let m = re.exec(value); m; m = re.exec(value)) {
    const key = m[1]!.toLowerCase();
    let v = m[2] !== undefined ? m[2].replace(/\\(.)/g, "$1") : m[3]!.trim();
    if (key.endsWith("*")) {
      const ext = /^([^']*)'[^']*'(.*)$/.exec(v);
      try {
        v = ext ? decodeURIComponent(ext[2]!) : v;
      } catch {
        // keep it raw
      }
      out[key.slice(0, -1)] = v;
    } else if (!(key in out)) out[key] = v;
  }
  return out;
}

function concat(a: Uint8Array, b: Uint8Array): Uint8Array {
  if (!a.length) return b;
  const out = new Uint8Array(a.length + b.length);
  out.set(a);
  out.set(b, a.length);
  return out;
}

/**
 * Reads the body and calls `onPart` per part; the sink it returns (or null to skip the part)
 * receives the part's bytes, with backpressure.
 */
export async function readMultipart(
  body: ReadableStream<Uint8Array>,
  boundary: string,
  onPart: (h: PartHeaders) => Promise<PartSink | null> | PartSink | null,
): Promise<void> {
  const delim = Buffer.from(`\r\n--${boundary}`);
  // A virtual CRLF in front lets the first boundary match the same delimiter as the others.
  let buf: Uint8Array = CRLF;
  type State = "preamble" | "after" | "headers" | "body" | "done";
  let state = "preamble" as State; // `as`: step() changes it, which narrowing cannot see
  let sink: PartSink | null = null;
  const reader = body.getReader();
  let eof = false;

  const step = async (): Promise<boolean> => {
    const b = Buffer.from(buf.buffer, buf.byteOffset, buf.byteLength);
    switch (state) {
      case "preamble": {
        const i = b.indexOf(delim);
        if (i < 0) {
          buf = buf.slice(Math.max(0, buf.length - delim.length));
          return false;
        }
        buf = buf.slice(i + delim.length);
        state = "after";
        return true;
      }
      case "after": {
        if (buf.length < 2) return false;
        if (buf[0] === 45 && buf[1] === 45) {
          state = "done";
          return false;
        }
        const nl = b.indexOf(CRLF);
        if (nl < 0) {
          if (buf.length > 256) throw new MultipartError("malformed boundary line");
          return false;
        }
        buf = buf.slice(nl + 2); // transport padding before the CRLF is ignored
        state = "headers";
        return true;
      }
      case "headers": {
        let end: number;
        let skip: number;
        if (buf.length >= 2 && buf[0] === 13 && buf[1] === 10) {
          end = 0;
          skip = 2;
        } else {
          end = b.indexOf("\r\n\r\n");
          skip = 4;
        }
        if (end < 0) {
          if (buf.length > MAX_HEADER_BYTES) throw new MultipartError("part headers too large");
          return false;
        }
        const headers = new Map<string, string>();
        for (const line of b.subarray(0, end).toString("utf8").split("\r\n")) {
          const c = line.indexOf(":");
          if (c > 0) headers.set(line.slice(0, c).trim().toLowerCase(), line.slice(c + 1).trim());
        }
        const disp = dispositionParams(headers.get("content-disposition") ?? "");
        sink = await onPart({ name: disp.name, filename: disp.filename, headers });
        buf = buf.slice(end + skip);
        state = "body";
        return true;
      }
      case "body": {
        const i = b.indexOf(delim);
        if (i >= 0) {
          if (i > 0 && sink) await sink.write(buf.slice(0, i));
          if (sink) await sink.end();
          sink = null;
          buf = buf.slice(i + delim.length);
          state = "after";
          return true;
        }
        const keep = delim.length - 1; // a delimiter may straddle the next chunk
        if (buf.length > keep) {
          if (sink) await sink.write(buf.slice(0, buf.length - keep));
          buf = buf.slice(buf.length - keep);
        }
        return false;
      }
      default:
        return false;
    }
  };

  try {
    for (;;) {
      while (state !== "done" && (await step()));
      if (state === "done" || eof) break;
      const { done, value } = await reader.read();
      if (done) eof = true;
      else buf = concat(buf, value);
    }
    if (state !== "done") throw new MultipartError("unexpected end of multipart body");
  } finally {
    reader.releaseLock();
  }
}
