// Firecracker request builders against the documented API (Firecracker's swagger, 1.16/1.17-dev):
// upstream rejects unknown fields, so every body
// must hold only documented fields, all required ones, the right JSON types and valid enums.

import { describe, expect, test } from "bun:test";
import { existsSync } from "node:fs";
import { join } from "node:path";
import * as fc from "../../src/vmm/firecracker.ts";
import { selectDriver } from "../../src/vmm/select.ts";
import { VmmError, type VmSpec } from "../../src/vmm/types.ts";
import { scratchDir } from "../helpers/tmp.ts";

// ---- the documented schema, written out independently of the builders ---------------------------

type FieldType = "string" | "boolean" | "integer" | { enum: string[] } | { ref: string } | { arrayOf: FieldType } | "object";
interface Def {
  required: Record<string, FieldType>;
  optional: Record<string, FieldType>;
}

const DEFS: Record<string, Def> = {
  TokenBucket: { required: { size: "integer", refill_time: "integer" }, optional: { one_time_burst: "integer" } },
  RateLimiter: { required: {}, optional: { bandwidth: { ref: "TokenBucket" }, ops: { ref: "TokenBucket" } } },
  Logger: {
    required: {},
    optional: { log_path: "string", level: { enum: ["Error", "Warning", "Info", "Debug", "Trace", "Off"] }, show_level: "boolean", show_log_origin: "boolean", module: "string" },
  },
  Metrics: { required: { metrics_path: "string" }, optional: {} },
  BootSource: { required: { kernel_image_path: "string" }, optional: { boot_args: "string", initrd_path: "string" } },
  MachineConfiguration: {
    required: { vcpu_count: "integer", mem_size_mib: "integer" },
    optional: {
      smt: "boolean",
      track_dirty_pages: "boolean",
      huge_pages: { enum: ["None", "Transparent", "2M"] },
      cpu_template: { enum: ["C3", "T2", "T2S", "T2CL", "T2A", "V1N1", "None"] },
    },
  },
  Drive: {
    required: { drive_id: "string", is_root_device: "boolean" },
    optional: {
      partuuid: "string",
      cache_type: { enum: ["Unsafe", "Writeback"] },
      is_read_only: "boolean",
      path_on_host: "string",
      rate_limiter: { ref: "RateLimiter" },
      io_engine: { enum: ["Sync", "Async"] },
      socket: "string",
    },
  },
  PartialDrive: { required: { drive_id: "string" }, optional: { path_on_host: "string", rate_limiter: { ref: "RateLimiter" } } },
  NetworkInterface: {
    required: { iface_id: "string", host_dev_name: "string" },
    optional: { guest_mac: "string", mtu: "integer", rx_rate_limiter: { ref: "RateLimiter" }, tx_rate_limiter: { ref: "RateLimiter" } },
  },
  PartialNetworkInterface: { required: { iface_id: "string" }, optional: { rx_rate_limiter: { ref: "RateLimiter" }, tx_rate_limiter: { ref: "RateLimiter" } } },
  MmdsConfig: { required: { network_interfaces: { arrayOf: "string" } }, optional: { version: { enum: ["V1", "V2"] }, ipv4_address: "string", imds_compat: "boolean" } },
  Balloon: {
    required: { amount_mib: "integer", deflate_on_oom: "boolean" },
    optional: { stats_polling_interval_s: "integer", free_page_hinting: "boolean", free_page_reporting: "boolean" },
  },
  BalloonUpdate: { required: { amount_mib: "integer" }, optional: {} },
  BalloonStatsUpdate: { required: { stats_polling_interval_s: "integer" }, optional: {} },
  BalloonStartCmd: { required: {}, optional: { acknowledge_on_stop: "boolean" } },
  Vsock: { required: { guest_cid: "integer", uds_path: "string" }, optional: { vsock_id: "string" } },
  EntropyDevice: { required: {}, optional: { rate_limiter: { ref: "RateLimiter" } } },
  InstanceActionInfo: { required: { action_type: { enum: ["FlushMetrics", "InstanceStart", "SendCtrlAltDel"] } }, optional: {} },
  Vm: { required: { state: { enum: ["Paused", "Resumed"] } }, optional: {} },
  SnapshotCreateParams: { required: { snapshot_path: "string", mem_file_path: "string" }, optional: { snapshot_type: { enum: ["Full", "Diff"] } } },
  MemoryBackend: { required: { backend_type: { enum: ["File", "Uffd"] }, backend_path: "string" }, optional: {} },
  NetworkOverride: { required: { iface_id: "string", host_dev_name: "string" }, optional: {} },
  VsockOverride: { required: { uds_path: "string" }, optional: {} },
  SnapshotLoadParams: {
    required: { snapshot_path: "string" },
    optional: {
      mem_backend: { ref: "MemoryBackend" },
      mem_file_path: "string",
      enable_diff_snapshots: "boolean",
      track_dirty_pages: "boolean",
      resume_vm: "boolean",
      network_overrides: { arrayOf: { ref: "NetworkOverride" } },
      vsock_override: { ref: "VsockOverride" },
      clock_realtime: "boolean",
    },
  },
};

/** Every violation of def by value, as "path: problem" lines. */
function violations(value: unknown, def: string, at = def): string[] {
  const d = DEFS[def]!;
  if (!value || typeof value !== "object" || Array.isArray(value)) return [`${at}: not an object`];
  const o = value as Record<string, unknown>;
  const out: string[] = [];
  for (const k of Object.keys(d.required)) if (!(k in o)) out.push(`${at}.${k}: required field missing`);
  for (const [k, v] of Object.entries(o)) {
    const t = d.required[k] ?? d.optional[k];
    if (!t) out.push(`${at}.${k}: unknown field`);
    else out.push(...typeViolations(v, t, `${at}.${k}`));
  }
  return out;
}
function typeViolations(v: unknown, t: FieldType, at: string): string[] {
  if (v === null || v === undefined) return [`${at}: null/undefined sent`];
  if (t === "string") return typeof v === "string" ? [] : [`${at}: not a string`];
  if (t === "boolean") return typeof v === "boolean" ? [] : [`${at}: not a boolean`];
  if (t === "integer") return Number.isInteger(v) ? [] : [`${at}: not an integer`];
  if (t === "object") return typeof v === "object" ? [] : [`${at}: not an object`];
  if ("enum" in t) return t.enum.includes(v as string) ? [] : [`${at}: ${JSON.stringify(v)} not in ${t.enum.join("|")}`];
  if ("ref" in t) return violations(v, t.ref, at);
  if (!Array.isArray(v)) return [`${at}: not an array`];
  return v.flatMap((x, i) => typeViolations(x, t.arrayOf, `${at}[${i}]`));
}

function conforms(req: fc.FcRequest, def: string) {
  expect(violations(req.body, def)).toEqual([]);
}

const tb = { size: 1 << 20, refillTimeMs: 100, oneTimeBurst: 4096 };
const rl: fc.RateLimiter = { bandwidth: tb, ops: { size: 1000, refillTimeMs: 1000 } };

// ---- the builders -------------------------------------------------------------------------------

describe("firecracker request builders", () => {
  test("boot-source, machine-config (PUT and PATCH), logger, metrics", () => {
    const bs = fc.putBootSource({ kernelImagePath: "/k/vmlinux", bootArgs: "console=ttyS0", initrdPath: "/k/initrd" });
    expect([bs.method, bs.path]).toEqual(["PUT", "/boot-source"]);
    conforms(bs, "BootSource");
    expect(fc.putBootSource({ kernelImagePath: "/k" }).body).toEqual({ kernel_image_path: "/k" });

    const mc = fc.putMachineConfig({ vcpuCount: 2, memSizeMib: 512, smt: false, trackDirtyPages: true, hugePages: "2M", cpuTemplate: "None" });
    expect([mc.method, mc.path]).toEqual(["PUT", "/machine-config"]);
    conforms(mc, "MachineConfiguration");
    expect(fc.putMachineConfig({ vcpuCount: 1, memSizeMib: 128 }).body).toEqual({ vcpu_count: 1, mem_size_mib: 128 });
    const pm = fc.patchMachineConfig({ memSizeMib: 256 });
    expect([pm.method, pm.body]).toEqual(["PATCH", { mem_size_mib: 256 }]);
    expect(() => fc.putMachineConfig({ vcpuCount: 33, memSizeMib: 128 })).toThrow(/vcpu_count/);
    expect(() => fc.putMachineConfig({ vcpuCount: 3, memSizeMib: 128, smt: true })).toThrow(/1 or even/);
    expect(() => fc.putMachineConfig({ vcpuCount: 1, memSizeMib: 128, hugePages: "1G" as never })).toThrow(/huge_pages/);

    conforms(fc.putLogger({ logPath: "/l", level: "Debug", showLevel: true, showLogOrigin: false, module: "api_server" }), "Logger");
    expect(() => fc.putLogger({ level: "Verbose" as never })).toThrow(/level/);
    const m = fc.putMetrics({ metricsPath: "/m.fifo" });
    expect([m.path, m.body]).toEqual(["/metrics", { metrics_path: "/m.fifo" }]);
  });

  test("drives: virtio-blk with io_engine, rate_limiter, is_read_only; vhost-user; PATCH", () => {
    const d = fc.putDrive({ driveId: "rootfs", isRootDevice: true, partuuid: "abcd-01", pathOnHost: "/dev/ublkb0", isReadOnly: false, cacheType: "Writeback", ioEngine: "Async", rateLimiter: rl });
    expect([d.method, d.path]).toEqual(["PUT", "/drives/rootfs"]);
    conforms(d, "Drive");
    expect((d.body as any).rate_limiter).toEqual({ bandwidth: { size: 1 << 20, refill_time: 100, one_time_burst: 4096 }, ops: { size: 1000, refill_time: 1000 } });
    const minimal = fc.putDrive({ driveId: "vda", isRootDevice: false, pathOnHost: "/t.img", isReadOnly: true });
    expect(minimal.body).toEqual({ drive_id: "vda", is_root_device: false, path_on_host: "/t.img", is_read_only: true });
    conforms(fc.putDrive({ driveId: "vu", isRootDevice: false, socket: "/run/vhost.sock" }), "Drive");
    expect(() => fc.putDrive({ driveId: "vu", isRootDevice: false, socket: "/s", pathOnHost: "/p" })).toThrow(/socket/);
    expect(() => fc.putDrive({ driveId: "x", isRootDevice: false })).toThrow(/path_on_host/);
    expect(() => fc.putDrive({ driveId: "x", isRootDevice: false, pathOnHost: "/p", ioEngine: "Uring" as never })).toThrow(/io_engine/);
    expect(() => fc.putDrive({ driveId: "a/b", isRootDevice: false, pathOnHost: "/p" })).toThrow(/drive_id/);
    const p = fc.patchDrive({ driveId: "vdb", pathOnHost: "/new", rateLimiter: { ops: { size: 10, refillTimeMs: 1 } } });
    expect([p.method, p.path]).toEqual(["PATCH", "/drives/vdb"]);
    conforms(p, "PartialDrive");
  });

  test("network interfaces and MMDS", () => {
    const n = fc.putNetworkInterface({ ifaceId: "eth0", hostDevName: "tap0", guestMac: "06:00:AC:10:00:02", mtu: 1500, rxRateLimiter: rl, txRateLimiter: rl });
    expect([n.method, n.path]).toEqual(["PUT", "/network-interfaces/eth0"]);
    conforms(n, "NetworkInterface");
    expect(() => fc.putNetworkInterface({ ifaceId: "eth0", hostDevName: "tap0", mtu: 67 })).toThrow(/mtu/);
    expect(() => fc.putNetworkInterface({ ifaceId: "eth0", hostDevName: "tap0", guestMac: "zz" })).toThrow(/guest_mac/);
    conforms(fc.patchNetworkInterface({ ifaceId: "eth0", rxRateLimiter: rl }), "PartialNetworkInterface");

    const mc = fc.putMmdsConfig({ networkInterfaces: ["eth0"], version: "V2", ipv4Address: "169.254.169.254", imdsCompat: true });
    expect([mc.method, mc.path]).toEqual(["PUT", "/mmds/config"]);
    conforms(mc, "MmdsConfig");
    expect(() => fc.putMmdsConfig({ networkInterfaces: [] })).toThrow(/network_interfaces/);
    expect(() => fc.putMmdsConfig({ networkInterfaces: ["eth0"], ipv4Address: "10.0.0.1" })).toThrow(/ipv4_address/);
    expect(() => fc.putMmdsConfig({ networkInterfaces: ["eth0"], version: "V3" as never })).toThrow(/version/);
    const data = { latest: { "meta-data": { "instance-id": "sbx-1" } } };
    expect(fc.putMmds(data)).toEqual({ method: "PUT", path: "/mmds", body: data });
    expect(fc.patchMmds(data).method).toBe("PATCH");
    expect(fc.getMmds()).toEqual({ method: "GET", path: "/mmds" });
  });

  test("balloon: device, target, statistics, free page reporting and hinting", () => {
    const b = fc.putBalloon({ amountMib: 0, deflateOnOom: true, statsPollingIntervalS: 1, freePageReporting: true, freePageHinting: false });
    expect([b.method, b.path]).toEqual(["PUT", "/balloon"]);
    conforms(b, "Balloon");
    expect(fc.putBalloon({ amountMib: 64, deflateOnOom: false }).body).toEqual({ amount_mib: 64, deflate_on_oom: false });
    const u = fc.patchBalloon({ amountMib: 128 });
    expect([u.method, u.path]).toEqual(["PATCH", "/balloon"]);
    conforms(u, "BalloonUpdate");
    const s = fc.patchBalloonStatistics({ statsPollingIntervalS: 5 });
    expect([s.method, s.path]).toEqual(["PATCH", "/balloon/statistics"]);
    conforms(s, "BalloonStatsUpdate");
    expect(fc.getBalloonStatistics()).toEqual({ method: "GET", path: "/balloon/statistics" });
    expect(fc.getBalloon()).toEqual({ method: "GET", path: "/balloon" });
    const h = fc.startBalloonHinting({ acknowledgeOnStop: true });
    expect([h.method, h.path]).toEqual(["PATCH", "/balloon/hinting/start"]);
    conforms(h, "BalloonStartCmd");
    expect(fc.getBalloonHintingStatus()).toEqual({ method: "GET", path: "/balloon/hinting/status" });
    expect(fc.stopBalloonHinting()).toEqual({ method: "PATCH", path: "/balloon/hinting/stop" });
    expect(() => fc.putBalloon({ amountMib: -1, deflateOnOom: true })).toThrow(/amount_mib/);
  });

  test("vsock, entropy, actions, vm state", () => {
    const v = fc.putVsock({ guestCid: 3, udsPath: "/run/v.sock" });
    expect([v.method, v.path]).toEqual(["PUT", "/vsock"]);
    conforms(v, "Vsock");
    expect(() => fc.putVsock({ guestCid: 2, udsPath: "/v" })).toThrow(/guest_cid/);
    conforms(fc.putEntropy({ rateLimiter: rl }), "EntropyDevice");
    expect(fc.putEntropy().body).toEqual({});
    for (const a of ["InstanceStart", "SendCtrlAltDel", "FlushMetrics"] as const) {
      const r = fc.action(a);
      expect([r.method, r.path]).toEqual(["PUT", "/actions"]);
      conforms(r, "InstanceActionInfo");
    }
    expect(() => fc.action("Reboot" as never)).toThrow(/action_type/);
    for (const s of ["Paused", "Resumed"] as const) {
      const r = fc.patchVm(s);
      expect([r.method, r.path]).toEqual(["PATCH", "/vm"]);
      conforms(r, "Vm");
    }
    expect(() => fc.patchVm("Running" as never)).toThrow(/state/);
  });

  test("snapshot create (Full, Diff) and load (File/Uffd backends, dirty tracking, overrides)", () => {
    for (const t of ["Full", "Diff"] as const) {
      const c = fc.createSnapshot({ snapshotPath: "/s/vmstate", memFilePath: "/s/mem", snapshotType: t });
      expect([c.method, c.path]).toEqual(["PUT", "/snapshot/create"]);
      conforms(c, "SnapshotCreateParams");
    }
    expect(fc.createSnapshot({ snapshotPath: "/a", memFilePath: "/b" }).body).toEqual({ snapshot_path: "/a", mem_file_path: "/b" });
    expect(() => fc.createSnapshot({ snapshotPath: "/a", memFilePath: "/b", snapshotType: "Incremental" as never })).toThrow(/snapshot_type/);

    const l = fc.loadSnapshot({
      snapshotPath: "/s/vmstate",
      memBackend: { backendType: "File", backendPath: "/s/mem" },
      trackDirtyPages: true,
      resumeVm: true,
      networkOverrides: [{ ifaceId: "eth0", hostDevName: "tap7" }],
      vsockOverride: { udsPath: "/run/v7.sock" },
      clockRealtime: true,
    });
    expect([l.method, l.path]).toEqual(["PUT", "/snapshot/load"]);
    conforms(l, "SnapshotLoadParams");
    // Exactly one of mem_backend / mem_file_path: the builder always sends mem_backend.
    expect("mem_file_path" in l.body!).toBe(false);
    const old = fc.loadSnapshot({ snapshotPath: "/s", memBackend: { backendType: "Uffd", backendPath: "/run/uffd.sock" }, enableDiffSnapshots: true });
    conforms(old, "SnapshotLoadParams");
    expect(() => fc.loadSnapshot({ snapshotPath: "/s", memBackend: { backendType: "File", backendPath: "/m" }, trackDirtyPages: true, enableDiffSnapshots: true })).toThrow(/enable_diff_snapshots/);
    expect(() => fc.loadSnapshot({ snapshotPath: "/s", memBackend: { backendType: "Mmap" as never, backendPath: "/m" } })).toThrow(/backend_type/);
  });

  test("fields outside the documented set never reach a body", () => {
    const sneaky = { kernelImagePath: "/k", direct: true, extra: 1 } as never;
    expect(fc.putBootSource(sneaky).body).toEqual({ kernel_image_path: "/k" });
    const drive = fc.putDrive({ driveId: "vdb", isRootDevice: false, pathOnHost: "/p", direct: true } as never);
    conforms(drive, "Drive");
  });

  test("boot sequence for a spec: documented order, every body conforms", () => {
    const spec: VmSpec = {
      id: "fc1",
      runDir: "/run/fc1",
      kernel: "/k/vmlinux",
      cmdline: "console=ttyS0 reboot=k panic=1 init=/init/disk-init",
      vcpus: 2,
      memMiB: 512,
      drives: [{ path: "/tools.img", readOnly: true }, { path: "/dev/ublkb3" }],
      net: { tap: "tap3", mac: "06:00:AC:10:00:02" },
      balloon: true,
    };
    const reqs = fc.bootRequests(spec, { ioEngine: "Async", trackDirtyPages: true });
    expect(reqs.map((r) => `${r.method} ${r.path}`)).toEqual([
      "PUT /logger",
      "PUT /metrics",
      "PUT /machine-config",
      "PUT /boot-source",
      "PUT /drives/vda",
      "PUT /drives/vdb",
      "PUT /network-interfaces/eth0",
      "PUT /balloon",
      "PUT /entropy",
      "PUT /actions",
    ]);
    const defs = ["Logger", "Metrics", "MachineConfiguration", "BootSource", "Drive", "Drive", "NetworkInterface", "Balloon", "EntropyDevice", "InstanceActionInfo"];
    reqs.forEach((r, i) => conforms(r, defs[i]!));
    // Log and metrics go to files of the VM's own run directory, not the console.
    expect(reqs[0]!.body).toMatchObject({ log_path: "/run/fc1/firecracker.log" });
    expect(reqs[1]!.body).toEqual({ metrics_path: "/run/fc1/metrics.json" });
    // No initramfs: the tools disk is the kernel's root, so Firecracker appends root=/dev/vda ro.
    expect((reqs[4]!.body as any).is_root_device).toBe(true);
    expect((reqs[5]!.body as any).is_root_device).toBe(false);
    // With the jailer the paths are the jail's own; the host sees them under its chroot.
    const jailed = fc.telemetryPaths(spec, { jailer: { uid: 1, gid: 1, chrootBaseDir: "/srv/j" } });
    expect(jailed).toEqual({ log: "/firecracker.log", metrics: "/metrics.json", hostLog: "/srv/j/firecracker/fc1/root/firecracker.log", hostMetrics: "/srv/j/firecracker/fc1/root/metrics.json" });
    expect(() => fc.bootRequests({ ...spec, net: { user: { forwards: [] } } })).toThrow(/TAP/);
  });

  test("free page reporting only where the binary's version has it (1.14.0 and later); an unknown version gets none", () => {
    expect(fc.parseFirecrackerVersion("Firecracker v1.14.0\n\nSupported snapshot data format versions: v5.0.0\n")).toEqual([1, 14, 0]);
    expect(fc.parseFirecrackerVersion("Firecracker v1.7.0-dev")).toEqual([1, 7, 0]);
    expect(fc.parseFirecrackerVersion("qemu 7.2")).toBeUndefined();
    expect(fc.capsOf([1, 13, 9])).toEqual({ freePageReporting: false });
    expect(fc.capsOf([1, 14, 0])).toEqual({ freePageReporting: true });
    expect(fc.capsOf([2, 0, 0])).toEqual({ freePageReporting: true });
    expect(fc.capsOf(undefined)).toEqual({ freePageReporting: false });
    const spec: VmSpec = { id: "fc2", runDir: "/run/fc2", kernel: "/k", cmdline: "console=ttyS0", vcpus: 1, memMiB: 256, drives: [{ path: "/t", readOnly: true }], balloon: true };
    const balloon = (caps?: fc.FirecrackerCaps) => fc.bootRequests(spec, {}, caps).find((r) => r.path === "/balloon")!;
    expect(balloon().body).not.toHaveProperty("free_page_reporting");
    expect(balloon({ freePageReporting: true }).body).toMatchObject({ free_page_reporting: true, deflate_on_oom: true });
    conforms(balloon({ freePageReporting: true }), "Balloon");
  });

  test("jailer command line", () => {
    const j = { uid: 123, gid: 100, chrootBaseDir: "/srv/jail", netns: "/var/run/netns/s1", cgroupVersion: 2 as const, cgroups: { "cpu.max": "50000 100000" }, parentCgroup: "aenv", resourceLimits: { fsize: 1 << 30, noFile: 4096 }, daemonize: true, newPidNs: true, binary: "/usr/bin/jailer" };
    expect(fc.jailerArgs("sbx-1", "/usr/bin/firecracker", j, ["--api-sock", "/firecracker.sock"])).toEqual([
      "/usr/bin/jailer", "--id", "sbx-1", "--exec-file", "/usr/bin/firecracker", "--uid", "123", "--gid", "100",
      "--chroot-base-dir", "/srv/jail", "--netns", "/var/run/netns/s1", "--cgroup-version", "2", "--cgroup", "cpu.max=50000 100000",
      "--parent-cgroup", "aenv", "--resource-limit", `fsize=${1 << 30}`, "--resource-limit", "no-file=4096", "--daemonize", "--new-pid-ns",
      "--", "--api-sock", "/firecracker.sock",
    ]);
    expect(fc.jailRoot("sbx-1", "/usr/bin/firecracker", j)).toBe("/srv/jail/firecracker/sbx-1/root");
    expect(() => fc.jailerArgs("bad_id!", "/fc", j, [])).toThrow(/--id/);
  });
});

describe("VMM selection", () => {
  test("auto picks Firecracker only with its binary and a usable /dev/kvm; forcing works both ways", () => {
    const fcState = fc.firecrackerAvailable({ binary: "/nonexistent/firecracker" });
    expect(fcState.usable).toBe(false);
    const auto = selectDriver({ vmm: "auto", firecracker: { binary: "/nonexistent/firecracker" } });
    expect(auto.driver.kind).toBe("qemu");
    expect(auto.reason).toContain("no /nonexistent/firecracker binary");
    expect(selectDriver({ vmm: "qemu" }).driver.kind).toBe("qemu");
    expect(() => selectDriver({ vmm: "firecracker", firecracker: { binary: "/nonexistent/firecracker" } })).toThrow(/cannot run/);
    expect(() => selectDriver({ vmm: "xen" as never })).toThrow(/AENV_VMM/);
  });
});

// ---- the API client and the driver against a socket, without a Firecracker binary -------------

describe("firecracker API socket and VM ids", () => {
  test("a request waits out a socket that is bound but not listening yet, then goes through", async () => {
    const path = join(scratchDir("fc-api"), "api.sock");
    const server = Bun.spawn([process.execPath, join(import.meta.dir, "bound_socket.ts"), path], { stdin: "pipe", stdout: "pipe", stderr: "inherit" });
    try {
      const lines = lineReader(server.stdout);
      expect(await lines.next()).toBe("bound");
      // Bound, not listening: a plain connect is refused, as Firecracker's is for a moment.
      const early = await fetch("http://localhost/", { unix: path } as RequestInit).catch((e) => e);
      expect(early.code).toBe("ECONNREFUSED");

      const api = new fc.FirecrackerApi(path, 60_000);
      let settled = false;
      const sent = api.send(fc.putMachineConfig({ vcpuCount: 1, memSizeMib: 128 })).finally(() => (settled = true));
      // Still refused a while later, and the request has not given up.
      await Bun.sleep(100);
      expect((await fetch("http://localhost/", { unix: path } as RequestInit).catch((e) => e)).code).toBe("ECONNREFUSED");
      expect(settled).toBe(false);
      server.stdin.write("listen\n");
      server.stdin.flush();
      expect(await lines.next()).toBe("listening");
      expect(await sent).toBeUndefined();
      expect(await lines.next()).toBe(`PUT /machine-config {"vcpu_count":1,"mem_size_mib":128}`);
    } finally {
      server.kill(9);
      await server.exited;
    }
  }, 60_000);

  test("a request gives up with Timeout when the socket never listens", async () => {
    const path = join(scratchDir("fc-api-never"), "api.sock");
    const server = Bun.spawn([process.execPath, join(import.meta.dir, "bound_socket.ts"), path], { stdin: "pipe", stdout: "pipe", stderr: "inherit" });
    try {
      expect(await lineReader(server.stdout).next()).toBe("bound");
      const err = (await new fc.FirecrackerApi(path, 200).send(fc.getVersion()).then(
        () => undefined,
        (e: unknown) => e,
      )) as VmmError;
      expect(err).toBeInstanceOf(VmmError);
      expect(err.code).toBe("Timeout");
      expect(err.message).toContain("ECONNREFUSED");
    } finally {
      server.kill(9);
      await server.exited;
    }
  }, 60_000);

  test("VM ids are checked as Firecracker does ([A-Za-z0-9-]{1,64}) before anything is spawned", async () => {
    const dir = scratchDir("fc-id");
    // A binary that does not exist: reaching the spawn would fail differently (StartFailed).
    const driver = new fc.FirecrackerDriver({ binary: join(dir, "no-firecracker") });
    const spec: VmSpec = { id: "ok-id", runDir: join(dir, "run"), kernel: "/k", cmdline: "console=ttyS0", vcpus: 1, memMiB: 128, drives: [] };
    for (const id of ["", "has_underscore", "dots.no", "a/b", "x".repeat(65), "--api-sock"]) {
      const err = await driver.boot({ ...spec, id }).catch((e) => e);
      expect([id, err.code]).toEqual([id, "BadSpec"]);
    }
    const snap = { vmm: "firecracker" as const, dir, statePath: join(dir, "s"), memPath: join(dir, "m"), spec, createdAt: "" };
    expect((await driver.restore(snap, { id: "bad id", runDir: join(dir, "r"), drives: [] }).catch((e) => e)).code).toBe("BadSpec");
    expect(existsSync(join(dir, "run"))).toBe(false);
    expect(existsSync(join(dir, "r"))).toBe(false);
    expect(fc.checkVmId("x".repeat(64))).toBe("x".repeat(64));
    // A good id gets as far as the spawn.
    expect((await driver.boot(spec).catch((e) => e)).code).toBe("StartFailed");
  }, 60_000);
});

/** Lines from a child's stdout, one per next(). */
function lineReader(stream: ReadableStream<Uint8Array>) {
  const reader = stream.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  return {
    async next(): Promise<string> {
      for (;;) {
        const nl = buf.indexOf("\n");
        if (nl >= 0) {
          const line = buf.slice(0, nl);
          buf = buf.slice(nl + 1);
          return line;
        }
        const { value, done } = await reader.read();
        if (done) throw new Error(`stream ended after ${JSON.stringify(buf)}`);
        buf += decoder.decode(value, { stream: true });
      }
    },
  };
}
