// `aenv cp`: files and directories between this machine and a sandbox, through envd's file API.
// One side is `ID:PATH`, the other a local path (or `-` for stdin/stdout). As with cp(1), a
// destination that is an existing directory receives the source under its own name. Regular files
// and directories are copied; symlinks and special files are skipped with a note. A downloaded
// file keeps its permission bits (setuid, setgid and sticky dropped) and appears only once complete.
// Names and paths the sandbox answers with are the guest's: each is checked before it names a
// local file (one name per part, never empty, `.`, `..`, or with `/` or NUL; inside the
// destination); a copy out with any that is not writes nothing and fails with UnsafePath.

import { chmodSync, mkdirSync, readdirSync, statSync } from "node:fs";
import { basename, isAbsolute, join, relative, resolve, sep } from "node:path";
import { posix } from "node:path";
import { FileType, type Sandbox } from "e2b";
import { UsageError, type ParsedArgs } from "./args.ts";
import { NODE_OPTIONS, NodeError, onNode, openSandbox, resolveTarget, sandboxId } from "./node_client.ts";
import { withOutputs } from "./outputs.ts";
import type { Verb } from "./verbs.ts";

/** How deep a directory copy goes. */
const MAX_DEPTH = 64;

type Side = { id: string; path: string } | { local: string };

/** `ID:PATH` names a sandbox's file; a path starting with `/` or `.`, or without such a prefix, is local. */
function side(s: string): Side {
  const m = /^([a-z0-9]{1,64}):(.+)$/.exec(s);
  if (!m || s.startsWith("/") || s.startsWith(".")) return { local: s };
  return { id: sandboxId(m[1]!), path: m[2]! };
}

const skipped = (what: string, why: string) => void process.stderr.write(`aenv: skipped ${what}: ${why}\n`);

async function remoteIsDir(sbx: Sandbox, path: string): Promise<boolean> {
  return (await sbx.files.exists(path)) && (await sbx.files.getInfo(path)).type === FileType.DIR;
}

async function upload(sbx: Sandbox, local: string, remote: string): Promise<void> {
  if (local === "-") {
    await sbx.files.write(remote, Bun.stdin.stream());
    return;
  }
  const st = statSync(local);
  const target = (await remoteIsDir(sbx, remote)) ? posix.join(remote, basename(local)) : remote;
  if (st.isFile()) {
    await sbx.files.write(target, Bun.file(local));
    return;
  }
  if (!st.isDirectory()) throw new UsageError(`${local}: not a regular file or a directory`);
  const walk = async (dir: string, to: string, depth: number): Promise<void> => {
    await sbx.files.makeDir(to);
    if (depth >= MAX_DEPTH) {
      skipped(`${dir}/*`, `deeper than ${MAX_DEPTH} levels`);
      return;
    }
    for (const e of readdirSync(dir, { withFileTypes: true }).sort((x, y) => x.name.localeCompare(y.name))) {
      const from = join(dir, e.name);
      if (e.isDirectory()) await walk(from, posix.join(to, e.name), depth + 1);
      else if (e.isFile()) await sbx.files.write(posix.join(to, e.name), Bun.file(from));
      else skipped(from, "not a regular file or a directory");
    }
  };
  await walk(local, target, 0);
}

async function downloadFile(sbx: Sandbox, remote: string, local: string, mode: number): Promise<void> {
  const stream = await sbx.files.read(remote, { format: "stream" });
  await withOutputs({ outs: [local], inputs: [], force: true }, async ([tmp]) => {
    await Bun.write(tmp!, new Response(stream));
    chmodSync(tmp!, mode & 0o777);
  });
}

/** A refusal of what the sandbox answered: it would name a file outside the destination. */
const hostile = (what: string) => new NodeError("UnsafePath", `the sandbox answered ${what}: refusing to copy (a name must be one path part, not empty, '.' or '..', without '/' or NUL)`);

/** `name` as one part of a local path, or the refusal naming `where`. */
function guestName(name: string, where: string): string {
  if (name === "" || name === "." || name === ".." || name.includes("/") || name.includes("\0")) throw hostile(`${where} ${JSON.stringify(name)}`);
  return name;
}

/** The local path of `parts` under `root`, which it must stay under (the parts are checked names already). */
function under(root: string, parts: string[]): string {
  const to = join(root, ...parts);
  const rel = relative(resolve(root), resolve(to));
  if (rel === "" || rel === ".." || rel.startsWith(`..${sep}`) || isAbsolute(rel)) throw hostile(`a path that leaves ${root}: ${JSON.stringify(parts.join("/"))}`);
  return to;
}

async function download(sbx: Sandbox, remote: string, local: string): Promise<void> {
  const info = await sbx.files.getInfo(remote);
  if (local === "-") {
    if (info.type !== FileType.FILE) throw new UsageError(`${remote}: only a file can go to stdout`);
    for await (const chunk of await sbx.files.read(remote, { format: "stream" })) process.stdout.write(chunk);
    return;
  }
  // The source's own name comes from the sandbox too: as a name of the destination folder it is checked.
  const name = posix.basename(info.path);
  const target = statSync(local, { throwIfNoEntry: false })?.isDirectory() && name !== "" ? under(local, [guestName(name, "a source named")]) : local;
  if (info.type === FileType.FILE) return downloadFile(sbx, info.path, target, info.mode);
  if (info.type !== FileType.DIR) throw new UsageError(`${remote}: not a regular file or a directory`);
  const entries = (await sbx.files.list(info.path, { depth: MAX_DEPTH })).sort((x, y) => x.path.localeCompare(y.path));
  const prefix = `${info.path.replace(/\/+$/, "")}/`;
  // Every entry is checked before anything is written: its path is the listed folder's, then checked parts, the last its name.
  const planned = entries.map((e) => {
    guestName(e.name, "an entry named");
    if (!e.path.startsWith(prefix)) throw hostile(`an entry ${JSON.stringify(e.path)} outside ${JSON.stringify(info.path)}`);
    const parts = e.path.slice(prefix.length).split("/").filter((p) => p !== "").map((p) => guestName(p, `an entry ${JSON.stringify(e.path)} with a part`));
    if (parts.at(-1) !== e.name) throw hostile(`an entry named ${JSON.stringify(e.name)} at ${JSON.stringify(e.path)}`);
    return { e, to: under(target, parts) };
  });
  mkdirSync(target, { recursive: true });
  for (const { e, to } of planned) {
    if (e.type === FileType.DIR) mkdirSync(to, { recursive: true });
    else if (e.type === FileType.FILE) {
      mkdirSync(join(to, ".."), { recursive: true });
      await downloadFile(sbx, e.path, to, e.mode);
    } else skipped(`${e.path}`, "not a regular file or a directory");
  }
}

async function cp(a: ParsedArgs): Promise<void> {
  const [src, dst] = a.need(2, "SRC and DST").map(side);
  const t = await resolveTarget(a);
  if ("id" in src! && "local" in dst!) {
    const sbx = await openSandbox(t, src.id);
    return onNode(t, { kind: "sandbox", id: src.id }, () => download(sbx, src.path, dst.local));
  }
  if ("local" in src! && "id" in dst!) {
    const sbx = await openSandbox(t, dst.id);
    return onNode(t, { kind: "sandbox", id: dst.id }, () => upload(sbx, src.local, dst.path));
  }
  throw new UsageError("one side must be local and the other ID:PATH in a sandbox");
}

export const CP_VERB: Verb = {
  operands: "SRC DST",
  summary: "copy files and directories in (LOCAL ID:PATH) or out (ID:PATH LOCAL) of a sandbox",
  options: [...NODE_OPTIONS],
  notes: [
    "LOCAL may be - (stdin in, stdout out; files only). A destination that is a directory receives",
    "the source under its own name. Directories are copied recursively; symlinks and special files",
    "are skipped with a note. A local path containing ':' is written ./like:this. A paused sandbox",
    "is resumed first.",
  ].join("\n"),
  run: cp,
};
