// QEMU command-line construction (no VM): microvm with a file-backed RAM object, drives in guest
// order, loopback-only forwards, TAP, the TCG TSC fix, and the restore variant; the RAM file copy.

import { describe, expect, test } from "bun:test";
import { existsSync, openSync, closeSync, ftruncateSync, statSync, writeSync } from "node:fs";
import { join } from "node:path";
import { driveDescriptors, effectiveCmdline, probeKvm, qemuArgs, qemuOptValue, resolveAccel, sparseCopy, type QemuLaunch } from "../../src/vmm/qemu.ts";
import { VmmError, netnsArgv, type VmSpec } from "../../src/vmm/types.ts";
import { scratchDir } from "../helpers/tmp.ts";

const spec: VmSpec = {
  id: "vm-1",
  runDir: "/run/vm-1",
  kernel: "/k/vmlinux",
  initrd: "/k/initrd.cpio",
  cmdline: "console=ttyS0 quiet",
  vcpus: 1,
  memMiB: 256,
  drives: [{ path: "/tools.img", readOnly: true }, { path: "/state/dev/rw-1" }],
  net: { user: { forwards: [{ hostPort: 20001, guestPort: 49983 }, { hostPort: 20002, guestPort: 8080 }] } },
  balloon: true,
};
const launch: QemuLaunch = {
  spec,
  accel: "tcg",
  ram: { path: "/dev/shm/vm-1/ram", share: true },
  qmpSocket: "/run/vm-1/qmp.sock",
  fdMonitor: "/run/vm-1/qmp-fd.sock",
  consoleLog: "/run/vm-1/console.log",
  pidFile: "/run/vm-1/qemu.pid",
  tscKhz: 2596134,
};

/** The value following each occurrence of flag. */
function values(args: string[], flag: string): string[] {
  return args.flatMap((a, i) => (a === flag ? [args[i + 1]!] : []));
}

describe("qemuArgs", () => {
  test("boot: microvm over a shared RAM file, drives in order, forwards on loopback, balloon, QMP", () => {
    const a = qemuArgs(launch);
    expect(values(a, "-M")).toEqual(["microvm,acpi=on,memory-backend=ram0"]);
    expect(values(a, "-object")).toEqual(["memory-backend-file,id=ram0,size=256M,mem-path=/dev/shm/vm-1/ram,share=on"]);
    expect(values(a, "-accel")).toEqual(["tcg"]);
    expect(values(a, "-cpu")).toEqual(["max"]);
    expect(values(a, "-smp")).toEqual(["1"]);
    expect(values(a, "-m")).toEqual(["256M"]);
    expect(values(a, "-kernel")).toEqual(["/k/vmlinux"]);
    expect(values(a, "-initrd")).toEqual(["/k/initrd.cpio"]);
    expect(values(a, "-append")).toEqual(["console=ttyS0 quiet tsc_early_khz=2596134 tsc=reliable"]);
    // Drives are descriptors the node opened (QEMU under -runas cannot open the paths): a read-only
    // one for each drive, and a read-write one for a writable drive, in one fdset per drive.
    expect(values(a, "-add-fd")).toEqual(["fd=4,set=1", "fd=5,set=2", "fd=6,set=2"]);
    expect(driveDescriptors(spec.drives)).toEqual([
      { drive: 0, fdset: 1, fd: 4, write: false }, { drive: 1, fdset: 2, fd: 5, write: false }, { drive: 1, fdset: 2, fd: 6, write: true },
    ]);
    expect(values(a, "-drive")).toEqual([
      "id=d0,file=/dev/fdset/1,format=raw,if=none,cache=writeback,aio=threads,readonly=on",
      "id=d1,file=/dev/fdset/2,format=raw,if=none,cache=writeback,aio=threads",
    ]);
    expect(values(a, "-device")).toEqual(["virtio-blk-device,drive=d0", "virtio-blk-device,drive=d1", "virtio-net-device,netdev=n0", "virtio-balloon-device,deflate-on-oom=on,free-page-reporting=on"]);
    expect(values(a, "-netdev")).toEqual(["user,id=n0,hostfwd=tcp:127.0.0.1:20001-:49983,hostfwd=tcp:127.0.0.1:20002-:8080"]);
    expect(values(a, "-qmp")).toEqual(["unix:/run/vm-1/qmp.sock,server=on,wait=off", "unix:/run/vm-1/qmp-fd.sock,server=on,wait=off"]);
    // The console is a bounded ring in QEMU, drained by the node: no file QEMU appends to.
    expect(values(a, "-chardev")).toEqual([`ringbuf,id=console,size=${256 << 10}`]);
    expect(values(a, "-serial")).toEqual(["chardev:console"]);
    expect(values(a, "-pidfile")).toEqual(["/run/vm-1/qemu.pid"]);
    for (const f of ["-nodefaults", "-no-user-config", "-no-reboot"]) expect(a).toContain(f);
    expect(a).not.toContain("-incoming");
  });

  test("restore: the snapshot's RAM file mapped private, waiting for the stream", () => {
    const a = qemuArgs({ ...launch, ram: { path: "/snap/mem", share: false }, incoming: true });
    expect(values(a, "-object")).toEqual(["memory-backend-file,id=ram0,size=256M,mem-path=/snap/mem,share=off"]);
    expect(values(a, "-incoming")).toEqual(["defer"]);
  });

  test("confinement: seccomp sandbox always; -runas an unprivileged user, with setuid left to -runas itself", () => {
    const root = qemuArgs(launch);
    expect(values(root, "-sandbox")).toEqual(["on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny"]);
    expect(root).not.toContain("-runas");
    const dropped = qemuArgs({ ...launch, runAs: "aenv-vmm" });
    expect(values(dropped, "-sandbox")).toEqual(["on,obsolete=deny,elevateprivileges=allow,spawn=deny,resourcecontrol=deny"]);
    expect(values(dropped, "-runas")).toEqual(["aenv-vmm"]);
    expect(() => qemuArgs({ ...launch, runAs: "-evil" })).toThrow(/runas/);
    // A restore reads its device state from an inherited descriptor, never through exec:.
    const restore = qemuArgs({ ...launch, runAs: "aenv-vmm", incoming: true });
    expect(values(restore, "-incoming")).toEqual(["defer"]);
    expect(restore.join(" ")).not.toContain("exec:");
  });

  test("TCG's translated-code cache: tb-size when set, QEMU's default otherwise, nothing under KVM", () => {
    const accelOf = (a: string[]) => a[a.indexOf("-accel") + 1];
    expect(accelOf(qemuArgs({ ...launch, accel: "tcg", tcgCacheMiB: 16 }))).toBe("tcg,tb-size=16");
    expect(accelOf(qemuArgs({ ...launch, accel: "tcg" }))).toBe("tcg");
    expect(accelOf(qemuArgs({ ...launch, accel: "kvm", tcgCacheMiB: 16 }))).toBe("kvm");
  });

  test("KVM: host CPU and the command line untouched", () => {
    const a = qemuArgs({ ...launch, accel: "kvm" });
    expect(values(a, "-accel")).toEqual(["kvm"]);
    expect(values(a, "-cpu")).toEqual(["host"]);
    expect(values(a, "-append")).toEqual(["console=ttyS0 quiet"]);
  });

  test("TAP with a MAC; no network at all", () => {
    const a = qemuArgs({ ...launch, spec: { ...spec, net: { tap: "tap-s1", mac: "02:00:00:00:00:01" } } });
    expect(values(a, "-netdev")).toEqual(["tap,id=n0,ifname=tap-s1,script=no,downscript=no"]);
    expect(values(a, "-device")).toContain("virtio-net-device,netdev=n0,mac=02:00:00:00:00:01");
    const none = qemuArgs({ ...launch, spec: { ...spec, net: undefined, balloon: false } });
    expect(none).not.toContain("-netdev");
    expect(values(none, "-device")).toEqual(["virtio-blk-device,drive=d0", "virtio-blk-device,drive=d1"]);
  });

  test("refusals: forwards off loopback, bad ports, bad TAP names, bad sizes", () => {
    const withFwd = (hostAddr: string, hostPort = 1) => ({ ...launch, spec: { ...spec, net: { user: { forwards: [{ hostAddr, hostPort, guestPort: 80 }] } } } });
    expect(() => qemuArgs(withFwd("0.0.0.0"))).toThrow(/loopback/);
    expect(() => qemuArgs(withFwd("10.0.0.1"))).toThrow(/loopback/);
    expect(qemuArgs(withFwd("127.0.0.2", 9000)).join(" ")).toContain("hostfwd=tcp:127.0.0.2:9000-:80");
    expect(() => qemuArgs(withFwd("127.0.0.1", 70000))).toThrow(/port/);
    expect(() => qemuArgs({ ...launch, spec: { ...spec, net: { tap: "tap0,script=/evil" } } })).toThrow(/TAP/);
    expect(() => qemuArgs({ ...launch, spec: { ...spec, memMiB: 0 } })).toThrow(/memMiB/);
    expect(() => qemuArgs({ ...launch, spec: { ...spec, vcpus: 0 } })).toThrow(/vcpus/);
  });

  test("netns: the VMM argv runs under `nsenter --net=<path>`; paths that could be options are refused", () => {
    const argv = ["qemu-system-x86_64", "-name", "vm-1"];
    expect(netnsArgv(undefined, argv)).toEqual(argv);
    expect(netnsArgv("/run/netns/aenv-3", argv)).toEqual(["nsenter", "--net=/run/netns/aenv-3", "--", ...argv]);
    for (const bad of ["-all", "", "aenv-3", "/run/netns/../x", "/x y"]) expect(() => netnsArgv(bad, argv)).toThrow(/namespace/);
  });

  test("commas in paths are doubled so they cannot add options", () => {
    expect(qemuOptValue("/a,b/c")).toBe("/a,,b/c");
    const a = qemuArgs({ ...launch, spec: { ...spec, kernel: "/k,initrd=/evil" } });
    expect(values(a, "-kernel")[0]).toBe("/k,,initrd=/evil");
  });

  test("tsc_early_khz is added once, only under TCG", () => {
    expect(effectiveCmdline("quiet", "tcg", 1000)).toBe("quiet tsc_early_khz=1000 tsc=reliable");
    expect(effectiveCmdline("quiet tsc_early_khz=5", "tcg", 1000)).toBe("quiet tsc_early_khz=5");
    expect(effectiveCmdline("quiet", "kvm", 1000)).toBe("quiet");
    expect(effectiveCmdline("quiet", "tcg", undefined)).toBe("quiet");
  });

  test("accelerator: KVM probe matches the host; the option overrides it", () => {
    const p = probeKvm();
    if (existsSync("/sys/module/kvm_pvm")) expect(p).toEqual({ usable: false, reason: "/dev/kvm is kvm_pvm (PVM guests only)" });
    if (!existsSync("/dev/kvm")) expect(p.usable).toBe(false);
    expect(resolveAccel({ accel: "tcg" })).toBe("tcg");
    expect(resolveAccel({ accel: "kvm" })).toBe("kvm");
    expect(resolveAccel()).toBe(p.usable ? "kvm" : "tcg");
    expect(() => resolveAccel({ accel: "hvf" as never })).toThrow(/kvm or tcg/);
  });
});

describe("RAM file copy (resumable snapshots)", () => {
  /** A sparse "RAM file": `size` bytes with a touched page every `stride`. */
  function ramFile(path: string, size: number, stride: number): void {
    const fd = openSync(path, "w");
    ftruncateSync(fd, size);
    const page = new Uint8Array(4096).fill(0xa5);
    for (let off = 0; off < size; off += stride) writeSync(fd, page, 0, page.length, off);
    closeSync(fd);
  }

  test("the copy is awaited (the loop runs meanwhile), keeps the holes and the bytes", async () => {
    const dir = scratchDir("ram-copy");
    // cp reads a FIFO that only a timer of this loop writes: the copy ends only if the loop runs
    // while it is awaited (a synchronous cp would wait on the FIFO until its time limit).
    const fifo = join(dir, "fifo");
    expect(Bun.spawnSync(["mkfifo", fifo]).exitCode).toBe(0);
    const page = new Uint8Array(4096).fill(7);
    const fromFifo = sparseCopy(fifo, join(dir, "from-fifo"), 20_000);
    setTimeout(() => {
      const fd = openSync(fifo, "w");
      writeSync(fd, page);
      closeSync(fd);
    }, 0);
    await fromFifo;
    expect(await Bun.file(join(dir, "from-fifo")).bytes()).toEqual(page);
    const from = join(dir, "ram");
    ramFile(from, 256 << 20, 1 << 20);
    await sparseCopy(from, join(dir, "mem"));
    const to = statSync(join(dir, "mem"));
    expect(to.size).toBe(256 << 20);
    expect(to.blocks * 512).toBeLessThan(16 << 20); // 256 touched pages, not 256 MiB
    expect(Buffer.compare(await Bun.file(from).bytes(), await Bun.file(join(dir, "mem")).bytes())).toBe(0);
  }, 60_000);

  test("a copy that fails says why and leaves no partial file; one past its time limit is killed", async () => {
    const dir = scratchDir("ram-copy-fail");
    const missing = await sparseCopy(join(dir, "absent"), join(dir, "mem")).catch((e) => e);
    expect(missing).toBeInstanceOf(VmmError);
    expect(missing.code).toBe("Protocol");
    expect(missing.message).toContain("No such file");
    expect(existsSync(join(dir, "mem"))).toBe(false);

    // A FIFO never ends: cp blocks on it until the limit kills it.
    expect(Bun.spawnSync(["mkfifo", join(dir, "fifo")]).exitCode).toBe(0);
    const hung = await sparseCopy(join(dir, "fifo"), join(dir, "mem2"), 200).catch((e) => e);
    expect(hung).toBeInstanceOf(VmmError);
    expect(hung.code).toBe("Timeout");
    expect(existsSync(join(dir, "mem2"))).toBe(false);
  }, 60_000);
});
