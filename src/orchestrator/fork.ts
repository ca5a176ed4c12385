// Fork: a running sandbox checkpointed in place and resumed, and `count` children started from
// that checkpoint, the first ones from its seal on.
import { checkpoint, collectCheckpointsLater, compactsMemory } from "./checkpoint.ts";
import { prepareDevices, refuseWithVolumes } from "./devices.ts";
import { asOrchestratorError, OrchestratorError } from "./errors.ts";
import { accessToken, randomId } from "./ids.ts";
import { runtimeOf, teardown } from "./ledger.ts";
import type { AheadDevice } from "./memory_devices.ts";
import { checkDiskReserve, DEFAULT_DISK_RESERVE_BYTES } from "./disk_guard.ts";
import type { NodeState } from "./node_state.ts";
import { startFrom } from "./start.ts";
import type { SandboxRecord } from "./store.ts";
import type { VmCheckpoint } from "./templates.ts";
import { PhaseClock } from "./timings.ts";

/** Devices prepared ahead for a fork's children, at most (blockd's bound per stack). */
export const FORK_PREPARED_MAX = 16;

/** Checkpoint a running sandbox in place and start `count` children from it; one result each. */
export async function fork(node: NodeState, id: string, count: number, timeoutS: number | undefined): Promise<({ rec: SandboxRecord } | { error: OrchestratorError })[]> {
  node.sandbox(id); // 404 before 507
  await checkDiskReserve(node.opts.home, node.opts.diskReserveBytes ?? DEFAULT_DISK_RESERVE_BYTES);
  const src = node.sandbox(id);
  if (src.state !== "running" || node.inflight.has(id)) throw new OrchestratorError(409, `sandbox ${id} is ${src.state}, not running`);
  refuseWithVolumes(src, "fork");
  if (!node.store.transition(id, ["running"], "forking")) throw new OrchestratorError(409, `sandbox ${id} is busy`);
  // The first children (one per child started at once) start at the seal, before the checkpoint
  // is done: their slots and rootfs devices are taken while the VMM writes the memory (startFrom's
  // `ready`). For the children after them, devices of the children's own stack are prepared from
  // the seal on and replaced as children take them; retired when the fork ends.
  let preparing: { cp: VmCheckpoint; sent: Promise<void> } | undefined;
  /** The children's memory stack, pinned while they start (with or without devices prepared). */
  let pinned: string[] | undefined;
  const early: Promise<SandboxRecord>[] = [];
  let checkpointed!: (error?: Error) => void;
  const ready = new Promise<void>((resolve, reject) => (checkpointed = (error) => (error ? reject(error) : resolve())));
  ready.catch(() => {});
  try {
    const cp = await node.track(id, "fork", async () => {
      const rt = runtimeOf(node, id);
      const live = node.live.get(id);
      let memoryAhead: AheadDevice | undefined;
      try {
        if (!live) throw new OrchestratorError(500, `sandbox ${id} has no VM`);
        const clock = new PhaseClock();
        const parallel = Math.min(count, node.opts.forkParallelism ?? 4);
        const onSealed = (c: VmCheckpoint) => {
          // Every acquire of the stack counts against the target, the early ones too.
          if (count > parallel) preparing = { cp: c, sent: prepareDevices(node, c, src.diskSizeMB, Math.min(count - parallel, parallel, FORK_PREPARED_MAX), count) };
          for (let i = 0; i < parallel; i++) {
            const child = createFromCheckpoint(node, src, c, timeoutS, ready);
            child.catch(() => {}); // settled by its worker below, or by the catch if the fork fails
            early.push(child);
          }
        };
        // The children's memory stack is the source's plus the layer this checkpoint writes
        // (unless it compacts): a device over the source's is taken now and grown into it then.
        const below = rt.memLayers;
        memoryAhead = below?.length && !compactsMemory(node, below) ? node.memDevices.ahead(below) : undefined;
        const cp = await checkpoint(node, id, live.vm, rt, { resumable: true, onSealed }, clock);
        const resumed = live.vm.resume();
        // The children's memory device, opened once for all of them (unpinned with their rootfs devices).
        pinned = cp.memLayers;
        const memory = pinned ? node.memDevices.pin(pinned, memoryAhead) : undefined;
        await resumed;
        clock.lap("vmm");
        await memory;
        clock.lap("memory-device");
        node.timings.add("fork-checkpoint", id, clock);
        checkpointed();
        return cp;
      } catch (e) {
        checkpointed(new OrchestratorError(500, `the checkpoint of ${id} failed: ${(e as Error).message}`));
        throw e;
      } finally {
        if (memoryAhead) node.memDevices.drop(memoryAhead); // not grown: back to the pool
        if (live?.vm.state === "paused") await live.vm.resume().catch(() => {});
        node.store.transition(id, ["forking"], "running", { runtime: rt });
      }
    });
    const results: ({ rec: SandboxRecord } | { error: OrchestratorError })[] = new Array(count);
    const settle = (child: Promise<SandboxRecord>, i: number) =>
      child.then(
        (rec) => void (results[i] = { rec }),
        (e) => void (results[i] = { error: e instanceof OrchestratorError ? e : new OrchestratorError(500, (e as Error).message) }),
      );
    let next = early.length;
    // Worker j goes on from child j when that one started early.
    const worker = async (j: number) => {
      if (j < early.length) await settle(early[j]!, j);
      for (let i = next++; i < count; i = next++) await settle(createFromCheckpoint(node, src, cp, timeoutS), i);
    };
    await Promise.all(Array.from({ length: Math.min(count, node.opts.forkParallelism ?? 4) }, (_, j) => worker(j)));
    collectCheckpointsLater(node);
    return results;
  } catch (e) {
    await Promise.allSettled(early); // each gave back what it took (createFromCheckpoint)
    throw e;
  } finally {
    const p = preparing;
    if (p) void p.sent.then(() => prepareDevices(node, p.cp, src.diskSizeMB, 0));
    if (pinned) node.memDevices.unpin(pinned); // its children hold it now
  }
}

/** A fork child; `ready`: see startFrom. */
async function createFromCheckpoint(node: NodeState, src: SandboxRecord, cp: VmCheckpoint, timeoutS: number | undefined, ready?: Promise<void>): Promise<SandboxRecord> {
  if (node.store.count() >= node.opts.maxSandboxes)
    throw new OrchestratorError(429, `this node holds its maximum of ${node.opts.maxSandboxes} sandboxes`);
  const startedAt = node.store.nextStartedAt();
  const ttl = (timeoutS ?? Math.max(1, Math.round((src.endAt - src.startedAt) / 1000))) * 1000;
  const rec: SandboxRecord = {
    ...src, id: randomId(), state: "creating", startedAt, endAt: startedAt + ttl,
    envdAccessToken: accessToken(), trafficAccessToken: src.trafficAccessToken === null ? null : accessToken(), runtime: null,
  };
  node.store.insert(rec);
  return node.track(rec.id, "create", async () => {
    try {
      const clock = new PhaseClock();
      const runtime = await startFrom(node, rec, cp, clock, { ready });
      const out = node.store.transition(rec.id, ["creating"], "running", { runtime, endAt: Date.now() + ttl })!;
      clock.lap("record");
      node.timings.add("fork-child", rec.id, clock);
      node.creates.successes++;
      return out;
    } catch (e) {
      node.creates.fails++;
      await teardown(node, rec.id);
      throw asOrchestratorError(e, `fork of ${src.id} failed`);
    }
  });
}
