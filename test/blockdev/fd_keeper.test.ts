// The fd keeper on bad input: a request line past its bound is answered with an error and the
// connection cut, a hold of too many fds is refused, and the keeper serves on for everyone else.
import { afterAll, expect, test } from "bun:test";
import { existsSync, mkdirSync, readFileSync, rmSync } from "node:fs";
import { join } from "node:path";
import { scratchDir } from "../helpers/tmp.ts";
import { processGone, until } from "./harness.ts";

const dir = scratchDir("fd-keeper");
const state = join(dir, "state");
mkdirSync(state, { recursive: true });
const keeper = Bun.spawn([process.execPath, join(import.meta.dir, "../../src/blockdev/fd_keeper.ts"), state], { stdio: ["ignore", "inherit", "inherit"] });
afterAll(async () => {
  keeper.kill("SIGTERM");
  await keeper.exited;
  rmSync(dir, { recursive: true, force: true });
});

/** A connection to the keeper: send bytes, read reply lines, see whether it was closed. */
async function connect() {
  const lines: string[] = [];
  let buf = "";
  let closed = false;
  const s = await Bun.connect({
    unix: join(state, "keeper.sock"),
    socket: {
      data: (_s, c) => {
        buf += new TextDecoder().decode(c);
        const parts = buf.split("\n");
        buf = parts.pop()!;
        lines.push(...parts);
      },
      close: () => void (closed = true),
    },
  });
  return { s, lines, isClosed: () => closed };
}

test("an overlong request line: an error reply, the connection cut; the keeper serves on", async () => {
  await until(() => existsSync(join(state, "keeper.pid")), "the keeper to listen");
  const bad = await connect();
  bad.s.write("x".repeat(100 << 10)); // no newline: a line that never ends
  await until(() => bad.isClosed(), "the keeper to cut the connection");
  expect(bad.lines).toHaveLength(1);
  expect(JSON.parse(bad.lines[0]!)).toEqual({ ok: false, error: `request line over ${64 << 10} bytes` });

  const good = await connect();
  good.s.write(JSON.stringify({ op: "hold", key: "k", pid: process.pid, fds: Array.from({ length: 9 }, () => 0) }) + "\n");
  good.s.write(JSON.stringify({ op: "hold", key: "", pid: process.pid, fds: [0] }) + "\n");
  good.s.write(JSON.stringify({ op: "list" }) + "\n");
  await until(() => good.lines.length === 3, "three replies");
  expect(JSON.parse(good.lines[0]!)).toEqual({ ok: false, error: "hold takes 1..8 fds, not 9" });
  expect(JSON.parse(good.lines[1]!)).toEqual({ ok: false, error: "hold needs key, pid, fds" });
  expect(JSON.parse(good.lines[2]!)).toEqual({ ok: true, held: {} });
  expect(good.isClosed()).toBe(false);
  good.s.end();
  expect(processGone(Number(readFileSync(join(state, "keeper.pid"), "utf8")))).toBe(false);
});
