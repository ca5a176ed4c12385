// Where the node's own HTTP requests to registries may go (pulls, pushes, token realms, redirects,
// upload Locations, blockd's range reads). A host listed as insecure (`host` for any port,
// `host:port` for one) is spoken to as it is, plain http included. Any other destination is https
// and never an internal address: loopback (127/8, ::1, `localhost`), link-local (169.254/16,
// fe80::/10), unspecified (0/8, ::) or one of this machine's own interface addresses. A name is
// resolved and every address it has is checked.
import { lookup } from "node:dns/promises";
import { networkInterfaces } from "node:os";

export type InternalKind = "loopback" | "link-local" | "unspecified" | "this machine's";

/** A name's lookup is given up after this long (the request then goes on and fails or not on its own). */
export const DNS_LOOKUP_TIMEOUT_MS = 5_000;
/** This machine's interface addresses are read again after this long (interfaces come and go). */
const OWN_ADDRESSES_TTL_MS = 10_000;
/** Entries of an insecure list: a host name, an IPv4 address or an [IPv6] address, with an optional :port. */
export const INSECURE_HOST = /^(?:[a-z0-9](?:[a-z0-9-]*[a-z0-9])?(?:\.[a-z0-9](?:[a-z0-9-]*[a-z0-9])?)*|\[[0-9a-f:.]+\])(?::\d{1,5})?$/i;

/** This machine's addresses as last read, and when. */
let ownRead: { at: number; addrs: Set<string> } | undefined;

/** This machine's interface addresses (IPv6 without a zone), read at most every OWN_ADDRESSES_TTL_MS. */
export function ownAddresses(): Set<string> {
  if (ownRead && Date.now() - ownRead.at < OWN_ADDRESSES_TTL_MS) return ownRead.addrs;
  const addrs = new Set<string>();
  for (const list of Object.values(networkInterfaces())) for (const a of list ?? []) addrs.add(normalizeIp(a.address));
  ownRead = { at: Date.now(), addrs };
  return addrs;
}

function ipv4Parts(ip: string): number[] | undefined {
  const p = ip.split(".");
  if (p.length !== 4 || !p.every((x) => /^\d{1,3}$/.test(x) && Number(x) <= 255)) return undefined;
  return p.map(Number);
}

/** Lowercase, no brackets or zone; an IPv4-mapped IPv6 address (`::ffff:7f00:1` too) as its IPv4 address. IPv6 comes compressed (URL, DNS and os all write it so). */
export function normalizeIp(ip: string): string {
  const s = ip.toLowerCase().replace(/^\[|\]$/g, "").replace(/%.*$/, "");
  const dotted = /^::ffff:(\d+\.\d+\.\d+\.\d+)$/.exec(s);
  if (dotted && ipv4Parts(dotted[1]!)) return dotted[1]!;
  const hex = /^::ffff:([0-9a-f]{1,4}):([0-9a-f]{1,4})$/.exec(s);
  if (hex) {
    const hi = parseInt(hex[1]!, 16);
    const lo = parseInt(hex[2]!, 16);
    return [hi >> 8, hi & 255, lo >> 8, lo & 255].join(".");
  }
  return s;
}

/** What internal address an IP is, or undefined for any other. */
export function internalKind(ipIn: string, ownAddrs: Set<string> = ownAddresses()): InternalKind | undefined {
  const ip = normalizeIp(ipIn);
  const v4 = ipv4Parts(ip);
  if (v4) {
    if (v4[0] === 127) return "loopback";
    if (v4[0] === 0) return "unspecified";
    if (v4[0] === 169 && v4[1] === 254) return "link-local";
  } else {
    if (ip === "::1") return "loopback";
    if (ip === "::") return "unspecified";
    if (/^fe[89ab][0-9a-f]:/.test(ip)) return "link-local";
  }
  return ownAddrs.has(ip) ? "this machine's" : undefined;
}

const isIpLiteral = (host: string) => ipv4Parts(host) !== undefined || host.includes(":");

/** The addresses a host (a name, or an address in brackets or not) stands for; [] when a name does not resolve in time. */
export async function addressesOf(hostIn: string): Promise<string[]> {
  const host = hostIn.toLowerCase().replace(/^\[|\]$/g, "");
  if (isIpLiteral(host)) return [host];
  if (host === "localhost" || host.endsWith(".localhost")) return ["127.0.0.1"];
  let timer: ReturnType<typeof setTimeout> | undefined;
  const late = new Promise<never>((_, reject) => { timer = setTimeout(() => reject(new Error("timeout")), DNS_LOOKUP_TIMEOUT_MS); });
  try {
    return (await Promise.race([lookup(host, { all: true }), late])).map((a) => a.address);
  } catch {
    return [];
  } finally {
    clearTimeout(timer);
  }
}

/** An internal address as messages name it: `a loopback address (127.0.0.1)`, `one of this machine's addresses (10.0.0.5)`. */
export function describeInternal(a: { ip: string; kind: InternalKind }): string {
  return `${a.kind === "this machine's" ? "one of this machine's addresses" : `a ${a.kind} address`} (${a.ip})`;
}

/** The first internal address of a host, with its kind; undefined when it has none. */
export async function internalAddressOf(host: string): Promise<{ ip: string; kind: InternalKind } | undefined> {
  const mine = ownAddresses();
  for (const ip of await addressesOf(host)) {
    const kind = internalKind(ip, mine);
    if (kind) return { ip, kind };
  }
  return undefined;
}

/** A list of insecure hosts, asked whether a URL's host:port is on it (`host` alone: any port). */
export class InsecureHosts {
  private readonly entries: Set<string>;
  constructor(list: readonly string[] = []) {
    this.entries = new Set(list.map((h) => h.trim().toLowerCase()).filter(Boolean));
  }

  /** `hostPort` as a reference names it (`127.0.0.1:5000`, `[::1]:5000`, `reg.example.com`). */
  hasHostPort(hostPort: string): boolean {
    return this.has(new URL(`http://${hostPort}`));
  }

  has(u: URL): boolean {
    const host = u.hostname.toLowerCase();
    const port = u.port || (u.protocol === "https:" ? "443" : "80");
    return this.entries.has(host) || this.entries.has(`${host}:${port}`);
  }
}

/**
 * Why a request to `u` is refused (undefined: it may go): an unlisted host must be https and
 * have no internal address.
 */
export async function destinationRefusal(u: URL, insecure: InsecureHosts): Promise<string | undefined> {
  if (insecure.has(u)) return undefined;
  if (u.protocol !== "https:") return `${u.protocol}//${u.host} is plain http, which only hosts listed in insecure_registries (AENV_INSECURE_REGISTRIES) may be`;
  const internal = await internalAddressOf(u.hostname);
  if (internal) return `${u.host} is ${describeInternal(internal)}, which only hosts listed in insecure_registries (AENV_INSECURE_REGISTRIES) may be`;
  return undefined;
}
