// Time to guest-ready for a cold boot and for a restore, with our own overhead (blockd device
// creation, restack, network slot, envd /init) separated from the VMM's (process start, state load)
// and the guest's (kernel, init, agent); the resident memory each extra restored VM costs; and
// envd's command round trip through the e2b SDK against the same command run on the host.
//   npx bun bench/vm/run.ts [--runs N] [--forks N] [--rtt N] [--json]
// Part 1: "ready" = busybox httpd (started by our init) answers through a loopback forward.
// Part 2: the real sandbox: envd (compiled, on the tools disk) in a VM inside a network slot;
// "ready" = envd's /health answers at the slot's address. Needs root (blockd, namespaces).

import { copyFileSync, mkdirSync, mkdtempSync, readFileSync, rmSync } from "node:fs";
import { join } from "node:path";
import { Sandbox } from "e2b";
import { debianKernel, envdToolsDisk, guestCmdline, sealedLayer, testRootfs, toolsDisk } from "../../src/template/artifacts.ts";
import { BlockdClient } from "../../src/blockdev/client.ts";
import { SlotPool, type Slot } from "../../src/network/index.ts";
import { QemuDriver } from "../../src/vmm/qemu.ts";
import type { DriveSpec, SnapshotInfo, Vmm } from "../../src/vmm/types.ts";

const argv = process.argv.slice(2);
const flag = (name: string, dflt: number) => {
  const i = argv.indexOf(name);
  return i >= 0 ? Number(argv[i + 1]) : dflt;
};
const RUNS = flag("--runs", 3);
const FORKS = flag("--forks", 3);
const RTT = flag("--rtt", 30);
const ENVD_PORT = 49983;
const GUEST_PORT = 8080;
const DISK = 64 << 20;

function freePort(): number {
  const s = Bun.listen({ hostname: "127.0.0.1", port: 0, socket: { data() {} } });
  const p = s.port;
  s.stop(true);
  return p;
}

async function waitHttp(port: number, timeoutMs = 60_000): Promise<void> {
  const until = performance.now() + timeoutMs;
  for (;;) {
    try {
      const r = await fetch(`http://127.0.0.1:${port}/health`, { signal: AbortSignal.timeout(1000) });
      if (r.ok) return void (await r.arrayBuffer());
    } catch {}
    if (performance.now() > until) throw new Error(`guest on :${port} never answered`);
    await Bun.sleep(10);
  }
}

/** Resident and proportional set size of a process, in MiB. */
function memOf(pid: number): { rss: number; pss: number; privateMiB: number } {
  const t = readFileSync(`/proc/${pid}/smaps_rollup`, "utf8");
  const kb = (k: string) => Number(new RegExp(`^${k}:\\s+(\\d+)`, "m").exec(t)?.[1] ?? 0);
  return { rss: kb("Rss") / 1024, pss: kb("Pss") / 1024, privateMiB: (kb("Private_Clean") + kb("Private_Dirty")) / 1024 };
}

const median = (xs: number[]) => [...xs].sort((a, b) => a - b)[Math.floor(xs.length / 2)]!;
const ms = (x: number) => `${Math.round(x)} ms`;

// ---- setup ----------------------------------------------------------------------------------------

const kernel = await debianKernel();
const toolsImage = await toolsDisk();
const rootfsImage = await testRootfs();
const toolsLayer = await sealedLayer(toolsImage);
const rootfsLayer = await sealedLayer(rootfsImage);
const envdToolsLayer = await sealedLayer(await envdToolsDisk());
mkdirSync("/var/tmp/aenv-bench", { recursive: true });
const work = mkdtempSync("/var/tmp/aenv-bench/vm-");
const runRoot = mkdtempSync("/dev/shm/aenv-bench-vm-");
const state = join(work, "blockd");
mkdirSync(state, { recursive: true });
const blockd = await BlockdClient.ensure(state);
const driver = new QemuDriver();
const live = new Set<Vmm>();
const cmdline = guestCmdline({ httpdPort: GUEST_PORT });
// Its own names and addresses, so a node running on this machine is never touched.
const pool = new SlotPool({ size: 2, prefix: "aenvb-", hostCidr: "10.215.0.0/24", hostTable: "aenv_bench" });
const leased = new Set<Slot>();
let seq = 0;

async function cleanup() {
  for (const vm of live) await vm.stop().catch(() => {});
  for (const s of leased) await pool.release(s).catch(() => {});
  await pool.destroy().catch(() => {});
  try {
    await blockd.call("shutdown");
    await Bun.sleep(300);
  } catch {}
  rmSync(runRoot, { recursive: true, force: true });
  rmSync(work, { recursive: true, force: true });
}

interface Timing {
  /** Of `ours` (part 2 only): taking a slot from the pool, and envd's /init once it answers. */
  slotMs?: number;
  init?: number;
  ours: number;
  vmm: number;
  guest: number;
  total: number;
}

/** blockd devices for one VM: the shared tools disk and a rootfs with its own upper. */
async function blockdDrives(lowers: string[], tools0 = toolsLayer): Promise<{ drives: DriveSpec[]; rootfsId: string }> {
  const tools = await blockd.call("createReadOnly", { lowers: [tools0] });
  const rootfs = await blockd.call("create", { lowers, upperDir: join(work, "uppers", `u${++seq}`), size: DISK });
  return { drives: [{ path: tools.path, readOnly: true }, { path: rootfs.path }], rootfsId: rootfs.id };
}

async function coldBoot(kind: "blockd" | "files"): Promise<Timing & { vm: Vmm; port: number; rootfsId?: string }> {
  const port = freePort();
  const t0 = performance.now();
  let drives: DriveSpec[];
  let rootfsId: string | undefined;
  if (kind === "blockd") ({ drives, rootfsId } = await blockdDrives([rootfsLayer]));
  else {
    // Baseline: plain files, a private copy of the rootfs per VM.
    const copy = join(work, `rootfs-${++seq}.img`);
    copyFileSync(rootfsImage, copy);
    drives = [{ path: toolsImage, readOnly: true }, { path: copy }];
  }
  const t1 = performance.now();
  const vm = await driver.boot({ id: `cold${++seq}`, runDir: join(runRoot, `cold${seq}`), kernel: kernel.vmlinux, initrd: kernel.initrd, cmdline, vcpus: 1, memMiB: 256, drives, net: { user: { forwards: [{ hostPort: port, guestPort: GUEST_PORT }] } } });
  live.add(vm);
  const t2 = performance.now();
  await waitHttp(port);
  const t3 = performance.now();
  return { vm, port, rootfsId, ours: t1 - t0, vmm: t2 - t1, guest: t3 - t2, total: t3 - t0 };
}

async function stop(vm: Vmm) {
  await vm.stop();
  live.delete(vm);
}

function report(label: string, ts: Timing[]) {
  const init = ts[0]?.init === undefined ? "" : ` (slot ${ms(median(ts.map((t) => t.slotMs!)))}, /init ${ms(median(ts.map((t) => t.init!)))})`;
  console.log(
    `${label.padEnd(34)} total ${ms(median(ts.map((t) => t.total))).padStart(8)}  = ours ${ms(median(ts.map((t) => t.ours))).padStart(7)}${init}` +
      ` + VMM ${ms(median(ts.map((t) => t.vmm))).padStart(7)} + guest ${ms(median(ts.map((t) => t.guest))).padStart(8)}   (runs: ${ts.map((t) => Math.round(t.total)).join(", ")} ms)`,
  );
}

const results: Record<string, unknown> = { accel: driver.accel, runs: RUNS, forks: FORKS };
try {
  console.log(`QEMU ${driver.accel}, 1 vCPU, 256 MiB, Debian cloud kernel + initramfs, busybox rootfs; medians of ${RUNS}`);

  // ---- cold boots -------------------------------------------------------------------------------
  for (const kind of ["files", "blockd"] as const) {
    const ts: Timing[] = [];
    for (let i = 0; i < RUNS; i++) {
      const r = await coldBoot(kind);
      ts.push(r);
      await stop(r.vm);
    }
    report(`cold boot, disks as ${kind === "files" ? "plain files" : "blockd devices"}`, ts);
    results[`cold_${kind}`] = ts;
  }

  // ---- snapshot ---------------------------------------------------------------------------------
  const src = await coldBoot("blockd");
  const ts0 = performance.now();
  const snap: SnapshotInfo = await src.vm.snapshot(join(runRoot, "snap"));
  const ts1 = performance.now();
  const layer = join(work, "snap.rootfs.layer");
  await blockd.call("restack", { id: src.rootfsId, layerPath: layer });
  const ts2 = performance.now();
  await stop(src.vm);
  console.log(`snapshot                           VMM ${ms(ts1 - ts0)} (device state ${(Bun.file(snap.statePath).size / 1024).toFixed(0)} KiB, RAM file taken over) + restack ${ms(ts2 - ts1)}`);
  results.snapshot = { vmm: ts1 - ts0, restack: ts2 - ts1 };

  // ---- restores ---------------------------------------------------------------------------------
  const restore = async (): Promise<Timing & { vm: Vmm }> => {
    const port = freePort();
    const t0 = performance.now();
    const { drives } = await blockdDrives([rootfsLayer, layer]);
    const t1 = performance.now();
    const vm = await driver.restore(snap, { id: `rest${++seq}`, runDir: join(runRoot, `rest${seq}`), drives, net: { user: { forwards: [{ hostPort: port, guestPort: GUEST_PORT }] } } });
    live.add(vm);
    const t2 = performance.now();
    await waitHttp(port);
    const t3 = performance.now();
    return { vm, ours: t1 - t0, vmm: t2 - t1, guest: t3 - t2, total: t3 - t0 };
  };
  const rs: Timing[] = [];
  for (let i = 0; i < RUNS; i++) {
    const r = await restore();
    rs.push(r);
    await stop(r.vm);
  }
  report("restore (shared RAM file, CoW)", rs);
  results.restore = rs;

  // ---- memory per extra restored VM ---------------------------------------------------------------
  const forks: Vmm[] = [];
  for (let i = 0; i < FORKS; i++) forks.push((await restore()).vm);
  await Bun.sleep(500);
  const mems = forks.map((vm) => memOf(vm.pid));
  console.log(
    `${FORKS} restores side by side: per VM RSS ${mems.map((m) => m.rss.toFixed(0)).join("/")} MiB, PSS ${mems.map((m) => m.pss.toFixed(0)).join("/")} MiB, ` +
      `private ${mems.map((m) => m.privateMiB.toFixed(0)).join("/")} MiB (the rest is the shared snapshot RAM file and QEMU's own text)`,
  );
  results.memory = mems;
  for (const vm of forks) await stop(vm);

  // ---- part 2: envd in a VM in a network slot ----------------------------------------------------
  console.log(`\nenvd in the guest, VM in a network slot (pool of ${pool.size} ready slots), ready = envd /health at nsIp:${ENVD_PORT}`);
  await pool.start();
  await pool.whenFilled();
  const slotCmdline = (s: Slot) => guestCmdline({ ip: `${s.guestIp}/${s.guestPrefixLen}`, gw: s.gatewayIp });
  const envdUrl = (s: Slot) => `http://${s.nsIp}:${ENVD_PORT}`;
  const waitEnvd = async (s: Slot) => {
    const until = performance.now() + 60_000;
    for (;;) {
      try {
        const r = await fetch(`${envdUrl(s)}/health`, { signal: AbortSignal.timeout(1000) });
        if (r.status === 204) return;
      } catch {}
      if (performance.now() > until) throw new Error(`envd in ${s.netns} never answered`);
      await Bun.sleep(10);
    }
  };
  // What the node does once envd answers: push the clock (and, in production, env vars and token).
  const initEnvd = async (s: Slot) => {
    const r = await fetch(`${envdUrl(s)}/init`, { method: "POST", body: JSON.stringify({ timestamp: new Date().toISOString() }) });
    if (r.status !== 204) throw new Error(`/init → ${r.status}`);
  };
  type SlotVm = Timing & { vm: Vmm; slot: Slot; rootfsId: string };
  const stopSlotVm = async (v: { vm: Vmm; slot: Slot }) => {
    await stop(v.vm);
    await pool.release(v.slot);
    leased.delete(v.slot);
  };
  /** ours = slot from the pool + blockd devices + /init; VMM = QEMU start (+ state load); guest = until envd answers. */
  const envdVm = async (snapshot?: SnapshotInfo, snapLayer?: string): Promise<SlotVm> => {
    const tA = performance.now();
    const slot = await pool.acquire();
    leased.add(slot);
    const tSlot = performance.now() - tA;
    // The refill's ip/nft runs are synchronous and would stall this process's timers: kept out.
    await pool.whenFilled();
    const t0 = performance.now() - tSlot;
    const { drives, rootfsId } = await blockdDrives(snapLayer ? [rootfsLayer, snapLayer] : [rootfsLayer], envdToolsLayer);
    const t1 = performance.now();
    const id = `envd${++seq}`;
    const net = { tap: slot.tap, mac: slot.guestMac };
    const vm = snapshot
      ? await driver.restore(snapshot, { id, runDir: join(runRoot, id), drives, net, netnsPath: slot.netnsPath })
      : await driver.boot({ id, runDir: join(runRoot, id), kernel: kernel.vmlinux, initrd: kernel.initrd, cmdline: slotCmdline(slot), vcpus: 1, memMiB: 256, drives, net, netnsPath: slot.netnsPath });
    live.add(vm);
    const t2 = performance.now();
    await waitEnvd(slot);
    const t3 = performance.now();
    await initEnvd(slot);
    const t4 = performance.now();
    return { vm, slot, rootfsId, slotMs: tSlot, init: t4 - t3, ours: t1 - t0 + (t4 - t3), vmm: t2 - t1, guest: t3 - t2, total: t4 - t0 };
  };

  const ecold: Timing[] = [];
  for (let i = 0; i < RUNS; i++) {
    const r = await envdVm();
    ecold.push(r);
    await stopSlotVm(r);
  }
  report("cold boot → envd ready", ecold);
  results.envd_cold = ecold;

  const esrc = await envdVm();
  // Let envd settle (its startup allocations done) before the snapshot every restore inherits.
  await Sandbox.connect("bench", { debug: true, sandboxUrl: envdUrl(esrc.slot) }).then((s) => s.commands.run("true"));
  const es0 = performance.now();
  const esnap = await esrc.vm.snapshot(join(runRoot, "envd-snap"));
  const es1 = performance.now();
  const elayer = join(work, "envd-snap.rootfs.layer");
  await blockd.call("restack", { id: esrc.rootfsId, layerPath: elayer });
  const es2 = performance.now();
  await stopSlotVm(esrc);
  console.log(`snapshot                           VMM ${ms(es1 - es0)} + restack ${ms(es2 - es1)}`);

  const erest: Timing[] = [];
  for (let i = 0; i < RUNS; i++) {
    const r = await envdVm(esnap, elayer);
    erest.push(r);
    await stopSlotVm(r);
  }
  report("restore → envd ready", erest);
  results.envd_restore = erest;

  // ---- command round trip: SDK commands.run("true") vs spawning `true` on the host --------------
  const rttVm = await envdVm(esnap, elayer);
  const sbx = await Sandbox.connect("bench", { debug: true, sandboxUrl: envdUrl(rttVm.slot) });
  for (let i = 0; i < 3; i++) await sbx.commands.run("true"); // connections and JIT warm
  const sdkRtt: number[] = [];
  for (let i = 0; i < RTT; i++) {
    const t = performance.now();
    await sbx.commands.run("true");
    sdkRtt.push(performance.now() - t);
  }
  const hostRtt: number[] = [];
  for (let i = 0; i < RTT; i++) {
    const t = performance.now();
    await Bun.spawn(["true"], { stdio: ["ignore", "ignore", "ignore"] }).exited;
    hostRtt.push(performance.now() - t);
  }
  console.log(
    `command round trip (true)          SDK → envd in the VM ${ms(median(sdkRtt))} vs host spawn ${median(hostRtt).toFixed(1)} ms ` +
      `(×${(median(sdkRtt) / median(hostRtt)).toFixed(0)}; medians of ${RTT}; p90 ${ms([...sdkRtt].sort((a, b) => a - b)[Math.floor(RTT * 0.9)]!)})`,
  );
  results.rtt = { sdk: sdkRtt, host: hostRtt };
  await stopSlotVm(rttVm);

  // ---- memory per extra restored envd VM (each has run one command) ---------------------------------
  const forksE: SlotVm[] = [];
  for (let i = 0; i < FORKS; i++) forksE.push(await envdVm(esnap, elayer));
  for (const f of forksE) await Sandbox.connect("bench", { debug: true, sandboxUrl: envdUrl(f.slot) }).then((s) => s.commands.run("true"));
  await Bun.sleep(500);
  const emems = forksE.map((f) => memOf(f.vm.pid));
  console.log(
    `${FORKS} envd restores side by side: per VM RSS ${emems.map((m) => m.rss.toFixed(0)).join("/")} MiB, PSS ${emems.map((m) => m.pss.toFixed(0)).join("/")} MiB, ` +
      `private ${emems.map((m) => m.privateMiB.toFixed(0)).join("/")} MiB`,
  );
  results.envd_memory = emems;
  for (const f of forksE) await stopSlotVm(f);

  if (argv.includes("--json")) console.log(JSON.stringify(results));
} finally {
  await cleanup();
}
