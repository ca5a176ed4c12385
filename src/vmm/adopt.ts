// Adoption: a VM outlives the node process that started it, and a restarted node takes control of
// it again. Each driver leaves a record in the VM's run directory (`vmm.json`: the pid and its
// start time, which together name one process, plus what the driver needs to reconnect).
import { readFileSync } from "node:fs";
import { rename, writeFile } from "node:fs/promises";
import { join, resolve } from "node:path";
import { RUN_FILE_MODE, VmmError, type VmmProcess } from "./types.ts";

/** How often an adopted VMM's liveness is checked (it is not our child: no exit notification). */
const ADOPTED_POLL_MS = 250;

/**
 * A VMM process started by an earlier node process. `exited` resolves (with null: the code is not
 * ours to read) once /proc/<pid> is gone or belongs to another program.
 */
export class AdoptedProcess implements VmmProcess {
  private code: number | null = null;
  private gone = false;
  killed = false;
  readonly exited: Promise<number | null>;

  constructor(readonly pid: number, private readonly startTime: string) {
    this.exited = new Promise((resolveExit) => {
      const t = setInterval(() => {
        if (AdoptedProcess.startTimeOf(pid) === startTime) return;
        clearInterval(t);
        this.gone = true;
        resolveExit(this.code);
      }, ADOPTED_POLL_MS);
      t.unref();
    });
  }

  /** Field 22 of /proc/<pid>/stat: with the pid, it names one process for its whole life. */
  static startTimeOf(pid: number): string | undefined {
    try {
      const stat = readFileSync(`/proc/${pid}/stat`, "utf8");
      return stat.slice(stat.lastIndexOf(")") + 2).split(" ")[19];
    } catch {
      return undefined;
    }
  }

  get exitCode(): number | null {
    return this.gone ? -1 : null;
  }

  kill(signal: NodeJS.Signals | number = "SIGTERM"): void {
    if (this.gone || AdoptedProcess.startTimeOf(this.pid) !== this.startTime) return;
    try {
      process.kill(this.pid, signal);
      this.killed = true;
    } catch { /* already gone */ }
  }
}

const ADOPT_RECORD = "vmm.json";

interface AdoptRecord<T> {
  pid: number;
  startTime: string;
  driver: T;
}

/** Written once the VMM runs; without it the VM cannot be adopted later. */
export async function writeAdoptRecord<T>(runDir: string, pid: number, driver: T): Promise<void> {
  const startTime = AdoptedProcess.startTimeOf(pid);
  if (startTime === undefined) return; // already gone: nothing to adopt later
  const path = join(runDir, ADOPT_RECORD);
  await writeFile(`${path}.tmp`, JSON.stringify({ pid, startTime, driver } satisfies AdoptRecord<T>), { mode: RUN_FILE_MODE });
  await rename(`${path}.tmp`, path);
}

/** The live VMM process recorded in runDir and the driver's part of the record; BadState when gone. */
export async function readAdoptRecord<T>(runDir: string): Promise<{ proc: AdoptedProcess; driver: T }> {
  const path = join(resolve(runDir), ADOPT_RECORD);
  let rec: AdoptRecord<T>;
  try {
    rec = (await Bun.file(path).json()) as AdoptRecord<T>;
  } catch {
    throw new VmmError("BadState", `no VM record at ${path}`);
  }
  if (AdoptedProcess.startTimeOf(rec.pid) !== rec.startTime) throw new VmmError("BadState", `the VM of ${runDir} (pid ${rec.pid}) is gone`);
  return { proc: new AdoptedProcess(rec.pid, rec.startTime), driver: rec.driver };
}
