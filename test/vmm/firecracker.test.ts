// Firecracker request builders against the documented API (Firecracker's swagger, 1.16/1.17-dev):
// upstream rejects unknown fields, so every body
// must hold only documented fields, all required ones, the right JSON types and valid enums.

import { afterAll, describe, expect, test } from "bun:test";
import { existsSync, lstatSync, mkdirSync, mkdtempSync, readdirSync, readFileSync, readlinkSync, realpathSync, rmSync, statSync, symlinkSync, truncateSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import * as fc from "../../src/vmm/firecracker.ts";
import { selectDriver } from "../../src/vmm/select.ts";
import { readSnapshot, type SnapshotInfo, VmmError, type VmSpec } from "../../src/vmm/types.ts";
import { CONSOLE_LOG_MAX_BYTES } from "../../src/vmm/console.ts";
import { ensureSystemUser, VMM_USER } from "../../src/vmm/vmm_user.ts";
import { scratchDir } from "../helpers/tmp.ts";

// ---- the documented schema, written out independently of the builders ---------------------------

type FieldType = "string" | "boolean" | "integer" | { enum: string[] } | { ref: string } | { arrayOf: FieldType } | "object";
interface Def {
  required: Record<string, FieldType>;
  optional: Record<string, FieldType>;
  /** additionalProperties: true (MMDS contents: any JSON object). */
  open?: boolean;
}

const DEFS: Record<string, Def> = {
  TokenBucket: { required: { size: "integer", refill_time: "integer" }, optional: { one_time_burst: "integer" } },
  RateLimiter: { required: {}, optional: { bandwidth: { ref: "TokenBucket" }, ops: { ref: "TokenBucket" } } },
  Logger: {
    required: {},
    optional: { log_path: "string", level: { enum: ["Error", "Warning", "Info", "Debug", "Trace", "Off"] }, show_level: "boolean", show_log_origin: "boolean", module: "string" },
  },
  Metrics: { required: { metrics_path: "string" }, optional: { emit_id: "boolean", properties: "object" } },
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
  MmdsContentsObject: { required: {}, optional: {}, open: true },
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
      huge_pages: { enum: ["Snapshot", "None", "Transparent", "2M"] },
    },
  },
  BalloonStats: {
    required: { target_pages: "integer", actual_pages: "integer", target_mib: "integer", actual_mib: "integer" },
    optional: Object.fromEntries(
      ["swap_in", "swap_out", "major_faults", "minor_faults", "free_memory", "total_memory", "available_memory", "disk_caches", "hugetlb_allocations", "hugetlb_failures", "oom_kill", "alloc_stall", "async_scan", "direct_scan", "async_reclaim", "direct_reclaim"].map((k) => [k, "integer" as const]),
    ),
  },
};

/** The definition a request's body must conform to, by its method and path (the swagger's paths). */
function defOf(method: string, path: string): string | undefined {
  const p = path.replace(/^\/(drives|network-interfaces)\/[^/]+$/, "/$1/{id}");
  return (
    {
      "PUT /logger": "Logger", "PUT /metrics": "Metrics", "PUT /machine-config": "MachineConfiguration", "PATCH /machine-config": "MachineConfiguration",
      "PUT /boot-source": "BootSource", "PUT /drives/{id}": "Drive", "PATCH /drives/{id}": "PartialDrive",
      "PUT /network-interfaces/{id}": "NetworkInterface", "PATCH /network-interfaces/{id}": "PartialNetworkInterface",
      "PUT /mmds/config": "MmdsConfig", "PUT /mmds": "MmdsContentsObject", "PATCH /mmds": "MmdsContentsObject",
      "PUT /balloon": "Balloon", "PATCH /balloon": "BalloonUpdate", "PATCH /balloon/statistics": "BalloonStatsUpdate",
      "PUT /vsock": "Vsock", "PUT /entropy": "EntropyDevice", "PUT /actions": "InstanceActionInfo", "PATCH /vm": "Vm",
      "PUT /snapshot/create": "SnapshotCreateParams", "PUT /snapshot/load": "SnapshotLoadParams",
    } as Record<string, string>
  )[`${method} ${p}`];
}

/** Every violation of def by value, as "path: problem" lines. */
function violations(value: unknown, def: string, at = def): string[] {
  const d = DEFS[def]!;
  if (!value || typeof value !== "object" || Array.isArray(value)) return [`${at}: not an object`];
  const o = value as Record<string, unknown>;
  const out: string[] = [];
  for (const k of Object.keys(d.required)) if (!(k in o)) out.push(`${at}.${k}: required field missing`);
  for (const [k, v] of Object.entries(o)) {
    const t = d.required[k] ?? d.optional[k];
    if (!t && d.open) continue;
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

/** Every request of a sequence against the definition of its endpoint; GETs and bodiless PATCHes carry no body. */
function allConform(reqs: { method: string; path: string; body?: unknown }[]) {
  const bad: string[] = [];
  for (const r of reqs) {
    const def = defOf(r.method, r.path);
    if (r.method === "GET" || r.path.startsWith("/balloon/hinting/")) continue;
    if (!def) bad.push(`${r.method} ${r.path}: not an endpoint with a body`);
    else bad.push(...violations(r.body, def, `${r.method} ${r.path}`));
    // The path parameter and the body's id are the same.
    const id = /^\/(drives|network-interfaces)\/([^/]+)$/.exec(r.path)?.[2];
    const bodyId = (r.body as any)?.drive_id ?? (r.body as any)?.iface_id;
    if (id !== undefined && id !== bodyId) bad.push(`${r.method} ${r.path}: body id ${bodyId}`);
  }
  expect(bad).toEqual([]);
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

// ---- the production path: sequences a boot and a restore send, without a process ---------------

const prodSpec = (o: Partial<VmSpec> = {}): VmSpec => ({
  id: "sbx-1",
  runDir: "/run/sbx-1",
  kernel: "/k/vmlinux",
  cmdline: "console=ttyS0",
  vcpus: 2,
  memMiB: 512,
  drives: [{ path: "/tools.img", readOnly: true }, { path: "/dev/ublkb3", rateLimit: { bandwidth: { size: 50 << 20, refillTimeMs: 1000 }, ops: { size: 5000, refillTimeMs: 1000, oneTimeBurst: 1000 } } }],
  net: { tap: "tap3", mac: "06:00:AC:10:00:02" },
  netRateLimit: { rx: { bandwidth: { size: 10 << 20, refillTimeMs: 1000 } }, tx: { bandwidth: { size: 5 << 20, refillTimeMs: 1000 } } },
  metadata: { sandboxId: "sbx-1", templateId: "base", envdToken: "t0k" },
  vsock: true,
  balloon: true,
  ...o,
});

describe("firecracker production path: boot and restore sequences", () => {
  test("boot: MMDS V2 on eth0 with the metadata, rate limiters in the drive and interface bodies, vsock, per-VM drive names", () => {
    const reqs = fc.bootRequests(prodSpec(), { ioEngine: "Async", trackDirtyPages: true }, { freePageReporting: true });
    expect(reqs.map((r) => `${r.method} ${r.path}`)).toEqual([
      "PUT /logger", "PUT /metrics", "PUT /machine-config", "PUT /boot-source", "PUT /drives/vda", "PUT /drives/vdb",
      "PUT /network-interfaces/eth0", "PUT /mmds/config", "PUT /mmds", "PUT /balloon", "PUT /vsock", "PUT /entropy", "PUT /actions",
    ]);
    allConform(reqs);
    const by = (p: string) => reqs.find((r) => r.path === p)!.body as any;
    // Drives are names relative to Firecracker's working directory: what a snapshot records.
    expect([by("/drives/vda").path_on_host, by("/drives/vdb").path_on_host]).toEqual(["drive-0", "drive-1"]);
    expect(by("/drives/vda")).not.toHaveProperty("rate_limiter");
    expect(by("/drives/vdb").rate_limiter).toEqual({ bandwidth: { size: 50 << 20, refill_time: 1000 }, ops: { size: 5000, refill_time: 1000, one_time_burst: 1000 } });
    expect(by("/network-interfaces/eth0")).toMatchObject({ rx_rate_limiter: { bandwidth: { size: 10 << 20, refill_time: 1000 } }, tx_rate_limiter: { bandwidth: { size: 5 << 20, refill_time: 1000 } } });
    expect(by("/mmds/config")).toEqual({ network_interfaces: ["eth0"], version: "V2" });
    expect(by("/mmds")).toEqual({ sandboxId: "sbx-1", templateId: "base", envdToken: "t0k" });
    expect(by("/vsock")).toEqual({ guest_cid: 3, uds_path: "vsock.sock" });
    expect(by("/machine-config").track_dirty_pages).toBe(true);
    // Under the jailer the kernel is the jail's copy.
    const jailed = fc.bootRequests(prodSpec({ initrd: "/k/initrd" }), { jailer: { uid: 1, gid: 1, chrootBaseDir: "/srv/none" } });
    expect(jailed.find((r) => r.path === "/boot-source")!.body).toEqual({ kernel_image_path: "/vmlinux", initrd_path: "/initrd", boot_args: "console=ttyS0" });
    allConform(jailed);
  });

  test("boot: bad metadata, limits or MMDS without an interface are BadSpec", () => {
    const code = (f: () => unknown) => {
      try {
        f();
      } catch (e) {
        return (e as VmmError).code;
      }
      return "none";
    };
    expect(code(() => fc.bootRequests(prodSpec({ net: undefined, netRateLimit: undefined })))).toBe("BadSpec");
    expect(code(() => fc.bootRequests(prodSpec({ metadata: undefined, net: undefined })))).toBe("BadSpec");
    expect(code(() => fc.bootRequests(prodSpec({ metadata: { n: 1 as never } })))).toBe("BadSpec");
    expect(code(() => fc.bootRequests(prodSpec({ metadata: { "": "x" } })))).toBe("BadSpec");
    expect(code(() => fc.bootRequests(prodSpec({ drives: [{ path: "/t", rateLimit: { ops: { size: -1, refillTimeMs: 1 } } }] })))).toBe("BadSpec");
    expect(code(() => fc.bootRequests(prodSpec({ netRateLimit: { rx: { bandwidth: { size: 1.5, refillTimeMs: 1 } } } })))).toBe("BadSpec");
    // No metadata: no MMDS at all; no vsock unless asked.
    const plain = fc.bootRequests(prodSpec({ metadata: undefined, vsock: false }));
    expect(plain.some((r) => r.path.startsWith("/mmds") || r.path === "/vsock")).toBe(false);
  });

  test("restore: telemetry, load paused, this VM's limits by PATCH, its MMDS data again (a snapshot keeps none), Resumed", () => {
    const old = prodSpec();
    const snap: SnapshotInfo = { vmm: "firecracker", dir: "/s", statePath: "/s/vmstate", memPath: "/s/mem", spec: old, createdAt: "", extra: { snapshotType: "Full", drives: ["drive-0", "drive-1"] } };
    const spec = { ...old, id: "sbx-2", runDir: "/run/sbx-2", net: { tap: "tap9" }, metadata: { sandboxId: "sbx-2" } };
    const drives = [{ path: "/t2", readOnly: true }, { path: "/dev/ublkb9", rateLimit: { bandwidth: { size: 0, refillTimeMs: 0 } } }];
    const reqs = fc.restoreRequests(snap, spec, { drives, netRateLimit: { tx: { ops: { size: 100, refillTimeMs: 1000 } } } }, { statePath: "/s/vmstate", memPath: "/s/mem" }, { trackDirtyPages: true });
    expect(reqs.map((r) => `${r.method} ${r.path}`)).toEqual([
      "PUT /logger", "PUT /metrics", "PUT /snapshot/load", "PATCH /drives/vdb", "PATCH /network-interfaces/eth0", "PUT /mmds", "PATCH /vm",
    ]);
    allConform(reqs);
    expect(reqs[2]!.body).toEqual({
      snapshot_path: "/s/vmstate", mem_backend: { backend_type: "File", backend_path: "/s/mem" }, track_dirty_pages: true, resume_vm: false,
      network_overrides: [{ iface_id: "eth0", host_dev_name: "tap9" }],
    });
    // A 0-sized bucket lifts the limit; PATCH never names a path (the drive keeps its per-VM name).
    expect(reqs[3]!.body).toEqual({ drive_id: "vdb", rate_limiter: { bandwidth: { size: 0, refill_time: 0 } } });
    expect(reqs[4]!.body).toEqual({ iface_id: "eth0", tx_rate_limiter: { ops: { size: 100, refill_time: 1000 } } });
    expect(reqs[5]!.body).toEqual({ sandboxId: "sbx-2" });
    expect(reqs[6]!.body).toEqual({ state: "Resumed" });
    // Same TAP, no limits, no metadata: load and resume only.
    const bare = fc.restoreRequests({ ...snap, spec: { ...old, metadata: undefined } }, { ...old, metadata: undefined }, { drives: [{ path: "/a" }, { path: "/b" }] }, { statePath: "/x", memPath: "/y" });
    expect(bare.map((r) => r.path)).toEqual(["/logger", "/metrics", "/snapshot/load", "/vm"]);
    expect(bare[2]!.body).not.toHaveProperty("network_overrides");
    allConform(bare);
  });

  test("rate limits on a running VM: PATCH per drive given and for the interface", () => {
    const reqs = fc.rateLimitRequests({ drives: [undefined, { ops: { size: 10, refillTimeMs: 100 } }], net: { rx: { bandwidth: { size: 1, refillTimeMs: 1 } } } });
    expect(reqs.map((r) => `${r.method} ${r.path}`)).toEqual(["PATCH /drives/vdb", "PATCH /network-interfaces/eth0"]);
    allConform(reqs);
    expect(fc.rateLimitRequests({})).toEqual([]);
  });

  test("snapshot type: Diff only with dirty tracking, and only onto a base that still exists", () => {
    const dir = scratchDir("fc-type");
    const base = join(dir, "mem");
    writeFileSync(base, "");
    expect(fc.snapshotTypeFor(false, null)).toBe("Full");
    expect(fc.snapshotTypeFor(false, base)).toBe("Full");
    expect(fc.snapshotTypeFor(true, null)).toBe("Diff");
    expect(fc.snapshotTypeFor(true, base)).toBe("Diff");
    expect(fc.snapshotTypeFor(true, join(dir, "gone"))).toBe("Full");
  });
});

describe("balloon statistics", () => {
  const good = { target_pages: 65536, actual_pages: 32768, target_mib: 256, actual_mib: 128, free_memory: 1 << 28, total_memory: 1 << 29, available_memory: 300 << 20, oom_kill: 0, swap_in: 0 };
  test("a reply of the documented shape is parsed field by field", () => {
    expect(violations(good, "BalloonStats")).toEqual([]);
    expect(fc.parseBalloonStats(good, 512)).toEqual({ targetPages: 65536, actualPages: 32768, targetMib: 256, actualMib: 128, freeMemory: 1 << 28, totalMemory: 1 << 29, availableMemory: 300 << 20, oomKill: 0, swapIn: 0 });
    // Fields newer than the list are ignored; the four sizes alone are enough.
    expect(fc.parseBalloonStats({ target_pages: 0, actual_pages: 0, target_mib: 0, actual_mib: 0, future_counter: 7 }, 512)).toEqual({ targetPages: 0, actualPages: 0, targetMib: 0, actualMib: 0 });
  });
  test("bad replies are Protocol errors naming the field", () => {
    const cases: [unknown, RegExp][] = [
      [null, /not an object/],
      [[good], /not an object/],
      [{ ...good, actual_mib: undefined }, /actual_mib is not a u32/],
      [{ ...good, target_pages: "65536" }, /target_pages is not a u32/],
      [{ ...good, actual_pages: -1 }, /actual_pages is not a u32/],
      [{ ...good, target_pages: 2 ** 32 }, /target_pages is not a u32/],
      [{ ...good, free_memory: 1.5 }, /free_memory is not a non-negative integer/],
      [{ ...good, swap_out: -3 }, /swap_out/],
      [{ ...good, actual_mib: 127 }, /actual_mib is not actual_pages \/ 256/],
      [{ ...good, target_pages: 65536 * 4, target_mib: 1024 }, /larger than the guest's 512 MiB/],
    ];
    for (const [reply, msg] of cases) {
      let err: unknown;
      try {
        fc.parseBalloonStats(reply, 512);
      } catch (e) {
        err = e;
      }
      expect(err).toBeInstanceOf(VmmError);
      expect([(err as VmmError).code, (err as VmmError).message]).toEqual(["Protocol", expect.stringMatching(msg)]);
    }
    // Statistics cannot be switched off after boot.
    expect(() => fc.patchBalloonStatistics({ statsPollingIntervalS: 0 })).toThrow(/stats_polling_interval_s/);
  });
});

// ---- the driver against a fake Firecracker ---------------------------------------------------
//
// A stand-in for the binary, written out by the test: it serves the API on --api-sock, logs every
// request (with its working directory) to $FAKE_FC_LOG_DIR/<id>.jsonl and mimics the upstream rules
// these tests rely on: log and metrics files must exist, drives are opened at path_on_host relative
// to its working directory (at PUT and again at load, from what the snapshot recorded), MMDS config
// needs its interface, snapshot/create needs Paused and leaves a memory file of the guest's size in
// place (a Diff writes only its dirty page over it: page 1 + the number of Diffs in its lineage),
// load is refused after any other configuration and needs a memory file of the guest's size; a
// loaded VM maps its memory file privately (as the File backend does) and, when resumed, writes
// "dirty:<id>" into page 8 + the number of Diffs in its lineage of that mapping, as a guest would.
// FAKE_FC_ROOT (set by the fake jailer) stands for the chroot: absolute paths resolve under it.

const FAKE_FIRECRACKER = String.raw`
import { appendFileSync, closeSync, existsSync, ftruncateSync, openSync, readFileSync, statSync, writeFileSync, writeSync } from "node:fs";
import { join } from "node:path";
const args = process.argv.slice(2);
if (args.includes("--version")) { console.log("Firecracker v1.14.0"); process.exit(0); }
const arg = (n) => { const i = args.indexOf(n); if (i >= 0) return args[i + 1]; const a = args.find((x) => x.startsWith(n + "=")); return a && a.slice(n.length + 1); };
const root = process.env.FAKE_FC_ROOT || "";
const at = (p) => (p.startsWith("/") ? root + p : join(process.cwd(), p));
const id = arg("--id");
const sock = at(arg("--api-sock"));
const logFile = join(process.env.FAKE_FC_LOG_DIR, id + ".jsonl");
const st = { started: false, paused: false, configured: false, machine: null, drives: {}, ifaces: {}, mmdsConfig: null, mmds: null, balloon: null, vsock: null, diffs: 0 };
const MiB = 1 << 20;
const fault = (status, m) => new Response(JSON.stringify({ fault_message: m }), { status, headers: { "content-type": "application/json" } });
const json = (o) => new Response(JSON.stringify(o), { headers: { "content-type": "application/json" } });
const ok = () => new Response(null, { status: 204 });
const exists = (p) => { try { statSync(at(p)); return true; } catch { return false; } };
const listeners = [];
function bindVsock(p) { listeners.push(Bun.listen({ unix: at(p), socket: { data() {} } })); }
// The guest's serial console is stdout, non-blocking as Firecracker makes it: a full pipe is EAGAIN.
function toConsole(bytes) { try { writeSync(1, bytes); return true; } catch { return false; } }
// At InstanceStart a line; with $FAKE_FC_LOG_DIR/console-flood, that many bytes more (each 4 KiB
// write retried until the pipe takes it, so all of them reach the reader), then "flood-done".
function startConsole() {
  toConsole(Buffer.from("console: " + id + " started\n"));
  const flood = join(process.env.FAKE_FC_LOG_DIR, "console-flood");
  if (!existsSync(flood)) return;
  let left = Number(readFileSync(flood, "utf8"));
  const chunk = Buffer.alloc(4096, 0x61);
  const t = setInterval(() => {
    while (left > 0 && toConsole(chunk)) left -= chunk.length;
    if (left <= 0 && toConsole(Buffer.from("\nflood-done\n"))) clearInterval(t);
  }, 1);
}
function handle(method, path, b) {
  const preBoot = () => (st.started ? fault(400, "pre-boot only") : null);
  const cfg = () => { st.configured = true; };
  if (method === "GET" && path === "/") return json({ id, state: st.paused ? "Paused" : st.started ? "Running" : "Not started", vmm_version: "1.14.0", app_name: "Firecracker" });
  if (method === "PUT" && (path === "/logger" || path === "/metrics")) return exists(b.log_path || b.metrics_path) ? ok() : fault(400, "cannot open " + (b.log_path || b.metrics_path));
  if (method === "PUT" && path === "/machine-config") { cfg(); st.machine = b; return preBoot() || ok(); }
  if (method === "PUT" && path === "/boot-source") { cfg(); return preBoot() || (exists(b.kernel_image_path) ? ok() : fault(400, "no kernel at " + b.kernel_image_path)); }
  if (method === "PUT" && path.startsWith("/drives/")) { cfg(); if (st.started) return fault(400, "pre-boot only"); if (!exists(b.path_on_host)) return fault(400, "cannot open drive " + b.path_on_host); st.drives[b.drive_id] = b; return ok(); }
  if (method === "PATCH" && path.startsWith("/drives/")) { if (!st.started) return fault(400, "post-boot only"); const d = st.drives[b.drive_id]; if (!d) return fault(400, "no drive " + b.drive_id); Object.assign(d, b); return ok(); }
  if (method === "PUT" && path.startsWith("/network-interfaces/")) { cfg(); st.ifaces[b.iface_id] = b; return preBoot() || ok(); }
  if (method === "PATCH" && path.startsWith("/network-interfaces/")) { if (!st.started) return fault(400, "post-boot only"); if (!st.ifaces[b.iface_id]) return fault(400, "no iface"); Object.assign(st.ifaces[b.iface_id], b); return ok(); }
  if (method === "PUT" && path === "/mmds/config") { cfg(); for (const n of b.network_interfaces) if (!st.ifaces[n]) return fault(400, "no interface " + n); st.mmdsConfig = b; return preBoot() || ok(); }
  if (method === "PUT" && path === "/mmds") { st.mmds = b; return ok(); }
  if (method === "GET" && path === "/mmds") return st.mmds ? json(st.mmds) : fault(404, "no data");
  if (method === "PUT" && path === "/balloon") { cfg(); st.balloon = { ...b }; return preBoot() || ok(); }
  if (method === "PATCH" && path === "/balloon") { if (!st.balloon) return fault(400, "no balloon"); st.balloon.amount_mib = b.amount_mib; return ok(); }
  if (method === "GET" && path === "/balloon/statistics") {
    const forced = join(process.env.FAKE_FC_LOG_DIR, "balloon-stats.json");
    if (existsSync(forced)) return json(JSON.parse(readFileSync(forced, "utf8")));
    const a = st.balloon.amount_mib;
    return json({ target_pages: a * 256, actual_pages: a * 256, target_mib: a, actual_mib: a, free_memory: 1 << 26 });
  }
  if (method === "PUT" && path === "/vsock") { cfg(); if (st.started) return fault(400, "pre-boot only"); st.vsock = b; bindVsock(b.uds_path); return ok(); }
  if (method === "PUT" && path === "/entropy") { cfg(); return preBoot() || ok(); }
  if (method === "PUT" && path === "/actions") { if (b.action_type === "InstanceStart") { st.started = true; startConsole(); } return ok(); }
  if (method === "PATCH" && path === "/vm") {
    if (!st.started) return fault(400, "not started");
    st.paused = b.state === "Paused";
    if (!st.paused && st.mem) { const t = "dirty:" + id; for (let i = 0; i < t.length; i++) st.mem[(8 + st.diffs) * 4096 + i] = t.charCodeAt(i); }
    return ok();
  }
  if (method === "PUT" && path === "/snapshot/create") {
    if (!st.paused) return fault(400, "the microVM must be paused");
    const size = st.machine.mem_size_mib * MiB;
    writeFileSync(at(b.snapshot_path), JSON.stringify({ machine: st.machine, drives: st.drives, ifaces: st.ifaces, mmdsConfig: st.mmdsConfig, balloon: st.balloon, vsock: st.vsock, diffs: st.diffs + (b.snapshot_type === "Diff" ? 1 : 0) }));
    const mem = at(b.mem_file_path);
    const fd = openSync(mem, existsSync(mem) ? "r+" : "w+");
    if (statSync(mem).size !== size) ftruncateSync(fd, 0);
    ftruncateSync(fd, size);
    if (b.snapshot_type === "Diff") { st.diffs++; writeSync(fd, Buffer.from("diff:" + id), 0, 5 + id.length, st.diffs * 4096); }
    else writeSync(fd, Buffer.from("full:" + id), 0, 5 + id.length, 0);
    closeSync(fd);
    return ok();
  }
  if (method === "PUT" && path === "/snapshot/load") {
    if (st.configured || st.started) return fault(400, "load only on a fresh process");
    let s;
    try { s = JSON.parse(readFileSync(at(b.snapshot_path), "utf8")); } catch (e) { return fault(400, "cannot read " + b.snapshot_path); }
    const mem = b.mem_backend.backend_path;
    if (!exists(mem) || statSync(at(mem)).size < s.machine.mem_size_mib * MiB) return fault(400, "memory file " + mem + " too small or missing");
    for (const d of Object.values(s.drives)) if (!exists(d.path_on_host)) { setTimeout(() => process.exit(1), 10); return fault(400, "cannot reopen drive " + d.path_on_host); }
    Object.assign(st, { machine: s.machine, drives: s.drives, ifaces: s.ifaces, mmdsConfig: s.mmdsConfig, balloon: s.balloon, vsock: s.vsock, diffs: s.diffs, started: true, paused: true, mmds: null });
    st.mem = Bun.mmap(at(mem), { shared: false });
    for (const o of b.network_overrides || []) st.ifaces[o.iface_id].host_dev_name = o.host_dev_name;
    if (s.vsock) bindVsock(b.vsock_override ? b.vsock_override.uds_path : s.vsock.uds_path);
    return ok();
  }
  return fault(400, "unknown endpoint " + method + " " + path);
}
Bun.serve({
  unix: sock,
  async fetch(req) {
    const path = new URL(req.url).pathname;
    const text = await req.text();
    const body = text ? JSON.parse(text) : undefined;
    const res = handle(req.method, path, body);
    appendFileSync(logFile, JSON.stringify({ method: req.method, path, body, cwd: process.cwd(), status: res.status }) + "\n");
    return res;
  },
});
`;

// The jailer's rules the driver depends on: it canonicalizes --exec-file and the chroot base, names
// the chroot <base>/<exec_file_name>/<id>/root, copies the binary in, writes <exec_file_name>.pid
// (create-new) and, with --daemonize or --new-pid-ns, forks the VMM off and exits 0.
const FAKE_JAILER = String.raw`#!/bin/bash
set -e
echo "$@" >> "$FAKE_FC_LOG_DIR/jailer.args"
base=/srv/jailer; fork=
while [ $# -gt 0 ]; do case "$1" in
  --id) id=$2; shift 2;; --exec-file) exec_file=$2; shift 2;; --chroot-base-dir) base=$2; shift 2;;
  --uid|--gid|--netns|--cgroup-version|--cgroup|--parent-cgroup|--resource-limit) shift 2;;
  --daemonize|--new-pid-ns) fork=1; shift;; --) shift; break;; *) echo "jailer: unknown $1" >&2; exit 1;;
esac; done
real=$(realpath -e "$exec_file"); name=$(basename "$real"); base=$(realpath -e "$base")
root="$base/$name/$id/root"; mkdir -p "$root"; cp "$real" "$root/$name"
if [ -e "$root/$name.pid" ]; then echo "jailer: $root/$name.pid exists" >&2; exit 1; fi
cd "$root"; export FAKE_FC_ROOT="$root"
if [ -n "$fork" ]; then setsid "./$name" --id="$id" "$@" </dev/null >/dev/null 2>&1 & echo $! > "$name.pid"; exit 0; fi
echo $$ > "$name.pid"; exec "./$name" --id="$id" "$@"
`;

interface Logged {
  method: string;
  path: string;
  body?: any;
  cwd: string;
  status: number;
}

/** The fake binaries in a scratch directory, and what each fake VM was sent. */
function fakeFirecracker(label: string) {
  const dir = scratchDir(label);
  const logs = join(dir, "logs");
  mkdirSync(logs);
  writeFileSync(join(dir, "fake-fc.mjs"), FAKE_FIRECRACKER);
  // The "binary" is a script that execs bun on the fake, keeping its pid.
  const bin = join(dir, "firecracker-v9.9.9");
  writeFileSync(bin, `#!/bin/sh\nFAKE_FC_LOG_DIR=${JSON.stringify(logs)} exec ${JSON.stringify(process.execPath)} ${JSON.stringify(join(dir, "fake-fc.mjs"))} "$@"\n`, { mode: 0o755 });
  // What the node is configured with: a symlink, as /usr/bin/firecracker often is.
  symlinkSync(bin, join(dir, "firecracker"));
  const jailer = join(dir, "jailer");
  writeFileSync(jailer, FAKE_JAILER.replace("#!/bin/bash\n", `#!/bin/bash\nFAKE_FC_LOG_DIR=${JSON.stringify(logs)}\n`), { mode: 0o755 });
  return {
    dir,
    bin: join(dir, "firecracker"),
    jailer,
    sent(id: string): Logged[] {
      const f = join(logs, `${id}.jsonl`);
      return existsSync(f) ? readFileSync(f, "utf8").trim().split("\n").map((l) => JSON.parse(l) as Logged) : [];
    },
  };
}

/** A regular file of `bytes` (sparse), standing in for a blockd device or an image. */
function blank(path: string, bytes = 1 << 20): string {
  writeFileSync(path, "");
  truncateSync(path, bytes);
  return path;
}

function alive(pid: number): boolean {
  try {
    const s = readFileSync(`/proc/${pid}/stat`, "utf8");
    return !"ZX".includes(s.slice(s.lastIndexOf(")") + 2, s.lastIndexOf(")") + 3));
  } catch {
    return false;
  }
}

describe("FirecrackerDriver against a fake Firecracker", () => {
  const fake = fakeFirecracker("fc-fake");
  const kernel = blank(join(fake.dir, "vmlinux"));
  const spec = (id: string, o: Partial<VmSpec> = {}): VmSpec => ({
    id,
    runDir: join(fake.dir, "run", id),
    kernel,
    cmdline: "console=ttyS0",
    vcpus: 1,
    memMiB: 4,
    drives: [{ path: blank(join(fake.dir, `${id}-tools.img`)), readOnly: true }, { path: blank(join(fake.dir, `${id}-rootfs.img`)), rateLimit: { ops: { size: 100, refillTimeMs: 1000 } } }],
    net: { tap: `tap-${id}`, mac: "06:00:AC:10:00:02" },
    metadata: { sandboxId: id },
    vsock: true,
    balloon: true,
    ...o,
  });

  test("boot, balloon, limits, snapshot; restore after the source VM and its devices are gone", async () => {
    const driver = new fc.FirecrackerDriver({ binary: fake.bin });
    const a = (await driver.boot(spec("fc-a"))) as fc.FirecrackerVm;
    try {
      const sent = fake.sent("fc-a");
      expect(sent.every((r) => r.status === 204)).toBe(true);
      allConform(sent);
      expect(sent.map((r) => r.path)).toContain("/mmds/config");
      // Relative names resolved in the VM's own run directory: symlinks to its devices.
      expect(sent[0]!.cwd).toBe(a.spec.runDir);
      expect(readlinkSync(join(a.spec.runDir, "drive-1"))).toBe(a.spec.drives[1]!.path);
      expect(a.vsockPath).toBe(join(a.spec.runDir, "vsock.sock"));
      expect(existsSync(a.vsockPath!)).toBe(true);

      expect(await a.balloon(3)).toEqual({ actualMiB: 3, targetMiB: 3 });
      expect((await a.balloonStatistics()).freeMemory).toBe(1 << 26);
      await a.setRateLimits({ drives: [undefined, { ops: { size: 0, refillTimeMs: 0 } }], net: { rx: { bandwidth: { size: 1 << 20, refillTimeMs: 100 } } } });
      await a.setMetadata({ sandboxId: "fc-a", extra: "1" });
      const later = fake.sent("fc-a").slice(sent.length);
      expect(later.map((r) => `${r.method} ${r.path} ${r.status}`)).toEqual([
        "PATCH /balloon 204", "GET /balloon/statistics 200", "GET /balloon/statistics 200", "PATCH /drives/vdb 204", "PATCH /network-interfaces/eth0 204", "PUT /mmds 204",
      ]);
      allConform(later);

      const snap = await a.snapshot(join(fake.dir, "snap-a"));
      expect(a.state).toBe("paused");
      expect(snap.extra).toEqual({ snapshotType: "Full", drives: ["drive-0", "drive-1"] });
      expect(statSync(snap.memPath!).size).toBe(4 << 20);
      expect(await readSnapshot(snap.dir)).toEqual(snap);
    } finally {
      await a.stop();
    }
    // The source VM's run directory and devices go: the restore needs neither.
    rmSync(a.spec.runDir, { recursive: true });
    for (const d of a.spec.drives) rmSync(d.path);
    const snap = await readSnapshot(join(fake.dir, "snap-a"));
    const bSpec = spec("fc-b");
    const b = (await driver.restore(snap, { id: "fc-b", runDir: bSpec.runDir, drives: bSpec.drives, net: bSpec.net, metadata: { sandboxId: "fc-b" } })) as fc.FirecrackerVm;
    try {
      const sent = fake.sent("fc-b");
      expect(sent.map((r) => `${r.method} ${r.path} ${r.status}`)).toEqual([
        "PUT /logger 204", "PUT /metrics 204", "PUT /snapshot/load 204", "PATCH /drives/vdb 204", "PUT /mmds 204", "PATCH /vm 204",
      ]);
      allConform(sent);
      expect(sent[2]!.cwd).toBe(bSpec.runDir);
      expect(sent[2]!.body.network_overrides).toEqual([{ iface_id: "eth0", host_dev_name: "tap-fc-b" }]);
      expect(sent[4]!.body).toEqual({ sandboxId: "fc-b" });
      expect(b.state).toBe("running");
      expect(existsSync(b.vsockPath!)).toBe(true);
      // Adoption keeps what the VM needs (its launch and memory base).
      const adopted = (await new fc.FirecrackerDriver({ binary: fake.bin }).adopt(bSpec.runDir)) as fc.FirecrackerVm;
      expect([adopted.pid, adopted.state, adopted.vsockPath]).toEqual([b.pid, "running", b.vsockPath]);
    } finally {
      await b.stop();
    }
    expect(b.state).toBe("stopped");
  }, 60_000);

  test("dirty tracking: Diff snapshots, merged onto the memory base, so every mem is a full image", async () => {
    const driver = new fc.FirecrackerDriver({ binary: fake.bin, trackDirtyPages: true });
    const s = spec("fc-d1");
    const a = (await driver.boot(s)) as fc.FirecrackerVm;
    const s1 = await a.snapshot(join(fake.dir, "snap-d1"));
    await a.stop();
    // A booted VM's first Diff holds every page it wrote: resumable on its own, no base.
    expect(s1.extra).toEqual({ snapshotType: "Diff", drives: ["drive-0", "drive-1"] });
    const page = (f: string, n: number) => readFileSync(f).subarray(n * 4096, n * 4096 + 8).toString("latin1").replace(/\0+$/, "");
    expect([statSync(s1.memPath!).size, page(s1.memPath!, 1)]).toEqual([4 << 20, "diff:fc-"]);

    const s2spec = spec("fc-d2");
    const b = (await driver.restore(s1, { id: "fc-d2", runDir: s2spec.runDir, drives: s2spec.drives, net: s2spec.net })) as fc.FirecrackerVm;
    expect(fake.sent("fc-d2").find((r) => r.path === "/snapshot/load")!.body.track_dirty_pages).toBe(true);
    const s2 = await b.snapshot(join(fake.dir, "snap-d2"));
    // A restored VM's Diff is written into a copy of the memory it was loaded from.
    expect(s2.extra).toEqual({ snapshotType: "Diff", drives: ["drive-0", "drive-1"], base: s1.memPath });
    expect([page(s2.memPath!, 1), page(s2.memPath!, 2)]).toEqual(["diff:fc-", "diff:fc-"]);
    expect(readFileSync(s1.memPath!).subarray(2 * 4096, 2 * 4096 + 8).every((x) => x === 0)).toBe(true);
    // Its base is now s2's mem; once that is gone, the next snapshot is Full.
    rmSync(s2.memPath!);
    await b.resume();
    const s3 = await b.snapshot(join(fake.dir, "snap-d3"));
    expect(s3.extra!.snapshotType).toBe("Full");
    // Never onto the memory it runs on.
    const err = await b.snapshot(join(fake.dir, "snap-d3")).catch((e) => e);
    expect([err.code, err.message]).toEqual(["BadSpec", expect.stringContaining("is the memory this VM runs on")]);
    await b.stop();
  }, 60_000);

  test("on a memory image (memory layers) a snapshot is the pages the guest dirtied, taken from the paused process", async () => {
    const driver = new fc.FirecrackerDriver({ binary: fake.bin, trackDirtyPages: true });
    const a = (await driver.boot(spec("fc-m1")));
    const base = await a.snapshot(join(fake.dir, "snap-m1"));
    await a.stop();
    // The image a memory device would serve: the base snapshot's memory, with marks in two pages.
    const image = join(fake.dir, "mem-image");
    const bytes = readFileSync(base.memPath!);
    bytes.set(Buffer.from("image:p8"), 8 * 4096);
    bytes.set(Buffer.from("image:p20"), 20 * 4096);
    writeFileSync(image, bytes);
    const r = spec("fc-m2");
    const vm = (await driver.restore(base, { id: "fc-m2", runDir: r.runDir, drives: r.drives, net: r.net, memImage: image })) as fc.FirecrackerVm;
    try {
      const snap = await vm.snapshot(join(fake.dir, "snap-m2"));
      // One page written since the restore (the fake's guest wrote page 8 + 1 Diff = 9 at resume).
      expect(snap.memoryImage).toBe(true);
      expect(snap.memPath).toBeUndefined();
      expect(snap.delta).toMatchObject({ pid: vm.pid, size: 4 << 20, pageSize: 4096, pages: 1 });
      expect([...new Uint32Array(readFileSync(snap.delta!.pagesFile).buffer.slice(0))]).toEqual([9, 1]);
      // The page's bytes as the layer writer reads them, from the paused process; the image is unchanged.
      const mem = await Bun.file(`/proc/${vm.pid}/mem`).slice(snap.delta!.address + 9 * 4096, snap.delta!.address + 9 * 4096 + 11).text();
      expect(mem).toBe("dirty:fc-m2");
      expect(readFileSync(image).subarray(9 * 4096, 9 * 4096 + 5).every((x) => x === 0)).toBe(true);
      // Firecracker's own memory file went to a scratch file, removed; the record has no delta.
      expect(readdirSync(snap.dir).sort()).toEqual(["mem.pages", "snapshot.json", "vmstate"]);
      expect((await readSnapshot(snap.dir)).delta).toBeUndefined();
      expect(fake.sent("fc-m2").find((q) => q.path === "/snapshot/create")!.body.snapshot_type).toBe("Diff");
      // Restoring it needs the image its layers make.
      const again = await driver.restore(await readSnapshot(snap.dir), { id: "fc-m3", runDir: spec("fc-m3").runDir, drives: r.drives, net: r.net }).catch((e: VmmError) => e);
      expect([(again as VmmError).code, (again as VmmError).message]).toEqual(["BadSpec", expect.stringContaining("restore needs memImage")]);
    } finally {
      await vm.stop();
    }
  }, 60_000);

  test("bad restores are named errors before any process starts", async () => {
    const driver = new fc.FirecrackerDriver({ binary: fake.bin });
    const a = (await driver.boot(spec("fc-e"))) as fc.FirecrackerVm;
    const snap = await a.snapshot(join(fake.dir, "snap-e"));
    await a.stop();
    const before = readdirSync(join(fake.dir, "logs")).join();
    const r = spec("fc-e2");
    const restore = (s: SnapshotInfo, o: Partial<Parameters<typeof driver.restore>[1]> = {}) =>
      driver.restore(s, { id: "fc-e2", runDir: r.runDir, drives: r.drives, net: r.net, ...o }).then(
        () => "restored",
        (e: VmmError) => `${e.code}: ${e.message}`,
      );
    expect(await restore({ ...snap, vmm: "qemu" })).toMatch(/^BadSpec: a qemu snapshot cannot be restored by Firecracker/);
    const short = join(fake.dir, "mem-short");
    blank(short, 3 << 20);
    expect(await restore({ ...snap, memPath: short })).toMatch(/^BadSpec: memory file .* has 3145728 bytes, the snapshot's guest has 4 MiB/);
    expect(await restore(snap, { memImage: join(fake.dir, "no-such-image") })).toMatch(/^BadSpec: memory file .*no-such-image/);
    expect(await restore({ ...snap, extra: undefined })).toMatch(/^BadSpec: .*no per-VM drive names/);
    expect(await restore(snap, { drives: r.drives.slice(0, 1) })).toMatch(/^BadSpec: restore needs 2 drives/);
    expect(await restore(snap, { drives: [r.drives[0]!, { ...r.drives[1]!, readOnly: true }] })).toMatch(/^BadSpec: drive 1 must be writable/);
    expect(await restore(snap, { net: undefined })).toMatch(/^BadSpec: the snapshot's VM had a network interface/);
    expect(await restore({ ...snap, statePath: join(fake.dir, "gone") })).toMatch(/^BadSpec: no snapshot state/);
    expect(await restore({ ...snap, spec: { ...snap.spec, metadata: undefined } }, { metadata: { a: "b" } })).toMatch(/^BadSpec: metadata for a restore/);
    expect(readdirSync(join(fake.dir, "logs")).join()).toBe(before);
    expect(existsSync(r.runDir)).toBe(false);
    // A bad statistics reply is a Protocol error, not a silent guess.
    const forced = join(fake.dir, "logs", "balloon-stats.json");
    writeFileSync(forced, JSON.stringify({ target_pages: 256, actual_pages: 256, target_mib: 1, actual_mib: "1" }));
    try {
      const b = (await driver.boot(spec("fc-e3"))) as fc.FirecrackerVm;
      const err = await b.balloon(2).catch((e) => e);
      expect([err.code, err.message]).toEqual(["Protocol", expect.stringContaining("actual_mib is not a u32")]);
      await b.stop();
    } finally {
      rmSync(forced);
    }
  }, 60_000);

  test("the console: Firecracker's stdout is a FIFO the node drains into console.log, never past 1 MiB; run files 0600, the run directory 0700", async () => {
    const flood = join(fake.dir, "logs", "console-flood");
    writeFileSync(flood, String(3 << 20));
    const driver = new fc.FirecrackerDriver({ binary: fake.bin });
    const vm = (await driver.boot(spec("fc-con"))) as fc.FirecrackerVm;
    try {
      let largest = 0;
      const t0 = performance.now();
      for (;;) {
        await vm.syncConsole();
        largest = Math.max(largest, statSync(vm.consoleLog).size);
        if (readFileSync(vm.consoleLog, "utf8").endsWith("flood-done\n")) break;
        if (performance.now() - t0 > 60_000) throw new Error("the flood did not reach console.log in 60 s");
        await Bun.sleep(50);
      }
      console.log(`  3 MiB through the console FIFO in ${Math.round(performance.now() - t0)} ms; console.log at most ${largest} B`);
      expect(largest).toBeLessThanOrEqual(CONSOLE_LOG_MAX_BYTES);
      expect(largest).toBeGreaterThan(CONSOLE_LOG_MAX_BYTES / 2);
      expect(statSync(vm.spec.runDir).mode & 0o777).toBe(0o700);
      const modes = readdirSync(vm.spec.runDir).flatMap((n) => {
        const st = lstatSync(join(vm.spec.runDir, n));
        return st.isSymbolicLink() || (st.mode & 0o777) === 0o600 ? [] : [`${n} ${(st.mode & 0o777).toString(8)}`];
      });
      expect(modes).toEqual([]);
    } finally {
      rmSync(flood);
      await vm.stop();
    }
  }, 90_000);

  test("the jailer by default: one on PATH and a root node run the VMM under it, as the VMM user", async () => {
    expect(fc.defaultJailer({ uid: 990, gid: 991 }, null)).toBeUndefined();
    const j = fc.defaultJailer({ uid: 990, gid: 991 }, "/usr/bin/jailer")!;
    expect(j).toEqual({ binary: "/usr/bin/jailer", uid: 990, gid: 991 });
    const plan = fc.launchPlan({ id: "fc-dj", runDir: "/run/fc-dj" }, { binary: fake.bin, jailer: j });
    expect(plan.argv.slice(0, 9)).toEqual(["/usr/bin/jailer", "--id", "fc-dj", "--exec-file", realpathSync(fake.bin), "--uid", "990", "--gid", "991"]);
    expect(plan.argv.slice(9)).toEqual(["--", "--api-sock", "/firecracker.sock"]);
    // null: never, whatever is on PATH.
    expect(fc.launchPlan({ id: "fc-dj", runDir: "/run/fc-dj" }, { binary: fake.bin, jailer: null }).argv[0]).toBe(fake.bin);
    if (process.getuid?.() !== 0) return;
    // The driver itself: the fake jailer found on PATH, the VMM user made when missing.
    const path = process.env.PATH;
    process.env.PATH = `${fake.dir}:${path}`;
    // The default chroot base: made by the driver if missing, and removed again here then.
    const madeBase = !existsSync("/srv/jailer");
    try {
      expect(fc.findJailer()).toBe(fake.jailer);
      const driver = new fc.FirecrackerDriver({ binary: fake.bin });
      const user = await ensureSystemUser(VMM_USER);
      const err = await driver.boot(spec("fc-dj")).catch((e) => e);
      if (err instanceof Error) throw err;
      const args = readFileSync(join(fake.dir, "logs", "jailer.args"), "utf8").trim().split("\n").at(-1)!;
      expect(args).toStartWith(`--id fc-dj --exec-file ${realpathSync(fake.bin)} --uid ${user.uid} --gid ${user.gid} `);
      expect(err).toBeInstanceOf(fc.FirecrackerVm);
      await (err as fc.FirecrackerVm).stop();
    } finally {
      process.env.PATH = path;
      if (madeBase) rmSync("/srv/jailer", { recursive: true, force: true });
    }
  }, 30_000);

  test("a request that gets no answer is a Timeout naming it", async () => {
    const path = join(fake.dir, "mute.sock");
    const server = Bun.listen({ unix: path, socket: { data() {} } });
    try {
      const err = (await new fc.FirecrackerApi(path).send(fc.getVersion(), 200).catch((e) => e)) as VmmError;
      expect(err).toBeInstanceOf(VmmError);
      expect([err.code, err.message]).toEqual(["Timeout", `firecracker GET /version on ${path}: no answer in 200 ms`]);
    } finally {
      server.stop(true);
    }
  });
});

/** Whether this process may bind-mount (root in a mount namespace that allows it): the jail's cross-filesystem drives need it. */
function canBindMount(dir: string): boolean {
  const src = join(dir, "bind-src");
  const dst = join(dir, "bind-dst");
  writeFileSync(src, "x");
  writeFileSync(dst, "");
  const ok = Bun.spawnSync(["mount", "--bind", src, dst], { stderr: "ignore" }).exitCode === 0;
  if (ok) Bun.spawnSync(["umount", dst]);
  rmSync(src);
  rmSync(dst);
  return ok;
}

describe("FirecrackerDriver under a (fake) jailer", () => {
  const fake = fakeFirecracker("fc-jail");
  const base = join(fake.dir, "jails");
  mkdirSync(base);
  // The configured chroot base is a symlink: the jailer canonicalizes it, and so must the driver.
  symlinkSync(base, join(fake.dir, "jails-link"));
  // /dev/shm is another filesystem here: what must be copied or bind-mounted into the jail.
  const other = existsSync("/dev/shm") && statSync("/dev/shm").dev !== statSync(fake.dir).dev ? mkdtempSync("/dev/shm/fc-jail-") : undefined;
  afterAll(() => other && rmSync(other, { recursive: true, force: true }));
  const bind = !!other && canBindMount(fake.dir);
  const jailer = (o: Partial<fc.JailerOptions> = {}): fc.JailerOptions => ({ binary: fake.jailer, uid: process.getuid!(), gid: process.getgid!(), chrootBaseDir: join(fake.dir, "jails-link"), daemonize: true, ...o });
  const kernel = blank(join(other ?? fake.dir, "vmlinux"), 4096);
  const spec = (id: string): VmSpec => ({
    id,
    runDir: join(fake.dir, "run", id),
    kernel,
    cmdline: "console=ttyS0",
    vcpus: 1,
    memMiB: 4,
    drives: [{ path: blank(join(fake.dir, `${id}-tools.img`)), readOnly: true }, { path: blank(join(bind ? other! : fake.dir, `${id}-rootfs.img`)) }],
    net: { tap: `tap-${id}` },
    metadata: { sandboxId: id },
    vsock: true,
  });
  const jailOf = (id: string) => join(base, "firecracker-v9.9.9", id);

  test("exec-file canonicalized, the VMM's pid from the jail's pid file, files linked/copied/bound in, snapshots moved out, jails removed", async () => {
    const driver = new fc.FirecrackerDriver({ binary: fake.bin, jailer: jailer() });
    const s = spec("fj-a");
    const a = (await driver.boot(s)) as fc.FirecrackerVm;
    const root = join(jailOf("fj-a"), "root");
    try {
      // The chroot is named after the binary's real name, and the jailer got its canonical path.
      expect(readFileSync(join(fake.dir, "logs", "jailer.args"), "utf8")).toContain(`--exec-file ${realpathSync(fake.bin)} `);
      const pid = Number(readFileSync(join(root, "firecracker-v9.9.9.pid"), "utf8"));
      expect(a.pid).toBe(pid);
      expect(alive(pid)).toBe(true);
      const sent = fake.sent("fj-a");
      allConform(sent);
      expect(sent.every((r) => r.status === 204 && r.cwd === root)).toBe(true);
      expect(sent.find((r) => r.path === "/boot-source")!.body.kernel_image_path).toBe("/vmlinux");
      expect(sent.find((r) => r.path === "/logger")!.body.log_path).toBe("/firecracker.log");
      // Same filesystem: a hard link; another: the kernel copied, a writable drive bind-mounted.
      expect(statSync(join(root, "drive-0")).ino).toBe(statSync(s.drives[0]!.path).ino);
      if (other) expect(statSync(join(root, "vmlinux")).ino).not.toBe(statSync(kernel).ino);
      if (bind) expect(fc.mountsUnder(root)).toEqual([join(root, "drive-1")]);
      expect(a.vsockPath).toBe(join(root, "vsock.sock"));

      const snap = await a.snapshot(join(fake.dir, "snap-j"));
      const create = fake.sent("fj-a").find((r) => r.path === "/snapshot/create")!;
      expect(create.body).toEqual({ snapshot_type: "Full", snapshot_path: "/snapshot/vmstate", mem_file_path: "/snapshot/mem" });
      expect([snap.statePath, snap.memPath]).toEqual([join(fake.dir, "snap-j", "vmstate"), join(fake.dir, "snap-j", "mem")]);
      expect(statSync(snap.memPath!).size).toBe(4 << 20);
      expect(readdirSync(join(root, "snapshot"))).toEqual([]);

      const r = spec("fj-b");
      const b = (await driver.restore(snap, { id: "fj-b", runDir: r.runDir, drives: r.drives, net: r.net, metadata: { sandboxId: "fj-b" } })) as fc.FirecrackerVm;
      const rootB = join(jailOf("fj-b"), "root");
      try {
        const load = fake.sent("fj-b").find((q) => q.path === "/snapshot/load")!;
        expect([load.status, load.cwd, load.body.snapshot_path, load.body.mem_backend]).toEqual([204, rootB, "/restore/vmstate", { backend_type: "File", backend_path: "/restore/mem" }]);
        expect(statSync(join(rootB, "restore", "mem")).ino).toBe(statSync(snap.memPath!).ino);
        expect(alive(b.pid)).toBe(true);
      } finally {
        await b.stop();
      }
      expect(existsSync(jailOf("fj-b"))).toBe(false);
      expect(alive(b.pid)).toBe(false);
    } finally {
      await a.stop();
    }
    expect(existsSync(jailOf("fj-a"))).toBe(false);
    expect(fc.mountsUnder(base)).toEqual([]);
    expect(alive(a.pid)).toBe(false);
  }, 60_000);

  test("without --daemonize the jailer execs in place: the spawned process is the VMM", async () => {
    const driver = new fc.FirecrackerDriver({ binary: fake.bin, jailer: jailer({ daemonize: false }) });
    const a = await driver.boot(spec("fj-c"));
    try {
      expect(Number(readFileSync(join(jailOf("fj-c"), "root", "firecracker-v9.9.9.pid"), "utf8"))).toBe(a.pid);
      expect(fc.launchPlan(spec("fj-c"), { binary: fake.bin, jailer: jailer({ daemonize: false }) }).pidFile).toBeUndefined();
      expect(fc.launchPlan(spec("fj-c"), { binary: fake.bin, jailer: jailer({ daemonize: false, newPidNs: true }) }).pidFile).toBe(join(jailOf("fj-c"), "root", "firecracker-v9.9.9.pid"));
    } finally {
      await a.stop();
    }
    expect(existsSync(jailOf("fj-c"))).toBe(false);
  }, 60_000);

  test("placing files: link on one filesystem; across, a copy for what is read once and a bind mount for devices", async () => {
    const dir = scratchDir("fc-place");
    const src = join(dir, "f");
    writeFileSync(src, "data");
    expect(await fc.placeInJail(src, join(dir, "linked"), "live")).toBe("link");
    expect(statSync(join(dir, "linked")).ino).toBe(statSync(src).ino);
    // A symlink is followed: the jail gets the file, not a link pointing outside it.
    symlinkSync(src, join(dir, "sym"));
    expect(await fc.placeInJail(join(dir, "sym"), join(dir, "via-sym"), "once")).toBe("link");
    expect(statSync(join(dir, "via-sym")).ino).toBe(statSync(src).ino);
    const missing = await fc.placeInJail(join(dir, "nope"), join(dir, "x"), "once").catch((e) => e);
    expect(missing.code).toBe("StartFailed");
    if (!other) return;
    const far = join(other, "far");
    writeFileSync(far, "far data");
    expect(await fc.placeInJail(far, join(dir, "copied"), "once", { uid: process.getuid!(), gid: process.getgid!() })).toBe("copy");
    expect(readFileSync(join(dir, "copied"), "utf8")).toBe("far data");
    if (!bind) return;
    const jail = join(dir, "jail");
    mkdirSync(jail);
    expect(await fc.placeInJail(far, join(jail, "bound"), "live")).toBe("bind");
    writeFileSync(join(jail, "bound"), "written through");
    expect(readFileSync(far, "utf8")).toBe("written through");
    await fc.cleanJail(jail);
    expect([existsSync(jail), readFileSync(far, "utf8")]).toEqual([false, "written through"]);
  });
});
