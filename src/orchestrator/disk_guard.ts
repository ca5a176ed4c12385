// Disk bounds a create checks before it takes anything: $AENV_HOME's filesystem keeps
// disk_reserve_mb free (a sandbox's upper layer, memory layers and snapshots all grow there), and a
// sandbox's disk is at most max_disk_size_mb. Both refusals are 507 (Insufficient Storage).
import { statfs } from "node:fs/promises";
import { OrchestratorError } from "./errors.ts";

/** 2 GiB: room for the node's database, logs and the first writes of the sandboxes already running. */
export const DEFAULT_DISK_RESERVE_BYTES = 2 * 2 ** 30;

const mib = (bytes: number) => Math.floor(bytes / 2 ** 20);

/** 507 when the filesystem of `home` has less than `reserveBytes` free for unprivileged use (statfs f_bavail). */
export async function checkDiskReserve(home: string, reserveBytes: number = DEFAULT_DISK_RESERVE_BYTES): Promise<void> {
  const fs = await statfs(home);
  const free = fs.bavail * fs.bsize;
  if (free < reserveBytes) {
    throw new OrchestratorError(507, `the node's disk is nearly full: ${mib(free)} MiB free on the filesystem of ${home}, less than disk_reserve_mb (${mib(reserveBytes)} MiB); no sandbox is created until space is freed`);
  }
}

/** 507 when a template's disk (diskSizeMB) is larger than the node's max_disk_size_mb. */
export function checkDiskSize(diskSizeMB: number, maxDiskSizeMB: number, template: string): void {
  if (diskSizeMB > maxDiskSizeMB) {
    throw new OrchestratorError(507, `template '${template}' has a disk of ${diskSizeMB} MiB, more than this node's max_disk_size_mb (${maxDiskSizeMB} MiB)`);
  }
}
