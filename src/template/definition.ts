// A template's definition: a folder with template.json (what to install, the VM's size) and
// setup.sh (run inside the new root). Loaded, checked field by field, and hashed into the cache key.
import { join } from "node:path";

/** The steps of a build, in order; progress and errors name them. */
export type BuildStep = "resolving" | "bootstrap" | "setup" | "image" | "layer";

export type TemplateBuildErrorCode =
  | "BadDefinition" // template.json or setup.sh missing, unreadable or out of bounds
  | "MissingTool" // mmdebstrap, mkfs.ext4 or chroot not on PATH
  | "NotRoot" // the build needs root (mmdebstrap's root mode, chroot, file owners)
  | "SpawnFailed" // a tool could not be started
  | "StepFailed" // a tool exited non-zero
  | "Timeout" // a tool ran past its step's limit and was killed
  | "CacheCorrupt"; // a cache entry that cannot be read back or replaced

export class TemplateBuildError extends Error {
  constructor(
    readonly code: TemplateBuildErrorCode,
    /** The step that failed. */
    readonly step: BuildStep,
    message: string,
    /** The last lines the failing tool wrote (stdout and stderr), bounded. */
    readonly outputTail = "",
  ) {
    super(`template build, step ${step}: ${message}${outputTail ? `\n${outputTail}` : ""}`);
    this.name = "TemplateBuildError";
  }
}

export interface TemplateDefinition {
  name: string;
  /** Debian suite handed to mmdebstrap, e.g. bookworm. */
  suite: string;
  /** mmdebstrap variant; minbase = Essential packages and apt. */
  variant: "minbase" | "essential" | "required" | "important" | "standard";
  /** sources.list lines for the build and, as written, for the image. */
  mirrors: string[];
  packages: string[];
  /** Size of the ext4 image (sparse: only the used blocks take space). */
  diskSizeMB: number;
  cpuCount: number;
  memoryMB: number;
}

export interface LoadedDefinition {
  dir: string;
  definition: TemplateDefinition;
  setupScript: Uint8Array;
  /** sha256 (hex) of the definition files and the builder's format version. */
  key: string;
}

/** Bumped when the builder makes a different image from the same definition. */
const BUILDER_VERSION = "aenv-template-debian-2";
/** Bounds on the definition files: both are a few KiB; anything larger is not a definition. */
const MAX_DEFINITION_BYTES = 64 << 10;
const MAX_PACKAGES = 1000;
/** Debian package names (policy 5.6.1), with an optional =version or /suite. */
const PACKAGE = /^[a-z0-9][a-z0-9+.-]+(?:[=/][A-Za-z0-9+.~:-]+)?$/;
const NAME = /^[a-z0-9][a-z0-9_-]{0,62}$/;
const SUITE = /^[a-z][a-z0-9-]{1,31}$/;
const MIRROR = /^deb(?:-src)? (?:\[[^\]\n]*\] )?https?:\/\/[^\s]+ [a-z][a-z0-9-]* [a-z0-9 -]+$/;
const VARIANTS = ["minbase", "essential", "required", "important", "standard"] as const;

async function readBounded(path: string): Promise<Uint8Array> {
  const f = Bun.file(path);
  if (!(await f.exists())) throw new TemplateBuildError("BadDefinition", "resolving", `${path} does not exist`);
  if (f.size > MAX_DEFINITION_BYTES) throw new TemplateBuildError("BadDefinition", "resolving", `${path} is ${f.size} bytes (at most ${MAX_DEFINITION_BYTES})`);
  return new Uint8Array(await f.arrayBuffer());
}

function intIn(v: unknown, field: string, min: number, max: number): number {
  if (typeof v !== "number" || !Number.isInteger(v) || v < min || v > max) {
    throw new TemplateBuildError("BadDefinition", "resolving", `template.json: ${field} must be an integer in [${min}, ${max}], got ${JSON.stringify(v)}`);
  }
  return v;
}

function stringsMatching(v: unknown, field: string, re: RegExp, max: number): string[] {
  if (!Array.isArray(v) || v.length === 0 || v.length > max) {
    throw new TemplateBuildError("BadDefinition", "resolving", `template.json: ${field} must be a list of 1..${max} strings`);
  }
  for (const s of v) {
    if (typeof s !== "string" || !re.test(s)) throw new TemplateBuildError("BadDefinition", "resolving", `template.json: ${field} entry ${JSON.stringify(s)} is not valid`);
  }
  return v as string[];
}

export function parseDefinition(text: string): TemplateDefinition {
  let raw: unknown;
  try {
    raw = JSON.parse(text);
  } catch (e) {
    throw new TemplateBuildError("BadDefinition", "resolving", `template.json is not JSON: ${(e as Error).message}`);
  }
  if (typeof raw !== "object" || raw === null || Array.isArray(raw)) throw new TemplateBuildError("BadDefinition", "resolving", "template.json must be an object");
  const o = raw as Record<string, unknown>;
  const known = new Set(["name", "suite", "variant", "mirrors", "packages", "diskSizeMB", "cpuCount", "memoryMB"]);
  for (const k of Object.keys(o)) if (!known.has(k)) throw new TemplateBuildError("BadDefinition", "resolving", `template.json: unknown key ${JSON.stringify(k)}`);
  if (typeof o.name !== "string" || !NAME.test(o.name)) throw new TemplateBuildError("BadDefinition", "resolving", `template.json: name must match ${NAME}`);
  if (typeof o.suite !== "string" || !SUITE.test(o.suite)) throw new TemplateBuildError("BadDefinition", "resolving", `template.json: suite must match ${SUITE}`);
  const variant = o.variant ?? "minbase";
  if (!VARIANTS.includes(variant as TemplateDefinition["variant"])) throw new TemplateBuildError("BadDefinition", "resolving", `template.json: variant must be one of ${VARIANTS.join(", ")}`);
  return {
    name: o.name,
    suite: o.suite,
    variant: variant as TemplateDefinition["variant"],
    mirrors: stringsMatching(o.mirrors, "mirrors", MIRROR, 16),
    packages: stringsMatching(o.packages, "packages", PACKAGE, MAX_PACKAGES),
    // 256 MiB holds a minbase root; 64 GiB is the node's largest disk.
    diskSizeMB: intIn(o.diskSizeMB, "diskSizeMB", 256, 65536),
    cpuCount: intIn(o.cpuCount, "cpuCount", 1, 64),
    memoryMB: intIn(o.memoryMB, "memoryMB", 128, 262144),
  };
}

/** Read and check dir/template.json and dir/setup.sh; BadDefinition names what is wrong. */
export async function loadDefinition(dir: string): Promise<LoadedDefinition> {
  const json = await readBounded(join(dir, "template.json"));
  const setupScript = await readBounded(join(dir, "setup.sh"));
  const definition = parseDefinition(new TextDecoder().decode(json));
  const h = new Bun.CryptoHasher("sha256");
  // Length-prefixed parts, so moving bytes between the files changes the key.
  for (const part of [new TextEncoder().encode(BUILDER_VERSION), json, setupScript]) h.update(`${part.length}:`).update(part);
  return { dir, definition, setupScript, key: h.digest("hex") };
}
