// The remote-I/O budget holds across worker threads: never more than N permits out at once, and
// N are out whenever N holders want them. Holders keep their permit until the test lets them go,
// so what is asserted does not depend on how fast anything runs.
import { expect, test } from "bun:test";
import { IoLimiter } from "../../src/storage/io_limiter.ts";

/** Wait for cond, yielding to the event loop; fails after a bound meant only to catch a hang. */
async function until(cond: () => boolean, what: string, hangMs = 60_000): Promise<void> {
  const start = performance.now();
  while (!cond()) {
    if (performance.now() - start > hangMs) throw new Error(`still waiting after ${hangMs} ms: ${what}`);
    await new Promise<void>((r) => setImmediate(r));
  }
}

test("permits bound concurrency within one thread, and all of them are used", async () => {
  const LIMIT = 3;
  const TASKS = 20;
  const l = IoLimiter.create(LIMIT);
  let inFlight = 0;
  let peak = 0;
  const gates: (() => void)[] = [];
  const tasks = Array.from({ length: TASKS }, () =>
    l.run(() => {
      peak = Math.max(peak, ++inFlight);
      return new Promise<void>((resolve) => gates.push(() => (inFlight--, resolve())));
    }),
  );
  for (let released = 0; released < TASKS; released++) {
    const want = Math.min(LIMIT, TASKS - released);
    await until(() => {
      expect(peak).toBeLessThanOrEqual(LIMIT);
      return inFlight === want && gates.length === want;
    }, `${want} holders after ${released} releases`);
    gates.shift()!();
  }
  await Promise.all(tasks);
  expect(peak).toBe(LIMIT); // reached, never passed: inFlight is checked at every entry
  expect(l.available).toBe(LIMIT);
  expect(() => IoLimiter.create(0)).toThrow(RangeError);
  const release = await l.acquire();
  release();
  expect(() => release()).toThrow(/twice/);
}, 120_000);

test("permits bound concurrency across workers, and all of them are used", async () => {
  const LIMIT = 2;
  const WORKERS = 4;
  const PER_WORKER = 10;
  const TASKS = WORKERS * PER_WORKER;
  const l = IoLimiter.create(LIMIT);
  // [in flight, peak, tickets taken, tickets released, holders done]
  const gauge = new Int32Array(new SharedArrayBuffer(5 * 4));
  const [IN_FLIGHT, PEAK, TICKETS, RELEASED, DONE] = [0, 1, 2, 3, 4];
  const src = `
    import { IoLimiter } from ${JSON.stringify(new URL("../../src/storage/io_limiter.ts", import.meta.url).pathname)};
    self.onmessage = async (e) => {
      const l = IoLimiter.attach(e.data.shared);
      const g = new Int32Array(e.data.gauge);
      const hold = async () => {
        const now = Atomics.add(g, ${IN_FLIGHT}, 1) + 1;
        for (;;) { const p = Atomics.load(g, ${PEAK}); if (now <= p || Atomics.compareExchange(g, ${PEAK}, p, now) === p) break; }
        // Hold the permit until the test releases this holder's ticket (re-checked every second).
        const ticket = Atomics.add(g, ${TICKETS}, 1);
        for (;;) {
          const r = Atomics.load(g, ${RELEASED});
          if (r > ticket) break;
          const w = Atomics.waitAsync(g, ${RELEASED}, r, 1000);
          if (w.async) await w.value;
        }
        Atomics.sub(g, ${IN_FLIGHT}, 1);
      };
      await Promise.all(Array.from({ length: ${PER_WORKER} }, async () => {
        await l.run(hold);
        Atomics.add(g, ${DONE}, 1);
      }));
      postMessage("done");
    };`;
  const url = URL.createObjectURL(new Blob([src], { type: "application/typescript" }));
  const workers = Array.from({ length: WORKERS }, () => new Worker(url));
  try {
    const finished = Promise.all(
      workers.map(
        (w) =>
          new Promise<void>((resolve) => {
            w.onmessage = () => resolve();
            w.postMessage({ shared: l.shared, gauge: gauge.buffer });
          }),
      ),
    );
    const at = (i: number) => Atomics.load(gauge, i);
    for (let released = 0; released < TASKS; released++) {
      const want = Math.min(LIMIT, TASKS - released);
      await until(() => {
        expect(at(PEAK)).toBeLessThanOrEqual(LIMIT);
        return at(DONE) === released && at(IN_FLIGHT) === want;
      }, `${want} holders after ${released} releases`);
      Atomics.add(gauge, RELEASED, 1);
      Atomics.notify(gauge, RELEASED);
    }
    await finished;
    expect(at(DONE)).toBe(TASKS);
    expect(at(PEAK)).toBe(LIMIT); // reached, never passed: every holder raised the peak on entry
    expect(l.available).toBe(LIMIT);
  } finally {
    for (const w of workers) w.terminate();
  }
}, 300_000);
