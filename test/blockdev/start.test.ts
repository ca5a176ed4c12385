// blockd's start itself: one blockd per state dir (two started at once: one serves, the other
// says so and exits, and every client reaches the one), and a start that fails says why in one
// line without leaving the fd keeper behind.
import { afterAll, expect, test } from "bun:test";
import { existsSync, mkdirSync, readFileSync, rmSync } from "node:fs";
import { join } from "node:path";
import { BlockdClient } from "../../src/blockdev/client.ts";
import { scratchDir } from "../helpers/tmp.ts";
import { blockdPid, fuseTest, haveFuse, mountsAt, processGone, startBlockd, until } from "./harness.ts";

const MAIN = join(import.meta.dir, "../../src/blockdev/main.ts");

/** Run blockd's entry point to its end (bounded), with `env` added to ours: exit code and stderr. */
async function runMain(args: string[], env: Record<string, string> = {}): Promise<{ code: number | string; err: string }> {
  const p = Bun.spawn([process.execPath, MAIN, ...args], { stdout: "pipe", stderr: "pipe", env: { ...process.env, ...env } });
  const code = await Promise.race([p.exited, Bun.sleep(30_000).then(() => "still running")]);
  if (code === "still running") p.kill(9);
  return { code, err: (await new Response(p.stderr).text()).trim() };
}

test.skipIf(!haveFuse)(
  fuseTest("two blockds started at once on one state dir: one serves, the other exits 1 saying so, both clients reach the one"),
  async () => {
    const dir = scratchDir("blockd-start-race", { keep: true });
    const state = join(dir, "state");
    mkdirSync(state, { recursive: true });
    afterAll(async () => {
      const pids = ["blockd.pid", "keeper.pid"].map((n) => join(state, n)).filter(existsSync).map((f) => Number(readFileSync(f, "utf8")));
      for (const pid of pids) process.kill(pid, "SIGTERM");
      await until(() => pids.every(processGone), "blockd and its keeper to exit");
      rmSync(dir, { recursive: true, force: true });
    });
    const [a, b] = await Promise.all([BlockdClient.ensure(state), BlockdClient.ensure(state)]);
    const [ha, hb] = await Promise.all([a.call("hello"), b.call("hello")]);
    expect(ha.pid).toBe(hb.pid);
    expect(blockdPid(state)).toBe(ha.pid);
    await until(() => readFileSync(join(state, "blockd.log"), "utf8").includes("blockd: start failed: StateBusy: another blockd"), "the second blockd to say why it stopped");
    // What one client makes, the other sees: there is one device table.
    const dev = await a.call("create", { upperDir: join(dir, "up"), size: 1 << 20 });
    expect((await b.call("list")).map((d: { id: string }) => d.id)).toEqual([dev.id]);

    // A third start, while the first runs: refused by name, and the first serves on untouched.
    const third = await runMain(["--state", state]);
    expect(third.code).toBe(1);
    expect(third.err).toBe(`blockd: start failed: StateBusy: another blockd (pid ${ha.pid}) serves ${state}`);
    expect(mountsAt(dev.path)).toHaveLength(1);
    expect((await a.call("stats", { id: dev.id })).size).toBe(1 << 20);
    await a.call("delete", { id: dev.id });
    a.close();
    b.close();
  },
  60_000,
);

test.skipIf(!haveFuse)(
  fuseTest("a start that fails says why in one line, exits 1, and lets the fd keeper it started go"),
  async () => {
    const dir = scratchDir("blockd-start-fails");
    const state = join(dir, "state");
    mkdirSync(join(state, "blockd.sock", "in-the-way"), { recursive: true }); // the socket path is a non-empty folder
    try {
      const { code, err } = await runMain(["--state", state]);
      expect(code).toBe(1);
      expect(err.split("\n")).toHaveLength(1);
      expect(err).toStartWith("blockd: start failed: ");
      expect(err).toContain("blockd.sock");
      const keeperPid = Number(readFileSync(join(state, "keeper.pid"), "utf8"));
      await until(() => processGone(keeperPid), "the idle fd keeper to exit");
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  },
  60_000,
);

test.skipIf(!haveFuse)(fuseTest("the node's blockd settings reach the blockd it starts, in its environment"), async () => {
  const { state, client } = await startBlockd("blockd-start-settings", { settings: { frontend: "fuse", fuseUring: false, fuseReaderSlots: 0 } });
  expect((await client.call<{ frontend: string }>("hello")).frontend).toBe("fuse");
  const env = readFileSync(`/proc/${blockdPid(state)}/environ`, "utf8").split("\0");
  for (const v of ["AENV_BLOCKD_FRONTEND=fuse", "AENV_FUSE_URING=0", "AENV_FUSE_READER_SLOTS=0"]) expect(env).toContain(v);
  client.close();
});

test("a frontend that is not auto, fuse or ublk fails the start, naming AENV_BLOCKD_FRONTEND", async () => {
  const dir = scratchDir("blockd-start-frontend");
  try {
    const { code, err } = await runMain(["--state", join(dir, "state")], { AENV_BLOCKD_FRONTEND: "nbd" });
    expect(code).toBe(1);
    expect(err).toBe("blockd: start failed: AENV_BLOCKD_FRONTEND=nbd: expected auto, fuse or ublk");
    expect(existsSync(join(dir, "state", "keeper.pid"))).toBe(false);
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
});

test("a pool size that is not 0..256 is a usage error, before anything starts", async () => {
  for (const pool of ["-1", "abc", "100000"]) {
    const { code, err } = await runMain(["--state", "/nonexistent/state", "--pool", pool]);
    expect(code).toBe(2);
    expect(err).toBe("usage: blockd --state DIR [--pool N]   (N: 0..256)");
  }
});
