// What envd supplies where the image lacks it, on a host process: accounts root and user from envd
// when passwd has neither (user takes the first id from 1000 that passwd and group leave free), the
// tools directory last on PATH unless the request sets PATH, and the report in envd's log. The
// shells and homes are the guest's (test/node/any_image.test.ts drives them in VMs).
import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { chmodSync, mkdirSync, statSync, symlinkSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import type { Sandbox } from "e2b";
import { scratchDir } from "../helpers/tmp.ts";
import { BUSYBOX_BIN } from "../template/registry_harness.ts";
import { sdkSandbox, startEnvd, until, type Envd } from "./harness.ts";

const skip = process.getuid?.() !== 0 ? "needs root: envd switches to the supplied accounts' ids" : undefined;

describe.skipIf(!!skip)("accounts and tools envd supplies", () => {
  if (skip) return void test.skip(skip, () => {});
  let envd: Envd;
  let sbx: Sandbox;
  const dir = scratchDir("envd-supplied");
  const tools = join(dir, "tools");
  const scratch = join(dir, "scratch");

  beforeAll(async () => {
    chmodSync(dir, 0o755); // the supplied user must reach its scratch folder
    // A passwd with neither root nor user, and a group that holds gid 1000.
    writeFileSync(join(dir, "passwd"), "nobody:x:65534:65534:nobody:/nonexistent:/bin/sh\n");
    writeFileSync(join(dir, "group"), "nobody:x:65534:\ntaken:x:1000:\n");
    mkdirSync(tools);
    symlinkSync(BUSYBOX_BIN, join(tools, "sh"));
    mkdirSync(scratch);
    chmodSync(scratch, 0o1777);
    envd = await startEnvd(["--passwd", join(dir, "passwd"), "--group", join(dir, "group"), "--tools", tools]);
    sbx = await sdkSandbox(envd);
  });
  afterAll(() => envd?.stop());

  test("user is uid and gid 1001 (1000 is a group's) with home /home/user; root is 0 with /root; both only in envd", async () => {
    const user = await sbx.commands.run('id -u; id -g; echo "$HOME $USER $LOGNAME"', { user: "user", cwd: scratch });
    expect(user.stdout).toBe("1001\n1001\n/home/user user user\n");
    const root = await sbx.commands.run('id -u; echo "$HOME $USER"', { user: "root", cwd: scratch });
    expect(root.stdout).toBe("0\n/root root\n");
    await until(() => envd.logs().includes("envd: supplied for this image"), "the report in envd's log");
    expect(envd.logs()).toContain(`envd: supplied for this image (${tools} is last on PATH): user 'root': not in the image's /etc/passwd; envd supplies uid 0, gid 0, home /root; user 'user': not in the image's /etc/passwd; envd supplies uid 1001, gid 1001, home /home/user`);
  });

  test("files written as user are its own, and listings name the supplied account and group", async () => {
    await sbx.files.write(join(scratch, "mine.txt"), "mine", { user: "user" });
    expect(statSync(join(scratch, "mine.txt"))).toMatchObject({ uid: 1001, gid: 1001 });
    const entry = (await sbx.files.list(scratch, { user: "user" })).find((e) => e.name === "mine.txt");
    expect(entry).toMatchObject({ owner: "user", group: "user" });
  });

  test("the tools directory goes last on the PATH envd starts a process with; a request's own PATH is kept as given", async () => {
    // The environment the shell was started with (a login shell's /etc/profile may set PATH afresh).
    const startPath = 'tr "\\0" "\\n" </proc/$$/environ | grep ^PATH=';
    const path = (await sbx.commands.run(startPath, { cwd: scratch })).stdout.trim().slice("PATH=".length);
    expect(path.split(":").at(-1)).toBe(tools);
    expect(path.split(":").filter((d) => d === tools).length).toBe(1);
    expect((await sbx.commands.run(startPath, { cwd: scratch, envs: { PATH: "/usr/bin:/bin" } })).stdout).toBe("PATH=/usr/bin:/bin\n");
  });
});
