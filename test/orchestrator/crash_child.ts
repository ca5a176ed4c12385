// A node process for the restart test: the node's parts over the given directories and its API on
// loopback; creates a sandbox with the e2b SDK, leaves a file and a background process in it,
// prints them as JSON, and then waits to be killed with -9.
import { Sandbox } from "e2b";
import { BlockdClient } from "../../src/blockdev/client.ts";
import { nodeParts, serveParts, type NodeDirs } from "./harness.ts";

const dirs = JSON.parse(process.argv[2]!) as NodeDirs & { blockdSock: string; apiKey: string };
const blockd = await BlockdClient.connect(dirs.blockdSock);
const parts = await nodeParts(dirs, blockd);
const { base } = serveParts(parts.orch, dirs.apiKey);
const opts = { apiKey: dirs.apiKey, apiUrl: base, sandboxUrl: base, requestTimeoutMs: 120_000 };
const sbx = await Sandbox.create("busybox", opts);
await sbx.files.write("/tmp/before-crash.txt", "written before kill -9");
const bg = await sbx.commands.run("sleep 3600", { background: true, timeoutMs: 0 });
console.log(JSON.stringify({ id: sbx.sandboxId, pid: bg.pid }));
await new Promise(() => {});
