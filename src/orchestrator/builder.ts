// Template builds as E2B's template API drives them: a build is requested (a template ID and a
// build ID), its COPY files are uploaded by hash, then started with a parent (another template, or
// an image through the node's ImageSource) and steps. The build VM is cold-booted from the
// parent's layers plus every cached step's layer; the remaining steps run through its envd, each
// sealed into a layer of its own and recorded in the step cache under the hash of (parent, step,
// the state before it). startCmd runs in the background, readyCmd is polled, and the ready VM is
// checkpointed: the template is published only then, so a failed build leaves nothing behind.
import type { Database } from "bun:sqlite";
import { createHash, randomUUID } from "node:crypto";
import { mkdirSync } from "node:fs";
import { mkdir, open, readdir, rename, rm, stat } from "node:fs/promises";
import { join, posix } from "node:path";
import { Build, LOG_PAGE, type LogLevel } from "./build_log.ts";
import { runProcess, uploadFile, type ProcessSpec } from "./envd_process.ts";
import { StepCache } from "./step_cache.ts";
import { BOOT_TRACE } from "./start_traces.ts";
import { checkFilesHash } from "./files_hash.ts";
import { Orchestrator, OrchestratorError, type BuildVm } from "./orchestrator.ts";
import { layerKey, type TemplateConfig, type TemplateLayer, type TemplateRecord } from "./templates.ts";

/** A build API failure with the HTTP status the API answers it with. */
export class TemplateBuildError extends Error {
  constructor(readonly status: number, message: string) {
    super(message);
    this.name = "TemplateBuildError";
  }
}

/** A step failed inside the build: the status's reason names it (E2B's step numbering: 1 = first step). */
class StepFailed extends Error {
  constructor(message: string, readonly step: string) {
    super(message);
    this.name = "StepFailed";
  }
}

export interface BuildStep {
  type: string;
  args?: string[];
  filesHash?: string;
  force?: boolean;
}

export interface RegistryAuth {
  type: string;
  username?: string;
  password?: string;
}

/** The body of POST /v2/templates/{templateID}/builds/{buildID} (E2B's TemplateBuildStartV2). */
export interface BuildSpec {
  fromImage?: string;
  fromTemplate?: string;
  fromImageRegistry?: RegistryAuth;
  force?: boolean;
  startCmd?: string;
  readyCmd?: string;
  steps?: BuildStep[];
  /** aenv's own field (`aenv pull --image-cmd`): a fromImage build without startCmd starts the image's Entrypoint + Cmd. */
  imageCmd?: boolean;
}

/** An OCI image as a clean layer stack plus its config (the node composes it from src/template). */
export interface PulledImage {
  /** A stable name of the image's content (its manifest digest): the step cache's root. */
  digest: string;
  /** Base first: layer files, or layers left in the registry (an overlaybd image, read lazily). */
  layers: TemplateLayer[];
  diskSizeMB: number;
  env: Record<string, string>;
  /** A lazy pull's boot trace (the image's, recorded where it was made): its build VM's rootfs replays it. */
  rootfsTrace?: Uint8Array;
  user?: string;
  workdir?: string;
  /** The config's Entrypoint and Cmd (run only with the build's imageCmd), ExposedPorts (`8080/tcp`) and Labels. */
  entrypoint?: string[];
  cmd?: string[];
  exposedPorts?: string[];
  labels?: Record<string, string>;
}

/** What a template's image carries besides its layers (the OCI config's run fields). */
export type PushedConfig = Required<Pick<TemplateConfig, "env" | "user" | "workdir">> & Pick<TemplateConfig, "entrypoint" | "cmd" | "exposed" | "labels">;

/** A pushed image: its manifest's digest and each layer's blob (uploaded: false when the registry had it). */
export interface PushResult {
  ref: string;
  manifestDigest: string;
  configDigest: string;
  layers: { digest: string; size: number; uploaded: boolean }[];
  /** The boot trace's blob, when the image carries one. */
  trace?: { digest: string; size: number; uploaded: boolean };
}

export interface ImageSource {
  pull(ref: string, auth: { username: string; password: string } | undefined, log: (message: string) => void, signal: AbortSignal): Promise<PulledImage>;
  /** A template's layers (base first) and run config to `ref` as an overlaybd image. */
  push?(ref: string, image: { layers: TemplateLayer[]; config: PushedConfig; rootfsTrace?: string }, auth: { username: string; password: string } | undefined): Promise<PushResult>;
}

export interface BuilderOptions {
  /** Uploaded COPY archives, by template and hash. */
  filesDir: string;
  /** Sealed step layers of the step cache. */
  stepsDir: string;
  /** Builds running at once on this node; more wait ("waiting") up to maxQueued, then 429. */
  maxConcurrent?: number;
  maxQueued?: number;
  /** A build's whole run, boot to checkpoint. */
  buildTimeoutMs?: number;
  /** Log entries kept per build (the oldest go first; logsOffset still counts them). */
  maxLogEntries?: number;
  /** One COPY archive's size. */
  maxUploadBytes?: number;
  /** readyCmd is polled this often, up to readyTimeoutMs (E2B: 2 s, 10 min). */
  readyIntervalMs?: number;
  readyTimeoutMs?: number;
  /** startCmd without readyCmd waits with this command (E2B: `sleep 20`). */
  defaultReadyCmd?: string;
  /** Builds (finished or not) whose status this node keeps answering. */
  maxBuildsKept?: number;
  /** Step-cache layers kept (least recently used go first; a template's layers always stay). */
  stepCacheBytes?: number;
  /** Where fromImage parents come from; none: fromImage is refused. */
  images?: ImageSource;
  /** Told of each template a build made ready (a cluster pushes it for the other nodes). */
  onReady?: (t: TemplateRecord) => void;
}

/** What a BuilderOptions field left out is (the node leaves the ready poll's out: 2 s, at most 10 min). */
export const BUILDER_DEFAULTS = {
  maxConcurrent: 2, maxQueued: 8, buildTimeoutMs: 60 * 60_000, maxLogEntries: 10_000, maxUploadBytes: 1024 ** 3,
  readyIntervalMs: 2000, readyTimeoutMs: 10 * 60_000, stepCacheBytes: 20 * 1024 ** 3, defaultReadyCmd: "sleep 20", maxBuildsKept: 64,
};
/** Steps of one build, and a step's args (count and bytes). */
const MAX_STEPS = 256;
/** How often a cold create looks at the build it waits on. */
const COLD_POLL_MS = 250;
const MAX_ARGS = 256;
const MAX_ARG_BYTES = 64 * 1024;
/** USER's account creation (E2B: 60 s); each bookkeeping command in the VM (sync, mkdir). */
const USER_STEP_MS = 60_000;
const SHORT_CMD_MS = 120_000;
/** One log entry's message at most (longer output lines are cut). */
const LOG_LINE = 4096;
/** A failed step's reason carries this much of its output's end. */
const OUTPUT_TAIL = 4096;

/** The tools disk's busybox (every VM has it at /agentenv): bookkeeping runs on it whatever the image holds. */
const BUSYBOX = "/agentenv/bin/busybox";
/** The image's tools first, the tools disk's applets last. */
const TOOLS_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin:/agentenv/bin";

const STEP_TYPES = new Set(["RUN", "COPY", "ADD", "ENV", "ARG", "WORKDIR", "USER", "EXPOSE", "LABEL", "VOLUME"]);
/** Steps that change the disk: their upper is sealed into a layer. */
const DISK_STEPS = new Set(["RUN", "COPY", "ADD", "WORKDIR", "USER"]);
const NAME = /^[a-zA-Z0-9][a-zA-Z0-9_.-]{0,127}$/;
const TAG = /^[a-zA-Z0-9][a-zA-Z0-9_.-]{0,127}$/;
const HASH = /^[0-9a-f]{64}$/;

/** `name` or `name:tag` → its parts (tag undefined when none was given). */
export function splitName(ref: string): { name: string; tag?: string } {
  const colon = ref.lastIndexOf(":");
  return colon < 0 ? { name: ref } : { name: ref.slice(0, colon), tag: ref.slice(colon + 1) };
}

function sha256(text: string): string {
  return createHash("sha256").update(text).digest("hex");
}

function randomId(len = 20): string {
  const alphabet = "abcdefghijklmnopqrstuvwxyz0123456789";
  let s = "";
  for (const b of crypto.getRandomValues(new Uint8Array(len))) s += alphabet[b % 36];
  return s;
}

interface Request {
  templateId: string;
  name: string;
  tags: string[];
  cpuCount?: number;
  memoryMB?: number;
  builds: Map<string, Build>;
  /** Made from another node's pushed template (importTemplate): not pushed again. */
  imported?: boolean;
}

/** The builder's state that changes step by step (the next step's key covers it). */
interface StepState {
  env: Record<string, string>;
  /** ARG values: build-time only, not kept in the template. */
  args: Record<string, string>;
  user: string;
  workdir: string;
  exposed: string[];
  labels: Record<string, string>;
}

interface PlannedStep {
  index: number;
  step: BuildStep;
  key: string;
  /** The state the step runs in. */
  before: StepState;
  archive?: string;
}

export class TemplateBuilder {
  private readonly o: Required<Omit<BuilderOptions, "images" | "onReady">> & Pick<BuilderOptions, "images" | "onReady">;
  private readonly requests = new Map<string, Request>();
  /** Requested names not yet published → their template ID (one ID per name). */
  private readonly pendingNames = new Map<string, string>();
  private readonly queue: Build[] = [];
  private running = 0;
  /** Archives being uploaded (their paths): one upload of a hash at a time. */
  private readonly uploading = new Set<string>();
  private readonly aborts = new Set<AbortController>();
  private readonly runs = new Set<Promise<void>>();
  private readonly steps: StepCache;
  /** Cold templates being built, by name (POST /sandboxes-cold), and imports by ID: callers for one share its build. */
  private readonly coldBuilds = new Map<string, Promise<string>>();

  constructor(private readonly orch: Orchestrator, private readonly db: Database, opts: BuilderOptions) {
    this.o = { ...BUILDER_DEFAULTS, ...opts };
    mkdirSync(this.o.filesDir, { recursive: true });
    this.steps = new StepCache(db, this.o.stepsDir, this.o.stepCacheBytes, () => orch.templates.layersInUse());
    this.collectSteps();
  }

  /** A step-cache and upload collection in the background (after start and after each build). */
  private collectSteps(): void {
    this.steps.collect().catch((e) => console.error(`template builds: collecting the step cache: ${(e as Error).message}`));
    this.collectFiles().catch((e) => console.error(`template builds: collecting uploads: ${(e as Error).message}`));
  }

  /** Uploaded archives of templates that are gone (deleted, or never built) with no build open or running. */
  private async collectFiles(): Promise<void> {
    for (const id of await readdir(this.o.filesDir).catch(() => [] as string[])) {
      const open = [...(this.requests.get(id)?.builds.values() ?? [])].some((b) => !b.finished());
      if (open || this.orch.templates.resolve(id)) continue;
      await rm(join(this.o.filesDir, id), { recursive: true, force: true });
    }
  }

  // ─── requests ──────────────────────────────────────────────────────────────

  /** POST /v3/templates: a template ID (the name's, if it exists) and a new build ID. */
  request(body: { name?: string; alias?: string; tags?: string[]; cpuCount?: number; memoryMB?: number }, fixedId?: string) {
    const full = body.name ?? body.alias;
    if (!full) throw new TemplateBuildError(400, "name is required (name or name:tag)");
    const { name, tag } = splitName(full);
    if (!NAME.test(name)) throw new TemplateBuildError(400, `name '${name}': letters, digits, '_', '.', '-', at most 128, starting with a letter or digit`);
    const tags = [...new Set([...(tag !== undefined ? [tag] : []), ...(body.tags ?? [])])];
    for (const t of tags) if (!TAG.test(t)) throw new TemplateBuildError(400, `tag '${t}': letters, digits, '_', '.', '-', at most 128`);
    if (tags.length === 0) tags.push("default");
    const existing = this.orch.templates.resolve(name);
    if (existing && existing.kind !== "template") throw new TemplateBuildError(409, `'${name}' is a snapshot, not a template`);
    if (existing && existing.alias !== name && existing.id === name) throw new TemplateBuildError(409, `'${name}' is a template ID; build under its alias '${existing.alias}'`);
    const templateId = existing?.id ?? this.pendingNames.get(name) ?? fixedId ?? randomId();
    this.pendingNames.set(name, templateId);
    const buildId = randomUUID();
    let req = this.requests.get(templateId);
    if (!req) {
      req = { templateId, name, tags, builds: new Map() };
      this.requests.set(templateId, req);
    }
    Object.assign(req, { name, tags, cpuCount: body.cpuCount, memoryMB: body.memoryMB });
    req.builds.set(buildId, new Build(templateId, buildId, this.o.maxLogEntries));
    this.forgetOldBuilds();
    return { templateID: templateId, buildID: buildId, public: false, names: tags.map((t) => `${name}:${t}`), tags, aliases: [name] };
  }

  /** Finished builds beyond maxBuildsKept are forgotten, oldest first. */
  private forgetOldBuilds(): void {
    const all = [...this.requests.values()].flatMap((r) => [...r.builds.values()]);
    let extra = all.length - this.o.maxBuildsKept;
    for (const b of all.sort((a, c) => a.updatedAt - c.updatedAt)) {
      if (extra <= 0) break;
      if (!b.finished() && b.started) continue;
      const req = this.requests.get(b.templateId);
      req?.builds.delete(b.buildId);
      if (req && req.builds.size === 0) {
        this.requests.delete(b.templateId);
        if (this.pendingNames.get(req.name) === b.templateId) this.pendingNames.delete(req.name);
      }
      extra--;
    }
  }

  private build(templateId: string, buildId: string): Build {
    const b = this.requests.get(templateId)?.builds.get(buildId);
    if (!b) throw new TemplateBuildError(404, `build ${buildId} of template ${templateId} not found`);
    return b;
  }

  // ─── files ─────────────────────────────────────────────────────────────────

  private knownTemplate(templateId: string): void {
    if (!this.requests.has(templateId) && !this.orch.templates.resolve(templateId)) throw new TemplateBuildError(404, `template ${templateId} not found`);
  }

  private archivePath(templateId: string, hash: string): string {
    return join(this.o.filesDir, templateId, `${hash}.tar`);
  }

  /** GET /templates/{templateID}/files/{hash}: whether its archive is here (the API signs the URL to PUT it to). */
  async fileStatus(templateId: string, hash: string): Promise<boolean> {
    if (!HASH.test(hash)) throw new TemplateBuildError(400, "the files hash is 64 lowercase hex digits (sha256)");
    this.knownTemplate(templateId);
    return stat(this.archivePath(templateId, hash)).then(() => true, () => false);
  }

  /**
   * PUT of a COPY archive (tar or tar.gz as the SDK makes it; its URL checked by the API), at most
   * maxUploadBytes. A hash already here keeps its archive and the body is not read (the SDK's
   * forceUpload puts it again; a replay changes nothing); one upload of a hash runs at a time (409).
   * The files hash covers the step's source and destination, so it is checked at the build's start.
   */
  async putFile(templateId: string, hash: string, body: ReadableStream<Uint8Array> | null): Promise<void> {
    if (!HASH.test(hash)) throw new TemplateBuildError(400, "the files hash is 64 lowercase hex digits (sha256)");
    this.knownTemplate(templateId);
    if (!body) throw new TemplateBuildError(400, "the upload has no body");
    const archive = this.archivePath(templateId, hash);
    if (this.uploading.has(archive)) throw new TemplateBuildError(409, `files ${hash} of template ${templateId} are being uploaded: wait for that upload`);
    this.uploading.add(archive);
    const dir = join(this.o.filesDir, templateId);
    const tmp = join(dir, `.${hash}.${randomId(8)}`);
    try {
      if (await stat(archive).then(() => true, () => false)) return;
      await mkdir(dir, { recursive: true });
      const fh = await open(tmp, "w");
      const h = createHash("sha256");
      let total = 0;
      try {
        for await (const chunk of body) {
          total += chunk.byteLength;
          if (total > this.o.maxUploadBytes) throw new TemplateBuildError(413, `the archive is larger than ${this.o.maxUploadBytes} bytes`);
          h.update(chunk);
          await fh.write(chunk);
        }
      } finally {
        await fh.close();
      }
      await Bun.write(`${archive}.sha256`, h.digest("hex"));
      await rename(tmp, archive);
    } catch (e) {
      await rm(tmp, { force: true });
      throw e;
    } finally {
      this.uploading.delete(archive);
    }
  }

  /** An archive and its sum, gone (its hash is then uploaded again). */
  private async dropArchive(templateId: string, hash: string): Promise<void> {
    const archive = this.archivePath(templateId, hash);
    await rm(archive, { force: true });
    await rm(`${archive}.sha256`, { force: true });
  }

  // ─── start and status ──────────────────────────────────────────────────────

  /** POST /v2/templates/{templateID}/builds/{buildID}: checked, then run now or queued. */
  async start(templateId: string, buildId: string, spec: BuildSpec): Promise<void> {
    const b = this.build(templateId, buildId);
    if (b.started) throw new TemplateBuildError(409, `build ${buildId} has already been started`);
    const notes = await this.check(templateId, spec);
    if (this.running >= this.o.maxConcurrent && this.queue.length >= this.o.maxQueued)
      throw new TemplateBuildError(429, `this node runs ${this.o.maxConcurrent} builds and queues ${this.o.maxQueued}: try again later`);
    b.started = true;
    b.spec = spec;
    b.log("info", `Build ${buildId} accepted`);
    for (const n of notes) b.log("warn", n);
    this.queue.push(b);
    this.pump();
  }

  /** Refuses a spec the build could not run (TemplateBuildError); what it could not check, as notes for the build's log. */
  private async check(templateId: string, spec: BuildSpec): Promise<string[]> {
    const notes: string[] = [];
    const hasImage = typeof spec.fromImage === "string" && spec.fromImage !== "";
    const hasTemplate = typeof spec.fromTemplate === "string" && spec.fromTemplate !== "";
    if (hasImage === hasTemplate) throw new TemplateBuildError(400, "give exactly one of fromImage and fromTemplate");
    const reg = spec.fromImageRegistry;
    if (reg) {
      if (!hasImage) throw new TemplateBuildError(400, "fromImageRegistry goes with fromImage");
      if (reg.type !== "registry") throw new TemplateBuildError(400, `fromImageRegistry type '${reg.type}' is not supported: only 'registry' (username and password)`);
      if (typeof reg.username !== "string" || typeof reg.password !== "string" || !reg.username) throw new TemplateBuildError(400, "fromImageRegistry needs username and password");
    }
    if (spec.imageCmd !== undefined && typeof spec.imageCmd !== "boolean") throw new TemplateBuildError(400, "imageCmd: true or false");
    if (spec.imageCmd && !hasImage) throw new TemplateBuildError(400, "imageCmd goes with fromImage");
    if (spec.imageCmd && spec.startCmd) throw new TemplateBuildError(400, "give imageCmd or startCmd, not both");
    if (hasTemplate) {
      const parent = this.orch.templates.resolve(spec.fromTemplate!);
      if (!parent) throw new TemplateBuildError(404, `template '${spec.fromTemplate}' not found`);
      if (parent.id === templateId) throw new TemplateBuildError(400, "a template cannot be built from itself");
    } else if (!this.o.images) {
      throw new TemplateBuildError(400, "fromImage is not supported by this node (no image puller configured): build fromTemplate");
    }
    const steps = spec.steps ?? [];
    if (!Array.isArray(steps) || steps.length > MAX_STEPS) throw new TemplateBuildError(400, `steps: a list of at most ${MAX_STEPS}`);
    for (const [i, s] of steps.entries()) {
      const where = `step ${i + 1}`;
      if (!s || typeof s.type !== "string" || !STEP_TYPES.has(s.type)) throw new TemplateBuildError(400, `${where}: type must be one of ${[...STEP_TYPES].join(", ")}`);
      const args = s.args ?? [];
      if (!Array.isArray(args) || args.length > MAX_ARGS || args.some((a) => typeof a !== "string" || Buffer.byteLength(a) > MAX_ARG_BYTES))
        throw new TemplateBuildError(400, `${where}: args must be at most ${MAX_ARGS} strings of at most ${MAX_ARG_BYTES} bytes`);
      const need = (n: number) => { if (args.length < n) throw new TemplateBuildError(400, `${where} (${s.type}) needs ${n} argument(s)`); };
      switch (s.type) {
        case "RUN": case "WORKDIR": case "USER": need(1); if (!args[0]) throw new TemplateBuildError(400, `${where} (${s.type}): empty argument`); break;
        case "ENV": case "ARG": case "LABEL":
          if (args.length % 2 !== 0 || args.length === 0) throw new TemplateBuildError(400, `${where} (${s.type}): args are key, value pairs`);
          break;
        case "COPY": case "ADD": {
          need(2);
          if (!s.filesHash || !HASH.test(s.filesHash)) throw new TemplateBuildError(400, `${where} (COPY): filesHash (sha256 hex) is required`);
          if (args[3] && !/^[0-7]{3,4}$/.test(args[3])) throw new TemplateBuildError(400, `${where} (COPY): mode '${args[3]}' is not octal`);
          const present = await stat(this.archivePath(templateId, s.filesHash)).then(() => true, () => false);
          if (!present) throw new TemplateBuildError(400, `${where} (COPY ${args[0]}): files ${s.filesHash} were not uploaded (GET then PUT /templates/${templateId}/files/${s.filesHash})`);
          const note = await this.checkFiles(templateId, where, s.type, args[0]!, args[1]!, s.filesHash);
          if (note) notes.push(note);
          break;
        }
      }
    }
    for (const [k, v] of [["startCmd", spec.startCmd], ["readyCmd", spec.readyCmd]] as const)
      if (v !== undefined && v !== null && (typeof v !== "string" || Buffer.byteLength(v) > MAX_ARG_BYTES)) throw new TemplateBuildError(400, `${k}: a string of at most ${MAX_ARG_BYTES} bytes`);
    return notes;
  }

  /**
   * A COPY's uploaded archive against its files hash (the SDK's, over `COPY src dest` and the
   * files): a mismatch is refused and the archive removed, so the SDK uploads it again; an
   * archive that cannot be checked (a directory in it; an ADD, which the SDK does not hash) is a note.
   */
  private async checkFiles(templateId: string, where: string, type: string, src: string, dest: string, hash: string): Promise<string | undefined> {
    if (type !== "COPY") return `${where} (${type} ${src}): files ${hash} not checked against their hash (the SDK hashes COPY steps only)`;
    const verdict = await checkFilesHash(this.archivePath(templateId, hash), src, dest, hash);
    if (verdict.kind === "match") return undefined;
    if (verdict.kind === "unchecked") return `${where} (COPY ${src}): files ${hash} not checked against their hash: ${verdict.reason}`;
    await this.dropArchive(templateId, hash);
    throw new TemplateBuildError(400, `${where} (COPY ${src} ${dest}): the uploaded files do not match filesHash ${hash} (${verdict.detail}); they were removed: upload them again`);
  }

  /**
   * POST /sandboxes-cold: the ID of a template of `image` at this size, built from the image on
   * first use (no steps) and reused after, named `cold-<hash of image and size>`; concurrent
   * callers for one image wait on one build. A build that fails is a TemplateBuildError with its
   * reason (e.g. the registry's answer naming the image).
   */
  coldTemplate(image: string, size: { cpuCount?: number; memoryMB?: number }, auth?: RegistryAuth): Promise<string> {
    const name = `cold-${sha256(JSON.stringify([image, size.cpuCount ?? null, size.memoryMB ?? null])).slice(0, 16)}`;
    const ready = this.orch.templates.resolve(name);
    if (ready?.kind === "template") return Promise.resolve(ready.id);
    const cur = this.coldBuilds.get(name);
    if (cur) return cur;
    const built = (async () => {
      const { templateID, buildID } = this.request({ name, ...size });
      await this.start(templateID, buildID, { fromImage: image, ...(auth ? { fromImageRegistry: auth } : {}) });
      const b = this.build(templateID, buildID);
      const until = Date.now() + this.o.buildTimeoutMs + 60_000; // the build's own limit ends it first
      while (!b.finished()) {
        if (Date.now() > until) throw new TemplateBuildError(500, `the build of ${image} did not finish`);
        await Bun.sleep(COLD_POLL_MS);
      }
      if (b.status === "error") throw new TemplateBuildError(400, `image ${image}: ${b.reason?.message ?? "the build failed"}`);
      return templateID;
    })().finally(() => this.coldBuilds.delete(name));
    this.coldBuilds.set(name, built);
    return built;
  }

  /** GET .../status: the build's state and its log entries from `offset` (at most LOG_PAGE). */
  status(templateId: string, buildId: string, offset = 0, limit = LOG_PAGE, level?: LogLevel) {
    const b = this.build(templateId, buildId);
    const entries = b.entries(offset, Math.min(limit, LOG_PAGE), level);
    return {
      templateID: templateId,
      buildID: buildId,
      status: b.status,
      logs: entries.map((e) => `[${e.timestamp}] ${e.message}`),
      logEntries: entries,
      ...(b.reason ? { reason: { ...b.reason, logEntries: b.entries(0, Number.MAX_SAFE_INTEGER, "error").slice(-LOG_PAGE) } } : {}),
    };
  }

  /** Running builds are cut short (nothing is published) and queued ones fail; resolves once their VMs are given back. */
  async close(): Promise<void> {
    for (const a of this.aborts) a.abort(new Error("the node is shutting down"));
    for (const b of this.queue.splice(0)) this.fail(b, new Error("the node is shutting down"));
    await Promise.all(this.runs);
  }

  private pump(): void {
    while (this.running < this.o.maxConcurrent && this.queue.length > 0) {
      const b = this.queue.shift()!;
      this.running++;
      const r = this.run(b).finally(() => {
        this.running--;
        this.runs.delete(r);
        this.pump();
      });
      this.runs.add(r);
    }
  }

  private fail(b: Build, e: unknown): void {
    const step = e instanceof StepFailed ? e.step : undefined;
    const message = (e as Error).message ?? String(e);
    b.status = "error";
    b.reason = { message, ...(step !== undefined ? { step } : {}) };
    b.log("error", `Build failed: ${message}`, step);
    b.updatedAt = Date.now();
  }

  // ─── the build ─────────────────────────────────────────────────────────────

  private async run(b: Build): Promise<void> {
    const spec = b.spec!;
    const req = this.requests.get(b.templateId)!;
    const abort = new AbortController();
    this.aborts.add(abort);
    const timer = setTimeout(() => abort.abort(new Error(`the build ran past its limit of ${this.o.buildTimeoutMs / 1000} s`)), this.o.buildTimeoutMs);
    const deadline = Date.now() + this.o.buildTimeoutMs;
    let vm: BuildVm | undefined;
    let checkpointDir: string | undefined;
    /** Step layers this build stacks or writes: kept from the step cache's collection until it ends. */
    const held: string[] = [];
    b.status = "building";
    try {
      const parent = await this.parent(b, spec, abort.signal);
      // imageCmd: the image's Entrypoint + Cmd is the start command (by default neither runs, as in E2B's fromImage).
      const start = spec.imageCmd ? { ...spec, startCmd: startCmdOf(parent.command) } : spec;
      const steps = spec.steps ?? [];
      const plan = await this.plan(b.templateId, parent, steps);
      const n = steps.length;
      const label = (p: PlannedStep) => `[${p.index + 1}/${n}] ${p.step.type} ${(p.step.args ?? []).join(" ")}`.trimEnd();
      // The longest cached prefix: force (the build's or a step's) bypasses the cache from there on.
      const stack: TemplateLayer[] = [...parent.layers];
      // The step cache names the layer a step ran over by its key (a path, or remote:<digest>).
      const top = (): string | undefined => (stack.length ? layerKey(stack[stack.length - 1]!) : undefined);
      let hits = 0;
      for (const p of plan) {
        if (spec.force || p.step.force) break;
        const layer = await this.steps.get(p.key, top());
        if (layer === undefined) break;
        if (layer !== null) {
          this.steps.hold([layer]);
          held.push(layer);
          stack.push(layer);
        }
        b.log("info", `CACHED ${label(p)}`, String(p.index + 1));
        hits++;
      }
      b.log("info", `Booting the build VM (${stack.length} layers)`);
      vm = await this.orch.startBuildVm(stack, parent.size, parent.rootfsTrace);
      const shell = await loginShell(vm, (line) => b.log("warn", `envd: ${line}`, "base"));
      for (const p of plan.slice(hits)) {
        if (abort.signal.aborted) throw abort.signal.reason;
        b.log("info", label(p), String(p.index + 1));
        await this.runStep(vm, shell, b, p, deadline, abort.signal);
        const under = top();
        if (DISK_STEPS.has(p.step.type)) {
          await this.exec(vm, b, SYNC, SHORT_CMD_MS, String(p.index + 1), abort.signal);
          const layer = this.steps.newLayer(p.key);
          held.push(layer);
          await vm.seal(layer);
          stack.push(layer);
          this.steps.put(p.key, under, layer);
        } else {
          this.steps.put(p.key, under, null);
        }
      }
      const final = plan.length ? after(plan[plan.length - 1]!) : parent.state;
      await this.startAndWait(vm, shell, b, start, final, deadline, abort.signal);
      await this.exec(vm, b, SYNC, SHORT_CMD_MS, "finalize", abort.signal);
      b.log("info", "Checkpointing the ready VM");
      const cp = await vm.checkpoint(b.templateId, stack);
      checkpointDir = cp.dir;
      if (abort.signal.aborted) throw abort.signal.reason;
      this.publish(req, b, parent, stack, cp, final, start);
      checkpointDir = undefined;
      b.status = "ready";
      b.log("info", `Template ${req.name} (${b.templateId}) is ready`);
    } catch (e) {
      this.fail(b, e instanceof OrchestratorError ? new Error(e.message) : e);
    } finally {
      clearTimeout(timer);
      this.aborts.delete(abort);
      await vm?.stop().catch(() => {});
      if (checkpointDir) this.orch.discardBuildCheckpoint(checkpointDir);
      b.updatedAt = Date.now();
      this.steps.release(held);
      this.collectSteps();
    }
  }

  /** The parent's clean layer stack, VM size and run-time state. */
  private async parent(b: Build, spec: BuildSpec, signal: AbortSignal): Promise<{ root: string; layers: TemplateLayer[]; size: { cpuCount: number; memoryMB: number; diskSizeMB: number }; state: StepState; envdVersion: string; command: ImageCommand; rootfsTrace?: Uint8Array }> {
    const req = this.requests.get(b.templateId)!;
    const stateOf = (c: { env?: Record<string, string>; user?: string; workdir?: string } | null | undefined, labels: Record<string, string> = {}, exposed: string[] = []): StepState => {
      const user = c?.user || "user";
      return { env: { ...c?.env }, args: {}, user, workdir: c?.workdir || (user === "root" ? "/root" : `/home/${user}`), labels, exposed };
    };
    if (spec.fromTemplate) {
      const t = this.orch.templates.resolve(spec.fromTemplate);
      if (!t) throw new Error(`template '${spec.fromTemplate}' is gone`);
      b.log("info", `FROM template ${t.alias ?? t.id}`, "base");
      return {
        root: sha256(JSON.stringify({ template: t.id, layers: t.layers })),
        layers: t.layers,
        size: { cpuCount: req.cpuCount ?? t.cpuCount, memoryMB: req.memoryMB ?? t.memoryMB, diskSizeMB: t.diskSizeMB },
        state: stateOf(t.config, { ...t.config?.labels }, [...(t.config?.exposed ?? [])]),
        envdVersion: t.envdVersion,
        command: { entrypoint: t.config?.entrypoint ?? [], cmd: t.config?.cmd ?? [] },
      };
    }
    b.log("info", `FROM image ${spec.fromImage}`, "base");
    const reg = spec.fromImageRegistry;
    const img = await this.o.images!.pull(spec.fromImage!, reg ? { username: reg.username!, password: reg.password! } : undefined, (m) => b.log("info", m, "base"), signal);
    const base = this.orch.templates.resolve("base");
    return {
      root: sha256(JSON.stringify({ image: img.digest })),
      layers: img.layers,
      size: { cpuCount: req.cpuCount ?? base?.cpuCount ?? 2, memoryMB: req.memoryMB ?? base?.memoryMB ?? 512, diskSizeMB: img.diskSizeMB },
      // An image's sandboxes run as its User (root when it names none) in its WorkingDir (/ when none).
      state: stateOf({ env: img.env, user: img.user || "root", workdir: img.workdir || "/" }, { ...img.labels }, [...(img.exposedPorts ?? [])]),
      envdVersion: base?.envdVersion ?? "0.6.13",
      command: { entrypoint: img.entrypoint ?? [], cmd: img.cmd ?? [] },
      ...(img.rootfsTrace ? { rootfsTrace: img.rootfsTrace } : {}),
    };
  }

  /** Each step's cache key and the state it runs in (ENV, ARG, USER, WORKDIR carry forward). */
  private async plan(templateId: string, parent: { root: string; state: StepState }, steps: BuildStep[]): Promise<PlannedStep[]> {
    let key = parent.root;
    let state = parent.state;
    const out: PlannedStep[] = [];
    for (const [index, step] of steps.entries()) {
      let archive: string | undefined;
      let archiveSum: string | undefined;
      if (step.type === "COPY" || step.type === "ADD") {
        archive = this.archivePath(templateId, step.filesHash!);
        archiveSum = (await Bun.file(`${archive}.sha256`).text().catch(() => "")).trim();
      }
      key = sha256(JSON.stringify({ parent: key, type: step.type, args: step.args ?? [], filesHash: step.filesHash ?? null, archiveSum: archiveSum ?? null, state }));
      const p: PlannedStep = { index, step, key, before: state, archive };
      out.push(p);
      state = after(p);
    }
    return out;
  }

  private async runStep(vm: BuildVm, shell: Shell, b: Build, p: PlannedStep, deadline: number, signal: AbortSignal): Promise<void> {
    const args = p.step.args ?? [];
    const s = p.before;
    const step = String(p.index + 1);
    const left = () => Math.max(1000, deadline - Date.now());
    const env = { ...s.env, ...s.args };
    const script = (text: string, envs: Record<string, string>): ProcessSpec => ({ cmd: BUSYBOX, args: ["sh", "-c", text], user: "root", cwd: "/", envs: { PATH: TOOLS_PATH, ...envs } });
    switch (p.step.type) {
      case "RUN":
        await this.exec(vm, b, { ...shell.run(args[0]!), user: args[1] || s.user, cwd: s.workdir, envs: env }, left(), step, signal);
        return;
      case "WORKDIR":
        await this.exec(vm, b, script(WORKDIR_SCRIPT, { D: posix.resolve(s.workdir, args[0]!), U: s.user }), SHORT_CMD_MS, step, signal);
        return;
      case "USER":
        await this.exec(vm, b, script(USER_SCRIPT, { U: args[0]! }), USER_STEP_MS, step, signal);
        return;
      case "COPY": case "ADD": {
        const inGuest = `/tmp/.aenv-copy-${p.step.filesHash}-${randomId(6)}`;
        const head = new Uint8Array(await Bun.file(p.archive!).slice(0, 2).arrayBuffer());
        await uploadFile(vm.envdUrl, null, "root", inGuest, p.archive!, left());
        await this.exec(vm, b, script(COPY_SCRIPT, {
          ARCHIVE: inGuest, Z: head[0] === 0x1f && head[1] === 0x8b ? "z" : "", SRC: args[0]!,
          DEST: posix.resolve(s.workdir, args[1]!) + (args[1]!.endsWith("/") ? "/" : ""), OWNER: args[2] || s.user, MODE: args[3] ?? "",
        }), left(), step, signal);
        return;
      }
      default:
        return; // ENV, ARG, EXPOSE, LABEL, VOLUME: state only (see after()).
    }
  }

  /** Runs a command in the build VM, its output into the build's log; a non-zero exit fails the step. */
  private async exec(vm: BuildVm, b: Build, spec: ProcessSpec, timeoutMs: number, step: string, signal: AbortSignal): Promise<void> {
    let tail = "";
    const lines = new LineLog((l) => b.log("info", l, step));
    const onOutput = (text: string) => {
      tail = (tail + text).slice(-OUTPUT_TAIL);
      lines.push(text);
    };
    let result;
    try {
      result = await runProcess(vm.envdUrl, null, spec, { timeoutMs, signal, onOutput });
    } catch (e) {
      if (signal.aborted) throw signal.reason;
      throw new StepFailed(`step ${step}: ${(e as Error).message}`, step);
    }
    lines.flush();
    if (result.exitCode !== 0) {
      const what = spec.args[0] === "-lc" ? spec.args[1] : spec.cmd === BUSYBOX ? spec.args[0] : [spec.cmd, ...spec.args].join(" ");
      throw new StepFailed(`step ${step} (${what}) failed: ${result.status || `exit code ${result.exitCode}`}; output:\n${tail.trimEnd()}`, step);
    }
  }

  /** startCmd in the background (its output logged until the checkpoint), then readyCmd until it passes. */
  private async startAndWait(vm: BuildVm, shell: Shell, b: Build, spec: BuildSpec, s: StepState, deadline: number, signal: AbortSignal): Promise<void> {
    const readyCmd = spec.readyCmd || (spec.startCmd ? this.o.defaultReadyCmd : undefined);
    if (!spec.startCmd && !readyCmd) return;
    const env = { ...s.env };
    const startAbort = new AbortController();
    const startLines = new LineLog((l) => b.log("info", `[start] ${l}`, "finalize"));
    let startEnded: string | undefined;
    if (spec.startCmd) {
      b.log("info", `Start command: ${spec.startCmd}`, "finalize");
      const stream = runProcess(vm.envdUrl, null, { ...shell.run(spec.startCmd), user: s.user, cwd: s.workdir, envs: env }, {
        signal: AbortSignal.any([startAbort.signal, signal]),
        onOutput: (t) => startLines.push(t),
      });
      stream.then((r) => { startEnded = `the start command exited (${r.status})`; b.log("info", startEnded, "finalize"); }, () => {});
    }
    try {
      if (!readyCmd) return;
      b.log("info", `Waiting for the ready command: ${readyCmd}`, "finalize");
      const until = Math.min(deadline, Date.now() + this.o.readyTimeoutMs);
      for (;;) {
        if (signal.aborted) throw signal.reason;
        try {
          await this.exec(vm, b, { ...shell.run(readyCmd), user: s.user, cwd: s.workdir, envs: env }, Math.max(1000, until - Date.now()), "finalize", signal);
          b.log("info", "Ready", "finalize");
          return;
        } catch (e) {
          if (!(e instanceof StepFailed)) throw e;
        }
        if (Date.now() + this.o.readyIntervalMs > until)
          throw new StepFailed(`the ready command did not succeed within ${Math.round(this.o.readyTimeoutMs / 1000)} s${startEnded ? ` (${startEnded})` : ""}`, "finalize");
        await Bun.sleep(this.o.readyIntervalMs);
      }
    } finally {
      // Only our stream goes: the start command keeps running into the checkpoint.
      startAbort.abort();
    }
  }

  private publish(req: Request, b: Build, parent: { envdVersion: string; size: { cpuCount: number; memoryMB: number; diskSizeMB: number }; command: ImageCommand }, stack: TemplateLayer[], cp: TemplateRecord["checkpoint"], s: StepState, spec: BuildSpec): void {
    const old = this.orch.templates.resolve(req.templateId);
    // One build per template is kept: its earlier tags move to it with the requested ones.
    const now = Date.now();
    const tags = new Map((old?.config?.tags ?? []).map((t) => [t.tag, t]));
    for (const t of ["default", ...req.tags]) tags.set(t, { tag: t, createdAt: now });
    const config: TemplateConfig = {
      env: s.env, user: s.user, workdir: s.workdir, startCmd: spec.startCmd, readyCmd: spec.readyCmd,
      exposed: s.exposed, labels: s.labels, buildId: b.buildId, tags: [...tags.values()],
      ...(parent.command.entrypoint.length + parent.command.cmd.length > 0 ? parent.command : {}),
    };
    const rec: TemplateRecord = {
      id: req.templateId, alias: req.name, kind: "template", names: [...tags.keys()].map((t) => `${req.name}:${t}`),
      cpuCount: parent.size.cpuCount, memoryMB: parent.size.memoryMB, diskSizeMB: parent.size.diskSizeMB,
      layers: stack, checkpoint: cp, sourceSandboxId: null, envdVersion: parent.envdVersion, createdAt: now, config,
    };
    this.orch.publishTemplate(rec);
    this.pendingNames.delete(req.name);
    if (!req.imported) this.o.onReady?.(rec);
  }

  /**
   * A template another node of the cluster built, from the image it pushed (`ref`), under the same
   * ID and name, with its start and ready commands: built here on first use (a lazy pull, a boot, a
   * checkpoint), joined by concurrent callers. Resolves to the template's ID.
   */
  importTemplate(t: { id: string; alias: string; ref: string; cpuCount: number; memoryMB: number; startCmd?: string; readyCmd?: string }): Promise<string> {
    const ready = this.orch.templates.resolve(t.id);
    if (ready?.kind === "template") return Promise.resolve(ready.id);
    const cur = this.coldBuilds.get(t.id);
    if (cur) return cur;
    const built = (async () => {
      const { templateID, buildID } = this.request({ name: t.alias, cpuCount: t.cpuCount, memoryMB: t.memoryMB }, t.id);
      if (templateID !== t.id) throw new TemplateBuildError(409, `'${t.alias}' is template ${templateID} on this node, not ${t.id}`);
      this.requests.get(templateID)!.imported = true;
      await this.start(templateID, buildID, { fromImage: t.ref, ...(t.startCmd ? { startCmd: t.startCmd } : {}), ...(t.readyCmd ? { readyCmd: t.readyCmd } : {}) });
      const b = this.build(templateID, buildID);
      const until = Date.now() + this.o.buildTimeoutMs + 60_000;
      while (!b.finished()) {
        if (Date.now() > until) throw new TemplateBuildError(500, `the import of ${t.ref} did not finish`);
        await Bun.sleep(COLD_POLL_MS);
      }
      if (b.status === "error") throw new TemplateBuildError(502, `template ${t.alias} from ${t.ref}: ${b.reason?.message ?? "the build failed"}`);
      return templateID;
    })().finally(() => this.coldBuilds.delete(t.id));
    this.coldBuilds.set(t.id, built);
    return built;
  }

  // ─── push ──────────────────────────────────────────────────────────────────

  /**
   * POST /templates/{id}/push: the template's rootfs layers (its build stack, base first; a
   * snapshot's sealed stack) and its env, user and working directory to `ref` as an overlaybd
   * image. A registry's refusal of the credentials is a 400 (not the node's own 401).
   */
  async push(ref: string, to: string, auth?: { username: string; password: string }): Promise<PushResult> {
    const t = this.orch.templates.resolve(ref);
    if (!t) throw new TemplateBuildError(404, `template '${ref}' not found`);
    if (!this.o.images?.push) throw new TemplateBuildError(400, "this node cannot push images (no image source configured)");
    const c = t.config;
    const config: PushedConfig = {
      env: { ...c?.env }, user: c?.user ?? "", workdir: c?.workdir ?? "",
      ...(c?.entrypoint ? { entrypoint: c.entrypoint } : {}), ...(c?.cmd ? { cmd: c.cmd } : {}),
      ...(c?.exposed ? { exposed: c.exposed } : {}), ...(c?.labels ? { labels: c.labels } : {}),
    };
    try {
      // The boot trace recorded where the template was made goes with it (start_traces.ts BOOT_TRACE).
      const rootfsTrace = t.checkpoint ? join(t.checkpoint.dir, BOOT_TRACE) : undefined;
      return await this.o.images.push(to, { layers: t.layers, config, ...(rootfsTrace ? { rootfsTrace } : {}) }, auth);
    } catch (e) {
      const status = (e as { status?: unknown }).status;
      if (typeof status !== "number") throw e;
      // A registry's 401 or 403 is a refused credential (400); the node's own refusal (code Forbidden: s3_buckets, insecure_registries) stays 403.
      const refusedByNode = (e as { code?: unknown }).code === "Forbidden";
      throw new TemplateBuildError((status === 401 || status === 403) && !refusedByNode ? 400 : status, (e as Error).message);
    }
  }

  // ─── tags ──────────────────────────────────────────────────────────────────

  private retag(ref: string, change: (tags: Map<string, { tag: string; createdAt: number }>) => void): TemplateRecord {
    const t = this.orch.templates.resolve(ref);
    if (!t || t.kind !== "template") throw new TemplateBuildError(404, `template '${ref}' not found`);
    const tags = new Map((t.config?.tags ?? [{ tag: "default", createdAt: t.createdAt }]).map((x) => [x.tag, x]));
    change(tags);
    const config: TemplateConfig = { env: {}, ...t.config, tags: [...tags.values()] };
    const rec = { ...t, config, names: [...tags.keys()].map((x) => `${t.alias ?? t.id}:${x}`) };
    this.orch.templates.upsert(rec);
    return rec;
  }

  /** POST /templates/tags: `target` is `name:tag` of the build to tag. */
  assignTags(target: string, tags: string[]): { buildID: string; tags: string[] } {
    if (tags.length === 0) throw new TemplateBuildError(400, "tags: at least one");
    for (const t of tags) if (!TAG.test(t)) throw new TemplateBuildError(400, `tag '${t}': letters, digits, '_', '.', '-', at most 128`);
    const now = Date.now();
    const rec = this.retag(target, (m) => { for (const t of tags) m.set(t, { tag: t, createdAt: now }); });
    return { buildID: rec.config?.buildId ?? rec.id, tags };
  }

  /** DELETE /templates/tags. `default` always names the template's build and is not removed. */
  removeTags(name: string, tags: string[]): void {
    if (tags.includes("default")) throw new TemplateBuildError(400, "the tag 'default' cannot be removed");
    const missing: string[] = [];
    this.retag(splitName(name).name, (m) => { for (const t of tags) if (!m.delete(t)) missing.push(t); });
    if (missing.length) throw new TemplateBuildError(404, `tag(s) not found: ${missing.join(", ")}`);
  }

  /** GET /templates/{templateID}/tags. */
  listTags(ref: string): { tag: string; buildID: string; createdAt: string }[] {
    const t = this.orch.templates.resolve(ref);
    if (!t || t.kind !== "template") throw new TemplateBuildError(404, `template '${ref}' not found`);
    const buildID = t.config?.buildId ?? t.id;
    return (t.config?.tags ?? [{ tag: "default", createdAt: t.createdAt }]).map((x) => ({ tag: x.tag, buildID, createdAt: new Date(x.createdAt).toISOString() }));
  }
}

/** Output as log lines: split at newlines, a line longer than LOG_LINE (a progress bar) cut into pieces. */
class LineLog {
  private partial = "";
  constructor(private readonly emit: (line: string) => void) {}

  push(text: string): void {
    const lines = (this.partial + text).split("\n");
    this.partial = lines.pop()!;
    while (this.partial.length > LOG_LINE) {
      lines.push(this.partial.slice(0, LOG_LINE));
      this.partial = this.partial.slice(LOG_LINE);
    }
    for (const l of lines) for (let i = 0; i < Math.max(1, l.length); i += LOG_LINE) this.emit(l.slice(i, i + LOG_LINE));
  }

  flush(): void {
    if (this.partial) this.emit(this.partial);
    this.partial = "";
  }
}

/** The guest's flush before a layer is sealed: the tools disk's sync, so any image has one. */
const SYNC: ProcessSpec = { cmd: BUSYBOX, args: ["sync"], user: "root", cwd: "/" };

/** How RUN, startCmd and readyCmd run: bash -lc (E2B's). */
interface Shell {
  run(cmd: string): { cmd: string; args: string[] };
}

/** What envd supplies where the image lacks it, one line each (guest/envd/toolbox.ts SUPPLIED_REPORT). */
const SUPPLIED_REPORT = "/run/aenv/supplied";
/** The report is a handful of short lines; more is cut. */
const SUPPLIED_REPORT_MAX = 4096;

/**
 * `/bin/bash -lc`, which envd runs with the tools disk's busybox sh in an image without bash; what
 * envd supplies for the image (that shell, accounts, sudo) goes to `log`, a line each.
 */
async function loginShell(vm: BuildVm, log: (line: string) => void): Promise<Shell> {
  let report = "";
  await runProcess(vm.envdUrl, null, { cmd: BUSYBOX, args: ["cat", SUPPLIED_REPORT], user: "root", cwd: "/" }, {
    timeoutMs: SHORT_CMD_MS,
    onOutput: (t, stream) => { if (stream === "stdout") report = (report + t).slice(0, SUPPLIED_REPORT_MAX); },
  });
  for (const line of report.split("\n")) if (line.trim()) log(line);
  return { run: (cmd) => ({ cmd: "/bin/bash", args: ["-lc", cmd] }) };
}

/** An image's Entrypoint and Cmd (a template built on one keeps its image's). */
interface ImageCommand {
  entrypoint: string[];
  cmd: string[];
}

/** Entrypoint + Cmd as one shell command line, each word single-quoted where it needs it. */
function startCmdOf(c: ImageCommand): string {
  const words = [...c.entrypoint, ...c.cmd];
  if (words.length === 0) throw new StepFailed("imageCmd: the image has no Entrypoint or Cmd to start", "base");
  return words.map((w) => (/^[A-Za-z0-9_./:=@%+,-]+$/.test(w) ? w : `'${w.replaceAll("'", "'\\''")}'`)).join(" ");
}

/** The state after a step (the next step's `before`). */
function after(p: PlannedStep): StepState {
  const s = { ...p.before, env: { ...p.before.env }, args: { ...p.before.args }, labels: { ...p.before.labels }, exposed: [...p.before.exposed] };
  const a = p.step.args ?? [];
  switch (p.step.type) {
    case "ENV": for (let i = 0; i + 1 < a.length; i += 2) s.env[a[i]!] = a[i + 1]!; break;
    case "ARG": for (let i = 0; i + 1 < a.length; i += 2) s.args[a[i]!] = a[i + 1]!; break;
    case "LABEL": for (let i = 0; i + 1 < a.length; i += 2) s.labels[a[i]!] = a[i + 1]!; break;
    case "EXPOSE": s.exposed.push(...a); break;
    case "WORKDIR": s.workdir = posix.resolve(p.before.workdir, a[0]!); break;
    case "USER": s.user = a[0]!; break;
  }
  return s;
}


/** WORKDIR: the directory is made (owned by the step's user) when missing. */
const WORKDIR_SCRIPT = '[ -d "$D" ] || { mkdir -p "$D" && chown "$U:$(id -g "$U")" "$D"; }';

/** USER: a missing account is made (useradd when the image has it, else busybox adduser). */
const USER_SCRIPT = `id -u "$U" >/dev/null 2>&1 && exit 0
if command -v useradd >/dev/null 2>&1; then useradd -m -s "$(command -v bash || echo /bin/sh)" "$U"; else adduser -D -s /bin/sh "$U"; fi`;

/**
 * COPY in the guest, as root (POSIX sh): the archive (Z=z when gzip) is unpacked with its modes
 * into a scratch directory, owned by OWNER (and given MODE when set), and SRC (a path or glob
 * relative to the build context) is copied to DEST as Docker does: a directory's contents into
 * DEST, one file to DEST (or into it when DEST ends in '/' or is a directory), several into DEST/.
 */
const COPY_SCRIPT = `set -eu
t=$(mktemp -d /tmp/.aenv-copy.XXXXXX)
trap 'rm -rf "$t" "$ARCHIVE"' EXIT
tar -x\${Z}opf "$ARCHIVE" -C "$t"
chown -R "$OWNER:$(id -g "$OWNER")" "$t"
if [ -n "$MODE" ]; then chmod -R "$MODE" "$t"; fi
cd "$t"
IFS=
set -- $SRC
if [ "$#" -eq 1 ] && [ ! -e "$1" ] && [ ! -L "$1" ]; then echo "COPY: nothing matches $SRC" >&2; exit 1; fi
many=0
[ "$#" -gt 1 ] && many=1
case "$DEST" in */) many=1 ;; esac
if [ "$many" = 1 ]; then
  mkdir -p "$DEST"
  for s in "$@"; do if [ -d "$s" ] && [ ! -L "$s" ]; then cp -a "$s/." "$DEST/"; else cp -a "$s" "$DEST/"; fi; done
elif [ -d "$1" ] && [ ! -L "$1" ]; then mkdir -p "$DEST"; cp -a "$1/." "$DEST/"
elif [ -d "$DEST" ]; then cp -a "$1" "$DEST/"
else mkdir -p "$(dirname "$DEST")"; cp -a "$1" "$DEST"
fi
`;
