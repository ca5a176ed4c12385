// A real OCI registry for tests: Debian's `docker-registry` (distribution 2.8) on 127.0.0.1 with
// a free port and its own storage folder, optionally behind htpasswd Basic auth or Bearer tokens
// from a token server started here; and builders that make small images (busybox from Debian's
// busybox-static, a second layer on top, whiteouts and an opaque directory, an OCI index or a
// Docker manifest list of two platforms, an overlaybd image of sealed layers, a Debian bookworm
// minbase root from mmdebstrap) and push them with our RegistryClient.
//
//   const reg = await startRegistry({ dir: scratchDir("reg") });        // stopped by reg.stop()
//   const client = new RegistryClient({ dockerConfigPath: null, insecureRegistries: [reg.host] });
//   const img = await pushBusyboxImage(client, `${reg.host}/busybox:1`, { workDir });
//   const r = await client.resolve(img.ref);                              // r.config.Env has FOO=bar
//
// Layers are tars made with GNU tar (`--format=posix --owner=0 --group=0 --numeric-owner
// --mtime=@0 --sort=name`), gzip-compressed with node:zlib or zstd-compressed with Bun.zstdCompress.
import { afterAll, beforeAll } from "bun:test";
import { createSign, randomBytes } from "node:crypto";
import { existsSync } from "node:fs";
import { chmod, copyFile, mkdir, readFile, rename, rm, symlink, writeFile } from "node:fs/promises";
import { join } from "node:path";
import { promisify } from "node:util";
import { gzip as gzipCb } from "node:zlib";
import type { Descriptor, Platform, RegistryClient } from "../../src/template/registry.ts";
import { MEDIA, OVERLAYBD_ANNOTATION } from "../../src/template/registry.ts";
import { guestCache, sealedLayer } from "../../src/template/artifacts.ts";
import { MKFS_ARGS } from "../../src/template/convert.ts";
import { STEP_TIMEOUT_MS } from "../../src/template/debian.ts";
import { diffIdOf } from "../../src/template/layer_stream.ts";
import { runStep } from "../../src/template/step.ts";
import { scratchDir } from "../helpers/tmp.ts";

const gzip = promisify(gzipCb);

export const REGISTRY_BIN = "/usr/bin/docker-registry";
export const BUSYBOX_BIN = "/bin/busybox";

/** Why registry tests cannot run here, or undefined when they can. */
export function registrySkipReason(): string | undefined {
  if (!existsSync(REGISTRY_BIN)) return "docker-registry is not installed (apt-get install docker-registry; .ci/deps does it)";
  if (!existsSync(BUSYBOX_BIN)) return "busybox-static is not installed (/bin/busybox; .ci/deps installs it)";
  if (!Bun.which("tar")) return "GNU tar is not on PATH";
  return undefined;
}

export interface BasicAuthUser {
  username: string;
  password: string;
}

export interface TokenAuthConfig {
  realm: string;
  service: string;
  issuer: string;
  rootCertBundle: string;
}

export interface StartRegistryOptions {
  /** Folder for the config, storage and logs (a test scratch dir). */
  dir: string;
  /** htpasswd Basic auth with these users (bcrypt hashes). */
  basicAuth?: BasicAuthUser[];
  /** Bearer tokens from a token server (startTokenServer gives this). */
  tokenAuth?: TokenAuthConfig;
  /** Keep the registry's access log (`RegistryServer.accessLog`): tests count the bytes it served. */
  accessLog?: boolean;
}

/** One line of the registry's access log (Apache combined format). */
export interface AccessEntry {
  method: string;
  path: string;
  status: number;
  /** Body bytes sent. */
  bytes: number;
}

/** Access log lines kept per registry (the oldest go first). */
const MAX_ACCESS_LINES = 200_000;
const ACCESS_LINE = /"([A-Z]+) (\S+) HTTP\/[\d.]+" (\d{3}) (\d+|-)/;

export interface RegistryServer {
  /** `127.0.0.1:<port>`: the registry part of image references. */
  host: string;
  port: number;
  storageDir: string;
  /** The file the registry serves a blob's bytes from (tests corrupt it). */
  blobDataPath(digest: string): string;
  /** The registry's output so far (for a failing test's message). */
  log(): string;
  /** Requests answered so far, oldest first (empty unless started with `accessLog`). */
  accessLog(): AccessEntry[];
  stop(): Promise<void>;
}

/**
 * Bytes the registry sent for GETs of these blobs (whole or by Range), from its access log, once
 * the log has caught up (the registry writes a line after its answer; no new line for settleMs).
 */
export async function blobBytesServed(reg: RegistryServer, digests: string[], settleMs = 300): Promise<number> {
  for (let n = -1; reg.accessLog().length !== n; ) {
    n = reg.accessLog().length;
    await Bun.sleep(settleMs);
  }
  const want = new Set(digests);
  return reg.accessLog().filter((e) => e.method === "GET" && (e.status === 200 || e.status === 206) && want.has(e.path.split("/blobs/")[1] ?? "")).reduce((s, e) => s + e.bytes, 0);
}

/** A port the kernel just handed out and released (the registry takes a fixed port in its config). */
async function freePort(): Promise<number> {
  const s = Bun.listen({ hostname: "127.0.0.1", port: 0, socket: { data() {} } });
  const port = s.port;
  s.stop(true);
  return port;
}

/** Start `docker-registry serve`; resolves once `/v2/` answers (200 or 401), within 15 s. */
export async function startRegistry(opts: StartRegistryOptions): Promise<RegistryServer> {
  const storageDir = join(opts.dir, "storage");
  await mkdir(storageDir, { recursive: true });
  let lastError = "";
  for (let attempt = 0; attempt < 3; attempt++) {
    const port = await freePort();
    const lines = [
      "version: 0.1",
      "log:",
      "  level: warn",
      "  accesslog:",
      `    disabled: ${opts.accessLog ? "false" : "true"}`,
      "storage:",
      "  filesystem:",
      `    rootdirectory: ${storageDir}`,
      "  delete:",
      "    enabled: true",
      "  maintenance:",
      "    uploadpurging:",
      "      enabled: false",
      "http:",
      `  addr: 127.0.0.1:${port}`,
      `  secret: ${randomBytes(16).toString("hex")}`,
      "health:",
      "  storagedriver:",
      "    enabled: false",
    ];
    if (opts.basicAuth) {
      const htpasswd = join(opts.dir, "htpasswd");
      const entries = await Promise.all(opts.basicAuth.map(async (u) => `${u.username}:${await Bun.password.hash(u.password, { algorithm: "bcrypt", cost: 4 })}`));
      await writeFile(htpasswd, entries.join("\n") + "\n");
      lines.push("auth:", "  htpasswd:", "    realm: aenv-test", `    path: ${htpasswd}`);
    } else if (opts.tokenAuth) {
      const t = opts.tokenAuth;
      lines.push("auth:", "  token:", `    realm: ${t.realm}`, `    service: ${t.service}`, `    issuer: ${t.issuer}`, `    rootcertbundle: ${t.rootCertBundle}`);
    }
    const config = join(opts.dir, `config-${port}.yml`);
    await writeFile(config, lines.join("\n") + "\n");
    let output = "";
    const access: AccessEntry[] = [];
    const proc = Bun.spawn([REGISTRY_BIN, "serve", config], { stdout: "pipe", stderr: "pipe" });
    const collect = async (s: ReadableStream<Uint8Array>) => {
      const dec = new TextDecoder();
      let partial = "";
      for await (const chunk of s) {
        const text = dec.decode(chunk, { stream: true });
        if (opts.accessLog) {
          const lines = (partial + text).split("\n");
          partial = lines.pop()!;
          for (const line of lines) {
            const m = ACCESS_LINE.exec(line);
            if (!m) continue;
            access.push({ method: m[1]!, path: m[2]!, status: Number(m[3]), bytes: m[4] === "-" ? 0 : Number(m[4]) });
            if (access.length > MAX_ACCESS_LINES) access.shift();
          }
        }
        output = (output + text).slice(-16_000);
      }
    };
    void collect(proc.stdout);
    void collect(proc.stderr);
    const deadline = Date.now() + 15_000;
    let up = false;
    while (Date.now() < deadline && proc.exitCode === null) {
      try {
        const res = await fetch(`http://127.0.0.1:${port}/v2/`, { signal: AbortSignal.timeout(1000) });
        await res.body?.cancel();
        if (res.status === 200 || res.status === 401) {
          up = true;
          break;
        }
      } catch {
        /* not listening yet */
      }
      await Bun.sleep(50);
    }
    if (up) {
      return {
        host: `127.0.0.1:${port}`,
        port,
        storageDir,
        blobDataPath: (digest: string) => {
          const hex = digest.replace(/^sha256:/, "");
          return join(storageDir, "docker/registry/v2/blobs/sha256", hex.slice(0, 2), hex, "data");
        },
        log: () => output,
        accessLog: () => [...access],
        stop: async () => {
          proc.kill("SIGTERM");
          const t = setTimeout(() => proc.kill("SIGKILL"), 5000);
          await proc.exited;
          clearTimeout(t);
        },
      };
    }
    proc.kill("SIGKILL");
    await proc.exited;
    lastError = output.slice(-2000);
  }
  throw new Error(`docker-registry did not start: ${lastError}`);
}

export interface RegistrySuite {
  /** The suite's scratch folder (the registry's files are under `<dir>/registry`). */
  dir: string;
  reg: RegistryServer;
  tokens?: TokenServer;
  /** The registry and its token server (both on loopback, plain http): a client's insecureRegistries. */
  insecure: string[];
}

/**
 * A registry for one describe block: in beforeAll a scratch folder and a registry (behind Basic
 * auth, or with `token: true` behind a token server with the same users); in afterAll both are
 * stopped and the folder removed. Call it in the describe body; the accessor works inside tests.
 */
export function registrySuite(label: string, opts: { basicAuth?: BasicAuthUser[]; token?: boolean; accessLog?: boolean } = {}): () => RegistrySuite {
  let suite: RegistrySuite | undefined;
  beforeAll(async () => {
    const dir = scratchDir(label, { keep: true });
    const tokens = opts.token ? await startTokenServer(join(dir, "tokens"), opts.basicAuth) : undefined;
    const reg = await startRegistry({ dir: join(dir, "registry"), basicAuth: opts.token ? undefined : opts.basicAuth, tokenAuth: tokens?.auth, accessLog: opts.accessLog });
    suite = { dir, reg, tokens, insecure: [reg.host, ...(tokens ? [new URL(tokens.auth.realm).host] : [])] };
  });
  afterAll(async () => {
    if (!suite) return;
    await suite.reg.stop();
    suite.tokens?.stop();
    await rm(suite.dir, { recursive: true, force: true });
  });
  return () => {
    if (!suite) throw new Error(`${label}: registry used outside its suite`);
    return suite;
  };
}

// ---------------------------------------------------------------------------------------------
// Bearer tokens: a token server that signs JWTs (RS256) with a self-signed certificate the
// registry trusts as its rootcertbundle; the token's header carries the certificate (x5c).

export interface TokenServer {
  /** The registry's `auth.token` settings. */
  auth: TokenAuthConfig;
  /** Token requests answered so far (tests count them to see the client's cache). */
  requests: { scope: string[]; user: string | undefined }[];
  stop(): void;
}

const b64url = (b: Buffer | string) => Buffer.from(b).toString("base64url");

/**
 * Start a token server on 127.0.0.1. With users, a token needs their Basic credentials (401
 * otherwise); without, anyone gets one. Every scope asked for is granted.
 */
export async function startTokenServer(dir: string, users?: BasicAuthUser[]): Promise<TokenServer> {
  await mkdir(dir, { recursive: true });
  const key = join(dir, "token.key");
  const cert = join(dir, "token.crt");
  const openssl = Bun.spawn(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert, "-days", "2", "-subj", "/CN=aenv-test-token-issuer"], { stdout: "ignore", stderr: "pipe" });
  if ((await openssl.exited) !== 0) throw new Error(`openssl: ${await new Response(openssl.stderr).text()}`);
  const keyPem = await readFile(key, "utf8");
  const certDer = (await readFile(cert, "utf8")).replace(/-----[A-Z ]+-----/g, "").replace(/\s+/g, "");
  const service = "aenv-test-registry";
  const issuer = "aenv-test-issuer";
  const requests: TokenServer["requests"] = [];
  const server = Bun.serve({
    hostname: "127.0.0.1",
    port: 0,
    fetch(req) {
      const url = new URL(req.url);
      let user: string | undefined;
      const authz = req.headers.get("authorization");
      if (authz?.startsWith("Basic ")) {
        const plain = Buffer.from(authz.slice(6), "base64").toString();
        const i = plain.indexOf(":");
        const u = users?.find((x) => x.username === plain.slice(0, i) && x.password === plain.slice(i + 1));
        if (!u) return new Response(JSON.stringify({ details: "bad credentials" }), { status: 401 });
        user = u.username;
      } else if (users) {
        return new Response(JSON.stringify({ details: "credentials needed" }), { status: 401 });
      }
      const scopes = url.searchParams.getAll("scope");
      requests.push({ scope: scopes, user });
      const access = scopes.flatMap((s) => {
        const m = /^([a-z]+):(.+):([a-z*,]+)$/.exec(s);
        return m ? [{ type: m[1], name: m[2], actions: m[3]!.split(",") }] : [];
      });
      const now = Math.floor(Date.now() / 1000);
      const header = { typ: "JWT", alg: "RS256", x5c: [certDer] };
      const claims = { iss: issuer, sub: user ?? "", aud: url.searchParams.get("service") ?? service, exp: now + 300, nbf: now - 10, iat: now, jti: randomBytes(8).toString("hex"), access };
      const signing = `${b64url(JSON.stringify(header))}.${b64url(JSON.stringify(claims))}`;
      const signature = createSign("RSA-SHA256").update(signing).sign(keyPem);
      const token = `${signing}.${b64url(signature)}`;
      return Response.json({ token, access_token: token, expires_in: 300, issued_at: new Date(now * 1000).toISOString() });
    },
  });
  return {
    auth: { realm: `http://127.0.0.1:${server.port}/token`, service, issuer, rootCertBundle: cert },
    requests,
    stop: () => server.stop(true),
  };
}

// ---------------------------------------------------------------------------------------------
// Images.

export type Compression = "gzip" | "zstd" | "none";

export interface ImageSpec {
  /** Root folders of the layers, lowest first. */
  layers: string[];
  compression?: Compression;
  /** OCI media types (default) or Docker schema 2's. */
  format?: "oci" | "docker";
  platform?: Platform;
  config?: { Env?: string[]; WorkingDir?: string; Cmd?: string[]; Entrypoint?: string[]; User?: string; ExposedPorts?: Record<string, object>; Labels?: Record<string, string> };
}

export interface PushedImage {
  /** `host/repo:tag`. */
  ref: string;
  manifestDigest: string;
  mediaType: string;
  configDigest: string;
  layers: Descriptor[];
  /** sha256 of each uncompressed layer tar. */
  diffIds: string[];
}

async function run(argv: string[], cwd?: string): Promise<void> {
  const p = Bun.spawn(argv, { cwd, stdout: "ignore", stderr: "pipe" });
  const [code, err] = await Promise.all([p.exited, new Response(p.stderr).text()]);
  if (code !== 0) throw new Error(`${argv.join(" ")}: exit ${code}: ${err}`);
}

/** A reproducible tar of a folder's contents (root-owned, mtime 0, sorted). */
export async function tarFolder(dir: string, out: string): Promise<void> {
  await run(["tar", "--format=posix", "--pax-option=delete=atime,delete=ctime", "--owner=0", "--group=0", "--numeric-owner", "--mtime=@0", "--sort=name", "-C", dir, "-cf", out, "."]);
}

const sha256 = (b: Uint8Array) => new Bun.CryptoHasher("sha256").update(b).digest("hex");

/** A layer blob of a folder: the compressed tar's bytes and the uncompressed tar's digest. */
export async function layerBlob(dir: string, compression: Compression): Promise<{ bytes: Uint8Array; diffId: string }> {
  const tarPath = `${dir.replace(/\/$/, "")}.tar`;
  await tarFolder(dir, tarPath);
  const tar = new Uint8Array(await readFile(tarPath));
  await rm(tarPath, { force: true });
  const bytes = compression === "gzip" ? new Uint8Array(await gzip(tar)) : compression === "zstd" ? new Uint8Array(await Bun.zstdCompress(tar)) : tar;
  return { bytes, diffId: `sha256:${sha256(tar)}` };
}

export function layerMediaType(format: "oci" | "docker", c: Compression): string {
  if (format === "oci") return c === "gzip" ? MEDIA.ociLayerGzip : c === "zstd" ? MEDIA.ociLayerZstd : MEDIA.ociLayerTar;
  return c === "gzip" ? MEDIA.dockerLayerGzip : c === "zstd" ? MEDIA.dockerLayerZstd : MEDIA.dockerLayerTar;
}

/** Build the layers, push blobs, config and manifest under ref. */
export async function pushImage(client: RegistryClient, ref: string, spec: ImageSpec): Promise<PushedImage> {
  const format = spec.format ?? "oci";
  const compression = spec.compression ?? "gzip";
  const platform = spec.platform ?? { os: "linux", architecture: "amd64" };
  const layers: Descriptor[] = [];
  const diffIds: string[] = [];
  for (const dir of spec.layers) {
    const { bytes, diffId } = await layerBlob(dir, compression);
    const d = await client.pushBlob(ref, bytes, { mediaType: layerMediaType(format, compression) });
    layers.push(d);
    diffIds.push(diffId);
  }
  return pushConfigAndManifest(client, ref, format, platform, layers, diffIds, spec.config);
}

/** The image's config (diff_ids, platform, run config) and its manifest over pushed layers. */
async function pushConfigAndManifest(client: RegistryClient, ref: string, format: "oci" | "docker", platform: Platform, layers: Descriptor[], diffIds: string[], run: ImageSpec["config"]): Promise<PushedImage> {
  const config = {
    architecture: platform.architecture,
    os: platform.os,
    ...(platform.variant ? { variant: platform.variant } : {}),
    config: { Env: ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"], ...run },
    rootfs: { type: "layers", diff_ids: diffIds },
    history: layers.map(() => ({ created: "1970-01-01T00:00:00Z", created_by: "aenv test harness" })),
  };
  const configType = format === "oci" ? MEDIA.ociConfig : MEDIA.dockerConfig;
  const cfg = await client.pushBlob(ref, new TextEncoder().encode(JSON.stringify(config)), { mediaType: configType });
  const mediaType = format === "oci" ? MEDIA.ociManifest : MEDIA.dockerManifest;
  const manifest = { schemaVersion: 2, mediaType, config: { mediaType: configType, digest: cfg.digest, size: cfg.size }, layers };
  const m = await client.pushManifest(ref, manifest, mediaType);
  return { ref, manifestDigest: m.digest, mediaType, configDigest: cfg.digest, layers, diffIds };
}

/**
 * A sealed overlaybd layer (bare LSMT, our sealedLayer) holding an ext4 file system of `root`'s
 * files, `sizeMB` virtual, made by `mke2fs -d` (no mount), with the converter's mkfs arguments.
 */
export async function overlaybdLayerOf(root: string, out: string, sizeMB: number): Promise<string> {
  const img = `${out}.ext4`;
  await run([Bun.which("mkfs.ext4", { PATH: `${process.env.PATH}:/usr/sbin:/sbin` }) ?? "mkfs.ext4", ...MKFS_ARGS, "-d", root, img, `${sizeMB}M`]);
  await sealedLayer(img, out);
  await rm(img, { force: true });
  return out;
}

/**
 * An overlaybd image as accelerated-container-image pushes one: each layer file (or bytes) a blob
 * with the tar media type whose `blob-digest` annotation is its own digest, `blob-size` and
 * `blob-fs-type` ext4; the config's diff_ids are the blobs' digests.
 */
export async function pushOverlaybdImage(client: RegistryClient, ref: string, spec: { layers: (string | Uint8Array)[]; config?: ImageSpec["config"] }): Promise<PushedImage> {
  const layers: Descriptor[] = [];
  for (const l of spec.layers) {
    const d = await client.pushBlob(ref, l, { mediaType: MEDIA.ociLayerTar });
    layers.push({ ...d, annotations: { [OVERLAYBD_ANNOTATION.blobDigest]: d.digest, [OVERLAYBD_ANNOTATION.blobSize]: String(d.size), [OVERLAYBD_ANNOTATION.fsType]: "ext4" } });
  }
  return pushConfigAndManifest(client, ref, "oci", { os: "linux", architecture: "amd64" }, layers, layers.map((d) => d.digest), spec.config);
}

/** Busybox's applets that the image links to /bin/busybox. */
export const BUSYBOX_APPLETS = ["sh", "ls", "cat", "env", "echo", "pwd", "mkdir", "rm", "cp", "mv", "test", "true", "false", "sleep", "id", "uname", "grep", "head", "wc", "stat"];

/** A root folder with /bin/busybox and its applet links, /work, /tmp (1777), /etc/passwd. */
export async function busyboxRoot(dir: string): Promise<string> {
  await mkdir(join(dir, "bin"), { recursive: true });
  await copyFile(BUSYBOX_BIN, join(dir, "bin/busybox"));
  await chmod(join(dir, "bin/busybox"), 0o755);
  for (const a of BUSYBOX_APPLETS) await symlink("busybox", join(dir, "bin", a));
  await mkdir(join(dir, "work"), { recursive: true });
  await mkdir(join(dir, "tmp"), { recursive: true });
  await chmod(join(dir, "tmp"), 0o1777);
  await mkdir(join(dir, "etc"), { recursive: true });
  await writeFile(join(dir, "etc/passwd"), "root:x:0:0:root:/root:/bin/sh\n");
  return dir;
}

export const BUSYBOX_CONFIG = { Env: ["PATH=/bin", "FOO=bar"], WorkingDir: "/work", Cmd: ["/bin/sh"] };

/** (a) The busybox image: one layer, Env FOO=bar, WorkingDir /work, Cmd /bin/sh. */
export async function pushBusyboxImage(client: RegistryClient, ref: string, o: { workDir: string; compression?: Compression; format?: "oci" | "docker"; platform?: Platform }): Promise<PushedImage> {
  const root = await busyboxRoot(join(o.workDir, "busybox-root"));
  return pushImage(client, ref, { layers: [root], compression: o.compression, format: o.format, platform: o.platform, config: BUSYBOX_CONFIG });
}

/** (b) Busybox plus one layer: /etc/second-layer ("two\n"), Env adds BAR=baz. */
export async function pushTwoLayerImage(client: RegistryClient, ref: string, o: { workDir: string; compression?: Compression }): Promise<PushedImage> {
  const root = await busyboxRoot(join(o.workDir, "busybox-root"));
  const top = join(o.workDir, "second-layer");
  await mkdir(join(top, "etc"), { recursive: true });
  await writeFile(join(top, "etc/second-layer"), "two\n");
  return pushImage(client, ref, { layers: [root, top], compression: o.compression, config: { ...BUSYBOX_CONFIG, Env: [...BUSYBOX_CONFIG.Env, "BAR=baz"] } });
}

/**
 * (c) Whiteouts: busybox, then a layer with /data/keep, /data/gone and /opaque/old, then a layer
 * with the whiteout /data/.wh.gone and the opaque marker /opaque/.wh..wh..opq plus /opaque/new.
 * Applied in order, /data holds keep only and /opaque holds new only.
 */
export async function pushWhiteoutImage(client: RegistryClient, ref: string, o: { workDir: string; compression?: Compression }): Promise<PushedImage> {
  const root = await busyboxRoot(join(o.workDir, "busybox-root"));
  const l1 = join(o.workDir, "files");
  await mkdir(join(l1, "data"), { recursive: true });
  await mkdir(join(l1, "opaque"), { recursive: true });
  await writeFile(join(l1, "data/keep"), "keep\n");
  await writeFile(join(l1, "data/gone"), "gone\n");
  await writeFile(join(l1, "opaque/old"), "old\n");
  const l2 = join(o.workDir, "whiteouts");
  await mkdir(join(l2, "data"), { recursive: true });
  await mkdir(join(l2, "opaque"), { recursive: true });
  await writeFile(join(l2, "data/.wh.gone"), "");
  await writeFile(join(l2, "opaque/.wh..wh..opq"), "");
  await writeFile(join(l2, "opaque/new"), "new\n");
  return pushImage(client, ref, { layers: [root, l1, l2], compression: o.compression, config: BUSYBOX_CONFIG });
}

/**
 * An index under ref naming pushed manifests with their platforms (all in ref's repository): OCI's,
 * or with `mediaType: MEDIA.dockerList` Docker's manifest list.
 */
export async function pushIndex(client: RegistryClient, ref: string, entries: { image: PushedImage; platform: Platform }[], o: { mediaType?: string } = {}): Promise<{ ref: string; digest: string }> {
  const mediaType = o.mediaType ?? MEDIA.ociIndex;
  const manifests = await Promise.all(
    entries.map(async (e) => {
      const m = await client.getManifest(e.image.ref);
      return { mediaType: e.image.mediaType, digest: m.digest, size: m.bytes.length, platform: e.platform };
    }),
  );
  const d = await client.pushManifest(ref, { schemaVersion: 2, mediaType, manifests }, mediaType);
  return { ref, digest: d.digest };
}

/** A layer blob already on disk: its file, the uncompressed tar's digest and its compression. */
export interface LayerFile {
  path: string;
  diffId: string;
  compression: Compression;
}

/** An image of layer blobs already made (lowest first) under ref. */
export async function pushLayerFiles(client: RegistryClient, ref: string, spec: { layers: LayerFile[]; config?: ImageSpec["config"]; format?: "oci" | "docker" }): Promise<PushedImage> {
  const format = spec.format ?? "oci";
  const layers: Descriptor[] = [];
  for (const l of spec.layers) layers.push(await client.pushBlob(ref, l.path, { mediaType: layerMediaType(format, l.compression) }));
  return pushConfigAndManifest(client, ref, format, { os: "linux", architecture: "amd64" }, layers, spec.layers.map((l) => l.diffId), spec.config);
}

// ---------------------------------------------------------------------------------------------
// A Debian bookworm minbase image: mmdebstrap's tar of the root (owners, modes, device nodes as
// dpkg left them), gzip'd, one layer. Built once from the Debian archive and kept in the guest
// cache under a name keyed by the mmdebstrap command, as base's cache is keyed by its definition:
// the archive moving on does not rebuild it (delete the file to pick up new package versions).

const DEBIAN_MIRROR = "http://deb.debian.org/debian";
const DEBIAN_ARGV = ["mmdebstrap", "--variant=minbase", "--mode=root", "--format=tar", "bookworm"];
const SBIN_PATH = `${process.env.PATH ?? ""}:/usr/local/sbin:/usr/sbin:/sbin`;

/** The image's run config: Env and a WorkingDir that base-files makes (/srv). */
export const DEBIAN_CONFIG = {
  Env: ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "IMAGE_KIND=debian-minbase"],
  WorkingDir: "/srv",
  Cmd: ["bash"],
};

function debianLayerPath(): string {
  const key = new Bun.CryptoHasher("sha256").update(JSON.stringify([...DEBIAN_ARGV, DEBIAN_MIRROR])).digest("hex").slice(0, 16);
  return join(guestCache(), "images", `debian-bookworm-minbase-${key}.tar.gz`);
}

/** Why the Debian image cannot be made here, or undefined when it is cached or can be built. */
export async function debianImageSkipReason(): Promise<string | undefined> {
  if (process.getuid?.() !== 0) return "needs root (mmdebstrap's root mode keeps the files' owners)";
  if (!Bun.which("mmdebstrap", { PATH: SBIN_PATH })) return "mmdebstrap is not installed (.ci/deps installs it)";
  if (existsSync(debianLayerPath()) && existsSync(`${debianLayerPath()}.diffid`)) return undefined;
  try {
    const r = await fetch(`${DEBIAN_MIRROR}/dists/bookworm/Release`, { method: "HEAD", signal: AbortSignal.timeout(10_000) });
    if (!r.ok) return `the Debian archive answered ${r.status} for bookworm's Release file (${DEBIAN_MIRROR})`;
  } catch (e) {
    return `the Debian archive is unreachable (${DEBIAN_MIRROR}: ${(e as Error).message})`;
  }
  return undefined;
}

/** The minbase layer (gzip'd tar), from the cache or built now (mmdebstrap: a minute or two). */
export async function debianMinbaseLayer(): Promise<LayerFile> {
  const path = debianLayerPath();
  if (existsSync(path) && existsSync(`${path}.diffid`)) return { path, diffId: (await readFile(`${path}.diffid`, "utf8")).trim(), compression: "gzip" };
  await mkdir(join(guestCache(), "images"), { recursive: true });
  const tmp = `${path}.${process.pid}-${randomBytes(4).toString("hex")}`;
  try {
    await runStep({ step: "bootstrap", argv: [...DEBIAN_ARGV, `${tmp}.tar`, DEBIAN_MIRROR], timeoutMs: STEP_TIMEOUT_MS.bootstrap });
    await run(["gzip", "-n", "-6", `${tmp}.tar`]);
    const diffId = await diffIdOf(`${tmp}.tar.gz`);
    // The digest file last: a blob without one is rebuilt.
    await writeFile(`${tmp}.diffid`, `${diffId}\n`);
    await rename(`${tmp}.tar.gz`, path);
    await rename(`${tmp}.diffid`, `${path}.diffid`);
    return { path, diffId, compression: "gzip" };
  } finally {
    for (const f of [`${tmp}.tar`, `${tmp}.tar.gz`, `${tmp}.diffid`]) await rm(f, { force: true });
  }
}
