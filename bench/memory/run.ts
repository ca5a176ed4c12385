// Memory as layers, measured under real QEMU VMs (docs/vmm.md, "Memory layers"), each row against
// a baseline taken in the same run:
// - pause (VMM stop + dirty-page scan + device state, then the memory layer written by blockd) vs
//   MiB dirtied (1, 64, 512 in a 1 GiB guest), against a full snapshot of the same VM (QEMU's
//   migration stream with its RAM in it, what a snapshot cost before memory layers);
// - resume (restore until the guest answers) from stacks of 1, 4 and 16 memory layers;
// - host memory (PSS of the VMMs, which counts shared page cache and tmpfs RAM files in shares)
//   of 16 VMs restored from one snapshot vs 16 cold boots;
// - an idle restored VM's private memory before and after free page reporting returns what a
//   workload freed.
//   npx bun bench/memory/run.ts [--guest-mib N] [--vms N] [--json]
import { mkdirSync, mkdtempSync, readFileSync, rmSync, statSync } from "node:fs";
import { join } from "node:path";
import { guestCmdline } from "../../src/template/artifacts.ts";
import { BlockdClient } from "../../src/blockdev/client.ts";
import { QemuDriver } from "../../src/vmm/qemu.ts";
import type { SnapshotInfo, Vmm } from "../../src/vmm/types.ts";
import { anonymousBytes, freePort, guestFixture, guestRun, waitHttp } from "../../test/vmm/harness.ts";

const argv = process.argv.slice(2);
const flag = (name: string, dflt: number) => {
  const i = argv.indexOf(name);
  return i >= 0 ? Number(argv[i + 1]) : dflt;
};
const GUEST_MIB = flag("--guest-mib", 1024);
const VMS = flag("--vms", 16);
const DIRTY_MIB = [1, 64, 512];
const STACKS = [1, 4, 16];
const GUEST_PORT = 8080;
const MiB = 1 << 20;
const r1 = (x: number) => Math.round(x * 10) / 10;
const results: Record<string, unknown> = {};

const fx = await guestFixture();
mkdirSync("/var/tmp/aenv-bench", { recursive: true });
const work = mkdtempSync("/var/tmp/aenv-bench/memory-");
const runRoot = mkdtempSync("/dev/shm/aenv-bench-memory-");
const state = join(work, "blockd");
mkdirSync(state, { recursive: true });
const blockd = await BlockdClient.ensure(state, {});
const driver = new QemuDriver();
const tools = await blockd.call("createReadOnly", { lowers: [fx.toolsLayer] });
const devices: string[] = [tools.id];
const live = new Set<Vmm>();
let n = 0;

async function drives(name: string) {
  const d = await blockd.call("create", { lowers: [fx.rootfsLayer], upperDir: join(work, "uppers", name), size: 64 * MiB });
  devices.push(d.id);
  return [{ path: tools.path as string, readOnly: true }, { path: d.path as string }];
}
const net = (port: number) => ({ user: { forwards: [{ hostPort: port, guestPort: GUEST_PORT }] } });
async function cold(memMiB: number) {
  const name = `c${n++}`;
  const port = freePort();
  const vm = await driver.boot({
    id: name, runDir: join(runRoot, name), kernel: fx.kernel.vmlinux, initrd: fx.kernel.initrd,
    cmdline: guestCmdline({ httpdPort: GUEST_PORT, httpdRoot: "/srv/www" }), vcpus: 1, memMiB, drives: await drives(name), net: net(port), balloon: true,
  });
  live.add(vm);
  await waitHttp(`http://127.0.0.1:${port}/health`, 120_000);
  return { vm, port };
}

async function restore(snap: SnapshotInfo, layers: string[]) {
  const name = `r${n++}`;
  const port = freePort();
  const mem = await blockd.call("createReadOnly", { lowers: layers });
  devices.push(mem.id);
  const t0 = performance.now();
  const vm = await driver.restore(snap, { id: name, runDir: join(runRoot, name), drives: await drives(name), net: net(port), memImage: mem.path });
  live.add(vm);
  await waitHttp(`http://127.0.0.1:${port}/health`, 120_000);
  return { vm, port, mem: mem.path as string, readyMs: performance.now() - t0 };
}

async function stop(vm: Vmm) {
  await vm.stop();
  live.delete(vm);
}

/** Pause into a memory layer: the VMM's part (stop, dirty scan, device state) and blockd's (the layer). */
async function pause(vm: Vmm, below: string[]) {
  const dir = join(work, `p${n++}`);
  const t0 = performance.now();
  const snap = await vm.snapshot(dir);
  const t1 = performance.now();
  const d = snap.delta!;
  const out = join(dir, "mem.layer");
  await blockd.call("memoryLayer", { out, size: d.size, from: { pid: d.pid, address: d.address, pagesFile: d.pagesFile } });
  const t2 = performance.now();
  await stop(vm);
  return { snap, layers: [...below, out], vmmMs: t1 - t0, layerMs: t2 - t1, dirtyMiB: (d.pages * 4096) / MiB, layerMiB: statSync(out).size / MiB };
}

/** The same moment as a full snapshot: QEMU's stream with the RAM in it (a restored VM's RAM is private). */
async function fullSnapshot(vm: Vmm): Promise<{ ms: number; mib: number }> {
  const qmp = (vm as unknown as { monitor: { execute<T>(c: string, a?: unknown): Promise<T> } }).monitor;
  const path = join(work, `full${n++}`);
  const t0 = performance.now();
  await qmp.execute("migrate-set-parameters", { "max-bandwidth": 100 * 1024 * MiB });
  await qmp.execute("migrate", { uri: `exec:cat > ${path}` });
  for (;;) {
    const m = await qmp.execute<{ status: string }>("query-migrate");
    if (m.status === "completed") break;
    if (m.status === "failed") throw new Error("full snapshot failed");
    await Bun.sleep(2);
  }
  const ms = performance.now() - t0;
  const mib = statSync(path).size / MiB;
  rmSync(path, { force: true });
  return { ms, mib };
}

const pss = (pid: number) => Number(/\nPss:\s+(\d+) kB/.exec(readFileSync(`/proc/${pid}/smaps_rollup`, "utf8"))![1]) / 1024;
try {
  // ---- the base: a cold boot's RAM file as one layer ---------------------------------------------
  const c = await cold(GUEST_MIB);
  const baseSnap = await c.vm.snapshot(join(work, "base"));
  await stop(c.vm);
  const base = join(work, "base.mem.layer");
  const t0 = performance.now();
  const b = await blockd.call("memoryLayer", { out: base, size: GUEST_MIB * MiB, from: { file: baseSnap.memPath } });
  results.base = { guestMiB: GUEST_MIB, layerMiB: r1(b.bytes / MiB), ms: r1(performance.now() - t0) };

  // ---- pause vs MiB dirtied -------------------------------------------------------------------------
  const pauses: Record<string, unknown>[] = [];
  for (const mib of DIRTY_MIB) {
    const r = await restore(baseSnap, [base]);
    await guestRun(r.port, `dd if=/dev/urandom of=/dev/shm/dirty bs=1M count=${mib} 2>/dev/null`, 600_000);
    await r.vm.pause();
    const full = await fullSnapshot(r.vm);
    const p = await pause(r.vm, [base]);
    const ours = p.vmmMs + p.layerMs;
    pauses.push({ dirtiedMiB: mib, dirtyMiB: r1(p.dirtyMiB), layerMiB: r1(p.layerMiB), vmmMs: r1(p.vmmMs), layerMs: r1(p.layerMs), pauseMs: r1(ours),
      fullSnapshotMs: r1(full.ms), fullSnapshotMiB: r1(full.mib), speedup: r1(full.ms / ours) });
  }
  results.pause = pauses;

  // ---- resume from stacked layers -------------------------------------------------------------------
  let layers = [base];
  let snap = baseSnap;
  const stacks: Record<string, number> = {};
  const deepest = Math.max(...STACKS);
  for (let depth = 1; ; depth++) {
    const r = await restore(snap, layers);
    if (STACKS.includes(depth)) stacks[`${depth}`] = r1(r.readyMs);
    if (depth === deepest) {
      await stop(r.vm);
      break;
    }
    await guestRun(r.port, `dd if=/dev/urandom of=/dev/shm/l${depth} bs=1M count=1 2>/dev/null`);
    ({ layers, snap } = await pause(r.vm, layers));
  }
  results.resumeMs = stacks;

  // ---- 16 restores of one snapshot vs 16 cold boots ------------------------------------------------
  const SMALL = 256;
  const sc = await cold(SMALL);
  const smallSnap = await sc.vm.snapshot(join(work, "small"));
  await stop(sc.vm);
  const smallBase = join(work, "small.mem.layer");
  await blockd.call("memoryLayer", { out: smallBase, size: SMALL * MiB, from: { file: smallSnap.memPath } });
  const restored: Vmm[] = [];
  for (let i = 0; i < VMS; i++) restored.push((await restore(smallSnap, [smallBase])).vm);
  await Bun.sleep(2000);
  const restoredPss = restored.reduce((a, vm) => a + pss(vm.pid), 0);
  for (const vm of restored) await stop(vm);
  const colds: Vmm[] = [];
  for (let i = 0; i < VMS; i++) colds.push((await cold(SMALL)).vm);
  await Bun.sleep(2000);
  const coldPss = colds.reduce((a, vm) => a + pss(vm.pid), 0);
  for (const vm of colds) await stop(vm);
  results.hostMemory = { vms: VMS, guestMiB: SMALL, restoredPssMiB: r1(restoredPss), coldPssMiB: r1(coldPss), ratio: r1(restoredPss / coldPss) };

  // ---- free page reporting ---------------------------------------------------------------------------
  const f = await restore(baseSnap, [base]);
  const idle = anonymousBytes(f.vm.pid, f.mem) / MiB;
  await guestRun(f.port, "dd if=/dev/urandom of=/dev/shm/big bs=1M count=256 2>/dev/null", 600_000);
  const busy = anonymousBytes(f.vm.pid, f.mem) / MiB;
  await guestRun(f.port, "rm /dev/shm/big");
  let after = busy;
  for (let i = 0; i < 60 && after > idle + 32; i++) {
    await Bun.sleep(500);
    after = anonymousBytes(f.vm.pid, f.mem) / MiB;
  }
  await stop(f.vm);
  results.freePageReporting = { idleMiB: r1(idle), afterWriteMiB: r1(busy), afterFreeMiB: r1(after) };
} finally {
  for (const vm of live) await vm.stop().catch(() => {});
  for (const id of devices) await blockd.call("delete", { id }).catch(() => {});
  await blockd.call("shutdown", {}).catch(() => {});
  rmSync(runRoot, { recursive: true, force: true });
  await Bun.sleep(1000);
  rmSync(work, { recursive: true, force: true });
}

if (argv.includes("--json")) console.log(JSON.stringify(results, null, 1));
else console.log(results);
