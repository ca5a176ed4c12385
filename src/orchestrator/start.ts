// Starting a sandbox: a create from a template or snapshot, and the restore every start shares
// (create, resume, fork child): a checkpoint into a fresh slot, devices, VMM, envd initialised.
import { join } from "node:path";
import type { Slot } from "../network/index.ts";
import { readSnapshot, type DriveSpec, type Vmm } from "../vmm/types.ts";
import { prepareTemplate } from "./boot.ts";
import { drives, volumeDrives } from "./devices.ts";
import { checkDiskReserve, checkDiskSize, DEFAULT_DISK_RESERVE_BYTES } from "./disk_guard.ts";
import { applyEgress, egressPolicyOf } from "./egress.ts";
import { ENVD_PORT, ENVD_VERSION, initEnvd, waitEnvdReady } from "./envd.ts";
import { asOrchestratorError, OrchestratorError } from "./errors.ts";
import { accessToken, randomId } from "./ids.ts";
import { checkpointDirs, type ResumeDevice, type SandboxRuntime, teardown } from "./ledger.ts";
import type { NodeState } from "./node_state.ts";
import { materializeSnapshot } from "./snapshots.ts";
import { MEMORY_TRACE, ROOTFS_TRACE } from "./start_traces.ts";
import type { SandboxRecord, VolumeMount } from "./store.ts";
import { runProcess } from "./envd_process.ts";
import { isRemoteLayer, type TemplateConfig, type VmCheckpoint } from "./templates.ts";
import { PhaseClock } from "./timings.ts";

/** How long a boot's start command keeps its stream (its early errors logged); it runs on after. */
const START_CMD_STREAM_MS = 5_000;

export interface CreateOptions {
  templateId: string;
  timeoutS?: number;
  metadata?: Record<string, string>;
  envVars?: Record<string, string>;
  autoPause?: boolean;
  /** false: an expiry's pause is filesystem-only (E2B autoPauseMemory). */
  autoPauseMemory?: boolean;
  autoResume?: boolean;
  allowInternetAccess?: boolean | null;
  network?: unknown;
  customExtensionParams?: Record<string, unknown>;
  /** Volumes by name at guest paths (checked by the API): the sandbox boots with them. */
  volumeMounts?: VolumeMount[];
}

/** What a start restores besides the checkpoint (see startFrom). */
export interface StartOptions {
  traced?: boolean;
  ready?: Promise<void>;
  resume?: { held?: ResumeDevice };
}

/** A new sandbox from a template or snapshot (its checkpoint made first if it has none here). */
export async function create(node: NodeState, o: CreateOptions): Promise<SandboxRecord> {
  if (node.closed) throw new OrchestratorError(503, "the node is shutting down");
  const tpl = node.templates.resolve(o.templateId);
  if (!tpl) throw new OrchestratorError(404, `template '${o.templateId}' not found`);
  if (node.opts.maxDiskSizeMB !== undefined) checkDiskSize(tpl.diskSizeMB, node.opts.maxDiskSizeMB, tpl.alias ?? tpl.id);
  await checkDiskReserve(node.opts.home, node.opts.diskReserveBytes ?? DEFAULT_DISK_RESERVE_BYTES);
  if (node.store.count() >= node.opts.maxSandboxes)
    throw new OrchestratorError(429, `this node holds its maximum of ${node.opts.maxSandboxes} sandboxes`);
  egressPolicyOf(o.allowInternetAccess, o.network);
  const now = Date.now();
  const startedAt = node.store.nextStartedAt(now);
  const rec: SandboxRecord = {
    id: randomId(),
    state: "creating",
    templateId: tpl.id,
    alias: tpl.alias,
    metadata: o.metadata ?? {},
    envVars: o.envVars ?? {},
    startedAt,
    endAt: startedAt + (o.timeoutS ?? node.opts.defaultTimeoutS) * 1000,
    cpuCount: tpl.cpuCount,
    memoryMB: tpl.memoryMB,
    diskSizeMB: tpl.diskSizeMB,
    envdVersion: ENVD_VERSION,
    envdAccessToken: accessToken(),
    // E2B: a sandbox closed to public traffic wants this token on every non-envd port.
    trafficAccessToken: (o.network as { allowPublicTraffic?: unknown } | undefined)?.allowPublicTraffic === false ? accessToken() : null,
    autoPause: o.autoPause ?? false,
    autoPauseMemory: o.autoPauseMemory ?? true,
    autoResume: o.autoResume ?? false,
    allowInternetAccess: o.allowInternetAccess ?? null,
    network: o.network ?? null,
    runtime: null,
    customExtensionParams: o.customExtensionParams ?? {},
    volumeMounts: o.volumeMounts ?? [],
  };
  node.store.insert(rec);
  return node.track(rec.id, "create", async () => {
    try {
      const clock = new PhaseClock();
      const made = tpl.checkpoint ?? (tpl.kind === "snapshot" ? await materializeSnapshot(node, tpl) : await prepareTemplate(node, tpl));
      // Volumes are disks the checkpoint's VM never had: such a sandbox boots on the checkpoint's disk.
      const cp: VmCheckpoint = rec.volumeMounts?.length ? { dir: made.dir, layers: made.layers, envdToken: null, boot: true } : made;
      clock.lap("template");
      const runtime = await startFrom(node, rec, cp, clock, { traced: !cp.boot });
      const done = node.store.transition(rec.id, ["creating"], "running", { runtime, endAt: Date.now() + (o.timeoutS ?? node.opts.defaultTimeoutS) * 1000 });
      if (!done) throw new OrchestratorError(409, `sandbox ${rec.id} changed state while it was created`);
      clock.lap("record");
      node.timings.add("create", rec.id, clock);
      node.creates.successes++;
      return done;
    } catch (e) {
      node.creates.fails++;
      await teardown(node, rec.id);
      throw asOrchestratorError(e, `create from template '${tpl.alias ?? tpl.id}' failed`);
    }
  });
}

/**
 * A VM for `rec` restored from `cp` in a fresh slot with a fresh upper, envd initialised.
 * `traced`: a template's or snapshot's checkpoint, whose starts record and replay prefetch traces (start_traces.ts).
 * `ready` (a fork's first children, started at its seal): the checkpoint's VM state and memory
 * are still being written; the slot and the rootfs device are taken meanwhile, the memory device
 * and the snapshot after it, and the clock charges our steps only for what outlasts it
 * ("checkpoint": the source's, timed in its own row).
 * `resume` (a paused sandbox's): its rootfs is `held`, the device acquired at its pause, if given.
 */
export async function startFrom(node: NodeState, rec: SandboxRecord, cp: VmCheckpoint, clock = new PhaseClock(), o: StartOptions = {}): Promise<SandboxRuntime> {
  const held = o.resume?.held;
  const upperDir = held?.upperDir ?? join(node.opts.home, "sandboxes", rec.id, `upper-${randomId(6)}`);
  // A resume's row keeps naming its checkpoint until it runs: a restart mid-way pauses it again.
  const rt: SandboxRuntime = {
    slot: null, toolsDevice: null, rootfsDevice: held?.id ?? null, upperDir, layers: cp.layers, vmPid: null,
    runDir: join(node.opts.runRoot, rec.id), paused: o.resume ? cp : null, checkpoints: checkpointDirs(cp), memLayers: cp.memLayers, memDevice: null,
  };
  // Recorded before each step, so a crash or a kill mid-way can find what to give back.
  const save = () => node.store.setRuntime(rec.id, rt);
  node.starting.set(rec.id, rt);
  try {
    return await restoreInto(node, rec, cp, rt, save, clock, o);
  } finally {
    if (node.starting.get(rec.id) === rt) node.starting.delete(rec.id);
  }
}

/** startFrom's steps over its runtime record `rt` (held in `starting` meanwhile). */
async function restoreInto(node: NodeState, rec: SandboxRecord, cp: VmCheckpoint, rt: SandboxRuntime, save: () => void, clock: PhaseClock, o: StartOptions): Promise<SandboxRuntime> {
  const held = o.resume?.held;
  const taken: string[] = held ? [held.id] : [];
  const upperDir = rt.upperDir!;
  if (held) save(); // the row names the held device as this start's, and no longer as the paused one's
  // One memory device per memory stack, shared by every VM restored from it (blockd counts
  // them), asked for alongside the rootfs device once the stack is written.
  const takeMemory = () =>
    cp.memLayers?.length
      ? node.memDevices.take(cp.memLayers, rec.id).then((m) => {
          rt.memDevice = m.id;
          return m.path;
        })
      : undefined;
  const readFirst = () => {
    const reading = readSnapshot(cp.dir); // read while blockd gets the devices
    reading.catch(() => {});
    return { reading, memory: takeMemory() };
  };
  // A boot reads no snapshot and maps no memory.
  let then = o.ready || cp.boot ? undefined : readFirst();
  const own = (async () => {
    const slot = (rt.slot = await node.slots.acquire());
    save();
    // The policy is in force before the VM runs; read from the store now, so a PUT meanwhile is not lost.
    await applyEgress(node, rec.id, slot);
    if (!o.ready) clock.lap("slot");
    try {
      const own = (await drives(node, taken, cp.layers, upperDir, rec.diskSizeMB, held)).drives;
      const vols = await volumeDrives(node, rec.id, rec.volumeMounts ?? []);
      return { slot, drives: [...own, ...vols.drives], cmdline: vols.cmdline };
    } finally {
      rt.rootfsDevice = taken[0] ?? null;
    }
  })();
  own.catch(() => {});
  // On a throw, the caller's teardown() gives back what the saved runtime names.
  if (cp.boot) return bootOn(node, rec, rt, own, save, clock);
  if (o.ready) {
    try {
      await o.ready;
    } catch (e) {
      await own.catch(() => {});
      save();
      throw e;
    }
    clock.lap("checkpoint");
    rt.memLayers = cp.memLayers;
    rt.checkpoints = checkpointDirs(cp);
    then = readFirst();
  }
  const { reading, memory } = then!;
  let driveSpecs: DriveSpec[];
  let slot: Slot;
  try {
    ({ drives: driveSpecs, slot } = await own);
  } finally {
    await memory?.catch(() => {}); // settled, so the record names it before a teardown reads it
    save();
  }
  const snap = await reading;
  const memImage = await memory;
  // The checkpoint's traces replayed ahead of the guest (rootfs: where a layer is remote), or recorded at its first start here.
  const traced = !o.traced ? () => {} : await node.traces.begin(cp.dir, [
    ...(rt.rootfsDevice ? [{ id: rt.rootfsDevice, file: ROOTFS_TRACE, replay: cp.layers.some(isRemoteLayer) }] : []),
    ...(rt.memDevice ? [{ id: rt.memDevice, file: MEMORY_TRACE, replay: true, shared: true }] : []),
  ]);
  clock.lap("devices");
  const vm = await node.driver.restore(snap, {
    id: rec.id, runDir: rt.runDir!, drives: driveSpecs, net: { tap: slot.tap, mac: slot.guestMac }, netnsPath: slot.netnsPath, memImage,
  });
  const url = await running(node, rec.id, rt, vm, slot, save, clock);
  traced();
  clock.lap("guest");
  await initGuest(node, rec, url, cp.envdToken);
  clock.lap("init");
  return rt;
}

/** The started VM recorded as the sandbox's (its row names its pid), then envd waited for; envd's URL. */
async function running(node: NodeState, id: string, rt: SandboxRuntime, vm: Vmm, slot: Slot, save: () => void, clock: PhaseClock): Promise<string> {
  clock.lap("vmm");
  rt.vmPid = vm.pid;
  node.live.set(id, { vm, slot });
  save();
  clock.lap("record");
  const url = `http://${slot.nsIp}:${ENVD_PORT}`;
  await waitEnvdReady(url, node.envdTimeoutMs, () => vm.state !== "stopped");
  return url;
}

/** envd told the sandbox's token, env, user and working directory: a built or pulled template's, the request's env winning. */
function initGuest(node: NodeState, rec: SandboxRecord, url: string, currentToken: string | null): Promise<void> {
  const config = node.templates.resolve(rec.templateId)?.config;
  return initEnvd(url, {
    accessToken: rec.envdAccessToken,
    currentToken,
    envVars: { ...config?.env, ...rec.envVars, E2B_SANDBOX_ID: rec.id, E2B_TEMPLATE_ID: rec.templateId },
    defaultUser: config?.user,
    defaultWorkdir: config?.workdir,
    caBundle: node.opts.caBundle,
  }, 30_000);
}

/**
 * restoreInto's boot (cp.boot: a filesystem-only pause's resume, a sandbox with volumes): the
 * template's kernel boots on the sandbox's disk, envd is initialised, and the template's start
 * command, if it has one, is started again in the background (a reboot runs what the build ran).
 */
async function bootOn(node: NodeState, rec: SandboxRecord, rt: SandboxRuntime, own: Promise<{ slot: Slot; drives: DriveSpec[]; cmdline?: string }>, save: () => void, clock: PhaseClock): Promise<SandboxRuntime> {
  let started: Awaited<typeof own>;
  try {
    started = await own;
  } finally {
    save();
  }
  const { slot, drives: driveSpecs } = started;
  clock.lap("devices");
  const vm = await node.driver.boot({
    id: rec.id, runDir: rt.runDir!, kernel: node.guest.kernel, initrd: node.guest.initrd,
    cmdline: [node.guest.cmdline(slot), started.cmdline].filter(Boolean).join(" "), vcpus: rec.cpuCount, memMiB: rec.memoryMB,
    drives: driveSpecs, net: { tap: slot.tap, mac: slot.guestMac }, netnsPath: slot.netnsPath, balloon: true,
  });
  const url = await running(node, rec.id, rt, vm, slot, save, clock);
  clock.lap("guest");
  await initGuest(node, rec, url, null);
  const config = node.templates.resolve(rec.templateId)?.config;
  if (config?.startCmd) startInBackground(url, rec, config);
  clock.lap("init");
  return rt;
}

/** The template's start command, left running (envd keeps a process whose stream went); its failure to start is logged. */
function startInBackground(url: string, rec: SandboxRecord, config: TemplateConfig): void {
  const stream = new AbortController();
  runProcess(url, rec.envdAccessToken, { cmd: "/bin/sh", args: ["-lc", config.startCmd!], user: config.user ?? "root", cwd: config.workdir, envs: { ...config.env, ...rec.envVars } }, { signal: stream.signal })
    .catch((e) => { if (!stream.signal.aborted) console.error(`orchestrator: the start command of ${rec.id} after its boot: ${(e as Error).message}`); });
  setTimeout(() => stream.abort(), START_CMD_STREAM_MS).unref();
}
