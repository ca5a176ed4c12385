// The node's settings: one table, each setting with its environment variable, its key in the
// optional `$AENV_HOME/node.toml`, its default and its parser. The environment wins over the file;
// docs/node.md lists the same table (test/node/config.test.ts keeps the two in step).
import { chmodSync, closeSync, existsSync, mkdirSync, openSync, readFileSync, renameSync, writeSync } from "node:fs";
import { dirname, join, resolve } from "node:path";
import { S3_ENDPOINT } from "../snapshot/open.ts";
import { INSECURE_HOST } from "../storage/remote/destination.ts";
import { parseS3Url } from "../storage/s3_url.ts";

export class ConfigError extends Error {
  constructor(message: string) { super(message); this.name = "ConfigError"; }
}

type Parse<T> = (raw: string, name: string) => T;

const str: Parse<string> = (raw) => raw;
function int(min: number, max: number): Parse<number> {
  return (raw, name) => {
    const v = Number(raw);
    if (!Number.isSafeInteger(v) || v < min || v > max) throw new ConfigError(`${name}=${raw}: expected a whole number in ${min}..${max}`);
    return v;
  };
}
function oneOf<T extends string>(...values: T[]): Parse<T> {
  return (raw, name) => {
    if (!(values as string[]).includes(raw)) throw new ConfigError(`${name}=${raw}: expected one of ${values.join(", ")}`);
    return raw as T;
  };
}
/** 1/0 in the environment, true/false in node.toml. */
const flag: Parse<boolean> = (raw, name) => {
  if (raw === "1" || raw === "true") return true;
  if (raw === "0" || raw === "false") return false;
  throw new ConfigError(`${name}=${raw}: expected 1 or 0 (true or false)`);
};
function matching(re: RegExp, what: string): Parse<string> {
  return (raw, name) => {
    if (!re.test(raw)) throw new ConfigError(`${name}=${raw}: expected ${what}`);
    return raw;
  };
}

/** A comma-separated list, each entry checked; empty entries dropped. */
function listOf(check: (entry: string) => boolean, what: string): Parse<string[]> {
  return (raw, name) => {
    const entries = raw.split(",").map((e) => e.trim()).filter(Boolean);
    const bad = entries.find((e) => !check(e));
    if (bad !== undefined) throw new ConfigError(`${name}=${raw}: '${bad}' is not ${what}`);
    return entries;
  };
}
const isS3Scope = (e: string) => {
  try {
    parseS3Url(`s3://${e}`);
    return true;
  } catch {
    return false;
  }
};

interface Setting<T> { env: string; toml: string; default: string; parse: Parse<T>; doc: string }
function setting<T>(env: string, toml: string, def: string, parse: Parse<T>, doc: string): Setting<T> {
  return { env, toml, default: def, parse, doc };
}

/** Every setting of the node. `$AENV_HOME` in a default is replaced by the home setting's value. */
/** An IP socket address as AENV_P2P_BIND and each address of AENV_P2P_PEERS take it: `ip:port`, IPv6 in brackets. */
export const SOCKET_ADDR = /^(\[[0-9a-fA-F:.]+\]|[0-9.]+):\d{1,5}$/;

export const SETTINGS = {
  home: setting("AENV_HOME", "home", "/var/lib/aenv", str, "state: sqlite database, layers, snapshots, secrets"),
  host: setting("HOST", "host", "0.0.0.0", str, "address the API and proxy listen on"),
  port: setting("PORT", "port", "3000", int(0, 65535), "port of the API and proxy"),
  apiKey: setting("AENV_API_KEY", "api_key", "", str, "API key; empty: read or generate $AENV_HOME/secrets/api-key"),
  domain: setting("AENV_DOMAIN", "domain", "", str, "sandbox domain for `{port}-{id}.{domain}` hosts; empty: the clients' own"),
  tlsCert: setting("AENV_TLS_CERT", "tls_cert", "", str, "PEM certificate chain (leaf first, e.g. for `*.{domain}`) of the HTTPS listener on AENV_TLS_PORT; set with AENV_TLS_KEY or neither; empty: no HTTPS"),
  tlsKey: setting("AENV_TLS_KEY", "tls_key", "", str, "PEM private key of AENV_TLS_CERT"),
  tlsPort: setting("AENV_TLS_PORT", "tls_port", "443", int(0, 65535), "port of the HTTPS listener (API and proxy, as on PORT) when AENV_TLS_CERT is set: the SDK's `https://{port}-{id}.{domain}` goes to 443 unless the domain names a port"),
  defaultTimeoutS: setting("AENV_DEFAULT_TIMEOUT_S", "default_timeout_s", "300", int(1, 86_400 * 30), "sandbox TTL when a create names none (E2B: 300 s)"),
  reaperIntervalMs: setting("AENV_REAPER_INTERVAL_MS", "reaper_interval_ms", "1000", int(50, 60_000), "how often expired sandboxes are paused or killed"),
  maxSandboxes: setting("AENV_MAX_SANDBOXES", "max_sandboxes", "64", int(1, 4096), "sandboxes this node holds at once (running + paused); past it: 429"),
  maxBodyBytes: setting("AENV_MAX_BODY_BYTES", "max_body_bytes", "1048576", int(1024, 64 << 20), "largest API request body (the proxy streams and has no such bound)"),
  vmm: setting("AENV_VMM", "vmm", "auto", oneOf("auto", "qemu", "firecracker"), "VMM: auto picks Firecracker when its binary and KVM exist, else QEMU"),
  slotCidr: setting("AENV_SLOT_CIDR", "slot_cidr", "10.200.0.0/16", str, "host-side addresses of network slots, cut into /31s; on this machine's veths only"),
  devicePool: setting("AENV_DEVICE_POOL", "device_pool", "4", int(0, 256), "rootfs devices kept ready: that many empty ones in blockd's pool, and per template that many with its layers open"),
  slotPool: setting("AENV_SLOT_POOL", "slot_pool", "4", int(0, 256), "network slots kept ready"),
  memoryLayersMax: setting("AENV_MEMORY_LAYERS_MAX", "memory_layers_max", "32", int(1, 1024), "memory layers a sandbox stacks (one per pause) before a pause writes one fresh base layer of all its memory instead"),
  memoryZfile: setting("AENV_MEMORY_ZFILE", "memory_zfile", "", oneOf("", "zstd", "lz4"), "compress memory layers as ZFiles (zstd or lz4, 4 KiB blocks); empty: plain layers"),
  balloonPressurePct: setting("AENV_BALLOON_PRESSURE_PCT", "balloon_pressure_pct", "10", int(0, 50), "below this % of host memory available, running sandboxes' balloons take back half their memory (returned from twice that); 0: never"),
  templateCache: setting("AENV_TEMPLATE_CACHE", "template_cache", "$AENV_HOME/templates", str, "built templates (base), keyed by their definition's hash"),
  runDir: setting("AENV_RUN_DIR", "run_dir", "/run/aenv", str, "VM run directories (sockets, consoles, a cold boot's RAM): tmpfs"),
  slotPrefix: setting("AENV_SLOT_PREFIX", "slot_prefix", "aenv-", str, "names of this node's network namespaces and host veths"),
  maxBuilds: setting("AENV_MAX_BUILDS", "max_builds", "2", int(1, 64), "template builds running at once; up to 8 more wait, past that: 429"),
  buildTimeoutS: setting("AENV_BUILD_TIMEOUT_S", "build_timeout_s", "3600", int(60, 86_400), "a template build's limit, boot to checkpoint"),
  uploadUrlTtlS: setting("AENV_UPLOAD_URL_TTL_S", "upload_url_ttl_s", "3600", int(60, 86_400), "how long a COPY archive's upload URL (GET /templates/{id}/files/{hash}) stays valid (E2B: 1 hour)"),
  stepCacheMB: setting("AENV_STEP_CACHE_MB", "step_cache_mb", "20480", int(0, 1 << 24), "template builds' step layers kept; past it the least recently used go (a template's layers stay)"),
  layerCacheMB: setting("AENV_LAYER_CACHE_MB", "layer_cache_mb", "65536", int(64, 1 << 24), "pulled images' converted layers kept; above 90 % the least recently used go until 70 % (a template's, snapshot's or sandbox's layers stay)"),
  blockCacheDir: setting("AENV_BLOCK_CACHE_DIR", "block_cache_dir", "$AENV_HOME/block-cache", str, "chunks of remote layers (overlaybd images pulled lazily) and the layers promoted whole; blockd's workers and the node share it"),
  blockCacheMB: setting("AENV_BLOCK_CACHE_MB", "block_cache_mb", "10240", int(64, 1 << 24), "remote layers' chunks kept; above 90 % the least recently used go until 70 % (chunks being read stay)"),
  blockCacheDownload: setting("AENV_BLOCK_CACHE_DOWNLOAD", "block_cache_download", "1", flag, "1: a remote layer that fits under 70 % of the block cache is fetched whole in the background and promoted to a local file; 0: only what is read is fetched"),
  p2p: setting("AENV_P2P", "p2p", "1", flag, "1: an iroh endpoint (key in $AENV_HOME/p2p) serves this node's verified layers to its peers, and remote layers are asked of the peers before their origin; 0: none"),
  p2pBind: setting("AENV_P2P_BIND", "p2p_bind", "0.0.0.0:0", matching(SOCKET_ADDR, "ip:port"), "UDP address of the iroh endpoint; port 0: a free one (the start line prints it)"),
  p2pPeers: setting("AENV_P2P_PEERS", "p2p_peers", "", str, "peers asked for layers, comma-separated `<endpoint ID>@<ip:port>` (several addresses joined by `;`); each may connect"),
  p2pAllow: setting("AENV_P2P_ALLOW", "p2p_allow", "", str, "further endpoint IDs (comma-separated) that may fetch this node's layers without being its peers"),
  p2pRelays: setting("AENV_P2P_RELAYS", "p2p_relays", "", str, "iroh relay URLs (comma-separated) for nodes behind NAT; empty: relays and discovery off, peers dialed directly"),
  snapshotStore: setting("AENV_SNAPSHOT_STORE", "snapshot_store", "$AENV_HOME/snapshots", str, "where snapshots live: a directory (local or shared FS) or s3://bucket/prefix"),
  egressResolvers: setting("AENV_EGRESS_RESOLVERS", "egress_resolvers", "", str, "DNS servers sandboxes may always reach and the domain proxy asks (comma-separated IPv4); empty: the host's non-loopback nameservers"),
  egressUplinks: setting("AENV_EGRESS_UPLINKS", "egress_uplinks", "", str, "interfaces sandbox egress leaves by (forwarding is switched on for them only); empty: the default route's; none: no interface is touched (tests on shared hosts)"),
  egressAlwaysDenied: setting("AENV_EGRESS_ALWAYS_DENIED", "egress_always_denied", "0.0.0.0/8,10.0.0.0/8,100.64.0.0/10,127.0.0.0/8,169.254.0.0/16,172.16.0.0/12,192.0.0.0/24,192.168.0.0/16,224.0.0.0/4,240.0.0.0/4", str, "CIDRs no sandbox reaches whatever its policy allows (the slot CIDR and the host's own networks are always added)"),
  egressProxyPort: setting("AENV_EGRESS_PROXY_PORT", "egress_proxy_port", "0", int(0, 65535), "TCP port of the domain proxy (sandboxes' redirected 80/443); 0: a free one"),
  egressExtraCa: setting("AENV_EGRESS_EXTRA_CA", "egress_extra_ca", "", str, "PEM file of CAs the domain proxy trusts for servers besides the host's trust store, where a header rule terminates TLS; empty: none"),
  guestCache: setting("AENV_GUEST_CACHE", "guest_cache", "$AENV_HOME/guest", str, "the guest's built kernel, initramfs, envd and tools disk (guest/*.sh build them into it)"),
  qemuBin: setting("AENV_QEMU_BIN", "qemu_bin", "qemu-system-x86_64", str, "QEMU binary: a name on PATH or a path"),
  qemuTcgCacheMB: setting("AENV_QEMU_TCG_CACHE_MB", "qemu_tcg_cache_mb", "0", int(0, 4096), "TCG's translated-code cache per VMM in MiB (`-accel tcg,tb-size=`); 0: QEMU's default (1 GiB, of which an idle base guest fills 75–85 MiB; 64 saves ~15 MiB a VMM and slows commands 1.5×, 16 thrashes)"),
  qemuAccel: setting("AENV_QEMU_ACCEL", "qemu_accel", "auto", oneOf("auto", "kvm", "tcg"), "QEMU's accelerator; auto: KVM when /dev/kvm is usable, else TCG"),
  vmmNice: setting("AENV_VMM_NICE", "vmm_nice", "10", int(0, 19), "CPU niceness of VMM processes (all their vCPU threads, and the scheduler group of each VMM's session): busy guests never starve the node's API and blockd's I/O"),
  firecrackerBin: setting("AENV_FIRECRACKER_BIN", "firecracker_bin", "firecracker", str, "Firecracker binary: a name on PATH or a path"),
  blockdFrontend: setting("AENV_BLOCKD_FRONTEND", "blockd_frontend", "auto", oneOf("auto", "fuse", "ublk"), "how blockd serves devices; auto: ublk when ublk_drv is loaded, else FUSE"),
  fuseUring: setting("AENV_FUSE_URING", "fuse_uring", "0", flag, "FUSE over io_uring for blockd's devices (Linux 6.14+); such a connection does not survive a blockd crash"),
  fuseReaderSlots: setting("AENV_FUSE_READER_SLOTS", "fuse_reader_slots", "8", int(0, 64), "FUSE requests a device's reader thread takes while its worker is busy; 0: no reader thread"),
  s3Endpoint: setting("AENV_S3_ENDPOINT", "s3_endpoint", "", matching(new RegExp(`^$|${S3_ENDPOINT.source}`), "http(s)://host[:port] or empty"), "endpoint of S3: an s3:// snapshot store and s3:// images; empty: AWS in the region"),
  s3Region: setting("AWS_REGION", "s3_region", "us-east-1", matching(/^[a-z0-9-]{1,64}$/, "a region name such as us-east-1"), "region of S3 (snapshot store and s3:// images)"),
  s3AccessKeyId: setting("AWS_ACCESS_KEY_ID", "s3_access_key_id", "", str, "access key of S3 (required for an s3:// snapshot store or image)"),
  s3SecretAccessKey: setting("AWS_SECRET_ACCESS_KEY", "s3_secret_access_key", "", str, "secret key of S3 (required for an s3:// snapshot store or image)"),
  s3SessionToken: setting("AWS_SESSION_TOKEN", "s3_session_token", "", str, "session token of S3; empty: none"),
  dockerConfig: setting("DOCKER_CONFIG", "docker_config", "", str, "folder of Docker's config.json, registry credentials for fromImage builds; empty: ~/.docker"),
  insecureRegistries: setting("AENV_INSECURE_REGISTRIES", "insecure_registries", "", listOf((e) => INSECURE_HOST.test(e), "host or host:port"), "registries (comma-separated host or host:port) spoken to over plain http and allowed at loopback, link-local or this machine's addresses; any other registry, redirect, token realm or upload Location is https to a public address"),
  maxBlobMB: setting("AENV_MAX_BLOB_MB", "max_blob_mb", "10240", int(1, 1 << 24), "largest blob (image layer) a pull takes, by its descriptor or its Content-Length"),
  maxDiskSizeMB: setting("AENV_MAX_DISK_SIZE_MB", "max_disk_size_mb", "65536", int(256, 1 << 24), "largest disk a pulled image (converted size or overlaybd virtual size) or a created sandbox may have"),
  volumeSizeMB: setting("AENV_VOLUME_SIZE_MB", "volume_size_mb", "2048", int(64, 1 << 20), "size of a new volume's ext4 file system (docs/volumes.md); a volume keeps the size it was made with"),
  diskReserveMB: setting("AENV_DISK_RESERVE_MB", "disk_reserve_mb", "2048", int(0, 1 << 24), "free space a create leaves on $AENV_HOME's filesystem; below it creates are refused with 507"),
  cluster: setting("AENV_CLUSTER", "cluster", "", listOf((e) => /^https?:\/\/[^/\s]+$/.test(e), "http(s)://host:port"), "etcd endpoints (comma-separated http(s)://host:port) of the cluster this node joins (docs/cluster.md); empty: a node alone"),
  nodeId: setting("AENV_NODE_ID", "node_id", "", matching(/^$|^[a-z0-9]([a-z0-9.-]{0,61}[a-z0-9])?$/, "lower-case letters, digits, '.' and '-', at most 63"), "this node's ID in the cluster; empty: the host name"),
  clusterTemplates: setting("AENV_CLUSTER_TEMPLATES", "cluster_templates", "", matching(/^$|^s3:\/\/[^\s]+$|^[a-z0-9.-]+(:\d+)?(\/[a-z0-9._-]+)+$/, "a registry repository prefix (host[:port]/path) or s3://bucket/prefix"), "in a cluster: where a template built on this node is pushed (as overlaybd) so every node imports it under the same ID on first use; empty: a template stays on the node that built it"),
  resumeAnywhere: setting("AENV_RESUME_ANYWHERE", "resume_anywhere", "0", flag, "in a cluster whose nodes share AENV_SNAPSHOT_STORE: 1 puts every paused sandbox into the store, so another node resumes it when this one left or drains; 0: a paused sandbox resumes on its node only"),
  advertiseUrl: setting("AENV_ADVERTISE_URL", "advertise_url", "", matching(/^$|^https?:\/\/[^/\s]+$/, "http(s)://host:port"), "where gateways reach this node's API and proxy; empty: http://<first non-loopback IPv4>:<port>"),
  s3Buckets: setting("AENV_S3_BUCKETS", "s3_buckets", "", listOf(isS3Scope, "bucket or bucket/prefix"), "buckets and prefixes (comma-separated bucket or bucket/prefix) s3:// images may be in, read and written with the node's S3 credentials; empty: the snapshot store's bucket when it is in S3, else none"),
};

export type SettingName = keyof typeof SETTINGS;
export type NodeConfig = { [K in SettingName]: ReturnType<(typeof SETTINGS)[K]["parse"]> };

/** Bound on node.toml: a settings file, not a data file. */
const TOML_MAX_BYTES = 64 << 10;

/**
 * Reads the settings: environment first, then `$AENV_HOME/node.toml` (a flat table of the keys
 * above), then the defaults. Unknown keys in the file and malformed values are ConfigErrors.
 */
export function loadConfig(env: Record<string, string | undefined> = process.env): NodeConfig {
  // Absolute: blockd and the VMMs get paths under it, and they run in other directories.
  const home = resolve(env[SETTINGS.home.env] || SETTINGS.home.default);
  const tomlPath = join(home, "node.toml");
  let file: Record<string, unknown> = {};
  if (existsSync(tomlPath)) {
    const text = readFileSync(tomlPath);
    if (text.length > TOML_MAX_BYTES) throw new ConfigError(`${tomlPath}: larger than ${TOML_MAX_BYTES} bytes`);
    try {
      file = Bun.TOML.parse(text.toString("utf8")) as Record<string, unknown>;
    } catch (e) {
      throw new ConfigError(`${tomlPath}: ${(e as Error).message}`);
    }
    const known = new Set(Object.values(SETTINGS).map((s) => s.toml));
    for (const k of Object.keys(file)) if (!known.has(k)) throw new ConfigError(`${tomlPath}: unknown setting '${k}' (known: ${[...known].join(", ")})`);
  }
  const out: Record<string, unknown> = {};
  for (const [name, s] of Object.entries(SETTINGS) as [SettingName, Setting<unknown>][]) {
    const fromEnv = env[s.env];
    const fromFile = file[s.toml];
    let raw: string;
    let where: string;
    if (fromEnv !== undefined && fromEnv !== "") { raw = fromEnv; where = s.env; }
    else if (fromFile !== undefined) { raw = String(fromFile); where = `${tomlPath}: ${s.toml}`; }
    else { raw = s.default.replace("$AENV_HOME", home); where = `default of ${s.env}`; }
    if (name === "home") raw = home;
    out[name] = s.parse(raw, where);
  }
  return out as NodeConfig;
}

/**
 * The buckets and prefixes s3:// images may use the node's S3 credentials on: s3_buckets, or when
 * it is empty the snapshot store's bucket (when the store is in S3), else none.
 */
export function s3Scopes(cfg: Pick<NodeConfig, "s3Buckets" | "snapshotStore">): string[] {
  if (cfg.s3Buckets.length > 0) return cfg.s3Buckets;
  if (!cfg.snapshotStore.startsWith("s3://")) return [];
  try {
    return [parseS3Url(cfg.snapshotStore.trim()).bucket];
  } catch {
    return []; // the store's own check names the malformed setting
  }
}

/** E2B's key format: `e2b_` and 40 hex digits (SDK 2.45 checks it). */
export const API_KEY_FORMAT = /^e2b_[0-9a-f]{40}$/;

/** Where a node with this home keeps the key it generated. */
export const apiKeyPath = (home: string) => join(home, "secrets", "api-key");

/**
 * The key a node with these settings uses, if it has one yet: the configured one, else the one in
 * its key file; null when neither exists (the node generates one on its first start). The aenv CLI
 * reads a local node's key through this.
 */
export function configuredApiKey(cfg: Pick<NodeConfig, "apiKey" | "home">): { key: string; path: string | null } | null {
  if (cfg.apiKey !== "") {
    if (!/^[A-Za-z0-9._~-]{32,256}$/.test(cfg.apiKey)) throw new ConfigError("AENV_API_KEY: expected 32..256 characters of A-Z a-z 0-9 . _ ~ -");
    return { key: cfg.apiKey, path: null };
  }
  const path = apiKeyPath(cfg.home);
  if (!existsSync(path)) return null;
  const key = readFileSync(path, "utf8").trim();
  if (!/^[A-Za-z0-9._~-]{32,256}$/.test(key)) throw new ConfigError(`${path}: not an API key (expected 32..256 characters of A-Z a-z 0-9 . _ ~ -)`);
  return { key, path };
}

/**
 * The API key: the configured one, else the one in `<home>/secrets/api-key`, else a new one written
 * there (mode 0600, by rename so a crash leaves no half key). Returns the key and where it lives.
 */
export function resolveApiKey(cfg: Pick<NodeConfig, "apiKey" | "home">): { key: string; path: string | null } {
  const known = configuredApiKey(cfg);
  if (known) return known;
  const path = apiKeyPath(cfg.home);
  mkdirSync(dirname(path), { recursive: true, mode: 0o700 });
  const key = "e2b_" + Buffer.from(crypto.getRandomValues(new Uint8Array(20))).toString("hex");
  const tmp = `${path}.tmp-${process.pid}`;
  const fd = openSync(tmp, "wx", 0o600);
  try { writeSync(fd, key + "\n"); } finally { closeSync(fd); }
  chmodSync(tmp, 0o600);
  renameSync(tmp, path);
  return { key, path };
}
