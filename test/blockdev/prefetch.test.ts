// Prefetch traces on a real blockd: a device over a remote layer served by a loopback origin
// records the order of its first reads; a device over the same layer with an empty block cache
// replays that trace, and the reads it covered then come from the cache. Bad trace files are named
// errors; prefetch never delays or corrupts the guest's reads.
import { afterAll, describe, expect, test } from "bun:test";
import { readFileSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { decodeTrace, encodeTrace } from "../../src/storage/trace_file.ts";
import { failure, fuseTest, haveFuse, startBlockd, until } from "./harness.ts";
import { withTimeout } from "../../src/vmm/wait.ts";
import { preadDevice, remoteLayer, type RemoteLayerFixture } from "../helpers/remote_layer.ts";

const KiB = 1024;
const MiB = 1024 * KiB;
const G = 64 * KiB; // the default granule

describe.skipIf(!haveFuse)("prefetch traces", async () => {
  const { dir, client } = await startBlockd("prefetch");
  const layer: RemoteLayerFixture = await remoteLayer(dir, 64);
  afterAll(() => layer.origin.stop());
  let n = 0;
  /** A fresh writable device over the remote layer with an empty block cache of its own. */
  const device = async () => {
    const k = ++n;
    return client.call("create", { lowers: [layer.lower(join(dir, `cache-${k}`))], upperDir: join(dir, `upper-${k}`), size: layer.data.length });
  };
  const same = (got: Uint8Array, at: number) => Buffer.from(got).equals(layer.data.subarray(at, at + got.length));
  const stats = (id: string) => client.call<Record<string, number>>("stats", { id });

  test(fuseTest("a recorded trace lists the granules of first reads in order, each once"), async () => {
    const d = await device();
    expect(await client.call("traceStart", { id: d.id })).toMatchObject({ size: layer.data.length, granule: G });
    // Granules 5, 2, 5 again, 9, a read across 2|3, 0, and 2 again.
    for (const [at, len] of [[5 * G, 4096], [2 * G + 8192, 4096], [5 * G + 4096, 4096], [9 * G, G], [3 * G - 4096, 8192], [0, 512], [2 * G, 4096]]) {
      expect(same(await preadDevice(d.path, at!, len!), at!)).toBe(true);
    }
    expect((await stats(d.id)).traceEntries).toBe(5);
    const out = join(dir, "first.trace");
    expect(await client.call("traceStop", { id: d.id, out })).toMatchObject({ out, entries: 5, granule: G, size: layer.data.length });
    const t = decodeTrace(new Uint8Array(readFileSync(out)));
    expect([...t.entries]).toEqual([5, 2, 9, 3, 0]);
    expect(t.size).toBe(layer.data.length);
    // Stopped: reads are no longer noted, and a second stop says there is nothing to stop.
    expect((await failure(client.call("traceStop", { id: d.id })))?.name).toBe("TraceError");
    expect((await failure(client.call("traceStart", { id: d.id, granule: 1000 })))?.name).toBe("BadRequest");
    // Bounded: maxEntries 2 keeps the first two granules read.
    await client.call("traceStart", { id: d.id, maxEntries: 2 });
    for (const g of [40, 41, 42]) await preadDevice(d.path, g * G, 4096);
    const r = await client.call("traceStop", { id: d.id, out });
    expect(r.entries).toBe(2);
    expect([...decodeTrace(new Uint8Array(readFileSync(out))).entries]).toEqual([40, 41]);
    await client.call("delete", { id: d.id });
  });

  test(fuseTest("a stop naming an earlier recording is refused: the id was given back and taken again, and the new holder's recording goes on"), async () => {
    const lowers = [layer.lower(join(dir, "cache-reused"))];
    const a = await client.call<{ id: string; path: string }>("acquire", { lowers });
    const first = (await client.call<{ recording: number }>("traceStart", { id: a.id })).recording;
    await client.call("release", { id: a.id });
    // The one released last goes first: the same id, another holder, which records too. Its start
    // and the first holder's late stop are sent together, the stop second.
    const b = await client.call<{ id: string; path: string }>("acquire", { lowers });
    expect(b.id).toBe(a.id);
    const [started, late] = await Promise.all([client.call<{ recording: number }>("traceStart", { id: b.id }), failure(client.call("traceStop", { id: b.id, recording: first }))]);
    expect(started.recording).toBeGreaterThan(first);
    expect(late?.name).toBe("TraceError");
    expect(late?.message).toContain(`numbered ${first}`);
    expect((await failure(client.call("traceStop", { id: b.id, recording: "x" })))?.name).toBe("BadRequest");
    await preadDevice(b.path, 7 * G, 4096);
    const out = join(dir, "reused.trace");
    expect(await client.call("traceStop", { id: b.id, recording: started.recording, out })).toMatchObject({ entries: 1 });
    expect([...decodeTrace(new Uint8Array(readFileSync(out))).entries]).toEqual([7]);
    await client.call("release", { id: b.id });
  });

  test(fuseTest("a replayed trace brings its ranges into the cache before the guest asks"), async () => {
    // Record a boot-like pattern: 4 KiB reads spread over 24 MiB, some of it twice.
    const pattern: number[] = [];
    for (let i = 0; i < 96; i++) pattern.push(((i * 37) % 96) * 256 * KiB);
    const rec = await device();
    await client.call("traceStart", { id: rec.id });
    for (const at of pattern) await preadDevice(rec.path, at, 4096);
    const out = join(dir, "boot.trace");
    expect((await client.call("traceStop", { id: rec.id, out })).entries).toBe(96);
    await client.call("delete", { id: rec.id });

    // Cold: nothing prefetched, every read goes to the origin.
    const cold = await device();
    const before = layer.origin.bytesSent;
    for (const at of pattern) expect(same(await preadDevice(cold.path, at, 4096), at)).toBe(true);
    const coldBytes = layer.origin.bytesSent - before;
    expect(coldBytes).toBeGreaterThan(0);
    await client.call("delete", { id: cold.id });

    // Replayed: the origin serves the trace's chunks before the guest reads, none after.
    const warm = await device();
    const started = await client.call("prefetch", { id: warm.id, trace: out });
    expect(started).toMatchObject({ started: true, planned: 96 });
    await until(async () => (await stats(warm.id)).prefetchActive === 0, "the prefetch to end", 60_000);
    const s = await stats(warm.id);
    expect(s).toMatchObject({ prefetchPlanned: 96, prefetchFetched: 96, prefetchErrors: 0 });
    const prefetched = layer.origin.bytesSent;
    for (const at of pattern) expect(same(await preadDevice(warm.path, at, 4096), at)).toBe(true);
    expect(layer.origin.bytesSent - prefetched).toBe(0);
    // Once per image: a second prefetch of the same trace reads nothing.
    expect(await client.call("prefetch", { id: warm.id, trace: out })).toMatchObject({ started: false });
    await client.call("delete", { id: warm.id });
  });

  test(fuseTest("a bad trace file is a TraceError and the device serves on"), async () => {
    const d = await device();
    const good = encodeTrace({ size: layer.data.length, granule: G, entries: new Uint32Array([1, 2, 3]) });
    const write = (name: string, b: Uint8Array) => (writeFileSync(join(dir, name), b), join(dir, name));
    const cases: [string, Uint8Array][] = [
      ["truncated", good.subarray(0, good.length - 6)],
      ["garbage", new Uint8Array(64).fill(7)],
      ["flipped", Uint8Array.from(good, (b, i) => (i === 30 ? b ^ 1 : b))],
      ["wrong-size", encodeTrace({ size: layer.data.length / 2, granule: G, entries: new Uint32Array([1]) })],
      ["past-end", encodeTrace({ size: layer.data.length, granule: G, entries: new Uint32Array([1 << 20]) })],
      ["empty", new Uint8Array(0)],
    ];
    for (const [name, bytes] of cases) {
      const e = await failure(client.call("prefetch", { id: d.id, trace: write(`${name}.trace`, bytes) }));
      expect(`${name}: ${e?.name}`).toBe(`${name}: TraceError`);
    }
    expect((await failure(client.call("prefetch", { id: d.id, trace: join(dir, "none.trace") })))?.name).toBe("NotFound");
    expect((await failure(client.call("prefetch", { id: d.id, trace: "relative.trace" })))?.name).toBe("BadRequest");
    expect(same(await preadDevice(d.path, 7 * MiB, 64 * KiB), 7 * MiB)).toBe(true);
    await client.call("delete", { id: d.id });
  });

  test(fuseTest("the guest's reads do not wait behind prefetch, and read the right bytes"), async () => {
    // 48 MiB of trace; the origin holds every range starting below 52 MiB of the layer file (the
    // trace's chunks; runs are at most 8 MiB, so none of them reaches the read at 60 MiB).
    const out = join(dir, "long.trace");
    writeFileSync(out, encodeTrace({ size: layer.data.length, granule: G, entries: Uint32Array.from({ length: 48 * 16 }, (_, i) => i) }));
    const d = await device();
    layer.origin.hold = (start) => start < 52 * MiB;
    try {
      await client.call("prefetch", { id: d.id, trace: out });
      await until(() => layer.origin.held > 0, "prefetch's reads to reach the origin");
      // Beyond the trace (60 MiB): answered while prefetch's reads are still held at the origin.
      const got = await withTimeout(preadDevice(d.path, 60 * MiB, 64 * KiB), 20_000, "a read beyond the trace while prefetch's reads are held");
      expect(same(got, 60 * MiB)).toBe(true);
      expect(layer.origin.held).toBeGreaterThan(0);
      expect((await stats(d.id)).prefetchActive).toBe(1);
    } finally {
      layer.origin.hold = undefined;
      layer.origin.releaseHeld();
    }
    layer.origin.delayMs = 100;
    try {
      // Reads inside the trace, while prefetch runs, are right too.
      for (const at of [MiB + 4096, 20 * MiB, 47 * MiB]) expect(same(await preadDevice(d.path, at, 128 * KiB), at)).toBe(true);
      // The prefetch ends without errors (whether it skipped what the guest read first depends on
      // how far the remote file's readahead had fetched by then).
      await until(async () => (await stats(d.id)).prefetchActive === 0, "the prefetch to end", 60_000);
      expect((await stats(d.id)).prefetchErrors).toBe(0);
    } finally {
      layer.origin.delayMs = 0;
    }
    // A delete while a prefetch runs: its reads settle first, nothing fails.
    const e = await device();
    layer.origin.delayMs = 50;
    try {
      await client.call("prefetch", { id: e.id, trace: out });
      await Bun.sleep(30);
      expect(await client.call("delete", { id: e.id })).toMatchObject({ freed: true });
    } finally {
      layer.origin.delayMs = 0;
    }
    await client.call("delete", { id: d.id });
  }, 120_000);
});
