// Memory as overlaybd layers under real QEMU VMs (docs/vmm.md, "Memory layers"): a cold-booted
// VM's RAM file becomes the base layer; VMs restore from a blockd read-only device over the
// memory layers (mapped copy-on-write); a pause writes only the pages dirtied since into a new
// layer; many restores of one snapshot share one device and one copy in the page cache.

import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { copyFileSync, readFileSync, statSync, truncateSync } from "node:fs";
import { join } from "node:path";
import { guestCmdline } from "../../src/template/artifacts.ts";
import { QemuDriver } from "../../src/vmm/qemu.ts";
import type { SnapshotInfo, Vmm } from "../../src/vmm/types.ts";
import { startBlockd } from "../blockdev/harness.ts";
import { anonymousBytes, freePort, guestFixture, guestRun, guestSh, qemuPids, rmrf, runRoot, vmSkipReason, waitHttp, type GuestFixture } from "./harness.ts";

const skip = vmSkipReason();
if (skip) console.log(`QEMU memory-layer tests skipped: ${skip}`);

const GUEST_PORT = 8080;
const MiB = 1 << 20;

describe.skipIf(!!skip)("QEMU memory layers", async () => {
  if (skip) return void test.skip(skip!, () => {});
  const { dir, client } = await startBlockd("vmm-mem");
  const root = runRoot("vmm-mem");
  const driver = new QemuDriver();
  let fx: GuestFixture;
  const live = new Set<Vmm>();
  const devices: string[] = [];
  let tools = "";

  beforeAll(async () => {
    fx = await guestFixture();
    const t = await client.call("createReadOnly", { lowers: [fx.toolsLayer] });
    devices.push(t.id);
    tools = t.path;
  }, 180_000);

  afterAll(async () => {
    for (const vm of live) await vm.stop();
    rmrf(root);
  });

  const drives = async (name: string) => {
    const d = await client.call("create", { lowers: [fx.rootfsLayer], upperDir: join(dir, "uppers", name), size: 64 * MiB });
    devices.push(d.id);
    return [{ path: tools, readOnly: true }, { path: d.path as string }];
  };
  const net = (port: number) => ({ user: { forwards: [{ hostPort: port, guestPort: GUEST_PORT }] } });

  /** A read-only memory device over `layers` (blockd shares one per stack). */
  async function memDevice(layers: string[]) {
    const d = await client.call("createReadOnly", { lowers: layers });
    devices.push(d.id);
    return d as { id: string; path: string };
  }

  async function restore(snap: SnapshotInfo, name: string, layers: string[]) {
    const port = freePort();
    const mem = await memDevice(layers);
    const vm = await driver.restore(snap, { id: name, runDir: join(root, name), drives: await drives(name), net: net(port), memImage: mem.path });
    live.add(vm);
    await waitHttp(`http://127.0.0.1:${port}/health`, 45_000);
    return { vm, port, mem };
  }

  /** Snapshot of a VM on a memory image: its delta into `layer` by blockd; the VM is then stopped. */
  async function pauseInto(vm: Vmm, name: string) {
    const t0 = performance.now();
    const snap = await vm.snapshot(join(root, name));
    const t1 = performance.now();
    expect(snap.memoryImage).toBe(true);
    expect(snap.memPath).toBeUndefined();
    const d = snap.delta!;
    const layer = join(dir, `${name}.mem.layer`);
    const r = await client.call("memoryLayer", { out: layer, size: d.size, from: { pid: d.pid, address: d.address, pagesFile: d.pagesFile } });
    const t2 = performance.now();
    await vm.stop();
    live.delete(vm);
    console.log(`  ${name}: ${d.pages} dirty pages (${(d.pages * 4096 / MiB).toFixed(1)} MiB), layer ${(r.bytes / MiB).toFixed(1)} MiB; snapshot ${Math.round(t1 - t0)} ms, layer ${Math.round(t2 - t1)} ms, state ${statSync(snap.statePath).size} B`);
    return { snap, layer, pages: d.pages, bytes: r.bytes as number };
  }

  let base = "";
  let baseSnap: SnapshotInfo;

  test(
    "a cold boot's RAM file becomes the base layer; restores from the memory device run",
    async () => {
      const port = freePort();
      const vm = await driver.boot({
        id: "cold", runDir: join(root, "cold"), kernel: fx.kernel.vmlinux, initrd: fx.kernel.initrd,
        cmdline: guestCmdline({ httpdPort: GUEST_PORT, httpdRoot: "/srv/www" }), vcpus: 1, memMiB: 1024,
        drives: await drives("cold"), net: net(port), balloon: true,
      });
      live.add(vm);
      await waitHttp(`http://127.0.0.1:${port}/health`, 45_000);
      await guestSh(port, "echo cold > /dev/shm/marker");
      baseSnap = await vm.snapshot(join(root, "base"));
      await vm.stop();
      live.delete(vm);
      base = join(dir, "base.mem.layer");
      const r = await client.call("memoryLayer", { out: base, size: 1024 * MiB, from: { file: baseSnap.memPath } });
      // The layer holds the guest's touched pages, not its 1 GiB.
      expect(r.dataPages).toBeGreaterThan(0);
      expect(r.bytes).toBeLessThan(256 * MiB);
      expect(r.dataPages + r.zeroPages).toBe(262_144);

      const a = await restore(baseSnap, "a0", [base]);
      expect((await guestSh(a.port, "cat /dev/shm/marker")).trim()).toBe("cold");
      await a.vm.stop();
      live.delete(a.vm);
    },
    240_000,
  );

  test(
    "pause writes what was dirtied: 8 MiB written in a 1 GiB guest is a layer of about 8 MiB; every write survives every resume",
    async () => {
      let layers = [base];
      let snap = baseSnap;
      const sums: string[] = [];
      const pauses: Awaited<ReturnType<typeof pauseInto>>[] = [];
      for (let gen = 1; gen <= 3; gen++) {
        const { vm, port } = await restore(snap, `g${gen}`, layers);
        for (let g = 1; g < gen; g++) expect((await guestSh(port, `md5sum /dev/shm/f${g} | cut -d' ' -f1`)).trim()).toBe(sums[g - 1]!);
        expect((await guestSh(port, "cat /dev/shm/marker")).trim()).toBe("cold");
        sums.push(await guestRun(port, `dd if=/dev/urandom of=/dev/shm/f${gen} bs=1M count=8 2>/dev/null; md5sum /dev/shm/f${gen} | cut -d' ' -f1`));
        const p = await pauseInto(vm, `p${gen}`);
        pauses.push(p);
        layers = [...layers, p.layer];
        snap = p.snap;
      }
      const { vm, port } = await restore(snap, "g4", layers);
      for (let g = 1; g <= 3; g++) expect((await guestSh(port, `md5sum /dev/shm/f${g} | cut -d' ' -f1`)).trim()).toBe(sums[g - 1]!);
      for (const p of pauses) {
        // 8 MiB of data plus what the guest's kernel and processes touched meanwhile.
        expect(p.pages * 4096).toBeGreaterThanOrEqual(8 * MiB);
        expect(p.bytes).toBeLessThan(24 * MiB);
        expect(statSync(p.snap.statePath).size).toBeLessThan(256 << 10); // device state only
      }
      // A removed file's pages are reused or zeroed: still right after one more pause.
      await guestRun(port, "rm /dev/shm/f2; dd if=/dev/zero of=/dev/shm/z bs=1M count=4 2>/dev/null");
      const p = await pauseInto(vm, "p4");
      const again = await restore(p.snap, "g5", [...layers, p.layer]);
      expect((await guestSh(again.port, "ls /dev/shm")).split(/\s+/).filter(Boolean).sort()).toEqual(["f1", "f3", "marker", "z"]);
      expect((await guestSh(again.port, "md5sum /dev/shm/f3 | cut -d' ' -f1")).trim()).toBe(sums[2]!);
      expect((await guestSh(again.port, "tr -d '\\000' < /dev/shm/z | wc -c")).trim()).toBe("0");
      await again.vm.stop();
      live.delete(again.vm);
    },
    400_000,
  );

  test(
    "16 VMs restored from one snapshot share one memory device and one copy of it in the page cache",
    async () => {
      const vms: { vm: Vmm; port: number; mem: { id: string; path: string } }[] = [];
      try {
        for (let i = 0; i < 16; i++) vms.push(await restore(baseSnap, `s${i}`, [base]));
        expect(new Set(vms.map((v) => v.mem.id)).size).toBe(1);
        const dev = vms[0]!.mem.path;
        for (const v of vms) expect((await guestSh(v.port, "cat /dev/shm/marker")).trim()).toBe("cold");
        // Page cache of the device file: one copy, however many VMs map it.
        const cached = Number(Bun.spawnSync(["fincore", "-b", "-n", "-o", "RES", dev]).stdout.toString().trim());
        let mapped = 0;
        let shared = 0;
        for (const v of vms) {
          const smaps = readFileSync(`/proc/${v.vm.pid}/smaps`, "utf8");
          const at = smaps.indexOf(` ${dev}\n`);
          const block = smaps.slice(at, smaps.indexOf("VmFlags", at));
          mapped += Number(/\nRss:\s+(\d+) kB/.exec(block)![1]) * 1024;
          shared += Number(/\nShared_Clean:\s+(\d+) kB/.exec(block)![1]) * 1024;
        }
        console.log(`  16 restores: device pages cached ${(cached / MiB).toFixed(1)} MiB, mapped ${(mapped / MiB).toFixed(1)} MiB in all, ${(shared / MiB).toFixed(1)} MiB of it shared`);
        expect(cached).toBeGreaterThan(0);
        expect(cached).toBeLessThan(mapped / 4); // one copy for 16 mappings
        expect(shared).toBeGreaterThan(mapped * 0.8);
      } finally {
        for (const v of vms) {
          await v.vm.stop();
          live.delete(v.vm);
        }
      }
    },
    600_000,
  );

  test(
    "free page reporting gives a restored VM's freed pages back to the host; the shared image never changes",
    async () => {
      const hash = () => new Bun.CryptoHasher("sha256").update(readFileSync(base)).digest("hex");
      const before = hash();
      const { vm, port, mem } = await restore(baseSnap, "fpr", [base]);
      try {
        const idle = anonymousBytes(vm.pid, mem.path);
        await guestRun(port, "dd if=/dev/urandom of=/dev/shm/big bs=1M count=64 2>/dev/null");
        const full = anonymousBytes(vm.pid, mem.path);
        expect(full - idle).toBeGreaterThanOrEqual(64 * MiB);
        await guestRun(port, "rm /dev/shm/big");
        // The guest reports free 2 MiB blocks a couple of seconds after they are freed; a block its
        // allocator has not merged back to 2 MiB stays (as little as 7 of the 64 MiB came back under
        // a full run's load), so the guest drops its caches and compacts its memory, every 5 s.
        const settle = () => guestRun(port, "sync; echo 3 > /proc/sys/vm/drop_caches; echo 1 > /proc/sys/vm/compact_memory; true");
        const deadline = Date.now() + 60_000;
        let now = full;
        let compacted = 0;
        while (Date.now() < deadline && (now = anonymousBytes(vm.pid, mem.path)) > full - 32 * MiB) {
          if (Date.now() - compacted >= 5_000) {
            await settle();
            compacted = Date.now();
          }
          await Bun.sleep(500);
        }
        console.log(`  anonymous pages of the restored VM: idle ${(idle / MiB).toFixed(1)} MiB, after 64 MiB written ${(full / MiB).toFixed(1)} MiB, after it was freed ${(now / MiB).toFixed(1)} MiB`);
        expect(now).toBeLessThanOrEqual(full - 32 * MiB);
      } finally {
        await vm.stop();
        live.delete(vm);
      }
      expect(hash()).toBe(before);
      const again = await restore(baseSnap, "fpr2", [base]);
      expect((await guestSh(again.port, "cat /dev/shm/marker")).trim()).toBe("cold");
      await again.vm.stop();
      live.delete(again.vm);
    },
    180_000,
  );

  test("bad input: a truncated memory layer, an image of the wrong size, another accelerator's snapshot: named errors, no QEMU started", async () => {
    const cut = join(dir, "cut.mem.layer");
    copyFileSync(base, cut);
    truncateSync(cut, Math.floor(statSync(base).size / 2));
    await expect(client.call("createReadOnly", { lowers: [cut] })).rejects.toThrow(/FormatError|Truncated/);
    const spec = async (name: string) => ({ id: name, runDir: join(root, name), drives: await drives(name), net: net(freePort()) });
    // The tools disk as "memory": not the 1 GiB the snapshot's VM has.
    await expect(driver.restore(baseSnap, { ...(await spec("wrongsize")), memImage: tools })).rejects.toThrow(/holds \d+ bytes, the snapshot's VM has 1024 MiB/);
    const other = { ...baseSnap, extra: { ...baseSnap.extra, accel: driver.accel === "tcg" ? "kvm" : "tcg" } };
    const mem = await memDevice([base]);
    await expect(driver.restore(other, { ...(await spec("wrongaccel")), memImage: mem.path })).rejects.toThrow(/was taken under/);
    expect(qemuPids(join(root, "wrongsize"))).toEqual([]);
    expect(qemuPids(join(root, "wrongaccel"))).toEqual([]);
  }, 60_000);

  test("a memory layer compressed as a ZFile: smaller, and the VM restored over it reads its data back", async () => {
    const { vm, port } = await restore(baseSnap, "zf", [base]);
    const sum = await guestRun(port, "yes 'compressible memory' | head -c 8388608 > /dev/shm/z; md5sum /dev/shm/z | cut -d' ' -f1");
    const snap = await vm.snapshot(join(root, "zf-p"));
    const d = snap.delta!;
    const layer = join(dir, "zf.mem.layer");
    const r = await client.call("memoryLayer", { out: layer, size: d.size, from: { pid: d.pid, address: d.address, pagesFile: d.pagesFile }, zfile: "zstd" });
    await vm.stop();
    live.delete(vm);
    expect(r.bytes).toBeLessThan((r.dataPages * 4096) / 4);
    const again = await restore(snap, "zf2", [base, layer]);
    expect(await guestRun(again.port, "md5sum /dev/shm/z | cut -d' ' -f1")).toBe(sum);
    await again.vm.stop();
    live.delete(again.vm);
    await expect(client.call("memoryLayer", { out: join(dir, "bad.layer"), size: d.size, from: { file: base }, zfile: "gzip" })).rejects.toThrow(/zfile/);
  }, 120_000);

  test("a snapshot whose memory is in layers will not restore without its memory image", async () => {
    const { vm } = await restore(baseSnap, "nomem", [base]);
    const p = await pauseInto(vm, "nomem-p");
    await expect(driver.restore(p.snap, { id: "nomem2", runDir: join(root, "nomem2"), drives: await drives("nomem2"), net: net(freePort()) })).rejects.toThrow(/memImage/);
    expect(qemuPids(join(root, "nomem2"))).toEqual([]);
  }, 120_000);

  test("nothing leaks: no QEMU process, no device left", async () => {
    expect(live.size).toBe(0);
    expect(qemuPids(root)).toEqual([]);
    for (const id of devices) await client.call("delete", { id });
    expect((await client.call<unknown[]>("list")).length).toBe(0);
  }, 60_000);
});
