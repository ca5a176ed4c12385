// The kernel relay (src/network/splice_relay.ts) on loopback sockets, no namespaces: two peers,
// each connected to a socket of ours; the relay carries bytes between our two sockets.
import { afterAll, expect, test } from "bun:test";
import { createHash, randomBytes } from "node:crypto";
import { SpliceRelay } from "../../src/network/splice_relay.ts";
import { eventually } from "./harness.ts";

const relay = new SpliceRelay(8, 60_000);
afterAll(() => relay.stop());

type Sock = Bun.Socket<undefined>;
const fdOf = (s: Sock) => (s as unknown as { fd: number }).fd;
const sha = (b: Buffer) => createHash("sha256").update(b).digest("hex");

/** A peer that writes `send` (then its FIN unless told not to) and collects what it gets until the other side's FIN (its end, or its close when this side is shut down already). */
async function peer(send: Buffer, fin = true) {
  const got: Buffer[] = [];
  let closed = false;
  let reset = false;
  const ended = Promise.withResolvers<Buffer>();
  const accepted = Promise.withResolvers<void>();
  let at = 0;
  const pump = (s: Sock) => {
    while (at < send.length) {
      const n = s.write(send.subarray(at, at + (1 << 20)));
      if (n <= 0) return;
      at += n;
    }
    if (fin) s.shutdown();
  };
  const server = Bun.listen({
    hostname: "127.0.0.1", port: 0, allowHalfOpen: true,
    socket: { open: (s) => (accepted.resolve(), pump(s)), drain: pump, data: (_s, d) => void got.push(Buffer.from(d)), end: () => ended.resolve(Buffer.concat(got)), close: () => ((closed = true), ended.resolve(Buffer.concat(got))), error: () => void (reset = true) },
  });
  // Our side: nothing read here once the relay has it (paused before any byte can arrive).
  let readPastPause = 0;
  const ours = await Bun.connect({ hostname: "127.0.0.1", port: server.port, allowHalfOpen: true, socket: { open: (s) => s.pause(), data: () => void readPastPause++ } });
  await accepted.promise;
  return { ours, got: ended.promise, closed: () => closed, readPastPause: () => readPastPause, reset: () => reset, stop: () => server.stop(true) };
}

test("the relay carries every byte both ways, each FIN after them, and ends 'done'", async () => {
  const [x, y] = [randomBytes(16 << 20), randomBytes(3 << 20)];
  const [left, right] = await Promise.all([peer(x), peer(y)]);
  const end = Promise.withResolvers<string>();
  await eventually(() => relay.available, "the relay's worker is ready");
  const slot = relay.take(fdOf(left.ours), fdOf(right.ours), 0, (reason) => {
    left.ours.terminate();
    right.ours.terminate();
    end.resolve(reason);
  });
  expect(slot).toBeGreaterThanOrEqual(0);
  const [atRight, atLeft] = await Promise.all([right.got, left.got]);
  expect([atRight.length, sha(atRight)]).toEqual([x.length, sha(x)]);
  expect([atLeft.length, sha(atLeft)]).toEqual([y.length, sha(y)]);
  expect(await end.promise).toBe("done");
  expect([left.readPastPause(), right.readPastPause(), left.reset(), right.reset()]).toEqual([0, 0, false, false]);
  left.stop();
  right.stop();
}, 30_000);

test("a dropped slot ends 'dropped' and both connections close; the slot is taken again", async () => {
  const [left, right] = await Promise.all([peer(Buffer.from("x"), false), peer(Buffer.alloc(0), false)]);
  await eventually(() => relay.available, "the relay's worker is ready");
  const end = Promise.withResolvers<string>();
  const slot = relay.take(fdOf(left.ours), fdOf(right.ours), 0, (reason) => {
    left.ours.terminate();
    right.ours.terminate();
    end.resolve(reason);
  });
  relay.drop(slot);
  expect(await end.promise).toBe("dropped");
  await eventually(() => left.closed() && right.closed(), "both peers see the connection closed");
  left.stop();
  right.stop();
  expect(relay.available).toBe(true);
}, 30_000);
