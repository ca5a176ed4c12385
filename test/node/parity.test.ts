// E2B parity through the stock SDK against `bun run node` (real VMs): a filesystem-only pause and
// its reboot, and volumes mounted into sandboxes.
import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { existsSync, readdirSync } from "node:fs";
import { join } from "node:path";
import { Sandbox, Volume } from "e2b";
import { qemuPids } from "../vmm/harness.ts";
import { FIRST_START_MS, nodeSetup, nodeSkipReason, sdkOpts, startNode, stopNode, until, type NodeProc } from "./harness.ts";

const skip = nodeSkipReason();
const KEY = "e2b_" + "7a".repeat(20);

describe.skipIf(!!skip)("E2B parity: filesystem-only pause, volumes in sandboxes", () => {
  if (skip) return void test.skip(skip!, () => {});
  const setup = nodeSetup("par", 249, KEY, { AENV_REAPER_INTERVAL_MS: "200" });
  const { home, runDir } = setup;
  let node: NodeProc;
  const opts = () => sdkOpts(node, KEY);
  const bootId = async (s: Sandbox) => (await s.commands.run("cat /proc/sys/kernel/random/boot_id")).stdout.trim();

  beforeAll(async () => {
    node = await startNode(setup.env, FIRST_START_MS);
  }, FIRST_START_MS + 60_000);

  afterAll(() => stopNode(node, setup), 180_000);

  test("filesystem-only pause reboots on resume but keeps the filesystem; it keeps no memory layer", async () => {
    const sbx = await Sandbox.create("base", opts());
    await sbx.files.write("/home/user/kept.txt", "on disk");
    await sbx.commands.run("sleep 3600", { background: true });
    const before = await bootId(sbx);
    expect(await sbx.pause({ keepMemory: false })).toBe(true);
    expect(await sbx.isRunning()).toBe(false);
    expect((await Sandbox.getInfo(sbx.sandboxId, opts())).state).toBe("paused");
    // Its checkpoint holds the sealed disk only: no device state, no memory.
    const cps = readdirSync(join(home, "checkpoints")).filter((d) => d.startsWith(`${sbx.sandboxId}-`));
    expect(cps.length).toBe(1);
    expect(readdirSync(join(home, "checkpoints", cps[0]!))).toEqual(["rootfs.layer"]);
    const back = await Sandbox.connect(sbx.sandboxId, opts());
    expect(await back.isRunning()).toBe(true);
    expect(await bootId(back)).not.toBe(before);
    expect(await back.files.read("/home/user/kept.txt")).toBe("on disk");
    expect((await back.commands.list()).some((p) => p.cmd === "sleep 3600" || p.args.includes("sleep 3600"))).toBe(false);
    // envd took the sandbox's token again: commands as the default user and as root work.
    expect((await back.commands.run("whoami")).stdout.trim()).toBe("user");
    expect((await back.commands.run("whoami", { user: "root" })).stdout.trim()).toBe("root");
    // A memory pause after the reboot restores as usual.
    await back.commands.run("echo again > /tmp/mem.txt");
    expect(await back.pause()).toBe(true);
    const again = await Sandbox.connect(sbx.sandboxId, opts());
    expect(await bootId(again)).not.toBe(before);
    expect((await again.commands.run("cat /tmp/mem.txt")).stdout).toBe("again\n");
    await again.kill();
  }, 300_000);

  test("onResume 'reboot' boots a memory-paused sandbox on its disk (what the guest flushed)", async () => {
    const sbx = await Sandbox.create("base", opts());
    await sbx.files.write("/home/user/f.txt", "kept");
    await sbx.commands.run("sync");
    const before = await bootId(sbx);
    expect(await sbx.pause()).toBe(true);
    const back = await Sandbox.connect(sbx.sandboxId, { ...opts(), onResume: "reboot" } as Parameters<typeof Sandbox.connect>[1]);
    expect(await bootId(back)).not.toBe(before);
    expect(await back.files.read("/home/user/f.txt")).toBe("kept");
    await back.kill();
  }, 300_000);

  test("autoPauseMemory false: the expiry's pause is filesystem-only", async () => {
    const sbx = await Sandbox.create("base", { ...opts(), timeoutMs: 4_000, lifecycle: { onTimeout: { action: "pause", keepMemory: false } } } as Parameters<typeof Sandbox.create>[1]);
    await sbx.files.write("/home/user/x.txt", "x");
    // Listed as paused from its pause's start: done once its checkpoint holds the sealed disk (only).
    const listing = () => readdirSync(join(home, "checkpoints")).filter((d) => d.startsWith(`${sbx.sandboxId}-`)).map((d) => readdirSync(join(home, "checkpoints", d)));
    await until(() => JSON.stringify(listing()) === JSON.stringify([["rootfs.layer"]]), 60_000, "a checkpoint of the disk only");
    await until(async () => (await fetch(`${node.base}/sandboxes/${sbx.sandboxId}`, { headers: { "x-api-key": KEY } })).ok, 10_000);
    const back = await Sandbox.connect(sbx.sandboxId, opts());
    expect(await back.files.read("/home/user/x.txt")).toBe("x");
    await back.kill();
  }, 300_000);

  test("volumes: mounted read-write where asked, kept for the next sandbox and the content API; one writer at a time", async () => {
    const vopts = () => ({ ...opts(), apiUrl: node.base });
    const vol = await Volume.create("parity-data", vopts());
    await vol.writeFile("/seed.txt", "from the content API", vopts());
    const sbx = await Sandbox.create("base", { ...opts(), volumeMounts: { "/data": vol } });
    try {
      expect((await Sandbox.getInfo(sbx.sandboxId, opts())).volumeMounts).toEqual([{ name: "parity-data", path: "/data" }]);
      expect(await sbx.files.read("/data/seed.txt")).toBe("from the content API");
      // The default user writes there (the root is 1777); root too.
      await sbx.commands.run("mkdir -p /data/out && echo written-in-vm > /data/out/a.txt && sync");
      expect((await sbx.commands.run("stat -c %U /data/out/a.txt")).stdout.trim()).toBe("user");
      expect((await sbx.commands.run("findmnt -n -o FSTYPE,OPTIONS /data")).stdout).toMatch(/^ext4\s+rw/);
      // A second writer, a fork and a snapshot are refused while it is mounted; so is the content API.
      const second = await Sandbox.create("base", { ...opts(), volumeMounts: { "/mnt/v": "parity-data" } }).then(() => "created", (e: Error) => e.message);
      expect(second).toMatch(/409|mounted by sandbox/);
      expect(await Sandbox.fork(sbx.sandboxId, { ...opts(), count: 1 }).then(() => "forked", (e: Error) => e.message)).toMatch(/volumes/);
      expect(await vol.readFile("/seed.txt", vopts()).then(() => "read", (e: Error) => e.message)).toMatch(/409|mounted|sandbox/);
      // A memory pause keeps it held; the resume mounts the same volume.
      expect(await sbx.pause()).toBe(true);
      const back = await Sandbox.connect(sbx.sandboxId, opts());
      expect(await back.files.read("/data/out/a.txt")).toBe("written-in-vm\n");
      await back.commands.run("echo after-resume > /data/out/b.txt");
    } finally {
      await Sandbox.kill(sbx.sandboxId, opts());
    }
    // Free again: the content API and the next sandbox see what the first one wrote.
    expect(await vol.readFile("/out/b.txt", vopts())).toBe("after-resume\n");
    const next = await Sandbox.create("base", { ...opts(), volumeMounts: { "/srv/vol": "parity-data" } });
    expect((await next.commands.run("cat /srv/vol/out/a.txt /srv/vol/seed.txt")).stdout).toBe("written-in-vm\nfrom the content API");
    await next.kill();
    // Bad input: an unknown volume, a bad path.
    const unknown = await Sandbox.create("base", { ...opts(), volumeMounts: { "/data": "no-such-volume" } }).then(() => "created", (e: Error) => e.message);
    expect(unknown).toMatch(/not found/);
    const badPath = await Sandbox.create("base", { ...opts(), volumeMounts: { "/proc/x": vol } }).then(() => "created", (e: Error) => e.message);
    expect(badPath).toMatch(/system directory/);
    expect(await Volume.destroy(vol.volumeId, vopts())).toBe(true);
  }, 600_000);

  test("nothing is left: no sandboxes, no VMs of this node", async () => {
    expect(await Sandbox.list(opts()).nextItems()).toEqual([]);
    expect(qemuPids(runDir)).toEqual([]);
    expect(existsSync(join(runDir, "vms")) ? readdirSync(join(runDir, "vms")) : []).toEqual([]);
  }, 30_000);
});
