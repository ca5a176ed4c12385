// A real blockd for a test: its own state dir, started through the client as the node does,
// shut down (devices flushed, mounts and loops gone) when the test file ends.
import { afterAll } from "bun:test";
import { closeSync, existsSync, openSync, readFileSync, readSync, renameSync, rmSync } from "node:fs";
import { join } from "node:path";
import { BlockdClient } from "../../src/blockdev/client.ts";
import { WritableLayer } from "../../src/storage/lsmt/writable_layer.ts";
import { scratchDir } from "../helpers/tmp.ts";

export const haveFuse = existsSync("/dev/fuse") && process.getuid?.() === 0;
export const haveLoop = existsSync("/dev/loop-control");

export async function startBlockd(label: string, opts: { pool?: number } = {}) {
  const dir = scratchDir(label, { keep: true }); // removed below, after the mounts are gone
  const state = join(dir, "state");
  const { mkdirSync } = await import("node:fs");
  mkdirSync(state, { recursive: true });
  const client = await BlockdClient.ensure(state, opts);
  afterAll(async () => {
    try {
      const c = await BlockdClient.connect(join(state, "blockd.sock"));
      await c.call("shutdown");
      await Bun.sleep(300);
    } catch {}
    for (const name of ["blockd.pid", "keeper.pid"]) {
      const pidFile = join(state, name);
      if (!existsSync(pidFile)) continue;
      try {
        process.kill(Number(readFileSync(pidFile, "utf8")), "SIGKILL");
      } catch {}
    }
    // Nothing of this blockd may outlive it: no mount under its state dir, no loop on its files.
    const leaked = readFileSync("/proc/mounts", "utf8").split("\n").filter((l) => l.includes(state));
    rmSync(dir, { recursive: true, force: true });
    if (leaked.length) throw new Error(`blockd left mounts behind: ${leaked.join("; ")}`);
  });
  return { dir, state, client };
}

export function sh(cmd: string[], input?: Uint8Array): string {
  const r = Bun.spawnSync(cmd, { stdin: input ?? "ignore", stdout: "pipe", stderr: "pipe" });
  if (r.exitCode !== 0) throw new Error(`${cmd.join(" ")} → ${r.exitCode}: ${r.stderr.toString()}`);
  return r.stdout.toString();
}

export function blockdPid(state: string): number {
  return Number(readFileSync(join(state, "blockd.pid"), "utf8"));
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
