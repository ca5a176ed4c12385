// Templates in S3 (no VM; the two-node run is test/node/remote_s3.test.ts): pushImage writes an OCI
// image layout under s3://bucket/prefix (oci-layout, index.json last, blobs/sha256/<hex>) with the
// same manifest, config and layer blobs a registry gets; pullImage reads it back whole or lazily
// (remote refs whose S3 origin carries no credentials, reading only headers and indexes); blockd
// reads such a layer once the node's credentials are added at use; bad locations and layouts are
// named errors with their status.
import { afterAll, describe, expect, test } from "bun:test";
import { S3Client } from "bun";
import { randomBytes } from "node:crypto";
import { existsSync, mkdirSync, statSync, writeFileSync } from "node:fs";
import { rm } from "node:fs/promises";
import { join } from "node:path";
import { nodeImages, remoteLayerView, type NodeRemoteLayers } from "../../src/node/images.ts";
import { createApi } from "../../src/api/app.ts";
import { templateRoutes } from "../../src/api/templates.ts";
import { TemplateBuilder } from "../../src/orchestrator/builder.ts";
import type { Orchestrator } from "../../src/orchestrator/orchestrator.ts";
import { SandboxStore } from "../../src/orchestrator/store.ts";
import { type RemoteLayer, TemplateStore } from "../../src/orchestrator/templates.ts";
import { LayerCache } from "../../src/template/layer_cache.ts";
import { pullImage, type RemoteLayerRef } from "../../src/template/pull.ts";
import { pushImage } from "../../src/template/push.ts";
import { PREFETCH_ROOTFS_ANNOTATION, PREFETCH_ROOTFS_SIZE_ANNOTATION } from "../../src/template/prefetch_trace.ts";
import { MEDIA, OVERLAYBD_ANNOTATION, RegistryClient, RegistryError } from "../../src/template/registry.ts";
import { parseS3Location, REF_NAME_ANNOTATION, S3Layout, type S3Access } from "../../src/template/s3_layout.ts";
import type { BlockdClient } from "../../src/blockdev/client.ts";
import type { OriginSpec } from "../../src/storage/remote/spec.ts";
import { encodeTrace } from "../../src/storage/trace_file.ts";
import { haveFuse, startBlockd } from "../blockdev/harness.ts";
import { scratchDir } from "../helpers/tmp.ts";
import { requestLog, startS3Server, type TestS3 } from "../snapshot/s3_server.ts";
import { busyboxRoot, overlaybdLayerOf, registrySkipReason, startRegistry } from "./registry_harness.ts";

const SBIN = "/usr/local/sbin:/usr/sbin:/sbin";
const mkfs = Bun.which("mkfs.ext4", { PATH: `${process.env.PATH}:${SBIN}` });
const skip = !existsSync("/bin/busybox") ? "busybox-static is not installed" : !mkfs ? "mkfs.ext4 (e2fsprogs) is missing" : undefined;
const debugfs = Bun.which("debugfs", { PATH: `${process.env.PATH}:${SBIN}` });
const MiB = 2 ** 20;
/** A never-read file: the layer is much larger than a lazy pull's headers and indexes. */
const FILLER_MIB = 24;
const BUCKET = "templates";
const LOCATION = `s3://${BUCKET}/team/app:1`;
const config = { env: { FOO: "bar", PATH: "/bin" }, user: "root", workdir: "/work" };
/** No blockd is needed where the layers stay remote or are overlaybd blobs (nothing is converted). */
const noBlockd = undefined as unknown as BlockdClient;

async function catFile(device: string, path: string): Promise<string> {
  const p = Bun.spawn([debugfs!, "-R", `cat ${path}`, device], { stdout: "pipe", stderr: "pipe" });
  const [out, err, code] = await Promise.all([new Response(p.stdout).text(), new Response(p.stderr).text(), p.exited]);
  if (code !== 0) throw new Error(`debugfs cat ${path}: exit ${code}: ${err}`);
  return out;
}

const errorOf = async (p: Promise<unknown>) => {
  const e = await p.then(() => undefined, (x: unknown) => x);
  expect(e).toBeInstanceOf(RegistryError);
  return { code: (e as RegistryError).code, status: (e as RegistryError).status, message: (e as RegistryError).message };
};

test("parseS3Location: bucket, prefix, optional tag; anything else is BadReference", () => {
  expect(parseS3Location("s3://templates/team/app:1")).toEqual({ bucket: "templates", prefix: "team/app", tag: "1" });
  expect(parseS3Location("s3://templates/team/app/")).toEqual({ bucket: "templates", prefix: "team/app" });
  expect(parseS3Location("s3://templates")).toEqual({ bucket: "templates", prefix: "" });
  expect(parseS3Location("s3://templates/:v2")).toEqual({ bucket: "templates", prefix: "", tag: "v2" });
  for (const bad of ["s3://", "s3://UP/x", "s3://ab/x", "s3://templates/../x", "s3://templates/./x", "s3://templates:1", "s3://templates/a b", "s3://templates/x:", "s3://templates/x:-bad", "http://templates/x", `s3://templates/${"a".repeat(1100)}`]) {
    let e: unknown;
    try {
      parseS3Location(bad);
    } catch (x) {
      e = x;
    }
    expect({ bad, code: (e as RegistryError)?.code, status: (e as RegistryError)?.status }).toEqual({ bad, code: "BadReference", status: 400 });
  }
});

describe.skipIf(!!skip)("templates in S3 as an OCI image layout", async () => {
  if (skip) return void test.skip(skip!, () => {});
  const dir = scratchDir("s3-layout", { keep: true });
  const log = join(dir, "s3.log");
  const s3: TestS3 = await startS3Server(join(dir, "s3"), 30_000, { buckets: [BUCKET], log });
  const access: S3Access = { endpoint: s3.endpoint, region: "us-east-1", accessKeyId: "S3RVER", secretAccessKey: "S3RVER" };
  const raw = new S3Client({ bucket: BUCKET, ...access });
  const medium = randomBytes(2 * MiB).toString("hex");
  let layer = "";
  let layerDigest = "";
  let manifestDigest = "";
  /** Bytes GET answered for one key. */
  const served = async (key: string) => (await requestLog(log)).filter((r) => r.method === "GET" && r.path === `/${BUCKET}/${key}`).reduce((n, r) => n + r.bytes, 0);

  afterAll(async () => {
    await s3.stop();
    await rm(dir, { recursive: true, force: true });
  });

  test("push: oci-layout, index.json naming the manifest with its tag, blobs/sha256/<hex> for manifest, config and layer; a second push sends no blob", async () => {
    const root = await busyboxRoot(join(dir, "root"));
    writeFileSync(join(root, "etc/motd"), "hello from S3\n");
    mkdirSync(join(root, "data"));
    writeFileSync(join(root, "data/filler"), randomBytes(FILLER_MIB * MiB));
    writeFileSync(join(root, "data/medium"), medium);
    layer = await overlaybdLayerOf(root, join(dir, "root.layer"), 128);
    layerDigest = `sha256:${new Bun.CryptoHasher("sha256").update(await Bun.file(layer).bytes()).digest("hex")}`;

    const pushed = await pushImage(S3Layout.open(LOCATION, access), [layer], config, { workDir: dir });
    expect(pushed.ref).toBe(LOCATION);
    expect(pushed.layers).toEqual([{ digest: layerDigest, size: statSync(layer).size, uploaded: true }]);
    manifestDigest = pushed.manifestDigest;
    const blob = (d: string) => `team/app/blobs/sha256/${d.slice(7)}`;
    expect(JSON.parse(await raw.file("team/app/oci-layout").text())).toEqual({ imageLayoutVersion: "1.0.0" });
    const index = JSON.parse(await raw.file("team/app/index.json").text());
    expect(index.schemaVersion).toBe(2);
    expect(index.mediaType).toBe(MEDIA.ociIndex);
    expect(index.manifests).toHaveLength(1);
    expect(index.manifests[0].mediaType).toBe(MEDIA.ociManifest);
    expect(index.manifests[0].digest).toBe(manifestDigest);
    expect(index.manifests[0].annotations).toEqual({ [REF_NAME_ANNOTATION]: "1" });
    const manifestBytes = await raw.file(blob(manifestDigest)).bytes();
    expect(`sha256:${new Bun.CryptoHasher("sha256").update(manifestBytes).digest("hex")}`).toBe(manifestDigest);
    const manifest = JSON.parse(new TextDecoder().decode(manifestBytes));
    expect(manifest.layers).toEqual([{
      mediaType: MEDIA.ociLayerTar, digest: layerDigest, size: statSync(layer).size,
      annotations: { [OVERLAYBD_ANNOTATION.blobDigest]: layerDigest, [OVERLAYBD_ANNOTATION.blobSize]: String(statSync(layer).size), [OVERLAYBD_ANNOTATION.fsType]: "ext4" },
    }]);
    expect(manifest.config.digest).toBe(pushed.configDigest);
    const cfg = JSON.parse(await raw.file(blob(pushed.configDigest)).text());
    expect(cfg).toMatchObject({ architecture: "amd64", os: "linux", config: { Env: ["FOO=bar", "PATH=/bin"], WorkingDir: "/work", User: "root" }, rootfs: { diff_ids: [layerDigest] } });
    expect((await raw.file(blob(layerDigest)).stat()).size).toBe(statSync(layer).size);
    expect(new Bun.CryptoHasher("sha256").update(await raw.file(blob(layerDigest)).bytes()).digest("hex")).toBe(layerDigest.slice(7));
    // index.json is the push's last write.
    const puts = (await requestLog(log)).filter((r) => r.method === "PUT" || r.method === "POST");
    expect(puts.at(-1)!.path).toBe(`/${BUCKET}/team/app/index.json`);

    // The same layers again: HEAD finds every blob; only the manifest, oci-layout and index.json are written.
    const before = (await requestLog(log)).length;
    const again = await pushImage(S3Layout.open(LOCATION, access), [layer], config, { workDir: dir });
    expect(again.layers.map((l) => l.uploaded)).toEqual([false]);
    expect(again.manifestDigest).toBe(manifestDigest);
    const writes = (await requestLog(log)).slice(before).filter((r) => r.method === "PUT" || r.method === "POST").map((r) => r.path);
    expect(writes.some((p) => p.includes(layerDigest.slice(7)))).toBe(false);

    // With a boot trace: one more blob, named by the manifest's annotations (push checks the file whole; blockd its fit to the device).
    const traceFile = join(dir, "boot.trace");
    const traceBytes = encodeTrace({ size: 64 << 20, granule: 64 << 10, entries: new Uint32Array([0, 7, 3]) });
    writeFileSync(traceFile, traceBytes);
    const traceDigest = `sha256:${new Bun.CryptoHasher("sha256").update(traceBytes).digest("hex")}`;
    const traced = await pushImage(S3Layout.open(`s3://${BUCKET}/team/traced:1`, access), [layer], config, { workDir: dir, rootfsTrace: traceFile });
    expect(traced.trace).toEqual({ digest: traceDigest, size: traceBytes.length, uploaded: true });
    expect(await raw.file(`team/traced/blobs/sha256/${traceDigest.slice(7)}`).bytes()).toEqual(traceBytes);
    const tracedImage = await S3Layout.open(`s3://${BUCKET}/team/traced:1`, access).resolve({ os: "linux", architecture: "amd64" });
    expect(tracedImage.annotations).toEqual({ [PREFETCH_ROOTFS_ANNOTATION]: traceDigest, [PREFETCH_ROOTFS_SIZE_ANNOTATION]: String(traceBytes.length) });
    expect(tracedImage.layers.map((l) => l.digest)).toEqual([layerDigest]);
  }, 120_000);

  test.skipIf(!!registrySkipReason())("one image, byte-identical in a registry and in S3: the same manifest digest", async () => {
    const reg = await startRegistry({ dir: join(dir, "registry") });
    try {
      const pushed = await pushImage(`${reg.host}/team/app:1`, [layer], config, { registry: new RegistryClient({ dockerConfigPath: null, insecureRegistries: [reg.host] }), workDir: dir });
      expect(pushed.manifestDigest).toBe(manifestDigest);
    } finally {
      await reg.stop();
    }
  }, 120_000);

  /** The lazily pulled layer as the node's view hands it to blockd (set by the lazy pull test). */
  let lazyView: Awaited<ReturnType<typeof remoteLayerView>> | undefined;
  test("lazy pull: remote refs with S3 origins that carry no credentials; only headers and indexes are read", async () => {
    const cacheDir = join(dir, "block-cache");
    const before = await served(`team/app/blobs/sha256/${layerDigest.slice(7)}`);
    const pulled = await pullImage(S3Layout.open(LOCATION, access), { cache: new LayerCache(join(dir, "layers")), blockd: noBlockd, remote: { cache: { dir: cacheDir, capacity: 1024 * MiB }, download: false } });
    expect(pulled).toMatchObject({ overlaybdNative: true, diskSizeMB: 128, manifestDigest, config: { env: { FOO: "bar" }, workingDir: "/work", user: "root" } });
    expect(pulled.ref).toBe(`${LOCATION}@${manifestDigest}`);
    const l = pulled.layers[0] as RemoteLayerRef;
    expect(l.digest).toBe(layerDigest as `sha256:${string}`);
    expect(l.remote.sources).toEqual([{ kind: "s3", bucket: BUCKET, key: `team/app/blobs/sha256/${layerDigest.slice(7)}`, endpoint: s3.endpoint, region: "us-east-1" }]);
    expect(JSON.stringify(l)).not.toContain("S3RVER");
    const read = (await served(`team/app/blobs/sha256/${layerDigest.slice(7)}`)) - before;
    expect(read).toBeGreaterThan(0);
    expect(read).toBeLessThan(l.size / 4);
    console.log(`S3 layer ${(l.size / MiB).toFixed(1)} MiB: a lazy pull read ${(read / MiB).toFixed(2)} MiB of it`);

    // The node's view adds its credentials at each use.
    const r = { cache: { dir: cacheDir, capacity: 1024 * MiB }, download: false, auth: { fileFor: async () => undefined }, s3: access, s3Buckets: [BUCKET] } as unknown as NodeRemoteLayers;
    const view = await remoteLayerView(l as RemoteLayer, r);
    expect(view.remote.sources).toEqual([{ ...(l.remote.sources[0] as Extract<OriginSpec, { kind: "s3" }>), accessKeyId: "S3RVER", secretAccessKey: "S3RVER" }]);
    expect(l.remote.sources[0]).not.toHaveProperty("accessKeyId");
    lazyView = view;
  }, 180_000);

  const noBlockdReason = !haveFuse ? "needs root and /dev/fuse" : !debugfs ? "debugfs (e2fsprogs) is missing" : undefined;
  test.skipIf(!!noBlockdReason)(`blockd reads the lazily pulled layer from S3 with the credentials the node's view added${noBlockdReason ? ` (skipped: ${noBlockdReason})` : ""}`, async () => {
    expect(lazyView).toBeDefined();
    const { client: blockd } = await startBlockd("s3-layout-blockd");
    const dev = await blockd.call<{ id: string; path: string }>("createReadOnly", { lowers: [lazyView] });
    expect(await catFile(dev.path, "/etc/motd")).toBe("hello from S3\n");
    expect(await catFile(dev.path, "/data/medium")).toBe(medium);
    await blockd.call("delete", { id: dev.id }).catch(() => {});
  }, 180_000);

  test("a whole pull: the layer downloaded from S3, verified and cached as it is", async () => {
    const cache = new LayerCache(join(dir, "whole-layers"));
    const pulled = await pullImage(S3Layout.open("s3://templates/team/app", access), { cache, blockd: noBlockd });
    expect(pulled).toMatchObject({ overlaybdNative: true, converted: 1, diskSizeMB: 128, manifestDigest });
    expect(new Bun.CryptoHasher("sha256").update(await Bun.file(pulled.layers[0]!).bytes()).digest("hex")).toBe(layerDigest.slice(7));
  }, 120_000);

  test("the node's image source: s3:// with its S3 settings only; credentials in a request are refused, a node without keys names the settings", async () => {
    const opts = { dir: join(dir, "node-images"), capacityMB: 1024, templates: { layersInUse: () => new Set<string>() } as unknown as TemplateStore, blockd: noBlockd, s3Buckets: [BUCKET] };
    const signal = new AbortController().signal;
    const withKeys = nodeImages({ ...opts, s3: access }).source;
    const img = await withKeys.pull(LOCATION, undefined, () => {}, signal);
    expect(img).toMatchObject({ digest: manifestDigest, env: { FOO: "bar" }, user: "root", workdir: "/work", diskSizeMB: 128 });
    expect(await errorOf(withKeys.pull(LOCATION, { username: "u", password: "p" }, () => {}, signal))).toMatchObject({ code: "BadReference", status: 400, message: expect.stringContaining("node's S3 settings") });
    expect(await errorOf(withKeys.push!(LOCATION, { layers: [layer], config }, { username: "u", password: "p" }))).toMatchObject({ code: "BadReference", status: 400 });
    const noKeys = nodeImages({ ...opts, s3: { endpoint: s3.endpoint, region: "us-east-1", accessKeyId: "", secretAccessKey: "" } }).source;
    expect(await errorOf(noKeys.pull(LOCATION, undefined, () => {}, signal))).toMatchObject({ code: "NoCredentials", status: 400, message: expect.stringContaining("AWS_SECRET_ACCESS_KEY") });
  }, 120_000);

  test("the node's S3 credentials only inside s3_buckets: elsewhere a pull or push is Forbidden (403) before any request, an S3 origin gets no keys", async () => {
    const opts = { dir: join(dir, "scoped-images"), capacityMB: 1024, templates: { layersInUse: () => new Set<string>() } as unknown as TemplateStore, blockd: noBlockd, s3: access };
    const signal = new AbortController().signal;
    const scoped = nodeImages({ ...opts, s3Buckets: [`${BUCKET}/team`] }).source;
    expect(await scoped.pull(LOCATION, undefined, () => {}, signal)).toMatchObject({ digest: manifestDigest });
    const before = (await requestLog(log)).length;
    for (const loc of ["s3://other-bucket/team/app:1", `s3://${BUCKET}/teamx/app:1`, `s3://${BUCKET}/app:1`, `s3://${BUCKET}`]) {
      expect(await errorOf(scoped.pull(loc, undefined, () => {}, signal))).toMatchObject({ code: "Forbidden", status: 403, message: expect.stringContaining("s3_buckets") });
      expect(await errorOf(scoped.push!(loc, { layers: [layer], config }, undefined))).toMatchObject({ code: "Forbidden", status: 403 });
    }
    // Nothing listed: no bucket at all.
    expect(await errorOf(nodeImages(opts).source.push!(LOCATION, { layers: [layer], config }, undefined))).toMatchObject({ code: "Forbidden", status: 403 });
    expect((await requestLog(log)).length).toBe(before);

    // A remote layer's S3 origin (a record, a snapshot from another node) gets the keys only inside the scope.
    const origin = (bucket: string, key: string): RemoteLayer => ({ digest: layerDigest, size: 1, remote: { sources: [{ kind: "s3", bucket, key, endpoint: s3.endpoint, region: "us-east-1" }], cache: { dir: dir, capacity: MiB } } }) as unknown as RemoteLayer;
    const r = { cache: { dir, capacity: MiB }, download: false, auth: { fileFor: async () => undefined }, s3: access, s3Buckets: [`${BUCKET}/team`] } as unknown as NodeRemoteLayers;
    const keysOf = async (l: RemoteLayer) => ((await remoteLayerView(l, r)).remote.sources[0] as { accessKeyId?: string }).accessKeyId;
    expect(await keysOf(origin(BUCKET, `team/app/blobs/sha256/${layerDigest.slice(7)}`))).toBe("S3RVER");
    for (const [bucket, key] of [["other-bucket", "team/app/blobs/x"], [BUCKET, "teamx/blobs/x"], [BUCKET, "team/../other/blobs/x"]] as const) expect(await keysOf(origin(bucket, key))).toBeUndefined();
  }, 120_000);

  test("POST /templates/{id}/push to a bucket outside s3_buckets: 403 {code, message}", async () => {
    const store = new SandboxStore(join(dir, "push-api.db"));
    const templates = new TemplateStore(store.db);
    templates.insert({ id: "tpl1", alias: "tpl1", kind: "template", names: ["tpl1:default"], cpuCount: 1, memoryMB: 256, diskSizeMB: 128, layers: [layer], checkpoint: null, sourceSandboxId: null, envdVersion: "0.6.13", createdAt: Date.now() });
    const images = nodeImages({ dir: join(dir, "push-api"), capacityMB: 1024, templates, blockd: noBlockd, s3: access, s3Buckets: [`${BUCKET}/team`] }).source;
    const builder = new TemplateBuilder({ templates } as unknown as Orchestrator, store.db, { filesDir: join(dir, "push-api-files"), stepsDir: join(dir, "push-api-steps"), images });
    const key = "e2b_" + "5a".repeat(20);
    const api = createApi({ apiKey: key, maxBodyBytes: 4096, notReadyReason: () => undefined, version: "0.0.0-test" }).use(templateRoutes(() => builder)).listen({ hostname: "127.0.0.1", port: 0 });
    try {
      const push = (ref: string) => fetch(`http://127.0.0.1:${api.server!.port}/templates/tpl1/push`, { method: "POST", headers: { "x-api-key": key, "content-type": "application/json" }, body: JSON.stringify({ ref }) });
      const refused = await push("s3://other-bucket/team/app:1");
      expect(refused.status).toBe(403);
      expect(await refused.json()).toEqual({ code: 403, message: expect.stringContaining("is not among the buckets and prefixes this node's S3 credentials may be used on (s3_buckets, AENV_S3_BUCKETS)") });
      expect((await push(LOCATION)).status).toBe(200);
    } finally {
      api.stop(true);
      await builder.close();
      store.close();
    }
  }, 120_000);

  test("a pull's bounds: a layer above maxBlobBytes is TooLarge before any of it is read; a disk above maxDiskSizeMB as soon as its header is", async () => {
    const cache = new LayerCache(join(dir, "bounded-layers"));
    const key = `team/app/blobs/sha256/${layerDigest.slice(7)}`;
    const before = await served(key);
    const blob = await errorOf(pullImage(S3Layout.open(LOCATION, access), { cache, blockd: noBlockd, maxBlobBytes: 1 * MiB }));
    expect(blob.code).toBe("TooLarge");
    expect(blob.message).toContain(`layer ${layerDigest} is`);
    expect(blob.message).toContain("max_blob_mb");
    expect(await served(key)).toBe(before);
    // The layer's virtual size is 128 MiB: past a 64 MiB bound once its header and index are read, the rest never is.
    const disk = await errorOf(pullImage(S3Layout.open(LOCATION, access), { cache, blockd: noBlockd, maxDiskSizeMB: 64, remote: { cache: { dir: join(dir, "bounded-cache"), capacity: 1024 * MiB }, download: false } }));
    expect(disk.code).toBe("TooLarge");
    expect(disk.message).toContain("a disk of 128 MiB, more than this node's max_disk_size_mb (64 MiB)");
    expect((await served(key)) - before).toBeLessThan(statSync(layer).size / 4);
  }, 120_000);

  test("errors: missing bucket, prefix or tag are 404; a malformed layout, index or blob is 502; no credentials is 400", async () => {
    const open = (loc: string, a: S3Access = access) => S3Layout.open(loc, a);
    const pull = (loc: string) => pullImage(open(loc), { cache: new LayerCache(join(dir, "err-layers")), blockd: noBlockd });
    expect(await errorOf(pull("s3://no-such-bucket/x"))).toMatchObject({ code: "NotFound", status: 404 });
    expect((await errorOf(pull("s3://no-such-bucket/x"))).message).toContain("bucket does not exist");
    expect(await errorOf(pull("s3://templates/nothing/here"))).toMatchObject({ code: "NotFound", status: 404, message: expect.stringContaining("no image there") });
    expect(await errorOf(pull("s3://templates/team/app:2"))).toMatchObject({ code: "NotFound", status: 404, message: expect.stringContaining("no manifest tagged '2' (it has 1)") });
    let e: unknown;
    try {
      open(LOCATION, { endpoint: s3.endpoint });
    } catch (x) {
      e = x;
    }
    expect({ code: (e as RegistryError).code, status: (e as RegistryError).status }).toEqual({ code: "NoCredentials", status: 400 });
    expect((e as Error).message).toContain("AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY");

    const write = (key: string, body: string) => raw.write(key, body);
    await write("bad/layout/oci-layout", "not json");
    await write("bad/layout/index.json", "{}");
    expect(await errorOf(pull("s3://templates/bad/layout"))).toMatchObject({ code: "Protocol", status: 502, message: expect.stringContaining("oci-layout") });
    await write("bad/index/oci-layout", '{"imageLayoutVersion":"1.0.0"}');
    await write("bad/index/index.json", "{not json");
    expect(await errorOf(pull("s3://templates/bad/index"))).toMatchObject({ code: "Protocol", status: 502 });
    await write("bad/shape/oci-layout", '{"imageLayoutVersion":"1.0.0"}');
    await write("bad/shape/index.json", '{"schemaVersion":2,"manifests":"no"}');
    expect(await errorOf(pull("s3://templates/bad/shape"))).toMatchObject({ code: "Protocol", status: 502, message: expect.stringContaining("manifests") });
    // An index naming a manifest whose blob is not what it says.
    const fake = { mediaType: MEDIA.ociManifest, digest: `sha256:${"0".repeat(64)}`, size: 10 };
    await write("bad/blob/oci-layout", '{"imageLayoutVersion":"1.0.0"}');
    await write("bad/blob/index.json", JSON.stringify({ schemaVersion: 2, mediaType: MEDIA.ociIndex, manifests: [fake] }));
    await write(`bad/blob/blobs/sha256/${"0".repeat(64)}`, "0123456789");
    expect(await errorOf(pull("s3://templates/bad/blob"))).toMatchObject({ code: "DigestMismatch", status: 502 });
    // A manifest blob the index names but S3 lacks.
    await write("bad/missing/oci-layout", '{"imageLayoutVersion":"1.0.0"}');
    await write("bad/missing/index.json", JSON.stringify({ schemaVersion: 2, mediaType: MEDIA.ociIndex, manifests: [fake] }));
    expect(await errorOf(pull("s3://templates/bad/missing"))).toMatchObject({ code: "NotFound", status: 404 });
    // An index.json past the 4 MiB bound.
    await write("bad/big/oci-layout", '{"imageLayoutVersion":"1.0.0"}');
    await write("bad/big/index.json", " ".repeat(4 * MiB + 1));
    expect(await errorOf(pull("s3://templates/bad/big"))).toMatchObject({ code: "TooLarge", status: 502 });
    // A push to a bucket that does not exist.
    expect(await errorOf(pushImage(open("s3://no-such-bucket/x"), [layer], config, { workDir: dir }))).toMatchObject({ code: "NotFound", status: 404 });
  }, 120_000);
});
