// The default template, built for real from the Debian archive (mmdebstrap, a minute or two) and
// converted onto the empty ext4 layer through a real blockd, then checked without booting: debugfs
// on a read-only device of its layers for owners and modes, a read-only loop mount and chroot to
// run what it ships. Also the cache: hits, concurrent calls, failures that leave nothing behind,
// damaged entries rebuilt.
import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { existsSync } from "node:fs";
import { mkdir, readdir, rm, truncate, writeFile } from "node:fs/promises";
import { join } from "node:path";
import type { BlockdClient } from "../../src/blockdev/client.ts";
import {
  BASE_TEMPLATE_DIR, buildBaseTemplate, buildTemplate, TemplateBuildError,
  type BuildProgress, type BuiltTemplate,
} from "../../src/template/debian.ts";
import { haveFuse, startBlockd } from "../blockdev/harness.ts";
import { loadDefinition } from "../../src/template/definition.ts";
import { scratchDir } from "../helpers/tmp.ts";

const SBIN = "/usr/local/sbin:/usr/sbin:/sbin";
const haveMmdebstrap = Bun.which("mmdebstrap", { PATH: `${process.env.PATH ?? ""}:${SBIN}` }) !== null;
const isRoot = process.getuid?.() === 0;
const haveLoop = existsSync("/dev/loop-control");
const canBuild = haveMmdebstrap && isRoot && haveFuse && haveLoop;
const why = !haveMmdebstrap ? "mmdebstrap missing (apt-get install mmdebstrap; .ci/run installs it)" : "needs root, /dev/fuse and /dev/loop-control";
/** The suite's name, with the reason when it is skipped. */
const built = (name: string) => (canBuild ? name : `${name} (skipped: ${why})`);
const BUILD_TIMEOUT_MS = 20 * 60_000;

async function sh(argv: string[], stdin?: string): Promise<{ code: number; out: string }> {
  const p = Bun.spawn(argv, { stdin: stdin === undefined ? "ignore" : Buffer.from(stdin), stdout: "pipe", stderr: "pipe", env: { ...process.env, PATH: `${process.env.PATH}:${SBIN}` } });
  const [out, err] = await Promise.all([new Response(p.stdout).text(), new Response(p.stderr).text(), p.exited]);
  return { code: p.exitCode ?? -1, out: out + err };
}

/** `debugfs -R cmd` on a template's file system: a read-only blockd device of its layers. */
async function debugfs(blockd: BlockdClient, t: BuiltTemplate, cmd: string): Promise<string> {
  const dev = await blockd.call("createReadOnly", { lowers: t.layers });
  try {
    const r = await sh(["debugfs", "-R", cmd, dev.path]);
    expect(r.code).toBe(0);
    return r.out;
  } finally {
    await blockd.call("delete", { id: dev.id });
  }
}

/** The virtual disk size of a template's layer stack. */
async function diskBytes(blockd: BlockdClient, t: BuiltTemplate): Promise<number> {
  const dev = await blockd.call("createReadOnly", { lowers: t.layers });
  await blockd.call("delete", { id: dev.id });
  return dev.size;
}

/** Cache entries (not the layer cache, `.layers`, nor build folders). */
async function entriesOf(cacheDir: string): Promise<string[]> {
  return (await readdir(cacheDir)).filter((n) => !n.startsWith("."));
}

function mode(stat: string): string {
  return /Mode:\s+(\d+)/.exec(stat)?.[1] ?? `(no mode in ${stat})`;
}

function owner(stat: string): string {
  const m = /User:\s+(\d+)\s+Group:\s+(\d+)/.exec(stat);
  return m ? `${m[1]}:${m[2]}` : `(no owner in ${stat})`;
}

/** A definition folder: template.json from fields, setup.sh as given. */
async function definition(dir: string, fields: Record<string, unknown>, setup = "#!/bin/bash\nset -e\n"): Promise<string> {
  await mkdir(dir, { recursive: true });
  await writeFile(join(dir, "template.json"), JSON.stringify({
    name: "small", suite: "bookworm", variant: "minbase",
    mirrors: ["deb http://deb.debian.org/debian bookworm main"],
    packages: ["bash"], diskSizeMB: 256, cpuCount: 1, memoryMB: 256, ...fields,
  }));
  await writeFile(join(dir, "setup.sh"), setup);
  return dir;
}

async function buildFolders(cacheDir: string): Promise<string[]> {
  return (await readdir(cacheDir)).filter((n) => n.startsWith(".building-"));
}

/**
 * A scratch folder for a suite, made before its first test and removed after its last: a skipped
 * or filtered-out suite leaves nothing behind (scratchDir at collection time would).
 */
function suiteDir(label: string): () => string {
  let dir: string | undefined;
  beforeAll(() => {
    dir = scratchDir(label, { keep: true });
  });
  afterAll(async () => {
    if (dir) await rm(dir, { recursive: true, force: true });
  });
  return () => dir ?? expect.unreachable(`${label}: used outside its suite`);
}

describe("template definitions", () => {
  const rootOf = suiteDir("template-def");

  test("base's definition loads and has the packages the issue lists", async () => {
    const d = await loadDefinition(BASE_TEMPLATE_DIR);
    for (const p of ["bash", "coreutils", "python3", "python-is-python3", "nodejs", "npm", "sudo", "curl", "git", "ncurses-bin", "procps", "iproute2", "ca-certificates"]) {
      expect(d.definition.packages).toContain(p);
    }
    expect(d.definition.suite).toBe("bookworm");
    expect(d.key).toMatch(/^[0-9a-f]{64}$/);
  });

  test("the key follows setup.sh and template.json, and nothing else", async () => {
    const a = await loadDefinition(await definition(join(rootOf(), "a"), {}));
    const b = await loadDefinition(await definition(join(rootOf(), "b"), {}));
    const c = await loadDefinition(await definition(join(rootOf(), "c"), {}, "#!/bin/bash\nset -e\ntrue\n"));
    const d = await loadDefinition(await definition(join(rootOf(), "d"), { memoryMB: 512 }));
    expect(a.key).toBe(b.key);
    expect(new Set([a.key, c.key, d.key]).size).toBe(3);
  });

  test.each([
    ["not JSON", {}, "{", /not JSON/],
    ["an unknown key", {}, JSON.stringify({ name: "x", extra: 1 }), /unknown key "extra"/],
    ["a package with a space", { packages: ["bad name"] }, null, /packages entry "bad name"/],
    ["a disk below 256 MiB", { diskSizeMB: 16 }, null, /diskSizeMB/],
  ] as const)("a definition with %s is BadDefinition at step resolving", async (label, fields, json, message) => {
    const dir = await definition(join(rootOf(), label.replaceAll(" ", "-")), fields);
    if (json !== null) await writeFile(join(dir, "template.json"), json);
    // The definition fails before anything needs blockd.
    const err = await buildTemplate({ definitionDir: dir, cacheDir: join(rootOf(), "cache"), blockd: null as unknown as BlockdClient }).catch((e) => e);
    expect(err).toBeInstanceOf(TemplateBuildError);
    expect(err.code).toBe("BadDefinition");
    expect(err.step).toBe("resolving");
    expect(err.message).toMatch(message);
  });

  test("a missing setup.sh is BadDefinition", async () => {
    const dir = await definition(join(rootOf(), "nosetup"), {});
    await Bun.file(join(dir, "setup.sh")).delete();
    const err = await loadDefinition(dir).catch((e) => e);
    expect(err).toBeInstanceOf(TemplateBuildError);
    expect(err.code).toBe("BadDefinition");
    expect(err.message).toContain("setup.sh does not exist");
  });
});

describe.skipIf(!canBuild)(built("base template, built for real"), async () => {
  if (!canBuild) return void test.skip(why, () => {});
  const { client: blockd } = await startBlockd("template-base-blockd");
  const rootOf = suiteDir("template-base");
  const cacheDirOf = () => join(rootOf(), "cache");
  let first: Promise<{ results: BuiltTemplate[]; progress: BuildProgress[][]; ms: number }> | undefined;

  /** Two calls at once on an empty cache: the first build of the file, shared by the tests below. */
  function builtOnce() {
    const cacheDir = cacheDirOf();
    first ??= (async () => {
      const progress: BuildProgress[][] = [[], []];
      const t0 = performance.now();
      const results = await Promise.all([0, 1].map((i) => buildBaseTemplate({ cacheDir, blockd, onProgress: (p) => progress[i]!.push(p) })));
      const ms = performance.now() - t0;
      console.log(`base template built in ${(ms / 1000).toFixed(1)} s: ${JSON.stringify(progress[0]!.filter((p) => p.bytes !== undefined))}`);
      return { results, progress, ms };
    })();
    return first;
  }

  test("two concurrent first calls build once: one built, one joined, same files, one cache entry", async () => {
    const { results, progress } = await builtOnce();
    expect(results.map((r) => r.source).sort()).toEqual(["built", "joined"]);
    const [a, b] = results;
    expect(b!.layers).toEqual(a!.layers);
    expect(a!.layers.length).toBe(2); // the empty ext4 layer, the root's files
    expect(a!.key).toBe((await loadDefinition(BASE_TEMPLATE_DIR)).key);
    expect({ cpu: a!.cpuCount, mem: a!.memoryMB, disk: a!.diskSizeMB }).toEqual({ cpu: 2, mem: 512, disk: 2048 });
    // The steps in order, each once, with sizes for the image and the layer.
    const builder = progress[results.findIndex((r) => r.source === "built")]!;
    const steps = builder.map((p) => p.step).filter((s, i, all) => all.indexOf(s) === i);
    expect(steps).toEqual(["resolving", "bootstrap", "setup", "image", "layer"]);
    expect(builder.find((p) => p.step === "layer" && p.bytes)!.bytes).toBeGreaterThan(100 << 20);
    expect(builder.some((p) => p.detail?.startsWith("I: "))).toBe(true);
    expect(builder.map((p) => p.elapsedMs)).toEqual(builder.map((p) => p.elapsedMs).sort((x, y) => x - y));
    // The joined caller heard the rest of the same build.
    expect(progress[results.findIndex((r) => r.source === "joined")]!.some((p) => p.step === "layer")).toBe(true);
    expect(await entriesOf(cacheDirOf())).toEqual([a!.layers[0]!.split("/").at(-2)!]);
    expect(await diskBytes(blockd, a!)).toBe(2048 * 1024 * 1024);
  }, BUILD_TIMEOUT_MS);

  test("the image holds E2B's conventions: user 1000, sudo, modes, profile (debugfs, no boot)", async () => {
    const { results: [t] } = await builtOnce();
    const img = t!;
    const passwd = await debugfs(blockd, img, "cat /etc/passwd");
    expect(passwd).toContain("user:x:1000:1000::/home/user:/bin/bash");
    const shadow = await debugfs(blockd, img, "cat /etc/shadow");
    expect(shadow).toMatch(/^root::/m);
    expect(await debugfs(blockd, img, "cat /etc/group")).toMatch(/^sudo:x:27:user$/m);
    expect(await debugfs(blockd, img, "cat /etc/sudoers.d/user")).toContain("user ALL=(ALL:ALL) NOPASSWD: ALL");
    expect(mode(await debugfs(blockd, img, "stat /etc/sudoers.d/user"))).toBe("0440");
    expect(mode(await debugfs(blockd, img, "stat /usr/local"))).toBe("0777");
    expect(mode(await debugfs(blockd, img, "stat /code"))).toBe("0777");
    expect(owner(await debugfs(blockd, img, "stat /home/user"))).toBe("1000:1000");
    expect(mode(await debugfs(blockd, img, "stat /usr/bin/sudo"))).toBe("04755");
    for (const f of ["/usr/bin/python3.11", "/usr/bin/node", "/usr/bin/git", "/usr/lib/git-core/git-daemon", "/usr/bin/tput", "/usr/bin/ps", "/usr/bin/ip", "/usr/bin/curl", "/usr/bin/bash"]) {
      expect(await debugfs(blockd, img, `stat ${f}`)).toContain("Type: regular");
    }
    expect(await debugfs(blockd, img, "stat /usr/bin/python")).toContain("Type: symlink");
    const profile = await debugfs(blockd, img, "cat /etc/profile");
    expect(profile).toContain("if [ -f ~/.bashrc ]; then . ~/.bashrc; fi; if [ -f ~/.profile ]; then . ~/.profile; fi");
    expect(profile).toContain("export PS1=");
    // Nothing of the build host's: no resolver, no hostname, no apt lists.
    expect((await debugfs(blockd, img, "cat /etc/resolv.conf")).trim()).toMatch(/^(debugfs [^\n]*)?$/);
    expect(await debugfs(blockd, img, "cat /etc/hostname")).toContain("sandbox");
    expect(await debugfs(blockd, img, "ls /var/lib/apt/lists")).not.toContain("_Packages");
  }, BUILD_TIMEOUT_MS);

  const runs = "what it ships runs: python, node, npm, git daemon, tput, sudo as user (read-only mount + chroot, hostname sandbox)";
  test.skipIf(!haveLoop)(haveLoop ? runs : `${runs} (skipped: no /dev/loop-control)`, async () => {
    const { results: [t] } = await builtOnce();
    const mnt = join(rootOf(), "mnt");
    await mkdir(mnt);
    const dev = await blockd.call("createReadOnly", { lowers: t!.layers, loop: true });
    expect((await sh(["mount", "-t", "ext4", "-o", "ro,noload", dev.loop, mnt])).code).toBe(0);
    try {
      // A UTS namespace of its own with the image's hostname, as init sets it in the guest.
      const r = await sh(["unshare", "--uts", "sh", "-c", 'hostname sandbox && exec chroot "$0" /bin/bash -l -s', mnt], [
        "python --version", "node --version", "npm --version", "git daemon -h 2>&1 | grep -c 'usage: git daemon'",
        "tput -T xterm-256color colors", "su user -s /bin/bash -c 'sudo -n id -u; id -nG'",
      ].join("\n"));
      expect(r.code).toBe(0);
      expect(r.out).toMatch(/Python 3\.11\.\d+/);
      expect(r.out).toMatch(/^v\d+\.\d+\.\d+$/m);
      expect(r.out).toMatch(/^1$/m);
      expect(r.out).toMatch(/^256$/m);
      expect(r.out).toMatch(/^0$/m); // sudo as user gave root, without a password
      expect(r.out).toMatch(/^user sudo$/m);
      expect(r.out).not.toContain("unable to resolve host"); // /etc/hosts names the hostname
      expect(r.out).not.toMatch(/command not found|No such file/);
    } finally {
      await sh(["umount", mnt]);
      await blockd.call("delete", { id: dev.id });
    }
  }, BUILD_TIMEOUT_MS);

  test("a second call returns the cached template without building", async () => {
    const { results: [t] } = await builtOnce();
    const progress: BuildProgress[] = [];
    const t0 = performance.now();
    const again = await buildBaseTemplate({ cacheDir: cacheDirOf(), blockd, onProgress: (p) => progress.push(p) });
    console.log(`cache hit in ${(performance.now() - t0).toFixed(0)} ms`);
    expect(again.source).toBe("cache");
    expect(again.layers).toEqual(t!.layers);
    expect(new Set(progress.map((p) => p.step))).toEqual(new Set(["resolving"]));
  }, BUILD_TIMEOUT_MS);

  test("an unknown package fails at bootstrap naming the step and apt's words; no cache entry, no build folder; abandoned folders (mounts included) are swept", async () => {
    const dir = await definition(join(rootOf(), "broken-def"), { packages: ["aenv-no-such-package"] });
    const brokenCache = join(rootOf(), "broken-cache");
    // What a build killed with -9 leaves: its folder, with something still mounted inside.
    const abandoned = join(brokenCache, ".building-999999999-small-0000000000000000-deadbeef");
    await mkdir(join(abandoned, "tree", "proc"), { recursive: true });
    expect((await sh(["mount", "-t", "tmpfs", "tmpfs", join(abandoned, "tree", "proc")])).code).toBe(0);
    await writeFile(join(abandoned, "tree", "proc", "x"), "x");
    const err = await buildTemplate({ definitionDir: dir, cacheDir: brokenCache, blockd }).catch((e) => e);
    expect(err).toBeInstanceOf(TemplateBuildError);
    expect(err.step).toBe("bootstrap");
    expect(err.code).toBe("StepFailed");
    expect(err.message).toContain("step bootstrap");
    expect(err.outputTail).toContain("aenv-no-such-package");
    expect(await readdir(brokenCache)).toEqual([]);
    expect(await Bun.file("/proc/self/mountinfo").text()).not.toContain(abandoned);
  }, BUILD_TIMEOUT_MS);
});

describe.skipIf(!canBuild)(built("a small template (minbase + bash)"), async () => {
  if (!canBuild) return void test.skip(why, () => {});
  const { client: blockd } = await startBlockd("template-small-blockd");
  const rootOf = suiteDir("template-small");
  const cacheDirOf = () => join(rootOf(), "cache");

  test("setup.sh failing fails step setup with its output; nothing is cached", async () => {
    const dir = await definition(join(rootOf(), "failing"), {}, "#!/bin/bash\necho 'setup says: no'\nexit 3\n");
    const err = await buildTemplate({ definitionDir: dir, cacheDir: cacheDirOf(), blockd }).catch((e) => e);
    expect(err).toBeInstanceOf(TemplateBuildError);
    expect(err.step).toBe("setup");
    expect(err.message).toContain("exited 3");
    expect(err.outputTail).toContain("setup says: no");
    expect(await readdir(cacheDirOf())).toEqual([]);
  }, BUILD_TIMEOUT_MS);

  test("a damaged entry (layer cut short) is removed and rebuilt", async () => {
    const dir = await definition(join(rootOf(), "ok"), {}, "#!/bin/bash\nset -e\necho small >/etc/hostname\n");
    const a = await buildTemplate({ definitionDir: dir, cacheDir: cacheDirOf(), blockd });
    expect(a.source).toBe("built");
    expect(await diskBytes(blockd, a)).toBe(256 << 20);
    expect(await debugfs(blockd, a, "cat /etc/hostname")).toContain("small");
    await truncate(a.layers[1]!, 4096);
    const progress: BuildProgress[] = [];
    // The event loop keeps turning while the layer is sealed (the node serves during a build).
    let ticks = 0;
    const ticksAt: Partial<Record<string, number>> = {};
    const ticker = setInterval(() => ticks++, 20);
    const b = await buildTemplate({
      definitionDir: dir, cacheDir: cacheDirOf(), blockd,
      onProgress: (p) => {
        progress.push(p);
        if (p.step === "layer") ticksAt[p.bytes === undefined ? "start" : "end"] = ticks;
      },
    }).finally(() => clearInterval(ticker));
    expect(ticksAt.end! - ticksAt.start!).toBeGreaterThan(0);
    expect(b.source).toBe("built");
    expect(b.layers).toEqual(a.layers);
    expect((await Bun.file(b.layers[1]!).stat()).size).toBeGreaterThan(4096);
    expect(await debugfs(blockd, b, "cat /etc/hostname")).toContain("small");
    expect(progress.some((p) => p.detail?.includes("removing damaged cache entry"))).toBe(true);
    expect(await buildFolders(cacheDirOf())).toEqual([]);
  }, BUILD_TIMEOUT_MS);
});
