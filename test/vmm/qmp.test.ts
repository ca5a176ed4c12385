// QmpClient against a socket that exists before anyone listens on it, as QEMU's does for a moment
// between bind() and listen(); the CI failure this reproduces: "QMP failed (Failed to connect)".
import { expect, test } from "bun:test";
import { existsSync, rmSync } from "node:fs";
import { join } from "node:path";
import { QmpClient, QmpFdSession } from "../../src/vmm/qmp.ts";
import { scratchDir } from "../helpers/tmp.ts";

test("connect waits out a socket file nobody listens on yet, then greets and negotiates", async () => {
  const path = join(scratchDir("qmp"), "qmp.sock");
  // A listener killed with SIGKILL leaves its socket file behind: connecting to it is refused.
  const stale = Bun.spawn([process.execPath, "-e", `Bun.listen({unix: ${JSON.stringify(path)}, socket: {data() {}}}); setInterval(() => {}, 1000)`]);
  while (!existsSync(path)) await Bun.sleep(5);
  stale.kill("SIGKILL");
  await stale.exited;
  expect(existsSync(path)).toBe(true);

  const seen: string[] = [];
  let server: ReturnType<typeof Bun.listen> | undefined;
  const later = Bun.sleep(150).then(() => {
    rmSync(path);
    server = Bun.listen({
      unix: path,
      socket: {
        open: (s) => void s.write('{"QMP": {"version": {}, "capabilities": []}}\r\n'),
        data: (s, chunk) => {
          const msg = JSON.parse(new TextDecoder().decode(chunk));
          seen.push(msg.execute);
          s.write(JSON.stringify({ return: {}, id: msg.id }) + "\r\n");
        },
      },
    });
  });
  const qmp = await QmpClient.connect(path, 60_000);
  expect(server).toBeDefined(); // it waited for the listener rather than failing on the refused connect
  expect(seen).toEqual(["qmp_capabilities"]);
  qmp.close();
  await later;
  server?.stop(true);
});

test("connect gives up at its deadline when nobody ever listens", async () => {
  await expect(QmpClient.connect(join(scratchDir("qmp-none"), "absent.sock"), 100)).rejects.toMatchObject({ code: "Timeout" });
});

test("QmpFdSession (the fd monitor): greets and negotiates, runs a command, bounds a reply's line and its wait", async () => {
  const path = join(scratchDir("qmp-fd"), "qmp-fd.sock");
  const seen: string[] = [];
  let mode: "answer" | "silent" | "flood" = "answer";
  const server = Bun.listen({
    unix: path,
    socket: {
      open: (s) => void s.write('{"QMP": {"version": {}, "capabilities": []}}\r\n'),
      data: (s, chunk) => {
        for (const line of new TextDecoder().decode(chunk).split("\n").filter((l) => l.trim())) {
          const msg = JSON.parse(line);
          seen.push(msg.execute);
          if (msg.execute === "qmp_capabilities" || mode === "answer") s.write(JSON.stringify({ return: { ok: msg.execute }, id: msg.id }) + "\r\n");
          else if (mode === "flood") s.write("x".repeat(128 << 10));
        }
      },
    },
  });
  try {
    const s = await QmpFdSession.open(path, 500);
    expect(await s.execute("query-status")).toEqual({ ok: "query-status" });
    mode = "silent";
    await expect(s.execute("stop")).rejects.toMatchObject({ code: "Timeout" });
    s.close();
    mode = "flood";
    const f = await QmpFdSession.open(path, 2000);
    const err = await f.execute("stop").catch((e) => e);
    expect([err.code, err.message]).toEqual(["Protocol", expect.stringContaining("a line over 65536 bytes")]);
    f.close();
    expect(seen).toEqual(["qmp_capabilities", "query-status", "stop", "qmp_capabilities", "stop"]);
  } finally {
    server.stop(true);
  }
});
