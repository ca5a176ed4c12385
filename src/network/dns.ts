// A minimal DNS client for the domain proxy: A records of one name from the node's resolvers over
// UDP, bounded in time and size. Also the message codec the network tests' DNS server uses.

import { NetworkError } from "./command.ts";

/** One lookup waits this long per resolver before trying the next. */
export const DNS_TIMEOUT_MS = 2000;
/** Larger datagrams are not answers to our queries (512 bytes without EDNS, which we never ask for). */
const MAX_MESSAGE = 4096;

function encodeName(name: string): Buffer {
  const parts = name.replace(/\.$/, "").split(".").map((l) => {
    const b = Buffer.from(l, "ascii");
    if (b.length === 0 || b.length > 63) throw new NetworkError("BadName", `bad DNS label in ${name}`);
    return Buffer.concat([Buffer.from([b.length]), b]);
  });
  return Buffer.concat([...parts, Buffer.from([0])]);
}

/** A query for the A records of `name` (recursion desired). */
export function encodeQuery(id: number, name: string): Buffer {
  const header = Buffer.alloc(12);
  header.writeUInt16BE(id, 0);
  header.writeUInt16BE(0x0100, 2);
  header.writeUInt16BE(1, 4);
  return Buffer.concat([header, encodeName(name), Buffer.from([0, 1, 0, 1])]);
}

/** Reads a (possibly compressed) name at `off`; returns it and the offset after it. */
function readName(msg: Buffer, off: number): [string, number] {
  const labels: string[] = [];
  let end = -1;
  for (let hops = 0; hops < 64; hops++) {
    const len = msg[off];
    if (len === undefined) throw new NetworkError("BadDnsMessage", "name runs past the message");
    if (len === 0) return [labels.join("."), end < 0 ? off + 1 : end];
    if ((len & 0xc0) === 0xc0) {
      if (end < 0) end = off + 2;
      off = ((len & 0x3f) << 8) | msg[off + 1]!;
      continue;
    }
    labels.push(msg.subarray(off + 1, off + 1 + len).toString("ascii"));
    off += 1 + len;
  }
  throw new NetworkError("BadDnsMessage", "name has too many labels or a pointer loop");
}

export interface DnsQuestion {
  id: number;
  name: string;
  type: number;
}

export function parseQuestion(msg: Buffer): DnsQuestion {
  if (msg.length < 12 || msg.readUInt16BE(4) < 1) throw new NetworkError("BadDnsMessage", "no question");
  const [name, off] = readName(msg, 12);
  return { id: msg.readUInt16BE(0), name: name.toLowerCase(), type: msg.readUInt16BE(off) };
}

/** An answer to `query` with these A records (NXDOMAIN when there are none). */
export function encodeAnswer(query: Buffer, addresses: string[]): Buffer {
  const q = parseQuestion(query);
  const [, qEnd] = readName(query, 12);
  const question = query.subarray(12, qEnd + 4);
  const header = Buffer.alloc(12);
  header.writeUInt16BE(q.id, 0);
  header.writeUInt16BE(addresses.length ? 0x8180 : 0x8183, 2);
  header.writeUInt16BE(1, 4);
  const answers = q.type === 1 ? addresses : [];
  header.writeUInt16BE(answers.length, 6);
  const rrs = answers.map((a) => {
    const rr = Buffer.alloc(16);
    rr.writeUInt16BE(0xc00c, 0);
    rr.writeUInt16BE(1, 2);
    rr.writeUInt16BE(1, 4);
    rr.writeUInt32BE(60, 6);
    rr.writeUInt16BE(4, 10);
    a.split(".").forEach((p, i) => rr.writeUInt8(Number(p), 12 + i));
    return rr;
  });
  return Buffer.concat([header, question, ...rrs]);
}

/** The A records in an answer to query `id`. */
export function parseAnswer(msg: Buffer, id: number): string[] {
  if (msg.length < 12 || msg.readUInt16BE(0) !== id) throw new NetworkError("BadDnsMessage", "answer to another query");
  const rcode = msg.readUInt16BE(2) & 0xf;
  if (rcode === 3) return [];
  if (rcode !== 0) throw new NetworkError("DnsFailed", `resolver answered rcode ${rcode}`);
  let off = 12;
  for (let i = msg.readUInt16BE(4); i > 0; i--) off = readName(msg, off)[1] + 4;
  const out: string[] = [];
  for (let i = msg.readUInt16BE(6); i > 0; i--) {
    off = readName(msg, off)[1];
    const type = msg.readUInt16BE(off);
    const len = msg.readUInt16BE(off + 8);
    if (type === 1 && len === 4) out.push([...msg.subarray(off + 10, off + 14)].join("."));
    off += 10 + len;
  }
  return out;
}

/**
 * The IPv4 addresses of `name`, asked of each resolver in turn (port 53 unless given as ip:port).
 * NetworkError `DnsFailed` when none answers within DNS_TIMEOUT_MS each.
 */
export async function resolve4(name: string, resolvers: string[], timeoutMs = DNS_TIMEOUT_MS): Promise<string[]> {
  let last: Error = new NetworkError("DnsFailed", "no resolver configured");
  for (const r of resolvers) {
    const [host, port] = r.includes(":") ? [r.split(":")[0]!, Number(r.split(":")[1])] : [r, 53];
    const id = crypto.getRandomValues(new Uint16Array(1))[0]!;
    try {
      return await new Promise<string[]>((resolve, reject) => {
        let sock: { close(): void } | undefined;
        const timer = setTimeout(() => {
          sock?.close();
          reject(new NetworkError("DnsFailed", `${host}:${port} did not answer for ${name} within ${timeoutMs} ms`));
        }, timeoutMs);
        Bun.udpSocket({
          socket: {
            data(s, buf) {
              if (buf.length > MAX_MESSAGE) return;
              try {
                const out = parseAnswer(Buffer.from(buf), id);
                clearTimeout(timer);
                s.close();
                resolve(out);
              } catch (e) {
                if ((e as NetworkError).code === "DnsFailed") {
                  clearTimeout(timer);
                  s.close();
                  reject(e);
                }
              }
            },
          },
        }).then((s) => {
          sock = s;
          s.send(encodeQuery(id, name), port, host);
        }, (e) => {
          clearTimeout(timer);
          reject(e);
        });
      });
    } catch (e) {
      last = e as Error;
    }
  }
  throw last;
}
