// What a dead blockd may have left of a device on the host: a FUSE mount at its path (dead once
// the connection is gone) and loop devices over that path. Read at start only, from /proc and /sys.

import { existsSync, readdirSync, readFileSync } from "node:fs";
import { join } from "node:path";
import { loopDetach } from "../../ffi/loop.ts";

/** mountinfo escapes space, tab, newline and backslash as \ooo. */
const unescapeMountPath = (p: string) => p.replace(/\\([0-7]{3})/g, (_, o: string) => String.fromCharCode(parseInt(o, 8)));

/** True when something is mounted at `path` (field 5 of /proc/self/mountinfo). */
export function isMountPoint(path: string): boolean {
  for (const line of readFileSync("/proc/self/mountinfo", "utf8").split("\n")) {
    const mountPoint = line.split(" ")[4];
    if (mountPoint !== undefined && unescapeMountPath(mountPoint) === path) return true;
  }
  return false;
}

/** The file a loop device (/dev/loopN) is bound to, or undefined when it is unbound or unknown. */
export function loopBackingFile(loop: string): string | undefined {
  const f = `/sys/block/${loop.replace(/^\/dev\//, "")}/loop/backing_file`;
  try {
    return readFileSync(f, "utf8").replace(/\n$/, "").replace(/ \(deleted\)$/, "");
  } catch {
    return undefined;
  }
}

/** Every loop device bound to `path`. */
export function loopsBackedBy(path: string): string[] {
  if (!existsSync("/sys/block")) return [];
  return readdirSync("/sys/block")
    .filter((n) => /^loop\d+$/.test(n))
    .map((n) => join("/dev", n))
    .filter((loop) => loopBackingFile(loop) === path);
}

/** Detach a loop device; a failure is reported, not thrown (the device it served comes back anyway). */
export function detachLoop(loop: string): void {
  try {
    loopDetach(loop);
  } catch (e) {
    console.error(`blockd: detaching ${loop}: ${(e as Error).message}`);
  }
}
