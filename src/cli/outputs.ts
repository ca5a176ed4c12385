// Outputs of the aenv verbs: never an input, never an existing file without --force, and never
// seen half-written. Each is written under a temporary name in its own directory (so the final
// rename stays on one filesystem) and renamed into place only when the verb has succeeded. A
// failure removes the temporaries; a kill (Ctrl-C) leaves at most a hidden `.OUT.aenv-PID-*.tmp`.
// No signal handler: I/O chains of microtasks would hold it off until the verb ends, so Ctrl-C
// would not stop anything.

import { randomBytes } from "node:crypto";
import { existsSync, renameSync, rmSync, statSync, unlinkSync } from "node:fs";
import { basename, dirname, join } from "node:path";
import { UsageError } from "./args.ts";

/** Which file a path names, after following links: device and inode, not the spelling of the path. */
export const fileIdentity = (p: string) => {
  const st = statSync(p, { throwIfNoEntry: false });
  return st ? `${st.dev}:${st.ino}` : undefined;
};

/** A fresh name next to `path`, hidden, that says who made it. */
function tempNameFor(path: string): string {
  return join(dirname(path), `.${basename(path)}.aenv-${process.pid}-${randomBytes(4).toString("hex")}.tmp`);
}

export interface OutputSpec {
  /** Final paths, renamed into place in this order. */
  outs: string[];
  /** Every file the verb reads: no output may be one of them, whatever --force says. */
  inputs: string[];
  /** Replace outputs that exist. */
  force: boolean;
}

/**
 * Run `write` with one temporary path per output (plus `scratch()` names for intermediates),
 * then rename each temporary over its output. On failure every temporary is removed and no
 * output has changed. An output the verb did not produce (e.g. a sparse layer's index) is
 * removed if an old one was there, so no stale file is left beside the new ones.
 */
export async function withOutputs<T>(spec: OutputSpec, write: (tmps: string[], scratch: () => string) => Promise<T>): Promise<T> {
  const inputIds = new Set(spec.inputs.map(fileIdentity).filter((x) => x !== undefined));
  for (const out of spec.outs) {
    const id = fileIdentity(out);
    if (id === undefined) continue;
    if (inputIds.has(id)) throw new UsageError(`output ${out} is also an input`);
    if (statSync(out).isDirectory()) throw new UsageError(`output ${out} is a directory`);
    if (!spec.force) throw new UsageError(`output ${out} exists (--force replaces it)`);
  }
  const temps: string[] = [];
  const make = (path: string) => {
    const t = tempNameFor(path);
    temps.push(t);
    return t;
  };
  const tmps = spec.outs.map(make);
  const scratchBase = spec.outs[0]!;
  try {
    const result = await write(tmps, () => make(scratchBase));
    spec.outs.forEach((out, i) => {
      if (existsSync(tmps[i]!)) renameSync(tmps[i]!, out);
      else if (existsSync(out)) unlinkSync(out);
    });
    return result;
  } finally {
    for (const t of temps) rmSync(t, { recursive: true, force: true });
  }
}
