// Firecracker for real, where it can run: a Firecracker binary, a usable (non-PVM) /dev/kvm, and a
// guest kernel built by guest/kernel/build-firecracker-kernel.sh (AENV_FC_KERNEL, or the guest
// cache). The same sandbox as sandbox_vm.test.ts: tools disk with envd as the root device, the
// user's rootfs on blockd, the VM in a network slot; boot, pause/resume, snapshot and a restore
// into a second slot after the source VM's run directory and devices are gone, MMDS data, vsock,
// rate limits, balloon statistics, Diff snapshots with dirty tracking, adoption by a second driver.
// Elsewhere it prints why it skipped.
import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { existsSync, readdirSync } from "node:fs";
import { join } from "node:path";
import { envdToolsDisk, guestCmdline, sealedLayer } from "../../src/template/artifacts.ts";
import { SlotPool, type Slot } from "../../src/network/index.ts";
import { FirecrackerDriver, type FirecrackerVm, firecrackerAvailable, getMmds } from "../../src/vmm/firecracker.ts";
import type { Vmm } from "../../src/vmm/types.ts";
import { startBlockd } from "../blockdev/harness.ts";
import { guestFixture, rmrf, runRoot, type GuestFixture } from "./harness.ts";

function fcKernel(): string | undefined {
  if (process.env.AENV_FC_KERNEL) return process.env.AENV_FC_KERNEL;
  const dir = join(import.meta.dir, "../../guest/.cache/kernel-firecracker");
  const found = existsSync(dir) ? readdirSync(dir).find((n) => n.startsWith("vmlinux-")) : undefined;
  return found && join(dir, found);
}

function skipReason(): string | undefined {
  const fc = firecrackerAvailable();
  if (!fc.usable) return `Firecracker cannot run here: ${fc.reason}`;
  const k = fcKernel();
  if (!k || !existsSync(k)) return "no Firecracker guest kernel (run guest/kernel/build-firecracker-kernel.sh or set AENV_FC_KERNEL)";
  if (!existsSync("/dev/net/tun")) return "no /dev/net/tun for the slot's TAP";
  return undefined;
}

const skip = skipReason();
if (skip) console.log(`Firecracker VM tests skipped: ${skip}`);

describe.skipIf(!!skip)("Firecracker microVMs", async () => {
  // bun runs a skipped describe's body: start nothing there, and show why it skipped.
  if (skip) return void test.skip(skip!, () => {});
  const { dir, client } = await startBlockd("fc-vm");
  const root = runRoot("fc-vm");
  const driver = new FirecrackerDriver();
  const pool = new SlotPool({ size: 0, prefix: `afc${process.pid % 1000}-`, hostCidr: `10.215.${process.pid % 250}.0/24`, hostTable: `aenv_fctest` });
  const live = new Set<Vmm>();
  let fx: GuestFixture;
  let toolsLayer = "";

  beforeAll(async () => {
    fx = await guestFixture();
    toolsLayer = await sealedLayer(await envdToolsDisk());
    await pool.start();
  }, 240_000);
  afterAll(async () => {
    for (const vm of live) await vm.stop().catch(() => {});
    await pool.destroy().catch(() => {});
    rmrf(root);
  });

  const deviceIds = new Map<string, string[]>();
  async function drives(name: string) {
    const tools = await client.call("createReadOnly", { lowers: [toolsLayer] });
    const rootfs = await client.call("create", { lowers: [fx.rootfsLayer], upperDir: join(dir, name), size: 64 << 20 });
    deviceIds.set(name, [tools.id as string, rootfs.id as string]);
    return [{ path: tools.path as string, readOnly: true }, { path: rootfs.path as string }];
  }
  async function health(s: Slot, ms = 30_000): Promise<void> {
    const end = Date.now() + ms;
    for (;;) {
      try {
        if ((await fetch(`http://${s.nsIp}:49983/health`, { signal: AbortSignal.timeout(1000) })).status === 204) return;
      } catch {}
      if (Date.now() > end) throw new Error(`envd in slot ${s.id} did not answer`);
      await Bun.sleep(50);
    }
  }

  test("boot with MMDS, vsock, limits and a balloon; pause/resume, snapshot, restore into another slot once the source is gone", async () => {
    const a = await pool.acquire();
    const cmdline = guestCmdline({ ip: `${a.guestIp}/${a.guestPrefixLen}`, gw: a.gatewayIp, extra: "init=/init/disk-init" });
    const d = await drives("a");
    const vm = (await driver.boot({
      id: "fc-a", runDir: join(root, "a"), kernel: fcKernel()!, cmdline, vcpus: 1, memMiB: 256,
      drives: [d[0]!, { ...d[1]!, rateLimit: { bandwidth: { size: 64 << 20, refillTimeMs: 1000 } } }], net: { tap: a.tap, mac: a.guestMac }, netnsPath: a.netnsPath,
      netRateLimit: { rx: { bandwidth: { size: 32 << 20, refillTimeMs: 1000 } } }, metadata: { sandboxId: "fc-a" }, vsock: true, balloon: true,
    })) as FirecrackerVm;
    live.add(vm);
    await health(a);
    expect(await vm.api.send(getMmds())).toEqual({ sandboxId: "fc-a" });
    expect(existsSync(vm.vsockPath!)).toBe(true);
    const stats = await vm.balloonStatistics();
    expect(stats.actualMib).toBeLessThanOrEqual(256);
    await vm.setRateLimits({ drives: [undefined, { bandwidth: { size: 0, refillTimeMs: 0 } }] });
    await vm.pause();
    await vm.resume();
    await health(a);
    const snap = await vm.snapshot(join(root, "snap"));
    expect(snap.extra).toMatchObject({ snapshotType: "Full", drives: ["drive-0", "drive-1"] });
    await vm.stop();
    live.delete(vm);
    // The restore reopens per-VM drive names: neither the source's run directory nor its devices are needed.
    rmrf(join(root, "a"));
    for (const id of deviceIds.get("a")!) await client.call("delete", { id });
    const b = await pool.acquire();
    const vm2 = (await driver.restore(snap, {
      id: "fc-b", runDir: join(root, "b"), drives: await drives("b"), net: { tap: b.tap, mac: b.guestMac }, netnsPath: b.netnsPath, metadata: { sandboxId: "fc-b" },
    })) as FirecrackerVm;
    live.add(vm2);
    await health(b);
    // MMDS data is not part of a snapshot: the restore put this VM's own.
    expect(await vm2.api.send(getMmds())).toEqual({ sandboxId: "fc-b" });
    await vm2.stop();
    live.delete(vm2);
    expect(vm2.state).toBe("stopped");
    await pool.release(a);
    await pool.release(b);
  }, 180_000);

  test("dirty tracking: a Diff snapshot of a restored VM is merged onto its memory base and restores", async () => {
    const tracking = new FirecrackerDriver({ trackDirtyPages: true });
    const a = await pool.acquire();
    const cmdline = guestCmdline({ ip: `${a.guestIp}/${a.guestPrefixLen}`, gw: a.gatewayIp, extra: "init=/init/disk-init" });
    const vm = await tracking.boot({ id: "fc-d1", runDir: join(root, "d1"), kernel: fcKernel()!, cmdline, vcpus: 1, memMiB: 256, drives: await drives("d1"), net: { tap: a.tap, mac: a.guestMac }, netnsPath: a.netnsPath });
    live.add(vm);
    await health(a);
    const s1 = await vm.snapshot(join(root, "snap-d1"));
    expect(s1.extra).toMatchObject({ snapshotType: "Diff" });
    await vm.stop();
    live.delete(vm);
    const vm2 = await tracking.restore(s1, { id: "fc-d2", runDir: join(root, "d2"), drives: await drives("d2"), net: { tap: a.tap, mac: a.guestMac }, netnsPath: a.netnsPath });
    live.add(vm2);
    await health(a);
    const s2 = await vm2.snapshot(join(root, "snap-d2"));
    expect(s2.extra).toMatchObject({ snapshotType: "Diff", base: s1.memPath });
    await vm2.stop();
    live.delete(vm2);
    const vm3 = await tracking.restore(s2, { id: "fc-d3", runDir: join(root, "d3"), drives: await drives("d3"), net: { tap: a.tap, mac: a.guestMac }, netnsPath: a.netnsPath });
    live.add(vm3);
    await health(a);
    await vm3.stop();
    live.delete(vm3);
    await pool.release(a);
  }, 180_000);

  test("adopt: a second driver (a restarted node) takes over a running VM by its run directory", async () => {
    const a = await pool.acquire();
    const cmdline = guestCmdline({ ip: `${a.guestIp}/${a.guestPrefixLen}`, gw: a.gatewayIp, extra: "init=/init/disk-init" });
    const vm = await driver.boot({
      id: "fc-adopt", runDir: join(root, "adopt"), kernel: fcKernel()!, cmdline, vcpus: 1, memMiB: 256,
      drives: await drives("adopt"), net: { tap: a.tap, mac: a.guestMac }, netnsPath: a.netnsPath,
    });
    live.add(vm);
    await health(a);
    const adopted = await new FirecrackerDriver().adopt(join(root, "adopt"));
    live.add(adopted);
    expect(adopted.pid).toBe(vm.pid);
    expect(adopted.state).toBe("running");
    await adopted.pause();
    expect(await new FirecrackerDriver().adopt(join(root, "adopt")).then((v) => v.state)).toBe("paused");
    await adopted.resume();
    await health(a);
    await adopted.stop();
    expect(adopted.state).toBe("stopped");
    await expect(new FirecrackerDriver().adopt(join(root, "adopt"))).rejects.toMatchObject({ code: "BadState" });
    live.delete(vm);
    live.delete(adopted);
    await pool.release(a);
  }, 180_000);
});
