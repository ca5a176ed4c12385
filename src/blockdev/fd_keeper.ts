// fd keeper: a tiny process that holds a copy of every FUSE connection blockd serves, so the
// connections (and the files VMs hold open on them) outlive a blockd crash. A restarted blockd
// takes its fds back with pidfd_getfd. A device's fds (its connection's, and its reader's clone)
// are held under one key. Protocol: JSON lines on <state>/keeper.sock.
//   {op:"hold", pid, fds, key} → {ok, fds}   {op:"drop", key} → {ok}   {op:"list"} → {ok, held:{key: fds}}

import { rmSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import type { Socket } from "bun";
import { close, takeFdFrom } from "../../ffi/libc.ts";
import { FrameWriter } from "./protocol.ts";

/** A request line past this is not one blockd sends (a hold names a key and two fds): cut off. */
const KEEPER_MAX_LINE = 64 << 10;
/** fds held under one key: a device has its connection's and its reader's clone. */
const KEEPER_MAX_FDS = 8;
const ID_MAX = 256;

const state = process.argv[2];
if (!state) {
  console.error("usage: fd_keeper STATE_DIR");
  process.exit(2);
}
const held = new Map<string, number[]>();
const sock = join(state, "keeper.sock");
rmSync(sock, { force: true });

function release(key: string): void {
  for (const fd of held.get(key) ?? []) close(fd);
  held.delete(key);
}

function run(req: { op?: string; pid?: number; fds?: number[]; key?: string }): unknown {
  switch (req.op) {
    case "hold": {
      if (typeof req.key !== "string" || !req.key || req.key.length > ID_MAX || !Number.isInteger(req.pid) || !Array.isArray(req.fds) || !req.fds.every(Number.isInteger))
        throw new Error("hold needs key, pid, fds");
      if (req.fds.length < 1 || req.fds.length > KEEPER_MAX_FDS) throw new Error(`hold takes 1..${KEEPER_MAX_FDS} fds, not ${req.fds.length}`);
      const fds: number[] = [];
      try {
        for (const fd of req.fds) fds.push(takeFdFrom(req.pid!, fd));
      } catch (e) {
        for (const fd of fds) close(fd);
        throw e;
      }
      release(req.key);
      held.set(req.key, fds);
      return { ok: true, fds };
    }
    case "drop":
      release(req.key ?? "");
      return { ok: true };
    case "list":
      return { ok: true, held: Object.fromEntries(held) };
    default:
      throw new Error(`unknown op ${JSON.stringify(req.op)}`);
  }
}

/** One reply line, whole: what the socket does not take now goes when it drains. */
function answer(s: Socket<Conn>, out: unknown): void {
  try {
    s.data.writer.send(new TextEncoder().encode(JSON.stringify(out) + "\n"));
  } catch {
    s.end(); // a peer that does not read its replies
  }
}

interface Conn {
  buf: string;
  writer: FrameWriter;
}

Bun.listen<Conn>({
  unix: sock,
  socket: {
    open: (s) => {
      s.data = { buf: "", writer: new FrameWriter(s) };
    },
    drain: (s) => {
      try {
        s.data.writer.flush();
      } catch {
        s.end();
      }
    },
    data: (s, chunk) => {
      s.data.buf += new TextDecoder().decode(chunk);
      let nl: number;
      while ((nl = s.data.buf.indexOf("\n")) >= 0) {
        const line = s.data.buf.slice(0, nl);
        s.data.buf = s.data.buf.slice(nl + 1);
        let out: unknown;
        try {
          if (line.length > KEEPER_MAX_LINE) throw new Error(`request line over ${KEEPER_MAX_LINE} bytes`);
          out = run(JSON.parse(line));
        } catch (e) {
          out = { ok: false, error: (e as Error).message };
        }
        answer(s, out);
      }
      if (s.data.buf.length > KEEPER_MAX_LINE) {
        answer(s, { ok: false, error: `request line over ${KEEPER_MAX_LINE} bytes` });
        s.data.buf = "";
        s.end();
      }
    },
  },
});
writeFileSync(join(state, "keeper.pid"), String(process.pid));
process.on("SIGTERM", () => {
  for (const key of [...held.keys()]) release(key);
  rmSync(sock, { force: true });
  process.exit(0);
});
