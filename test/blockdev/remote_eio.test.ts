// A remote lower whose sources all fail, on a real blockd (FUSE frontend): every source failing is
// the guest's EIO (RemoteReadError in the device worker), read after read, never zeros or partial
// bytes, and never a hang; the device serves on, and once an origin answers again the same offset
// reads the layer's bytes.
import { afterAll, describe, expect, test } from "bun:test";
import { join } from "node:path";
import { fuseTest, haveFuse, startBlockd } from "./harness.ts";
import { preadDevice, remoteLayer } from "../helpers/remote_layer.ts";

const KiB = 1024;
const MiB = 1024 * KiB;
/** A failed read is 3 tries per source with 100 + 200 ms backoff between: well under this. */
const READ_BOUND_MS = 10_000;

/**
 * How a device read ends: "EIO" when it fails with EIO, else what happened instead (another
 * error, the bytes it resolved with, or that it was still pending after READ_BOUND_MS).
 */
async function readOutcome(path: string, at: number, length: number): Promise<string> {
  let timer: Timer | undefined;
  const hang = new Promise<string>((r) => (timer = setTimeout(() => r(`still pending after ${READ_BOUND_MS} ms`), READ_BOUND_MS)));
  const read = preadDevice(path, at, length).then(
    (b) => `resolved with ${b.length} bytes (${b.every((x) => x === 0) ? "all zeros" : "data"})`,
    (e: NodeJS.ErrnoException) => (e.code === "EIO" ? "EIO" : `${e.code}: ${e.message}`),
  );
  try {
    return await Promise.race([read, hang]);
  } finally {
    clearTimeout(timer);
  }
}

describe.skipIf(!haveFuse)("a remote lower whose sources fail", async () => {
  const { dir, client } = await startBlockd("remote-eio");
  // 16 MiB of random bytes as one sealed layer, served by a loopback origin this test starts.
  const layer = await remoteLayer(dir, 16, 11);
  afterAll(() => layer.origin.stop());
  // A first source that accepts each connection and closes it before any answer.
  let closed = 0;
  const closer = Bun.listen({
    hostname: "127.0.0.1",
    port: 0,
    socket: {
      open(s) {
        closed++;
        s.end();
      },
      data() {},
    },
  });
  afterAll(() => closer.stop(true));
  const lower = () => {
    const l = layer.lower(join(dir, "cache")) as { remote: { sources: unknown[] } };
    const closing = { kind: "http", url: `http://127.0.0.1:${closer.port}/v2/test/blobs/${layer.origin.digest}` };
    return { ...l, remote: { ...l.remote, sources: [closing, ...l.remote.sources] } };
  };

  test(fuseTest("every source failing is EIO, twice, and the same offset reads right once an origin answers"), async () => {
    // The device opens the layer (its header and index come from the origin, the closing source
    // tried first) with an empty block cache and no background download; then the origin breaks.
    const d = await client.call("create", { lowers: [lower()], upperDir: join(dir, "upper"), size: layer.data.length });
    const at = 9 * MiB + 4096; // data the layer maps, far from its header and index
    const len = 64 * KiB;
    const want = layer.data.subarray(at, at + len);
    expect(want.some((b) => b !== 0)).toBe(true);

    // Both sources fail: one closes, the origin answers 500.
    layer.origin.fault = "500";
    const [asked0, closed0] = [layer.origin.requests, closed];
    expect(await readOutcome(d.path, at, len)).toBe("EIO");
    const [asked1, closed1] = [layer.origin.requests, closed];
    // Each source was tried (3 tries each), not skipped.
    expect(closed1 - closed0).toBeGreaterThanOrEqual(3);
    expect(asked1 - asked0).toBeGreaterThanOrEqual(3);
    // Nothing was cached by the failure: a second read asks again and fails the same way.
    expect(await readOutcome(d.path, at, len)).toBe("EIO");
    expect(closed - closed1).toBeGreaterThanOrEqual(3);
    expect(layer.origin.requests - asked1).toBeGreaterThanOrEqual(3);

    // A 206 with the right Content-Range but half the body: still EIO, not half the bytes and zeros.
    layer.origin.fault = "short";
    expect(await readOutcome(d.path, at, len)).toBe("EIO");

    // The origin answers again (the first source still closes): the same device and offset read
    // the layer's bytes, fetched now.
    layer.origin.fault = "none";
    const sent = layer.origin.bytesSent;
    const got = await preadDevice(d.path, at, len);
    expect(got.length).toBe(len);
    expect(Buffer.from(got).equals(want)).toBe(true);
    expect(layer.origin.bytesSent - sent).toBeGreaterThanOrEqual(len);
    // And a read in another chunk: the device serves on beyond the one range.
    const at2 = 2 * MiB + 512;
    expect(Buffer.from(await preadDevice(d.path, at2, 8 * KiB)).equals(layer.data.subarray(at2, at2 + 8 * KiB))).toBe(true);
    expect(await client.call("delete", { id: d.id })).toMatchObject({ freed: true });
  }, 60_000);
});
