// The registry client against a real registry (Debian's docker-registry on loopback, started
// here): image references, resolve (OCI and Docker manifests, an index's platforms), Basic auth,
// Docker's config file, Bearer tokens from a token server the registry trusts, blob downloads with
// their digest check, resume after a dropped connection, races on one destination, pushes.
import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { existsSync } from "node:fs";
import { mkdir, readdir, readFile, writeFile } from "node:fs/promises";
import { join } from "node:path";
import { RegistryClient, RegistryError, MEDIA, parseImageRef, type Descriptor } from "../../src/template/registry.ts";
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

describe.skipIf(!!skip)(suite("anonymous registry"), () => {
  const suiteOf = registrySuite("registry-anon");
  const client = new RegistryClient({ dockerConfigPath: null, retryBaseMs: 20 });
  let busybox: PushedImage;
  let dir: string;
  let reg: RegistryServer;

  beforeAll(async () => {
    ({ dir, reg } = suiteOf());
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
