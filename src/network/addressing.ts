// Slot naming and addressing: pure functions, no system calls. Slot n owns the /31
// base+2n (host end) / base+2n+1 (namespace end) of the configured host CIDR; the guest side
// (169.254.0.20/30 on the TAP) is the same in every namespace.

import { NetworkError } from "./command.ts";

/** The guest's address in every slot; snapshots and forks keep it, so it never changes. */
export const GUEST_IP = "169.254.0.21";
/** The TAP's address inside the namespace: the guest's default gateway. */
export const GATEWAY_IP = "169.254.0.22";
export const GUEST_PREFIX_LEN = 30;
/** Locally administered, spelling 169.254.0.21 in its last four bytes; identical in every slot. */
export const DEFAULT_GUEST_MAC = "06:00:a9:fe:00:15";
/**
 * The gateway side of every slot's TAP has this one MAC too: a VM restored into another slot
 * still has the old gateway's neighbour entry, which must stay right.
 */
export const GATEWAY_MAC = "06:00:a9:fe:00:16";

export const DEFAULT_PREFIX = "aenv-";
export const DEFAULT_HOST_CIDR = "10.200.0.0/16";
export const DEFAULT_HOST_TABLE = "aenv";
/** The nftables table each namespace holds (one per namespace, so the name can be fixed). */
export const SLOT_TABLE = "aenv_slot";
/** Interface names inside a slot's namespace; every namespace uses the same ones. */
export const NS_VETH = "vpeer";
export const DEFAULT_TAP = "tap0";

/** Linux interface names are at most 15 bytes (IFNAMSIZ 16 with the NUL). */
const IFNAME_MAX = 15;

export interface Cidr {
  base: number;
  prefixLen: number;
}

export function parseIpv4(s: string): number {
  const parts = s.split(".");
  if (parts.length !== 4 || !parts.every((p) => /^\d{1,3}$/.test(p) && Number(p) <= 255)) {
    throw new NetworkError("BadAddress", `not an IPv4 address: ${s}`);
  }
  return parts.reduce((acc, p) => acc * 256 + Number(p), 0);
}

export function formatIpv4(n: number): string {
  return [n >>> 24, (n >>> 16) & 255, (n >>> 8) & 255, n & 255].join(".");
}

/** Any IPv4 network "a.b.c.d/len" (len 0..32, no host bits), e.g. a route's destination. */
export function parseCidr(s: string): Cidr {
  const m = /^([\d.]+)\/(\d{1,2})$/.exec(s);
  if (!m) throw new NetworkError("BadAddress", `not an IPv4 CIDR: ${s}`);
  const base = parseIpv4(m[1]!);
  const prefixLen = Number(m[2]);
  if (prefixLen > 32) throw new NetworkError("BadAddress", `prefix length above 32: ${s}`);
  if (base % 2 ** (32 - prefixLen) !== 0) throw new NetworkError("BadAddress", `${s} has host bits set`);
  return { base, prefixLen };
}

/** The configured host CIDR: like parseCidr, but it must hold at least one /31 slot. */
export function parseHostCidr(s: string): Cidr {
  const c = parseCidr(s);
  if (c.prefixLen < 1 || c.prefixLen > 31) throw new NetworkError("BadAddress", `host CIDR prefix length must be 1..31: ${s}`);
  return c;
}

export function cidrSize(c: Cidr): number {
  return 2 ** (32 - c.prefixLen);
}

export function cidrsOverlap(a: Cidr, b: Cidr): boolean {
  return a.base < b.base + cidrSize(b) && b.base < a.base + cidrSize(a);
}

/** Resolved, validated settings shared by the slot functions and the pool. */
export interface NetworkConfig {
  /** Namespace and host-veth name prefix; slot n is `${prefix}${n}` for both. */
  prefix: string;
  hostCidr: Cidr;
  /** The host nftables table (family inet) this module owns. */
  hostTable: string;
  tap: string;
  guestMac: string;
  /** Owner of the TAP so an unprivileged VMM in the namespace can open it; unset = CAP_NET_ADMIN only. */
  tapOwner?: { uid: number; gid: number };
  /** Highest slot count: the CIDR's /31s, capped so names fit IFNAMSIZ. */
  maxSlots: number;
}

export interface NetworkConfigInput {
  prefix?: string;
  hostCidr?: string;
  hostTable?: string;
  tap?: string;
  guestMac?: string;
  tapOwner?: { uid: number; gid: number };
  maxSlots?: number;
}

export function resolveConfig(input: NetworkConfigInput = {}): NetworkConfig {
  const prefix = input.prefix ?? DEFAULT_PREFIX;
  // Letters first and no glob characters: the prefix becomes an nftables interface wildcard.
  if (!/^[a-z][a-z0-9-]*$/.test(prefix)) throw new NetworkError("BadConfig", `prefix must match [a-z][a-z0-9-]*: ${prefix}`);
  const hostCidr = parseHostCidr(input.hostCidr ?? DEFAULT_HOST_CIDR);
  const hostTable = input.hostTable ?? DEFAULT_HOST_TABLE;
  if (!/^[a-z][a-z0-9_]*$/.test(hostTable)) throw new NetworkError("BadConfig", `hostTable must match [a-z][a-z0-9_]*: ${hostTable}`);
  const tap = input.tap ?? DEFAULT_TAP;
  if (!/^[a-z][a-z0-9_-]{0,14}$/.test(tap) || tap === NS_VETH) throw new NetworkError("BadConfig", `bad TAP name: ${tap}`);
  const guestMac = (input.guestMac ?? DEFAULT_GUEST_MAC).toLowerCase();
  if (!/^[0-9a-f]{2}(:[0-9a-f]{2}){5}$/.test(guestMac)) throw new NetworkError("BadConfig", `bad MAC: ${guestMac}`);
  let maxSlots = Math.min(cidrSize(hostCidr) / 2, input.maxSlots ?? Infinity);
  const digits = IFNAME_MAX - prefix.length;
  if (digits < 1) throw new NetworkError("BadConfig", `prefix ${prefix} leaves no room for a slot number in ${IFNAME_MAX} bytes`);
  maxSlots = Math.min(maxSlots, 10 ** digits);
  if (!(maxSlots >= 1)) throw new NetworkError("BadConfig", `maxSlots must be at least 1`);
  return { prefix, hostCidr, hostTable, tap, guestMac, tapOwner: input.tapOwner, maxSlots };
}

/** Everything a VMM driver and the proxy need to know about one slot. */
export interface Slot {
  /** Slot number n: fixes the names and the /31. */
  id: number;
  /** Network namespace name (ip netns) and the host end of the veth pair. */
  netns: string;
  /** Bind-mount path of the namespace, for tools that take a path (firecracker jailer --netns). */
  netnsPath: string;
  hostVeth: string;
  /** TAP device inside the namespace, for the VMM's netdev / network-interface. */
  tap: string;
  /** Host end of the /31: the namespace's default gateway; also the only source let into the slot. */
  hostIp: string;
  /** Namespace end of the /31: the host reaches guest port P at nsIp:P (DNAT to guestIp:P). */
  nsIp: string;
  guestIp: string;
  gatewayIp: string;
  guestPrefixLen: number;
  guestMac: string;
}

export const NETNS_DIR = "/run/netns";

export function slotName(cfg: NetworkConfig, id: number): string {
  return `${cfg.prefix}${id}`;
}

/** The slot number a namespace or link name stands for, or undefined when the name is not ours. */
export function slotIdOf(cfg: NetworkConfig, name: string): number | undefined {
  if (!name.startsWith(cfg.prefix)) return undefined;
  const rest = name.slice(cfg.prefix.length);
  // Canonical decimal only, so "aenv-01" (not a name we make) is never taken for slot 1.
  if (!/^(0|[1-9]\d*)$/.test(rest)) return undefined;
  const id = Number(rest);
  return id < cfg.maxSlots ? id : undefined;
}

export function slotFor(cfg: NetworkConfig, id: number): Slot {
  if (!Number.isInteger(id) || id < 0 || id >= cfg.maxSlots) throw new NetworkError("BadSlot", `slot ${id} outside 0..${cfg.maxSlots - 1}`);
  const name = slotName(cfg, id);
  return {
    id,
    netns: name,
    netnsPath: `${NETNS_DIR}/${name}`,
    hostVeth: name,
    tap: cfg.tap,
    hostIp: formatIpv4(cfg.hostCidr.base + 2 * id),
    nsIp: formatIpv4(cfg.hostCidr.base + 2 * id + 1),
    guestIp: GUEST_IP,
    gatewayIp: GATEWAY_IP,
    guestPrefixLen: GUEST_PREFIX_LEN,
    guestMac: cfg.guestMac,
  };
}
