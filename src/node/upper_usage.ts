// A sandbox's upper layer on disk, for /metrics (aenv_sandbox_upper_bytes): the blocks allocated
// (st_blocks · 512, so sparse files count what they hold) to the data and index files of every
// upper folder under $AENV_HOME/sandboxes/<id>/ (`upper`, and `upper-<random>` of a restore or a
// resume's held device).
import { readdir, stat } from "node:fs/promises";
import { join } from "node:path";
import { WRITABLE_DATA, WRITABLE_INDEX } from "../storage/lsmt/writable_layer.ts";

/** A sandbox has at most this many upper folders counted (one live, one held for a resume, leftovers). */
const MAX_UPPER_DIRS = 16;

const allocated = async (path: string): Promise<number> => {
  try {
    return (await stat(path)).blocks * 512;
  } catch {
    return 0; // gone between the listing and the stat (a pause, a kill)
  }
};

/** Bytes on disk of the sandbox's upper layer files; 0 when it has none (paused, gone, unknown). */
export async function sandboxUpperBytes(home: string, sandboxId: string): Promise<number> {
  if (!/^[a-z0-9]{1,64}$/.test(sandboxId)) return 0;
  const dir = join(home, "sandboxes", sandboxId);
  let names: string[];
  try {
    names = await readdir(dir);
  } catch {
    return 0;
  }
  const uppers = names.filter((n) => n === "upper" || n.startsWith("upper-")).slice(0, MAX_UPPER_DIRS);
  const sizes = await Promise.all(uppers.flatMap((u) => [allocated(join(dir, u, WRITABLE_DATA)), allocated(join(dir, u, WRITABLE_INDEX))]));
  return sizes.reduce((a, b) => a + b, 0);
}
