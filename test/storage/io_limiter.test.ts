// The remote-I/O budget holds across worker threads: never more than N permits out at once.
import { expect, test } from "bun:test";
import { IoLimiter } from "../../src/storage/io_limiter.ts";

test("permits bound concurrency within one thread", async () => {
  const l = IoLimiter.create(3);
  let inFlight = 0;
  let peak = 0;
  await Promise.all(
    Array.from({ length: 20 }, () =>
      l.run(async () => {
        peak = Math.max(peak, ++inFlight);
        await Bun.sleep(2);
        inFlight--;
      }),
    ),
  );
  expect(peak).toBe(3);
  expect(l.available).toBe(3);
  expect(() => IoLimiter.create(0)).toThrow(RangeError);
  const release = await l.acquire();
  release();
  expect(() => release()).toThrow(/twice/);
});

test("permits bound concurrency across workers", async () => {
  const l = IoLimiter.create(2);
  const gauge = new Int32Array(new SharedArrayBuffer(8)); // [in flight, peak]
  const src = `
    import { IoLimiter } from ${JSON.stringify(new URL("../../src/storage/io_limiter.ts", import.meta.url).pathname)};
    self.onmessage = async (e) => {
      const l = IoLimiter.attach(e.data.shared);
      const g = new Int32Array(e.data.gauge);
      for (let i = 0; i < 10; i++)
        await l.run(async () => {
          const now = Atomics.add(g, 0, 1) + 1;
          for (;;) { const p = Atomics.load(g, 1); if (now <= p || Atomics.compareExchange(g, 1, p, now) === p) break; }
          await Bun.sleep(1);
          Atomics.sub(g, 0, 1);
        });
      postMessage("done");
    };`;
  const url = URL.createObjectURL(new Blob([src], { type: "application/typescript" }));
  const workers = Array.from({ length: 4 }, () => new Worker(url));
  await Promise.all(
    workers.map(
      (w) =>
        new Promise<void>((resolve) => {
          w.onmessage = () => resolve();
          w.postMessage({ shared: l.shared, gauge: gauge.buffer });
        }),
    ),
  );
  for (const w of workers) w.terminate();
  expect(Atomics.load(gauge, 1)).toBe(2);
  expect(l.available).toBe(2);
}, 30_000);
