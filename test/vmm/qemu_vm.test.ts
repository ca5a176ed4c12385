// Real VMs under QEMU (TCG here, KVM where usable): a busybox rootfs served by blockd plus the
// shared tools disk; boot until the guest answers HTTP through a loopback forward, pause/resume,
// snapshot + restore into VMs with their own disk uppers, two restores side by side, and nothing
// left behind (QEMU processes, blockd devices).

import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { existsSync, lstatSync, mkdirSync, readdirSync, readFileSync, statSync } from "node:fs";
import { join } from "node:path";
import { dirname } from "node:path";
import { guestCmdline, toolsDisk } from "../../src/template/artifacts.ts";
import type { BlockdClient } from "../../src/blockdev/client.ts";
import { QemuDriver } from "../../src/vmm/qemu.ts";
import type { SnapshotInfo, Vmm } from "../../src/vmm/types.ts";
import { CONSOLE_LOG_MAX_BYTES } from "../../src/vmm/console.ts";
import { lookupUser, VMM_USER } from "../../src/vmm/vmm_user.ts";
import { startBlockd } from "../blockdev/harness.ts";
import { freePort, guestFixture, guestRun, guestSh, qemuPids, rmrf, runRoot, until, vmSkipReason, waitHttp, type GuestFixture } from "./harness.ts";

const skip = vmSkipReason();
if (skip) console.log(`QEMU VM tests skipped: ${skip}`);

const GUEST_PORT = 8080;
const DISK = 64 << 20;

describe.skipIf(!!skip)("QEMU microVMs", async () => {
  // bun runs a skipped describe's body: start nothing there, and show why it skipped.
  if (skip) return void test.skip(skip!, () => {});
  const { dir, client } = await startBlockd("vmm");
  const root = runRoot("vmm-test");
  const NICE = 5;
  const driver = new QemuDriver({ nice: NICE });
  let fx: GuestFixture;
  let devicesBefore = 0;
  const live = new Set<Vmm>();
  const devices: string[] = []; // rw devices to delete at the end
  let toolsRefs = 0;
  let toolsDev = "";
  console.log(`QEMU VM tests: accel ${driver.accel}`);

  beforeAll(async () => {
    fx = await guestFixture();
    devicesBefore = (await client.call<unknown[]>("list")).length;
  }, 180_000);

  afterAll(async () => {
    for (const vm of live) await vm.stop();
    rmrf(root);
  });

  async function toolsDrive() {
    const d = await client.call("createReadOnly", { lowers: [fx.toolsLayer] });
    toolsDev = d.id;
    toolsRefs++;
    return { path: d.path as string, readOnly: true };
  }

  async function rootfsDrive(c: BlockdClient, lowers: string[], name: string) {
    const d = await c.call("create", { lowers, upperDir: join(dir, "uppers", name), size: DISK });
    devices.push(d.id);
    return { id: d.id as string, path: d.path as string };
  }

  async function boot(name: string, port: number, lowers = [fx.rootfsLayer]) {
    const rootfs = await rootfsDrive(client, lowers, name);
    const vm = await driver.boot({
      id: name,
      runDir: join(root, name),
      kernel: fx.kernel.vmlinux,
      initrd: fx.kernel.initrd,
      cmdline: guestCmdline({ httpdPort: GUEST_PORT, httpdRoot: "/srv/www" }),
      vcpus: 1,
      memMiB: 256,
      drives: [await toolsDrive(), { path: rootfs.path }],
      net: { user: { forwards: [{ hostPort: port, guestPort: GUEST_PORT }] } },
      balloon: true,
    });
    live.add(vm);
    return { vm, rootfs };
  }

  async function stop(vm: Vmm) {
    await vm.stop();
    live.delete(vm);
  }

  /** Start a counter in the guest (1 per 100 ms into /tmp/counter); returns its pid. */
  async function startCounter(port: number): Promise<number> {
    const out = await guestSh(port, "setsid sh -c 'n=0; while :; do n=$((n+1)); echo $n > /tmp/counter; usleep 100000; done' </dev/null >/dev/null 2>&1 & echo $!");
    return Number(out.trim());
  }
  const counter = async (port: number) => Number((await guestSh(port, "cat /tmp/counter")).trim());
  const alive = async (port: number, pid: number) => (await guestSh(port, `kill -0 ${pid} && echo yes || echo no`)).trim() === "yes";

  let snap: SnapshotInfo;
  let counterPid = 0;
  // snap's memory as a base layer, and the read-only device over it that restores map.
  const baseLayer = join(dir, "snap1.mem.layer");
  let memDevice: Promise<string> | undefined;
  const memImage = () =>
    (memDevice ??= (async () => {
      await client.call("memoryLayer", { out: baseLayer, size: snap.spec.memMiB << 20, from: { file: snap.memPath } });
      const d = await client.call("createReadOnly", { lowers: [baseLayer] });
      devices.push(d.id);
      return d.path as string;
    })());
  // Restack renames the upper into the layer file: it must sit on the uppers' filesystem.
  const snap1Layer = join(dir, "snap1.rootfs.layer");
  const snap2Layer = join(dir, "snap2.rootfs.layer");

  test(
    "boot: blockd rootfs + shared tools disk; guest answers HTTP; our init is PID 1 in the user's root",
    async () => {
      const port = freePort();
      const t0 = performance.now();
      const { vm } = await boot("boot1", port);
      try {
        const ms = await waitHttp(`http://127.0.0.1:${port}/health`, 45_000);
        console.log(`  cold boot → HTTP: ${Math.round(performance.now() - t0)} ms (QEMU up after ${Math.round(performance.now() - t0 - ms)} ms)`);
        expect(vm.state).toBe("running");
        // Its threads at the driver's nice, and (a session of its own) its scheduler group too.
        const stat = readFileSync(`/proc/${vm.pid}/stat`, "utf8");
        expect(Number(stat.slice(stat.lastIndexOf(")") + 2).split(" ")[16])).toBe(NICE);
        if (existsSync("/proc/self/autogroup")) {
          expect(readFileSync(`/proc/${vm.pid}/autogroup`, "utf8")).toMatch(new RegExp(` nice ${NICE}\\n?$`));
          expect(readFileSync("/proc/self/autogroup", "utf8")).not.toBe(readFileSync(`/proc/${vm.pid}/autogroup`, "utf8"));
        }
        const mounts = await guestSh(port, "cat /proc/mounts");
        expect(mounts).toMatch(/^\/dev\/vdb \/ ext4 rw/m);
        expect(mounts).toMatch(/^\/dev\/vda \/agentenv ext4 ro/m);
        for (const fs of ["proc", "sysfs", "devtmpfs", "devpts"]) expect(mounts).toContain(` ${fs} `);
        expect(mounts).toMatch(/ \/run tmpfs /);
        expect((await guestSh(port, "cat /proc/1/cmdline | tr '\\0' ' '")).trim()).toBe("/agentenv/bin/busybox sh /agentenv/init/run");
        expect((await guestSh(port, "ip -4 addr show eth0")).trim()).toContain("10.0.2.15/24");
        // No envd on this tools disk: no supervisor was started, and nothing of ours is in the image.
        expect((await guestSh(port, "test -e /run/aenv/envd-supervisor.pid && echo yes || echo no")).trim()).toBe("no");
        expect((await guestSh(port, "ls /agentenv")).split(/\s+/)).toContain("init");
        const b = await vm.balloon(200);
        expect(b.targetMiB).toBe(200);
      } finally {
        await stop(vm);
      }
      expect(vm.state).toBe("stopped");
    },
    150_000,
  );

  test(
    "confined and bounded: QEMU runs as the VMM user under seccomp; a console flood leaves at most 1 MiB; run files 0600, dirs 0700",
    async () => {
      const port = freePort();
      const { vm } = await boot("confined1", port);
      try {
        await waitHttp(`http://127.0.0.1:${port}/health`, 45_000);
        const status = readFileSync(`/proc/${vm.pid}/status`, "utf8");
        const field = (name: string) => new RegExp(`^${name}:\\s*(.*)$`, "m").exec(status)![1]!.split(/\s+/);
        const user = (await lookupUser(VMM_USER))!;
        expect(user.uid).toBeGreaterThan(0);
        expect(field("Uid")).toEqual(Array(4).fill(String(user.uid)));
        expect(field("Gid")).toEqual(Array(4).fill(String(user.gid)));
        expect(field("Seccomp")).toEqual(["2"]);
        expect(field("NoNewPrivs")).toEqual(["1"]);
        expect(field("CapEff")).toEqual(["0000000000000000"]);

        // 4 MiB into the serial console, 4x the bound; the file never holds more than the bound.
        let largest = 0;
        let flooding = true;
        const watch = (async () => {
          while (flooding) {
            largest = Math.max(largest, existsSync(vm.consoleLog) ? statSync(vm.consoleLog).size : 0);
            await Bun.sleep(50);
          }
        })();
        const t0 = performance.now();
        await guestRun(port, "yes 0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ | head -c 4194304 > /dev/ttyS0; echo console-flood-done > /dev/ttyS0", 240_000);
        await vm.syncConsole();
        flooding = false;
        await watch;
        const size = statSync(vm.consoleLog).size;
        console.log(`  console flood: 4 MiB written in ${Math.round(performance.now() - t0)} ms; console.log ${size} B (largest seen ${largest} B)`);
        expect(Math.max(size, largest)).toBeLessThanOrEqual(CONSOLE_LOG_MAX_BYTES);
        // The newest output is there (what GET /logs reads: the last 64 KiB).
        const f = Bun.file(vm.consoleLog);
        expect(await f.slice(Math.max(0, f.size - 65536)).text()).toContain("console-flood-done");
        expect(size).toBeGreaterThan(CONSOLE_LOG_MAX_BYTES / 4);

        const runDir = join(root, "confined1");
        expect(statSync(runDir).mode & 0o777).toBe(0o700);
        const wrong: string[] = [];
        for (const name of readdirSync(runDir)) {
          const st = lstatSync(join(runDir, name));
          if (st.isSymbolicLink()) continue;
          const want = st.isDirectory() ? 0o700 : 0o600;
          if ((st.mode & 0o777) !== want) wrong.push(`${name} ${(st.mode & 0o777).toString(8)}`);
        }
        expect(wrong).toEqual([]);
      } finally {
        await stop(vm);
      }
    },
    300_000,
  );

  test(
    "adoption: a VM whose node was killed -9 is taken over; what its guest printed meanwhile reaches console.log; it snapshots",
    async () => {
      const port = freePort();
      const runDir = join(root, "adopt1");
      const rootfs = join(root, "adopt1-rootfs.ext4");
      await Bun.write(rootfs, Bun.file(fx.rootfsImage));
      const child = Bun.spawn([process.execPath, join(import.meta.dir, "qemu_boot_child.ts"), JSON.stringify({
        runDir, kernel: fx.kernel.vmlinux, initrd: fx.kernel.initrd, cmdline: guestCmdline({ httpdPort: GUEST_PORT, httpdRoot: "/srv/www" }),
        tools: fx.toolsImage, rootfs, port, guestPort: GUEST_PORT,
      })], { stdout: "pipe", stderr: "inherit" });
      // Its line says the guest answers; then the "node" dies and the VM runs on without one.
      const reader = child.stdout.getReader();
      let line = "";
      while (!line.includes("\n")) {
        const { done, value } = await reader.read();
        if (done) throw new Error(`the booting child exited (${await child.exited}) before its line`);
        line += new TextDecoder().decode(value);
      }
      const { pid: vmPid } = JSON.parse(line) as { pid: number };
      child.kill("SIGKILL");
      await child.exited;
      expect(qemuPids(root)).toContain(vmPid);
      await guestSh(port, "echo printed-while-no-node-ran > /dev/ttyS0");
      const vm = await driver.adopt(runDir);
      live.add(vm);
      try {
        expect([vm.pid, vm.state]).toEqual([vmPid, "running"]);
        await vm.syncConsole();
        expect(readFileSync(vm.consoleLog, "utf8")).toContain("printed-while-no-node-ran");
        const snapA = await vm.snapshot(join(root, "snap-adopt"));
        expect(vm.state).toBe("snapshotted");
        expect(statSync(snapA.statePath).size).toBeLessThan(1 << 20);
      } finally {
        await stop(vm);
      }
    },
    150_000,
  );

  test(
    "pause/resume: the guest stops answering while paused, its processes survive",
    async () => {
      const port = freePort();
      const { vm } = await boot("pause1", port);
      try {
        await waitHttp(`http://127.0.0.1:${port}/health`, 45_000);
        const pid = await startCounter(port);
        await Bun.sleep(500);
        await vm.pause();
        expect(vm.state).toBe("paused");
        const stalled = await fetch(`http://127.0.0.1:${port}/health`, { signal: AbortSignal.timeout(700) }).then(
          () => "answered",
          () => "no answer",
        );
        expect(stalled).toBe("no answer");
        await vm.resume();
        expect(vm.state).toBe("running");
        const c1 = await counter(port);
        await until(async () => (await counter(port)) > c1, 30_000, "the counter carries on");
        expect(await alive(port, pid)).toBe(true);
      } finally {
        await stop(vm);
      }
    },
    150_000,
  );

  test(
    "snapshot (resumable) + restack; the source keeps running",
    async () => {
      const port = freePort();
      const { vm, rootfs } = await boot("src1", port);
      try {
        await waitHttp(`http://127.0.0.1:${port}/health`, 45_000);
        counterPid = await startCounter(port);
        await guestSh(port, "echo before-snapshot > /root/marker");
        await Bun.sleep(300);
        const t0 = performance.now();
        snap = await vm.snapshot(join(root, "snap1"), { resumable: true });
        const tSnap = performance.now() - t0;
        // The disk as of the snapshot becomes a read-only layer; the source gets a fresh upper.
        await client.call("restack", { id: rootfs.id, layerPath: snap1Layer });
        console.log(`  snapshot: ${Math.round(tSnap)} ms (state ${statSync(snap.statePath).size} B), restack: ${Math.round(performance.now() - t0 - tSnap)} ms`);
        expect(vm.state).toBe("paused");
        expect(snap.memPath && existsSync(snap.memPath)).toBeTruthy();
        expect(statSync(snap.statePath).size).toBeLessThan(1 << 20); // device state only: RAM stays in the file
        await vm.resume();
        await guestSh(port, "echo after-snapshot > /root/source-only; sync");
        expect(await alive(port, counterPid)).toBe(true);
      } finally {
        await stop(vm);
      }
    },
    150_000,
  );

  test(
    "restore into a VM with its own upper: same files, same processes",
    async () => {
      expect(snap).toBeDefined();
      const port = freePort();
      const rootfs = await rootfsDrive(client, [fx.rootfsLayer, snap1Layer], "restore1");
      const t0 = performance.now();
      const spec = { id: "restore1", runDir: join(root, "restore1"), drives: [await toolsDrive(), { path: rootfs.path }], net: { user: { forwards: [{ hostPort: port, guestPort: GUEST_PORT }] } } };
      // Its VM had a balloon: its mem file, mapped private, would be punched by the balloon.
      await expect(driver.restore(snap, spec)).rejects.toThrow(/has a balloon/);
      const vm = await driver.restore(snap, { ...spec, memImage: await memImage() });
      live.add(vm);
      try {
        const tQemu = performance.now() - t0;
        await waitHttp(`http://127.0.0.1:${port}/health`, 45_000);
        console.log(`  restore → HTTP: ${Math.round(performance.now() - t0)} ms (QEMU + state load ${Math.round(tQemu)} ms)`);
        expect((await guestSh(port, "cat /root/marker")).trim()).toBe("before-snapshot");
        expect((await guestSh(port, "cat /root/source-only 2>&1 || true")).trim()).toContain("No such file");
        expect(await alive(port, counterPid)).toBe(true);
        const c1 = await counter(port);
        await until(async () => (await counter(port)) > c1, 30_000, "the restored counter carries on");
        // Its disk writes survive a drop of the guest page cache, i.e. they reached its own upper.
        await guestSh(port, "echo restored > /root/mine; sync; echo 3 > /proc/sys/vm/drop_caches");
        expect((await guestSh(port, "cat /root/mine")).trim()).toBe("restored");
      } finally {
        await stop(vm);
      }
    },
    150_000,
  );

  test(
    "two restores side by side: each its own state; the memory image is never written",
    async () => {
      expect(snap).toBeDefined();
      await memImage();
      const md5 = () => Bun.spawnSync(["md5sum", snap.memPath!, baseLayer]).stdout.toString();
      const before = md5();
      const vms: { vm: Vmm; port: number }[] = [];
      try {
        for (const name of ["fork-a", "fork-b"]) {
          const port = freePort();
          const rootfs = await rootfsDrive(client, [fx.rootfsLayer, snap1Layer], name);
          const vm = await driver.restore(snap, { id: name, runDir: join(root, name), drives: [await toolsDrive(), { path: rootfs.path }], net: { user: { forwards: [{ hostPort: port, guestPort: GUEST_PORT }] } }, memImage: await memImage() });
          live.add(vm);
          vms.push({ vm, port });
        }
        for (const { vm, port } of vms) {
          await waitHttp(`http://127.0.0.1:${port}/health`, 45_000);
          await guestSh(port, `echo ${vm.id} > /root/who; dd if=/dev/urandom of=/tmp/fill bs=1M count=16 2>/dev/null; sync`);
        }
        for (const { vm, port } of vms) {
          expect((await guestSh(port, "cat /root/who")).trim()).toBe(vm.id);
          expect((await guestSh(port, "cat /root/marker")).trim()).toBe("before-snapshot");
          expect(await alive(port, counterPid)).toBe(true);
        }
        expect(new Set(vms.map((v) => v.vm.pid)).size).toBe(2);
      } finally {
        for (const { vm } of vms) await stop(vm);
      }
      expect(md5()).toBe(before);
    },
    150_000,
  );

  test(
    "snapshot of a restored VM: device state plus its dirty pages, restored over memory layers",
    async () => {
      expect(snap).toBeDefined();
      const port = freePort();
      const rootfs = await rootfsDrive(client, [fx.rootfsLayer, snap1Layer], "gen2");
      const vm = await driver.restore(snap, { id: "gen2", runDir: join(root, "gen2"), drives: [await toolsDrive(), { path: rootfs.path }], net: { user: { forwards: [{ hostPort: port, guestPort: GUEST_PORT }] } }, memImage: await memImage() });
      live.add(vm);
      const base = baseLayer;
      const delta = join(dir, "snap2.mem.layer");
      let snap2: SnapshotInfo;
      try {
        await waitHttp(`http://127.0.0.1:${port}/health`, 45_000);
        await guestSh(port, "echo gen2 > /root/gen");
        snap2 = await vm.snapshot(join(root, "snap2"));
        await client.call("restack", { id: rootfs.id, layerPath: snap2Layer });
        // A private (copy-on-write) RAM mapping: the stream is device state only, the dirty pages wait in QEMU.
        expect(snap2.memPath).toBeUndefined();
        expect(snap2.memoryImage).toBe(true);
        expect(statSync(snap2.statePath).size).toBeLessThan(1 << 20);
        expect(vm.state).toBe("snapshotted");
        const d = snap2.delta!;
        expect(d.pages).toBeGreaterThan(0);
        await client.call("memoryLayer", { out: delta, size: d.size, from: { pid: d.pid, address: d.address, pagesFile: d.pagesFile } });
      } finally {
        await stop(vm);
      }
      const mem = await client.call("createReadOnly", { lowers: [base, delta] });
      devices.push(mem.id);
      const port3 = freePort();
      const rootfs3 = await rootfsDrive(client, [fx.rootfsLayer, snap1Layer, snap2Layer], "gen3");
      const spec3 = { id: "gen3", runDir: join(root, "gen3"), drives: [await toolsDrive(), { path: rootfs3.path }], net: { user: { forwards: [{ hostPort: port3, guestPort: GUEST_PORT }] } } };
      await expect(driver.restore(snap2, spec3)).rejects.toThrow(/memImage/);
      const vm3 = await driver.restore(snap2, { ...spec3, memImage: mem.path });
      live.add(vm3);
      try {
        await waitHttp(`http://127.0.0.1:${port3}/health`, 45_000);
        expect((await guestSh(port3, "cat /root/gen /root/marker")).trim()).toBe("gen2\nbefore-snapshot");
        expect(await alive(port3, counterPid)).toBe(true);
        // Its snapshot is a delta again; without resumable the VM may not run on.
        const snap3 = await vm3.snapshot(join(root, "snap3"));
        expect(snap3.memoryImage).toBe(true);
        expect(vm3.state).toBe("snapshotted");
        await expect(vm3.resume()).rejects.toThrow(/snapshotted/);
      } finally {
        await stop(vm3);
      }
    },
    150_000,
  );

  test(
    "envd on the tools disk: started by init, restarted by the supervisor when it dies",
    async () => {
      // A shell stand-in for envd; the real binary goes in the same way (toolsDisk({ envd })).
      const tools = await toolsDisk({ envd: join(import.meta.dir, "fake-envd.sh"), out: join(dirname(fx.toolsImage), "tools-test-envd.img") });
      const port = freePort();
      const envdPort = freePort();
      const rootfs = await rootfsDrive(client, [fx.rootfsLayer], "envd1");
      const vm = await driver.boot({
        id: "envd1",
        runDir: join(root, "envd1"),
        kernel: fx.kernel.vmlinux,
        initrd: fx.kernel.initrd,
        cmdline: guestCmdline({ httpdPort: GUEST_PORT, httpdRoot: "/srv/www" }),
        vcpus: 1,
        memMiB: 256,
        drives: [{ path: tools, readOnly: true }, { path: rootfs.path }],
        net: { user: { forwards: [{ hostPort: port, guestPort: GUEST_PORT }, { hostPort: envdPort, guestPort: 49983 }] } },
      });
      live.add(vm);
      try {
        await waitHttp(`http://127.0.0.1:${envdPort}/health`, 45_000);
        await waitHttp(`http://127.0.0.1:${port}/health`, 45_000);
        const first = (await guestSh(port, "cat /run/fake-envd/pid")).trim();
        await guestSh(port, `kill ${first}`);
        // The supervisor waits 1 s before starting it again.
        const deadline = Date.now() + 45_000;
        let second = first;
        while (second === first && Date.now() < deadline) {
          await Bun.sleep(200);
          second = (await guestSh(port, "cat /run/fake-envd/pid")).trim();
        }
        expect(second).not.toBe(first);
        await waitHttp(`http://127.0.0.1:${envdPort}/health`, 45_000);
        expect((await guestSh(port, "cat /run/aenv/envd.restarts")).trim()).toBe("1");
      } finally {
        await stop(vm);
      }
    },
    150_000,
  );

  test("a QEMU that cannot start reports its stderr", async () => {
    mkdirSync(join(root, "bad"), { recursive: true });
    const port = freePort();
    const blocker = Bun.listen({ hostname: "127.0.0.1", port, socket: { data() {} } });
    try {
      const err = await driver
        .boot({
          id: "bad",
          runDir: join(root, "bad"),
          kernel: fx.kernel.vmlinux,
          initrd: fx.kernel.initrd,
          cmdline: guestCmdline(),
          vcpus: 1,
          memMiB: 128,
          drives: [{ path: fx.toolsImage, readOnly: true }],
          net: { user: { forwards: [{ hostPort: port, guestPort: GUEST_PORT }] } },
        })
        .then(
          () => undefined,
          (e: Error) => e,
        );
      expect(err?.message).toContain("host forwarding");
      expect(err?.name).toContain("StartFailed");
    } finally {
      blocker.stop(true);
    }
  }, 30_000);

  test("nothing leaks: no QEMU process, no device beyond the ones we delete", async () => {
    expect(live.size).toBe(0);
    expect(qemuPids(root)).toEqual([]);
    for (const id of devices) await client.call("delete", { id });
    for (let i = 0; i < toolsRefs; i++) await client.call("delete", { id: toolsDev });
    expect((await client.call<unknown[]>("list")).length).toBe(devicesBefore);
  }, 30_000);
});
