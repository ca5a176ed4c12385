// E2B's template build API end to end: the stock e2b SDK's `Template` builder against `bun run
// node`, building from the base template with RUN, ENV, ARG, WORKDIR, COPY, USER and a start and
// ready command; sandboxes from the result; an unchanged rebuild served from the step cache; a
// failing step; bad requests; tags.
import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { chmodSync, existsSync, mkdirSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { BuildError, Sandbox, Template, type LogEntry } from "e2b";
import { scratchDir } from "../helpers/tmp.ts";
import { FIRST_START_MS, nodeSetup, nodeSkipReason, startNode, stopNode, until, type NodeProc } from "./harness.ts";
import { type BuildLogEntry } from "../../src/orchestrator/build_log.ts";
import { BUILDER_DEFAULTS } from "../../src/orchestrator/builder.ts";
import { RegistryClient } from "../../src/template/registry.ts";
import {
  BUSYBOX_CONFIG, busyboxRoot, DEBIAN_CONFIG, debianImageSkipReason, debianMinbaseLayer, pushImage, pushLayerFiles, registrySkipReason, registrySuite,
} from "../template/registry_harness.ts";

const skip = nodeSkipReason();
/** The Debian image needs the registry, and the Debian archive unless its layer is cached. */
const noDebian = skip ?? registrySkipReason() ?? (await debianImageSkipReason());
const KEY = "e2b_" + "7b".repeat(20);
const BUILD_MS = 10 * 60_000;

describe.skipIf(!!skip)("template builds through the API with the e2b SDK", () => {
  if (skip) return void test.skip(skip!, () => {});
  // The registry below starts after the node, on a port the node cannot know: every port of loopback is listed.
  const setup = nodeSetup("tb", 217, KEY, { AENV_INSECURE_REGISTRIES: "127.0.0.1" });
  let node: NodeProc;
  const opts = () => ({ apiKey: KEY, apiUrl: node.base, sandboxUrl: node.base, requestTimeoutMs: 180_000 });
  const api = (path: string, init: RequestInit = {}) =>
    fetch(`${node.base}${path}`, { ...init, headers: { "x-api-key": KEY, "content-type": "application/json", ...init.headers } });
  const name = `tb-${process.pid}`;
  /** `fn` on a new sandbox of `template`, killed after. */
  async function inSandbox(template: string, fn: (sbx: Sandbox) => Promise<unknown>): Promise<void> {
    const sbx = await Sandbox.create(template, opts());
    try {
      await fn(sbx);
    } finally {
      await sbx.kill();
    }
  }

  // The build context: a directory with a file and an executable script in a subdirectory.
  const ctx = scratchDir("template-ctx");
  mkdirSync(join(ctx, "files", "sub"), { recursive: true });
  writeFileSync(join(ctx, "files", "a.txt"), "from the context\n");
  writeFileSync(join(ctx, "files", "sub", "run.sh"), "#!/bin/sh\necho script\n");
  chmodSync(join(ctx, "files", "sub", "run.sh"), 0o755);

  /** The ready command fails its first two polls whatever the server does, and says which poll it is. */
  const READY_CMD = 'n=$(( $(cat /tmp/ready-polls 2>/dev/null || echo 0) + 1 )); echo "$n" > /tmp/ready-polls; echo "ready poll $n"; [ "$n" -ge 3 ] && curl -sf http://127.0.0.1:8080/ >/dev/null';
  function template() {
    const t = Template({ fileContextPath: ctx })
      .fromTemplate("base")
      .setEnvs({ GREETING: "hello from the build" })
      .runCmd('echo "building as $(id -un) in $(pwd): $GREETING"; echo "$GREETING" > /tmp/greeting');
    // ARG has no builder method (fromDockerfile turns ARG into ENV): the step goes in as the API takes it.
    const raw = t as unknown as { instructions: { type: string; args: string[]; force: boolean }[]; collectStackTrace(): void };
    raw.instructions.push({ type: "ARG", args: ["BUILD_ONLY", "arg-value"], force: false });
    raw.collectStackTrace();
    return t
      .runCmd('echo "${BUILD_ONLY}" > /tmp/arg-seen')
      .setWorkdir("/home/user/app")
      .copy("files", "/home/user/app/files")
      .runCmd("touch made-by-root", { user: "root" })
      .setUser("worker")
      .setStartCmd("echo started > /tmp/start-ran; exec python3 -m http.server 8080 --bind 127.0.0.1", READY_CMD);
  }
  const STEPS = 8;

  beforeAll(async () => {
    node = await startNode(setup.env, FIRST_START_MS);
  }, FIRST_START_MS + 60_000);

  afterAll(() => stopNode(node, setup), 180_000);

  test("the routes are in the Swagger document", async () => {
    const doc = (await (await fetch(`${node.base}/swagger/json`)).json()) as { paths: Record<string, unknown> };
    expect(Object.keys(doc.paths)).toEqual(expect.arrayContaining([
      "/v3/templates", "/v2/templates/{templateID}/builds/{buildID}", "/templates/{templateID}/builds/{buildID}/status",
      "/templates/{templateID}/files/{hash}", "/templates/tags", "/templates/{templateID}/tags",
    ]));
  });

  let firstBuild: { templateId: string; buildId: string };
  let firstBuildMs = 0;
  test("a build from base: RUN, ENV, ARG, WORKDIR, COPY, USER, start and ready commands; sandboxes get its env, user, cwd and files", async () => {
    const logs: LogEntry[] = [];
    const t0 = performance.now();
    firstBuild = await Template.build(template(), name, { ...opts(), onBuildLogs: (l) => logs.push(l) });
    firstBuildMs = performance.now() - t0;
    const text = logs.map((l) => l.message).join("\n");
    expect(text).toContain("building as user in /home/user: hello from the build");
    expect(text).toContain("Ready");
    // readyCmd ran until it passed, every 2 s (the builder's default, as its 10-minute cap), its output in the log.
    expect(BUILDER_DEFAULTS).toMatchObject({ readyIntervalMs: 2000, readyTimeoutMs: 10 * 60_000 });
    const polls = logs.filter((l) => /^ready poll \d+$/.test(l.message));
    expect(polls.length).toBeGreaterThanOrEqual(3);
    expect(polls.map((l) => l.message)).toEqual(polls.map((_, i) => `ready poll ${i + 1}`));
    for (let i = 1; i < polls.length; i++) {
      const gap = polls[i]!.timestamp.getTime() - polls[i - 1]!.timestamp.getTime();
      expect(gap).toBeGreaterThanOrEqual(1900);
      expect(gap).toBeLessThan(10_000);
    }
    expect(await Template.exists(name, opts())).toBe(true);

    await inSandbox(name, async (sbx) => {
      const r = await sbx.commands.run('echo "$GREETING"; id -un; pwd; cat files/a.txt; files/sub/run.sh; stat -c "%a %U" files/sub/run.sh files/a.txt made-by-root; cat /tmp/greeting /tmp/arg-seen /tmp/start-ran; echo "arg:${BUILD_ONLY:-unset}"');
      expect(r.stdout).toBe([
        "hello from the build", "worker", "/home/user/app", "from the context", "script",
        "755 user", "644 user", "644 root", "hello from the build", "arg-value", "started", "arg:unset", "",
      ].join("\n"));
      // The start command's server runs in every sandbox: it was running when the template was checkpointed.
      expect((await sbx.commands.run("curl -sf http://127.0.0.1:8080/ >/dev/null && echo up")).stdout).toBe("up\n");
    });
  }, BUILD_MS);

  test("an unchanged rebuild hits the step cache for every step; the template keeps its ID", async () => {
    const logs: LogEntry[] = [];
    const t0 = performance.now();
    const again = await Template.build(template(), name, { ...opts(), onBuildLogs: (l) => logs.push(l) });
    const rebuildMs = performance.now() - t0;
    console.log(`  first build ${Math.round(firstBuildMs)} ms, unchanged rebuild ${Math.round(rebuildMs)} ms (${(rebuildMs / firstBuildMs).toFixed(2)}× the first)`);
    expect(again.templateId).toBe(firstBuild.templateId);
    expect(again.buildId).not.toBe(firstBuild.buildId);
    const cached = logs.map((l) => l.message).filter((m) => m.startsWith("CACHED "));
    expect(cached.length).toBe(STEPS);
    for (let i = 1; i <= STEPS; i++) expect(cached.some((m) => m.startsWith(`CACHED [${i}/${STEPS}]`))).toBe(true);
    expect(logs.some((l) => l.message.includes("building as user"))).toBe(false);
    await inSandbox(name, async (sbx) => {
      expect((await sbx.commands.run("cat files/a.txt; id -un")).stdout).toBe("from the context\nworker\n");
    });
  }, BUILD_MS);

  test("a changed step rebuilds from there on; skipCache rebuilds every step", async () => {
    const logs: LogEntry[] = [];
    const t = Template({ fileContextPath: ctx }).fromTemplate("base").setEnvs({ GREETING: "hello from the build" })
      .runCmd('echo "building as $(id -un) in $(pwd): $GREETING"; echo "$GREETING" > /tmp/greeting')
      .runCmd("head -c 9000 /dev/zero | tr '\\0' x; echo");
    await Template.build(t, `${name}-b`, { ...opts(), onBuildLogs: (l) => logs.push(l) });
    const msgs = logs.map((l) => l.message);
    expect(msgs.filter((m) => m.startsWith("CACHED ")).map((m) => m.slice(0, 12))).toEqual(["CACHED [1/3]", "CACHED [2/3]"]);
    expect(msgs.some((m) => m.startsWith("[3/3] RUN head"))).toBe(true);
    // A 9000-character output line is logged in pieces of at most 4096.
    expect(msgs.filter((m) => /^x+$/.test(m)).map((m) => m.length)).toEqual([4096, 4096, 808]);

    const forced: LogEntry[] = [];
    await Template.build(t, `${name}-b`, { ...opts(), skipCache: true, onBuildLogs: (l) => forced.push(l) });
    expect(forced.some((l) => l.message.startsWith("CACHED "))).toBe(false);
    expect(forced.some((l) => l.message.includes("building as user"))).toBe(true);
  }, BUILD_MS);

  test("a failing RUN: status error naming the step, with its output; nothing is published; the node keeps serving", async () => {
    const t = Template().fromTemplate("base").runCmd("echo fine").runCmd("echo before-the-failure; echo on-stderr >&2; exit 7");
    const err = await Template.build(t, `${name}-fail`, opts()).catch((e) => e);
    expect(err).toBeInstanceOf(BuildError);
    expect(err.message).toContain("step 2");
    expect(err.message).toContain("exit status 7");
    expect(err.message).toContain("before-the-failure");
    expect(err.message).toContain("on-stderr");
    expect(await Template.exists(`${name}-fail`, opts())).toBe(false);
    await inSandbox("base", async (sbx) => expect((await sbx.commands.run("echo ok")).stdout).toBe("ok\n"));
  }, BUILD_MS);

  test("two builds of one name at once: one template ID, both ready, sandboxes get one of the two", async () => {
    const racing = (n: number) => Template().fromTemplate("base").runCmd(`echo ${n} > /tmp/which`);
    const [a, b] = await Promise.all([1, 2].map((n) => Template.build(racing(n), `${name}-race`, opts())));
    expect(a!.templateId).toBe(b!.templateId);
    expect(a!.buildId).not.toBe(b!.buildId);
    await inSandbox(`${name}-race`, async (sbx) => {
      expect(["1\n", "2\n"]).toContain((await sbx.commands.run("cat /tmp/which")).stdout);
    });
  }, BUILD_MS);

  test("bad requests: 400 and 404 with {code, message}", async () => {
    const req = await api("/v3/templates", { method: "POST", body: JSON.stringify({ name: `${name}-bad` }) });
    expect(req.status).toBe(202);
    const { templateID, buildID } = (await req.json()) as { templateID: string; buildID: string };
    const start = (body: unknown, build = buildID) => api(`/v2/templates/${templateID}/builds/${build}`, { method: "POST", body: JSON.stringify(body) });
    const expectError = async (r: Response, status: number, words: string) => {
      expect(r.status).toBe(status);
      const body = (await r.json()) as { code: number; message: string };
      expect(body.code).toBe(status);
      expect(body.message).toContain(words);
    };
    await expectError(await api("/v3/templates", { method: "POST", body: "{}" }), 400, "name");
    await expectError(await start({ fromImage: "debian:bookworm", fromTemplate: "base", steps: [] }), 400, "exactly one");
    await expectError(await start({ steps: [] }), 400, "exactly one");
    await expectError(await start({ fromTemplate: "no-such-template", steps: [] }), 404, "no-such-template");
    await expectError(await start({ fromImage: "x", fromImageRegistry: { type: "aws", awsAccessKeyId: "a", awsSecretAccessKey: "b", awsRegion: "c" } }), 400, "aws");
    await expectError(await start({ fromTemplate: "base", steps: [{ type: "FROB", args: [] }] }), 400, "type");
    await expectError(await start({ fromTemplate: "base", imageCmd: true }), 400, "imageCmd goes with fromImage");
    await expectError(await start({ fromImage: "x", imageCmd: true, startCmd: "true" }), 400, "imageCmd or startCmd");
    await expectError(await start({ fromTemplate: "base", steps: [{ type: "COPY", args: ["a", "/b"], filesHash: "0".repeat(64) }] }), 400, "not uploaded");
    await expectError(await start({ fromTemplate: "base", steps: [] }, "00000000-0000-0000-0000-000000000000"), 404, "not found");
    await expectError(await api(`/templates/${templateID}/builds/${buildID}x/status`), 404, "not found");
    await expectError(await api(`/templates/${templateID}/files/nothex`), 400, "hash");
    await expectError(await api(`/templates/nosuchtemplate/files/${"a".repeat(64)}`), 404, "not found");
    // The upload URL is signed and expires: a PUT without its signature and expiry is refused.
    await expectError(await fetch(`${node.base}/templates/${templateID}/files/${"a".repeat(64)}?signature=bad`, { method: "PUT", body: "x" }), 403, "upload URL");
    // The build never started is still waiting.
    const st = (await (await api(`/templates/${templateID}/builds/${buildID}/status`)).json()) as { status: string };
    expect(st.status).toBe("waiting");
  });

  test("tags: assign, list, resolve name:tag, remove", async () => {
    const assigned = await Template.assignTags(`${name}:default`, ["prod", "v1"], opts());
    expect(assigned.tags).toEqual(["prod", "v1"]);
    const tags = (await Template.getTags(name, opts())).map((t) => t.tag).sort();
    expect(tags).toEqual(["default", "prod", "v1"]);
    await inSandbox(`${name}:prod`, async (sbx) => expect((await sbx.commands.run("id -un")).stdout).toBe("worker\n"));
    await Template.removeTags(name, "v1", opts());
    expect((await Template.getTags(name, opts())).map((t) => t.tag).sort()).toEqual(["default", "prod"]);
    const missing = await api("/templates/tags", { method: "DELETE", body: JSON.stringify({ name, tags: ["nope"] }) });
    expect(missing.status).toBe(404);
    expect((await api("/templates/tags", { method: "POST", body: JSON.stringify({ target: "no-such:default", tags: ["x"] }) })).status).toBe(404);
  }, BUILD_MS);

  const noRegistry = registrySkipReason();
  const USER = { username: "puller", password: "pull-secret" };
  const registry = noRegistry ? undefined : registrySuite("tb-registry", { basicAuth: [USER] });
  test.skipIf(!!noRegistry)(`fromImage from a private registry: the image's Env, WorkingDir and user; RUN and COPY on it${noRegistry ? ` (skipped: ${noRegistry})` : ""}`, async () => {
    const { reg } = registry!();
    // A busybox image behind Basic auth; /bin/bash hands over to busybox's sh (the SDK's commands run bash).
    const root = await busyboxRoot(join(scratchDir("tb-image"), "root"));
    writeFileSync(join(root, "bin/bash"), '#!/bin/sh\nexec /bin/busybox sh "$@"\n');
    chmodSync(join(root, "bin/bash"), 0o755);
    const ref = `${reg.host}/tb/busybox:1`;
    await pushImage(new RegistryClient({ dockerConfigPath: null, credentials: { [reg.host]: USER }, insecureRegistries: [reg.host] }), ref, { layers: [root], config: BUSYBOX_CONFIG });

    const logs: LogEntry[] = [];
    const t = Template({ fileContextPath: ctx }).fromImage(ref, USER)
      .runCmd('echo "in $(pwd) as $(id -u): $FOO" > made')
      .copy("files/a.txt", "copied.txt");
    const built = await Template.build(t, `${name}-img`, { ...opts(), onBuildLogs: (l) => logs.push(l) });
    expect(logs.some((l) => l.message.startsWith("pull "))).toBe(true);
    await inSandbox(`${name}-img`, async (sbx) => {
      const r = await sbx.commands.run('pwd; echo "$FOO"; cat made copied.txt; id -u');
      expect(r.stdout).toBe("/work\nbar\nin /work as 0: bar\nfrom the context\n0\n");
    });
    // Deleted, its uploads go with the next build's collection.
    const uploads = join(setup.home, "template-files", built.templateId);
    expect(existsSync(uploads)).toBe(true);
    expect((await api(`/templates/${built.templateId}`, { method: "DELETE" })).status).toBe(204);
    // Without the credentials the registry refuses: the build fails, naming the image.
    const denied = await Template.build(Template().fromImage(ref).runCmd("true"), `${name}-img-denied`, opts()).catch((e) => e);
    expect(denied).toBeInstanceOf(BuildError);
    expect(denied.message).toContain(reg.host);
    await until(() => !existsSync(uploads), 10_000, "the deleted template's uploads are collected");
  }, BUILD_MS);

  test.skipIf(!!noRegistry)(`fromImage naming an image the registry does not have: the build fails naming it, nothing is published; the status route's level gives that level and above${noRegistry ? ` (skipped: ${noRegistry})` : ""}`, async () => {
    const { reg } = registry!();
    const ref = `${reg.host}/tb/no-such-image:1`;
    const info = await Template.buildInBackground(Template().fromImage(ref, USER), `${name}-noimage`, opts());
    type Status = { status: string; reason?: { message: string; step?: string }; logEntries: BuildLogEntry[] };
    const status = async (query = "") => (await (await api(`/templates/${info.templateId}/builds/${info.buildId}/status${query}`)).json()) as Status;
    await until(async () => (await status()).status === "error", 120_000, "the build fails");
    const st = await status();
    // The registry's 404 is the build's error, naming the image; no VM was booted, nothing published.
    expect(st.reason!.message).toContain(ref);
    expect(st.reason!.message).toContain("not found");
    expect(st.logEntries.some((e) => e.message.startsWith("Booting"))).toBe(false);
    expect(await Template.exists(`${name}-noimage`, opts())).toBe(false);

    // The log has info and error entries: a level keeps it and the levels above; logsOffset counts those.
    const all = st.logEntries;
    const errors = all.filter((e) => e.level === "error");
    expect(errors.length).toBeGreaterThan(0);
    expect(all.length).toBeGreaterThan(errors.length);
    expect((await status("?level=error")).logEntries).toEqual(errors);
    expect((await status("?level=warn")).logEntries).toEqual(errors);
    expect((await status("?level=info")).logEntries).toEqual(all);
    expect((await status("?level=debug")).logEntries).toEqual(all);
    expect((await status("?level=info&logsOffset=1")).logEntries).toEqual(all.slice(1));
    expect((await status(`?level=error&logsOffset=${errors.length}`)).logEntries).toEqual([]);
    expect((await status("?level=error&limit=1")).logEntries).toEqual(errors.slice(0, 1));
    const bad = await api(`/templates/${info.templateId}/builds/${info.buildId}/status?level=loud`);
    expect(bad.status).toBe(400);
    expect(((await bad.json()) as { message: string }).message).toContain("level");
  }, BUILD_MS);

  test.skipIf(!!noDebian)(`a Debian bookworm minbase image from mmdebstrap, pushed and pulled into a template: a sandbox runs its bash and dpkg with the image's Env and WorkingDir${noDebian ? ` (skipped: ${noDebian})` : ""}`, async () => {
    const { reg } = registry!();
    const layer = await debianMinbaseLayer();
    const ref = `${reg.host}/tb/debian:bookworm`;
    await pushLayerFiles(new RegistryClient({ dockerConfigPath: null, credentials: { [reg.host]: USER }, insecureRegistries: [reg.host] }), ref, { layers: [layer], config: DEBIAN_CONFIG });
    const logs: LogEntry[] = [];
    const built = await Template.build(Template().fromImage(ref, USER), `${name}-debian`, { ...opts(), onBuildLogs: (l) => logs.push(l) });
    expect(logs.some((l) => /^pull done: 1\/1 layers \(0 cached\)/.test(l.message))).toBe(true);
    await inSandbox(`${name}-debian`, async (sbx) => {
      const r = await sbx.commands.run('cat /etc/debian_version; pwd; echo "$IMAGE_KIND"; id -un; echo "$BASH_VERSION"; dpkg -l | grep -c "^ii"; dpkg -s base-files | grep "^Status:"');
      const [version, cwd, kind, user, bash, packages, baseFiles] = r.stdout.trimEnd().split("\n");
      expect(version).toMatch(/^12\.\d+$/);
      expect([cwd, kind, user]).toEqual(["/srv", "debian-minbase", "root"]);
      expect(bash).toMatch(/^5\.2\./);
      expect(Number(packages)).toBeGreaterThanOrEqual(50);
      expect(baseFiles).toBe("Status: install ok installed");
    });
    expect((await api(`/templates/${built.templateId}`, { method: "DELETE" })).status).toBe(204);
  }, BUILD_MS);
});
