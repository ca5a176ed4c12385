// A node process for the restart test: the node's parts over the given directories and its API on
// loopback. Default: creates a sandbox with the e2b SDK, leaves a file and a background process in
// it, prints them as JSON, and waits to be killed with -9. With `resume` (a paused sandbox's id):
// recovers, starts its resume, prints its runtime once the VM is restored (before envd answers)
// and stops itself (SIGSTOP), so a kill -9 lands mid-resume.
import { writeSync } from "node:fs";
import { Sandbox } from "e2b";
import { BlockdClient } from "../../src/blockdev/client.ts";
import type { SandboxRuntime } from "../../src/orchestrator/orchestrator.ts";
import { nodeParts, serveParts, type NodeDirs } from "./harness.ts";

const dirs = JSON.parse(process.argv[2]!) as NodeDirs & { blockdSock: string; apiKey: string; resume?: string };
const blockd = await BlockdClient.connect(dirs.blockdSock);
const parts = await nodeParts(dirs, blockd);
if (dirs.resume) {
  const id = dirs.resume;
  await parts.orch.recover();
  const held = (parts.store.get(id)!.runtime as SandboxRuntime).resumeDevice ?? null;
  void parts.orch.connect(id, 60).catch((e) => console.error(`crash child: resume of ${id}: ${(e as Error).message}`));
  for (;;) {
    const rt = parts.store.get(id)!.runtime as SandboxRuntime;
    if (rt.vmPid) {
      writeSync(1, `${JSON.stringify({ held, rootfsDevice: rt.rootfsDevice, state: parts.store.get(id)!.state })}\n`); // out before the stop
      process.kill(process.pid, "SIGSTOP");
    }
    await Bun.sleep(1);
  }
}
const { base } = serveParts(parts.orch, dirs.apiKey);
const opts = { apiKey: dirs.apiKey, apiUrl: base, sandboxUrl: base, requestTimeoutMs: 120_000 };
const sbx = await Sandbox.create("busybox", opts);
await sbx.files.write("/tmp/before-crash.txt", "written before kill -9");
const bg = await sbx.commands.run("sleep 3600", { background: true, timeoutMs: 0 });
console.log(JSON.stringify({ id: sbx.sandboxId, pid: bg.pid }));
await new Promise(() => {});
