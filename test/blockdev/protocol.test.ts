// blockd's wire framing: u32 big-endian length + JSON, split or merged any way by the socket.
import { expect, test } from "bun:test";
import { BlockdConnectionError, BlockdError, BlockdTimeoutError, CallTable, FrameReader, FrameWriter, MAX_FRAME, MAX_UNSENT, encodeFrame } from "../../src/blockdev/protocol.ts";

test("frames survive any split and merge of the byte stream", () => {
  const msgs = [{ v: 1, id: 1, method: "hello" }, { v: 1, id: 2, method: "list", params: { x: "é".repeat(300) } }, { v: 1, id: 3 }];
  const bytes = Buffer.concat(msgs.map((m) => encodeFrame(m)));
  expect(new DataView(bytes.buffer, bytes.byteOffset).getUint32(0, false)).toBe(JSON.stringify(msgs[0]).length);
  for (const step of [1, 3, 7, 64, bytes.length]) {
    const r = new FrameReader();
    const got: unknown[] = [];
    for (let i = 0; i < bytes.length; i += step) for (const f of r.push(bytes.subarray(i, i + step))) got.push(JSON.parse(new TextDecoder().decode(f)));
    expect(got).toEqual(msgs);
  }
});

test("an impossible length is refused by name, before any allocation of that size", () => {
  const r = new FrameReader();
  const head = new Uint8Array(4);
  new DataView(head.buffer).setUint32(0, MAX_FRAME + 1, false);
  expect(() => r.push(head)).toThrow(BlockdError);
  expect(() => encodeFrame({ big: "x".repeat(MAX_FRAME) })).toThrow(/exceeds/);
});

test("a FrameWriter keeps what the socket did not take and sends it, in order, on drain; a peer that never reads is cut off", () => {
  const got: number[] = [];
  let room = 5;
  const socket = {
    write(b: Uint8Array): number {
      const n = Math.min(room, b.length);
      got.push(...b.subarray(0, n));
      room -= n;
      return n;
    },
  };
  const w = new FrameWriter(socket);
  const frames = [encodeFrame({ a: 1 }), encodeFrame({ b: "x".repeat(100) }), encodeFrame({ c: 3 })];
  for (const f of frames) w.send(f);
  expect(got.length).toBe(5);
  while (got.length < frames.reduce((n, f) => n + f.length, 0)) {
    room = 7;
    w.flush(); // the socket's drain callback
  }
  const r = new FrameReader();
  expect(r.push(new Uint8Array(got)).map((f) => JSON.parse(new TextDecoder().decode(f)))).toEqual([{ a: 1 }, { b: "x".repeat(100) }, { c: 3 }]);
  room = 0;
  const stuck = new FrameWriter(socket);
  expect(() => {
    for (let i = 0; i <= MAX_UNSENT / MAX_FRAME; i++) stuck.send(new Uint8Array(MAX_FRAME));
  }).toThrow(/not reading/);
});

test("a CallTable call ends by its reply, its timeout (a late reply is dropped), or the connection's end", async () => {
  const t = new CallTable("peer");
  const answered = t.add(1, "one", 10_000, () => {});
  expect(t.settle(1, "r1")).toBe(true);
  expect(await answered).toBe("r1");
  const late = t.add(2, "two", 20, () => {});
  expect(await late.catch((e) => e)).toBeInstanceOf(BlockdTimeoutError);
  expect(t.settle(2, "too late")).toBe(false);
  const pending = t.add(3, "three", 10_000, () => {});
  t.close("gone");
  const e = (await pending.catch((e) => e)) as Error;
  expect(e).toBeInstanceOf(BlockdConnectionError);
  expect(e.message).toContain('"three"');
  expect(await t.add(4, "four", 10_000, () => {}).catch((e) => e)).toBeInstanceOf(BlockdConnectionError);
  expect(t.size).toBe(0);
});

test("a call whose write finds the socket closed is a lost connection (BlockdConnectionError), not a bare error", async () => {
  const t = new CallTable("blockd");
  const closed = new FrameWriter({ write: () => -1 });
  const e = (await t.add(1, "hello", 10_000, () => closed.send(new Uint8Array(8))).catch((e) => e)) as Error;
  expect(e).toBeInstanceOf(BlockdConnectionError);
  expect(e.message).toContain('"hello"');
  const other = (await t.add(2, "list", 10_000, () => { throw new BlockdError("Backpressure", "full"); }).catch((e) => e)) as BlockdError;
  expect(other).not.toBeInstanceOf(BlockdConnectionError);
  expect(other.code).toBe("Backpressure");
  expect(t.size).toBe(0);
});
