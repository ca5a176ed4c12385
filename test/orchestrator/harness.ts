// One node's parts for orchestrator tests, built the way src/node/main.ts builds them, over a given
// state directory, so a second process (or a second life of the node) can build them again.
import { join } from "node:path";
import { envdToolsDisk, guestCmdline, sealedLayer } from "../../src/template/artifacts.ts";
import { createApi } from "../../src/api/app.ts";
import { SandboxProxy } from "../../src/api/proxy.ts";
import { sandboxRoutes } from "../../src/api/sandboxes.ts";
import { serveNode } from "../../src/api/server.ts";
import type { BlockdClient } from "../../src/blockdev/client.ts";
import { existsSync } from "node:fs";
import { haveTool, SlotPool, type Egress, type NetworkConfig } from "../../src/network/index.ts";
import { Orchestrator } from "../../src/orchestrator/orchestrator.ts";
import { SandboxStore } from "../../src/orchestrator/store.ts";
import { openSnapshotStore, type S3Settings } from "../../src/snapshot/index.ts";
import { TemplateStore } from "../../src/orchestrator/templates.ts";
import { QemuDriver } from "../../src/vmm/qemu.ts";
import type { RestoreSpec, SnapshotInfo, VmSpec, Vmm, VmmDriver } from "../../src/vmm/types.ts";
import { guestFixture, vmSkipReason } from "../vmm/harness.ts";

/** Why sandboxes (VMs in network slots) cannot run here, or undefined when they can. */
export function sandboxSkipReason(): string | undefined {
  const vm = vmSkipReason();
  if (vm) return vm;
  if (!existsSync("/dev/net/tun")) return "no /dev/net/tun for the slot's TAP";
  for (const t of ["ip", "nft", "sysctl", "conntrack"] as const) if (!haveTool(t)) return `${t} is missing (see .ci/deps)`;
  return undefined;
}

export interface NodeDirs {
  /** Holds node.db and home/. */
  dir: string;
  /** VM run directories (tmpfs). */
  runRoot: string;
  /** Slot names and addresses: unique per test file. */
  slotPrefix: string;
  slotCidr: string;
}

/** The busybox template with our envd (what the orchestrator tests start sandboxes from). */
export async function busyboxTemplate(templates: TemplateStore): Promise<void> {
  if (templates.resolve("busybox")) return;
  const fx = await guestFixture();
  templates.insert({
    id: "busyboxtpl", alias: "busybox", kind: "template", names: ["busybox:default"], cpuCount: 1, memoryMB: 256,
    diskSizeMB: 64, layers: [fx.rootfsLayer], checkpoint: null, sourceSandboxId: null, envdVersion: "0.6.13", createdAt: Date.now(),
  });
}

/** QEMU whose VMs await `beforeSnapshot` (while set) before each snapshot starts: a test's hook into a checkpoint. */
export class SnapshotHookDriver extends QemuDriver {
  beforeSnapshot: ((vm: Vmm) => Promise<void>) | undefined;

  override async boot(spec: VmSpec): Promise<Vmm> {
    return this.hooked(await super.boot(spec));
  }

  override async restore(snap: SnapshotInfo, spec: RestoreSpec): Promise<Vmm> {
    return this.hooked(await super.restore(snap, spec));
  }

  override async adopt(runDir: string): Promise<Vmm> {
    return this.hooked(await super.adopt(runDir));
  }

  private hooked(vm: Vmm): Vmm {
    const snapshot = vm.snapshot.bind(vm);
    vm.snapshot = async (dir, opts) => {
      await this.beforeSnapshot?.(vm);
      return snapshot(dir, opts);
    };
    return vm;
  }
}

/** Store, templates, slots (keeping those that sandboxes use) and an orchestrator over `blockd`. */
/** `snapshots`: where snapshots go (openSnapshotStore's location and S3 settings); default a directory in d.dir. */
/** `egress`: builds the node's egress over the started pool (egress policies are then enforced). */
/** `driver`: the VMM driver (default a QemuDriver); `traceWindowMs`: the orchestrator's option of that name. */
export async function nodeParts(d: NodeDirs, blockd: BlockdClient, o: { slotPool?: number; maxSandboxes?: number; snapshots?: { location: string; s3: S3Settings }; egress?: (cfg: NetworkConfig) => Promise<Egress>; caBundle?: string; balloonPressurePct?: number; memoryLayersMax?: number; driver?: VmmDriver; traceWindowMs?: number } = {}) {
  const fx = await guestFixture();
  const toolsLayer = await sealedLayer(await envdToolsDisk());
  const store = new SandboxStore(join(d.dir, "node.db"));
  const snapshotStore = openSnapshotStore(o.snapshots?.location ?? join(d.dir, "snapshots"), { home: join(d.dir, "home"), s3: o.snapshots?.s3 });
  const templates = new TemplateStore(store.db);
  await busyboxTemplate(templates);
  const pool = new SlotPool({ size: o.slotPool ?? 1, prefix: d.slotPrefix, hostCidr: d.slotCidr, hostTable: `${d.slotPrefix.replaceAll("-", "_")}host` });
  await pool.start({ adopt: Orchestrator.slotsInUse(store) });
  const egress = await o.egress?.(pool.config);
  const orch = new Orchestrator(store, templates, blockd, pool, o.driver ?? new QemuDriver(), {
    kernel: fx.kernel.vmlinux, initrd: fx.kernel.initrd, toolsLayer,
    cmdline: (s) => guestCmdline({ ip: `${s.guestIp}/${s.guestPrefixLen}`, gw: s.gatewayIp }),
  }, { home: join(d.dir, "home"), runRoot: d.runRoot, defaultTimeoutS: 300, maxSandboxes: o.maxSandboxes ?? 12, forkParallelism: 2, snapshots: snapshotStore, egress, caBundle: o.caBundle, balloonPressurePct: o.balloonPressurePct, memoryLayersMax: o.memoryLayersMax, traceWindowMs: o.traceWindowMs });
  return { store, templates, pool, orch, snapshotStore };
}

/** The node's API and proxy over `orch` on a loopback port. */
export function serveParts(orch: Orchestrator, apiKey: string) {
  const proxy = new SandboxProxy(orch, { domain: "" });
  const app = createApi({ apiKey, maxBodyBytes: 1 << 20, notReadyReason: () => undefined, version: "test" })
    .use(sandboxRoutes(() => orch, { domain: null, defaultTimeoutS: 300 }));
  const server = serveNode(app, { hostname: "127.0.0.1", port: 0, proxy: () => proxy });
  return { base: `http://127.0.0.1:${server.port}`, stop: () => void server.stop(true) };
}
