// fd keeper: a tiny process that holds a copy of every FUSE connection blockd serves, so the
// connections (and the files VMs hold open on them) outlive a blockd crash. A restarted blockd
// takes its fds back with pidfd_getfd. A device's fds (its connection's, and its reader's clone)
// are held under one key. Protocol: JSON lines on <state>/keeper.sock.
//   {op:"hold", pid, fds, key} → {ok, fds}   {op:"drop", key} → {ok}   {op:"list"} → {ok, held:{key: fds}}

import { rmSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { close, takeFdFrom } from "../../ffi/libc.ts";

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
      if (typeof req.key !== "string" || !Number.isInteger(req.pid) || !Array.isArray(req.fds) || !req.fds.every(Number.isInteger))
        throw new Error("hold needs key, pid, fds");
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

Bun.listen<{ buf: string }>({
  unix: sock,
  socket: {
    open: (s) => {
      s.data = { buf: "" };
    },
    data: (s, chunk) => {
      s.data.buf += new TextDecoder().decode(chunk);
      let nl: number;
      while ((nl = s.data.buf.indexOf("\n")) >= 0) {
        const line = s.data.buf.slice(0, nl);
        s.data.buf = s.data.buf.slice(nl + 1);
        let out: unknown;
        try {
          out = run(JSON.parse(line));
        } catch (e) {
          out = { ok: false, error: (e as Error).message };
        }
        s.write(JSON.stringify(out) + "\n");
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
