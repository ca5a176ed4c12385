// Picks the VMM at node start (docs/vmm.md): Firecracker when its binary and a usable /dev/kvm
// exist, QEMU otherwise. `vmm` (the node's AENV_VMM) forces one; forcing an unusable one is an error.

import { FirecrackerDriver, type FirecrackerOptions, firecrackerAvailable } from "./firecracker.ts";
import { QemuDriver, type QemuOptions } from "./qemu.ts";
import { type VmmDriver, VmmError, type VmmKind } from "./types.ts";

export interface SelectOptions {
  vmm?: VmmKind | "auto";
  qemu?: QemuOptions;
  firecracker?: FirecrackerOptions;
}

export function selectDriver(o: SelectOptions = {}): { driver: VmmDriver; reason: string } {
  const want: string = o.vmm ?? "auto";
  if (want !== "auto" && want !== "qemu" && want !== "firecracker") throw new VmmError("BadSpec", `AENV_VMM must be qemu, firecracker or auto, not ${want}`);
  const fc = firecrackerAvailable(o.firecracker);
  if (want === "firecracker") {
    if (!fc.usable) throw new VmmError("Unsupported", `Firecracker was asked for but cannot run: ${fc.reason}`);
    return { driver: new FirecrackerDriver(o.firecracker), reason: `forced: ${fc.reason}` };
  }
  if (want === "auto" && fc.usable) return { driver: new FirecrackerDriver(o.firecracker), reason: fc.reason };
  const q = new QemuDriver(o.qemu);
  return { driver: q, reason: want === "qemu" ? `forced: QEMU (${q.accel})` : `QEMU (${q.accel}) because Firecracker cannot run: ${fc.reason}` };
}
