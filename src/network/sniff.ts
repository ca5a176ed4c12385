// The name a new TCP connection claims, read from its first bytes without decrypting anything:
// the TLS ClientHello's server_name (SNI), or the HTTP request's Host header. Pure functions over
// the bytes received so far: "more" until the bytes decide, at most MAX_SNIFF_BYTES.

/** The most a connection may send before it names its host (a ClientHello with many extensions is < 4 KiB). */
export const MAX_SNIFF_BYTES = 16 * 1024;

export type Sniffed =
  | { kind: "more" }
  | { kind: "tls"; name: string | undefined }
  | { kind: "http"; name: string | undefined }
  | { kind: "unknown" };

const HTTP_METHOD = /^[A-Z]{3,10} /;

export function sniff(buf: Buffer): Sniffed {
  if (buf.length === 0) return { kind: "more" };
  if (buf[0] === 0x16) return sniffTls(buf);
  const head = buf.subarray(0, 11).toString("latin1");
  if (!HTTP_METHOD.test(head)) {
    // A method still arriving ("GE") is more; anything else is not HTTP.
    return /^[A-Z]{1,10}$/.test(head) && buf.length < 11 ? { kind: "more" } : { kind: "unknown" };
  }
  const end = buf.indexOf("\r\n\r\n");
  if (end < 0) return buf.length >= MAX_SNIFF_BYTES ? { kind: "unknown" } : { kind: "more" };
  const lines = buf.subarray(0, end).toString("latin1").split("\r\n").slice(1);
  const host = lines.find((l) => /^host:/i.test(l))?.slice(5).trim();
  return { kind: "http", name: host ? stripPort(host) : undefined };
}

function stripPort(host: string): string | undefined {
  if (host.startsWith("[")) return undefined; // IPv6 literal: names no domain
  const name = host.replace(/:\d+$/, "").toLowerCase();
  return /^[a-z0-9.*-]+$/.test(name) ? name : undefined;
}

/**
 * The SNI of a ClientHello that may span several TLS records and arrive in pieces.
 * "more" while the handshake message is incomplete; name undefined when it has no SNI or is malformed.
 */
function sniffTls(buf: Buffer): Sniffed {
  // Gather the handshake bytes carried by the leading handshake records.
  const hs: Buffer[] = [];
  let have = 0;
  let off = 0;
  let need = -1;
  while (need < 0 || have < need) {
    if (off + 5 > buf.length) return buf.length >= MAX_SNIFF_BYTES ? { kind: "unknown" } : { kind: "more" };
    if (buf[off] !== 0x16 || buf[off + 1] !== 0x03) return { kind: "tls", name: undefined };
    const len = buf.readUInt16BE(off + 3);
    if (len === 0 || len > 16384 + 2048) return { kind: "tls", name: undefined };
    const body = buf.subarray(off + 5, off + 5 + len);
    hs.push(body);
    have += body.length;
    if (need < 0 && have >= 4) {
      const h = Buffer.concat(hs);
      if (h[0] !== 0x01) return { kind: "tls", name: undefined }; // not a ClientHello
      need = 4 + ((h[1]! << 16) | (h[2]! << 8) | h[3]!);
      if (need > MAX_SNIFF_BYTES) return { kind: "tls", name: undefined };
    }
    if (body.length < len) return { kind: "more" }; // this record is still arriving
    off += 5 + len;
  }
  return { kind: "tls", name: serverName(Buffer.concat(hs).subarray(4, need)) };
}

/** server_name (extension 0, host_name type 0) of a ClientHello body, or undefined. */
function serverName(ch: Buffer): string | undefined {
  try {
    let p = 2 + 32; // legacy_version, random
    p += 1 + ch[p]!; // session id
    p += 2 + ch.readUInt16BE(p); // cipher suites
    p += 1 + ch[p]!; // compression methods
    const end = Math.min(ch.length, p + 2 + ch.readUInt16BE(p));
    p += 2;
    while (p + 4 <= end) {
      const type = ch.readUInt16BE(p);
      const len = ch.readUInt16BE(p + 2);
      p += 4;
      if (type === 0) {
        let q = p + 2;
        const listEnd = Math.min(p + 2 + ch.readUInt16BE(p), p + len);
        while (q + 3 <= listEnd) {
          const nameType = ch[q]!;
          const nameLen = ch.readUInt16BE(q + 1);
          if (nameType === 0) return stripPort(ch.subarray(q + 3, q + 3 + nameLen).toString("latin1"));
          q += 3 + nameLen;
        }
        return undefined;
      }
      p += len;
    }
  } catch {
    // A length past the end (readUInt16BE throws): malformed.
  }
  return undefined;
}
