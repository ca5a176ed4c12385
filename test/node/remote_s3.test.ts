// Templates in S3: node A (one `bun run node`) makes a template of a busybox image from the
// loopback registry and `aenv push`es it to s3://templates/busybox:1 (an OCI image layout in the
// s3rver this test starts; both nodes have its endpoint and keys as their S3 settings). Node B, its
// own $AENV_HOME and an empty cache, creates a sandbox from `s3://templates/busybox:1` through
// POST /sandboxes-cold: its layers stay in S3, blockd's workers read them by ranged GET through B's
// block cache, so the bytes s3rver served (its request log) are fewer than the layers.
import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { randomBytes } from "node:crypto";
import { chmodSync, existsSync, mkdirSync, readdirSync, writeFileSync } from "node:fs";
import { rm } from "node:fs/promises";
import { join } from "node:path";
import { S3Client } from "bun";
import { Database } from "bun:sqlite";
import { Sandbox } from "e2b";
import { RegistryClient } from "../../src/template/registry.ts";
import { scratchDir } from "../helpers/tmp.ts";
import { requestLog, startS3Server, type TestS3 } from "../snapshot/s3_server.ts";
import { BUSYBOX_CONFIG, busyboxRoot, pushImage, registrySkipReason, registrySuite } from "../template/registry_harness.ts";
import { FIRST_START_MS, aenvAt, nodeSetup, nodeSkipReason, postJson, sdkOpts, startNode, stopNode, type NodeProc } from "./harness.ts";

const skip = nodeSkipReason() ?? registrySkipReason();
const KEY_A = "e2b_" + "d4".repeat(20);
const KEY_B = "e2b_" + "e5".repeat(20);
const BUILD_MS = 10 * 60_000;
const MiB = 2 ** 20;
/** A file no sandbox reads: the layers are this much larger than what a boot and a command read. */
const FILLER_MIB = 48;
const BUCKET = "templates";
const LOCATION = `s3://${BUCKET}/busybox:1`;

describe.skipIf(!!skip)("a template pushed to S3 by one node, started lazily from S3 by another", () => {
  if (skip) return void test.skip(skip!, () => {});
  const setupA = nodeSetup("sma", 241, KEY_A, { AENV_P2P: "0" });
  // B fetches only what is read (no background download), so s3rver's bytes show the lazy reads.
  const setupB = nodeSetup("smb", 242, KEY_B, { AENV_BLOCK_CACHE_DOWNLOAD: "0", AENV_P2P: "0" });
  const registry = registrySuite("remote-s3-registry");
  const dir = scratchDir("remote-s3", { keep: true });
  const log = join(dir, "s3.log");
  let s3: TestS3;
  let a: NodeProc;
  let b: NodeProc;
  /** Bytes s3rver answered GETs of these layers' blobs with. */
  const layerBytesServed = async (digests: string[]) => {
    const keys = new Set(digests.map((d) => `/${BUCKET}/busybox/blobs/sha256/${d.slice(7)}`));
    return (await requestLog(log)).filter((r) => r.method === "GET" && keys.has(r.path)).reduce((n, r) => n + r.bytes, 0);
  };

  beforeAll(async () => {
    s3 = await startS3Server(join(dir, "s3"), 30_000, { buckets: [BUCKET], log });
    const settings = {
      AENV_S3_ENDPOINT: s3.endpoint, AWS_REGION: "us-east-1", AWS_ACCESS_KEY_ID: "S3RVER", AWS_SECRET_ACCESS_KEY: "S3RVER",
      AENV_S3_BUCKETS: BUCKET, AENV_INSECURE_REGISTRIES: registry().insecure.join(","),
    };
    Object.assign(setupA.env, settings);
    Object.assign(setupB.env, settings);
    // One after the other: each boots its base template once on 2 shared cores.
    a = await startNode(setupA.env, FIRST_START_MS);
    b = await startNode(setupB.env, FIRST_START_MS);
  }, 2 * FIRST_START_MS + 60_000);
  afterAll(async () => {
    await stopNode(b, setupB);
    await stopNode(a, setupA);
    await s3?.stop();
    await rm(dir, { recursive: true, force: true });
  }, 360_000);

  test("A pushes its template to S3; B starts a sandbox from s3:// with an empty cache, fetching fewer bytes than the layers", async () => {
    const { reg } = registry();
    const root = await busyboxRoot(join(dir, "root"));
    writeFileSync(join(root, "bin/bash"), '#!/bin/sh\nexec /bin/busybox sh "$@"\n');
    chmodSync(join(root, "bin/bash"), 0o755);
    writeFileSync(join(root, "etc/motd"), "made on node A\n");
    mkdirSync(join(root, "data"));
    writeFileSync(join(root, "data/filler"), randomBytes(FILLER_MIB * MiB));
    const image = `${reg.host}/remote/busybox:1`;
    await pushImage(new RegistryClient({ dockerConfigPath: null, insecureRegistries: [reg.host] }), image, { layers: [root], config: BUSYBOX_CONFIG, compression: "none" });

    // A: a template of the image (pulled and converted, booted once), then pushed to S3.
    const made = await postJson(a, KEY_A, "/sandboxes-cold", { image });
    expect(made.status).toBe(201);
    const { sandboxID: first, templateID } = (await made.json()) as { sandboxID: string; templateID: string };
    await Sandbox.kill(first, sdkOpts(a, KEY_A));
    const pushed = await aenvAt(a, KEY_A, ["push", templateID, LOCATION, "--json"], BUILD_MS);
    expect({ code: pushed.code, err: pushed.err }).toMatchObject({ code: 0 });
    const answer = JSON.parse(pushed.out) as { ref: string; manifestDigest: string; layers: { digest: string; size: number; uploaded: boolean }[] };
    expect(answer.ref).toBe(LOCATION);
    expect(answer.layers.map((l) => l.uploaded)).toEqual(answer.layers.map(() => true));
    const raw = new S3Client({ bucket: BUCKET, endpoint: s3.endpoint, region: "us-east-1", accessKeyId: "S3RVER", secretAccessKey: "S3RVER" });
    const index = JSON.parse(await raw.file("busybox/index.json").text()) as { manifests: { digest: string }[] };
    expect(index.manifests.map((m) => m.digest)).toEqual([answer.manifestDigest]);
    // Pushed again: every blob is there (HEAD), nothing is sent; the plain answer is LOCATION@DIGEST.
    const again = await aenvAt(a, KEY_A, ["push", templateID, LOCATION], BUILD_MS);
    expect(again.code).toBe(0);
    expect(again.out).toBe(`${LOCATION}@${answer.manifestDigest}\n`);
    expect(again.err).toContain(": already there");
    // Credentials in the request are refused for S3; a bucket outside AENV_S3_BUCKETS is a 403 {code, message}.
    const withCreds = await postJson(a, KEY_A, `/templates/${templateID}/push`, { ref: LOCATION, username: "u", password: "p" });
    expect(withCreds.status).toBe(400);
    expect(((await withCreds.json()) as { message: string }).message).toContain("node's S3 settings");
    const unlisted = await postJson(a, KEY_A, `/templates/${templateID}/push`, { ref: "s3://no-such-bucket/x" });
    expect(unlisted.status).toBe(403);
    expect(await unlisted.json()).toEqual({ code: 403, message: expect.stringContaining("s3_buckets") });

    const digests = answer.layers.map((l) => l.digest);
    const layerBytes = answer.layers.reduce((s, l) => s + l.size, 0);
    expect(layerBytes).toBeGreaterThan(FILLER_MIB * MiB);
    const beforeB = await layerBytesServed(digests);

    // B: a sandbox from the S3 location, its layers read lazily from S3.
    const t0 = performance.now();
    const onB = await postJson(b, KEY_B, "/sandboxes-cold", { image: LOCATION });
    const onBText = await onB.text();
    expect({ status: onB.status, body: onBText }).toMatchObject({ status: 201 });
    const sb = JSON.parse(onBText) as { sandboxID: string; templateID: string };
    const sbx = await Sandbox.connect(sb.sandboxID, sdkOpts(b, KEY_B));
    const r = await sbx.commands.run("pwd; echo $FOO; cat /etc/motd");
    const firstMs = performance.now() - t0;
    expect(r.stdout).toBe("/work\nbar\nmade on node A\n");
    await Bun.sleep(300); // s3rver's log line follows its answer
    const firstBytes = (await layerBytesServed(digests)) - beforeB;
    console.log(`B's first sandbox from S3 (pull, boot, checkpoint, restore, command) in ${(firstMs / 1000).toFixed(1)} s fetched ${(firstBytes / MiB).toFixed(1)} MiB of ${(layerBytes / MiB).toFixed(1)} MiB of layers`);
    expect(firstBytes).toBeGreaterThan(0);
    expect(firstBytes).toBeLessThan(layerBytes / 2);
    // Nothing was downloaded whole: no layer file in B's image cache, chunks in its block cache.
    const bLayers = join(setupB.home, "image-layers", "layers");
    expect(existsSync(bLayers) ? readdirSync(bLayers) : []).toEqual([]);
    expect(readdirSync(join(setupB.home, "block-cache", "sparse")).length).toBeGreaterThan(0);
    // The template's record names its S3 origins without credentials.
    const rows = new Database(join(setupB.home, "node.db"), { readonly: true }).query("SELECT * FROM templates").all();
    const records = rows.map((row) => Object.values(row as object).map(String).join(" ")).join("\n");
    expect(records).toContain(`"kind":"s3"`);
    expect(records).not.toContain("S3RVER");
    await Sandbox.kill(sb.sandboxID, sdkOpts(b, KEY_B));

    // A location with no image is refused, naming it.
    const none = await postJson(b, KEY_B, "/sandboxes-cold", { image: `s3://${BUCKET}/nothing-here` });
    expect(none.status).toBe(400);
    expect(((await none.json()) as { message: string }).message).toContain("nothing-here");
  }, 3 * BUILD_MS);
});
