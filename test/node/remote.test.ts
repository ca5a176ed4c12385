// Templates live remotely: node A (one `bun run node`) makes a template of a busybox image from
// the loopback registry and `aenv push`es it back as an overlaybd image; node B (a second node,
// its own $AENV_HOME, port, slots and empty caches) creates sandboxes from that reference through
// POST /sandboxes-cold. B pulls it lazily: its layers stay in the registry, blockd's workers read
// them by HTTP Range through B's block cache, so the bytes the registry served (its access log)
// are fewer than the layers; a second sandbox on B is served from the cache (no more bytes).
// Node D is in a cluster with A: blockd reads a file no start read straight from A over HTTP
// (A's /v1/layers, the cluster's key), not from the registry. Node C has A as its only peer: it
// starts the pushed template, then, with the registry stopped, reads a file no start read, every
// chunk of it from A over iroh.
import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { randomBytes } from "node:crypto";
import { chmodSync, existsSync, mkdirSync, readdirSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { Sandbox } from "e2b";
import { SecretKey } from "@number0/iroh";
import { loadOrCreateSecretKey } from "../../p2p/index.ts";
import { PREFETCH_ROOTFS_ANNOTATION } from "../../src/template/prefetch_trace.ts";
import { RegistryClient } from "../../src/template/registry.ts";
import { scratchDir } from "../helpers/tmp.ts";
import { BUSYBOX_CONFIG, blobBytesServed, busyboxRoot, pushImage, registrySkipReason, registrySuite } from "../template/registry_harness.ts";
import { etcdSkipReason, etcdSuite } from "../services/harness.ts";
import { FIRST_START_MS, aenvAt, nodeSetup, nodeSkipReason, postJson, sdkOpts, startNode, stopNode, type NodeProc } from "./harness.ts";

const skip = nodeSkipReason() ?? registrySkipReason() ?? etcdSkipReason();
const KEY_A = "e2b_" + "a1".repeat(20);
const KEY_B = "e2b_" + "b2".repeat(20);
const KEY_C = "e2b_" + "c3".repeat(20);
const BUILD_MS = 10 * 60_000;
const MiB = 2 ** 20;
/** A file no sandbox reads: the layers are this much larger than what a boot and a command read. */
const FILLER_MIB = 48;

describe.skipIf(!!skip)("a template pushed by one node, started lazily by another", () => {
  if (skip) return void test.skip(skip!, () => {});
  // A's endpoint on a fixed loopback port; C asks A (its only peer), A lets C in.
  const p2pPort = 20_000 + Math.floor(Math.random() * 30_000);
  const setupA = nodeSetup("rma", 236, KEY_A, { AENV_P2P_BIND: `127.0.0.1:${p2pPort}` });
  // B fetches only what is read (no background download), so the registry's bytes show the lazy reads.
  const setupB = nodeSetup("rmb", 237, KEY_B, { AENV_BLOCK_CACHE_DOWNLOAD: "0", AENV_P2P: "0" });
  const setupC = nodeSetup("rmc", 238, KEY_C, { AENV_BLOCK_CACHE_DOWNLOAD: "0", AENV_P2P_BIND: "127.0.0.1:0" });
  // D shares A's cluster (and so its key); it fetches only what is read.
  const setupD = nodeSetup("rmd", 239, KEY_A, { AENV_BLOCK_CACHE_DOWNLOAD: "0", AENV_P2P_BIND: "127.0.0.1:0", AENV_NODE_ID: "rd" });
  const etcd = etcdSuite("remote-cluster-etcd");
  let d: NodeProc | undefined;
  const metric = async (n: NodeProc, name: string) => Number(new RegExp(`^${name} (\\d+)$`, "m").exec(await (await fetch(`${n.base}/metrics`)).text())?.[1]);
  const idOf = async (home: string) => SecretKey.fromBytes(await loadOrCreateSecretKey(home)).public().toString();
  let c: NodeProc | undefined;
  let pushedRef = "";
  let filler: Uint8Array;
  const registry = registrySuite("remote-node-registry", { accessLog: true });
  let a: NodeProc;
  let b: NodeProc;

  beforeAll(async () => {
    for (const s of [setupA, setupB, setupC, setupD]) s.env.AENV_INSECURE_REGISTRIES = registry().insecure.join(",");
    for (const s of [setupA, setupD]) s.env.AENV_CLUSTER = etcd.etcd().endpoints;
    setupA.env.AENV_NODE_ID = "ra";
    setupA.env.AENV_P2P_ALLOW = await idOf(setupC.home);
    setupC.env.AENV_P2P_PEERS = `${await idOf(setupA.home)}@127.0.0.1:${p2pPort}`;
    // One after the other: each boots its base template once on 2 shared cores.
    a = await startNode(setupA.env, FIRST_START_MS);
    b = await startNode(setupB.env, FIRST_START_MS);
  }, 2 * FIRST_START_MS + 60_000);
  afterAll(async () => {
    if (d) await stopNode(d, setupD);
    if (c) await stopNode(c, setupC);
    await stopNode(b, setupB);
    await stopNode(a, setupA);
  }, 360_000);

  test("A pushes its template as an overlaybd image; B starts sandboxes from it fetching fewer bytes than the layers, the second from its cache", async () => {
    const { reg } = registry();
    const client = new RegistryClient({ dockerConfigPath: null, insecureRegistries: [reg.host] });
    const root = await busyboxRoot(join(scratchDir("remote-node-image"), "root"));
    writeFileSync(join(root, "bin/bash"), '#!/bin/sh\nexec /bin/busybox sh "$@"\n');
    chmodSync(join(root, "bin/bash"), 0o755);
    writeFileSync(join(root, "etc/motd"), "made on node A\n");
    mkdirSync(join(root, "data"));
    filler = randomBytes(FILLER_MIB * MiB);
    writeFileSync(join(root, "data/filler"), filler);
    const image = `${reg.host}/remote/busybox:1`;
    await pushImage(client, image, { layers: [root], config: BUSYBOX_CONFIG, compression: "none" });

    // A: a template of the image (pulled and converted, booted once), then pushed as overlaybd.
    const made = await postJson(a, KEY_A, "/sandboxes-cold", { image });
    expect(made.status).toBe(201);
    const { sandboxID: first, templateID } = (await made.json()) as { sandboxID: string; templateID: string };
    await Sandbox.kill(first, sdkOpts(a, KEY_A));
    pushedRef = `${reg.host}/remote/pushed:1`;
    const pushed = await aenvAt(a, KEY_A, ["push", templateID, pushedRef], BUILD_MS);
    expect({ code: pushed.code, err: pushed.err }).toMatchObject({ code: 0 });
    expect(pushed.out).toMatch(new RegExp(`^${pushedRef.replace(/[.:/]/g, "\\$&")}@sha256:[0-9a-f]{64}\\n$`));
    expect(pushed.err).toContain(": pushed");
    // Pushed again: every blob is in the registry already (HEAD), nothing is sent.
    const again = await aenvAt(a, KEY_A, ["push", templateID, pushedRef, "--json"], BUILD_MS);
    expect(again.code).toBe(0);
    const answer = JSON.parse(again.out) as { manifestDigest: string; layers: { digest: string; size: number; uploaded: boolean }[]; trace?: { digest: string; size: number; uploaded: boolean } };
    expect(answer.layers.map((l) => l.uploaded)).toEqual(answer.layers.map(() => false));
    // The boot trace A recorded while it made the template went with it, named by the manifest.
    expect(answer.trace?.uploaded).toBe(false);
    expect(pushed.out.trim().endsWith(answer.manifestDigest)).toBe(true);
    const img = await client.resolve(pushedRef);
    expect(img.overlaybdNative).toBe(true);
    expect(img.annotations?.[PREFETCH_ROOTFS_ANNOTATION]).toBe(answer.trace!.digest);
    // Base first: the empty ext4 layer, then the image's files.
    expect(img.layers.map((l) => l.digest)).toEqual(answer.layers.map((l) => l.digest));
    expect(img.config).toMatchObject({ WorkingDir: "/work", User: "root" });
    expect(img.config.Env).toContain("FOO=bar");
    const digests = answer.layers.map((l) => l.digest);
    const layerBytes = answer.layers.reduce((s, l) => s + l.size, 0);
    expect(layerBytes).toBeGreaterThan(FILLER_MIB * MiB);
    const beforeB = await blobBytesServed(reg, digests);

    // B: a sandbox from the pushed reference, its layers read lazily from the registry.
    const t0 = performance.now();
    const onB = await postJson(b, KEY_B, "/sandboxes-cold", { image: pushedRef });
    expect(onB.status).toBe(201);
    const sb = (await onB.json()) as { sandboxID: string; templateID: string };
    const sbx = await Sandbox.connect(sb.sandboxID, sdkOpts(b, KEY_B));
    const r = await sbx.commands.run("pwd; echo $FOO; cat /etc/motd");
    const firstMs = performance.now() - t0;
    expect(r.stdout).toBe("/work\nbar\nmade on node A\n");
    const firstBytes = (await blobBytesServed(reg, digests)) - beforeB;
    console.log(`B's first sandbox (pull, boot, checkpoint, restore, command) in ${(firstMs / 1000).toFixed(1)} s fetched ${(firstBytes / MiB).toFixed(1)} MiB of ${(layerBytes / MiB).toFixed(1)} MiB of layers`);
    expect(firstBytes).toBeGreaterThan(0);
    expect(firstBytes).toBeLessThan(layerBytes / 2);
    // Nothing was downloaded whole: no layer file in B's image cache, chunks in its block cache.
    const bLayers = join(setupB.home, "image-layers", "layers");
    expect(existsSync(bLayers) ? readdirSync(bLayers) : []).toEqual([]);
    expect(readdirSync(join(setupB.home, "block-cache", "sparse")).length).toBeGreaterThan(0);
    // B replayed A's trace on its build VM and recorded its own boot: the template's checkpoint has it.
    expect(readdirSync(join(setupB.home, "checkpoints")).some((d) => existsSync(join(setupB.home, "checkpoints", d, "boot.trace")))).toBe(true);

    // A second sandbox on B: a restore of the same template, its reads served by the block cache.
    const second = await postJson(b, KEY_B, "/sandboxes-cold", { image: pushedRef });
    expect(second.status).toBe(201);
    const s2 = (await second.json()) as { sandboxID: string; templateID: string };
    expect(s2.templateID).toBe(sb.templateID);
    const sbx2 = await Sandbox.connect(s2.sandboxID, sdkOpts(b, KEY_B));
    expect((await sbx2.commands.run("pwd; echo $FOO; cat /etc/motd")).stdout).toBe("/work\nbar\nmade on node A\n");
    const secondBytes = (await blobBytesServed(reg, digests)) - beforeB - firstBytes;
    console.log(`B's second sandbox fetched ${(secondBytes / MiB).toFixed(1)} MiB`);
    expect(secondBytes).toBe(0);

    // Checkpoints over remote lowers: a pause and resume, and a snapshot (stored with its remote layers named, not copied) that a sandbox starts from.
    expect((await postJson(b, KEY_B, `/sandboxes/${sb.sandboxID}/pause`, {})).status).toBe(204);
    const resumed = await Sandbox.connect(sb.sandboxID, sdkOpts(b, KEY_B));
    expect((await resumed.commands.run("cat /etc/motd; echo resumed")).stdout).toBe("made on node A\nresumed\n");
    const snap = await postJson(b, KEY_B, `/sandboxes/${s2.sandboxID}/snapshots`, {});
    expect(snap.status).toBe(201);
    const { snapshotID } = (await snap.json()) as { snapshotID: string };
    const fromSnap = await Sandbox.create(snapshotID, sdkOpts(b, KEY_B));
    expect((await fromSnap.commands.run("cat /etc/motd; pwd")).stdout).toBe("made on node A\n/work\n");
    console.log(`B's pause, resume and snapshot fetched ${(((await blobBytesServed(reg, digests)) - beforeB - firstBytes) / MiB).toFixed(1)} MiB more`);
    for (const id of [sb.sandboxID, s2.sandboxID, fromSnap.sandboxId]) await Sandbox.kill(id, sdkOpts(b, KEY_B));

    // B pushes its lazily pulled template to another repository: its remote layers, held neither
    // whole nor as files, are copied from the registry (verified), and the image is the same.
    const copyRef = `${reg.host}/remote/copied:1`;
    const copied = await postJson(b, KEY_B, `/templates/${sb.templateID}/push`, { ref: copyRef });
    const copiedText = await copied.text();
    expect({ status: copied.status, body: copiedText }).toMatchObject({ status: 200 });
    const c = JSON.parse(copiedText) as { manifestDigest: string; layers: { digest: string; uploaded: boolean }[] };
    expect(c.layers.map((l) => l.digest)).toEqual(digests);
    expect(c.layers.map((l) => l.uploaded)).toEqual(digests.map(() => true));
    expect((await client.resolve(copyRef)).layers.map((l) => l.digest)).toEqual(digests);
    const bad = await postJson(b, KEY_B, `/templates/${sb.templateID}/push`, { ref: "not a reference" });
    expect(bad.status).toBe(400);
    expect(((await bad.json()) as { message: string }).message).toContain("not a reference");
    expect((await postJson(b, KEY_B, "/templates/no-such-template/push", { ref: copyRef })).status).toBe(404);
  }, 3 * BUILD_MS);

  test("D, in a cluster with A, starts the pushed template and reads a file no start read straight from A over HTTP", async () => {
    expect(pushedRef).not.toBe("");
    const { reg } = registry();
    const client = new RegistryClient({ dockerConfigPath: null, insecureRegistries: [reg.host] });
    const digests = (await client.resolve(pushedRef)).layers.map((l) => l.digest);
    d = await startNode(setupD.env, FIRST_START_MS);
    const servedBefore = await metric(a, "aenv_p2p_served_bytes_total");
    const registryBefore = await blobBytesServed(reg, digests);
    const made = await postJson(d, KEY_A, "/sandboxes-cold", { image: pushedRef });
    expect(made.status).toBe(201);
    const { sandboxID } = (await made.json()) as { sandboxID: string };
    const sbx = await Sandbox.connect(sandboxID, sdkOpts(d, KEY_A));
    const r = await sbx.commands.run("md5sum /data/filler", { timeoutMs: 300_000 });
    expect(r.stdout).toBe(`${new Bun.CryptoHasher("md5").update(filler).digest("hex")}  /data/filler\n`);
    const fromA = (await metric(a, "aenv_p2p_served_bytes_total")) - servedBefore;
    const fromRegistry = (await blobBytesServed(reg, digests)) - registryBefore;
    console.log(`  D read ${(fromA / MiB).toFixed(1)} MiB from A over HTTP, ${(fromRegistry / MiB).toFixed(1)} MiB from the registry`);
    expect(fromA).toBeGreaterThanOrEqual(FILLER_MIB * MiB);
    expect(fromRegistry).toBeLessThan(FILLER_MIB * MiB);
    await Sandbox.kill(sandboxID, sdkOpts(d, KEY_A));
  }, 2 * BUILD_MS);

  test("C, with A as its only peer, starts the pushed template and reads a file no start read from A while the registry is stopped", async () => {
    expect(pushedRef).not.toBe("");
    const { reg } = registry();
    c = await startNode(setupC.env, FIRST_START_MS);
    expect(c.log.join("\n")).toMatch(/p2p: endpoint [0-9a-f]{64} on .*, 1 peers/);
    const made = await postJson(c, KEY_C, "/sandboxes-cold", { image: pushedRef });
    expect(made.status).toBe(201);
    const { sandboxID } = (await made.json()) as { sandboxID: string };
    // The origin goes away: every chunk C has not read yet can come only from A.
    await reg.stop();
    const sbx = await Sandbox.connect(sandboxID, sdkOpts(c, KEY_C));
    const r = await sbx.commands.run("md5sum /data/filler; cat /etc/motd", { timeoutMs: 300_000 });
    expect(r.stdout).toBe(`${new Bun.CryptoHasher("md5").update(filler).digest("hex")}  /data/filler\nmade on node A\n`);
    // Counted on both ends: at least the file's bytes crossed from A to C over iroh.
    expect(await metric(c, "aenv_p2p_fetched_bytes_total")).toBeGreaterThanOrEqual(FILLER_MIB * MiB);
    expect(await metric(a, "aenv_p2p_served_bytes_total")).toBeGreaterThanOrEqual(FILLER_MIB * MiB);
    await Sandbox.kill(sandboxID, sdkOpts(c, KEY_C));
  }, 2 * BUILD_MS);
});
