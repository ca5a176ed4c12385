// Prefetch traces of a checkpoint's starts (docs/snapshots.md, Prefetch traces): the first start of
// a checkpoint on this node records the order of its devices' first reads (blockd `traceStart` /
// `traceStop`) into the checkpoint's folder; later starts hand those files to blockd (`prefetch`),
// which reads the ranges ahead of the guest. Everything here is best effort: a failure is logged,
// never a failed start. A template's cold boot records `boot.trace` the same way, from before the VM
// starts to its checkpoint; that one travels with the template's image (src/template/prefetch_trace.ts)
// and is replayed on a build VM of the pulled image.

import { stat } from "node:fs/promises";
import { join } from "node:path";
import type { BlockdClient } from "../blockdev/client.ts";

/** In a checkpoint's folder: the rootfs device's trace, and the memory device's. */
export const ROOTFS_TRACE = "rootfs.trace";
export const MEMORY_TRACE = "memory.trace";
/** In a template's checkpoint folder: its rootfs device's first reads from before the cold boot to the checkpoint. */
export const BOOT_TRACE = "boot.trace";
/** A boot's recording lasts at most blockd's bound, 10 minutes: a longer build's later steps add nothing. */
const BOOT_TRACE_MS = 600_000;
/** A recording ends this long after envd answered: the first command of a sandbox usually runs in it. */
export const TRACE_WINDOW_MS = 5_000;
/** A recording whose VM never got envd to answer is dropped after this (blockd's own bound is 120 s). */
const TRACE_ABANDON_MS = 110_000;
/** Recordings under way on this node, at most (each holds a timer; more starts simply record nothing). */
const MAX_RECORDING = 64;
/** Recordings of one trace file tried at most this often (each costs a start one awaited RPC; a sandbox gone within the window leaves none). */
const MAX_ATTEMPTS = 3;
/** Trace files known to exist (a checkpoint's files never change) and (device, trace) pairs replayed, each bounded. */
const MAX_KNOWN = 4096;

export interface TracedDevice {
  /** The blockd device the VM reads. */
  id: string;
  /** Its trace's file name in the checkpoint folder (ROOTFS_TRACE, MEMORY_TRACE). */
  file: string;
  /** Whether an existing trace is replayed on it (blockd replays one once per device image). */
  replay: boolean;
  /** A device shared by many VMs (a memory device): asked to replay a trace once, not at each start. */
  shared?: boolean;
}

/** A recording under way: its device, blockd's number for it (once traceStart answered), and its timer. */
interface Recording {
  id: string;
  recording?: number;
  timer: Timer;
  /** envd answered: the recording is kept when it ends. */
  windowOpen: boolean;
  /** traceStop sent. */
  ending?: boolean;
}

export class StartTraces {
  /** Trace files being recorded, by path: one recording per file at a time. */
  private readonly recording = new Map<string, Recording>();
  /** Paths seen on disk: a later start needs no stat (a create's hot path costs no file system round trip). */
  private readonly known = new Set<string>();
  /** `device trace` pairs asked to replay: a shared memory device replays its trace once, not per VM. */
  private readonly replayed = new Set<string>();
  /** Recordings started per trace file (bounded as `known`). */
  private readonly attempts = new Map<string, number>();

  constructor(
    private readonly blockd: BlockdClient,
    private readonly windowMs = TRACE_WINDOW_MS,
    /** A trace was written to `path` (the orchestrator attaches a snapshot's to the snapshot store). */
    private readonly onKept: (path: string) => void = () => {},
  ) {}

  /**
   * Before the VM runs: each device replays its trace when the folder has one, else records one.
   * Returns what to call once envd answered (the recordings end `windowMs` later).
   */
  async begin(dir: string, devices: TracedDevice[]): Promise<() => void> {
    const started: string[] = [];
    await Promise.all(
      devices.map(async (d) => {
        const path = join(dir, d.file);
        if (this.recording.has(path)) return;
        if (this.known.has(path) || (await exists(path))) {
          remember(this.known, path);
          const pair = `${d.id} ${path}`;
          if (d.replay && !(d.shared && this.replayed.has(pair))) {
            if (d.shared) remember(this.replayed, pair);
            this.blockd.call("prefetch", { id: d.id, trace: path }).catch((e) => log(`prefetch of ${path} on ${d.id}`, e));
          }
          return;
        }
        const tried = this.attempts.get(path) ?? 0;
        if (this.recording.size >= MAX_RECORDING || tried >= MAX_ATTEMPTS) return;
        this.attempts.set(path, tried + 1);
        if (this.attempts.size > MAX_KNOWN) this.attempts.delete(this.attempts.keys().next().value!);
        const r: Recording = { id: d.id, timer: setTimeout(() => this.end(path), TRACE_ABANDON_MS), windowOpen: false };
        this.recording.set(path, r);
        try {
          ({ recording: r.recording } = await this.blockd.call<{ recording: number }>("traceStart", { id: d.id }));
          started.push(path);
        } catch (e) {
          this.clear(path);
          log(`recording ${path} on ${d.id}`, e);
        }
      }),
    );
    return () => {
      for (const path of started) {
        const r = this.recording.get(path);
        if (!r || r.ending) continue;
        clearTimeout(r.timer);
        r.windowOpen = true;
        r.timer = setTimeout(() => this.end(path), this.windowMs);
      }
    };
  }

  /**
   * Device `id` is about to change under its VM (a restack: pause, fork, snapshot) or go back to
   * blockd (teardown): its recordings end now, kept when envd had answered (a shorter trace beats
   * none, and the device would drop it anyway).
   */
  endOn(id: string): void {
    for (const [path, r] of this.recording) if (r.id === id && r.recording !== undefined) this.end(path);
  }

  /**
   * The recording of `path` ends (once); kept, when its window had opened: written to `path`. Named
   * by its number: a device given back since (its id reused by another VM's, which may record its
   * own) refuses the stop (logged).
   */
  private end(path: string): void {
    const r = this.recording.get(path);
    if (!r || r.ending) return;
    r.ending = true;
    clearTimeout(r.timer);
    const { id, recording, windowOpen: keep } = r;
    this.blockd
      .call("traceStop", { id, recording, ...(keep ? { out: path } : {}) })
      .then(() => {
        if (!keep) return;
        remember(this.known, path);
        this.onKept(path);
      })
      .catch((e) => log(`ending the recording of ${path} on ${id}`, e))
      .finally(() => this.clear(path));
  }

  private clear(path: string): void {
    const r = this.recording.get(path);
    if (r) clearTimeout(r.timer);
    this.recording.delete(path);
  }

  /** Timers of recordings under way go (the node is closing); their devices drop them when given back. */
  close(): void {
    for (const r of this.recording.values()) clearTimeout(r.timer);
    this.recording.clear();
  }
}

/**
 * Before a cold boot: `replay` (a trace file) is handed to the rootfs device, and a recording of the
 * boot starts. Answers the recording's number (endBootTrace then writes it), undefined when none
 * started. Failures are logged.
 */
export async function beginBootTrace(blockd: BlockdClient, device: string, replay?: string): Promise<number | undefined> {
  if (replay) await blockd.call("prefetch", { id: device, trace: replay }).catch((e) => log(`prefetch of ${replay} on ${device}`, e));
  return blockd.call<{ recording: number }>("traceStart", { id: device, forMs: BOOT_TRACE_MS }).then(
    (r) => r.recording,
    (e) => (log(`recording the boot of ${device}`, e), undefined),
  );
}

/** At the checkpoint: the boot's recording is written to `out`; a failure is logged (the template has no trace). */
export async function endBootTrace(blockd: BlockdClient, device: string, recording: number, out: string): Promise<void> {
  await blockd.call("traceStop", { id: device, recording, out }).catch((e) => log(`writing the boot trace ${out} of ${device}`, e));
}

/** Adds `v`, dropping the oldest entry past MAX_KNOWN. */
function remember(set: Set<string>, v: string): void {
  set.add(v);
  if (set.size > MAX_KNOWN) set.delete(set.values().next().value!);
}

function log(what: string, e: unknown): void {
  console.error(`orchestrator: ${what}: ${(e as Error).message}`);
}

async function exists(path: string): Promise<boolean> {
  return stat(path).then(
    () => true,
    () => false,
  );
}
