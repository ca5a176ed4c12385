// A node stand-in for the adoption test: boots one QEMU VM (plain-file drives, a loopback forward),
// waits until the guest answers, prints {pid, runDir} and waits to be killed with -9.
import { QemuDriver } from "../../src/vmm/qemu.ts";
import { waitHttp } from "./harness.ts";

const o = JSON.parse(process.argv[2]!) as { runDir: string; kernel: string; initrd: string; cmdline: string; tools: string; rootfs: string; port: number; guestPort: number };
const vm = await new QemuDriver().boot({
  id: "adopt1", runDir: o.runDir, kernel: o.kernel, initrd: o.initrd, cmdline: o.cmdline, vcpus: 1, memMiB: 256,
  drives: [{ path: o.tools, readOnly: true }, { path: o.rootfs }],
  net: { user: { forwards: [{ hostPort: o.port, guestPort: o.guestPort }] } },
});
await waitHttp(`http://127.0.0.1:${o.port}/health`, 60_000);
console.log(JSON.stringify({ pid: vm.pid, runDir: o.runDir }));
await new Promise(() => {});
