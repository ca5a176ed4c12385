// Any OCI image runs the SDK's commands, PTYs and file operations (POST /sandboxes-cold, the stock
// e2b SDK, real VMs). Three images are built here and pushed to a loopback registry: busybox (no
// bash, no account `user`), an alpine-like one (musl loader and a program linked against it,
// /bin/sh but no bash, an /etc/profile that sets PATH) and one with no shell at all (one static
// binary, no /etc). envd stands the tools disk's busybox sh in for the missing shells, supplies
// `user` (uid 1000, home /home/user) and a root-only sudo, and says so in the sandbox's logs (its
// console) and in the template's build log; nothing is written into the image's files.
import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { chmod, copyFile, mkdir, symlink, writeFile } from "node:fs/promises";
import { join } from "node:path";
import { CommandExitError, Sandbox } from "e2b";
import { RegistryClient } from "../../src/template/registry.ts";
import { scratchDir } from "../helpers/tmp.ts";
import { BUSYBOX_BIN, BUSYBOX_CONFIG, busyboxRoot, pushImage, registrySkipReason, registrySuite } from "../template/registry_harness.ts";
import { FIRST_START_MS, nodeSetup, nodeSkipReason, postJson, sdkOpts, startNode, stopNode, until, type NodeProc } from "./harness.ts";

const GUEST = join(import.meta.dir, "../../guest");
const skip = nodeSkipReason() ?? registrySkipReason() ?? (Bun.which("gcc") ? undefined : "gcc is missing: the musl programs of the test images cannot be built");
const KEY = "e2b_" + "a9".repeat(20);
/** A cold create pulls, converts, boots and checkpoints the image under TCG, then restores it. */
const IMAGE_MS = 10 * 60_000;
/** What the test programs print: the C library they run on and their uid. */
const HELLO_C = `#include <stdio.h>
#include <unistd.h>
int main(void) { printf("musl hello uid=%d\\n", (int)getuid()); return 0; }
`;

/** Runs argv; its stdout, or an error with its stderr. */
async function run(argv: string[]): Promise<string> {
  const p = Bun.spawn(argv, { stdout: "pipe", stderr: "pipe" });
  const [out, err, code] = await Promise.all([new Response(p.stdout).text(), new Response(p.stderr).text(), p.exited]);
  if (code !== 0) throw new Error(`${argv.join(" ")} failed (${code}): ${err.trim().slice(-2000)}`);
  return out;
}

/**
 * Debian's musl (loader and libc.so) and musl-dev (headers, crt files, libc.a), fetched into the
 * guest cache as the guest build fetches its packages (nothing installed), unpacked under `dir`;
 * `hello` linked against musl's loader, and `hello-static`.
 */
async function muslPrograms(dir: string): Promise<{ sysroot: string; dynamic: string; static: string }> {
  const debs = (await run(["bash", "-c", `source '${GUEST}/lib.sh' && fetch_deb musl && fetch_deb musl-dev`])).trim().split("\n");
  const sysroot = join(dir, "musl");
  for (const deb of debs) await run(["dpkg-deb", "-x", deb, sysroot]);
  const src = join(dir, "hello.c");
  await writeFile(src, HELLO_C);
  const crt = join(sysroot, "usr/lib/x86_64-linux-musl");
  const common = ["gcc", "-O2", "-nostdinc", "-isystem", join(sysroot, "usr/include/x86_64-linux-musl"), "-isystem", (await run(["gcc", "-print-file-name=include"])).trim(), "-nostdlib"];
  const libgcc = (await run(["gcc", "-print-libgcc-file-name"])).trim();
  const dynamic = join(dir, "hello");
  await run([...common, "-fPIE", "-pie", join(crt, "Scrt1.o"), join(crt, "crti.o"), src, `-L${join(sysroot, "lib/x86_64-linux-musl")}`, "-lc", libgcc, join(crt, "crtn.o"),
    "-Wl,-dynamic-linker,/lib/ld-musl-x86_64.so.1", "-o", dynamic]);
  const fixed = join(dir, "hello-static");
  await run([...common, "-static", join(crt, "crt1.o"), join(crt, "crti.o"), src, join(crt, "libc.a"), libgcc, join(crt, "crtn.o"), "-o", fixed]);
  return { sysroot, dynamic, static: fixed };
}

/**
 * Alpine's layout: busybox with every applet linked in /bin, musl's loader in /lib, a program
 * linked against it, root and nobody in passwd, an /etc/profile that sets PATH; no bash, no sudo.
 */
async function alpineLikeRoot(dir: string, musl: { sysroot: string; dynamic: string }): Promise<string> {
  for (const d of ["bin", "lib/x86_64-linux-musl", "usr/bin", "etc", "root", "tmp"]) await mkdir(join(dir, d), { recursive: true });
  await chmod(join(dir, "tmp"), 0o1777);
  await copyFile(BUSYBOX_BIN, join(dir, "bin/busybox"));
  await chmod(join(dir, "bin/busybox"), 0o755);
  for (const a of (await run([BUSYBOX_BIN, "--list"])).split("\n").filter((a) => a && a !== "busybox")) await symlink("busybox", join(dir, "bin", a));
  await copyFile(join(musl.sysroot, "lib/x86_64-linux-musl/libc.so"), join(dir, "lib/x86_64-linux-musl/libc.so"));
  await symlink("x86_64-linux-musl/libc.so", join(dir, "lib/ld-musl-x86_64.so.1"));
  await copyFile(musl.dynamic, join(dir, "usr/bin/hello"));
  await chmod(join(dir, "usr/bin/hello"), 0o755);
  await writeFile(join(dir, "etc/passwd"), "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/sbin/nologin\n");
  await writeFile(join(dir, "etc/group"), "root:x:0:root\nnobody:x:65534:\n");
  await writeFile(join(dir, "etc/profile"), "export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin\nexport PROFILE_READ=yes\n");
  await writeFile(join(dir, "etc/os-release"), "ID=alpine-like\nNAME=\"musl test image\"\n");
  return dir;
}

/** Nothing but one static binary: no shell, no /etc, no /tmp (a distroless or scratch image). */
async function noShellRoot(dir: string, program: string): Promise<string> {
  await mkdir(dir, { recursive: true });
  await copyFile(program, join(dir, "hello"));
  await chmod(join(dir, "hello"), 0o755);
  return dir;
}

describe.skipIf(!!skip)("any OCI image runs the SDK's commands, PTYs and files", () => {
  if (skip) return void test.skip(skip!, () => {});
  const setup = nodeSetup("img", 245, KEY);
  const registry = registrySuite("any-image-registry");
  let node: NodeProc;
  let refs: { busybox: string; alpine: string; noShell: string };
  const get = async (path: string) => {
    const r = await fetch(`${node.base}${path}`, { headers: { "x-api-key": KEY } });
    expect(r.status).toBe(200);
    return r.json() as Promise<any>;
  };

  beforeAll(async () => {
    setup.env.AENV_INSECURE_REGISTRIES = registry().insecure.join(",");
    const dir = scratchDir("any-image");
    const musl = await muslPrograms(dir);
    const { reg } = registry();
    const client = new RegistryClient({ dockerConfigPath: null, insecureRegistries: [reg.host] });
    refs = { busybox: `${reg.host}/any/busybox:1`, alpine: `${reg.host}/any/alpine-like:1`, noShell: `${reg.host}/any/no-shell:1` };
    await pushImage(client, refs.busybox, { layers: [await busyboxRoot(join(dir, "busybox"))], config: BUSYBOX_CONFIG });
    await pushImage(client, refs.alpine, {
      layers: [await alpineLikeRoot(join(dir, "alpine"), musl)],
      config: { Env: ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"], Cmd: ["/bin/sh"] },
    });
    await pushImage(client, refs.noShell, { layers: [await noShellRoot(join(dir, "no-shell"), musl.static)], config: { Entrypoint: ["/hello"] } });
    node = await startNode(setup.env, FIRST_START_MS);
  }, FIRST_START_MS + 120_000);
  afterAll(() => stopNode(node, setup), 180_000);

  /** A sandbox of `image` through POST /sandboxes-cold, connected with the SDK. */
  async function create(image: string): Promise<{ sbx: Sandbox; templateID: string }> {
    const r = await postJson(node, KEY, "/sandboxes-cold", { image, timeout: 900 });
    const body = (await r.json()) as { sandboxID: string; templateID: string; message?: string };
    expect({ status: r.status, message: body.message }).toEqual({ status: 201, message: undefined });
    return { sbx: await Sandbox.connect(body.sandboxID, sdkOpts(node, KEY)), templateID: body.templateID };
  }

  /** The sandbox's logs (its console) and the warnings of its template's build. */
  async function reports(sbx: Sandbox, templateID: string): Promise<{ console: string; build: string[] }> {
    const logs = (await get(`/v2/sandboxes/${sbx.sandboxId}/logs`)) as { logs: { message: string }[] };
    const [{ buildID }] = (await get(`/templates/${templateID}/tags`)) as { buildID: string }[];
    const status = (await get(`/templates/${templateID}/builds/${buildID}/status?level=warn`)) as { logEntries: { level: string; message: string }[] };
    return { console: logs.logs.map((l) => l.message).join("\n"), build: status.logEntries.filter((e) => e.level === "warn").map((e) => e.message) };
  }

  /** Exit codes, stdout and stderr, env and cwd through the SDK's `/bin/bash -l -c`. */
  async function commandsWork(sbx: Sandbox, workdir: string) {
    expect((await sbx.commands.run('pwd; echo "$A"', { envs: { A: "from-request" } })).stdout).toBe(`${workdir}\nfrom-request\n`);
    expect((await sbx.commands.run("pwd", { cwd: "/tmp" })).stdout).toBe("/tmp\n");
    const failed = await sbx.commands.run("echo out; echo err >&2; exit 3").catch((e) => e);
    expect(failed).toBeInstanceOf(CommandExitError);
    expect({ exitCode: failed.exitCode, stdout: failed.stdout, stderr: failed.stderr }).toEqual({ exitCode: 3, stdout: "out\n", stderr: "err\n" });
    expect((await sbx.commands.run('id -u; echo "$HOME $USER"', { user: "root" })).stdout).toBe("0\n/root root\n");
    // `user` is envd's where the image has none: uid and gid 1000, a home it owns.
    const asUser = await sbx.commands.run('id -u; id -g; echo "$HOME $USER"; echo mine >~/mine; stat -c %u:%g:%a ~ ~/mine', { user: "user" });
    expect(asUser.stdout).toBe("1000\n1000\n/home/user user\n1000:1000:700\n1000:1000:644\n");
  }

  /** An interactive `/bin/bash -i -l` PTY: input in, output out, exit code back. */
  async function ptyWorks(sbx: Sandbox, user: "root" | "user", uid: number) {
    let out = "";
    const decoder = new TextDecoder();
    const pty = await sbx.pty.create({ cols: 100, rows: 30, user, onData: (d) => void (out += decoder.decode(d, { stream: true })) });
    await sbx.pty.sendInput(pty.pid, new TextEncoder().encode("echo pty-$((6*7))-$(id -u)\n"));
    await until(() => out.includes(`pty-42-${uid}`), 60_000, `the PTY's answer (so far: ${JSON.stringify(out.slice(-300))})`);
    await sbx.pty.sendInput(pty.pid, new TextEncoder().encode("exit 0\n"));
    expect((await pty.wait()).exitCode).toBe(0);
  }

  /** Write, read and list as root (absolute paths) and as `user` (relative: under its home). */
  async function filesWork(sbx: Sandbox) {
    await sbx.files.write("/tmp/any.txt", "any image\n");
    expect(await sbx.files.read("/tmp/any.txt")).toBe("any image\n");
    expect((await sbx.files.list("/tmp")).map((e) => e.name)).toContain("any.txt");
    await sbx.files.write("notes/n.txt", "written as user", { user: "user" });
    expect(await sbx.files.read("/home/user/notes/n.txt", { user: "user" })).toBe("written as user");
    const notes = (await sbx.files.list("~", { user: "user" })).find((e) => e.name === "notes");
    expect(notes).toMatchObject({ type: "dir", path: "/home/user/notes", owner: "user", group: "user" });
    expect((await sbx.commands.run("cat ~/notes/n.txt", { user: "user" })).stdout).toBe("written as user");
  }

  test("busybox (no bash, no account `user`, no sudo): commands, PTY, files; the sandbox's logs and the build log say what envd supplies", async () => {
    const { sbx, templateID } = await create(refs.busybox);
    await commandsWork(sbx, "/work");
    // The image's Env and PATH, the tools disk's applets after them (touch is not in this image).
    expect((await sbx.commands.run('echo "$FOO $PATH"; touch /tmp/t && echo touched')).stdout).toBe("bar /bin:/agentenv/bin\ntouched\n");
    await ptyWorks(sbx, "user", 1000);
    await filesWork(sbx);
    // sudo runs for root; nobody else gets root from it.
    expect((await sbx.commands.run("sudo -E id -u", { user: "root" })).stdout).toBe("0\n");
    const refused = await sbx.commands.run("sudo id -u", { user: "user" }).catch((e) => e);
    expect(refused).toBeInstanceOf(CommandExitError);
    expect(refused.exitCode).toBe(1);
    expect(refused.stderr).toContain("run the command as user root");
    // Nothing went into the image's files: its passwd is as built, there is no /bin/bash.
    expect((await sbx.commands.run("cat /etc/passwd; ls /bin/bash 2>&1; true")).stdout).toBe("root:x:0:0:root:/root:/bin/sh\nls: /bin/bash: No such file or directory\n");

    const { console, build } = await reports(sbx, templateID);
    expect(console).toContain("envd: supplied for this image (/agentenv/bin is last on PATH): /bin/bash: not in the image; /agentenv/bin/sh (busybox sh) runs in its place");
    expect(console).toContain("user 'user': not in the image's /etc/passwd; envd supplies uid 1000, gid 1000, home /home/user");
    expect(build).toEqual([
      "envd: /bin/bash: not in the image; /agentenv/bin/sh (busybox sh) runs in its place",
      "envd: user 'user': not in the image's /etc/passwd; envd supplies uid 1000, gid 1000, home /home/user",
      "envd: sudo: not in the image; /agentenv/bin/sudo runs commands for callers that are root already and refuses others",
    ]);
    await sbx.kill();
  }, IMAGE_MS);

  test("alpine-like (musl, /bin/sh, no bash): the image's musl program runs as root and as user; its /etc/profile sets the login shell's PATH", async () => {
    const { sbx, templateID } = await create(refs.alpine);
    await commandsWork(sbx, "/");
    expect((await sbx.commands.run("hello")).stdout).toBe("musl hello uid=0\n");
    expect((await sbx.commands.run("hello", { user: "user" })).stdout).toBe("musl hello uid=1000\n");
    // The image's own /bin/sh stays; only /bin/bash is the tools disk's. A login shell reads the image's profile.
    expect((await sbx.commands.run('echo "$PROFILE_READ $PATH"; readlink /bin/sh')).stdout).toBe("yes /usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin\nbusybox\n");
    await ptyWorks(sbx, "root", 0);
    await filesWork(sbx);
    const { build } = await reports(sbx, templateID);
    expect(build.map((l) => l.split(":")[1])).toEqual([" /bin/bash", " user 'user'", " sudo"]);
    await sbx.kill();
  }, IMAGE_MS);

  test("no shell at all (one static binary, no /etc, no /tmp): commands run on the tools disk's shell and applets; root and user are envd's", async () => {
    const { sbx, templateID } = await create(refs.noShell);
    await commandsWork(sbx, "/");
    expect((await sbx.commands.run("/hello; ls -a /")).stdout).toStartWith("musl hello uid=0\n");
    expect((await sbx.commands.run("/hello", { user: "user" })).stdout).toBe("musl hello uid=1000\n");
    // /tmp made at boot as the usual sticky, world-writable one.
    expect((await sbx.commands.run("stat -c %a /tmp")).stdout).toBe("1777\n");
    await ptyWorks(sbx, "user", 1000);
    await filesWork(sbx);
    expect((await sbx.commands.run("sudo id -u", { user: "root" })).stdout).toBe("0\n");
    // No passwd: nothing was written there, the ids show bare (envd names them in file listings).
    expect((await sbx.commands.run("ls /etc 2>&1; true")).stdout).not.toContain("passwd");
    const { console, build } = await reports(sbx, templateID);
    expect(console).toContain("/bin/sh: not in the image");
    expect(build.map((l) => l.split(":")[1])).toEqual([" /bin/bash", " /bin/sh", " user 'root'", " user 'user'", " sudo"]);
    await sbx.kill();
  }, IMAGE_MS);
});
