// Running the host's network tools (ip, nft, conntrack, sysctl): argument arrays only, never a
// shell, exit codes checked, stderr carried in a NetworkError.

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
export type ToolName = "ip" | "nft" | "conntrack" | "sysctl";

const PACKAGE_OF: Record<ToolName, string> = { ip: "iproute2", nft: "nftables", conntrack: "conntrack", sysctl: "procps" };
const SBIN_PATH = "/usr/local/sbin:/usr/sbin:/sbin";
const resolved = new Map<ToolName, string>();

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
}

export interface RunResult {
  exitCode: number;
  stdout: string;
  stderr: string;
}

/** Run argv (argv[0] a ToolName or an absolute path) and return its output; NetworkError on failure. */
export function run(argv: string[], opts: RunOptions = {}): RunResult {
  const [head, ...rest] = argv;
  if (head === undefined) throw new NetworkError("BadCommand", "empty argv");
  if (!head.startsWith("/") && !(head in PACKAGE_OF)) throw new NetworkError("BadCommand", `${head} is not one of ${Object.keys(PACKAGE_OF).join(", ")}`);
  const full = [head.startsWith("/") ? head : toolPath(head as ToolName), ...rest];
  let proc;
  try {
    proc = Bun.spawnSync(full, {
      stdin: opts.stdin === undefined ? "ignore" : Buffer.from(opts.stdin),
      stdout: "pipe",
      stderr: "pipe",
      // C locale so stderr we match on and surface is not translated.
      env: { ...process.env, LC_ALL: "C" },
    });
  } catch (e) {
    throw new NetworkError("SpawnFailed", `could not start ${full[0]}: ${(e as Error).message}`, { argv: full });
  }
  const stdout = proc.stdout ? proc.stdout.toString() : "";
  const stderr = proc.stderr ? proc.stderr.toString().trim() : "";
  const exitCode = proc.exitCode ?? -1;
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
