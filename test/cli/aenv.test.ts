// The aenv CLI's node verbs run as a user runs them: a real process (in a pseudo-terminal for the
// interactive shells, piped otherwise) against a real `bun run node` with its base template.
import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { chmodSync, mkdirSync, readdirSync, readFileSync, statSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { apiKeyPath } from "../../src/node/config.ts";
import { progressBar } from "../../src/cli/template.ts";
import { scratchDir, sha256 } from "../helpers/tmp.ts";
import { FIRST_START_MS, nodeSetup, nodeSkipReason, startNode, stopNode, until, type NodeProc } from "../node/harness.ts";
import { RegistryClient } from "../../src/template/registry.ts";
import { BUSYBOX_CONFIG, busyboxRoot, overlaybdLayerOf, pushImage, pushOverlaybdImage, registrySkipReason, registrySuite } from "../template/registry_harness.ts";

const AENV = join(import.meta.dir, "../../src/cli/aenv.ts");
/** A CLI call that hangs is killed after this long and fails its test, instead of hanging it. */
const HANG_MS = 240_000;
const skip = nodeSkipReason();
/** The template-build routes the pull and build verbs call (another part of the node). */
const API_DIR = join(import.meta.dir, "../../src/api");
const buildApi = readdirSync(API_DIR).some((f) => f.endsWith(".ts") && readFileSync(join(API_DIR, f), "utf8").includes("/v3/templates"));

const cliHome = scratchDir("cli-home");
/** The CLI's environment: a HOME of its own (credentials), no node settings unless a test adds them. */
function cliEnv(extra: Record<string, string | undefined> = {}): Record<string, string | undefined> {
  const env: Record<string, string | undefined> = { PATH: process.env.PATH, HOME: cliHome, TERM: "xterm", ...extra };
  for (const k of Object.keys(env)) if (env[k] === undefined) delete env[k];
  return env;
}

interface Run { code: number | null; out: string; err: string }

async function aenv(args: string[], o: { env?: Record<string, string | undefined>; stdin?: string | Uint8Array } = {}): Promise<Run> {
  const p = Bun.spawn([process.execPath, AENV, ...args], {
    env: o.env ?? cliEnv(),
    stdin: o.stdin === undefined ? "ignore" : new Blob([o.stdin]),
    stdout: "pipe",
    stderr: "pipe",
    timeout: HANG_MS,
  });
  const [out, err] = await Promise.all([new Response(p.stdout).text(), new Response(p.stderr).text()]);
  return { code: await p.exited, out, err };
}

/** A port nothing listens on: taken from the kernel, then let go. */
function closedPort(): number {
  const s = Bun.listen({ hostname: "127.0.0.1", port: 0, socket: { data() {} } });
  const port = s.port;
  s.stop(true);
  return port;
}

describe("aenv without a node", () => {
  test("pull progress from the node's log lines as a bar with the download rate; other lines are not bars", () => {
    expect(progressBar("pull layers: 1/4 layers (1 cached), 10.0/40.0 MiB, 12.5 MiB/s", 8)).toBe("[##......] layers: 1/4 layers (1 cached), 10.0/40.0 MiB, 12.5 MiB/s");
    expect(progressBar("pull layers: 1/4 layers (1 cached), 10.0/40.0 MiB", 8)).toBe("[##......] layers: 1/4 layers (1 cached), 10.0/40.0 MiB");
    expect(progressBar("pull done: 4/4 layers (1 cached), 40.0/40.0 MiB", 8)).toStartWith("[########] done");
    expect(progressBar("pull resolving: 0/0 layers (0 cached), 0.0/0.0 MiB", 4)).toStartWith("[....] resolving");
    expect(progressBar("FROM image x")).toBeUndefined();
  });

  const verbs = ["auth", "push", "pull", "build", "start", "cn", "exec", "cp", "ls", "pause", "resume", "timeout", "rm", "fork", "logs",
    "template ls", "template rm", "snapshot create", "snapshot ls", "snapshot rm"];

  test("--help on every verb: its usage on stdout, exit 0", async () => {
    for (const v of verbs) {
      const r = await aenv([...v.split(" "), "--help"]);
      expect({ v, code: r.code, err: r.err }).toEqual({ v, code: 0, err: "" });
      expect(r.out.startsWith(`usage: aenv ${v} `)).toBe(true);
      expect(r.out).toContain("--url URL");
    }
    const top = await aenv(["--help"]);
    expect(top.code).toBe(0);
    for (const v of verbs) expect(top.out).toContain(`aenv ${v}`);
    expect((await aenv(["help", "snapshot", "create"])).out.startsWith("usage: aenv snapshot create ")).toBe(true);
  }, HANG_MS);

  test("usage errors exit 2 with the verb's usage", async () => {
    for (const args of [["timeout", "abc"], ["fork", "abc", "-n", "0"], ["exec", "abc"], ["snapshot"], ["ls", "--bogus"], ["cp", "a", "b"], ["exec", "NOT-AN-ID", "--", "true"]]) {
      const r = await aenv([...args, "--url", "http://127.0.0.1:1", "--api-key", "k".repeat(40)]);
      expect({ args, code: r.code }).toEqual({ args, code: 2 });
      expect(r.err).toMatch(/^aenv: UsageError: /);
    }
  }, HANG_MS);

  test("a node that is not there: one line naming --url / AENV_URL; no key: one line naming aenv auth", async () => {
    const url = `http://127.0.0.1:${closedPort()}`;
    for (const args of [["ls"], ["exec", "abc", "--", "true"], ["template", "ls"], ["rm", "abc"]]) {
      const r = await aenv(args, { env: cliEnv({ AENV_URL: url, AENV_API_KEY: "k".repeat(40) }) });
      expect({ args, code: r.code, err: r.err }).toEqual({ args, code: 1, err: `aenv: Unreachable: cannot reach the node at ${url}: is \`bun run node\` running? (--url / AENV_URL)\n` });
    }
    const nokey = await aenv(["ls", "--url", "http://10.255.255.1:3000"]);
    expect(nokey.code).toBe(1);
    expect(nokey.err).toBe("aenv: NoApiKey: no API key for http://10.255.255.1:3000: run `aenv auth` (or pass --api-key / set AENV_API_KEY)\n");
  }, HANG_MS);
});

describe.skipIf(!!skip)("aenv against bun run node", () => {
  if (skip) return void test.skip(skip!, () => {});
  // The node generates its key (no AENV_API_KEY): the CLI finds it through AENV_HOME as a local user would.
  // The registry of the build verbs starts after the node, on a port the node cannot know: every port of loopback is listed.
  const setup = nodeSetup("acl", 221, "", { AENV_API_KEY: "", AENV_INSECURE_REGISTRIES: "127.0.0.1" });
  let node: NodeProc;
  let key = "";
  /** The CLI on this machine next to the node: AENV_HOME tells it where the node's key is. */
  const local = (extra: Record<string, string | undefined> = {}) => cliEnv({ AENV_URL: node.base, AENV_HOME: setup.home, ...extra });
  const run = (args: string[], o: { stdin?: string | Uint8Array; env?: Record<string, string | undefined> } = {}) => aenv(args, { env: o.env ?? local(), stdin: o.stdin });
  const ok = async (args: string[], o: { stdin?: string | Uint8Array } = {}) => {
    const r = await run(args, o);
    if (r.code !== 0) throw new Error(`aenv ${args.join(" ")} → ${r.code}: ${r.err}`);
    return r;
  };
  const listed = async () => JSON.parse((await ok(["ls"])).out) as { sandboxId: string; state: string; endAt: string }[];
  let id = "";

  beforeAll(async () => {
    node = await startNode(setup.env, FIRST_START_MS);
    key = readFileSync(apiKeyPath(setup.home), "utf8").trim();
  }, FIRST_START_MS + 60_000);

  afterAll(() => stopNode(node, setup, key), 180_000);

  test("auth checks the key against the node before saving it; later verbs use the saved URL and key", async () => {
    const home = scratchDir("cli-auth-home"); // its own HOME: the other tests find the key through AENV_HOME
    const env = cliEnv({ HOME: home });
    const creds = join(home, ".config/aenv/credentials");
    const bad = await aenv(["auth", "--url", node.base, "--api-key", "e2b_" + "0".repeat(40)], { env });
    expect(bad.code).toBe(1);
    expect(bad.err).toContain(`the node at ${node.base} refused this API key: nothing saved`);
    expect(await Bun.file(creds).exists()).toBe(false);
    // Asked for on stdin (not a terminal here): the URL comes from the flag, the key from the answer.
    const good = await aenv(["auth", "--url", `${node.base}/`], { env, stdin: `${key}\n` });
    expect(good.code).toBe(0);
    expect(statSync(creds).mode & 0o777).toBe(0o600);
    expect(Bun.TOML.parse(readFileSync(creds, "utf8"))).toEqual({ url: node.base, api_key: key });
    const r = await aenv(["ls", "--json"], { env }); // neither AENV_URL nor a key: the saved ones
    expect({ code: r.code, err: r.err }).toEqual({ code: 0, err: "" });
    expect(JSON.parse(r.out)).toBeArray();
  }, HANG_MS);

  test("auth on a terminal: the key is asked for and not echoed", async () => {
    const home = scratchDir("cli-auth-tty");
    const t = inTerminal(["auth"], cliEnv({ HOME: home, AENV_URL: node.base }));
    await t.waitFor(/node URL \[.*\]: $/, "the URL question");
    t.type("\r"); // the default shown: AENV_URL
    await t.waitFor(/API key( \[from .*\])?: $/, "the key question");
    t.type(`${key}\r`);
    expect(await t.exited).toBe(0);
    expect(t.output()).not.toContain(key);
    expect(Bun.TOML.parse(readFileSync(join(home, ".config/aenv/credentials"), "utf8"))).toEqual({ url: node.base, api_key: key });
  }, HANG_MS);

  test("a key the node refuses: one line naming aenv auth", async () => {
    const r = await run(["ls"], { env: local({ AENV_API_KEY: "e2b_" + "1".repeat(40) }) });
    expect(r.code).toBe(1);
    expect(r.err).toBe("aenv: KeyRefused: the node refused the API key (from AENV_API_KEY): run `aenv auth`\n");
  }, HANG_MS);

  test("start -d prints the ID; ls piped is JSON with it running", async () => {
    id = (await ok(["start", "-d", "base", "--timeout", "900"])).out.trim();
    expect(id).toMatch(/^[a-z0-9]+$/);
    const mine = (await listed()).find((s) => s.sandboxId === id);
    expect(mine?.state).toBe("running");
    const asked = JSON.parse((await ok(["ls", "--json", "--state", "running"])).out) as { sandboxId: string }[];
    expect(asked.map((s) => s.sandboxId)).toContain(id);
  }, HANG_MS);

  test("exec: stdout and stderr stream apart, the command's exit code is aenv's; -i forwards stdin", async () => {
    const r = await run(["exec", id, "--", "echo out; echo err >&2; exit 3"]);
    expect(r).toEqual({ code: 3, out: "out\n", err: "err\n" });
    const words = await run(["exec", id, "--", "printf", "'%s|'", "a b", "c"]);
    expect(words).toEqual({ code: 0, out: "a|b|c|", err: "" });
    expect(await run(["exec", "-i", id, "--", "wc -c"], { stdin: "12345" })).toEqual({ code: 0, out: "5\n", err: "" });
    expect((await run(["exec", "--user", "root", "--cwd", "/tmp", id, "--", "id -u; pwd"])).out).toBe("0\n/tmp\n");
    // Ctrl-C on aenv ends the command in the sandbox too.
    const p = Bun.spawn([process.execPath, AENV, "exec", id, "--", "echo started; exec sleep 7777"], { env: local(), stdout: "pipe", stderr: "pipe", timeout: HANG_MS });
    const reader = (p.stdout as ReadableStream<Uint8Array>).getReader();
    expect(new TextDecoder().decode((await reader.read()).value)).toBe("started\n");
    p.kill("SIGINT");
    expect(await p.exited).toBe(130);
    expect((await run(["exec", id, "--", "pgrep -x sleep || echo none"])).out).toBe("none\n");
  }, HANG_MS);

  test("cp in and out: a binary file, stdin/stdout, a directory tree", async () => {
    const dir = scratchDir("cli-cp");
    const blob = new Uint8Array(3 << 20);
    crypto.getRandomValues(blob.subarray(0, 65536));
    for (let i = 65536; i < blob.length; i += 65536) blob.set(blob.subarray(0, 65536), i);
    blob[blob.length - 1] = 7;
    writeFileSync(join(dir, "blob.bin"), blob);
    await ok(["cp", join(dir, "blob.bin"), `${id}:/tmp/blob.bin`]);
    expect((await ok(["exec", id, "--", "sha256sum /tmp/blob.bin | cut -c1-64"])).out.trim()).toBe(sha256(blob));
    await ok(["cp", `${id}:/tmp/blob.bin`, join(dir, "back.bin")]);
    expect(sha256(readFileSync(join(dir, "back.bin")))).toBe(sha256(blob));
    await ok(["cp", "-", `${id}:/tmp/from-stdin`], { stdin: "piped in" });
    expect((await ok(["cp", `${id}:/tmp/from-stdin`, "-"])).out).toBe("piped in");

    const tree = join(dir, "tree");
    mkdirSync(join(tree, "a/b"), { recursive: true });
    mkdirSync(join(tree, "empty"));
    writeFileSync(join(tree, "top.txt"), "top");
    writeFileSync(join(tree, "a/b/deep.txt"), "deep");
    await ok(["exec", id, "--", "mkdir -p /tmp/into"]);
    await ok(["cp", tree, `${id}:/tmp/into`]); // an existing directory receives it under its name
    expect((await ok(["exec", id, "--", "cd /tmp/into/tree && find . | sort"])).out).toBe(".\n./a\n./a/b\n./a/b/deep.txt\n./empty\n./top.txt\n");
    await ok(["exec", id, "--", "chmod 755 /tmp/into/tree/top.txt"]);
    await ok(["cp", `${id}:/tmp/into/tree`, join(dir, "out")]);
    const files = (d: string): string[] => readdirSync(d, { recursive: true }).map(String).sort();
    expect(files(join(dir, "out"))).toEqual(files(tree));
    expect(readFileSync(join(dir, "out/a/b/deep.txt"), "utf8")).toBe("deep");
    expect(statSync(join(dir, "out/top.txt")).mode & 0o777).toBe(0o755);
  }, HANG_MS);

  test("timeout sets the TTL from now; pause, then resume with --timeout", async () => {
    await ok(["timeout", id, "1800"]);
    const endAt = Date.parse((await listed()).find((s) => s.sandboxId === id)!.endAt);
    expect(endAt).toBeGreaterThan(Date.now() + 1500_000);
    await ok(["exec", id, "--", "echo kept > /tmp/kept"]);
    await ok(["pause", id]);
    expect((await listed()).find((s) => s.sandboxId === id)?.state).toBe("paused");
    const again = await run(["pause", id]);
    expect(again.code).toBe(0);
    expect(again.err).toBe(`aenv: sandbox ${id} was already paused\n`);
    await ok(["resume", "--timeout", "900", id]);
    expect((await listed()).find((s) => s.sandboxId === id)?.state).toBe("running");
    expect((await ok(["exec", id, "--", "cat /tmp/kept"])).out).toBe("kept\n");
  }, HANG_MS);

  test("fork -n 2 prints two children that have the source's files", async () => {
    await ok(["exec", id, "--", "echo parent > /tmp/who"]);
    const kids = (await ok(["fork", id, "-n", "2"])).out.trim().split("\n");
    expect(kids.length).toBe(2);
    expect(new Set([...kids, id]).size).toBe(3);
    for (const k of kids) expect((await ok(["exec", k, "--", "cat /tmp/who"])).out).toBe("parent\n");
    await ok(["rm", ...kids]);
    const ids = (await listed()).map((s) => s.sandboxId);
    for (const k of kids) expect(ids).not.toContain(k);
  }, HANG_MS);

  test("snapshot create, ls, start from it, rm", async () => {
    await ok(["exec", id, "--", "echo snapped > /tmp/snap.txt"]);
    const snap = (await ok(["snapshot", "create", id, "--name", `cli-${setup.tag}`])).out.trim();
    const all = JSON.parse((await ok(["snapshot", "ls", "--sandbox", id])).out) as { snapshotId: string; names: string[] }[];
    expect(all.map((s) => s.snapshotId)).toContain(snap);
    const child = (await ok(["start", "-d", snap])).out.trim();
    expect((await ok(["exec", child, "--", "cat /tmp/snap.txt"])).out).toBe("snapped\n");
    await ok(["rm", child]);
    await ok(["snapshot", "rm", snap]);
    const gone = await run(["snapshot", "rm", snap]);
    expect(gone.code).toBe(1);
    expect(gone.err).toBe(`aenv: NotFound: no snapshot ${snap} on ${node.base}: \`aenv snapshot ls\` lists them\n`);
  }, HANG_MS);

  test("logs and template ls answer; an unknown template is named", async () => {
    const logs = await ok(["logs", "--json", id]);
    expect(JSON.parse(logs.out)).toBeArray();
    const templates = JSON.parse((await ok(["template", "ls"])).out) as { templateID: string; aliases: string[] }[];
    expect(templates.some((t) => t.aliases.includes("base"))).toBe(true);
    const line = `aenv: NotFound: no template nosuchtemplate on ${node.base}: \`aenv template ls\` lists them\n`;
    for (const args of [["template", "rm", "nosuchtemplate"], ["start", "-d", "nosuchtemplate"]]) {
      const r = await run(args);
      expect({ args, code: r.code, err: r.err }).toEqual({ args, code: 1, err: line });
    }
  }, HANG_MS);

  /** aenv in a pseudo-terminal: what it printed so far, keystrokes, a resize, its exit code. */
  function inTerminal(args: string[], env = local()) {
    let out = "";
    const dec = new TextDecoder();
    const proc = Bun.spawn([process.execPath, AENV, ...args], {
      env,
      terminal: { cols: 100, rows: 30, data: (_t, d) => void (out += dec.decode(d, { stream: true })) },
    });
    const killer = setTimeout(() => proc.kill(), HANG_MS);
    return {
      output: () => out,
      waitFor: async (re: RegExp, what: string) => {
        await until(() => re.test(out), 120_000, what).catch((e) => {
          throw new Error(`${(e as Error).message}; the terminal shows ${JSON.stringify(out.slice(-400))}`);
        });
      },
      type: (s: string) => proc.terminal!.write(s),
      resize: (cols: number, rows: number) => proc.terminal!.resize(cols, rows),
      exited: proc.exited.finally(() => clearTimeout(killer)),
    };
  }

  test("start: an interactive shell in a PTY, resized with the terminal; exit ends aenv with its code and kills the sandbox", async () => {
    const t = inTerminal(["start", "base"]);
    await t.waitFor(/aenv: sandbox ([a-z0-9]+) from base/, "the sandbox line");
    const started = /aenv: sandbox ([a-z0-9]+) from base/.exec(t.output())![1]!;
    await t.waitFor(/[$#] $/m, "a prompt");
    t.type("echo hi-$((40+2)); tty\r");
    // The terminal's ONLCR turns the shell's \r\n into \r\r\n: aenv leaves output processing as it is.
    await t.waitFor(/hi-42\r*\n\/dev\/pts\//, "the command's output");
    t.resize(120, 40);
    // SIGWINCH, then the resize RPC: ask the guest's terminal until it answers with the new size.
    for (let asked = 1; ; asked++) {
      const mark = t.output().length;
      t.type("stty size\r");
      await until(() => /\d+ \d+\r*\n/.test(t.output().slice(mark)), 30_000, "an answer to stty size");
      if (/40 120/.test(t.output().slice(mark))) break;
      if (asked === 50) throw new Error(`the guest never saw 120x40; the terminal shows ${JSON.stringify(t.output().slice(-400))}`);
      await Bun.sleep(100);
    }
    t.type("exit 7\r");
    expect(await t.exited).toBe(7);
    expect((await listed()).map((s) => s.sandboxId)).not.toContain(started);
  }, HANG_MS);

  test("ls on a terminal: a table with the sandbox in it", async () => {
    const t = inTerminal(["ls"]);
    expect(await t.exited).toBe(0);
    expect(t.output()).toMatch(/^ID +TEMPLATE +STATE +STARTED +ENDS +CPU +MEM MiB +METADATA\r?$/m);
    expect(t.output()).toMatch(new RegExp(`^${id} +base +running `, "m"));
  }, HANG_MS);

  test("cn into a paused sandbox resumes it; exit leaves it running", async () => {
    await ok(["pause", id]);
    const t = inTerminal(["cn", id]);
    await t.waitFor(/[$#] $/m, "a prompt");
    t.type("tr a-z A-Z < /tmp/kept; exit\r");
    await t.waitFor(/KEPT/, "the file");
    expect(await t.exited).toBe(0);
    expect((await listed()).find((s) => s.sandboxId === id)?.state).toBe("running");
  }, HANG_MS);

  test("rm; then the ID is unknown: one line naming aenv ls", async () => {
    await ok(["rm", id]);
    const line = `aenv: NotFound: no sandbox ${id} on ${node.base}: \`aenv ls\` lists them\n`;
    for (const args of [["rm", id], ["exec", id, "--", "true"], ["pause", id], ["resume", id], ["timeout", id, "60"], ["cp", `${id}:/etc/hostname`, "-"],
      ["cn", id], ["fork", id], ["logs", id], ["snapshot", "create", id]]) {
      const r = await run(args);
      expect({ args, code: r.code, err: r.err }).toEqual({ args, code: 1, err: line });
    }
  }, HANG_MS);

  // pull and build: a busybox image in a registry on loopback (/bin/bash hands over to busybox's sh,
  // since commands run in bash), made into a template by `aenv pull` and built on by `aenv build`.
  const noBuilds = !buildApi ? "the node has no template-build API (POST /v3/templates)" : registrySkipReason();
  const registry = noBuilds ? undefined : registrySuite("cli-registry");
  let image = "";
  test.skipIf(!!noBuilds)(`pull IMAGE --name N: the build's log streams; sandboxes get the image's Env and WorkingDir${noBuilds ? ` (skipped: ${noBuilds})` : ""}`, async () => {
    const root = await busyboxRoot(join(scratchDir("cli-image"), "root"));
    writeFileSync(join(root, "bin/bash"), '#!/bin/sh\nexec /bin/busybox sh "$@"\n');
    chmodSync(join(root, "bin/bash"), 0o755);
    image = `${registry!().reg.host}/cli/busybox:1`;
    await pushImage(new RegistryClient({ dockerConfigPath: null, insecureRegistries: [registry!().reg.host] }), image, { layers: [root], config: BUSYBOX_CONFIG });
    const name = `cli-pull-${setup.tag}`;
    const r = await ok(["pull", image, "--name", name]);
    expect(r.out).toMatch(/^pull done: 1\/1 layers \(0 cached\), [\d.]+\/[\d.]+ MiB, [\d.]+ MiB\/s$/m);
    expect(r.err).toContain(`aenv: template ${name} (`);
    const sbx = (await ok(["start", "-d", name])).out.trim();
    expect((await ok(["exec", sbx, "--", 'pwd; echo "$FOO"'])).out).toBe("/work\nbar\n");
    await ok(["rm", sbx]);
    const listed = JSON.parse((await ok(["template", "ls", "--json"])).out) as { names?: string[]; aliases?: string[] }[];
    expect(listed.some((t) => [...(t.names ?? []), ...(t.aliases ?? [])].some((n) => n.startsWith(name)))).toBe(true);
    await ok(["template", "rm", name]);
    // On a terminal the pull's progress is one bar redrawn in place, the node's download rate on it.
    const t = inTerminal(["pull", image, "--name", `${name}-tty`]);
    expect(await t.exited).toBe(0);
    expect(t.output()).toMatch(/\r\x1b\[K\[[#.]{30}\] done: 1\/1 layers \(\d+ cached\), [\d.]+\/[\d.]+ MiB, [\d.]+ MiB\/s/);
    await ok(["template", "rm", `${name}-tty`]);
  }, 20 * 60_000);

  /** A template's row in `template ls --json`. */
  const templateRow = async (name: string) => {
    const rows = JSON.parse((await ok(["template", "ls", "--json"])).out) as { aliases?: string[]; diskSizeMB: number; config?: Record<string, unknown> }[];
    const row = rows.find((t) => t.aliases?.includes(name));
    if (!row) throw new Error(`template ${name} is not listed`);
    return row;
  };

  test.skipIf(!!noBuilds)(`pull keeps the image's Entrypoint, Cmd, ExposedPorts and Labels with the template and runs neither; --image-cmd makes them the start command${noBuilds ? ` (skipped: ${noBuilds})` : ""}`, async () => {
    const root = await busyboxRoot(join(scratchDir("cli-image-cmd"), "root"));
    writeFileSync(join(root, "bin/bash"), '#!/bin/sh\nexec /bin/busybox sh "$@"\n');
    chmodSync(join(root, "bin/bash"), 0o755);
    const ref = `${registry!().reg.host}/cli/cmd:1`;
    const cmd = ['echo "ran with $FOO" > /tmp/image-cmd; exec sleep 100000'];
    await pushImage(new RegistryClient({ dockerConfigPath: null, insecureRegistries: [registry!().reg.host] }), ref, {
      layers: [root], config: { ...BUSYBOX_CONFIG, Entrypoint: ["/bin/sh", "-c"], Cmd: cmd, ExposedPorts: { "8080/tcp": {} }, Labels: { "org.example.suite": "cli" } },
    });
    const name = `cli-cmd-${setup.tag}`;
    await ok(["pull", ref, "--name", name]);
    const plain = await templateRow(name);
    expect(plain.config).toMatchObject({ entrypoint: ["/bin/sh", "-c"], cmd, exposed: ["8080/tcp"], labels: { "org.example.suite": "cli" }, env: { FOO: "bar" }, workdir: "/work" });
    expect(plain.config!.startCmd).toBeUndefined();
    const a = (await ok(["start", "-d", name])).out.trim();
    expect((await ok(["exec", a, "--", "cat /tmp/image-cmd 2>/dev/null || echo not run"])).out).toBe("not run\n");
    await ok(["rm", a]);

    expect((await run(["pull", ref, "--name", `${name}-x`, "--image-cmd", "--start-cmd", "true"])).code).toBe(2);
    await ok(["pull", ref, "--name", `${name}-run`, "--image-cmd", "--ready-cmd", "test -e /tmp/image-cmd"]);
    const started = await templateRow(`${name}-run`);
    expect(started.config!.startCmd).toBe(`/bin/sh -c '${cmd[0]}'`);
    const b = (await ok(["start", "-d", `${name}-run`])).out.trim();
    expect((await ok(["exec", b, "--", "cat /tmp/image-cmd"])).out).toBe("ran with bar\n");
    await ok(["rm", b]);
    await ok(["template", "rm", name, `${name}-run`]);
  }, 20 * 60_000);

  test.skipIf(!!noBuilds)(`pull of an overlaybd image: its layer is the template's as it is, the disk its virtual size; a sandbox runs a command from it${noBuilds ? ` (skipped: ${noBuilds})` : ""}`, async () => {
    const work = scratchDir("cli-obd");
    const root = await busyboxRoot(join(work, "root"));
    writeFileSync(join(root, "bin/bash"), '#!/bin/sh\nexec /bin/busybox sh "$@"\n');
    chmodSync(join(root, "bin/bash"), 0o755);
    writeFileSync(join(root, "etc/obd"), "from the overlaybd layer\n");
    const ref = `${registry!().reg.host}/cli/obd:1`;
    await pushOverlaybdImage(new RegistryClient({ dockerConfigPath: null, insecureRegistries: [registry!().reg.host] }), ref, { layers: [await overlaybdLayerOf(root, join(work, "obd.layer"), 512)], config: BUSYBOX_CONFIG });
    const name = `cli-obd-${setup.tag}`;
    await ok(["pull", ref, "--name", name]);
    expect((await templateRow(name)).diskSizeMB).toBe(512);
    const sbx = (await ok(["start", "-d", name])).out.trim();
    expect((await ok(["exec", sbx, "--", 'pwd; echo "$FOO"; cat /etc/obd'])).out).toBe("/work\nbar\nfrom the overlaybd layer\n");
    await ok(["rm", sbx]);
    await ok(["template", "rm", name]);
  }, 20 * 60_000);

  test.skipIf(!!noBuilds)(`build DIR --name N: a Dockerfile's ENV, ARG, WORKDIR, USER, COPY, RUN, LABEL and EXPOSE; a failing RUN fails the build${noBuilds ? ` (skipped: ${noBuilds})` : ""}`, async () => {
    const ctx = scratchDir("cli-build");
    writeFileSync(join(ctx, "a.txt"), "from the context\n");
    writeFileSync(join(ctx, "Dockerfile"), [
      `FROM ${image}`,
      "ENV GREETING=hello",
      "ARG LEVEL=3",
      "USER root",
      "WORKDIR /app",
      "COPY a.txt /app/a.txt",
      'RUN echo "built at level $LEVEL: $GREETING" > /app/built',
      "LABEL org.example.suite=cli",
      "EXPOSE 8080",
      "",
    ].join("\n"));
    const name = `cli-build-${setup.tag}`;
    const r = await ok(["build", ctx, "--name", name]);
    expect(r.err).toContain(`aenv: template ${name} (`);
    const sbx = (await ok(["start", "-d", name])).out.trim();
    // ARG is build-time only: the sandbox has ENV's variable, not ARG's.
    expect((await ok(["exec", sbx, "--", 'pwd; echo "$GREETING ${LEVEL:-unset}"; cat a.txt built'])).out).toBe("/app\nhello unset\nfrom the context\nbuilt at level 3: hello\n");
    await ok(["rm", sbx]);
    // LABEL and EXPOSE do nothing in the VM; they are kept with the template's config.
    expect((await templateRow(name)).config).toMatchObject({ exposed: ["8080"], labels: { "org.example.suite": "cli" }, env: { GREETING: "hello" }, workdir: "/app" });
    await ok(["template", "rm", name]);

    writeFileSync(join(ctx, "Dockerfile"), `FROM ${image}\nUSER root\nWORKDIR /\nRUN echo about to fail; exit 3\n`);
    const bad = await run(["build", join(ctx, "Dockerfile"), "--name", `${name}-bad`]);
    expect(bad.code).toBe(1);
    expect(bad.out).toContain("about to fail");
    // The node's reason names the step and carries its output.
    expect(bad.err).toStartWith("aenv: BuildError: step ");
    expect(bad.err).toContain("exit status 3");
  }, 20 * 60_000);
});
