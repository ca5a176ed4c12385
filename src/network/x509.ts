// The node's egress CA and the leaf certificates the domain proxy shows a sandbox when a rule
// terminates TLS (egress_proxy.ts). node:crypto makes the keys (ECDSA P-256) and the signatures
// and parses certificates (X509Certificate), but has no certificate builder: this file writes the
// few DER structures an X.509 v3 certificate needs (RFC 5280), nothing else.
//
// The CA is made once under its directory (ca.pem 0644, ca-key.pem 0600; a key readable by group or
// others is refused) and lives CA_YEARS; a leaf is made per host name, valid LEAF_DAYS, kept in a
// bounded cache and made again a day before it expires.

import { createHash, createPrivateKey, generateKeyPairSync, randomBytes, sign, X509Certificate, type KeyObject } from "node:crypto";
import { closeSync, lstatSync, mkdirSync, openSync, readFileSync, renameSync, writeSync } from "node:fs";
import { join } from "node:path";
import { NetworkError } from "./command.ts";

export const CA_YEARS = 10;
export const LEAF_DAYS = 30;
/** Leaf certificates kept (the least recently used goes first). */
export const LEAF_CACHE_ENTRIES = 1024;
const DAY_MS = 86_400_000;

// ─── DER ─────────────────────────────────────────────────────────────────────

function len(n: number): Buffer {
  if (n < 0x80) return Buffer.from([n]);
  const bytes: number[] = [];
  for (let v = n; v > 0; v = Math.floor(v / 256)) bytes.unshift(v & 0xff);
  return Buffer.from([0x80 | bytes.length, ...bytes]);
}
const tlv = (tag: number, ...body: Buffer[]): Buffer => {
  const b = Buffer.concat(body);
  return Buffer.concat([Buffer.from([tag]), len(b.length), b]);
};
const seq = (...b: Buffer[]) => tlv(0x30, ...b);
const set = (...b: Buffer[]) => tlv(0x31, ...b);
const octets = (b: Buffer) => tlv(0x04, b);
const bits = (b: Buffer, unused = 0) => tlv(0x03, Buffer.from([unused]), b);
const bool = (v: boolean) => tlv(0x01, Buffer.from([v ? 0xff : 0]));
const utf8 = (s: string) => tlv(0x0c, Buffer.from(s, "utf8"));
const explicit = (n: number, b: Buffer) => tlv(0xa0 | n, b);

function int(v: number | Buffer): Buffer {
  let b = typeof v === "number" ? Buffer.from([v]) : v;
  if (b[0]! & 0x80) b = Buffer.concat([Buffer.from([0]), b]);
  return tlv(0x02, b);
}

function oid(s: string): Buffer {
  const p = s.split(".").map(Number);
  const out = [40 * p[0]! + p[1]!];
  for (const v of p.slice(2)) {
    const enc = [v & 0x7f];
    for (let x = Math.floor(v / 128); x > 0; x = Math.floor(x / 128)) enc.unshift(0x80 | (x & 0x7f));
    out.push(...enc);
  }
  return tlv(0x06, Buffer.from(out));
}

/** UTCTime through 2049, GeneralizedTime after (RFC 5280 4.1.2.5). */
function time(d: Date): Buffer {
  const iso = d.toISOString().replace(/[-:T]/g, "").slice(0, 14) + "Z"; // YYYYMMDDHHMMSSZ
  return d.getUTCFullYear() < 2050 ? tlv(0x17, Buffer.from(iso.slice(2))) : tlv(0x18, Buffer.from(iso));
}

const OID = {
  ecdsaSha256: "1.2.840.10045.4.3.2",
  cn: "2.5.4.3",
  o: "2.5.4.10",
  basicConstraints: "2.5.29.19",
  keyUsage: "2.5.29.15",
  extKeyUsage: "2.5.29.37",
  serverAuth: "1.3.6.1.5.5.7.3.1",
  san: "2.5.29.17",
  ski: "2.5.29.14",
  aki: "2.5.29.35",
};

const name = (cn: string) => seq(set(seq(oid(OID.o), utf8("AgentENV"))), set(seq(oid(OID.cn), utf8(cn))));
const ext = (id: string, critical: boolean, value: Buffer) => seq(oid(id), ...(critical ? [bool(true)] : []), octets(value));

/** A key identifier: the SHA-1 of the whole SubjectPublicKeyInfo (any stable unique value will do, RFC 5280 4.2.1.2). */
const keyId = (spki: Buffer): Buffer => createHash("sha1").update(spki).digest();

interface CertSpec {
  subject: string;
  spki: Buffer;
  issuer: string;
  issuerKey: KeyObject;
  issuerSpki: Buffer;
  notBefore: Date;
  notAfter: Date;
  ca: boolean;
  dnsName?: string;
}

function certificate(s: CertSpec): string {
  const sigAlg = seq(oid(OID.ecdsaSha256));
  // Positive and minimally encoded (DER): a first byte of 1..127, never 0 (a leading zero byte before
  // one below 0x80 is an invalid INTEGER to BoringSSL: 1 certificate in 128 failed to load).
  const serial = randomBytes(16);
  serial[0] = 1 + (serial[0]! % 127);
  const extensions = s.ca
    ? [
        ext(OID.basicConstraints, true, seq(bool(true), int(0))),
        ext(OID.keyUsage, true, bits(Buffer.from([0x86]), 1)), // digitalSignature, keyCertSign, cRLSign
        ext(OID.ski, false, octets(keyId(s.spki))),
      ]
    : [
        ext(OID.basicConstraints, true, seq()),
        ext(OID.keyUsage, true, bits(Buffer.from([0x80]), 7)), // digitalSignature
        ext(OID.extKeyUsage, false, seq(oid(OID.serverAuth))),
        ext(OID.san, false, seq(tlv(0x82, Buffer.from(s.dnsName!, "ascii")))),
        ext(OID.ski, false, octets(keyId(s.spki))),
        ext(OID.aki, false, seq(tlv(0x80, keyId(s.issuerSpki)))),
      ];
  const tbs = seq(
    explicit(0, int(2)),
    int(serial),
    sigAlg,
    name(s.issuer),
    seq(time(s.notBefore), time(s.notAfter)),
    name(s.subject),
    s.spki,
    explicit(3, seq(...extensions)),
  );
  const sig = sign("sha256", tbs, { key: s.issuerKey, dsaEncoding: "der" });
  const der = seq(tbs, sigAlg, bits(sig));
  return `-----BEGIN CERTIFICATE-----\n${der.toString("base64").replace(/.{64}/g, "$&\n").replace(/\n?$/, "\n")}-----END CERTIFICATE-----\n`;
}

function newKey(): { key: KeyObject; spki: Buffer; pem: string } {
  const { privateKey, publicKey } = generateKeyPairSync("ec", { namedCurve: "prime256v1" });
  return { key: privateKey, spki: publicKey.export({ type: "spki", format: "der" }), pem: privateKey.export({ type: "pkcs8", format: "pem" }) as string };
}

// ─── the CA ──────────────────────────────────────────────────────────────────

export interface LeafCert {
  certPem: string;
  keyPem: string;
  notAfter: number;
}

export class EgressCa {
  private readonly leaves = new Map<string, LeafCert>();
  /** One key for every leaf: minting is then one signature (the CA's key never leaves the host either way). */
  private readonly leafKey = newKey();
  private readonly spki: Buffer;

  constructor(readonly certPem: string, private readonly key: KeyObject, readonly subject: string) {
    this.spki = new X509Certificate(certPem).publicKey.export({ type: "spki", format: "der" });
  }

  /** A leaf for `host` signed by this CA, from the cache while it has more than a day left. */
  leaf(host: string, now = Date.now()): LeafCert {
    const hit = this.leaves.get(host);
    if (hit && hit.notAfter - now > DAY_MS) {
      this.leaves.delete(host); // re-insert: most recently used last
      this.leaves.set(host, hit);
      return hit;
    }
    if (!/^[a-z0-9.-]{1,253}$/.test(host)) throw new NetworkError("BadName", `no certificate for ${JSON.stringify(host)}`);
    const notAfter = new Date(now + LEAF_DAYS * DAY_MS);
    const certPem = certificate({
      subject: host, spki: this.leafKey.spki, issuer: this.subject, issuerKey: this.key, issuerSpki: this.spki,
      notBefore: new Date(now - 3_600_000), notAfter, ca: false, dnsName: host,
    });
    const leaf = { certPem, keyPem: this.leafKey.pem, notAfter: notAfter.getTime() };
    if (this.leaves.size >= LEAF_CACHE_ENTRIES) this.leaves.delete(this.leaves.keys().next().value!);
    this.leaves.set(host, leaf);
    return leaf;
  }

  /** The CA's private key (written once to its 0600 file; never sent anywhere). */
  keyPem(): string {
    return this.key.export({ type: "pkcs8", format: "pem" }) as string;
  }

  get cachedLeaves(): number {
    return this.leaves.size;
  }

  /** A CA in memory (tests); a node keeps its own with loadOrCreateCa. */
  static generate(subject = "AgentENV egress CA", now = Date.now()): EgressCa {
    const k = newKey();
    const certPem = certificate({
      subject, spki: k.spki, issuer: subject, issuerKey: k.key, issuerSpki: k.spki,
      notBefore: new Date(now - 3_600_000), notAfter: new Date(now + CA_YEARS * 365 * DAY_MS), ca: true,
    });
    return new EgressCa(certPem, k.key, subject);
  }
}

function writeAtomic(path: string, text: string, mode: number): void {
  const tmp = `${path}.tmp${process.pid}`;
  const fd = openSync(tmp, "w", mode);
  try {
    writeSync(fd, text);
  } finally {
    closeSync(fd);
  }
  renameSync(tmp, path);
}

/**
 * The node's CA in `dir` (ca.pem, ca-key.pem), made on first use. A key file readable by group or
 * others, or not a regular file, is refused (NetworkError BadCa): it would let anyone forge hosts
 * every sandbox trusts.
 */
export function loadOrCreateCa(dir: string): EgressCa {
  mkdirSync(dir, { recursive: true, mode: 0o700 });
  const certPath = join(dir, "ca.pem");
  const keyPath = join(dir, "ca-key.pem");
  let st;
  try {
    st = lstatSync(keyPath);
  } catch {
    const host = (() => {
      try {
        return readFileSync("/etc/hostname", "utf8").trim().slice(0, 32);
      } catch {
        return "";
      }
    })();
    const subject = `AgentENV egress CA${host ? ` ${host}` : ""} ${randomBytes(4).toString("hex")}`;
    const ca = EgressCa.generate(subject);
    writeAtomic(keyPath, ca.keyPem(), 0o600);
    writeAtomic(certPath, ca.certPem, 0o644);
    return ca;
  }
  if (!st.isFile()) throw new NetworkError("BadCa", `${keyPath} is not a regular file`);
  if (st.mode & 0o077) throw new NetworkError("BadCa", `${keyPath} is readable by others (mode ${(st.mode & 0o777).toString(8)}); it must be 0600`);
  const certPem = readFileSync(certPath, "utf8");
  const cert = new X509Certificate(certPem);
  const key = createPrivateKey(readFileSync(keyPath, "utf8"));
  if (!cert.checkPrivateKey(key)) throw new NetworkError("BadCa", `${certPath} and ${keyPath} are not one pair`);
  const subject = /CN=([^\n]+)/.exec(cert.subject)?.[1] ?? "AgentENV egress CA";
  return new EgressCa(certPem, key, subject);
}
