// The node's HTTPS listener: AENV_TLS_CERT and AENV_TLS_KEY, both or neither, read and checked once
// at start (a PEM certificate, a PEM private key, one pair), so a wrong setting stops the start
// with the setting's name instead of failing every handshake later. A renewed certificate is read
// by the next start (a stop leaves sandboxes running).
import { X509Certificate, createPrivateKey } from "node:crypto";
import { readFileSync, statSync } from "node:fs";
import { ConfigError, SETTINGS, type NodeConfig } from "./config.ts";

/** Largest PEM file read: a chain of a few certificates or one key is a few KiB; 1 MiB bounds a misnamed path. */
export const PEM_MAX_BYTES = 1 << 20;

export interface NodeTls {
  /** PEM texts as Bun.serve's `tls` takes them. */
  cert: string;
  key: string;
  /** The leaf's subject alternative names, for the start line. */
  names: string;
  /** When the leaf expires. */
  notAfter: Date;
  /** Warnings for the start line: an expired leaf, a domain the leaf does not cover. */
  warnings: string[];
}

/** The text of the PEM file a setting names; a ConfigError naming the setting when it cannot be read. */
function readPem(name: "tlsCert" | "tlsKey", path: string): string {
  const s = SETTINGS[name];
  const where = `${s.env}=${path}`;
  let size: number;
  try {
    const st = statSync(path);
    if (!st.isFile()) throw new ConfigError(`${where}: not a regular file`);
    size = st.size;
  } catch (e) {
    if (e instanceof ConfigError) throw e;
    throw new ConfigError(`${where}: cannot read it (${(e as NodeJS.ErrnoException).code ?? (e as Error).message})`);
  }
  if (size > PEM_MAX_BYTES) throw new ConfigError(`${where}: larger than ${PEM_MAX_BYTES} bytes, not a PEM file`);
  try {
    return readFileSync(path, "utf8");
  } catch (e) {
    throw new ConfigError(`${where}: cannot read it (${(e as NodeJS.ErrnoException).code ?? (e as Error).message})`);
  }
}

/**
 * The HTTPS settings, or undefined when neither file is set. ConfigError when only one is set, a
 * file is unreadable, is not a PEM certificate or key, or the two are not one pair. A leaf that
 * has expired, or does not cover `{port}-{id}.{domain}` hosts, is a warning: the plain port serves on.
 */
export function loadTls(cfg: Pick<NodeConfig, "tlsCert" | "tlsKey" | "domain">, now = Date.now()): NodeTls | undefined {
  const { tlsCert: c, tlsKey: k } = SETTINGS;
  if (cfg.tlsCert === "" && cfg.tlsKey === "") return undefined;
  if (cfg.tlsCert === "" || cfg.tlsKey === "") {
    const [set, missing] = cfg.tlsCert === "" ? [k, c] : [c, k];
    throw new ConfigError(`${set.env} (${set.toml}) is set but ${missing.env} (${missing.toml}) is not: HTTPS needs both a certificate and its key, or neither`);
  }
  const cert = readPem("tlsCert", cfg.tlsCert);
  const key = readPem("tlsKey", cfg.tlsKey);
  let leaf: X509Certificate;
  try {
    leaf = new X509Certificate(cert);
  } catch (e) {
    throw new ConfigError(`${c.env}=${cfg.tlsCert}: not a PEM certificate (${(e as Error).message})`);
  }
  let privateKey;
  try {
    privateKey = createPrivateKey(key);
  } catch (e) {
    throw new ConfigError(`${k.env}=${cfg.tlsKey}: not a PEM private key (${(e as Error).message})`);
  }
  if (!leaf.checkPrivateKey(privateKey)) throw new ConfigError(`${c.env}=${cfg.tlsCert} and ${k.env}=${cfg.tlsKey} are not one pair: the key does not match the certificate`);
  const notAfter = new Date(leaf.validTo);
  const warnings: string[] = [];
  if (notAfter.getTime() < now) warnings.push(`the certificate expired on ${notAfter.toISOString()}`);
  // The SDK's envd host for a sandbox: a name under the domain, its port (if any) not part of the name.
  const domainHost = cfg.domain.replace(/:\d+$/, "");
  if (domainHost !== "" && !leaf.checkHost(`49983-x.${domainHost}`)) warnings.push(`the certificate does not cover *.${domainHost}: clients will refuse https://{port}-{id}.${cfg.domain}`);
  return { cert, key, names: leaf.subjectAltName ?? leaf.subject, notAfter, warnings };
}
