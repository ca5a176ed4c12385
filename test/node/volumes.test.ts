// Volumes through the stock e2b SDK's `Volume` class against a real node: the team routes, the
// content API with the volume's own token, paths that try to leave the volume, symlinks a guest
// left pointing at host files, racing writers, and the data across a node killed with -9. Volumes
// need blockd and e2fsprogs, not a VM: the node's VMM is left unavailable (a Firecracker binary
// that does not exist), so its start stops at the VMM step after the volumes are served, and no
// guest boots on this shared machine. Attach/detach between sandboxes is test/orchestrator/volumes.test.ts.
import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { existsSync, readFileSync } from "node:fs";
import { join } from "node:path";
import { AuthenticationError, Volume, VolumeError, VolumeNotFoundError, VolumePathNotFoundError } from "e2b";
import { BlockdClient } from "../../src/blockdev/client.ts";
import { NODE_ENTRY, startService } from "../../services/cluster/procs.ts";
import { haveFuse } from "../blockdev/harness.ts";
import { prng, sha256 } from "../helpers/tmp.ts";
import { nodeSetup, stopNode, until, type NodeProc } from "./harness.ts";

const haveTools = ["debugfs", "e2fsck", "mkfs.ext4"].every((t) => Bun.which(t, { PATH: `${process.env.PATH}:/usr/sbin:/sbin` }));
const skip = haveFuse && haveTools ? undefined : "needs root, /dev/fuse and e2fsprogs (debugfs, e2fsck, mkfs.ext4)";
const KEY = "e2b_" + "7e".repeat(20);
/** Until the volume routes answer: blockd started, the empty ext4 layer not yet made. */
const SERVE_MS = 120_000;

describe.skipIf(!!skip)("volumes through the e2b SDK", () => {
  if (skip) return void test.skip(skip, () => {});
  const setup = nodeSetup("vol", 248, KEY, {
    AENV_P2P: "0", AENV_VOLUME_SIZE_MB: "256", AENV_VMM: "firecracker", AENV_FIRECRACKER_BIN: "/nonexistent/firecracker",
  });
  let node: NodeProc;
  const api = () => ({ apiKey: KEY, apiUrl: node.base });
  /** The content API is on the node's own port: the SDK's E2B_VOLUME_API_URL, given per call. */
  const at = () => ({ apiUrl: node.base });

  async function start(): Promise<NodeProc> {
    const { proc, url, log } = await startService(NODE_ENTRY, setup.env, { logLines: 10_000 });
    await until(async () => {
      if (proc.exitCode !== null) throw new Error(`node exited: ${log.slice(-30).join("\n")}`);
      return (await fetch(`${url}/volumes`, { headers: { "x-api-key": KEY } }).catch(() => undefined))?.status === 200;
    }, SERVE_MS, "GET /volumes 200");
    return { proc, base: url, log };
  }

  beforeAll(async () => {
    node = await start();
  }, SERVE_MS + 30_000);
  afterAll(() => stopNode(node, setup), 180_000);

  /** The node's blockd devices. */
  async function devices(): Promise<{ id: string; path: string }[]> {
    const bd = await BlockdClient.connect(join(setup.home, "blockd", "blockd.sock"));
    try {
      return await bd.call<{ id: string; path: string }[]>("list");
    } finally {
      bd.close();
    }
  }

  /** A guest's doings on the volume's open device, with debugfs (the device stays open 10 s after a call). */
  async function asGuest(volumeId: string, commands: string): Promise<void> {
    const dev = (await devices()).find((d) => d.id === `vol-${volumeId}`);
    if (!dev) throw new Error(`volume ${volumeId} has no open device`);
    const p = Bun.spawn(["debugfs", "-w", "-f", "-", dev.path], { stdin: Buffer.from(commands), stdout: "pipe", stderr: "pipe" });
    await p.exited;
  }

  test("create, list, getInfo, connect, destroy; bad and taken names are 400 and 409", async () => {
    const vol = await Volume.create("crud-vol", api());
    expect(vol.name).toBe("crud-vol");
    expect(vol.token.length).toBeGreaterThan(20);
    expect((await Volume.list(api())).map((v) => v.name)).toContain("crud-vol");
    const info = await Volume.getInfo(vol.volumeId, api());
    expect(info).toMatchObject({ volumeId: vol.volumeId, name: "crud-vol", token: vol.token });
    const again = await Volume.connect(vol.volumeId, api());
    expect(again.token).toBe(vol.token);
    for (const bad of ["has space", "slash/name", "dot.name", "x".repeat(129)]) {
      await expect(Volume.create(bad, api())).rejects.toThrow(/^400: /);
    }
    await expect(Volume.create("crud-vol", api())).rejects.toThrow(/^409: /);
    expect(await Volume.destroy(vol.volumeId, api())).toBe(true);
    expect(await Volume.destroy(vol.volumeId, api())).toBe(false);
    await expect(Volume.getInfo(vol.volumeId, api())).rejects.toBeInstanceOf(VolumeNotFoundError);
    // Its token opens nothing any more.
    await expect(again.list("/", at())).rejects.toThrow(/^403: /);
  }, 120_000);

  test("files: a string, bytes, a streamed body of MiBs; read back as text, bytes and a stream", async () => {
    const vol = await Volume.create("files-vol", api());
    const w = await vol.writeFile("/hello.txt", "Hello, World!", at());
    expect(w).toMatchObject({ name: "hello.txt", path: "/hello.txt", type: "file", size: 13, mode: 0o644 });
    expect(await vol.readFile("/hello.txt", at())).toBe("Hello, World!");
    const all = Uint8Array.from({ length: 256 }, (_, i) => i);
    await vol.writeFile("bytes.bin", all.buffer, at());
    expect(await vol.readFile("/bytes.bin", { ...at(), format: "bytes" })).toEqual(all);
    await vol.writeFile("/empty", "", at());
    expect(await vol.readFile("/empty", at())).toBe("");
    // 6 MiB in 64 KiB chunks, sent as the SDK streams a ReadableStream (chunked, no length).
    const rand = prng(248);
    const chunks = Array.from({ length: 96 }, () => Uint8Array.from({ length: 65536 }, () => (rand() * 256) | 0));
    const whole = Buffer.concat(chunks);
    let i = 0;
    const body = new ReadableStream<Uint8Array>({ pull(c) { if (i < chunks.length) c.enqueue(chunks[i++]!); else c.close(); } });
    const big = await vol.writeFile("/big/blob", body, { ...at(), force: true });
    expect(big.size).toBe(whole.length);
    const stream = await vol.readFile("/big/blob", { ...at(), format: "stream" });
    expect(sha256(new Uint8Array(await new Response(stream).arrayBuffer()))).toBe(sha256(whole));
    expect(sha256(await vol.readFile("/big/blob", { ...at(), format: "bytes" }))).toBe(sha256(whole));
    // An existing file is replaced.
    await vol.writeFile("/hello.txt", "again", { ...at(), force: true });
    expect(await vol.readFile("/hello.txt", at())).toBe("again");
  }, 180_000);

  test("directories: makeDir with force, list with depth, getInfo, exists, updateMetadata, remove", async () => {
    const vol = await Volume.create("dirs-vol", api());
    await expect(vol.makeDir("/a/b", at())).rejects.toBeInstanceOf(VolumePathNotFoundError);
    const made = await vol.makeDir("/deep/nested/structure", { ...at(), force: true, uid: 1000, gid: 1000, mode: 0o750 });
    expect(made).toMatchObject({ type: "directory", path: "/deep/nested/structure", name: "structure", uid: 1000, gid: 1000, mode: 0o750 });
    await expect(vol.makeDir("/deep", at())).rejects.toThrow(/^409: /);
    await vol.writeFile("/deep/nested/structure/file.txt", "Content", { ...at(), uid: 1000, gid: 1000, mode: 0o600 });
    expect((await vol.list("/deep", at())).map((e) => e.path)).toEqual(["/deep/nested"]);
    const two = await vol.list("/deep", { ...at(), depth: 3 });
    expect(two.map((e) => e.path)).toEqual(["/deep/nested", "/deep/nested/structure", "/deep/nested/structure/file.txt"]);
    expect(two[2]).toMatchObject({ type: "file", size: 7, uid: 1000, gid: 1000, mode: 0o600 });
    expect(two[2]!.mtime).toBeInstanceOf(Date);
    expect(Math.abs(two[2]!.mtime.getTime() - Date.now())).toBeLessThan(10 * 60_000);
    expect((await vol.list("/", at())).map((e) => e.name)).toContain("deep");
    await expect(vol.list("/nope", at())).rejects.toBeInstanceOf(VolumePathNotFoundError);
    const info = await vol.getInfo("deep/nested", at());
    expect(info).toMatchObject({ name: "nested", type: "directory", path: "/deep/nested" });
    expect(await vol.exists("/deep/nested/structure/file.txt", at())).toBe(true);
    expect(await vol.exists("/deep/missing", at())).toBe(false);
    const updated = await vol.updateMetadata("/deep/nested/structure/file.txt", { uid: 1001, gid: 1002, mode: 0o755 }, at());
    expect(updated).toMatchObject({ type: "file", uid: 1001, gid: 1002, mode: 0o755, path: "/deep/nested/structure/file.txt" });
    await expect(vol.updateMetadata("/none", { mode: 0o644 }, at())).rejects.toBeInstanceOf(VolumePathNotFoundError);
    await vol.remove("/deep/nested/structure/file.txt", at());
    expect(await vol.exists("/deep/nested/structure/file.txt", at())).toBe(false);
    await vol.writeFile("/deep/nested/x", "x", at());
    await vol.remove("/deep", at());
    expect(await vol.exists("/deep", at())).toBe(false);
    await expect(vol.remove("/deep", at())).rejects.toBeInstanceOf(VolumePathNotFoundError);
    await expect(vol.readFile("/deep/nested/x", at())).rejects.toBeInstanceOf(VolumePathNotFoundError);
    await expect(vol.getInfo("/deep", at())).rejects.toBeInstanceOf(VolumePathNotFoundError);
  }, 180_000);

  test("the token: none is 401, another volume's is refused", async () => {
    const vol = await Volume.create("token-vol", api());
    const other = await Volume.create("token-other", api());
    await vol.writeFile("/secret", "mine", at());
    const wrong = new Volume(vol.volumeId, vol.name, other.token);
    await expect(wrong.readFile("/secret", at())).rejects.toThrow(/^403: /);
    await expect(wrong.writeFile("/secret", "theirs", at())).rejects.toThrow(/^403: /);
    const none = await fetch(`${node.base}/volumecontent/${vol.volumeId}/file?path=/secret`);
    expect(none.status).toBe(401);
    expect(((await none.json()) as { code: unknown }).code).toBe("401");
    // The API key is not a volume's token.
    const withKey = await fetch(`${node.base}/volumecontent/${vol.volumeId}/file?path=/secret`, { headers: { authorization: `Bearer ${KEY}` } });
    expect(withKey.status).toBe(403);
    await expect(new Volume(vol.volumeId, vol.name, "").readFile("/secret", at())).rejects.toBeInstanceOf(AuthenticationError);
    expect(await vol.readFile("/secret", at())).toBe("mine");
  }, 120_000);

  test("paths stay in the volume: `..` stops at its root, names it cannot quote are 400", async () => {
    const vol = await Volume.create("paths-vol", api());
    const e = await vol.writeFile("../../../tmp-aenv-escape/x", "inside", { ...at(), force: true });
    expect(e.path).toBe("/tmp-aenv-escape/x");
    expect(existsSync("/tmp-aenv-escape")).toBe(false);
    expect(await vol.readFile("/a/../../tmp-aenv-escape/./x", at())).toBe("inside");
    await expect(vol.writeFile('/quote"name', "x", at())).rejects.toThrow(/^400: /);
    await expect(vol.writeFile("/new\nline", "x", at())).rejects.toThrow(/^400: /);
    await expect(vol.remove("/", at())).rejects.toThrow(/^400: /);
    const spaced = await vol.writeFile("/with space/ünï 😀.txt", "ok", { ...at(), force: true });
    expect(spaced.name).toBe("ünï 😀.txt");
    expect((await vol.list("/with space", at())).map((x) => x.name)).toEqual(["ünï 😀.txt"]);
  }, 120_000);

  test("a symlink a guest left to /etc/passwd is the volume's /etc/passwd, never the host's", async () => {
    const vol = await Volume.create("links-vol", api());
    await vol.writeFile("/marker", "written", at()); // the device is open (and will be sealed) for the next 10 s
    await asGuest(vol.volumeId, "symlink /link /etc/passwd\nsymlink /rel ../../../../etc/passwd\nsymlink /root-link /\n");
    const link = await vol.getInfo("/link", at());
    expect(link).toMatchObject({ type: "symlink", target: "/etc/passwd" });
    await expect(vol.readFile("/link", at())).rejects.toBeInstanceOf(VolumePathNotFoundError);
    await expect(vol.readFile("/root-link/etc/passwd", at())).rejects.toBeInstanceOf(VolumePathNotFoundError);
    await vol.writeFile("/etc/passwd", "the volume's own", { ...at(), force: true });
    expect(readFileSync("/etc/passwd", "utf8")).not.toContain("the volume's own");
    expect(await vol.readFile("/link", at())).toBe("the volume's own");
    expect(await vol.readFile("/rel", at())).toBe("the volume's own");
    expect(await vol.readFile("/root-link/etc/passwd", at())).toBe("the volume's own");
    // A remove takes the link, not what it names.
    await vol.remove("/link", at());
    expect(await vol.readFile("/etc/passwd", at())).toBe("the volume's own");
    expect((await vol.list("/", at())).find((x) => x.name === "rel")).toMatchObject({ type: "symlink", target: "../../../../etc/passwd" });
  }, 120_000);

  test("two writers racing on one path: both are answered, the file is one of the two", async () => {
    const vol = await Volume.create("race-vol", api());
    const a = "a".repeat(1 << 20);
    const b = "b".repeat(1 << 20);
    const [ra, rb] = await Promise.allSettled([vol.writeFile("/race", a, at()), vol.writeFile("/race", b, at())]);
    expect([ra.status, rb.status]).toEqual(["fulfilled", "fulfilled"]);
    const got = await vol.readFile("/race", at());
    expect(got === a || got === b).toBe(true);
  }, 120_000);

  test("the data outlives a node killed with -9 while the volume's device is open", async () => {
    const vol = await Volume.create("durable-vol", api());
    await vol.makeDir("/keep", at());
    await vol.writeFile("/keep/data.txt", "survives", at());
    // Within the device's idle time: its writes are in its upper, not yet sealed.
    expect((await devices()).map((d) => d.id)).toContain(`vol-${vol.volumeId}`);
    node.proc.kill("SIGKILL");
    await node.proc.exited;
    node = await start();
    // The device the killed node left open was taken back and sealed without complaint.
    expect(node.log.some((l) => l.includes("] volumes"))).toBe(true);
    expect(node.log.filter((l) => l.includes("volumes: "))).toEqual([]);
    expect((await devices()).map((d) => d.id)).not.toContain(`vol-${vol.volumeId}`);
    const back = await Volume.connect(vol.volumeId, api());
    expect(back.token).toBe(vol.token);
    expect(await back.readFile("/keep/data.txt", at())).toBe("survives");
    expect((await back.list("/keep", at())).map((e) => e.name)).toEqual(["data.txt"]);
    expect(await (await Volume.connect((await Volume.list(api())).find((v) => v.name === "files-vol")!.volumeId, api())).readFile("/hello.txt", at())).toBe("again");
  }, 240_000);

  test("errors: the SDK's error classes for missing paths and volumes", async () => {
    const vol = await Volume.create("errors-vol", api());
    await expect(vol.readFile("/missing", at())).rejects.toBeInstanceOf(VolumePathNotFoundError);
    await expect(vol.readFile("/missing", { ...at(), format: "stream" })).rejects.toBeInstanceOf(VolumePathNotFoundError);
    await expect(vol.readFile("/", at())).rejects.toBeInstanceOf(VolumeError);
    await expect(vol.writeFile("/no/parent/file", "x", at())).rejects.toBeInstanceOf(VolumePathNotFoundError);
    await expect(Volume.getInfo("00000000-0000-0000-0000-000000000000", api())).rejects.toBeInstanceOf(VolumeNotFoundError);
    expect(await Volume.destroy("00000000-0000-0000-0000-000000000000", api())).toBe(false);
  }, 120_000);
});
