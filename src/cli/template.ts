// aenv's template verbs: pull (an OCI image becomes a template), build (a Dockerfile becomes one),
// template ls|rm. Builds go through the e2b SDK's Template builder, so the node sees exactly what
// the SDK sends (POST /v3/templates, COPY sources uploaded by hash, POST /v2/templates/{id}/builds/
// {buildID}, then the build status polled with logsOffset) and aenv prints the build's log lines
// as they come.

import { existsSync, readFileSync, statSync } from "node:fs";
import { dirname, join, resolve } from "node:path";
import { Template, type BuildInfo, type LogEntry } from "e2b";
import { UsageError, type ParsedArgs } from "./args.ts";
import { DEFAULT_READY_CMD, DockerfileError, dockerfileTemplate } from "./dockerfile.ts";
import { NODE_OPTIONS, api, onNode, resolveTarget, sdkOpts, unknown, type NodeTarget } from "./node_client.ts";
import { JSON_OPTION, printListing, when } from "./table.ts";
import { wholeNumber, type Option, type Verb } from "./verbs.ts";

/** A build's longest wait: a large image's pull and conversion, then the template's boot. */
const BUILD_TIMEOUT_MS = 60 * 60_000;

const READY: Option = { flag: "--ready-cmd", value: "CMD", help: `the template is ready once this exits 0, polled every 2 s (default with a start command: ${DEFAULT_READY_CMD})` };
const BUILD_OPTIONS: Option[] = [
  { flag: "--name", value: "N", required: true, help: "the template's name (`aenv start N`); may be name:tag" },
  { flag: "--cpu", value: "N", help: "vCPUs of its sandboxes" },
  { flag: "--memory", value: "MiB", help: "memory of its sandboxes" },
  { flag: "--skip-cache", help: "rebuild every step" },
  { flag: "-d", help: "detach: print the template and build IDs once the build is accepted" },
  ...NODE_OPTIONS,
];

/**
 * The node's image-pull progress ("pull PHASE: D/T layers (C cached), X/Y MiB, R MiB/s") as a
 * bar with the download rate, or undefined for any other line.
 */
export function progressBar(message: string, width = 30): string | undefined {
  const m = /^pull (\w+): (\d+)\/(\d+) layers \((\d+) cached\), ([\d.]+)\/([\d.]+) MiB(?:, ([\d.]+) MiB\/s)?/.exec(message);
  if (!m) return undefined;
  const [, phase, done, total, cached, got, all, rate] = m as unknown as (string | undefined)[];
  const frac = Number(all) > 0 ? Number(got) / Number(all) : Number(total) > 0 ? Number(done) / Number(total) : 0;
  const fill = Math.round(Math.min(1, frac) * width);
  return `[${"#".repeat(fill)}${".".repeat(width - fill)}] ${phase}: ${done}/${total} layers (${cached} cached), ${got}/${all} MiB${rate === undefined ? "" : `, ${rate} MiB/s`}`;
}

/**
 * The build's log as a person reads it: the level where it is not info, then the message. On a
 * terminal the pull's progress lines redraw one bar in place; piped, every line is kept.
 */
function buildLog(): { print(e: LogEntry): void; end(): void } {
  const tty = process.stdout.isTTY === true;
  let barShown = false;
  return {
    print(e) {
      const text = e.message.replace(/\n+$/, "");
      const bar = tty ? progressBar(text) : undefined;
      if (bar !== undefined) {
        process.stdout.write(`\r\x1b[K${bar}`);
        barShown = true;
        return;
      }
      if (barShown) process.stdout.write("\n");
      barShown = false;
      process.stdout.write(e.level === "info" ? `${text}\n` : `${e.level}: ${text}\n`);
    },
    end() {
      if (barShown) process.stdout.write("\n");
      barShown = false;
    },
  };
}

/** Run the build (or only start it, with -d) and say what came of it. */
async function runBuild(a: ParsedArgs, t: NodeTarget, tpl: Parameters<typeof Template.build>[0]): Promise<void> {
  const name = a.value("name")!;
  const opts = {
    ...sdkOpts(t),
    requestTimeoutMs: BUILD_TIMEOUT_MS,
    cpuCount: wholeNumber(a.value("cpu"), "--cpu", 1, 64),
    memoryMB: wholeNumber(a.value("memory"), "--memory", 128, 1 << 20),
    skipCache: a.flag("skip-cache"),
  };
  if (a.flag("d")) {
    const info: BuildInfo = await onNode(t, undefined, () => Template.buildInBackground(tpl, name, opts));
    process.stdout.write(`${info.templateId} ${info.buildId}\n`);
    return;
  }
  const log = buildLog();
  const info: BuildInfo = await onNode(t, undefined, () => Template.build(tpl, name, { ...opts, onBuildLogs: (e) => log.print(e) })).finally(() => log.end());
  process.stderr.write(`aenv: template ${name} (${info.templateId}) is ready: \`aenv start ${name}\`\n`);
}

async function pull(a: ParsedArgs): Promise<void> {
  const [image] = a.need(1, "IMAGE");
  const start = a.value("start-cmd");
  const ready = a.value("ready-cmd");
  const imageCmd = a.flag("image-cmd");
  if (imageCmd && start !== undefined) throw new UsageError("--image-cmd and --start-cmd: give one");
  if (ready !== undefined && start === undefined && !imageCmd) throw new UsageError("--ready-cmd needs --start-cmd or --image-cmd");
  const t = await resolveTarget(a);
  const from = Template().fromImage(image!);
  if (imageCmd) return runBuild(a, t, withImageCmd(ready === undefined ? from : from.setReadyCmd(ready)));
  await runBuild(a, t, start === undefined ? from : from.setStartCmd(start, ready ?? DEFAULT_READY_CMD));
}

/**
 * The build's start request with the node's own `imageCmd: true` (the image's Entrypoint + Cmd is
 * the start command): the SDK has no field for it, so its request body gets one.
 */
function withImageCmd<T extends object>(tpl: T): T {
  const t = tpl as unknown as { serialize?(steps: unknown): Record<string, unknown> };
  if (typeof t.serialize !== "function") throw new Error("this e2b SDK's Template has no serialize(): --image-cmd cannot be sent");
  const serialize = t.serialize.bind(t);
  t.serialize = (steps) => ({ ...serialize(steps), imageCmd: true });
  return tpl;
}

/** `DIR` (its Dockerfile, DIR the context) or a Dockerfile (its folder the context). */
function dockerfileOf(arg: string): { file: string; context: string } {
  const st = statSync(arg, { throwIfNoEntry: false });
  if (!st) throw new UsageError(`${arg}: no such file or directory`);
  if (st.isDirectory()) {
    const file = join(arg, "Dockerfile");
    if (!existsSync(file)) throw new UsageError(`${arg} has no Dockerfile`);
    return { file, context: resolve(arg) };
  }
  return { file: arg, context: resolve(dirname(arg)) };
}

async function build(a: ParsedArgs): Promise<void> {
  const [arg] = a.need(1, "DIR or DOCKERFILE");
  const { file, context } = dockerfileOf(arg!);
  const ignore = join(context, ".dockerignore");
  const patterns = existsSync(ignore)
    ? readFileSync(ignore, "utf8").split("\n").map((l) => l.trim()).filter((l) => l !== "" && !l.startsWith("#"))
    : [];
  let tpl;
  try {
    tpl = dockerfileTemplate(readFileSync(file, "utf8"), { context, ignore: patterns, readyCmd: a.value("ready-cmd") });
  } catch (e) {
    if (e instanceof DockerfileError) throw new UsageError(`${file}: ${e.message}`);
    throw e;
  }
  await runBuild(a, await resolveTarget(a), tpl);
}

interface TemplateRow {
  templateID: string;
  names?: string[];
  aliases?: string[];
  cpuCount: number;
  memoryMB: number;
  diskSizeMB: number;
  buildStatus?: string;
  createdAt: string;
}

async function templateLs(a: ParsedArgs): Promise<void> {
  a.need(0, "no operands");
  const t = await resolveTarget(a);
  const { data } = await api<TemplateRow[]>(t, "GET", "/templates");
  printListing(data, [
    { header: "ID", cell: (r) => r.templateID },
    { header: "NAMES", cell: (r) => [...new Set([...(r.aliases ?? []), ...(r.names ?? [])])].join(",") },
    { header: "STATUS", cell: (r) => r.buildStatus ?? "-" },
    { header: "CPU", cell: (r) => String(r.cpuCount) },
    { header: "MEM MiB", cell: (r) => String(r.memoryMB) },
    { header: "DISK MiB", cell: (r) => String(r.diskSizeMB) },
    { header: "CREATED", cell: (r) => when(r.createdAt) },
  ], { json: a.flag("json"), empty: `no templates on ${t.url}` });
}

async function templateRm(a: ParsedArgs): Promise<void> {
  const ids = a.atLeast(1, "TEMPLATE...");
  const t = await resolveTarget(a);
  const missing: string[] = [];
  for (const id of ids) {
    await api(t, "DELETE", `/templates/${encodeURIComponent(id)}`).catch((e) => {
      if ((e as { status?: number }).status === 404) missing.push(id);
      else throw e;
    });
  }
  if (missing.length > 0) throw unknown(t, { kind: "template", id: missing.join(", ") });
}

/** A push's longest wait: every layer hashed and uploaded (the node lifts its idle timeout for it). */
const PUSH_TIMEOUT_MS = 60 * 60_000;
/** Bound on a password read from stdin. */
const PASSWORD_MAX_BYTES = 16 << 10;

interface PushAnswer {
  ref: string;
  manifestDigest: string;
  layers: { digest: string; size: number; uploaded: boolean }[];
}

async function push(a: ParsedArgs): Promise<void> {
  const [template, ref] = a.need(2, "TEMPLATE REF");
  const username = a.value("username");
  const fromStdin = a.flag("password-stdin");
  if (fromStdin !== (username !== undefined)) throw new UsageError("--username and --password-stdin: give both or neither");
  let password: string | undefined;
  if (fromStdin) {
    const raw = await Bun.stdin.text();
    if (raw.length > PASSWORD_MAX_BYTES) throw new UsageError(`the password on stdin is longer than ${PASSWORD_MAX_BYTES} bytes`);
    password = raw.replace(/\r?\n$/, "");
  }
  const t = await resolveTarget(a);
  const { data } = await api<PushAnswer>(t, "POST", `/templates/${encodeURIComponent(template!)}/push`, {
    body: { ref, ...(username !== undefined ? { username, password } : {}) }, subject: { kind: "template", id: template! }, timeoutMs: PUSH_TIMEOUT_MS,
  });
  if (a.flag("json")) {
    process.stdout.write(`${JSON.stringify(data, null, 2)}\n`);
    return;
  }
  for (const l of data.layers) process.stderr.write(`aenv: layer ${l.digest} (${(l.size / 2 ** 20).toFixed(1)} MiB): ${l.uploaded ? "pushed" : "already there"}\n`);
  process.stdout.write(`${data.ref}@${data.manifestDigest}\n`);
}

export const BUILD_VERBS: Record<string, Verb> = {
  push: {
    operands: "TEMPLATE REF",
    summary: "push a template's rootfs layers as an overlaybd image under REF (registry/repo:tag, or s3://bucket/prefix[:tag]); prints REF@DIGEST",
    options: [
      { flag: "--username", value: "U", help: "registry user (default: the node's Docker config, else anonymous)" },
      { flag: "--password-stdin", help: "read the registry password from stdin (with --username)" },
      { flag: "--json", help: "the node's answer: the manifest digest and each layer's blob (uploaded or already there)" },
      ...NODE_OPTIONS,
    ],
    notes: [
      "Layers go base first, one blob each, as accelerated-container-image lays out an overlaybd image; blobs",
      "the registry has are not sent again. The image's config carries the template's env, user and working",
      "directory, so `aenv pull REF` (or a sandbox from REF on another node) starts the same. A node pulls such",
      "an image lazily: its sandboxes read the layers by HTTP Range through the node's block cache.",
      "s3://bucket/prefix is an OCI image layout (oci-layout, index.json, blobs/sha256/…) written with the",
      "node's S3 settings (AENV_S3_ENDPOINT, AWS_REGION, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY); --username",
      "does not apply there. Another node starts it with `aenv pull s3://…` or a sandbox from s3://….",
      "example: aenv push my-app 127.0.0.1:5000/team/my-app:1",
      "example: aenv push my-app s3://templates/team/my-app:1",
    ].join("\n"),
    run: push,
  },
  pull: {
    operands: "IMAGE",
    summary: "make a template of an OCI image (registry/repo:tag, or s3://bucket/prefix[:tag]); the build's log streams (on a terminal the pull's progress is a bar)",
    options: [
      { flag: "--start-cmd", value: "CMD", help: "started in the background in every sandbox of the template" },
      { flag: "--image-cmd", help: "the image's Entrypoint + Cmd is the start command (without it neither runs)" },
      READY,
      ...BUILD_OPTIONS,
    ],
    notes: "example: aenv pull docker.io/library/python:3.12-slim --name py",
    run: pull,
  },
  build: {
    operands: "DIR|DOCKERFILE",
    summary: "make a template of a Dockerfile (DIR/Dockerfile with DIR as the context, or a file with its folder); the build's log streams",
    options: [READY, ...BUILD_OPTIONS],
    notes: [
      "One stage: FROM, RUN, ENV, ARG (build-time only), WORKDIR, USER, COPY/ADD (local sources, uploaded",
      "by hash; --chown, --chmod), EXPOSE, LABEL, VOLUME; CMD/ENTRYPOINT become the start command. Steps",
      "run as root in / unless the file says otherwise; without USER or WORKDIR the sandboxes run as",
      "`user` in /home/user. .dockerignore in the context is honoured.",
    ].join("\n"),
    run: build,
  },
};

export const TEMPLATE_VERBS: Record<string, Verb> = {
  ls: { operands: "", summary: "the node's templates: a table on a terminal, JSON otherwise", options: [JSON_OPTION, ...NODE_OPTIONS], run: templateLs },
  rm: { operands: "TEMPLATE...", summary: "delete templates (by ID or name)", options: [...NODE_OPTIONS], run: templateRm },
};
