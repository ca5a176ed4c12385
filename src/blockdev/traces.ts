// Prefetch traces over RPC (docs/blockd.md, Prefetch traces): a device's recording started and
// stopped (its trace written to a file), and a trace file replayed ahead of the guest. The
// recording and the replay themselves run in the device's worker (trace.ts).

import { open, rename, rm, writeFile } from "node:fs/promises";
import { isAbsolute } from "node:path";
import { TRACE_MAX_ENTRIES, TRACE_MAX_FILE, TraceError, checkGranule, decodeTrace, encodeTrace } from "../storage/trace_file.ts";
import type { DeviceSet } from "./device_set.ts";
import { BlockdError } from "./protocol.ts";
import { TRACE_DEFAULT_MS, TRACE_GRANULE, TRACE_MAX_MS } from "./trace.ts";

/** Names traceStop's temp files apart (two stops writing one out at once). */
let traceWrites = 0;

export class Traces {
  /** traceStart's numbers: from the clock, so a number from before a blockd restart is not handed out again. */
  private recordings = Date.now();

  constructor(private readonly devices: DeviceSet) {}

  /** Note the device's first reads from now on (trace.ts): granule, maxEntries and forMs bound it. */
  async traceStart(p: Record<string, unknown>) {
    const d = this.devices.device(p.id);
    const granule = p.granule ?? TRACE_GRANULE;
    const maxEntries = p.maxEntries ?? TRACE_MAX_ENTRIES;
    const forMs = p.forMs ?? TRACE_DEFAULT_MS;
    try {
      checkGranule(granule as number, `"granule"`);
    } catch (e) {
      throw new BlockdError("BadRequest", (e as Error).message);
    }
    if (!Number.isInteger(maxEntries) || (maxEntries as number) < 1 || (maxEntries as number) > TRACE_MAX_ENTRIES)
      throw new BlockdError("BadRequest", `"maxEntries" must be an integer 1..${TRACE_MAX_ENTRIES}`);
    if (!Number.isInteger(forMs) || (forMs as number) < 1 || (forMs as number) > TRACE_MAX_MS) throw new BlockdError("BadRequest", `"forMs" must be an integer 1..${TRACE_MAX_MS}`);
    // Numbered before the worker hears of it: a traceStop sent for an earlier recording, arriving
    // after this, is refused instead of ending this one.
    const recording = ++this.recordings;
    const was = d.recording;
    d.recording = recording;
    try {
      const r = await d.handle.traceStart(granule as number, maxEntries as number, forMs as number);
      return { id: d.rec.id, recording, ...r };
    } catch (e) {
      if (d.recording === recording) d.recording = was;
      throw e;
    }
  }

  /** The recording ends; with `out` (absolute) it is written there whole (temp file, rename), replacing what was. */
  async traceStop(p: Record<string, unknown>) {
    const d = this.devices.device(p.id);
    if (p.out !== undefined && (typeof p.out !== "string" || !isAbsolute(p.out))) throw new BlockdError("BadRequest", `"out" must be an absolute file path`);
    if (p.recording !== undefined && !Number.isSafeInteger(p.recording)) throw new BlockdError("BadRequest", `"recording" must be the number traceStart answered`);
    if (p.recording !== undefined && p.recording !== d.recording)
      throw new BlockdError("TraceError", `device ${d.rec.id} records no trace numbered ${p.recording} (given back and taken again since)`);
    const trace = await d.handle.traceStop();
    const bytes = encodeTrace(trace);
    if (typeof p.out === "string") {
      const tmp = `${p.out}.tmp-${process.pid}-${++traceWrites}`;
      try {
        await writeFile(tmp, bytes, { mode: 0o644 });
        await rename(tmp, p.out);
      } catch (e) {
        await rm(tmp, { force: true }).catch(() => {});
        throw e;
      }
    }
    return { id: d.rec.id, out: p.out ?? null, entries: trace.entries.length, granule: trace.granule, size: trace.size, bytes: bytes.length };
  }

  /** Replay the trace file `trace` ahead of the guest (trace.ts); answered once it has started. A bad file is a TraceError. */
  async prefetch(p: Record<string, unknown>) {
    const d = this.devices.device(p.id);
    if (typeof p.trace !== "string" || !isAbsolute(p.trace)) throw new BlockdError("BadRequest", `"trace" must be an absolute file path`);
    const path = p.trace;
    const f = await open(path, "r").catch((e: NodeJS.ErrnoException) => {
      throw new BlockdError(e.code === "ENOENT" ? "NotFound" : "TraceError", `trace ${path}: ${e.message}`);
    });
    let bytes: Uint8Array;
    try {
      const { size } = await f.stat();
      if (size > TRACE_MAX_FILE) throw new TraceError(`trace ${path}: ${size} bytes is more than a trace can be (${TRACE_MAX_FILE})`);
      bytes = new Uint8Array(size);
      const { bytesRead } = await f.read(bytes, 0, size, 0);
      if (bytesRead !== size) throw new TraceError(`trace ${path}: read ${bytesRead} of ${size} bytes`);
    } finally {
      await f.close();
    }
    const trace = decodeTrace(bytes, `trace ${path}`);
    return { id: d.rec.id, ...(await d.handle.prefetch(trace)) };
  }
}
