// One blockd per state dir: flock(LOCK_EX | LOCK_NB) on <state>/blockd.lock, held for blockd's
// life. The kernel drops the lock when the process dies, so a crash never leaves it stale. Two
// blockds on one state would serve the same FUSE connections and write the same uppers.

import { existsSync, readFileSync } from "node:fs";
import { join } from "node:path";
import { O_CLOEXEC, O_CREAT, O_RDWR, SyscallError, close, open, syscall } from "../../ffi/libc.ts";
import { BlockdError } from "./protocol.ts";

const SYS_flock = 73; // x86_64
const LOCK_EX = 2;
const LOCK_NB = 4;

/** Take the state dir's lock (its fd, close-on-exec, kept open); StateBusy when another blockd has it. */
export function lockState(stateDir: string): number {
  const fd = open(join(stateDir, "blockd.lock"), O_RDWR | O_CREAT | O_CLOEXEC, 0o600);
  try {
    syscall(SYS_flock, fd, LOCK_EX | LOCK_NB);
    return fd;
  } catch (e) {
    close(fd);
    if (!(e instanceof SyscallError && e.code === "EAGAIN")) throw e;
    const pidFile = join(stateDir, "blockd.pid");
    const pid = existsSync(pidFile) ? readFileSync(pidFile, "utf8").trim() : "starting";
    throw new BlockdError("StateBusy", `another blockd (pid ${pid}) serves ${stateDir}`);
  }
}
