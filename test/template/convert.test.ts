// OCI layer conversion for real: a blockd started here, loop-mounted ext4 on its devices, tars made
// by GNU tar (and, for the hostile ones, by hand), every result checked on a read-only mount of the
// sealed stack. Then the cache (conversions counted, racing callers), the escapes, damaged streams
// and GC, and a pull from a real registry (docker-registry on loopback).
import { describe, expect, test } from "bun:test";
import { existsSync, lstatSync, readdirSync, readFileSync, readlinkSync, statSync } from "node:fs";
import { copyFile, mkdir, readdir, symlink, truncate, utimes, writeFile } from "node:fs/promises";
import { join } from "node:path";
import { gzipSync } from "node:zlib";
import { haveFuse, haveLoop, startBlockd } from "../blockdev/harness.ts";
import { sha256 } from "../helpers/tmp.ts";
import { convertLayer, emptyExt4Layer, type ConvertContext, type ConvertedLayer } from "../../src/template/convert.ts";
import { ConvertError } from "../../src/template/convert_error.ts";
import { LayerCache } from "../../src/template/layer_cache.ts";
import { diffIdOf } from "../../src/template/layer_stream.ts";
import { pullImage, type PullProgress } from "../../src/template/pull.ts";
import { RegistryClient } from "../../src/template/registry.ts";
import { BUSYBOX_CONFIG, busyboxRoot, overlaybdLayerOf, pushImage, pushOverlaybdImage, pushTwoLayerImage, pushWhiteoutImage, registrySkipReason, startRegistry } from "./registry_harness.ts";

const SBIN = "/usr/local/sbin:/usr/sbin:/sbin";
const haveTools = ["mkfs.ext4", "tar", "zstd", "python3"].every((t) => Bun.which(t, { PATH: `${process.env.PATH}:${SBIN}` }));
const canRun = haveFuse && haveLoop && haveTools;
const why = "needs root, /dev/fuse, /dev/loop-control, mkfs.ext4, GNU tar, zstd and python3";
const SIZE = 1 << 30;

async function sh(argv: string[], opts: { cwd?: string } = {}): Promise<string> {
  const p = Bun.spawn(argv, { cwd: opts.cwd, stdout: "pipe", stderr: "pipe", env: { ...process.env, PATH: `${process.env.PATH}:${SBIN}` } });
  const [out, err, code] = await Promise.all([new Response(p.stdout).text(), new Response(p.stderr).text(), p.exited]);
  if (code !== 0) throw new Error(`${argv.join(" ")} exited ${code}: ${err}`);
  return out;
}

/** A tar of a folder the way image builders write one (PAX, numeric owners, xattrs). */
async function tarOf(dir: string, out: string, compress: "gzip" | "zstd" | "none" = "gzip"): Promise<string> {
  const tar = compress === "none" ? out : `${out}.tar`;
  await sh(["tar", "--format=posix", "--xattrs", "--xattrs-include=*", "--numeric-owner", "-C", dir, "-cf", tar, "."]);
  if (compress === "gzip") await sh(["gzip", "-n", "-f", "-S", ".gz-tmp", tar]).then(() => sh(["mv", `${tar}.gz-tmp`, out]));
  if (compress === "zstd") await sh(["zstd", "-q", "-f", "--rm", tar, "-o", out]);
  return out;
}

/** A hand-made ustar archive: what no honest tool writes (`../` names, links out of the root). */
function craftedTar(entries: { name: string; type?: "0" | "1" | "2" | "5"; link?: string; data?: string }[]): Uint8Array {
  const blocks: Uint8Array[] = [];
  const enc = new TextEncoder();
  for (const e of entries) {
    const h = new Uint8Array(512);
    const put = (s: string, at: number) => h.set(enc.encode(s), at);
    const data = enc.encode(e.data ?? "");
    put(e.name, 0);
    put("0000644\0", 100);
    put("0000000\0", 108);
    put("0000000\0", 116);
    put(data.length.toString(8).padStart(11, "0") + "\0", 124);
    put("00000000000\0", 136);
    put("        ", 148);
    put(e.type ?? "0", 156);
    if (e.link) put(e.link, 157);
    put("ustar\0" + "00", 257);
    const sum = h.reduce((a, b) => a + b, 0);
    put(sum.toString(8).padStart(6, "0") + "\0 ", 148);
    blocks.push(h);
    if (data.length) {
      const d = new Uint8Array(Math.ceil(data.length / 512) * 512);
      d.set(data);
      blocks.push(d);
    }
  }
  blocks.push(new Uint8Array(1024));
  return Buffer.concat(blocks);
}

describe.skipIf(!canRun)(canRun ? "OCI layer conversion" : `OCI layer conversion (skipped: ${why})`, async () => {
  if (!canRun) return void test.skip(why, () => {});
  const { dir, client } = await startBlockd("convert");
  const cache = new LayerCache(join(dir, "cache"));
  const ctx: ConvertContext = { cache, blockd: client };
  const stage = (name: string) => join(dir, "stage", name);
  let base: ConvertedLayer;
  let first: ConvertedLayer;

  /** The stack mounted read-only (a blockd read-only device, loop, ext4 `ro,noload`). */
  async function mounted<T>(layers: ConvertedLayer[], fn: (root: string) => Promise<T>): Promise<T> {
    const dev = await client.call("createReadOnly", { lowers: layers.map((l) => l.path), loop: true });
    const mnt = join(dir, `mnt-${crypto.randomUUID().slice(0, 8)}`);
    await mkdir(mnt);
    await sh(["mount", "-t", "ext4", "-o", "ro,noload", dev.loop, mnt]);
    try {
      return await fn(mnt);
    } finally {
      await sh(["umount", mnt]);
      await client.call("delete", { id: dev.id });
    }
  }

  async function layer(parents: ConvertedLayer[], blob: string): Promise<ConvertedLayer> {
    return convertLayer(ctx, parents, { blob, diffId: await diffIdOf(blob) }, SIZE);
  }

  const xattr = (path: string, name: string) =>
    sh(["python3", "-c", "import os,sys; sys.stdout.write(os.getxattr(sys.argv[1], sys.argv[2], follow_symlinks=False).decode())", path, name]);

  /** What a failed conversion must not leave: a cached layer, a work folder, a blockd device. */
  async function leftovers() {
    const devices = (await client.call("list")) as { id: string }[];
    return {
      layers: (await readdir(join(dir, "cache", "layers"))).length,
      work: (await readdir(join(dir, "cache", "work"))).length,
      devices: (Array.isArray(devices) ? devices : (devices as { devices: unknown[] }).devices).length,
    };
  }

  test("the empty ext4 layer: made once per size, inode tables zeroed (no lazy init in the guest)", async () => {
    base = await emptyExt4Layer(ctx, SIZE);
    expect(base.converted).toBe(true);
    expect((await emptyExt4Layer(ctx, SIZE)).converted).toBe(false);
    const dev = await client.call("createReadOnly", { lowers: [base.path] });
    try {
      const groups = (await sh(["dumpe2fs", dev.path])).split("\n").filter((l) => /^Group \d+:/.test(l));
      expect(groups.length).toBeGreaterThan(0);
      expect(groups.every((g) => g.includes("ITABLE_ZEROED"))).toBe(true);
    } finally {
      await client.call("delete", { id: dev.id });
    }
    // Sparse: a 1 GiB file system takes a few MiB.
    expect(statSync(base.path).size).toBeLessThan(16 << 20);
  }, 60_000);

  test("a layer keeps owners, modes, mtimes, xattrs, hard links, symlinks, device nodes and fifos (gzip)", async () => {
    const s = stage("one");
    await mkdir(join(s, "bin"), { recursive: true });
    await copyFile("/bin/busybox", join(s, "bin/busybox"));
    await symlink("busybox", join(s, "bin/sh"));
    await mkdir(join(s, "etc"));
    await writeFile(join(s, "etc/hello"), "hello\n");
    await mkdir(join(s, "data/olddir/deep"), { recursive: true });
    await writeFile(join(s, "data/olddir/deep/f"), "old\n");
    await writeFile(join(s, "data/gone"), "gone\n");
    await writeFile(join(s, "data/keep"), "keep\n");
    await mkdir(join(s, "opq"));
    await writeFile(join(s, "opq/a"), "a\n");
    await mkdir(join(s, "home/user"), { recursive: true });
    const long = `${"d".repeat(60)}/${"e".repeat(60)}/${"f".repeat(80)}`;
    await mkdir(join(s, "deep", long, ".."), { recursive: true });
    await writeFile(join(s, "deep", long), "long name\n");
    await sh(["sh", "-euc", `
      cd "$0"
      chown 1000:1001 etc/hello home/user; chmod 0640 etc/hello; chmod 0700 home/user
      cp bin/busybox bin/suid; chmod 4755 bin/suid
      ln data/keep data/keep-link
      mkdir dev run; mknod dev/null c 1 3; mknod dev/blk b 7 99; mkfifo run/fifo; chmod 0620 dev/blk
      touch -h -d '2001-02-03 04:05:06' etc/hello bin/sh; touch -d '1999-12-31 23:59:59' home/user
      python3 -c "import os; os.setxattr('etc/hello','user.aenv',b'kept'); os.setxattr('home/user','trusted.dir',b'dirx')"
    `, s]);
    first = await layer([base], await tarOf(s, join(dir, "one.tgz")));
    expect(first.converted).toBe(true);
    expect(first.compression).toBe("gzip");
    await mounted([base, first], async (m) => {
      expect(sha256(readFileSync(join(m, "bin/busybox")))).toBe(sha256(readFileSync("/bin/busybox")));
      expect(readlinkSync(join(m, "bin/sh"))).toBe("busybox");
      const hello = statSync(join(m, "etc/hello"));
      expect([hello.uid, hello.gid, hello.mode & 0o7777]).toEqual([1000, 1001, 0o640]);
      expect(hello.mtime.toISOString()).toBe(new Date("2001-02-03T04:05:06").toISOString());
      expect(lstatSync(join(m, "bin/sh")).mtime.toISOString()).toBe(new Date("2001-02-03T04:05:06").toISOString());
      const home = statSync(join(m, "home/user"));
      expect([home.uid, home.mode & 0o7777]).toEqual([1000, 0o700]);
      expect(home.mtime.toISOString()).toBe(new Date("1999-12-31T23:59:59").toISOString()); // set after its entries
      expect(statSync(join(m, "bin/suid")).mode & 0o7777).toBe(0o4755);
      expect(statSync(join(m, "data/keep-link")).ino).toBe(statSync(join(m, "data/keep")).ino);
      expect(statSync(join(m, "data/keep")).nlink).toBe(2);
      const nul = statSync(join(m, "dev/null"));
      expect(nul.isCharacterDevice()).toBe(true);
      expect(nul.rdev).toBe(0x103);
      const blk = statSync(join(m, "dev/blk"));
      expect(blk.isBlockDevice()).toBe(true);
      expect(blk.mode & 0o7777).toBe(0o620);
      expect(blk.rdev).toBe(7 * 256 + 99);
      expect(lstatSync(join(m, "run/fifo")).isFIFO()).toBe(true);
      expect(await xattr(join(m, "etc/hello"), "user.aenv")).toBe("kept");
      expect(await xattr(join(m, "home/user"), "trusted.dir")).toBe("dirx");
      expect(readFileSync(join(m, "deep", long), "utf8")).toBe("long name\n");
      expect(await sh(["chroot", m, "/bin/sh", "-c", "echo $((6*7))"])).toBe("42\n");
    });
  }, 120_000);

  test("whiteouts and an opaque directory hide lower entries; the layer's own entries stay (zstd)", async () => {
    const s = stage("two");
    await mkdir(join(s, "data"), { recursive: true });
    await writeFile(join(s, "data/.wh.gone"), "");
    await writeFile(join(s, "data/.wh.olddir"), "");
    await writeFile(join(s, "data/new"), "new\n");
    await mkdir(join(s, "opq"));
    await writeFile(join(s, "opq/.wh..wh..opq"), "");
    await writeFile(join(s, "opq/b"), "b\n");
    await mkdir(join(s, "etc/hello"), { recursive: true }); // a file in the lower becomes a directory
    await writeFile(join(s, "etc/hello/inside"), "in\n");
    await mkdir(join(s, "bin"));
    await writeFile(join(s, "bin/sh"), "#!/bin/busybox sh\n"); // a symlink in the lower becomes a file
    await writeFile(join(s, ".wh..wh.plnk"), ""); // aufs metadata: skipped
    const second = await layer([base, first], await tarOf(s, join(dir, "two.tar.zst"), "zstd"));
    expect(second.compression).toBe("zstd");
    expect(second.stats!.whiteouts).toBe(3);
    await mounted([base, first, second], async (m) => {
      expect(readdirSync(join(m, "data")).sort()).toEqual(["keep", "keep-link", "new"]);
      expect(readdirSync(join(m, "opq"))).toEqual(["b"]);
      expect(readFileSync(join(m, "etc/hello/inside"), "utf8")).toBe("in\n");
      expect(lstatSync(join(m, "bin/sh")).isFile()).toBe(true);
      expect(existsSync(join(m, "bin/busybox"))).toBe(true);
      expect(readdirSync(m).some((n) => n.startsWith(".wh."))).toBe(false);
    });
  }, 120_000);

  test("the cache: a layer converts once; a second image on the same base converts only its new layer; racing callers share one conversion", async () => {
    const before = cache.stats.conversions;
    const again = await layer([base], join(dir, "one.tgz"));
    expect(again.converted).toBe(false);
    expect(again.path).toBe(first.path);
    const s = stage("three");
    await mkdir(join(s, "srv"), { recursive: true });
    await writeFile(join(s, "srv/three"), "3\n");
    const blob = await tarOf(s, join(dir, "three.tgz"));
    const diffId = await diffIdOf(blob);
    const [a, b] = await Promise.all([0, 1].map(() => convertLayer(ctx, [base, again], { blob, diffId }, SIZE)));
    expect([a!.converted, b!.converted].sort()).toEqual([false, true]);
    expect(a!.path).toBe(b!.path);
    expect(cache.stats.conversions - before).toBe(1);
    expect(cache.stats.joined).toBeGreaterThanOrEqual(1);
    await mounted([base, again, a!], async (m) => {
      expect(readFileSync(join(m, "srv/three"), "utf8")).toBe("3\n");
      expect(existsSync(join(m, "bin/busybox"))).toBe(true);
    });
  }, 120_000);

  test("escapes fail the layer with UnsafePath and touch nothing outside the image: `../x`, a symlink to /, a relative symlink out, a hard link out", async () => {
    const tag = crypto.randomUUID().slice(0, 8);
    const hostTmp = `/tmp/aenv-pwned-${tag}`;
    const cases = [
      { label: "dotdot", entries: [{ name: `../escape-${tag}`, data: "x" }] },
      { label: "abs-symlink", entries: [{ name: "evil", type: "2" as const, link: "/" }, { name: `evil/tmp/aenv-pwned-${tag}`, data: "x" }] },
      { label: "rel-symlink", entries: [{ name: "up", type: "2" as const, link: "../../../../../../../../" }, { name: `up/tmp/aenv-pwned-${tag}`, data: "x" }] },
      { label: "hardlink", entries: [{ name: "pw", type: "1" as const, link: "../../../../etc/passwd" }] },
    ];
    const clean = await leftovers();
    for (const c of cases) {
      const blob = join(dir, `${c.label}.tar`);
      await writeFile(blob, craftedTar(c.entries));
      const err = await layer([base], blob).catch((e) => e);
      expect(err, c.label).toBeInstanceOf(ConvertError);
      expect(err.code, `${c.label}: ${err.message}`).toBe("UnsafePath");
      expect(err.status).toBe(400);
      expect(err.message).toMatch(/\.\." component|runs through a symlink/);
    }
    expect(existsSync(hostTmp)).toBe(false);
    expect(await sh(["find", dir, "/var/tmp", "-maxdepth", "6", "-name", `*${tag}*`]).catch(() => "")).toBe("");
    expect(await leftovers()).toEqual(clean);
  }, 120_000);

  test("a damaged gzip stream (cut short, or bytes flipped) is CorruptLayer; a wrong diffID is DigestMismatch; nothing is cached", async () => {
    const clean = await leftovers();
    const good = readFileSync(join(dir, "one.tgz"));
    const cut = join(dir, "cut.tgz");
    await writeFile(cut, good);
    await truncate(cut, Math.floor(good.length / 2));
    const flipped = join(dir, "flipped.tgz");
    const bad = Buffer.from(good);
    for (let i = 4096; i < 8192; i++) bad[i] = bad[i]! ^ 0x5a;
    await writeFile(flipped, bad);
    for (const blob of [cut, flipped]) {
      // A diffID nothing is cached under: the stream fails before any digest is compared.
      const err = await convertLayer(ctx, [base], { blob, diffId: `sha256:${"1".repeat(64)}` }, SIZE).catch((e) => e);
      expect(err).toBeInstanceOf(ConvertError);
      expect(err.code, err.message).toBe("CorruptLayer");
      expect(err.message).toMatch(/gzip stream does not decode/);
    }
    const plain = join(dir, "plain.tar.gz");
    await writeFile(plain, gzipSync(craftedTar([{ name: "x", data: "x" }])));
    const err = await convertLayer(ctx, [base], { blob: plain, diffId: `sha256:${"0".repeat(64)}` }, SIZE).catch((e) => e);
    expect(err).toBeInstanceOf(ConvertError);
    expect(err.code).toBe("DigestMismatch");
    expect(await leftovers()).toEqual(clean);
  }, 120_000);
  test("a conversion killed mid-way (its work folder mounted, its device in blockd) is undone by the next process's first call", async () => {
    const crashed = join(dir, "cache2", "work", "999999999-deadbeef");
    await mkdir(crashed, { recursive: true });
    const dev = await client.call("create", { lowers: [base.path], upperDir: join(crashed, "upper"), size: SIZE, loop: true });
    await mkdir(join(crashed, "mnt"));
    await sh(["mount", "-t", "ext4", dev.loop, join(crashed, "mnt")]);
    const again = new LayerCache(join(dir, "cache2"));
    await emptyExt4Layer({ cache: again, blockd: client }, SIZE);
    expect(existsSync(crashed)).toBe(false);
    expect(readFileSync("/proc/self/mountinfo", "utf8")).not.toContain(crashed);
    expect(((await client.call("list")) as { id: string }[]).some((d) => d.id === dev.id)).toBe(false);
  }, 120_000);
});

describe("layer cache GC (real files, no blockd)", () => {
  test("between the watermarks, least recently used first; pinned and busy layers stay", async () => {
    const { scratchDir } = await import("../helpers/tmp.ts");
    const root = scratchDir("layer-gc");
    let pinned = new Set<string>();
    const cache = new LayerCache(root, { capacityBytes: 10 << 20, highWatermark: 0.8, lowWatermark: 0.5, pinned: () => pinned });
    await cache.init();
    const chains = Array.from({ length: 5 }, (_, i) => `sha256:${String(i).repeat(64)}`);
    for (const [i, c] of chains.entries()) {
      await writeFile(cache.layerPath(c), new Uint8Array(2 << 20).fill(1));
      const t = new Date(Date.UTC(2020, 0, 1 + i));
      await utimes(cache.layerPath(c), t, t);
    }
    // 10 MiB in use, above 8: the oldest go until at most 5 MiB remain, but 0 is pinned and 1 busy.
    pinned = new Set([cache.layerPath(chains[0]!)]);
    cache.hold([chains[1]!]);
    await Promise.all([0, 1].map(() => cache.gc())); // racing GCs share one pass
    const left = chains.filter((c) => existsSync(cache.layerPath(c)));
    expect(left).toEqual([chains[0], chains[1]]);
    expect(cache.stats.collected).toBe(3);
    cache.release([chains[1]!]);
    expect(await cache.gc()).toBe(0); // 4 MiB: below the high watermark
  });
});

const regSkip = registrySkipReason();
const pullRuns = canRun && !regSkip;
describe.skipIf(!pullRuns)(pullRuns ? "pull from a registry" : `pull from a registry (skipped: ${regSkip ?? why})`, async () => {
  if (!pullRuns) return void test.skip(regSkip ?? why, () => {});
  const { dir, client: blockd } = await startBlockd("pull");
  const reg = await startRegistry({ dir: join(dir, "registry") });
  const registry = new RegistryClient({ dockerConfigPath: null, insecureRegistries: [reg.host] });
  const cache = new LayerCache(join(dir, "cache"));

  test("an overlaybd image: its blobs are checked to be layers and cached as they are; the disk is their virtual size; a blob that is no layer is CorruptLayer, nothing cached", async () => {
    const root = await busyboxRoot(join(dir, "obd-root"));
    await writeFile(join(root, "etc/obd"), "native\n");
    const file = await overlaybdLayerOf(root, join(dir, "obd.layer"), 256);
    const img = await pushOverlaybdImage(registry, `${reg.host}/obd:1`, { layers: [file], config: BUSYBOX_CONFIG });
    const devices = async () => {
      const d = (await blockd.call("list")) as unknown[] | { devices: unknown[] };
      return (Array.isArray(d) ? d : d.devices).length;
    };
    const devicesBefore = await devices();
    const a = await pullImage(img.ref, { registry, cache, blockd });
    expect(a).toMatchObject({ overlaybdNative: true, converted: 1, cached: 0, diskSizeMB: 256 });
    expect(a.config).toMatchObject({ env: { FOO: "bar" }, workingDir: "/work" });
    // The cached layer is the blob's bytes (no empty ext4 layer, no conversion), and no device was left behind.
    expect(a.layers.length).toBe(1);
    expect(sha256(readFileSync(a.layers[0]!))).toBe(sha256(readFileSync(file)));
    expect(await devices()).toBe(devicesBefore);
    const dev = await blockd.call("createReadOnly", { lowers: a.layers, loop: true });
    const mnt = join(dir, "obd-mnt");
    await mkdir(mnt);
    await sh(["mount", "-t", "ext4", "-o", "ro,noload", dev.loop, mnt]);
    try {
      expect(await sh(["chroot", mnt, "/bin/sh", "-c", "cat /etc/obd"])).toBe("native\n");
    } finally {
      await sh(["umount", mnt]);
      await blockd.call("delete", { id: dev.id });
    }
    expect(await pullImage(img.ref, { registry, cache, blockd })).toMatchObject({ converted: 0, cached: 1, diskSizeMB: 256 });

    // Bytes that hash to their digest but are no overlaybd layer: refused, naming the blob; nothing cached.
    const layersBefore = readdirSync(join(dir, "cache", "layers")).sort();
    const junk = new TextEncoder().encode("not an overlaybd layer\n".repeat(200));
    const bad = await pushOverlaybdImage(registry, `${reg.host}/obd:junk`, { layers: [junk], config: BUSYBOX_CONFIG });
    const e = (await pullImage(bad.ref, { registry, cache, blockd }).catch((x) => x)) as ConvertError;
    expect(e).toBeInstanceOf(ConvertError);
    expect(e.code).toBe("CorruptLayer");
    expect(e.status).toBe(400);
    expect(e.message).toContain(bad.layers[0]!.digest);
    expect(e.message).toContain("not an overlaybd layer");
    expect(readdirSync(join(dir, "cache", "layers")).sort()).toEqual(layersBefore);
    expect(readdirSync(join(dir, "cache", "work"))).toEqual([]);
  }, 120_000);

  test("downloads overlap conversion: the next layer is asked for while one converts, and a layer is done before the image's last byte arrives", async () => {
    const work = join(dir, "overlap");
    const lower = await busyboxRoot(join(work, "root"));
    const upper = join(work, "top");
    await mkdir(upper, { recursive: true });
    await writeFile(join(upper, "top.txt"), "top\n");
    const img = await pushImage(registry, `${reg.host}/overlap:1`, { layers: [lower, upper], config: BUSYBOX_CONFIG });
    const last = img.layers.at(-1)!.digest;
    // A relay in front of the registry that holds the last blob until a layer is converted (at most 20 s).
    let release = () => {};
    const released = new Promise<void>((r) => (release = r));
    let lastAskedAt = 0;
    const relay = Bun.serve({
      hostname: "127.0.0.1",
      port: 0,
      async fetch(req) {
        const u = new URL(req.url);
        if (u.pathname.endsWith(`/blobs/${last}`)) {
          lastAskedAt ||= performance.now();
          await Promise.race([released, Bun.sleep(20_000)]);
        }
        const up = await fetch(`http://${reg.host}${u.pathname}${u.search}`, { method: req.method, headers: req.headers, redirect: "manual" });
        return new Response(up.body, { status: up.status, headers: up.headers });
      },
    });
    try {
      const events: { at: number; p: PullProgress }[] = [];
      const r = await pullImage(`127.0.0.1:${relay.port}/overlap:1`, {
        registry: new RegistryClient({ dockerConfigPath: null, insecureRegistries: [`127.0.0.1:${relay.port}`] }), cache: new LayerCache(join(work, "cache")), blockd,
        onProgress: (p) => {
          events.push({ at: performance.now(), p });
          if (p.layersDone >= 1) release();
        },
      });
      expect([r.converted, r.cached]).toEqual([2, 0]);
      const firstDone = events.find((e) => e.p.layersDone >= 1)!;
      expect(lastAskedAt).toBeGreaterThan(0);
      expect(lastAskedAt).toBeLessThan(firstDone.at);
      expect(firstDone.p.bytesDownloaded).toBeLessThan(firstDone.p.bytesTotal);
      expect(events.at(-1)!.p).toMatchObject({ phase: "done", layersDone: 2, bytesDownloaded: firstDone.p.bytesTotal });
    } finally {
      relay.stop(true);
    }
  }, 120_000);

  test("registry → pullImage → layers: whiteouts applied, config kept, a second image on the same base converts only its new layer", async () => {
    try {
      const wo = await pushWhiteoutImage(registry, `${reg.host}/wo:1`, { workDir: join(dir, "wo") });
      const progress: PullProgress[] = [];
      const a = await pullImage(wo.ref, { registry, cache, blockd, onProgress: (p) => progress.push(p) });
      expect(a.layers.length).toBe(4); // the empty ext4 layer + 3
      expect(a.converted).toBe(3);
      expect(a.diskSizeMB).toBe(20480);
      expect(a.config).toMatchObject({ env: { PATH: "/bin", FOO: "bar" }, workingDir: "/work", cmd: ["/bin/sh"] });
      const last = progress.at(-1)!;
      expect(last).toMatchObject({ phase: "done", layersDone: 3, layersTotal: 3, layersCached: 0 });
      expect(last.bytesDownloaded).toBe(wo.layers.reduce((s, l) => s + l.size, 0));
      expect(last.bytesPerSecond).toBeGreaterThan(0);

      const dev = await blockd.call("createReadOnly", { lowers: a.layers, loop: true });
      const mnt = join(dir, "mnt");
      await mkdir(mnt);
      await sh(["mount", "-t", "ext4", "-o", "ro,noload", dev.loop, mnt]);
      try {
        expect(readdirSync(join(mnt, "data"))).toEqual(["keep"]);
        expect(readdirSync(join(mnt, "opaque"))).toEqual(["new"]);
        expect(await sh(["chroot", mnt, "/bin/sh", "-c", "cat /data/keep"])).toBe("keep\n");
      } finally {
        await sh(["umount", mnt]);
        await blockd.call("delete", { id: dev.id });
      }

      // Same busybox layer (reproducible tars), one new layer on top: converted once, not again.
      const two = await pushTwoLayerImage(registry, `${reg.host}/two:1`, { workDir: join(dir, "two") });
      expect(two.diffIds[0]).toBe(wo.diffIds[0]);
      const b = await pullImage(two.ref, { registry, cache, blockd });
      expect([b.converted, b.cached]).toEqual([1, 1]);
      expect(b.layers[1]).toBe(a.layers[1]);
      expect(b.config.env.BAR).toBe("baz");
    } finally {
      await reg.stop();
    }
  }, 300_000);
});
