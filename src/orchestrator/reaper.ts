// The reaper: the node's periodic duties. Expired sandboxes are paused or killed, running ones
// sampled for metrics, balloons follow host memory pressure, and blockd devices nobody holds
// are given back (orphans.ts).
import { envdMetrics } from "./envd.ts";
import { kill } from "./kill.ts";
import { deviceHolders } from "./ledger.ts";
import type { NodeState } from "./node_state.ts";
import { type ListedDevice, ORPHAN_GRACE_MS } from "./orphans.ts";
import { pause } from "./pause_resume.ts";

/** E2B's SandboxMetric: one sample of the guest's envd. */
export interface SandboxMetric {
  timestamp: string;
  timestampUnix: number;
  cpuCount: number;
  cpuUsedPct: number;
  memUsed: number;
  memTotal: number;
  memCache: number;
  diskUsed: number;
  diskTotal: number;
}

/** A running sandbox is sampled every 5 s; the last 360 samples (30 min) of each are kept. */
export const METRICS_INTERVAL_MS = 5000;
/** How often the reaper compares blockd's devices with what the node holds (orphans.ts). */
export const ORPHAN_SWEEP_INTERVAL_MS = 2000;
const METRICS_KEPT = 360;

/**
 * Every `intervalMs`: an expired running sandbox is paused (autoPause) or killed. Every
 * METRICS_INTERVAL_MS it also starts a metrics round (one at a time, not waited for).
 */
export function startReaper(node: NodeState, intervalMs: number): void {
  let sampledAt = 0;
  let sampling = false;
  const tick = async () => {
    if (!sampling && Date.now() - sampledAt >= METRICS_INTERVAL_MS) {
      sampling = true;
      sampledAt = Date.now();
      void Promise.all([sampleAll(node).catch(() => {}), relieveMemory(node).catch((e) => console.error(`orchestrator: balloons: ${(e as Error).message}`))])
        .finally(() => { sampling = false; });
    }
    if (Date.now() - node.sweptAt >= ORPHAN_SWEEP_INTERVAL_MS) {
      node.sweptAt = Date.now();
      await reclaimOrphans(node).catch((e) => console.error(`orchestrator: orphan sweep: ${(e as Error).message}`));
    }
    for (const r of node.store.expired(Date.now(), 64)) {
      if (node.inflight.has(r.id)) continue;
      const op = r.autoPause ? pause(node, r.id, { memory: r.autoPauseMemory !== false }) : kill(node, r.id);
      await op.catch((e) => console.error(`reaper: ${r.autoPause ? "pause" : "kill"} ${r.id}: ${(e as Error).message}`));
    }
    if (!node.closed) node.reaper = setTimeout(tick, intervalMs);
  };
  node.reaper = setTimeout(tick, intervalMs);
}

/** Stops the reaper; sandboxes keep running (blockd and the VMMs outlive the node). */
export function close(node: NodeState): void {
  node.closed = true;
  if (node.reaper) clearTimeout(node.reaper);
  node.traces.close();
}

/** Test and shutdown helper: kill every sandbox. */
export async function killAll(node: NodeState): Promise<void> {
  for (const r of node.store.all()) await kill(node, r.id).catch(() => {});
}

/** One sample from the guest's envd into the sandbox's ring (none while it is paused or gone). */
export async function sample(node: NodeState, id: string): Promise<void> {
  const url = node.envdUrl(id);
  const rec = node.store.get(id);
  if (!url || !rec) return;
  const m = await envdMetrics(url, rec.envdAccessToken);
  if (!m) return;
  if (!node.live.has(id)) return; // went away while asked: no ring for it again
  const ts = (m.ts ?? Math.floor(Date.now() / 1000)) * 1000;
  const s: SandboxMetric = {
    timestamp: new Date(ts).toISOString(), timestampUnix: Math.floor(ts / 1000), cpuCount: m.cpu_count ?? rec.cpuCount,
    cpuUsedPct: m.cpu_used_pct ?? 0, memUsed: m.mem_used ?? 0, memTotal: m.mem_total ?? 0, memCache: m.mem_cache ?? 0,
    diskUsed: m.disk_used ?? 0, diskTotal: m.disk_total ?? 0,
  };
  const ring = node.samples.get(id) ?? [];
  // One sample per second at most: a second one in the same second replaces it.
  if (ring.at(-1)?.timestampUnix === s.timestampUnix) ring.pop();
  ring.push(s);
  if (ring.length > METRICS_KEPT) ring.shift();
  node.samples.set(id, ring);
}

/** A sample of every running sandbox with no operation in flight (the reaper's tick, every METRICS_INTERVAL_MS). */
async function sampleAll(node: NodeState): Promise<void> {
  await Promise.all([...node.live.keys()].filter((id) => !node.inflight.has(id)).map((id) => sample(node, id)));
}

/** One pass of the balloon policy (see balloonPressurePct); a VM without a balloon is left alone. */
async function relieveMemory(node: NodeState): Promise<void> {
  const pct = node.opts.balloonPressurePct ?? 10;
  if (pct <= 0) return;
  const info = await Bun.file("/proc/meminfo").text();
  const kb = (k: string) => Number(new RegExp(`^${k}:\\s+(\\d+)`, "m").exec(info)?.[1] ?? NaN);
  const available = (kb("MemAvailable") / kb("MemTotal")) * 100;
  const inflate = available < pct;
  if (!inflate && available < 2 * pct) return;
  for (const id of [...node.ballooned]) if (!node.live.has(id)) node.ballooned.delete(id);
  for (const [id, { vm }] of node.live) {
    if (!vm.spec.balloon || inflate === node.ballooned.has(id) || vm.state !== "running" || node.inflight.has(id)) continue;
    await vm.balloon(inflate ? Math.max(1, Math.floor(vm.spec.memMiB / 2)) : vm.spec.memMiB);
    if (inflate) node.ballooned.add(id);
    else node.ballooned.delete(id);
  }
}

/**
 * Gives back blockd devices nobody holds for `graceMs` (orphans.ts): an acquired pool device is
 * released, a read-only device deleted (every reference). Returns their ids.
 */
export async function reclaimOrphans(node: NodeState, graceMs = node.opts.orphanGraceMs ?? ORPHAN_GRACE_MS): Promise<string[]> {
  const acquiring = () => node.blockd.inFlight("acquire") + node.blockd.inFlight("createReadOnly");
  const quiet = acquiring() === 0;
  const devices = await node.blockd.call<ListedDevice[]>("list");
  const holders = deviceHolders(node, devices);
  const picked = node.orphans.pick(devices, (d) => holders.has(d.id), quiet && acquiring() === 0, Date.now(), graceMs);
  for (const d of picked) {
    console.error(`orchestrator: device ${d.id} (${d.kind}${d.acquired ? ", acquired" : ""}) is held by nobody: given back`);
    if (d.acquired) await node.blockd.call("release", { id: d.id }).catch((e) => console.error(`orchestrator: release ${d.id}: ${(e as Error).message}`));
    else for (let i = 0; i < Math.max(1, d.refs); i++) await node.blockd.call("delete", { id: d.id }).catch(() => {});
    node.orphans.done(d.id);
    node.orphans.reclaimed++;
  }
  return picked.map((d) => d.id);
}
