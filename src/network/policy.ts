// A sandbox's egress policy: parsed and validated from E2B's `allow_internet_access` and `network`
// (pure functions, no system calls), and the decision the domain proxy takes for one connection.
//
// Order of a decision (the nftables chains in egress.ts take the same order for IP traffic):
//   1. the node's always-denied ranges (internal networks, the slot CIDR): refused, whatever the policy;
//   2. allowOut (a CIDR holding the destination, or a domain matching the name): allowed;
//   3. denyOut (CIDR or domain): refused;
//   4. otherwise the internet default: allowed unless `allow_internet_access` is false.

import { isIPv6 } from "node:net";
import { formatIpv4, parseCidr, parseIpv4, type Cidr } from "./addressing.ts";
import { NetworkError } from "./command.ts";

/** Entries per list (allowOut, denyOut): one `nft -f` transaction with this many elements stays well under a second. */
export const MAX_RULES = 10_000;
/** Extra ports treated as HTTPS by the domain proxy (80 and 443 always are). */
export const MAX_HTTPS_PORTS = 16;
export const DEFAULT_PROXIED_PORTS = [80, 443] as const;

/** A policy the API refuses: `field` names the offending input (`network.allowOut[2]`); answered as 400. */
export class PolicyError extends NetworkError {
  readonly status = 400;
  constructor(readonly field: string, message: string) {
    super("BadPolicy", `${field}: ${message}`);
    this.name = "PolicyError";
  }
}

export interface EgressPolicy {
  /** Destinations not named by a rule are allowed (E2B's default) unless false. */
  internet: boolean;
  allowCidrs: string[];
  denyCidrs: string[];
  /** Lowercase names; `*.example.com` matches every name below example.com (not example.com itself). */
  allowDomains: string[];
  denyDomains: string[];
  /** TCP ports whose connections go through the domain proxy when the policy has domain rules. */
  proxiedPorts: number[];
  /** `network.rules`: headers set on HTTP requests to matching hosts. */
  rules: HostRules[];
  /** `network.egressProxy`: every allowed TCP connection leaves through it. */
  upstream: UpstreamProxy | undefined;
}

/** E2B's default: the internet, nothing else named. */
export const OPEN_POLICY: EgressPolicy = {
  internet: true, allowCidrs: [], denyCidrs: [], allowDomains: [], denyDomains: [], proxiedPorts: [...DEFAULT_PROXIED_PORTS], rules: [], upstream: undefined,
};

export function hasDomainRules(p: EgressPolicy): boolean {
  return p.allowDomains.length > 0 || p.denyDomains.length > 0;
}

/**
 * The TCP ports of a slot that the host table redirects to the domain proxy: every port with an
 * egress proxy, the proxied ports with domain or header rules, none otherwise.
 */
export function redirectedPorts(p: EgressPolicy): number[] | "all" | undefined {
  if (p.upstream) return "all";
  return hasDomainRules(p) || p.rules.length > 0 ? p.proxiedPorts : undefined;
}

/**
 * One header a rule sets: a literal value, the user secret `secret:NAME`, or a value holding
 * `${e2b.secrets.NAME}` placeholders; secrets are read from the node's SecretStore (secrets.ts)
 * when a request is sent.
 */
export interface HeaderValue {
  name: string;
  /** The literal value, or the text whose placeholders are replaced (`placeholders` set). */
  value?: string;
  /** `secret:NAME`: the whole value is the user secret NAME (lower-cased). */
  secret?: string;
  /** The secrets `value`'s placeholders name (lower-cased, each once); absent when it has none. */
  placeholders?: string[];
}

/** The rules of one `network.rules` key. */
export interface HostRules {
  /** `api.example.com` or `*.example.com`, lowercase. */
  pattern: string;
  /** Every header of the key's rules, in order (a later one of the same name replaces an earlier one). */
  headers: HeaderValue[];
  /** Some rule says `tls: "terminate"`: HTTPS to the host is terminated with the node's CA so the headers apply there too. */
  terminateTls: boolean;
}

/** `network.egressProxy`: a SOCKS5 proxy (`host:port`, `socks5://host:port`: E2B's) or an HTTP CONNECT one (`http://host:port`). */
export interface UpstreamProxy {
  kind: "socks5" | "http";
  host: string;
  port: number;
  username?: string;
  password?: string;
}

/** Hosts in `network.rules`. */
export const MAX_RULE_HOSTS = 256;
/** Rules per host. */
export const MAX_RULES_PER_HOST = 16;
/** Headers per rule. */
export const MAX_HEADERS_PER_RULE = 32;
/** Bytes of one header value (a literal or a secret's value). */
export const MAX_HEADER_VALUE = 8192;
/** Placeholders in one header value: a resolved value stays under 5 × MAX_HEADER_VALUE. */
export const MAX_PLACEHOLDERS_PER_VALUE = 4;
/** Bytes of a user secret's name (E2B's names: anything but `{`, `}` and control characters). */
export const MAX_SECRET_NAME = 256;
/** E2B's `Secret.fill(name)`: resolved where the header is set, at sandbox egress. */
export const SECRET_PLACEHOLDER = /\$\{e2b\.secrets\.([^{}]*)\}/g;
const PLACEHOLDER_START = "${e2b.secrets.";
/** Bytes of an egress proxy's username and of its password (RFC 1929's limit). */
export const MAX_PROXY_CREDENTIAL = 255;

/** Headers a rule may not set: they frame the request or name its host, which the proxy has judged. */
const RESERVED_HEADERS = new Set(["host", "content-length", "transfer-encoding", "connection", "keep-alive", "proxy-connection", "te", "trailer", "upgrade"]);
const TOKEN = /^[!#$%&'*+.^_`|~0-9A-Za-z-]{1,256}$/;

/**
 * Why `name` (lower-cased) cannot name a user secret, or undefined when it can: empty, over
 * MAX_SECRET_NAME bytes, holding `{`, `}` or a control character (it is written into a
 * placeholder), or starting with `sec_` (E2B keeps that prefix for secret IDs).
 */
export function secretNameProblem(name: string): string | undefined {
  if (name.length === 0) return "a secret name cannot be empty";
  if (Buffer.byteLength(name) > MAX_SECRET_NAME) return `a secret name is at most ${MAX_SECRET_NAME} bytes`;
  if (/[{}\p{Cc}]/u.test(name)) return "a secret name cannot contain '{', '}' or control characters";
  if (name.startsWith("sec_")) return "the sec_ prefix is kept for secret IDs";
  return undefined;
}

/** The secrets a header value's `${e2b.secrets.NAME}` placeholders name, lower-cased, each once; PolicyError on a malformed one. */
function placeholdersOf(field: string, value: string): string[] {
  const names = new Set<string>();
  let count = 0;
  for (let at = value.indexOf(PLACEHOLDER_START); at >= 0; at = value.indexOf(PLACEHOLDER_START, at + 1)) {
    const m = new RegExp(SECRET_PLACEHOLDER.source, "y");
    m.lastIndex = at;
    const got = m.exec(value);
    if (!got) throw new PolicyError(field, "a ${e2b.secrets. placeholder is not closed by } (or holds { or })");
    const name = got[1]!.toLowerCase();
    const problem = secretNameProblem(name);
    if (problem) throw new PolicyError(field, `\${e2b.secrets.${got[1]}}: ${problem}`);
    if (++count > MAX_PLACEHOLDERS_PER_VALUE) throw new PolicyError(field, `at most ${MAX_PLACEHOLDERS_PER_VALUE} secret placeholders in one value`);
    names.add(name);
  }
  return [...names];
}

const isObject = (v: unknown): v is Record<string, unknown> => typeof v === "object" && v !== null && !Array.isArray(v);
const key = (k: string) => `[${JSON.stringify(k)}]`;

function parseHeaders(field: string, v: unknown): HeaderValue[] {
  if (v === undefined || v === null) return [];
  if (!isObject(v)) throw new PolicyError(field, "must be an object of header names to values");
  const entries = Object.entries(v);
  if (entries.length > MAX_HEADERS_PER_RULE) throw new PolicyError(field, `at most ${MAX_HEADERS_PER_RULE} headers`);
  return entries.map(([name, value]) => {
    const f = `${field}${key(name)}`;
    if (!TOKEN.test(name)) throw new PolicyError(f, "a header name is a token of at most 256 characters");
    if (RESERVED_HEADERS.has(name.toLowerCase())) throw new PolicyError(f, `${name} cannot be set by a rule`);
    if (typeof value !== "string") throw new PolicyError(f, "must be a string");
    if (Buffer.byteLength(value) > MAX_HEADER_VALUE) throw new PolicyError(f, `at most ${MAX_HEADER_VALUE} bytes`);
    if (/[\r\n\0]/.test(value)) throw new PolicyError(f, "must not contain CR, LF or NUL");
    if (value.startsWith("secret:")) {
      const secret = value.slice(7).toLowerCase();
      const problem = secretNameProblem(secret);
      if (problem) throw new PolicyError(f, `secret:${value.slice(7)} does not name a secret: ${problem}`);
      return { name, secret };
    }
    const placeholders = placeholdersOf(f, value);
    return placeholders.length > 0 ? { name, value, placeholders } : { name, value };
  });
}

function parseRules(field: string, v: unknown): HostRules[] {
  if (v === undefined || v === null) return [];
  if (!isObject(v)) throw new PolicyError(field, "must be an object of host names to lists of rules");
  const hosts = Object.entries(v);
  if (hosts.length > MAX_RULE_HOSTS) throw new PolicyError(field, `at most ${MAX_RULE_HOSTS} hosts`);
  const seen = new Set<string>();
  return hosts.map(([host, list]) => {
    const f = `${field}${key(host)}`;
    const pattern = parseDomain(host.trim());
    if (!pattern) throw new PolicyError(f, `${JSON.stringify(host)} is not a host name (example.com, *.example.com)`);
    if (seen.has(pattern)) throw new PolicyError(f, `${pattern} is named twice`);
    seen.add(pattern);
    if (!Array.isArray(list)) throw new PolicyError(f, "must be an array of rules");
    if (list.length > MAX_RULES_PER_HOST) throw new PolicyError(f, `at most ${MAX_RULES_PER_HOST} rules`);
    const out: HostRules = { pattern, headers: [], terminateTls: false };
    list.forEach((rule, i) => {
      const rf = `${f}[${i}]`;
      if (!isObject(rule)) throw new PolicyError(rf, "must be an object ({transform: {headers}})");
      if (rule.tls !== undefined && rule.tls !== null && rule.tls !== "terminate" && rule.tls !== "passthrough") {
        throw new PolicyError(`${rf}.tls`, `must be "terminate" or "passthrough"`);
      }
      if (rule.tls === "terminate") out.terminateTls = true;
      const t = rule.transform;
      if (t === undefined || t === null) return;
      if (!isObject(t)) throw new PolicyError(`${rf}.transform`, "must be an object ({headers})");
      for (const h of parseHeaders(`${rf}.transform.headers`, t.headers)) {
        out.headers = out.headers.filter((x) => x.name.toLowerCase() !== h.name.toLowerCase());
        out.headers.push(h);
      }
    });
    return out;
  });
}

function parseUpstream(field: string, v: unknown): UpstreamProxy | undefined {
  if (v === undefined || v === null) return undefined;
  if (!isObject(v)) throw new PolicyError(field, "must be an object ({address, username?, password?})");
  const a = v.address;
  if (typeof a !== "string" || a.length === 0 || a.length > 300) throw new PolicyError(`${field}.address`, "must be host:port (SOCKS5), socks5://host:port or http://host:port");
  const m = /^(?:(socks5h?|http):\/\/)?([^:/@\s]+):(\d{1,5})\/?$/.exec(a.trim());
  const ipv4 = (s: string) => {
    try {
      return formatIpv4(parseIpv4(s)) === s ? s : undefined;
    } catch {
      return undefined;
    }
  };
  const host = m && (/^[\d.]+$/.test(m[2]!) ? ipv4(m[2]!) : parseDomain(m[2]!));
  if (!m || !host || host.startsWith("*.") || Number(m[3]) < 1 || Number(m[3]) > 65535) {
    throw new PolicyError(`${field}.address`, `${JSON.stringify(a)} is not host:port, socks5://host:port or http://host:port (an IPv4 address or a host name, port 1..65535)`);
  }
  const out: UpstreamProxy = { kind: m[1] === "http" ? "http" : "socks5", host, port: Number(m[3]) };
  for (const k of ["username", "password"] as const) {
    const c = v[k];
    if (c === undefined || c === null) continue;
    if (typeof c !== "string" || Buffer.byteLength(c) > MAX_PROXY_CREDENTIAL || /[\r\n\0]/.test(c)) {
      throw new PolicyError(`${field}.${k}`, `must be a string of at most ${MAX_PROXY_CREDENTIAL} bytes without CR, LF or NUL`);
    }
    out[k] = c;
  }
  if (out.password !== undefined && out.username === undefined) throw new PolicyError(`${field}.username`, "is needed with a password");
  if (out.kind === "http" && out.username?.includes(":")) throw new PolicyError(`${field}.username`, "must not contain ':' (HTTP Basic)");
  return out;
}

/**
 * The rules of the most specific key matching `name`: the exact name, else the longest wildcard
 * below which it lies (as E2B: rule sets are not merged).
 */
export function rulesFor(rules: HostRules[], name: string | undefined): HostRules | undefined {
  if (name === undefined || rules.length === 0) return undefined;
  const n = name.toLowerCase().replace(/\.$/, "");
  let best: HostRules | undefined;
  for (const r of rules) {
    if (r.pattern === n) return r;
    if (domainMatches(r.pattern, n) && (!best || r.pattern.length > best.pattern.length)) best = r;
  }
  return best;
}

const LABEL = /^(?!-)[a-z0-9-]{1,63}(?<!-)$/;

/** `example.com` or `*.example.com`, lowercased; undefined when `s` is not a domain. */
export function parseDomain(s: string): string | undefined {
  const d = s.toLowerCase().replace(/\.$/, "");
  if (d.length === 0 || d.length > 253) return undefined;
  const labels = d.startsWith("*.") ? d.slice(2).split(".") : d.split(".");
  if (!labels.every((l) => LABEL.test(l))) return undefined;
  // A name of digits and dots only would be an IP address written wrong, not a host name.
  if (labels.every((l) => /^\d+$/.test(l))) return undefined;
  return d;
}

/** "a.b.c.d" or "a.b.c.d/n" as a CIDR string (an address is its /32); undefined when not IPv4. */
function parseIpv4Entry(s: string): string | undefined {
  if (!/^[\d.]+(\/\d{1,2})?$/.test(s)) return undefined;
  const c = parseCidr(s.includes("/") ? s : `${s}/32`);
  return `${formatIpv4(c.base)}/${c.prefixLen}`;
}

interface ParsedList {
  cidrs: string[];
  domains: string[];
}

function parseList(field: string, v: unknown): ParsedList {
  const out: ParsedList = { cidrs: [], domains: [] };
  if (v === undefined || v === null) return out;
  if (!Array.isArray(v)) throw new PolicyError(field, "must be an array of CIDRs, IP addresses or domains");
  if (v.length > MAX_RULES) throw new PolicyError(field, `at most ${MAX_RULES} entries`);
  v.forEach((e, i) => {
    const f = `${field}[${i}]`;
    if (typeof e !== "string" || e.length === 0 || e.length > 256) throw new PolicyError(f, "must be a non-empty string of at most 256 characters");
    const s = e.trim();
    if (/^[\d./]+$/.test(s)) {
      let c: string | undefined;
      try {
        c = parseIpv4Entry(s);
      } catch (err) {
        throw new PolicyError(f, `${JSON.stringify(e)} is not a valid IPv4 address or CIDR (${(err as Error).message})`);
      }
      if (!c) throw new PolicyError(f, `${JSON.stringify(e)} is not a valid IPv4 address or CIDR`);
      out.cidrs.push(c);
      return;
    }
    if (s.includes(":")) {
      // IPv6: accepted as E2B does, but sandboxes have no IPv6 route, so it changes nothing.
      const [addr, len, ...rest] = s.split("/");
      const lenOk = len === undefined || (/^\d{1,3}$/.test(len) && Number(len) <= 128);
      if (rest.length > 0 || !isIPv6(addr!) || !lenOk) throw new PolicyError(f, `${JSON.stringify(e)} is not a valid IPv6 address or CIDR`);
      return;
    }
    const d = parseDomain(s);
    if (!d) throw new PolicyError(f, `${JSON.stringify(e)} is not a CIDR, an IP address or a domain (example.com, *.example.com)`);
    out.domains.push(d);
  });
  return out;
}

function parsePorts(field: string, v: unknown): number[] {
  if (v === undefined || v === null) return [];
  if (!Array.isArray(v)) throw new PolicyError(field, "must be an array of ports");
  if (v.length > MAX_HTTPS_PORTS) throw new PolicyError(field, `at most ${MAX_HTTPS_PORTS} ports`);
  return v.map((p, i) => {
    if (!Number.isInteger(p) || p < 1 || p > 65535) throw new PolicyError(`${field}[${i}]`, `${JSON.stringify(p)} is not a port (1..65535)`);
    return p as number;
  });
}

/**
 * The egress policy of `allow_internet_access` and `network` (E2B's SandboxNetworkConfig, or the
 * body of PUT /sandboxes/{id}/network). PolicyError naming the field on anything malformed.
 */
export function parseEgressPolicy(allowInternetAccess: unknown, network: unknown): EgressPolicy {
  if (allowInternetAccess !== undefined && allowInternetAccess !== null && typeof allowInternetAccess !== "boolean") {
    throw new PolicyError("allow_internet_access", "must be a boolean");
  }
  if (network !== undefined && network !== null && (typeof network !== "object" || Array.isArray(network))) {
    throw new PolicyError("network", "must be an object");
  }
  const n = (network ?? {}) as Record<string, unknown>;
  const allow = parseList("network.allowOut", n.allowOut);
  const deny = parseList("network.denyOut", n.denyOut);
  const ports = parsePorts("network.httpsPorts", n.httpsPorts);
  const rules = parseRules("network.rules", n.rules);
  const upstream = parseUpstream("network.egressProxy", n.egressProxy);
  return {
    internet: allowInternetAccess !== false,
    allowCidrs: allow.cidrs,
    denyCidrs: deny.cidrs,
    allowDomains: allow.domains,
    denyDomains: deny.domains,
    proxiedPorts: [...new Set([...DEFAULT_PROXIED_PORTS, ...ports])].sort((a, b) => a - b),
    rules,
    upstream,
  };
}

/** The inbound half of `network`: who may reach the sandbox's ports through the node's proxy. */
export interface InboundPolicy {
  /** false: non-envd ports want the sandbox's traffic access token. */
  allowPublicTraffic: boolean;
  /** The Host header sent to the sandbox on non-envd ports, `${PORT}` replaced by the port. */
  maskRequestHost: string | undefined;
}

export function parseInboundPolicy(network: unknown): InboundPolicy {
  const n = (network ?? {}) as Record<string, unknown>;
  if (n.allowPublicTraffic !== undefined && n.allowPublicTraffic !== null && typeof n.allowPublicTraffic !== "boolean") {
    throw new PolicyError("network.allowPublicTraffic", "must be a boolean");
  }
  const mask = n.maskRequestHost;
  if (mask !== undefined && mask !== null && (typeof mask !== "string" || !/^[A-Za-z0-9._:\[\]${}-]{1,256}$/.test(mask))) {
    throw new PolicyError("network.maskRequestHost", "must be a host[:port] of at most 256 characters (${PORT} is replaced by the port)");
  }
  return { allowPublicTraffic: n.allowPublicTraffic !== false, maskRequestHost: (mask as string | null | undefined) ?? undefined };
}

export function cidrContains(c: Cidr, ip: number): boolean {
  return ip >= c.base && ip < c.base + 2 ** (32 - c.prefixLen);
}

/** Whether `name` matches `pattern` (`example.com` exactly, `*.example.com` anything below it). */
export function domainMatches(pattern: string, name: string): boolean {
  const n = name.toLowerCase().replace(/\.$/, "");
  if (pattern.startsWith("*.")) return n.endsWith(pattern.slice(1));
  return n === pattern;
}

/** A policy with its CIDRs parsed once, for deciding many connections. */
export class PolicyMatcher {
  private readonly allow: Cidr[];
  private readonly deny: Cidr[];
  private readonly always: Cidr[];

  constructor(readonly policy: EgressPolicy, alwaysDenied: string[]) {
    this.allow = policy.allowCidrs.map(parseCidr);
    this.deny = policy.denyCidrs.map(parseCidr);
    this.always = alwaysDenied.map(parseCidr);
  }

  alwaysDenied(ip: string): boolean {
    const n = parseIpv4(ip);
    return this.always.some((c) => cidrContains(c, n));
  }

  /**
   * The decision for a connection to `ip` that claims `name` (undefined when it names none):
   * `by` says which rule decided (`allowOut`, `denyOut`, `internal`, `default`).
   */
  decide(ip: string, name?: string): { allow: boolean; by: "internal" | "allowOut" | "denyOut" | "default"; domain?: string } {
    const n = parseIpv4(ip);
    if (this.always.some((c) => cidrContains(c, n))) return { allow: false, by: "internal" };
    const allowDomain = name === undefined ? undefined : this.policy.allowDomains.find((d) => domainMatches(d, name));
    if (allowDomain) return { allow: true, by: "allowOut", domain: allowDomain };
    if (this.allow.some((c) => cidrContains(c, n))) return { allow: true, by: "allowOut" };
    const denyDomain = name === undefined ? undefined : this.policy.denyDomains.find((d) => domainMatches(d, name));
    if (denyDomain) return { allow: false, by: "denyOut", domain: denyDomain };
    if (this.deny.some((c) => cidrContains(c, n))) return { allow: false, by: "denyOut" };
    return { allow: this.policy.internet, by: "default" };
  }
}

/**
 * Ranges no sandbox reaches whatever its policy allows (the node may add its own networks):
 * "this" network, RFC 1918, CGNAT, loopback, link-local (cloud metadata at 169.254.169.254),
 * IETF protocol assignments, multicast and reserved.
 */
export const DEFAULT_ALWAYS_DENIED = [
  "0.0.0.0/8",
  "10.0.0.0/8",
  "100.64.0.0/10",
  "127.0.0.0/8",
  "169.254.0.0/16",
  "172.16.0.0/12",
  "192.0.0.0/24",
  "192.168.0.0/16",
  "224.0.0.0/4",
  "240.0.0.0/4",
];
