// aenv's sandbox verbs: start and cn (an interactive shell), exec, ls, pause, resume, timeout, rm,
// fork, snapshot create|ls|rm and logs, all through the stock e2b SDK against one node.

import { CommandExitError, Sandbox, type SandboxInfo, type SnapshotInfo } from "e2b";
import { UsageError, type ParsedArgs } from "./args.ts";
import { NODE_OPTIONS, api, onNode, openSandbox, resolveTarget, sandboxId, sdkOpts, unknown, type NodeTarget, type Subject } from "./node_client.ts";
import { attachShell } from "./shell.ts";
import { JSON_OPTION, printListing, when } from "./table.ts";
import { wholeNumber, type Option, type Verb } from "./verbs.ts";

/** E2B's limit on a TTL: 30 days. */
const TTL_MAX_S = 30 * 86_400;
/** The TTL the node gives when a request names none (E2B's 300 s); renewed at this while attached. */
const DEFAULT_TTL_S = 300;
/** Bound on a listing: pages of 100 until this many. */
const LIST_MAX = 10_000;
/** E2B's bound on one fork request. */
const FORK_MAX = 100;

const USER: Option = { flag: "--user", value: "U", help: "run as this user (default: the sandbox's, `user`)" };
const TTL = (what: string): Option => ({ flag: "--timeout", value: "S", help: `${what} in seconds (1..${TTL_MAX_S})` });
const ttlOf = (a: ParsedArgs) => wholeNumber(a.value("timeout"), "--timeout", 1, TTL_MAX_S);
const sandboxSubject = (id: string): Subject => ({ kind: "sandbox", id });

async function start(a: ParsedArgs): Promise<number> {
  const [template] = a.need(1, "TEMPLATE");
  const ttlS = ttlOf(a);
  const t = await resolveTarget(a);
  const sbx = await onNode(t, { kind: "template", id: template! }, () =>
    Sandbox.create(template!, { ...sdkOpts(t), ...(ttlS ? { timeoutMs: ttlS * 1000 } : {}) }));
  if (a.flag("d")) {
    process.stdout.write(`${sbx.sandboxId}\n`);
    return 0;
  }
  process.stderr.write(`aenv: sandbox ${sbx.sandboxId} from ${template}; it is killed when the shell exits\n`);
  const stop = (signal: NodeJS.Signals, code: number) => {
    process.on(signal, () => void sbx.kill().finally(() => process.exit(code)));
  };
  stop("SIGHUP", 129);
  stop("SIGTERM", 143);
  try {
    return await onNode(t, sandboxSubject(sbx.sandboxId), () => attachShell(sbx, { ttlS: ttlS ?? DEFAULT_TTL_S, user: a.value("user") }));
  } finally {
    await sbx.kill().catch(() => false);
  }
}

async function cn(a: ParsedArgs): Promise<number> {
  const id = sandboxId(a.need(1, "ID")[0]!);
  const ttlS = ttlOf(a);
  const t = await resolveTarget(a);
  return onNode(t, sandboxSubject(id), async () => {
    const sbx = await Sandbox.connect(id, { ...sdkOpts(t), ...(ttlS ? { timeoutMs: ttlS * 1000 } : {}) });
    return attachShell(sbx, { ttlS: ttlS ?? DEFAULT_TTL_S, user: a.value("user") });
  });
}

async function exec(a: ParsedArgs): Promise<number> {
  const [raw, ...cmd] = a.atLeast(2, "ID and a command");
  const id = sandboxId(raw!);
  const t = await resolveTarget(a);
  const sbx = await openSandbox(t, id);
  const line = cmd.join(" ");
  const opts = {
    user: a.value("user"),
    cwd: a.value("cwd"),
    timeoutMs: 0,
    onStdout: (d: string) => void process.stdout.write(d),
    onStderr: (d: string) => void process.stderr.write(d),
  };
  return onNode(t, sandboxSubject(id), async () => {
    try {
      const h = await sbx.commands.run(line, { ...opts, background: true, stdin: a.flag("i") });
      // Ctrl-C or SIGTERM here end the command there too, then aenv with the shell's code for it.
      for (const [signal, code] of [["SIGINT", 130], ["SIGTERM", 143]] as const) {
        process.once(signal, () => void sbx.commands.kill(h.pid).catch(() => false).finally(() => process.exit(code)));
      }
      if (a.flag("i")) {
        for await (const chunk of process.stdin) await sbx.commands.sendStdin(h.pid, chunk as Uint8Array);
        await sbx.commands.closeStdin(h.pid);
      }
      return (await h.wait()).exitCode;
    } catch (e) {
      if (e instanceof CommandExitError) return e.exitCode;
      throw e;
    }
  });
}

/** Every item of a listing, page by page, up to LIST_MAX. */
async function allPages<T>(pager: { hasNext: boolean; nextItems(): Promise<T[]> }): Promise<T[]> {
  const out: T[] = [];
  while (pager.hasNext && out.length < LIST_MAX) out.push(...(await pager.nextItems()));
  return out;
}

async function ls(a: ParsedArgs): Promise<void> {
  a.need(0, "no operands");
  const state = a.value("state");
  if (state !== undefined && state !== "running" && state !== "paused") throw new UsageError(`--state ${state}: expected running or paused`);
  const t = await resolveTarget(a);
  const items = await onNode(t, undefined, () => allPages<SandboxInfo>(Sandbox.list({ ...sdkOpts(t), limit: 100, ...(state ? { query: { state: [state] } } : {}) })));
  printListing(items, [
    { header: "ID", cell: (s) => s.sandboxId },
    { header: "TEMPLATE", cell: (s) => s.name ?? s.templateId },
    { header: "STATE", cell: (s) => s.state },
    { header: "STARTED", cell: (s) => when(s.startedAt) },
    { header: "ENDS", cell: (s) => when(s.endAt) },
    { header: "CPU", cell: (s) => String(s.cpuCount) },
    { header: "MEM MiB", cell: (s) => String(s.memoryMB) },
    { header: "METADATA", cell: (s) => Object.entries(s.metadata ?? {}).map(([k, v]) => `${k}=${v}`).join(",") },
  ], { json: a.flag("json"), empty: `no sandboxes on ${t.url}` });
}

/** Do `fn` for each ID; the ones the node does not know are reported after all have been tried. */
async function eachSandbox(a: ParsedArgs, fn: (t: NodeTarget, id: string) => Promise<boolean>): Promise<void> {
  const ids = a.atLeast(1, "ID...").map(sandboxId);
  const t = await resolveTarget(a);
  const missing: string[] = [];
  for (const id of ids) if (!(await onNode(t, sandboxSubject(id), () => fn(t, id)))) missing.push(id);
  if (missing.length > 0) throw unknown(t, sandboxSubject(missing.join(", ")));
}

async function pause(a: ParsedArgs): Promise<void> {
  await eachSandbox(a, async (t, id) => {
    if (!(await Sandbox.pause(id, sdkOpts(t)))) process.stderr.write(`aenv: sandbox ${id} was already paused\n`);
    return true;
  });
}

async function resume(a: ParsedArgs): Promise<void> {
  const ttlS = ttlOf(a);
  await eachSandbox(a, async (t, id) => {
    await Sandbox.connect(id, { ...sdkOpts(t), ...(ttlS ? { timeoutMs: ttlS * 1000 } : {}) });
    return true;
  });
}

async function timeout(a: ParsedArgs): Promise<void> {
  const [raw, secs] = a.need(2, "ID and SECS");
  const id = sandboxId(raw!);
  const s = wholeNumber(secs, "SECS", 1, TTL_MAX_S)!;
  const t = await resolveTarget(a);
  await onNode(t, sandboxSubject(id), () => Sandbox.setTimeout(id, s * 1000, sdkOpts(t)));
}

async function rm(a: ParsedArgs): Promise<void> {
  await eachSandbox(a, (t, id) => Sandbox.kill(id, sdkOpts(t)));
}

async function fork(a: ParsedArgs): Promise<number> {
  const id = sandboxId(a.need(1, "ID")[0]!);
  const count = wholeNumber(a.value("n") ?? "1", "-n", 1, FORK_MAX)!;
  const ttlS = ttlOf(a);
  const t = await resolveTarget(a);
  const kids = await onNode(t, sandboxSubject(id), () => Sandbox.fork(id, { ...sdkOpts(t), count, ...(ttlS ? { timeoutMs: ttlS * 1000 } : {}) }));
  let failed = 0;
  for (const k of kids) {
    if (k instanceof Sandbox) process.stdout.write(`${k.sandboxId}\n`);
    else {
      failed++;
      process.stderr.write(`aenv: a fork of ${id} failed: ${k.message}\n`);
    }
  }
  return failed > 0 ? 1 : 0;
}

async function logs(a: ParsedArgs): Promise<void> {
  const id = sandboxId(a.need(1, "ID")[0]!);
  const t = await resolveTarget(a);
  const { data } = await api<{ logs: { timestamp: string; level: string; message: string }[] }>(t, "GET", `/v2/sandboxes/${id}/logs`, { subject: sandboxSubject(id) });
  if (a.flag("json")) process.stdout.write(JSON.stringify(data.logs, null, 2) + "\n");
  else for (const l of data.logs) process.stdout.write(`${l.message}\n`);
}

async function snapshotCreate(a: ParsedArgs): Promise<void> {
  const id = sandboxId(a.need(1, "ID")[0]!);
  const name = a.value("name");
  const t = await resolveTarget(a);
  const snap = await onNode(t, sandboxSubject(id), () => Sandbox.createSnapshot(id, { ...sdkOpts(t), ...(name ? { name } : {}) }));
  process.stdout.write(`${snap.snapshotId}\n`);
}

async function snapshotLs(a: ParsedArgs): Promise<void> {
  a.need(0, "no operands");
  const of = a.value("sandbox");
  const t = await resolveTarget(a);
  const items = await onNode(t, undefined, () => allPages<SnapshotInfo>(Sandbox.listSnapshots({ ...sdkOpts(t), limit: 100, ...(of ? { sandboxId: sandboxId(of) } : {}) })));
  printListing(items, [
    { header: "ID", cell: (s) => s.snapshotId },
    { header: "NAMES", cell: (s) => s.names.join(",") },
  ], { json: a.flag("json"), empty: `no snapshots on ${t.url}` });
}

async function snapshotRm(a: ParsedArgs): Promise<void> {
  const ids = a.atLeast(1, "ID...");
  const t = await resolveTarget(a);
  const missing: string[] = [];
  for (const id of ids) if (!(await onNode(t, { kind: "snapshot", id }, () => Sandbox.deleteSnapshot(id, sdkOpts(t))))) missing.push(id);
  if (missing.length > 0) throw unknown(t, { kind: "snapshot", id: missing.join(", ") });
}

export const SANDBOX_VERBS: Record<string, Verb> = {
  start: {
    operands: "TEMPLATE",
    summary: "a new sandbox from TEMPLATE (name, ID or snapshot ID) with an interactive shell in it; the sandbox is killed when the shell exits",
    options: [{ flag: "-d", help: "detach: print the new sandbox's ID, start no shell, leave it running" }, TTL("the sandbox's TTL, renewed while the shell is attached (default 300)"), USER, ...NODE_OPTIONS],
    notes: "The shell's exit code is aenv's. Hang-up or SIGTERM kill the sandbox too (unless -d).",
    run: start,
  },
  cn: {
    operands: "ID",
    summary: "an interactive shell in a running sandbox (a paused one is resumed first); the sandbox keeps running after",
    options: [TTL("extend the TTL to at least this, renewed while attached (default 300)"), USER, ...NODE_OPTIONS],
    run: cn,
  },
  exec: {
    operands: "ID -- CMD...",
    summary: "run CMD in the sandbox's shell (bash -l -c, the words joined by spaces as ssh does); stdout and stderr stream, CMD's exit code is aenv's",
    options: [{ flag: "-i", help: "forward stdin to CMD (until its end)" }, USER, { flag: "--cwd", value: "DIR", help: "working directory (default: the user's home)" }, ...NODE_OPTIONS],
    notes: "A paused sandbox is resumed first. Ctrl-C (SIGINT) or SIGTERM kill CMD too (exit 130, 143).\nOutput is text (UTF-8); for bytes use `aenv cp`.\nexample: aenv exec ID -- 'cd /tmp && ls -la | wc -l'",
    run: exec,
  },
  ls: {
    operands: "",
    summary: "the node's sandboxes, running and paused: a table on a terminal, JSON otherwise",
    options: [{ flag: "--state", value: "running|paused", help: "only sandboxes in this state" }, JSON_OPTION, ...NODE_OPTIONS],
    run: ls,
  },
  pause: { operands: "ID...", summary: "pause sandboxes (memory and disk kept; `aenv resume` or `aenv cn` continue them)", options: [...NODE_OPTIONS], run: pause },
  resume: { operands: "ID...", summary: "resume paused sandboxes (a running one only has its TTL extended)", options: [TTL("TTL after resuming (default: the node's, 300)"), ...NODE_OPTIONS], run: resume },
  timeout: { operands: "ID SECS", summary: "set a sandbox's TTL to SECS from now (may shorten it)", options: [...NODE_OPTIONS], run: timeout },
  rm: { operands: "ID...", summary: "kill sandboxes, running or paused", options: [...NODE_OPTIONS], run: rm },
  fork: {
    operands: "ID",
    summary: "N new sandboxes from a running one's memory and disk (the source keeps running); prints their IDs, one a line",
    options: [{ flag: "-n", value: "N", help: `how many (1..${FORK_MAX}, default 1)` }, TTL("the children's TTL (default: the node's)"), ...NODE_OPTIONS],
    run: fork,
  },
  logs: { operands: "ID", summary: "a sandbox's console, line by line", options: [{ flag: "--json", help: "the entries with timestamps and levels, as JSON" }, ...NODE_OPTIONS], run: logs },
};

export const SNAPSHOT_VERBS: Record<string, Verb> = {
  create: {
    operands: "ID",
    summary: "snapshot a running sandbox (it continues); prints the snapshot's ID, which `aenv start` takes as a template",
    options: [{ flag: "--name", value: "N", help: "a name for it (letters, digits, _ and -)" }, ...NODE_OPTIONS],
    run: snapshotCreate,
  },
  ls: {
    operands: "",
    summary: "the node's snapshots: a table on a terminal, JSON otherwise",
    options: [{ flag: "--sandbox", value: "ID", help: "only snapshots of this sandbox" }, JSON_OPTION, ...NODE_OPTIONS],
    run: snapshotLs,
  },
  rm: { operands: "ID...", summary: "delete snapshots", options: [...NODE_OPTIONS], run: snapshotRm },
};

