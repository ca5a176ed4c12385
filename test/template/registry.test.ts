// The registry client against a real registry (Debian's docker-registry on loopback, started
// here): image references, resolve (OCI and Docker manifests, an index's platforms), Basic auth,
// Docker's config file, Bearer tokens from a token server the registry trusts, blob downloads with
// their digest check, resume after a dropped connection, races on one destination, pushes.
import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { randomBytes } from "node:crypto";
import { existsSync } from "node:fs";
import { mkdir, readFile, writeFile } from "node:fs/promises";
import { connect, createServer, type Server, type Socket } from "node:net";
import { networkInterfaces } from "node:os";
import { join } from "node:path";
import {
  type Descriptor,
  MEDIA,
  parseDockerConfig,
  parseImageRef,
  RegistryClient,
  RegistryError,
  selectPlatform,
} from "../../src/template/registry.ts";
import { parseChallenges } from "../../src/template/registry/auth.ts";
import { scratchDir, sha256 } from "../helpers/tmp.ts";
import {
  pushBusyboxImage,
  pushImage,
  pushIndex,
  pushTwoLayerImage,
  pushWhiteoutImage,
  registrySkipReason,
  startRegistry,
  registrySuite,
  type PushedImage,
  type RegistryServer,
  type TokenServer,
} from "./registry_harness.ts";

const skip = registrySkipReason();
const suite = (name: string) => (skip ? `${name} (skipped: ${skip})` : name);

async function rejection(p: Promise<unknown>): Promise<RegistryError> {
  const e = await p.then(
    () => undefined,
    (err) => err,
  );
  expect(e).toBeInstanceOf(RegistryError);
  return e as RegistryError;
}

describe("image references", () => {
  test.each([
    ["busybox", { registry: "docker.io", endpoint: "registry-1.docker.io", repository: "library/busybox", tag: "latest" }],
    ["team/app:1.2", { registry: "docker.io", endpoint: "registry-1.docker.io", repository: "team/app", tag: "1.2" }],
    ["index.docker.io/library/debian:bookworm", { registry: "docker.io", endpoint: "registry-1.docker.io", repository: "library/debian", tag: "bookworm" }],
    ["127.0.0.1:5000/a/b/c:t", { registry: "127.0.0.1:5000", endpoint: "127.0.0.1:5000", repository: "a/b/c", tag: "t" }],
    ["localhost/x", { registry: "localhost", endpoint: "localhost", repository: "x", tag: "latest" }],
    ["ghcr.io/o/r@sha256:" + "a".repeat(64), { registry: "ghcr.io", endpoint: "ghcr.io", repository: "o/r", digest: "sha256:" + "a".repeat(64) }],
    ["reg.example.com:8443/o/r:v1@sha256:" + "b".repeat(64), { registry: "reg.example.com:8443", endpoint: "reg.example.com:8443", repository: "o/r", tag: "v1", digest: "sha256:" + "b".repeat(64) }],
  ])("%s", (s, want) => {
    expect(parseImageRef(s)).toEqual(want as ReturnType<typeof parseImageRef>);
  });

  test.each(["", "UPPER/case", "a//b", "busybox:", "busybox@sha256:abc", "busybox@md5:" + "a".repeat(32), "-x/y", "host:port:/x", "a/b:t:t", "x".repeat(300), ":tag"])(
    "%p is BadReference (400)",
    (s) => {
      let err: unknown;
      try {
        parseImageRef(s);
      } catch (e) {
        err = e;
      }
      expect(err).toBeInstanceOf(RegistryError);
      expect((err as RegistryError).code).toBe("BadReference");
      expect((err as RegistryError).status).toBe(400);
    },
  );
});

describe("challenges, platforms, Docker's config file", () => {
  test("WWW-Authenticate: several challenges, quoted commas, unknown schemes dropped", () => {
    expect(parseChallenges('Bearer realm="https://auth.example/token",service="reg",scope="repository:a/b:pull,push"')).toEqual([
      { scheme: "bearer", params: { realm: "https://auth.example/token", service: "reg", scope: "repository:a/b:pull,push" } },
    ]);
    expect(parseChallenges('Negotiate abc, Basic realm="x y", Bearer realm=http://t/')).toEqual([
      { scheme: "basic", params: { realm: "x y" } },
      { scheme: "bearer", params: { realm: "http://t/" } },
    ]);
    expect(parseChallenges(null)).toEqual([]);
  });

  test("platform selection: variants, arm64's default v8, no-variant entries first", () => {
    const d = (architecture: string, variant?: string, n = 0): Descriptor => ({
      mediaType: MEDIA.ociManifest,
      digest: `sha256:${String(n).repeat(64).slice(0, 64)}`,
      size: 1,
      platform: { os: "linux", architecture, ...(variant ? { variant } : {}) },
    });
    const entries = [d("arm", "v6", 1), d("arm", "v7", 2), d("arm64", undefined, 3), d("amd64", "v3", 4), d("amd64", undefined, 5), d("386", undefined, 6)];
    expect(selectPlatform(entries, { os: "linux", architecture: "arm", variant: "v7" })?.digest).toBe(entries[1]!.digest);
    expect(selectPlatform(entries, { os: "linux", architecture: "arm" })?.digest).toBe(entries[1]!.digest);
    expect(selectPlatform(entries, { os: "linux", architecture: "arm64", variant: "v8" })?.digest).toBe(entries[2]!.digest);
    expect(selectPlatform(entries, { os: "linux", architecture: "amd64" })?.digest).toBe(entries[4]!.digest);
    expect(selectPlatform([entries[3]!], { os: "linux", architecture: "amd64" })?.digest).toBe(entries[3]!.digest);
    expect(selectPlatform(entries, { os: "windows", architecture: "amd64" })).toBeUndefined();
  });

  test("Docker's config file: base64 user:password per registry, Hub's old key, bad JSON is Unauthorized", () => {
    const auth = (s: string) => Buffer.from(s).toString("base64");
    const m = parseDockerConfig(
      JSON.stringify({ auths: { "https://index.docker.io/v1/": { auth: auth("hub:pw") }, "http://127.0.0.1:5000": { auth: auth("me:a:b") }, "ghcr.io": {} }, credsStore: "desktop" }),
      "config.json",
    );
    expect(m.get("docker.io")).toEqual({ username: "hub", password: "pw" });
    expect(m.get("127.0.0.1:5000")).toEqual({ username: "me", password: "a:b" });
    expect(m.has("ghcr.io")).toBe(false);
    let err: unknown;
    try {
      parseDockerConfig("{", "/x/config.json");
    } catch (e) {
      err = e;
    }
    expect((err as RegistryError).code).toBe("Unauthorized");
    expect((err as RegistryError).message).toContain("/x/config.json");
  });

});

describe.skipIf(!!skip)(suite("anonymous registry"), () => {
  const suiteOf = registrySuite("registry-anon");
  let client: RegistryClient;
  let busybox: PushedImage;
  let dir: string;
  let reg: RegistryServer;

  beforeAll(async () => {
    ({ dir, reg } = suiteOf());
    client = new RegistryClient({ dockerConfigPath: null, retryBaseMs: 20, insecureRegistries: suiteOf().insecure });
    busybox = await pushBusyboxImage(client, `${reg.host}/tests/busybox:1`, { workDir: join(dir, "bb") });
  });

  test("resolve: the busybox image's manifest, config and one gzip layer", async () => {
    const r = await client.resolve(busybox.ref);
    expect(r.manifestDigest).toBe(busybox.manifestDigest);
    expect(r.mediaType).toBe(MEDIA.ociManifest);
    expect(r.configDigest).toBe(busybox.configDigest);
    expect(r.config.Env).toContain("FOO=bar");
    expect(r.config.WorkingDir).toBe("/work");
    expect(r.config.Cmd).toEqual(["/bin/sh"]);
    expect(r.config.os).toBe("linux");
    expect(r.config.architecture).toBe("amd64");
    expect(r.config.diffIds).toEqual(busybox.diffIds);
    expect(r.layers.map((l) => [l.digest, l.size, l.mediaType])).toEqual(busybox.layers.map((l) => [l.digest, l.size, MEDIA.ociLayerGzip]));
    expect(r.overlaybdNative).toBe(false);
    expect(r.ref.digest).toBe(busybox.manifestDigest);
    expect(r.ref.tag).toBe("1");
    // Pinned by digest, the same image.
    const pinned = await client.resolve(`${reg.host}/tests/busybox@${busybox.manifestDigest}`);
    expect(pinned.manifestDigest).toBe(busybox.manifestDigest);
  });

  test("resolve: Docker schema 2 media types, zstd layers, two layers, whiteouts", async () => {
    const docker = await pushBusyboxImage(client, `${reg.host}/tests/busybox:docker`, { workDir: join(dir, "bb-docker"), format: "docker" });
    const r = await client.resolve(docker.ref);
    expect(r.mediaType).toBe(MEDIA.dockerManifest);
    expect(r.layers[0]!.mediaType).toBe(MEDIA.dockerLayerGzip);
    expect(r.config.Env).toContain("FOO=bar");

    const zstd = await pushBusyboxImage(client, `${reg.host}/tests/busybox:zstd`, { workDir: join(dir, "bb-zstd"), compression: "zstd" });
    const z = await client.resolve(zstd.ref);
    expect(z.layers[0]!.mediaType).toBe(MEDIA.ociLayerZstd);
    const out = join(dir, "zstd-layer");
    await client.fetchBlob(zstd.ref, z.layers[0]!, out);
    const tar = Bun.zstdDecompressSync(await readFile(out));
    expect(`sha256:${sha256(tar)}`).toBe(z.config.diffIds[0]!);

    const two = await pushTwoLayerImage(client, `${reg.host}/tests/two:1`, { workDir: join(dir, "two") });
    const t = await client.resolve(two.ref);
    expect(t.layers.length).toBe(2);
    expect(t.layers[0]!.digest).toBe(busybox.layers[0]!.digest);
    expect(t.config.Env).toContain("BAR=baz");

    const wh = await pushWhiteoutImage(client, `${reg.host}/tests/whiteout:1`, { workDir: join(dir, "wh") });
    const w = await client.resolve(wh.ref);
    expect(w.layers.length).toBe(3);
    const top = join(dir, "wh-top.tar.gz");
    await client.fetchBlob(wh.ref, w.layers[2]!, top);
    const list = Bun.spawnSync(["tar", "-tzf", top]).stdout.toString();
    expect(list).toContain("./data/.wh.gone");
    expect(list).toContain("./opaque/.wh..wh..opq");
  });

  test("an index: linux/amd64 by default, arm64/v8 when asked, NotFound naming what it has otherwise", async () => {
    const arm = await pushBusyboxImage(client, `${reg.host}/tests/multi:arm64`, { workDir: join(dir, "arm"), platform: { os: "linux", architecture: "arm64", variant: "v8" } });
    const x86 = await pushBusyboxImage(client, `${reg.host}/tests/multi:amd64`, { workDir: join(dir, "amd"), platform: { os: "linux", architecture: "amd64" } });
    const index = await pushIndex(client, `${reg.host}/tests/multi:1`, [
      { image: arm, platform: { os: "linux", architecture: "arm64", variant: "v8" } },
      { image: x86, platform: { os: "linux", architecture: "amd64" } },
    ]);
    const amd = await client.resolve(index.ref);
    expect(amd.manifestDigest).toBe(x86.manifestDigest);
    expect(amd.indexDigest).toBe(index.digest);
    const a = await client.resolve(index.ref, { platform: "linux/arm64" });
    expect(a.manifestDigest).toBe(arm.manifestDigest);
    expect(a.config.architecture).toBe("arm64");
    expect((await client.resolve(index.ref, { platform: "linux/arm64/v8" })).manifestDigest).toBe(arm.manifestDigest);
    const e = await rejection(client.resolve(index.ref, { platform: "linux/s390x" }));
    expect(e.code).toBe("NotFound");
    expect(e.status).toBe(404);
    expect(e.message).toContain("linux/arm64/v8, linux/amd64");
    // A single-platform image asked for another platform.
    const single = await rejection(client.resolve(busybox.ref, { platform: "linux/arm64" }));
    expect(single.code).toBe("NotFound");
  });

  test("a Docker manifest list: linux/amd64 by default, arm64/v8 when asked, its Docker schema 2 manifests and config", async () => {
    const arm = await pushBusyboxImage(client, `${reg.host}/tests/dlist:arm64`, { workDir: join(dir, "dl-arm"), format: "docker", platform: { os: "linux", architecture: "arm64", variant: "v8" } });
    const x86 = await pushBusyboxImage(client, `${reg.host}/tests/dlist:amd64`, { workDir: join(dir, "dl-amd"), format: "docker" });
    const list = await pushIndex(client, `${reg.host}/tests/dlist:1`, [
      { image: arm, platform: { os: "linux", architecture: "arm64", variant: "v8" } },
      { image: x86, platform: { os: "linux", architecture: "amd64" } },
    ], { mediaType: MEDIA.dockerList });
    // The registry serves it as the manifest list it is.
    expect((await client.getManifest(list.ref)).mediaType).toBe(MEDIA.dockerList);
    const amd = await client.resolve(list.ref);
    expect(amd.manifestDigest).toBe(x86.manifestDigest);
    expect(amd.indexDigest).toBe(list.digest);
    expect(amd.mediaType).toBe(MEDIA.dockerManifest);
    expect(amd.layers[0]!.mediaType).toBe(MEDIA.dockerLayerGzip);
    expect(amd.config).toMatchObject({ architecture: "amd64", WorkingDir: "/work" });
    const a = await client.resolve(list.ref, { platform: "linux/arm64/v8" });
    expect(a.manifestDigest).toBe(arm.manifestDigest);
    expect(a.config.architecture).toBe("arm64");
    const e = await rejection(client.resolve(list.ref, { platform: "linux/ppc64le" }));
    expect(e.code).toBe("NotFound");
    expect(e.message).toContain("linux/arm64/v8, linux/amd64");
  });

  test("an unknown repository or tag is NotFound (404) naming the image and registry", async () => {
    const repo = await rejection(client.resolve(`${reg.host}/tests/nothing-here:1`));
    expect(repo.code).toBe("NotFound");
    expect(repo.status).toBe(404);
    expect(repo.message).toContain(`${reg.host}/tests/nothing-here:1`);
    const tag = await rejection(client.resolve(`${reg.host}/tests/busybox:nope`));
    expect(tag.code).toBe("NotFound");
    expect(tag.message).toContain("manifest nope");
    expect(tag.message).toContain(reg.host);
  });

  test("unsupported layer media types are UnsupportedMediaType (415) naming the type; overlaybd blobs are native", async () => {
    const blob = await client.pushBlob(`${reg.host}/tests/odd`, new TextEncoder().encode("not a tar"));
    const cfg = await client.pushBlob(`${reg.host}/tests/odd`, new TextEncoder().encode(JSON.stringify({ os: "linux", architecture: "amd64", config: {}, rootfs: { type: "layers", diff_ids: [] } })));
    const manifest = (layers: Descriptor[]) => ({ schemaVersion: 2, mediaType: MEDIA.ociManifest, config: { mediaType: MEDIA.ociConfig, digest: cfg.digest, size: cfg.size }, layers });
    const odd = "application/vnd.example.layer.v1.squashfs";
    await client.pushManifest(`${reg.host}/tests/odd:squash`, manifest([{ ...blob, mediaType: odd }]), MEDIA.ociManifest);
    const e = await rejection(client.resolve(`${reg.host}/tests/odd:squash`));
    expect(e.code).toBe("UnsupportedMediaType");
    expect(e.status).toBe(415);
    expect(e.message).toContain(odd);

    const obd = { "containerd.io/snapshot/overlaybd/blob-digest": blob.digest, "containerd.io/snapshot/overlaybd/blob-size": String(blob.size) };
    await client.pushManifest(`${reg.host}/tests/odd:obd`, manifest([{ ...blob, mediaType: MEDIA.ociLayerTar, annotations: obd }]), MEDIA.ociManifest);
    const native = await client.resolve(`${reg.host}/tests/odd:obd`);
    expect(native.overlaybdNative).toBe(true);
    expect(native.layers[0]!.annotations).toEqual(obd);

    const gz = await client.pushBlob(`${reg.host}/tests/odd`, new Uint8Array(Bun.gzipSync(new Uint8Array(1024))), { mediaType: MEDIA.ociLayerGzip });
    await client.pushManifest(`${reg.host}/tests/odd:mixed`, manifest([{ ...blob, mediaType: MEDIA.ociLayerTar, annotations: obd }, gz]), MEDIA.ociManifest);
    const mixed = await rejection(client.resolve(`${reg.host}/tests/odd:mixed`));
    expect(mixed.code).toBe("UnsupportedMediaType");
    expect(mixed.message).toContain("all one kind");

    const wrapped = { ...obd, "containerd.io/snapshot/overlaybd/blob-digest": gz.digest };
    await client.pushManifest(`${reg.host}/tests/odd:wrapped`, manifest([{ ...blob, mediaType: MEDIA.ociLayerTar, annotations: wrapped }]), MEDIA.ociManifest);
    expect((await rejection(client.resolve(`${reg.host}/tests/odd:wrapped`))).message).toContain("wraps overlaybd blob");
  });
});

/**
 * A loopback TCP relay in front of a port. The first connection that carries more than cutAfter
 * bytes towards the client is cut there (both sides destroyed); every byte the client sent is
 * kept, so a test can see the Range header of the resume.
 */
async function startRelay(targetPort: number, cutAfter: number): Promise<{ port: number; sent: string[]; connections: () => number; cuts: () => number; stop: () => void }> {
  const sent: string[] = [];
  let connections = 0;
  let cuts = 0;
  const sockets = new Set<Socket>();
  const server: Server = createServer((client) => {
    connections++;
    const upstream = connect(targetPort, "127.0.0.1");
    sockets.add(client).add(upstream);
    let down = 0;
    client.on("data", (d: Buffer) => {
      sent.push(d.toString("latin1"));
      upstream.write(d);
    });
    upstream.on("data", (d: Buffer) => {
      if (cuts === 0 && down + d.length > cutAfter) {
        cuts++;
        client.write(d.subarray(0, cutAfter - down), () => {
          client.destroy();
          upstream.destroy();
        });
        down = cutAfter;
        return;
      }
      down += d.length;
      client.write(d);
    });
    const end = () => {
      client.destroy();
      upstream.destroy();
    };
    client.on("error", end).on("close", end);
    upstream.on("error", end).on("close", end);
  });
  await new Promise<void>((r) => server.listen(0, "127.0.0.1", r));
  const port = (server.address() as { port: number }).port;
  return {
    port,
    sent,
    connections: () => connections,
    cuts: () => cuts,
    stop: () => {
      for (const s of sockets) s.destroy();
      server.close();
    },
  };
}

describe.skipIf(!!skip)(suite("blob downloads"), () => {
  const suiteOf = registrySuite("registry-blobs");
  let client: RegistryClient;
  beforeAll(() => {
    client = new RegistryClient({ dockerConfigPath: null, retryBaseMs: 20, insecureRegistries: suiteOf().insecure });
  });
  const repo = () => `${suiteOf().reg.host}/tests/blobs`;
  const blobOf = async (bytes: number) => {
    const data = new Uint8Array(randomBytes(bytes));
    const desc = await client.pushBlob(repo(), data);
    return { data, desc };
  };

  test("a blob lands at dest whole and verified; progress ends at its size", async () => {
    const { data, desc } = await blobOf(3 << 20);
    const dest = join(suiteOf().dir, "whole.blob");
    const seen: number[] = [];
    const r = await client.fetchBlob(repo(), desc, dest, { onProgress: (b, t) => (expect(t).toBe(desc.size), seen.push(b)) });
    expect(r).toEqual({ path: dest, digest: desc.digest, size: desc.size, downloaded: desc.size });
    expect(sha256(await readFile(dest))).toBe(sha256(data));
    expect(seen.at(-1)).toBe(desc.size);
    expect(existsSync(`${dest}.partial`)).toBe(false);
    // Already there: verified again, nothing downloaded.
    expect((await client.fetchBlob(repo(), desc, dest)).downloaded).toBe(0);
  });

  test("bytes that do not match the digest are DigestMismatch, and nothing is left at dest", async () => {
    const { data, desc } = await blobOf(256 << 10);
    const stored = suiteOf().reg.blobDataPath(desc.digest);
    const bad = new Uint8Array(data);
    bad[1000] = bad[1000]! ^ 0xff;
    await writeFile(stored, bad);
    const dest = join(suiteOf().dir, "corrupt.blob");
    const e = await rejection(client.fetchBlob(repo(), desc, dest));
    expect(e.code).toBe("DigestMismatch");
    expect(e.status).toBe(502);
    expect(e.message).toContain(desc.digest);
    expect(existsSync(dest)).toBe(false);
    expect(existsSync(`${dest}.partial`)).toBe(false);
  });

  test("more bytes than the descriptor's size are TooLarge, and nothing is left at dest", async () => {
    const { desc } = await blobOf(64 << 10);
    const dest = join(suiteOf().dir, "short.blob");
    const e = await rejection(client.fetchBlob(repo(), { ...desc, size: desc.size - 10 }, dest));
    expect(e.code).toBe("TooLarge");
    expect(existsSync(dest)).toBe(false);
    expect(existsSync(`${dest}.partial`)).toBe(false);
  });

  test("a connection dropped mid-blob resumes with Range from where it stopped", async () => {
    const { data, desc } = await blobOf(4 << 20);
    const relay = await startRelay(suiteOf().reg.port, 1 << 20);
    try {
      const viaRelay = new RegistryClient({ dockerConfigPath: null, retryBaseMs: 20, insecureRegistries: [`127.0.0.1:${relay.port}`] });
      const dest = join(suiteOf().dir, "resumed.blob");
      const r = await viaRelay.fetchBlob(`127.0.0.1:${relay.port}/tests/blobs`, desc, dest);
      expect(relay.cuts()).toBe(1);
      expect(relay.connections()).toBeGreaterThanOrEqual(2);
      expect(sha256(await readFile(dest))).toBe(sha256(data));
      const ranges = relay.sent.join("").match(/range: bytes=(\d+)-/gi) ?? [];
      expect(ranges.length).toBe(1);
      const from = Number(/(\d+)-/.exec(ranges[0]!)![1]);
      expect(from).toBeGreaterThan(0);
      expect(from).toBeLessThan(1 << 20);
      // Only the rest came again.
      expect(r.downloaded).toBe(desc.size);
    } finally {
      relay.stop();
    }
  });

  test("a partial file left by an earlier run is re-hashed and continued; a bad one is replaced by a download from byte 0", async () => {
    const { data, desc } = await blobOf(1 << 20);
    const dest = join(suiteOf().dir, "continued.blob");
    await writeFile(`${dest}.partial`, data.subarray(0, 300_000));
    const r = await client.fetchBlob(repo(), desc, dest);
    expect(r.downloaded).toBe(desc.size - 300_000);
    expect(sha256(await readFile(dest))).toBe(sha256(data));

    const dest2 = join(suiteOf().dir, "bad-prefix.blob");
    await writeFile(`${dest2}.partial`, new Uint8Array(300_000));
    const r2 = await client.fetchBlob(repo(), desc, dest2);
    expect(r2.downloaded).toBe(desc.size - 300_000 + desc.size);
    expect(sha256(await readFile(dest2))).toBe(sha256(data));
    expect(existsSync(`${dest2}.partial`)).toBe(false);

    // With the registry's bytes wrong too, the second download ends in DigestMismatch and leaves nothing.
    const stored = suiteOf().reg.blobDataPath(desc.digest);
    await writeFile(stored, new Uint8Array(desc.size));
    const dest3 = join(suiteOf().dir, "bad-both.blob");
    await writeFile(`${dest3}.partial`, data.subarray(0, 300_000));
    const e = await rejection(client.fetchBlob(repo(), desc, dest3));
    expect(e.code).toBe("DigestMismatch");
    expect(existsSync(dest3)).toBe(false);
    expect(existsSync(`${dest3}.partial`)).toBe(false);
  });

  test("two fetches of one blob to one dest at once both succeed with one valid file", async () => {
    const { data, desc } = await blobOf(2 << 20);
    const dest = join(suiteOf().dir, "raced.blob");
    const other = new RegistryClient({ dockerConfigPath: null, insecureRegistries: suiteOf().insecure });
    const [a, b] = await Promise.all([client.fetchBlob(repo(), desc, dest), other.fetchBlob(repo(), desc, dest)]);
    expect(a.path).toBe(dest);
    expect(b.path).toBe(dest);
    expect(a.downloaded + b.downloaded).toBe(desc.size);
    expect(sha256(await readFile(dest))).toBe(sha256(data));
    expect(existsSync(`${dest}.partial`)).toBe(false);
  });

  test("a chunked push (PATCH per chunk) and a repeated push give the same descriptor", async () => {
    const chunked = new RegistryClient({ dockerConfigPath: null, chunkSize: 64 << 10, insecureRegistries: suiteOf().insecure });
    const file = join(suiteOf().dir, "upload.bin");
    const data = new Uint8Array(randomBytes((200 << 10) + 7));
    await writeFile(file, data);
    const d = await chunked.pushBlob(repo(), file);
    expect(d.digest).toBe(`sha256:${sha256(data)}`);
    expect(d.size).toBe(data.length);
    expect(await chunked.hasBlob(repo(), d.digest)).toBe(true);
    expect(await chunked.pushBlob(repo(), data)).toEqual(d);
    expect(sha256(await client.readBlob(repo(), d, 1 << 20))).toBe(sha256(data));
  });

  test("a manifest whose bytes do not match the digest asked for is DigestMismatch", async () => {
    const img = await pushBusyboxImage(client, `${repo()}:m`, { workDir: join(suiteOf().dir, "m") });
    const stored = suiteOf().reg.blobDataPath(img.manifestDigest);
    const text = await readFile(stored, "utf8");
    await writeFile(stored, text.replace('"schemaVersion":2', '"schemaVersion": 2'));
    const e = await rejection(client.resolve(`${repo()}@${img.manifestDigest}`));
    expect(e.code).toBe("DigestMismatch");
    expect(e.message).toContain(img.manifestDigest);
  });
});

const alice = { username: "alice", password: "s3cret-pass" };

describe.skipIf(!!skip)(suite("Basic auth (htpasswd) and Docker's config file"), () => {
  const suiteOf = registrySuite("registry-basic", { basicAuth: [alice] });
  let img: PushedImage;

  beforeAll(async () => {
    const { reg, dir } = suiteOf();
    const writer = new RegistryClient({ dockerConfigPath: null, credentials: { [reg.host]: alice }, insecureRegistries: suiteOf().insecure });
    img = await pushBusyboxImage(writer, `${reg.host}/private/busybox:1`, { workDir: join(dir, "bb") });
  });

  test("the right password resolves and fetches", async () => {
    const { reg, dir } = suiteOf();
    const c = new RegistryClient({ dockerConfigPath: null, credentials: { [reg.host]: alice }, insecureRegistries: suiteOf().insecure });
    const r = await c.resolve(img.ref);
    expect(r.manifestDigest).toBe(img.manifestDigest);
    expect(r.config.Env).toContain("FOO=bar");
    const f = await c.fetchBlob(img.ref, r.layers[0]!, join(dir, "layer"));
    expect(f.size).toBe(r.layers[0]!.size);
  });

  test("a wrong password, or none, is Unauthorized (401) naming the registry", async () => {
    const { reg } = suiteOf();
    const wrong = new RegistryClient({ dockerConfigPath: null, credentials: { [reg.host]: { ...alice, password: "nope" } }, insecureRegistries: suiteOf().insecure });
    const e = await rejection(wrong.resolve(img.ref));
    expect(e.code).toBe("Unauthorized");
    expect(e.status).toBe(401);
    expect(e.message).toContain(reg.host);
    expect(e.message).toContain("rejected the credentials");
    const none = await rejection(new RegistryClient({ dockerConfigPath: null, insecureRegistries: suiteOf().insecure }).resolve(img.ref));
    expect(none.code).toBe("Unauthorized");
    expect(none.message).toContain("needs credentials");
  });

  test("credentials from Docker's config file, named directly or by $DOCKER_CONFIG", async () => {
    const { reg, dir } = suiteOf();
    const cfgDir = join(dir, "docker-config");
    await mkdir(cfgDir, { recursive: true });
    const auth = Buffer.from(`${alice.username}:${alice.password}`).toString("base64");
    await writeFile(join(cfgDir, "config.json"), JSON.stringify({ auths: { [`http://${reg.host}`]: { auth }, "https://index.docker.io/v1/": { auth: "eDp5" } } }));
    const c = new RegistryClient({ dockerConfigPath: join(cfgDir, "config.json"), insecureRegistries: [reg.host] });
    expect((await c.resolve(img.ref)).manifestDigest).toBe(img.manifestDigest);

    const before = process.env.DOCKER_CONFIG;
    process.env.DOCKER_CONFIG = cfgDir;
    try {
      expect((await new RegistryClient({ insecureRegistries: [reg.host] }).resolve(img.ref)).manifestDigest).toBe(img.manifestDigest);
    } finally {
      if (before === undefined) delete process.env.DOCKER_CONFIG;
      else process.env.DOCKER_CONFIG = before;
    }
    // The caller's credentials win over the file's.
    const e = await rejection(new RegistryClient({ dockerConfigPath: join(cfgDir, "config.json"), credentials: { [reg.host]: { ...alice, password: "x" } }, insecureRegistries: [reg.host] }).resolve(img.ref));
    expect(e.code).toBe("Unauthorized");
  });
});

describe.skipIf(!!skip)(suite("Bearer tokens from a token server the registry trusts"), () => {
  const suiteOf = registrySuite("registry-token", { basicAuth: [alice], token: true });

  test("push and resolve with a token per scope, fetched once and then cached", async () => {
    const { reg, dir, tokens } = suiteOf();
    // The registry itself asks for a Bearer token from the token server.
    const bare = await fetch(`http://${reg.host}/v2/team/busybox/manifests/1`);
    expect(bare.status).toBe(401);
    expect(bare.headers.get("www-authenticate")).toStartWith(`Bearer realm="${tokens!.auth.realm}"`);
    const c = new RegistryClient({ dockerConfigPath: null, credentials: { [reg.host]: alice }, insecureRegistries: suiteOf().insecure });
    const img = await pushBusyboxImage(c, `${reg.host}/team/busybox:1`, { workDir: join(dir, "bb") });
    expect(tokens!.requests.some((r) => r.scope.includes("repository:team/busybox:pull,push") && r.user === "alice")).toBe(true);

    const reader = new RegistryClient({ dockerConfigPath: null, credentials: { [reg.host]: alice }, insecureRegistries: suiteOf().insecure });
    const r = await reader.resolve(img.ref);
    expect(r.manifestDigest).toBe(img.manifestDigest);
    expect(r.config.WorkingDir).toBe("/work");
    const after = tokens!.requests.length;
    await reader.resolve(img.ref);
    await reader.fetchBlob(img.ref, r.layers[0]!, join(dir, "layer"));
    expect(tokens!.requests.length).toBe(after);
  });

  test("a wrong password, or none, is Unauthorized at the token server", async () => {
    const { reg } = suiteOf();
    const wrong = await rejection(new RegistryClient({ dockerConfigPath: null, credentials: { [reg.host]: { ...alice, password: "no" } }, insecureRegistries: suiteOf().insecure }).resolve(`${reg.host}/team/busybox:1`));
    expect(wrong.code).toBe("Unauthorized");
    expect(wrong.status).toBe(401);
    expect(wrong.message).toContain("rejected the credentials of alice");
    const none = await rejection(new RegistryClient({ dockerConfigPath: null, insecureRegistries: suiteOf().insecure }).resolve(`${reg.host}/team/busybox:1`));
    expect(none.code).toBe("Unauthorized");
  });
});

describe.skipIf(!!skip)(suite("retries, timeouts, nesting"), () => {
  const suiteOf = registrySuite("registry-faults");

  test("5xx answers are retried with backoff; past the tries they are Unreachable (502)", async () => {
    const { reg, dir } = suiteOf();
    const writer = new RegistryClient({ dockerConfigPath: null, insecureRegistries: [reg.host] });
    await pushBusyboxImage(writer, `${reg.host}/tests/busybox:1`, { workDir: join(dir, "bb") });
    let failFirst = 2;
    let seen = 0;
    // A front that answers 503 to the first requests, then passes requests to the registry.
    const front = Bun.serve({
      hostname: "127.0.0.1",
      port: 0,
      async fetch(req) {
        seen++;
        if (failFirst-- > 0) return new Response("busy", { status: 503 });
        const u = new URL(req.url);
        return fetch(`http://${reg.host}${u.pathname}${u.search}`, { method: req.method, headers: req.headers });
      },
    });
    try {
      const c = new RegistryClient({ dockerConfigPath: null, retryBaseMs: 10, insecureRegistries: [`127.0.0.1:${front.port}`] });
      const r = await c.resolve(`127.0.0.1:${front.port}/tests/busybox:1`);
      expect(r.config.Env).toContain("FOO=bar");
      expect(seen).toBeGreaterThanOrEqual(4);
      failFirst = 1000;
      const e = await rejection(new RegistryClient({ dockerConfigPath: null, retryBaseMs: 10, tries: 3, insecureRegistries: [`127.0.0.1:${front.port}`] }).resolve(`127.0.0.1:${front.port}/tests/busybox:1`));
      expect(e.code).toBe("Unreachable");
      expect(e.status).toBe(502);
      expect(e.message).toContain("answered 503 (after 3 tries)");
    } finally {
      front.stop(true);
    }
  });

  test("a closed port is Unreachable (502); a registry that never answers is Timeout (504)", async () => {
    const closed = Bun.listen({ hostname: "127.0.0.1", port: 0, socket: { data() {} } });
    const port = closed.port;
    closed.stop(true);
    const e = await rejection(new RegistryClient({ dockerConfigPath: null, retryBaseMs: 10, tries: 2, insecureRegistries: [`127.0.0.1:${port}`] }).resolve(`127.0.0.1:${port}/x/y:1`));
    expect(e.code).toBe("Unreachable");
    expect(e.message).toContain(`127.0.0.1:${port}`);

    const silent = Bun.listen({ hostname: "127.0.0.1", port: 0, socket: { data() {} } });
    try {
      const t = await rejection(new RegistryClient({ dockerConfigPath: null, retryBaseMs: 10, tries: 2, timeoutMs: 300, insecureRegistries: [`127.0.0.1:${silent.port}`] }).resolve(`127.0.0.1:${silent.port}/x/y:1`));
      expect(t.code).toBe("Timeout");
      expect(t.status).toBe(504);
      expect(t.message).toContain("did not answer in time (after 2 tries)");
    } finally {
      silent.stop(true);
    }
  });

  test("indexes nested 4 deep resolve; 5 deep is Protocol", async () => {
    const { reg, dir } = suiteOf();
    const c = new RegistryClient({ dockerConfigPath: null, insecureRegistries: [reg.host] });
    const img = await pushBusyboxImage(c, `${reg.host}/tests/nest:leaf`, { workDir: join(dir, "nest") });
    const leaf = await c.getManifest(img.ref);
    let child: { mediaType: string; digest: string; size: number } = { mediaType: MEDIA.ociManifest, digest: leaf.digest, size: leaf.bytes.length };
    const tops: string[] = [];
    for (let depth = 1; depth <= 5; depth++) {
      const index = { schemaVersion: 2, mediaType: MEDIA.ociIndex, manifests: [{ ...child, platform: { os: "linux", architecture: "amd64" } }] };
      const d = await c.pushManifest(`${reg.host}/tests/nest:depth${depth}`, index, MEDIA.ociIndex);
      child = { mediaType: MEDIA.ociIndex, digest: d.digest, size: d.size };
      tops.push(`${reg.host}/tests/nest:depth${depth}`);
    }
    expect((await c.resolve(tops[3]!)).manifestDigest).toBe(leaf.digest);
    const e = await rejection(c.resolve(tops[4]!));
    expect(e.code).toBe("Protocol");
    expect(e.message).toContain("deeper than 4");
  });
});

describe.skipIf(!!skip)(suite("https and credentials stay where they belong"), () => {
  test("a realm or redirect to plain http of an unlisted host is Forbidden (403) before any connection", async () => {
    const front = Bun.serve({
      hostname: "127.0.0.1",
      port: 0,
      fetch(req) {
        const u = new URL(req.url);
        if (u.pathname.includes("/manifests/")) return new Response("", { status: 401, headers: { "www-authenticate": 'Bearer realm="http://192.0.2.1/token",service="x"' } });
        return new Response(null, { status: 307, headers: { location: "http://192.0.2.1/blob" } });
      },
    });
    try {
      const listed = [`127.0.0.1:${front.port}`];
      const c = new RegistryClient({ dockerConfigPath: null, tries: 1, insecureRegistries: listed });
      const realm = await rejection(c.resolve(`127.0.0.1:${front.port}/x/y:1`));
      expect(realm.code).toBe("Forbidden");
      expect(realm.status).toBe(403);
      expect(realm.message).toContain("refusing http://192.0.2.1");
      const desc = { mediaType: MEDIA.ociLayerGzip, digest: `sha256:${"0".repeat(64)}`, size: 1 };
      // A fresh client: this one remembers the bad realm.
      const redirect = await rejection(new RegistryClient({ dockerConfigPath: null, tries: 1, insecureRegistries: listed }).readBlob(`127.0.0.1:${front.port}/x/y:1`, desc));
      expect(redirect.code).toBe("Forbidden");
      expect(redirect.message).toContain("refusing http://192.0.2.1");
      expect(redirect.message).toContain(`blob ${desc.digest}`);
    } finally {
      front.stop(true);
    }
  });

  test("a redirect to another origin gets the blob without the Authorization header", async () => {
    const body = new TextEncoder().encode("blob bytes behind a redirect");
    const digest = `sha256:${sha256(body)}`;
    const authorizations: (string | null)[] = [];
    const cdn = Bun.serve({
      hostname: "127.0.0.1",
      port: 0,
      fetch(req) {
        authorizations.push(req.headers.get("authorization"));
        return new Response(body);
      },
    });
    const registry = Bun.serve({
      hostname: "127.0.0.1",
      port: 0,
      fetch(req) {
        if (req.headers.get("authorization") !== `Basic ${Buffer.from("alice:pw").toString("base64")}`) {
          return new Response("", { status: 401, headers: { "www-authenticate": 'Basic realm="r"' } });
        }
        return new Response(null, { status: 307, headers: { location: `http://localhost:${cdn.port}/data` } });
      },
    });
    try {
      const c = new RegistryClient({ dockerConfigPath: null, credentials: { [`127.0.0.1:${registry.port}`]: { username: "alice", password: "pw" } }, insecureRegistries: [`127.0.0.1:${registry.port}`, `localhost:${cdn.port}`] });
      const got = await c.readBlob(`127.0.0.1:${registry.port}/x/y`, { mediaType: "application/octet-stream", digest, size: body.length });
      expect(new TextDecoder().decode(got)).toBe("blob bytes behind a redirect");
      expect(authorizations).toEqual([null]);
    } finally {
      registry.stop(true);
      cdn.stop(true);
    }
  });
});

/** A loopback server that records each request (`METHOD /path`) and answers with `answer`. */
function recordingServer(answer: (req: Request) => Response) {
  const seen: string[] = [];
  const server = Bun.serve({
    hostname: "127.0.0.1",
    port: 0,
    fetch(req) {
      seen.push(`${req.method} ${new URL(req.url).pathname}`);
      return answer(req);
    },
  });
  return { host: `127.0.0.1:${server.port}`, port: server.port, seen, stop: () => server.stop(true) };
}

describe("registries at internal addresses: only those listed in insecure_registries", () => {
  const data = new TextEncoder().encode("data");
  const desc = { mediaType: "application/octet-stream", digest: `sha256:${sha256(data)}`, size: data.length };

  test("an unlisted loopback registry is Forbidden (403) naming the setting; nothing is sent to it", async () => {
    const reg = recordingServer(() => new Response("{}", { status: 404 }));
    try {
      for (const ref of [`${reg.host}/x/y:1`, `localhost:${reg.port}/x/y:1`]) {
        const e = await rejection(new RegistryClient({ dockerConfigPath: null, tries: 1 }).resolve(ref));
        expect({ ref, code: e.code, status: e.status }).toEqual({ ref, code: "Forbidden", status: 403 });
        expect(e.message).toContain("a loopback address (127.0.0.1)");
        expect(e.message).toContain("listed in insecure_registries (AENV_INSECURE_REGISTRIES)");
      }
      // Another port of the same host is another registry.
      const other = await rejection(new RegistryClient({ dockerConfigPath: null, tries: 1, insecureRegistries: ["127.0.0.1:1"] }).readBlob(`${reg.host}/x/y`, desc));
      expect(other.code).toBe("Forbidden");
      expect(reg.seen).toEqual([]);
    } finally {
      reg.stop();
    }
  });

  test("a listed one (host:port, or the host for any port) is spoken to over plain http", async () => {
    const reg = recordingServer(() => Response.json({ errors: [{ code: "MANIFEST_UNKNOWN" }] }, { status: 404 }));
    try {
      for (const listed of [reg.host, "127.0.0.1"]) {
        const e = await rejection(new RegistryClient({ dockerConfigPath: null, tries: 1, insecureRegistries: [listed] }).resolve(`${reg.host}/x/y:1`));
        expect({ listed, code: e.code }).toEqual({ listed, code: "NotFound" });
      }
      expect(reg.seen).toEqual(["GET /v2/x/y/manifests/1", "GET /v2/x/y/manifests/1"]);
    } finally {
      reg.stop();
    }
  });

  test("a listed registry's redirect to an unlisted loopback port, or anywhere internal, is Forbidden and never followed", async () => {
    const target = recordingServer(() => new Response(data));
    let location = "";
    const reg = recordingServer(() => new Response(null, { status: 307, headers: { location } }));
    const own = Object.values(networkInterfaces()).flat().find((a) => a && a.family === "IPv4" && !a.internal)?.address;
    try {
      const c = new RegistryClient({ dockerConfigPath: null, tries: 1, insecureRegistries: [reg.host] });
      const internal = [`http://${target.host}/blob`, `https://${target.host}/blob`, `http://localhost:${target.port}/blob`, "https://169.254.169.254/latest/meta-data",
        "https://[::1]:1/x", "https://[fe80::1]/x", "https://0.0.0.0/x", "https://[::ffff:127.0.0.1]/x", ...(own ? [`https://${own}/x`] : [])];
      for (location of internal) {
        const e = await rejection(c.readBlob(`${reg.host}/x/y`, desc));
        expect({ location, code: e.code, status: e.status }).toEqual({ location, code: "Forbidden", status: 403 });
        expect(e.message).toContain(`refusing ${new URL(location).origin}`);
      }
      expect(target.seen).toEqual([]);
      // Listed too, it is followed.
      location = `http://${target.host}/blob`;
      const both = new RegistryClient({ dockerConfigPath: null, tries: 1, insecureRegistries: [reg.host, target.host] });
      expect(new TextDecoder().decode(await both.readBlob(`${reg.host}/x/y`, desc))).toBe("data");
      expect(target.seen).toEqual(["GET /blob"]);
    } finally {
      reg.stop();
      target.stop();
    }
  });

  test("an upload Location at an unlisted loopback port is Forbidden: the blob never goes there", async () => {
    const target = recordingServer(() => new Response(null, { status: 201 }));
    const reg = recordingServer((req) => (req.method === "HEAD" ? new Response(null, { status: 404 }) : new Response(null, { status: 202, headers: { location: `http://${target.host}/upload/1` } })));
    try {
      const c = new RegistryClient({ dockerConfigPath: null, tries: 1, insecureRegistries: [reg.host] });
      const e = await rejection(c.pushBlob(`${reg.host}/x/y`, data));
      expect({ code: e.code, status: e.status }).toEqual({ code: "Forbidden", status: 403 });
      expect(e.message).toContain(`upload Location: refusing http://${target.host}`);
      expect(target.seen).toEqual([]);
      expect(reg.seen).toEqual([`HEAD /v2/x/y/blobs/${desc.digest}`, "POST /v2/x/y/blobs/uploads/"]);
    } finally {
      reg.stop();
      target.stop();
    }
  });

  test("a Bearer realm at an unlisted loopback port is Forbidden: the credentials never go there", async () => {
    const realm = recordingServer(() => Response.json({ token: "t" }));
    const reg = recordingServer(() => new Response("", { status: 401, headers: { "www-authenticate": `Bearer realm="http://${realm.host}/token",service="x"` } }));
    try {
      const c = new RegistryClient({ dockerConfigPath: null, tries: 1, insecureRegistries: [reg.host], credentials: { [reg.host]: alice } });
      const e = await rejection(c.resolve(`${reg.host}/x/y:1`));
      expect({ code: e.code, status: e.status }).toEqual({ code: "Forbidden", status: 403 });
      expect(e.message).toContain(`refusing http://${realm.host}`);
      expect(realm.seen).toEqual([]);
    } finally {
      reg.stop();
      realm.stop();
    }
  });
});

describe("blob bounds: max_blob_mb and the descriptor's size", () => {
  const dir = scratchDir("blob-bounds");
  test("a descriptor above maxBlobBytes is TooLarge naming max_blob_mb, before any request", async () => {
    const reg = recordingServer(() => new Response("x"));
    try {
      const c = new RegistryClient({ dockerConfigPath: null, tries: 1, insecureRegistries: [reg.host], maxBlobBytes: 1 << 20 });
      const dest = join(dir, "big.blob");
      const e = await rejection(c.fetchBlob(`${reg.host}/x/y`, { mediaType: "application/octet-stream", digest: `sha256:${"2".repeat(64)}`, size: (1 << 20) + 1 }, dest));
      expect({ code: e.code, status: e.status }).toEqual({ code: "TooLarge", status: 502 });
      expect(e.message).toContain("more than this node's max_blob_mb (1048576 bytes)");
      expect(reg.seen).toEqual([]);
      expect(existsSync(`${dest}.partial`)).toBe(false);
    } finally {
      reg.stop();
    }
  });

  test("a Content-Length past the descriptor's size is TooLarge before the body is read; a body without one is cut at the size", async () => {
    const MiB = 1 << 20;
    let produced = 0;
    let chunked = false;
    const reg = recordingServer(() => {
      if (!chunked) return new Response(new Uint8Array(8 * MiB));
      // No Content-Length: 64 KiB at a time, up to 256 MiB, as fast as it is read.
      return new Response(new ReadableStream({
        pull(ctl) {
          if (produced >= 256 * MiB) return ctl.close();
          produced += 64 << 10;
          ctl.enqueue(new Uint8Array(64 << 10));
        },
      }));
    });
    try {
      const c = new RegistryClient({ dockerConfigPath: null, tries: 1, insecureRegistries: [reg.host] });
      const desc = { mediaType: "application/octet-stream", digest: `sha256:${"3".repeat(64)}`, size: MiB };
      const announced = await rejection(c.fetchBlob(`${reg.host}/x/y`, desc, join(dir, "announced.blob")));
      expect(announced.code).toBe("TooLarge");
      expect(announced.message).toContain(`announced ${8 * MiB} bytes from byte 0, past the ${MiB} bytes the manifest names`);
      chunked = true;
      const streamed = await rejection(c.fetchBlob(`${reg.host}/x/y`, desc, join(dir, "streamed.blob")));
      expect(streamed.code).toBe("TooLarge");
      expect(streamed.message).toContain(`sent more than the ${MiB} bytes the manifest names`);
      expect(produced).toBeLessThan(64 * MiB);
      expect(existsSync(join(dir, "streamed.blob.partial"))).toBe(false);
    } finally {
      reg.stop();
    }
  });
});
