// fd keeper: a tiny process that holds a copy of every FUSE connection blockd serves, so the
// connections (and the files VMs hold open on them) outlive a blockd crash. A restarted blockd
// takes its fds back with pidfd_getfd. Protocol: JSON lines on <state>/keeper.sock.
//   {op:"hold", pid, fd, key} → {ok, fd}   {op:"drop", key} → {ok}   {op:"list"} → {ok, held:{key: fd}}

import { rmSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { close, takeFdFrom } from "../../ffi/libc.ts";

const state = process.argv[2];
if (!state) {
  console.error("usage: fd_keeper STATE_DIR");
  process.exit(2);
}
const held = new Map<string, number>();
const sock = join(state, "keeper.sock");
rmSync(sock, { force: true });

function run(req: { op?: string; pid?: number; fd?: number; key?: string }): unknown {
  switch (req.op) {
    case "hold": {
      if (typeof req.key !== "string" || !Number.isInteger(req.pid) || !Number.isInteger(req.fd)) throw new Error("hold needs key, pid, fd");
      const old = held.get(req.key);
      if (old !== undefined) close(old);
      const fd = takeFdFrom(req.pid!, req.fd!);
      held.set(req.key, fd);
      return { ok: true, fd };
    }
    case "drop": {
      const fd = held.get(req.key ?? "");
      if (fd !== undefined) close(fd);
      held.delete(req.key ?? "");
      return { ok: true };
    }
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
  for (const fd of held.values()) close(fd);
  rmSync(sock, { force: true });
  process.exit(0);
});
