// Templates that live remotely, at the layer level (no VM; the two-node run is
// test/node/remote.test.ts): our push writes an overlaybd image that the puller takes as it is;
// a lazy pull leaves its layers in the registry (remote refs) and reads only their headers and
// indexes; blockd's workers open the refs through RemoteFile and the block cache and fetch only
// what is read, and a second device finds the first one's chunks on disk; behind Bearer tokens,
// blockd reads only with the headers file the node keeps fresh (RegistryAuthFiles); a boot trace
// pushed with the image comes back with a lazy pull and replays on a device over the remote layer,
// and a trace that is bad, too large or missing is left out with a log line, never a failed pull.
import { afterAll, describe, expect, test } from "bun:test";
import { randomBytes } from "node:crypto";
import { existsSync, mkdirSync, statSync, writeFileSync } from "node:fs";
import { rm } from "node:fs/promises";
import { join } from "node:path";
import { RegistryAuthFiles } from "../../src/node/registry_auth.ts";
import { LayerCache } from "../../src/template/layer_cache.ts";
import { pullImage, type RemoteLayerRef } from "../../src/template/pull.ts";
import { pushImage } from "../../src/template/push.ts";
import { PREFETCH_ROOTFS_ANNOTATION, PREFETCH_ROOTFS_SIZE_ANNOTATION } from "../../src/template/prefetch_trace.ts";
import { TRACE_MAX_FILE } from "../../src/storage/trace_file.ts";
import { MEDIA, OVERLAYBD_ANNOTATION, RegistryClient } from "../../src/template/registry.ts";
import { haveFuse, startBlockd } from "../blockdev/harness.ts";
import { scratchDir } from "../helpers/tmp.ts";
import { blobBytesServed, busyboxRoot, overlaybdLayerOf, registrySkipReason, startRegistry, startTokenServer, type RegistryServer } from "./registry_harness.ts";

const SBIN = "/usr/local/sbin:/usr/sbin:/sbin";
const skip = registrySkipReason() ?? (!haveFuse ? "needs root and /dev/fuse" : !Bun.which("debugfs", { PATH: `${process.env.PATH}:${SBIN}` }) ? "debugfs (e2fsprogs) is missing" : undefined);
const MiB = 2 ** 20;
/** The never-read file that makes the layer much larger than what a lookup of one small file reads. */
const FILLER_MIB = 48;
/** A file a device reads whole: its chunks are fetched by the first device and found on disk by the next. */
const medium = randomBytes(3 * MiB).toString("hex");

/** A file of the ext4 file system on a device (or image) file, read by debugfs (no mount). */
async function catFile(device: string, path: string): Promise<string> {
  const p = Bun.spawn(["debugfs", "-R", `cat ${path}`, device], { stdout: "pipe", stderr: "pipe", env: { ...process.env, PATH: `${process.env.PATH}:${SBIN}` } });
  const [out, err, code] = await Promise.all([new Response(p.stdout).text(), new Response(p.stderr).text(), p.exited]);
  if (code !== 0) throw new Error(`debugfs cat ${path}: exit ${code}: ${err}`);
  return out;
}

describe.skipIf(!!skip)("templates in a registry, lazily (layer level)", async () => {
  if (skip) return void test.skip(skip!, () => {});
  const dir = scratchDir("remote-tpl", { keep: true });
  const { client: blockd } = await startBlockd("remote-tpl-blockd");
  const reg: RegistryServer = await startRegistry({ dir: join(dir, "registry"), accessLog: true });
  let layer: string;
  const client = new RegistryClient({ dockerConfigPath: null, insecureRegistries: [reg.host] });
  const config = { env: { FOO: "bar", PATH: "/bin" }, user: "root", workdir: "/work" };

  afterAll(async () => {
    await reg.stop();
    await rm(dir, { recursive: true, force: true });
  });

  test("push: one blob per layer with the overlaybd annotations, the config's env, user and workdir; a second push sends no blob", async () => {
    const root = await busyboxRoot(join(dir, "root"));
    writeFileSync(join(root, "etc/motd"), "hello from the registry\n");
    mkdirSync(join(root, "data"));
    writeFileSync(join(root, "data/filler"), randomBytes(FILLER_MIB * MiB));
    writeFileSync(join(root, "data/medium"), medium);
    layer = await overlaybdLayerOf(root, join(dir, "root.layer"), 256);

    const ref = `${reg.host}/remote/tpl:1`;
    const pushed = await pushImage(ref, [layer], config, { registry: client, workDir: dir });
    // Asymmetric matchers stay out of toMatchObject/toEqual on objects used after (Bun writes them into the received object).
    const digest = `sha256:${new Bun.CryptoHasher("sha256").update(await Bun.file(layer).bytes()).digest("hex")}`;
    expect(pushed.layers).toEqual([{ digest, size: statSync(layer).size, uploaded: true }]);
    const r = await client.resolve(ref);
    expect(r.overlaybdNative).toBe(true);
    expect(r.manifestDigest).toBe(pushed.manifestDigest);
    expect(r.layers[0]).toMatchObject({
      mediaType: MEDIA.ociLayerTar, digest: pushed.layers[0]!.digest, size: pushed.layers[0]!.size,
      annotations: { [OVERLAYBD_ANNOTATION.blobDigest]: pushed.layers[0]!.digest, [OVERLAYBD_ANNOTATION.blobSize]: String(pushed.layers[0]!.size), [OVERLAYBD_ANNOTATION.fsType]: "ext4" },
    });
    expect(r.config).toMatchObject({ Env: ["FOO=bar", "PATH=/bin"], WorkingDir: "/work", User: "root", diffIds: [pushed.layers[0]!.digest] });
    expect(r.annotations).toBeUndefined(); // no trace: the manifest has no annotations
    expect(pushed.trace).toBeUndefined();

    // The same layers under another tag: HEAD finds every blob, no upload starts.
    const uploadsBefore = reg.accessLog().filter((e) => e.method === "POST" && e.path.includes("/blobs/uploads/")).length;
    const again = await pushImage(`${reg.host}/remote/tpl:2`, [layer], config, { registry: client, workDir: dir });
    expect(again.layers.map((l) => l.uploaded)).toEqual([false]);
    expect(again.manifestDigest).toBe(pushed.manifestDigest);
    const uploads = reg.accessLog().filter((e) => e.method === "POST" && e.path.includes("/blobs/uploads/")).length;
    // The config blob is the same too: nothing at all was uploaded.
    expect(uploads).toBe(uploadsBefore);
  }, 120_000);

  test("lazy pull: remote refs, only headers and indexes fetched; blockd serves a file reading a fraction of the layer; a second device reads it from the cache", async () => {
    const ref = `${reg.host}/remote/tpl:1`;
    const cacheDir = join(dir, "block-cache");
    const pulled = await pullImage(ref, { registry: client, cache: new LayerCache(join(dir, "layers")), blockd, remote: { cache: { dir: cacheDir, capacity: 1024 * MiB }, download: false } });
    expect(pulled).toMatchObject({ overlaybdNative: true, diskSizeMB: 256, config: { env: { FOO: "bar" }, workingDir: "/work", user: "root" } });
    const l = pulled.layers[0] as RemoteLayerRef;
    expect(l.digest).toMatch(/^sha256:[0-9a-f]{64}$/);
    expect(l).toMatchObject({ size: statSync(layer).size, remote: { sources: [{ kind: "http", url: client.blobUrl(ref, l.digest) }], cache: { dir: cacheDir }, download: false } });
    expect(pulled.rootfsTrace).toBeUndefined();
    const size = l.size;
    const afterPull = await blobBytesServed(reg, [l.digest]);
    expect(afterPull).toBeGreaterThan(0);
    expect(afterPull).toBeLessThan(size / 4);

    const dev = await blockd.call<{ id: string; path: string }>("createReadOnly", { lowers: pulled.layers });
    expect(await catFile(dev.path, "/etc/motd")).toBe("hello from the registry\n");
    expect(await catFile(dev.path, "/data/medium")).toBe(medium);
    const afterRead = await blobBytesServed(reg, [l.digest]);
    console.log(`remote layer ${(size / MiB).toFixed(1)} MiB: pull fetched ${(afterPull / MiB).toFixed(1)} MiB, a device reading /etc/motd and a 6 MiB file ${((afterRead - afterPull) / MiB).toFixed(1)} MiB more`);
    expect(afterRead - afterPull).toBeGreaterThanOrEqual(6 * MiB);
    expect(afterRead).toBeLessThan(size / 2);

    // Another device (its own worker thread) over the same layer: the chunks the first one wrote are found on disk.
    const upperDir = join(dir, "upper2");
    const rw = await blockd.call<{ id: string; path: string }>("create", { lowers: pulled.layers, upperDir, size: 256 * MiB });
    expect(await catFile(rw.path, "/etc/motd")).toBe("hello from the registry\n");
    expect(await catFile(rw.path, "/data/medium")).toBe(medium);
    expect(await blobBytesServed(reg, [l.digest])).toBe(afterRead);
    await blockd.call("delete", { id: rw.id });
    await blockd.call("delete", { id: dev.id });
  }, 120_000);

  test("with download on, an idle device's worker fetches the whole layer in the background, verifies and promotes it; reads go to the local file after", async () => {
    const ref = `${reg.host}/remote/tpl:1`;
    const cacheDir = join(dir, "download-cache");
    const pulled = await pullImage(ref, { registry: client, cache: new LayerCache(join(dir, "layers")), blockd, remote: { cache: { dir: cacheDir, capacity: 1024 * MiB } } });
    const l = pulled.layers[0] as RemoteLayerRef;
    const before = await blobBytesServed(reg, [l.digest]);
    // No request reaches the device: the download runs on the worker's event loop alone.
    const dev = await blockd.call<{ id: string; path: string }>("createReadOnly", { lowers: pulled.layers });
    const promoted = join(cacheDir, "layers", l.digest.slice(7));
    const until = Date.now() + 60_000;
    while (!existsSync(promoted) && Date.now() < until) await Bun.sleep(100);
    expect(existsSync(promoted)).toBe(true);
    expect(`sha256:${new Bun.CryptoHasher("sha256").update(await Bun.file(promoted).bytes()).digest("hex")}`).toBe(l.digest);
    // The cache's names go once promoted (the promoted file is their data, linked): the layer is one local file.
    const cached = join(cacheDir, "sparse", `${l.digest.slice(7)}-${1 << 20}`);
    while ((existsSync(`${cached}.data`) || existsSync(`${cached}.map`)) && Date.now() < until) await Bun.sleep(50);
    expect([existsSync(`${cached}.data`), existsSync(`${cached}.map`)]).toEqual([false, false]);
    const fetched = (await blobBytesServed(reg, [l.digest])) - before;
    expect(fetched).toBeGreaterThanOrEqual(l.size - 2 * MiB); // the pull's chunks (header, index) were not fetched again
    expect(fetched).toBeLessThanOrEqual(l.size);
    expect(await catFile(dev.path, "/data/medium")).toBe(medium);
    const rw = await blockd.call<{ id: string; path: string }>("create", { lowers: pulled.layers, upperDir: join(dir, "upper3"), size: 256 * MiB });
    expect(await catFile(rw.path, "/data/medium")).toBe(medium);
    expect((await blobBytesServed(reg, [l.digest])) - before).toBe(fetched);
    await blockd.call("delete", { id: rw.id });
    await blockd.call("delete", { id: dev.id });
  }, 120_000);

  test("behind Bearer tokens: blockd's reads fail without the registry's Authorization and pass with the headers file the node keeps fresh", async () => {
    const users = [{ username: "alice", password: "s3cret" }];
    const tokens = await startTokenServer(join(dir, "tokens"), users);
    const treg = await startRegistry({ dir: join(dir, "token-registry"), tokenAuth: tokens.auth });
    try {
      const insecure = [treg.host, new URL(tokens.auth.realm).host];
      const authed = new RegistryClient({ dockerConfigPath: null, credentials: { [treg.host]: users[0]! }, insecureRegistries: insecure });
      const ref = `${treg.host}/remote/tpl:1`;
      await pushImage(ref, [layer], config, { registry: authed, workDir: dir });
      const pulled = await pullImage(ref, { registry: authed, cache: new LayerCache(join(dir, "layers")), blockd, remote: { cache: { dir: join(dir, "probe-cache"), capacity: 1024 * MiB }, download: false } });
      const l = pulled.layers[0] as RemoteLayerRef;
      // A cache of its own for each try: the pull's probe cached the header and index in its own.
      const as = (cache: string, headersFile?: string): RemoteLayerRef => ({
        ...l, remote: { ...l.remote, cache: { dir: join(dir, cache), capacity: 1024 * MiB }, sources: l.remote.sources.map((s) => ({ ...s, ...(headersFile ? { headersFile } : {}) })) },
      });
      const refused = await blockd.call("createReadOnly", { lowers: [as("anon-cache")] }).catch((e: Error) => e);
      expect(refused).toBeInstanceOf(Error);
      expect((refused as Error).message).toContain("401");

      const auth = new RegistryAuthFiles({ dir: join(dir, "registry-auth"), secretsDir: join(dir, "secrets"), registry: { dockerConfigPath: null, insecureRegistries: insecure } });
      try {
        auth.remember(ref, users[0]!);
        const file = (await auth.fileFor(l.remote.sources[0]!.kind === "http" ? l.remote.sources[0]!.url : ""))!;
        expect(statSync(file).mode & 0o777).toBe(0o600);
        const doc = (await Bun.file(file).json()) as { headers: Record<string, string>; expiresAt: number };
        expect(doc.headers.authorization).toStartWith("Bearer ");
        expect(doc.expiresAt).toBeGreaterThan(Date.now());
        const dev = await blockd.call<{ id: string; path: string }>("createReadOnly", { lowers: [as("authed-cache", file)] });
        expect(await catFile(dev.path, "/etc/motd")).toBe("hello from the registry\n");
        await blockd.call("delete", { id: dev.id });
      } finally {
        auth.close();
      }
    } finally {
      await treg.stop();
      tokens.stop();
    }
  }, 120_000);

  test("a boot trace pushed with the image: a blob named by the manifest's annotations, handed on by a lazy pull and replayed over the remote layer; a bad one is logged and left out", async () => {
    // A real trace: a device over the local layer records a read of /data/medium.
    const traceFile = join(dir, "boot.trace");
    const local = await blockd.call<{ id: string; path: string }>("createReadOnly", { lowers: [layer] });
    await blockd.call("traceStart", { id: local.id });
    expect(await catFile(local.path, "/data/medium")).toBe(medium);
    const stopped = await blockd.call<{ entries: number; bytes: number }>("traceStop", { id: local.id, out: traceFile });
    await blockd.call("delete", { id: local.id });
    expect(stopped.entries).toBeGreaterThan(0);
    const traceBytes = await Bun.file(traceFile).bytes();
    const traceDigest = `sha256:${new Bun.CryptoHasher("sha256").update(traceBytes).digest("hex")}`;

    const ref = `${reg.host}/remote/traced:1`;
    const said: string[] = [];
    const pushed = await pushImage(ref, [layer], config, { registry: client, workDir: dir, rootfsTrace: traceFile, onProgress: (m) => said.push(m) });
    expect(pushed.trace).toEqual({ digest: traceDigest, size: traceBytes.length, uploaded: true });
    expect(said.some((m) => m.startsWith(`push prefetch trace ${traceDigest}`))).toBe(true);
    const r = await client.resolve(ref);
    expect(r.annotations).toEqual({ [PREFETCH_ROOTFS_ANNOTATION]: traceDigest, [PREFETCH_ROOTFS_SIZE_ANNOTATION]: String(traceBytes.length) });
    expect(r.layers.map((d) => d.digest)).toEqual(pushed.layers.map((d) => d.digest)); // the trace is no layer
    expect(await client.hasBlob(ref, traceDigest)).toBe(true);
    const untraced = (await client.resolve(`${reg.host}/remote/tpl:1`)).manifestDigest;
    expect(pushed.manifestDigest).not.toBe(untraced);
    // Pushed again: the trace blob is there (HEAD), nothing is sent, the same manifest.
    const again = await pushImage(ref, [layer], config, { registry: client, workDir: dir, rootfsTrace: traceFile });
    expect(again.trace?.uploaded).toBe(false);
    expect(again.manifestDigest).toBe(pushed.manifestDigest);
    // A missing trace file and one over the bound leave the image exactly as without one.
    expect((await pushImage(`${reg.host}/remote/tpl:3`, [layer], config, { registry: client, workDir: dir, rootfsTrace: join(dir, "none.trace") })).manifestDigest).toBe(untraced);
    const huge = join(dir, "huge.trace");
    writeFileSync(huge, Buffer.concat([Buffer.from("AETRACE1"), Buffer.alloc(TRACE_MAX_FILE)]));
    const hugeSaid: string[] = [];
    const hugePush = await pushImage(`${reg.host}/remote/tpl:4`, [layer], config, { registry: client, workDir: dir, rootfsTrace: huge, onProgress: (m) => hugeSaid.push(m) });
    expect(hugePush.manifestDigest).toBe(untraced);
    expect(hugeSaid.some((m) => m.includes("left out") && m.includes(String(TRACE_MAX_FILE)))).toBe(true);
    // So does a trace with one byte changed: the push checks it whole.
    const flipped = join(dir, "flipped.trace");
    writeFileSync(flipped, traceBytes.map((b, i) => (i === traceBytes.length - 6 ? b ^ 1 : b)));
    const flippedSaid: string[] = [];
    const flippedPush = await pushImage(`${reg.host}/remote/tpl:5`, [layer], config, { registry: client, workDir: dir, rootfsTrace: flipped, onProgress: (m) => flippedSaid.push(m) });
    expect(flippedPush.manifestDigest).toBe(untraced);
    expect(flippedSaid.some((m) => m.includes("left out") && m.includes("checksum mismatch"))).toBe(true);

    // A lazy pull hands the trace on; blockd replays it on a device over the remote layer.
    const logs: string[] = [];
    const pull = (tag: string, cache: string) =>
      pullImage(`${reg.host}/remote/traced:${tag}`, { registry: client, cache: new LayerCache(join(dir, "layers")), blockd, log: (m) => logs.push(m), remote: { cache: { dir: join(dir, cache), capacity: 1024 * MiB }, download: false } });
    const pulled = await pull("1", "trace-cache");
    expect(pulled.rootfsTrace).toEqual(traceBytes);
    expect(logs).toEqual([]);
    const replayed = join(dir, "pulled.trace");
    await Bun.write(replayed, pulled.rootfsTrace!);
    const before = await blobBytesServed(reg, [pushed.layers[0]!.digest]);
    const dev = await blockd.call<{ id: string; path: string }>("createReadOnly", { lowers: pulled.layers });
    const pf = await blockd.call<{ started: boolean; planned: number }>("prefetch", { id: dev.id, trace: replayed });
    expect(pf.started).toBe(true);
    expect(pf.planned).toBeGreaterThan(0);
    // The replay brings /data/medium's chunks: reading it after asks the registry for little more.
    const until = Date.now() + 30_000;
    while (Date.now() < until && (await blockd.call<{ prefetchActive?: number }>("stats", { id: dev.id })).prefetchActive) await Bun.sleep(50);
    const afterPrefetch = await blobBytesServed(reg, [pushed.layers[0]!.digest]);
    expect(afterPrefetch - before).toBeGreaterThanOrEqual(3 * MiB);
    expect(await catFile(dev.path, "/data/medium")).toBe(medium);
    expect((await blobBytesServed(reg, [pushed.layers[0]!.digest])) - afterPrefetch).toBeLessThanOrEqual(MiB);
    await blockd.call("delete", { id: dev.id });

    // Manifests naming a bad trace: the pull succeeds without one, and says why.
    const manifest = JSON.parse(new TextDecoder().decode((await client.getManifest(ref)).bytes)) as { annotations: Record<string, string> };
    const notTrace = await client.pushBlob(ref, new TextEncoder().encode("this is no trace at all, just some bytes"), {});
    const cases: [string, Record<string, string>, string][] = [
      ["bad", { [PREFETCH_ROOTFS_ANNOTATION]: notTrace.digest, [PREFETCH_ROOTFS_SIZE_ANNOTATION]: String(notTrace.size) }, "not a trace file (bad magic)"],
      ["big", { [PREFETCH_ROOTFS_ANNOTATION]: traceDigest, [PREFETCH_ROOTFS_SIZE_ANNOTATION]: String(2 * TRACE_MAX_FILE) }, "prefetch trace ignored: annotations"],
      ["gone", { [PREFETCH_ROOTFS_ANNOTATION]: `sha256:${"0".repeat(64)}`, [PREFETCH_ROOTFS_SIZE_ANNOTATION]: "64" }, "ignored"],
      ["short", { [PREFETCH_ROOTFS_ANNOTATION]: traceDigest, [PREFETCH_ROOTFS_SIZE_ANNOTATION]: String(traceBytes.length - 1) }, "ignored"],
    ];
    for (const [tag, annotations, message] of cases) {
      await client.pushManifest(`${reg.host}/remote/traced:${tag}`, { ...manifest, annotations }, MEDIA.ociManifest);
      logs.length = 0;
      const p = await pull(tag, `trace-cache-${tag}`);
      expect({ tag, trace: p.rootfsTrace, layers: p.layers.length }).toEqual({ tag, trace: undefined, layers: 1 });
      expect({ tag, logs: logs.filter((m) => m.includes(message)).length }).toEqual({ tag, logs: 1 });
    }
  }, 180_000);
});
