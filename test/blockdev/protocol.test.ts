// blockd's wire framing: u32 big-endian length + JSON, split or merged any way by the socket.
import { expect, test } from "bun:test";
import { BlockdError, FrameReader, MAX_FRAME, encodeFrame } from "../../src/blockdev/protocol.ts";

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
