// QmpClient against a socket that exists before anyone listens on it, as QEMU's does for a moment
// between bind() and listen(); the CI failure this reproduces: "QMP failed (Failed to connect)".
import { expect, test } from "bun:test";
import { existsSync, rmSync } from "node:fs";
import { join } from "node:path";
import { QmpClient } from "../../src/vmm/qmp.ts";
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
