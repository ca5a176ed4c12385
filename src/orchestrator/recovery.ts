// After a node restart (docs/node.md, Restart): running sandboxes' VMs are adopted, operations the
// old process left half done are settled, and what no row names any more is given back.
import { rm } from "node:fs/promises";
import { collectCheckpointsLater } from "./checkpoint.ts";
import { applyEgress } from "./egress.ts";
import { OrchestratorError } from "./errors.ts";
import { type SandboxRuntime, teardown } from "./ledger.ts";
import type { NodeState } from "./node_state.ts";
import type { ListedDevice } from "./orphans.ts";
import { trimResumeDevices } from "./pause_resume.ts";
import { reclaimOrphans } from "./reaper.ts";
import type { SandboxStore } from "./store.ts";

/**
 * Network slots that sandboxes may still use after a node restart: the pool keeps these
 * (SlotPool.start({adopt})) and rebuilds every other slot.
 */
export function slotsInUse(store: SandboxStore): string[] {
  return store.all().map((r) => (r.runtime as SandboxRuntime | null)?.slot?.netns).filter((n): n is string => !!n);
}

/**
 * After a node restart: takes back the VMs of running sandboxes (they kept running under blockd
 * and their VMMs), and settles operations the old process left half done. A sandbox whose VM is
 * gone is given back and dropped; paused sandboxes stay paused.
 */
export async function recover(node: NodeState): Promise<{ adopted: string[]; lost: string[]; paused: string[] }> {
  const out = { adopted: [] as string[], lost: [] as string[], paused: [] as string[] };
  const devices = await node.blockd.call<ListedDevice[]>("list");
  for (const r of node.store.all()) {
    const rt = r.runtime as SandboxRuntime | null;
    if (r.state === "paused") {
      await reloadResumeDevice(node, r.id, devices);
      out.paused.push(r.id);
      continue;
    }
    if (r.state === "resuming" && rt?.paused) {
      // The restore never finished: give back what it took and stay paused.
      await teardown(node, r.id, { keepPaused: true });
      node.store.transition(r.id, ["resuming"], "paused", { runtime: { ...rt, slot: null, toolsDevice: null, rootfsDevice: null, upperDir: null, vmPid: null, runDir: null, memDevice: null } });
      await reloadResumeDevice(node, r.id, devices);
      out.paused.push(r.id);
      continue;
    }
    const wasLive = r.state === "running" || r.state === "pausing" || r.state === "forking" || r.state === "snapshotting";
    if (wasLive && rt?.runDir && rt.slot) {
      try {
        const vm = await node.driver.adopt(rt.runDir);
        if (vm.state === "snapshotted") throw new OrchestratorError(500, "the VM gave its memory to a checkpoint that was never recorded");
        // An interrupted checkpoint left the VM paused; the half-written checkpoint is collected below.
        if (vm.state === "paused") await vm.resume();
        node.live.set(r.id, { vm, slot: rt.slot });
        const mem = rt.memDevice ? devices.find((d) => d.id === rt.memDevice) : undefined;
        if (mem && rt.memLayers) node.memDevices.adopt(mem.id, mem.path, rt.memLayers, r.id);
        node.store.transition(r.id, [r.state], "running", { runtime: { ...rt, vmPid: vm.pid } });
        await applyEgress(node, r.id, rt.slot); // the pool's start replaced the host table
        out.adopted.push(r.id);
        continue;
      } catch (e) {
        console.error(`recover: sandbox ${r.id} (${r.state}) is lost: ${(e as Error).message}`);
      }
    }
    // creating, killing, or a VM that is gone: give everything back.
    await teardown(node, r.id);
    out.lost.push(r.id);
  }
  // Devices the old process held that no row names now (warm or pinned memory devices, rootfs
  // devices acquired before their record): nothing is in flight yet, so no grace.
  await reclaimOrphans(node, 0);
  await trimResumeDevices(node);
  collectCheckpointsLater(node);
  return out;
}

/**
 * After a restart: a paused sandbox's ResumeDevice is its again if blockd still holds it
 * acquired with its upper (a blockd restarted meanwhile has not); otherwise its row stops naming it.
 */
async function reloadResumeDevice(node: NodeState, id: string, devices: ListedDevice[]): Promise<void> {
  const rt = node.store.get(id)?.runtime as SandboxRuntime | null | undefined;
  const d = rt?.resumeDevice;
  if (!d) return;
  const live = devices.find((l) => l.id === d.id);
  if (live?.acquired && live.path === d.path && live.config?.upper?.data?.startsWith(`${d.upperDir}/`)) return void node.resumeReady.add(id);
  node.store.setRuntime(id, { ...rt, resumeDevice: null });
  await rm(d.upperDir, { recursive: true, force: true });
}
