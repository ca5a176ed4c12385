// A real blockd for a test: its own state dir, started through the client as the node does,
// shut down (devices flushed, mounts and loops gone) when the test file ends.
import { afterAll } from "bun:test";
import { closeSync, existsSync, fsyncSync, mkdirSync, openSync, readdirSync, readFileSync, readlinkSync, readSync, renameSync, rmSync, writeSync } from "node:fs";
import { join } from "node:path";
import { BlockdClient, type BlockdSettings } from "../../src/blockdev/client.ts";
import { WritableLayer } from "../../src/storage/lsmt/writable_layer.ts";
import { scratchDir } from "../helpers/tmp.ts";

export const haveFuse = existsSync("/dev/fuse") && process.getuid?.() === 0;
/** A test's name, with why it is skipped without FUSE. */
export const fuseTest = (name: string) => (haveFuse ? name : `${name} (skipped: needs root and /dev/fuse)`);
export const haveLoop = existsSync("/dev/loop-control");

/** How long cleanup gives blockd's shutdown (every device flushed and stopped, on a loaded machine). */
const SHUTDOWN_BOUND_MS = 120_000;
/** How long a keeper has to follow a blockd that shut down (it is told to go before blockd exits). */
const KEEPER_GRACE_MS = 10_000;

/**
 * env: set for the blockd started here (AENV_BLOCKD_FAULT, AENV_BLOCKD_DEVICE_TIMEOUT_MS, ...), and only for it;
 * settings: the node's blockd settings, as the node passes them.
 */
export async function startBlockd(label: string, opts: { pool?: number; env?: Record<string, string>; settings?: BlockdSettings } = {}) {
  const dir = scratchDir(label, { keep: true }); // removed below, after the mounts are gone
  const state = join(dir, "state");
  mkdirSync(state, { recursive: true });
  const env = Object.entries(opts.env ?? {});
  for (const [k, v] of env) process.env[k] = v;
  const client = await BlockdClient.ensure(state, opts).finally(() => {
    for (const [k] of env) delete process.env[k];
  });
  afterAll(async () => {
    await stopBlockd(state);
    // Nothing of this blockd may outlive it: no mount under its state dir, no loop on its files.
    const leaked = readFileSync("/proc/mounts", "utf8").split("\n").filter((l) => l.includes(state));
    rmSync(dir, { recursive: true, force: true });
    if (leaked.length) throw new Error(`blockd left mounts behind: ${leaked.join("; ")}`);
  }, SHUTDOWN_BOUND_MS + KEEPER_GRACE_MS + 30_000); // the hook's own bound: past stopBlockd's
  return { dir, state, client };
}

/**
 * Shut the blockd of `state` down as the node would, wait for it and then its fd keeper to exit,
 * and only then kill -9 what is left. Returns the names ("blockd", "keeper") it had to kill.
 */
export async function stopBlockd(state: string, boundMs = SHUTDOWN_BOUND_MS): Promise<string[]> {
  const procs = (["blockd", "keeper"] as const).map((name) => ({ name, pid: ownPid(state, `${name}.pid`) }));
  let asked = false;
  try {
    const c = await BlockdClient.connect(join(state, "blockd.sock"));
    await c.call("shutdown", {}, { timeoutMs: 10_000 });
    c.close();
    asked = true;
  } catch {} // not serving: nothing to wait for
  const live = () => procs.filter((p) => p.pid !== undefined && !processGone(p.pid));
  if (asked) {
    const deadline = Date.now() + boundMs;
    let blockdGoneAt: number | undefined;
    while (live().length && Date.now() < deadline) {
      if (!live().some((p) => p.name === "blockd")) {
        blockdGoneAt ??= Date.now();
        if (Date.now() - blockdGoneAt > KEEPER_GRACE_MS) break; // the keeper still holds something: it stays
      }
      await Bun.sleep(50);
    }
  }
  return live().map((p) => {
    try {
      process.kill(p.pid!, "SIGKILL");
    } catch {}
    return p.name;
  });
}

/** The pid in <state>/<file>, if that process is still one of this state dir's (not a reused pid). */
function ownPid(state: string, file: string): number | undefined {
  try {
    const pid = Number(readFileSync(join(state, file), "utf8"));
    return readFileSync(`/proc/${pid}/cmdline`, "utf8").includes(state) ? pid : undefined;
  } catch {
    return undefined;
  }
}

export function sh(cmd: string[], input?: Uint8Array): string {
  const r = Bun.spawnSync(cmd, { stdin: input ?? "ignore", stdout: "pipe", stderr: "pipe" });
  if (r.exitCode !== 0) throw new Error(`${cmd.join(" ")} → ${r.exitCode}: ${r.stderr.toString()}`);
  return r.stdout.toString();
}

export function blockdPid(state: string): number {
  return Number(readFileSync(join(state, "blockd.pid"), "utf8"));
}

/** A device as blockd's `list` and `acquire` answer it: the fields tests read. */
export interface DeviceView {
  id: string;
  kind: string;
  path: string;
  acquired: boolean;
  readOnly: boolean;
  prepared?: boolean;
  config: { lowers: { file: string }[]; upper?: { data: string; index: string } } | null;
}

/** kill -9 blockd (the keeper lives on), run `meanwhile`, start it again; its new client. */
export async function killAndRestart(state: string, client: BlockdClient, meanwhile: () => void = () => {}): Promise<BlockdClient> {
  const pid = blockdPid(state);
  process.kill(pid, "SIGKILL");
  client.close();
  await until(() => processGone(pid), "the killed blockd to be gone");
  meanwhile();
  return BlockdClient.ensure(state);
}

/** A sealed layer file at `path` of virtual size `size`, holding `fill` at byte `at`. */
export async function makeLayer(path: string, size: number, at: number, fill: Uint8Array): Promise<string> {
  const l = await WritableLayer.create(`${path}.tmp.data`, `${path}.tmp.index`, { virtualSize: size });
  await l.write(fill, at);
  await l.seal();
  await l.close();
  renameSync(`${path}.tmp.data`, path);
  rmSync(`${path}.tmp.index`);
  return path;
}

/** `length` bytes of a device file from `at`, read through the page cache. */
export function readAll(path: string, length: number, at = 0): Uint8Array {
  const fd = openSync(path, "r");
  const b = new Uint8Array(length);
  let done = 0;
  while (done < length) {
    const n = readSync(fd, b, done, length - done, at + done);
    if (n <= 0) break;
    done += n;
  }
  closeSync(fd);
  return b;
}

/** Write `bytes` to a device file at `at` and fsync it: acknowledged data. */
export function writeAt(path: string, bytes: Uint8Array, at: number): void {
  const fd = openSync(path, "r+");
  writeSync(fd, bytes, 0, bytes.length, at);
  fsyncSync(fd);
  closeSync(fd);
}

/** The error a promise rejects with (undefined when it resolves). */
export async function failure(p: Promise<unknown>): Promise<Error | undefined> {
  try {
    await p;
  } catch (e) {
    return e as Error;
  }
  return undefined;
}

/** What process `pid`'s open fds are (socket:[n], anon_inode:[io_uring], /dev/fuse, files), sorted. */
export function openFds(pid: number): string[] {
  const out: string[] = [];
  for (const fd of readdirSync(`/proc/${pid}/fd`)) {
    try {
      out.push(readlinkSync(`/proc/${pid}/fd/${fd}`));
    } catch {} // closed while we listed
  }
  return out.sort();
}

/** `pid`'s fds once they match `want` (they settle as dead threads are reaped), or as they are after 10 s. */
export async function fdsSettled(pid: number, want: string[]): Promise<string[]> {
  const deadline = Date.now() + 10_000;
  let now = openFds(pid);
  while (JSON.stringify(now) !== JSON.stringify(want) && Date.now() < deadline) {
    await Bun.sleep(50);
    now = openFds(pid);
  }
  return now;
}

/** Wait for an eventual state: polls cond until it holds, failing with `what` after ms. */
export async function until(cond: () => boolean | Promise<boolean>, what: string, ms = 30_000): Promise<void> {
  const deadline = Date.now() + ms;
  while (!(await cond())) {
    if (Date.now() > deadline) throw new Error(`timed out after ${ms} ms waiting for ${what}`);
    await Bun.sleep(20);
  }
}

/** True once process `pid` has exited (gone, or a zombie nobody reaped yet). */
export function processGone(pid: number): boolean {
  try {
    return readFileSync(`/proc/${pid}/stat`, "utf8").replace(/^.*\) /s, "")[0] === "Z";
  } catch {
    return true;
  }
}

/** Mount lines of /proc/mounts whose mount point is `path`. */
export function mountsAt(path: string): string[] {
  return readFileSync("/proc/mounts", "utf8")
    .split("\n")
    .filter((l) => l.split(" ")[1] === path);
}

/**
 * A fixture process (test/blockdev/<name>.ts) whose stdout lines are collected as they come; its
 * I/O may block on a device under test, so the test waits on it with bounds, never in-process.
 */
export function spawnFixture(name: string, args: string[]) {
  const proc = Bun.spawn([process.execPath, join(import.meta.dir, `${name}.ts`), ...args], { stdout: "pipe", stderr: "pipe" });
  const lines: string[] = [];
  const done = (async () => {
    const dec = new TextDecoder();
    let buf = "";
    for await (const chunk of proc.stdout) {
      buf += dec.decode(chunk);
      const parts = buf.split("\n");
      buf = parts.pop()!;
      lines.push(...parts);
    }
    if (buf) lines.push(buf);
  })();
  return {
    proc,
    lines,
    /** Its exit code, once it has exited and its output is read. */
    async exited(): Promise<number> {
      const code = await proc.exited;
      await done;
      return code;
    },
  };
}
