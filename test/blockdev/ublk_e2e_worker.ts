// Queue worker for the ublk e2e test: serves one queue from an in-memory disk. The main thread sends
// {spec, wakeFd, sizeBytes}; the worker answers "ready" once every FETCH is submitted, then "exit".

import type { DeviceIo, WakeSource } from "../../src/blockdev/device_io.ts";
import { UblkQueue } from "../../src/blockdev/ublk/queue.ts";
import type { UblkQueueSpec } from "../../src/blockdev/ublk/frontend.ts";

declare const self: Worker;

self.onmessage = async (ev: MessageEvent<{ spec: UblkQueueSpec; wakeFd: number; sizeBytes: number }>) => {
  const { spec, wakeFd, sizeBytes } = ev.data;
  const store = new Uint8Array(sizeBytes);
  const io: DeviceIo = {
    size: () => sizeBytes,
    readOnly: false,
    async read(buf, offset) {
      buf.set(store.subarray(offset, offset + buf.length));
    },
    async write(buf, offset) {
      store.set(buf, offset);
    },
    async flush() {},
    async discard(offset, length) {
      store.fill(0, offset, offset + length);
    },
  };
  let stop = false;
  const wake: WakeSource = {
    fd: wakeFd,
    async onWake() {
      stop = true;
    },
    stopping: () => stop,
  };
  try {
    // Opened here: the driver binds the queue to the thread that issues the FETCHes.
    const q = UblkQueue.open(spec);
    q.prime();
    postMessage({ type: "ready" });
    const exit = await q.run(io, wake);
    q.close();
    postMessage({ type: "exit", reason: exit.reason, served: exit.served, error: exit.error?.message });
  } catch (e) {
    postMessage({ type: "error", message: e instanceof Error ? `${e.name}: ${e.message}` : String(e) });
  }
};
