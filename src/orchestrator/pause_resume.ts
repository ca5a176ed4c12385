// Pause and resume: a pause checkpoints the VM and gives back what it ran on (after its answer,
// it acquires the rootfs device its resume will run on); connect resumes a paused sandbox, or
// extends a running one's TTL.
import { existsSync } from "node:fs";
import { open as openAsync, rm } from "node:fs/promises";
import { join } from "node:path";
import { posixFadvise, POSIX_FADV_DONTNEED } from "../../ffi/libc.ts";
import { checkpoint, collectCheckpoints, diskCheckpoint } from "./checkpoint.ts";
import { syncGuest } from "./kill.ts";
import { acquireRootfs } from "./devices.ts";
import { asOrchestratorError, OrchestratorError } from "./errors.ts";
import { randomId } from "./ids.ts";
import { checkpointDirs, dropResumeDevice, giveBackRootfs, giveBackVm, runtimeOf, type SandboxRuntime, teardown } from "./ledger.ts";
import type { NodeState } from "./node_state.ts";
import { startFrom } from "./start.ts";
import type { SandboxRecord } from "./store.ts";
import type { VmCheckpoint } from "./templates.ts";
import { PhaseClock } from "./timings.ts";

/** The most recently paused sandboxes that hold their resume's rootfs device (ResumeDevice; ~8.5 MiB of blockd's memory each). */
export const RESUME_READY_MAX = 4;

/** Writes a file's dirty pages (off the event loop) and drops its cached ones; a missing file is fine. */
async function dropCache(path: string): Promise<void> {
  if (!existsSync(path)) return;
  const fh = await openAsync(path, "r");
  try {
    await fh.datasync();
    posixFadvise(fh.fd, 0, 0, POSIX_FADV_DONTNEED, path);
  } finally {
    await fh.close();
  }
}

/**
 * A running sandbox into a checkpoint on disk; its VM, devices and slot go back. `memory: false`
 * (E2B's filesystem-only pause): no memory is kept, only the disk; its resume boots.
 */
export async function pause(node: NodeState, id: string, o: { memory?: boolean } = {}): Promise<void> {
  const rec = node.sandbox(id);
  if (rec.state === "paused") throw new OrchestratorError(409, `sandbox ${id} is already paused`);
  const cur = node.inflight.get(id);
  if (cur?.op === "pause") return cur.done as Promise<void>;
  if (!node.store.transition(id, ["running"], "pausing")) {
    const now = node.store.get(id);
    if (now?.state === "paused" || now?.state === "pausing") throw new OrchestratorError(409, `sandbox ${id} is already paused`);
    throw new OrchestratorError(409, `sandbox ${id} is ${now?.state ?? "gone"}`);
  }
  await node.track(id, "pause", async () => {
    const rt = runtimeOf(node, id);
    const live = node.live.get(id);
    try {
      if (!live || !rt.rootfsDevice) throw new OrchestratorError(500, `sandbox ${id} has no VM to pause`);
      const clock = new PhaseClock();
      // The VMM stops while its rootfs is restacked (its state is saved and its disks flushed by
      // then); devices and slot go back after the answer.
      const stop = () => {
        node.gone(id);
        return live.vm.stop();
      };
      // Volumes outlive the memory a kill of the paused sandbox drops: what the guest wrote is flushed first.
      if (o.memory !== false && rec.volumeMounts?.length) await syncGuest(node, id, rec.envdAccessToken);
      const cp = o.memory === false
        ? await diskCheckpoint(node, id, rt, { stop, sync: () => syncGuest(node, id, rec.envdAccessToken) }, clock)
        : await checkpoint(node, id, live.vm, rt, { resumable: false, stop }, clock);
      node.live.delete(id);
      const paused: SandboxRuntime = { ...rt, slot: null, toolsDevice: null, rootfsDevice: null, upperDir: null, vmPid: null, paused: cp, layers: cp.layers, checkpoints: checkpointDirs(cp), memLayers: cp.memLayers, memDevice: null };
      node.store.transition(id, ["pausing"], "paused", { runtime: paused });
      clock.lap("record");
      node.timings.add("pause", id, clock);
      node.opts.moves?.paused(id);
      // The answer does not wait for the rest: the slot's scrub, the device and the page cache.
      node.afterReply(id, "pause", async () => {
        await giveBackVm(node, id, rt);
        // Its resume will want its own memory stack: opened now, kept while it is among the last left.
        if (cp.memLayers) node.memDevices.warm(cp.memLayers, id);
        await rm(join(node.opts.home, "sandboxes", id), { recursive: true, force: true });
        await acquireForResume(node, id, cp, rec.diskSizeMB);
        // A paused sandbox's memory lives on disk, not in the host's page cache.
        if (!cp.boot) for (const f of ["mem", "mem.layer", "vmstate"]) await dropCache(join(cp.dir, f));
        await collectCheckpoints(node);
      });
    } catch (e) {
      // Still running if the VM is: back to running; otherwise the sandbox is lost and goes.
      if (live && live.vm.state !== "stopped") {
        await live.vm.resume().catch(() => {});
        node.store.transition(id, ["pausing"], "running");
      } else {
        await teardown(node, id);
      }
      throw e;
    }
  });
}

/**
 * Connect (E2B): a running sandbox gets its TTL extended (never shortened) → "running"; a paused
 * one is resumed with the TTL set → "resumed"; a connect that joins a resume in flight extends
 * the TTL. `extendOnly` (auto-resume by traffic): a resume never shortens the TTL either, its
 * end becomes max(the stored end, now + timeoutS). `memory: false` (E2B `onResume: 'reboot'`): a
 * paused sandbox boots on its disk instead of restoring its memory.
 */
export async function connect(node: NodeState, id: string, timeoutS: number, o: { extendOnly?: boolean; memory?: boolean } = {}): Promise<{ rec: SandboxRecord; resumed: boolean }> {
  const rec = node.sandbox(id);
  const endAt = Date.now() + timeoutS * 1000;
  if (rec.state === "running") return { rec: node.store.setEndAt(id, endAt, true)!, resumed: false };
  const cur = node.inflight.get(id);
  if (cur?.op === "resume") {
    await cur.done;
    return { rec: node.store.setEndAt(id, Date.now() + timeoutS * 1000, true) ?? node.sandbox(id), resumed: true };
  }
  if (cur) await node.settled(id);
  const now = node.sandbox(id);
  if (now.state === "running") return { rec: node.store.setEndAt(id, endAt, true)!, resumed: false };
  if (now.state !== "paused") throw new OrchestratorError(409, `sandbox ${id} is ${now.state}`);
  if (!node.store.transition(id, ["paused"], "resuming")) return connect(node, id, timeoutS, o);
  const out = await node.track(id, "resume", async () => {
    await node.cleanups.get(id);
    const rt = runtimeOf(node, id);
    const paused = rt.paused;
    if (!paused) throw new OrchestratorError(500, `paused sandbox ${id} has no checkpoint`);
    const cp: VmCheckpoint = o.memory === false && !paused.boot ? { dir: paused.dir, layers: paused.layers, envdToken: null, boot: true } : paused;
    if (cp.boot) node.memDevices.forget(id);
    // Its device acquired at the pause, if it holds one: from here on the resume's (startFrom records it).
    const held = rt.resumeDevice ?? undefined;
    node.resumeReady.delete(id);
    try {
      await node.opts.moves?.resuming(id);
      const clock = new PhaseClock();
      const started = await startFrom(node, now, cp, clock, { resume: { held } });
      const until = Date.now() + timeoutS * 1000;
      const end = o.extendOnly ? Math.max(node.store.get(id)?.endAt ?? 0, until) : until;
      const out = node.store.transition(id, ["resuming"], "running", { runtime: { ...started, paused: null }, endAt: end })!;
      clock.lap("record");
      node.timings.add("resume", id, clock);
      return out;
    } catch (e) {
      await teardown(node, id, { keepPaused: true });
      node.store.transition(id, ["resuming"], "paused", { runtime: { ...rt, resumeDevice: null } });
      throw asOrchestratorError(e, `resume of ${id} failed`);
    }
  });
  return { rec: out, resumed: true };
}

/**
 * Acquires the rootfs device of paused sandbox `id`'s resume (its paused stack, a fresh upper)
 * and records it in its row; run in the pause's cleanup, which its resume and kill wait for.
 * The oldest holders past RESUME_READY_MAX give theirs back. Best effort: a resume without one
 * acquires its device as a create does.
 */
async function acquireForResume(node: NodeState, id: string, cp: VmCheckpoint, diskSizeMB: number): Promise<void> {
  const upperDir = join(node.opts.home, "sandboxes", id, `upper-${randomId(6)}`);
  let d: { id: string; path: string };
  try {
    d = await acquireRootfs(node, cp.layers, upperDir, diskSizeMB);
  } catch (e) {
    console.error(`orchestrator: a device for the resume of ${id}: ${(e as Error).message}`);
    return void (await rm(upperDir, { recursive: true, force: true }));
  }
  const rec = node.store.get(id);
  const rt = rec?.runtime as SandboxRuntime | null | undefined;
  if (rec?.state !== "paused" || rt?.paused?.dir !== cp.dir) {
    // Unreachable while resume and kill wait for the cleanup; given back rather than leaked.
    await giveBackRootfs(node, d.id);
    return void (await rm(upperDir, { recursive: true, force: true }));
  }
  node.store.setRuntime(id, { ...rt, resumeDevice: { id: d.id, path: d.path, upperDir } });
  node.resumeReady.add(id);
  await trimResumeDevices(node);
}

/** The oldest paused holders past RESUME_READY_MAX give their devices back (a sandbox in an operation keeps its own). */
export async function trimResumeDevices(node: NodeState): Promise<void> {
  for (const id of [...node.resumeReady]) {
    if (node.resumeReady.size <= RESUME_READY_MAX) return;
    if (!node.inflight.has(id) && node.store.get(id)?.state === "paused") await dropResumeDevice(node, id);
  }
}
