// The unmodified e2b SDK (2.51.0) against our envd running as a host process on 127.0.0.1.
import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { existsSync, lstatSync, readFileSync, statSync, symlinkSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import {
  AuthenticationError, CommandExitError, FileNotFoundError, FilesystemEventType, InvalidArgumentError, NotFoundError, TimeoutError, type Sandbox,
} from "e2b";
import { sdkSandbox, startEnvd, until, USER_UID, type Envd } from "./harness.ts";

let envd: Envd;
let sbx: Sandbox;

beforeAll(async () => {
  envd = await startEnvd();
  sbx = await sdkSandbox(envd);
});
afterAll(async () => {
  await envd?.stop();
});

/** The pid is a live process whose command line (argv joined by spaces) contains `fragment`. */
function runs(pid: number, fragment: string): boolean {
  try {
    return readFileSync(`/proc/${pid}/cmdline`, "utf8").split("\0").join(" ").includes(fragment);
  } catch {
    return false;
  }
}

/** A shell loop that waits for `flag` to exist: a process that stays alive exactly as long as the test needs. */
const waitFor = (flag: string) => `while [ ! -e ${flag} ]; do sleep 0.05; done`;

describe("commands", () => {
  test("stdout, stderr, exit code 0, default user and home", async () => {
    const r = await sbx.commands.run("echo out; echo err >&2; id -u; pwd");
    expect(r.exitCode).toBe(0);
    expect(r.stdout).toBe(`out\n${USER_UID}\n${envd.userHome}\n`);
    expect(r.stderr).toBe("err\n");
  });

  test("non-zero exit rejects with CommandExitError", async () => {
    const err = await sbx.commands.run("echo partial; exit 7").catch((e) => e);
    expect(err).toBeInstanceOf(CommandExitError);
    expect(err.exitCode).toBe(7);
    expect(err.error).toBe("exit status 7");
    expect(err.stdout).toBe("partial\n");
  });

  test("env vars, cwd and user root", async () => {
    const r = await sbx.commands.run('echo "$FOO|$E2B_SANDBOX|$USER"; pwd; id -u', {
      envs: { FOO: "bar baz" },
      cwd: "/tmp",
      user: "root",
    });
    expect(r.stdout).toBe("bar baz|true|root\n/tmp\n0\n");
    // Request envs must not leak into later processes.
    expect((await sbx.commands.run('echo "[$FOO]"')).stdout).toBe("[]\n");
  });

  test("a user's supplementary groups from the group file, as a login gives them", async () => {
    const groupFile = join(envd.root, "group");
    const before = readFileSync(groupFile, "utf8");
    try {
      writeFileSync(groupFile, `${before}wheel:x:4242:root,user\nother:x:4343:root\naudio:x:4444:user\n`);
      expect((await sbx.commands.run("id -G")).stdout.trim().split(" ").map(Number)).toEqual([USER_UID, 4242, 4444]);
      // Through a PTY too.
      let out = "";
      const dec = new TextDecoder();
      const pty = await sbx.pty.create({ cols: 80, rows: 24, onData: (d) => void (out += dec.decode(d, { stream: true })) });
      await sbx.pty.sendInput(pty.pid, new TextEncoder().encode("echo G=$(id -G); exit\n"));
      await pty.wait();
      expect(out).toContain(`G=${USER_UID} 4242 4444`);
    } finally {
      writeFileSync(groupFile, before);
    }
    expect((await sbx.commands.run("id -G")).stdout.trim()).toBe(String(USER_UID));
  });

  test("missing cwd is an argument error", async () => {
    const err = await sbx.commands.run("true", { cwd: "/definitely/not/here" }).catch((e) => e);
    expect(err).toBeInstanceOf(InvalidArgumentError);
    expect(err.message).toContain("cwd '/definitely/not/here' does not exist");
  });

  test("streaming callbacks see chunks as they come", async () => {
    // "two" is written only after the test saw "one": proof that "one" arrived on its own.
    const flag = join(envd.root, "seen-one");
    const seen: string[] = [];
    const run = sbx.commands.run(`echo one; ${waitFor(flag)}; echo two`, { onStdout: (d) => void seen.push(d) });
    await until(() => seen.join("") === "one\n", "first chunk");
    writeFileSync(flag, "");
    await run;
    expect(seen.join("")).toBe("one\ntwo\n");
  });

  test("background command, list, connect and wait", async () => {
    const flag = join(envd.root, "background-go");
    const script = `${waitFor(flag)}; echo done`;
    const h = await sbx.commands.run(script, { background: true });
    await until(() => runs(h.pid, script), "the started pid running the command");
    const listed = await sbx.commands.list();
    const mine = listed.find((p) => p.pid === h.pid);
    expect(mine?.cmd).toBe("/bin/bash");
    expect(mine?.args).toEqual(["-l", "-c", script]);
    const other = await sbx.commands.connect(h.pid);
    writeFileSync(flag, "");
    const r = await h.wait();
    expect(r.stdout).toBe("done\n");
    expect((await other.wait()).stdout).toBe("done\n");
    expect((await sbx.commands.list()).some((p) => p.pid === h.pid)).toBe(false);
  });

  test("sendStdin and closeStdin", async () => {
    const h = await sbx.commands.run("cat", { background: true, stdin: true });
    let out = "";
    const collected = sbx.commands.connect(h.pid, { onStdout: (d) => void (out += d) });
    await collected;
    await sbx.commands.sendStdin(h.pid, "hello ");
    await sbx.commands.sendStdin(h.pid, "");
    await sbx.commands.sendStdin(h.pid, "world");
    await until(() => out === "hello world");
    await h.closeStdin();
    const r = await h.wait();
    expect(r.exitCode).toBe(0);
    expect(r.stdout).toBe("hello world");
  });

  test("kill", async () => {
    const h = await sbx.commands.run("sleep 30", { background: true });
    await until(() => runs(h.pid, "sleep 30"), "the started pid running the command");
    expect(await sbx.commands.kill(h.pid)).toBe(true);
    const err = await h.wait().catch((e) => e);
    expect(err).toBeInstanceOf(CommandExitError);
    expect(err.error).toBe("signal: killed");
    await until(() => !existsSync(`/proc/${h.pid}`), "the killed process reaped");
    expect(await sbx.commands.kill(h.pid)).toBe(false);
    expect(await sbx.commands.kill(999_999)).toBe(false);
  });

  test("connect to an unknown pid rejects", async () => {
    await expect(sbx.commands.connect(999_999)).rejects.toBeInstanceOf(NotFoundError);
  });

  test("timeoutMs ends the command with TimeoutError, and kills it", async () => {
    // sleep 600: ending on its own would take far longer than the test's own limit.
    await expect(sbx.commands.run("sleep 600", { timeoutMs: 500 })).rejects.toBeInstanceOf(TimeoutError);
    const h = await sbx.commands.run("sleep 600", { background: true, timeoutMs: 300 });
    await expect(h.wait()).rejects.toBeInstanceOf(TimeoutError);
    await until(async () => !(await sbx.commands.list()).some((p) => p.pid === h.pid), "the timed-out process gone from the list");
    await until(() => !existsSync(`/proc/${h.pid}`), "the timed-out process reaped");
  }, 60_000);
});

describe("files", () => {
  test("write, read, exists, getInfo under the user's home", async () => {
    const info = await sbx.files.write("notes/a.txt", "hello");
    expect(info).toEqual({ name: "a.txt", path: join(envd.userHome, "notes/a.txt"), type: "file" } as never);
    expect(await sbx.files.read("notes/a.txt")).toBe("hello");
    expect(await sbx.files.read(join(envd.userHome, "notes/a.txt"), { format: "bytes" })).toEqual(new TextEncoder().encode("hello"));
    expect(await sbx.files.exists("notes/a.txt")).toBe(true);
    expect(await sbx.files.exists("notes/missing.txt")).toBe(false);
    const st = statSync(join(envd.userHome, "notes/a.txt"));
    expect([st.uid, st.mode & 0o777]).toEqual([USER_UID, 0o644]);
    expect(statSync(join(envd.userHome, "notes")).mode & 0o777).toBe(0o755);
    const e = await sbx.files.getInfo("notes/a.txt");
    expect([e.type, e.size, e.mode, e.permissions, e.owner, e.group]).toEqual(["file", 5, 0o644, "-rw-r--r--", "user", "user"] as never);
  });

  test("read of a missing file is FileNotFoundError", async () => {
    await expect(sbx.files.read("nope.txt")).rejects.toBeInstanceOf(FileNotFoundError);
  });

  test("multi-file write, gzip, octet-stream with metadata, empty file", async () => {
    const many = await sbx.files.write([
      { path: "multi/x.txt", data: "x" },
      { path: join(envd.root, "abs.txt"), data: new Blob(["abs"]) },
    ]);
    expect(many.map((w) => w.path)).toEqual([join(envd.userHome, "multi/x.txt"), join(envd.root, "abs.txt")]);
    expect(readFileSync(join(envd.root, "abs.txt"), "utf8")).toBe("abs");

    await sbx.files.write("gz.txt", "z".repeat(10_000), { gzip: true });
    expect(await sbx.files.read("gz.txt", { gzip: true })).toBe("z".repeat(10_000));

    const meta = await sbx.files.write("meta.txt", "m", { useOctetStream: true, metadata: { Author: "me" } });
    expect(meta.metadata).toEqual({ author: "me" });
    expect((await sbx.files.getInfo("meta.txt")).metadata).toEqual({ author: "me" });
    await sbx.files.write("meta.txt", "m2"); // a write without metadata clears it
    expect((await sbx.files.getInfo("meta.txt")).metadata ?? {}).toEqual({});

    await sbx.files.write("empty.txt", "");
    expect(await sbx.files.read("empty.txt")).toBe("");

    // A ReadableStream is uploaded as a chunked octet-stream body.
    await sbx.files.write("streamed.txt", new Blob(["str", "eamed"]).stream());
    const rs = await sbx.files.read("streamed.txt", { format: "stream" });
    expect(await new Response(rs).text()).toBe("streamed");
    // Pseudo-files report size 0 but have content.
    expect(await sbx.files.read("/proc/self/stat")).toMatch(/^\d+ /);
  });

  test("list with depth, in lexical pre-order, and symlinks", async () => {
    await sbx.files.makeDir("tree/b/c");
    await sbx.files.write("tree/a.txt", "a");
    await sbx.files.write("tree/b/c/d.txt", "d");
    symlinkSync(join(envd.userHome, "tree/a.txt"), join(envd.userHome, "tree/link"));
    const one = await sbx.files.list("tree");
    expect(one.map((e) => e.name)).toEqual(["a.txt", "b", "link"]);
    const link = one.find((e) => e.name === "link")!;
    expect([link.type, link.symlinkTarget]).toEqual(["file", join(envd.userHome, "tree/a.txt")] as never);
    const deep = await sbx.files.list("tree", { depth: 3 });
    expect(deep.map((e) => e.path.slice(join(envd.userHome, "tree").length + 1))).toEqual(["a.txt", "b", "b/c", "b/c/d.txt", "link"]);
  });

  test("makeDir, rename, remove", async () => {
    expect(await sbx.files.makeDir("mk/sub")).toBe(true);
    expect(await sbx.files.makeDir("mk/sub")).toBe(false);
    await sbx.files.write("mk/sub/f.txt", "f");
    const moved = await sbx.files.rename("mk/sub/f.txt", "mk/other/g.txt");
    expect(moved.path).toBe(join(envd.userHome, "mk/other/g.txt"));
    expect(await sbx.files.exists("mk/sub/f.txt")).toBe(false);
    await expect(sbx.files.rename("mk/none", "mk/x")).rejects.toBeInstanceOf(FileNotFoundError);
    await sbx.files.remove("mk");
    await sbx.files.remove("mk"); // idempotent
    expect(await sbx.files.exists("mk")).toBe(false);
    expect(() => lstatSync(join(envd.userHome, "mk"))).toThrow(/ENOENT/);
  });

  test("watchDir: write, create in a new nested dir, remove", async () => {
    await sbx.files.makeDir("watched");
    await sbx.files.write("watched/f.txt", "1");
    const events: { name: string; type: string }[] = [];
    const handle = await sbx.files.watchDir("watched", (e) => void events.push({ name: e.name, type: e.type }), { recursive: true });
    try {
      await sbx.files.write("watched/f.txt", "2");
      await until(() => events.some((e) => e.name === "f.txt" && e.type === FilesystemEventType.WRITE));
      await sbx.files.makeDir("watched/nested");
      await until(() => events.some((e) => e.name === "nested" && e.type === FilesystemEventType.CREATE));
      await sbx.files.write("watched/nested/g.txt", "g");
      await until(() => events.some((e) => e.name === "nested/g.txt" && e.type === FilesystemEventType.WRITE));
      await sbx.files.remove("watched/f.txt");
      await until(() => events.some((e) => e.name === "f.txt" && e.type === FilesystemEventType.REMOVE));
      // Uploads are staged in temp files and renamed into place: watchers see only the target.
      expect(events.filter((e) => e.name.includes(".envd-"))).toEqual([]);
      const g = events.filter((e) => e.name === "nested/g.txt").map((e) => e.type);
      expect(g).toEqual([FilesystemEventType.CREATE, FilesystemEventType.WRITE]);
    } finally {
      await handle.stop();
    }
  });

  test("watchDir: a tree moved in whole is reported entry by entry (its files predate any watch)", async () => {
    await sbx.files.makeDir("watched2");
    const events: { name: string; type: string }[] = [];
    const handle = await sbx.files.watchDir("watched2", (e) => void events.push({ name: e.name, type: e.type }), { recursive: true });
    try {
      const tmp = `/tmp/aenv-watch-${process.pid}`;
      await sbx.commands.run(`rm -rf ${tmp} && mkdir -p ${tmp}/deep && echo x > ${tmp}/deep/h.txt && mv ${tmp} ~/watched2/moved`);
      await until(() => events.some((e) => e.name === "moved/deep/h.txt" && e.type === FilesystemEventType.CREATE));
      const names = events.map((e) => e.name);
      expect(names.indexOf("moved")).toBeLessThan(names.indexOf("moved/deep"));
      expect(names.indexOf("moved/deep")).toBeLessThan(names.indexOf("moved/deep/h.txt"));
      // The moved-in tree is watched too.
      await sbx.files.write("watched2/moved/deep/later.txt", "l");
      await until(() => events.some((e) => e.name === "moved/deep/later.txt" && e.type === FilesystemEventType.WRITE));
    } finally {
      await handle.stop();
    }
  });

  test("watchDir on a missing dir or a file fails", async () => {
    await expect(sbx.files.watchDir("no-such-dir", () => {})).rejects.toBeInstanceOf(FileNotFoundError);
    await sbx.files.write("plain.txt", "p");
    const err = await sbx.files.watchDir("plain.txt", () => {}).catch((e) => e);
    expect(err).toBeInstanceOf(InvalidArgumentError);
    expect(err.message).toContain("is not a directory");
  });
});

describe("pty", () => {
  test("create, sendInput, output, resize, exit code", async () => {
    let out = "";
    const dec = new TextDecoder();
    const h = await sbx.pty.create({ cols: 80, rows: 24, onData: (d) => void (out += dec.decode(d, { stream: true })), envs: { FOO: "bar" } });
    await sbx.pty.sendInput(h.pid, new TextEncoder().encode("echo pty-$FOO; tty; echo pid=$$\n"));
    await until(() => out.includes(`pid=${h.pid}`), "the shell reporting the pid envd gave");
    await until(() => out.includes("pty-bar") && out.includes("/dev/pts/"));
    await sbx.pty.resize(h.pid, { cols: 100, rows: 30 });
    await sbx.pty.sendInput(h.pid, new TextEncoder().encode("tput cols\n"));
    await until(() => /\b100\r?\n/.test(out));
    await sbx.pty.sendInput(h.pid, new TextEncoder().encode("exit\n"));
    const r = await h.wait();
    expect(r.exitCode).toBe(0);
  });

  test("disconnect and reconnect", async () => {
    let first = "";
    let second = "";
    const h = await sbx.pty.create({ cols: 80, rows: 24, envs: { FOO: "bar" }, onData: (d) => void (first += new TextDecoder().decode(d)) });
    await sbx.pty.sendInput(h.pid, new TextEncoder().encode("echo one-$FOO\n"));
    await until(() => first.includes("one-bar"));
    await h.disconnect();
    const again = await sbx.pty.connect(h.pid, { onData: (d) => void (second += new TextDecoder().decode(d)) });
    await sbx.pty.sendInput(h.pid, new TextEncoder().encode("echo two-$FOO\nexit\n"));
    expect((await again.wait()).exitCode).toBe(0);
    expect(second).toContain("two-bar");
  });

  test("kill", async () => {
    const h = await sbx.pty.create({ cols: 80, rows: 24, onData: () => {} });
    await until(() => existsSync(`/proc/${h.pid}`), "the pty's shell running");
    expect(await sbx.pty.kill(h.pid)).toBe(true);
    await expect(h.wait()).rejects.toBeInstanceOf(CommandExitError);
    await until(() => !existsSync(`/proc/${h.pid}`), "the killed shell reaped");
  });
});

describe("secured envd (access token)", () => {
  test("token required for RPC and files; signed URLs work", async () => {
    const secured = await startEnvd();
    try {
      const token = "0tQG31xiMp0IOQfaz9dcwi72L1CPo8e0";
      const res = await fetch(`${secured.url}/init`, { method: "POST", body: JSON.stringify({ accessToken: token }) });
      expect(res.status).toBe(204);
      const anon = await sdkSandbox(secured);
      await expect(anon.commands.run("true")).rejects.toBeInstanceOf(AuthenticationError);
      const s = await sdkSandbox(secured, token);
      expect((await s.commands.run("echo secure")).stdout).toBe("secure\n");
      await s.files.write("hello.txt", "hello world");
      const url = await s.downloadUrl("hello.txt", { useSignatureExpiration: 10_000 });
      const got = await fetch(url);
      expect([got.status, await got.text()]).toEqual([200, "hello world"]);
      const expired = await fetch(await s.downloadUrl("hello.txt", { useSignatureExpiration: -10_000 }));
      expect([expired.status, await expired.json()]).toEqual([401, { code: 401, message: "signature is already expired" }]);
      const form = new FormData();
      form.append("file", "uploaded");
      const up = await fetch(await s.uploadUrl("up.txt"), { method: "POST", body: form });
      expect([up.status, await up.json()]).toEqual([200, [{ name: "up.txt", path: join(secured.userHome, "up.txt"), type: "file" }]]);
    } finally {
      await secured.stop();
    }
  }, 20_000);
});
