// A one-stage Dockerfile as an E2B template build: FROM → fromImage; RUN, ENV, ARG, WORKDIR, USER,
// COPY/ADD (local sources), EXPOSE, LABEL, VOLUME → build steps in file order; CMD/ENTRYPOINT →
// the start command. Steps go through the e2b SDK's Template builder (it hashes and uploads COPY
// sources); the kinds it has no method for (ARG, which stays build-time only, EXPOSE, LABEL,
// VOLUME) are added as the API takes them. Anything else is refused with its line number.
// As E2B's own conversion does, the steps run as root in / unless the file says otherwise, and
// without USER or WORKDIR the template's sandboxes run as `user` in /home/user.

import { Template } from "e2b";

/** A start command without a ready command is taken as ready after this (E2B's default). */
export const DEFAULT_READY_CMD = "sleep 20";

export class DockerfileError extends Error {
  override name = "DockerfileError";
}

interface Instruction {
  keyword: string;
  /** `--name=value` options before the arguments. */
  flags: Map<string, string>;
  /** The arguments as written (continuations joined). */
  rest: string;
  line: number;
}

/** Lines joined at trailing backslashes; comments and blank lines dropped. */
function instructions(text: string): Instruction[] {
  const out: Instruction[] = [];
  const lines = text.split(/\r?\n/);
  for (let i = 0; i < lines.length; i++) {
    const first = i + 1;
    let cur = lines[i]!;
    if (/^\s*(#|$)/.test(cur)) continue;
    // A comment or blank line inside a continuation is dropped; the continuation goes on.
    while (/\\\s*$/.test(cur) && i + 1 < lines.length) {
      const next = lines[++i]!;
      if (!/^\s*(#|$)/.test(next)) cur = cur.replace(/\\\s*$/, "") + next;
    }
    cur = cur.replace(/\\\s*$/, "");
    const m = /^\s*(\S+)\s*(.*)$/.exec(cur)!;
    let rest = m[2]!.trim();
    const flags = new Map<string, string>();
    for (let f = /^--([a-z-]+)(?:=(\S*))?\s*/.exec(rest); f; f = /^--([a-z-]+)(?:=(\S*))?\s*/.exec(rest)) {
      flags.set(f[1]!, f[2] ?? "");
      rest = rest.slice(f[0].length);
    }
    if (/<<-?\s*["']?\w+/.test(rest) && ["RUN", "COPY", "ADD"].includes(m[1]!.toUpperCase())) {
      throw new DockerfileError(`line ${first}: heredocs are not supported`);
    }
    out.push({ keyword: m[1]!.toUpperCase(), flags, rest, line: first });
  }
  return out;
}

/** Shell-like words: quotes group and are removed, a backslash escapes the next character. */
export function words(s: string): string[] {
  const out: string[] = [];
  let cur: string | null = null;
  for (let i = 0; i < s.length; i++) {
    const c = s[i]!;
    if (c === "\\" && i + 1 < s.length) cur = (cur ?? "") + s[++i];
    else if (c === '"' || c === "'") {
      const end = s.indexOf(c, i + 1);
      if (end < 0) throw new DockerfileError(`unterminated ${c} in ${JSON.stringify(s)}`);
      cur = (cur ?? "") + s.slice(i + 1, end);
      i = end;
    } else if (/\s/.test(c)) {
      if (cur !== null) out.push(cur);
      cur = null;
    } else cur = (cur ?? "") + c;
  }
  if (cur !== null) out.push(cur);
  return out;
}

/** A JSON array of strings (exec form), or undefined for the shell form. */
function execForm(rest: string, line: number): string[] | undefined {
  if (!rest.startsWith("[")) return undefined;
  let v: unknown;
  try {
    v = JSON.parse(rest);
  } catch {
    return undefined; // Docker too takes a malformed array as the shell form
  }
  if (!Array.isArray(v) || v.some((x) => typeof x !== "string")) throw new DockerfileError(`line ${line}: expected an array of strings`);
  return v as string[];
}

const shellQuote = (w: string) => (/^[A-Za-z0-9_\/.:=@%+,-]+$/.test(w) ? w : `'${w.replace(/'/g, `'\\''`)}'`);
/** A command as one shell line: the shell form as written, the exec form quoted word by word. */
const commandLine = (rest: string, line: number) => execForm(rest, line)?.map(shellQuote).join(" ") ?? rest;

/** `k=v k2="v 2"`, or ENV's old `k v with spaces`, as [k, v, k2, v2]. */
function pairs(i: Instruction, allowBare: boolean): string[] {
  const w = words(i.rest);
  if (w.length === 0) throw new DockerfileError(`line ${i.line}: ${i.keyword} needs arguments`);
  if (i.keyword === "ENV" && !w[0]!.includes("=")) return [w[0]!, i.rest.slice(i.rest.indexOf(w[0]!) + w[0]!.length).trim()];
  return w.flatMap((kv) => {
    const eq = kv.indexOf("=");
    if (eq > 0) return [kv.slice(0, eq), kv.slice(eq + 1)];
    if (allowBare) return [kv, ""];
    throw new DockerfileError(`line ${i.line}: ${JSON.stringify(kv)} is not key=value`);
  });
}

function noFlags(i: Instruction, allowed: string[] = []): void {
  for (const f of i.flags.keys()) if (!allowed.includes(f)) throw new DockerfileError(`line ${i.line}: ${i.keyword} --${f} is not supported`);
}

/** What `aenv build` passes to the SDK. */
export type DockerTemplate = Parameters<typeof Template.build>[0];

/**
 * The Dockerfile `text` as a template whose COPY sources are read from `context`. `readyCmd`
 * is used when the file has a CMD or ENTRYPOINT (default: DEFAULT_READY_CMD).
 */
export function dockerfileTemplate(text: string, o: { context: string; ignore?: string[]; readyCmd?: string }): DockerTemplate {
  const all = instructions(text);
  const froms = all.filter((i) => i.keyword === "FROM");
  if (froms.length !== 1) throw new DockerfileError(froms.length === 0 ? "no FROM: the image to start from" : `line ${froms[1]!.line}: one stage only (a second FROM)`);
  if (all[0]!.keyword !== "FROM" && all[0]!.keyword !== "ARG") throw new DockerfileError(`line ${all[0]!.line}: FROM must come first`);
  const from = froms[0]!;
  noFlags(from, ["platform"]);
  const fromWords = words(from.rest);
  if (fromWords.length !== 1 && !(fromWords.length === 3 && fromWords[1]!.toUpperCase() === "AS")) throw new DockerfileError(`line ${from.line}: expected FROM IMAGE [AS NAME]`);

  const tpl = Template({ fileContextPath: o.context, fileIgnorePatterns: o.ignore ?? [] }).fromImage(fromWords[0]!);
  // The SDK's builder has no method for these kinds; the API takes them as {type, args}.
  const raw = tpl as unknown as { instructions: { type: string; args: string[]; force: boolean }[]; collectStackTrace(): void };
  const step = (type: string, args: string[]) => {
    raw.instructions.push({ type, args, force: false });
    raw.collectStackTrace();
  };
  tpl.setUser("root");
  tpl.setWorkdir("/");
  let userSet = false;
  let workdirSet = false;
  let entrypoint: { line: string; exec: boolean } | undefined;
  let cmd: string | undefined;
  for (const i of all) {
    switch (i.keyword) {
      case "FROM":
        break;
      case "RUN":
        noFlags(i);
        tpl.runCmd(commandLine(i.rest, i.line));
        break;
      case "ENV":
        noFlags(i);
        tpl.setEnvs(Object.fromEntries(chunk(pairs(i, false))));
        break;
      case "ARG":
        noFlags(i);
        if (i.line < from.line) break; // an ARG before FROM only parameterizes FROM, which takes none here
        step("ARG", pairs(i, true));
        break;
      case "LABEL":
        noFlags(i);
        step("LABEL", pairs(i, false));
        break;
      case "EXPOSE":
        noFlags(i);
        step("EXPOSE", words(i.rest));
        break;
      case "VOLUME":
        noFlags(i);
        step("VOLUME", execForm(i.rest, i.line) ?? words(i.rest));
        break;
      case "WORKDIR":
        noFlags(i);
        tpl.setWorkdir(words(i.rest)[0] ?? "/");
        workdirSet = true;
        break;
      case "USER":
        noFlags(i);
        tpl.setUser((words(i.rest)[0] ?? "").split(":")[0]!);
        userSet = true;
        break;
      case "COPY":
      case "ADD": {
        noFlags(i, ["chown", "chmod"]);
        const args = execForm(i.rest, i.line) ?? words(i.rest);
        if (args.length < 2) throw new DockerfileError(`line ${i.line}: ${i.keyword} needs SRC... DEST`);
        const dest = args[args.length - 1]!;
        const user = i.flags.get("chown")?.split(":")[0];
        const chmod = i.flags.get("chmod");
        if (chmod !== undefined && !/^[0-7]{3,4}$/.test(chmod)) throw new DockerfileError(`line ${i.line}: --chmod=${chmod}: expected octal digits`);
        for (const src of args.slice(0, -1)) {
          if (/^[a-z]+:\/\//i.test(src)) throw new DockerfileError(`line ${i.line}: ${i.keyword} from a URL is not supported (local sources only)`);
          tpl.copy(src, dest, { user, mode: chmod === undefined ? undefined : parseInt(chmod, 8) });
        }
        break;
      }
      case "CMD":
        cmd = commandLine(i.rest, i.line);
        break;
      case "ENTRYPOINT":
        entrypoint = { line: commandLine(i.rest, i.line), exec: execForm(i.rest, i.line) !== undefined };
        break;
      case "MAINTAINER":
        break; // deprecated metadata: nothing to build
      default:
        throw new DockerfileError(`line ${i.line}: ${i.keyword} is not supported (FROM, RUN, ENV, ARG, WORKDIR, USER, COPY, ADD, EXPOSE, LABEL, VOLUME, CMD, ENTRYPOINT)`);
    }
  }
  if (!userSet) tpl.setUser("user");
  if (!workdirSet) tpl.setWorkdir("/home/user");
  // Docker's rule: an exec-form ENTRYPOINT takes CMD as its arguments; a shell-form one ignores CMD.
  const start = entrypoint ? (entrypoint.exec && cmd ? `${entrypoint.line} ${cmd}` : entrypoint.line) : cmd;
  return start === undefined ? tpl : tpl.setStartCmd(start, o.readyCmd ?? DEFAULT_READY_CMD);
}

function chunk(flat: string[]): [string, string][] {
  const out: [string, string][] = [];
  for (let i = 0; i + 1 < flat.length; i += 2) out.push([flat[i]!, flat[i + 1]!]);
  return out;
}
