// Running the host's network tools (ip, nft, conntrack, sysctl): argument arrays only, never a
// shell, awaited (never spawnSync: the node's event loop keeps serving), each run bounded in time
// and output, exit codes checked, stderr carried in a NetworkError.

export class NetworkError extends Error {
  constructor(
    readonly code: string,
    message: string,
    readonly detail: { argv?: string[]; exitCode?: number | null; stderr?: string } = {},
  ) {
    super(message);
    this.name = "NetworkError";
  }
}

/** The tools this module runs; sbin directories are added because non-login PATHs often lack them. */
export type ToolName = "ip" | "nft" | "conntrack" | "sysctl" | "ss";

const PACKAGE_OF: Record<ToolName, string> = { ip: "iproute2", nft: "nftables", conntrack: "conntrack", sysctl: "procps", ss: "iproute2" };
const SBIN_PATH = "/usr/local/sbin:/usr/sbin:/sbin";
const resolved = new Map<ToolName, string>();

/** One run of a tool: a slot step takes milliseconds, so 15 s only trips on a hung tool. */
export const COMMAND_TIMEOUT_MS = 15_000;
/** Output kept from one run: `ip -j route show table all` on a busy host stays far below this. */
const MAX_OUTPUT_BYTES = 16 << 20;

export function toolPath(name: ToolName): string {
  const known = resolved.get(name);
  if (known) return known;
  const found = Bun.which(name, { PATH: `${process.env.PATH ?? ""}:${SBIN_PATH}` });
  if (!found) {
    throw new NetworkError("MissingTool", `${name} not found on PATH or in ${SBIN_PATH} (Debian package ${PACKAGE_OF[name]})`);
  }
  resolved.set(name, found);
  return found;
}

export function haveTool(name: ToolName): boolean {
  try {
    toolPath(name);
    return true;
  } catch {
    return false;
  }
}

export interface RunOptions {
  /** Fed to the tool's stdin (nft -f -, ip -batch -). */
  stdin?: string;
  /** Exit codes that count as success besides 0 (conntrack -D exits 1 when nothing matched). */
  alsoOk?: number[];
  timeoutMs?: number;
}

export interface RunResult {
  exitCode: number;
  stdout: string;
  stderr: string;
}

/**
 * Run argv (argv[0] a ToolName or an absolute path) and return its output. NetworkError
 * `CommandFailed` on a bad exit, `Timeout` when it ran past timeoutMs (it is then killed).
 */
export async function run(argv: string[], opts: RunOptions = {}): Promise<RunResult> {
  const [head, ...rest] = argv;
  if (head === undefined) throw new NetworkError("BadCommand", "empty argv");
  if (!head.startsWith("/") && !(head in PACKAGE_OF)) throw new NetworkError("BadCommand", `${head} is not one of ${Object.keys(PACKAGE_OF).join(", ")}`);
  const full = [head.startsWith("/") ? head : toolPath(head as ToolName), ...rest];
  const timeoutMs = opts.timeoutMs ?? COMMAND_TIMEOUT_MS;
  const deadline = AbortSignal.timeout(timeoutMs);
  let proc;
  try {
    proc = Bun.spawn(full, {
      stdin: opts.stdin === undefined ? "ignore" : Buffer.from(opts.stdin),
      stdout: "pipe",
      stderr: "pipe",
      signal: deadline,
      killSignal: "SIGKILL",
      maxBuffer: MAX_OUTPUT_BYTES,
      // C locale so stderr we match on and surface is not translated.
      env: { ...process.env, LC_ALL: "C" },
    });
  } catch (e) {
    throw new NetworkError("SpawnFailed", `could not start ${full[0]}: ${(e as Error).message}`, { argv: full });
  }
  const [stdout, stderrRaw] = await Promise.all([new Response(proc.stdout).text(), new Response(proc.stderr).text(), proc.exited]);
  const stderr = stderrRaw.trim();
  const exitCode = proc.exitCode ?? -1;
  if (proc.exitCode === null && deadline.aborted) {
    throw new NetworkError("Timeout", `${full.join(" ")} did not finish within ${timeoutMs} ms (killed)${stderr ? `: ${stderr}` : ""}`, { argv: full, exitCode: null, stderr });
  }
  if (exitCode !== 0 && !(opts.alsoOk ?? []).includes(exitCode)) {
    const how = proc.exitCode === null ? `was killed by ${proc.signalCode}` : `exited ${exitCode}`;
    throw new NetworkError("CommandFailed", `${full.join(" ")} ${how}${stderr ? `: ${stderr}` : ""}`, {
      argv: full,
      exitCode: proc.exitCode,
      stderr,
    });
  }
  return { exitCode, stdout, stderr };
}
