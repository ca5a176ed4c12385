// One build step's tool run: argument arrays only, awaited (the node's event loop keeps serving),
// in its own process group so a timeout ends the tool and every child it started, output kept as
// a bounded tail for the error and passed line by line to a progress callback.
import { TemplateBuildError, type BuildStep } from "./definition.ts";

/** Output kept for an error message: the last 40 lines of apt or mkfs say what went wrong. */
const TAIL_LINES = 40;
/** A line longer than this is cut: dpkg's progress bars are the longest and stay far below it. */
const MAX_LINE = 1000;
/** After a timeout the group gets SIGTERM (mmdebstrap unmounts and cleans up), then SIGKILL. */
const TERM_GRACE_MS = 10_000;
/** Time the output pipes get to close once the tool has exited. */
const DRAIN_MS = 5_000;

export interface StepRun {
  step: BuildStep;
  argv: string[];
  timeoutMs: number;
  /** Fed to stdin (setup.sh into `chroot … bash -s`). */
  stdin?: Uint8Array;
  env?: Record<string, string>;
  /** Each output line (stdout or stderr), trimmed. */
  onLine?: (line: string) => void;
}

/** Bounded ring of the last lines of output. */
class Tail {
  private lines: string[] = [];
  push(line: string): void {
    this.lines.push(line.length > MAX_LINE ? `${line.slice(0, MAX_LINE)}…` : line);
    if (this.lines.length > TAIL_LINES) this.lines.shift();
  }
  text(): string {
    return this.lines.join("\n");
  }
}

async function pumpLines(stream: ReadableStream<Uint8Array>, each: (line: string) => void): Promise<void> {
  const decoder = new TextDecoder();
  let pending = "";
  for await (const chunk of stream) {
    pending += decoder.decode(chunk, { stream: true });
    let nl: number;
    // Carriage returns end a line too: apt and dpkg redraw progress lines with them.
    while ((nl = pending.search(/[\r\n]/)) >= 0) {
      each(pending.slice(0, nl));
      pending = pending.slice(nl + 1);
    }
    // A tool printing without newlines must not grow this string without bound.
    if (pending.length > MAX_LINE) {
      each(pending);
      pending = "";
    }
  }
  pending += decoder.decode();
  if (pending) each(pending);
}

function killGroup(pid: number, signal: NodeJS.Signals): void {
  try {
    process.kill(-pid, signal);
  } catch {
    // The group is gone already.
  }
}

/**
 * Run one tool for a step. TemplateBuildError `StepFailed` on a non-zero exit, `Timeout` past
 * timeoutMs (the process group is terminated, then killed), `SpawnFailed` when it cannot start;
 * each carries the output's tail.
 */
export async function runStep(run: StepRun): Promise<void> {
  const tail = new Tail();
  let proc;
  try {
    proc = Bun.spawn(run.argv, {
      stdin: run.stdin === undefined ? "ignore" : run.stdin,
      stdout: "pipe",
      stderr: "pipe",
      // A process group of its own: the timeout reaches apt, dpkg and the chrooted scripts too.
      detached: true,
      env: { PATH: "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", LC_ALL: "C", ...run.env },
    });
  } catch (e) {
    throw new TemplateBuildError("SpawnFailed", run.step, `could not start ${run.argv[0]}: ${(e as Error).message}`);
  }
  const pid = proc.pid;
  let timedOut = false;
  let killTimer: ReturnType<typeof setTimeout> | undefined;
  const termTimer = setTimeout(() => {
    timedOut = true;
    killGroup(pid, "SIGTERM");
    killTimer = setTimeout(() => killGroup(pid, "SIGKILL"), TERM_GRACE_MS);
  }, run.timeoutMs);
  const each = (line: string) => {
    const t = line.trim();
    if (!t) return;
    tail.push(t);
    try {
      run.onLine?.(t);
    } catch {
      // A progress callback's failure is the caller's; it must not break the build.
    }
  };
  const pumps = Promise.all([pumpLines(proc.stdout, each), pumpLines(proc.stderr, each)]);
  try {
    await proc.exited;
    // Children the tool left behind (a daemon a maintainer script started) go with it; one that
    // left the group and holds our pipes gets DRAIN_MS before its output is given up.
    killGroup(pid, "SIGKILL");
    await Promise.race([pumps, Bun.sleep(DRAIN_MS)]);
  } finally {
    clearTimeout(termTimer);
    clearTimeout(killTimer);
  }
  const what = run.argv.slice(0, 2).join(" ");
  if (timedOut) throw new TemplateBuildError("Timeout", run.step, `${what} did not finish within ${run.timeoutMs} ms (killed)`, tail.text());
  if (proc.exitCode !== 0) {
    const how = proc.exitCode === null ? `was killed by ${proc.signalCode}` : `exited ${proc.exitCode}`;
    throw new TemplateBuildError("StepFailed", run.step, `${what} ${how}`, tail.text());
  }
}
