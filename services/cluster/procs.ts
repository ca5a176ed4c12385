// The cluster's processes on one machine: a gateway or a node started as `bun run` starts it, its
// output kept (the last lines, for failure messages), its URL read from its start line.
import { join } from "node:path";
import type { Subprocess } from "bun";

const ROOT = join(import.meta.dir, "../..");
/** Lines of a process's output kept. */
const LOG_LINES = 400;

export interface ServiceProc {
  proc: Subprocess;
  /** http://host:port it listens on. */
  url: string;
  log: string[];
}

/**
 * Spawns `bun <entry>` with `env` (optionally inside `wrap`, e.g. nsenter) and waits for its
 * "listening on http://…" line. A process that exits first is an error with its last lines.
 */
export async function startService(entry: string, env: Record<string, string | undefined>, o: { wrap?: string[]; timeoutMs?: number; logLines?: number } = {}): Promise<ServiceProc> {
  const keep = o.logLines ?? LOG_LINES;
  const proc = Bun.spawn([...(o.wrap ?? []), process.execPath, entry], { cwd: ROOT, env, stdout: "pipe", stderr: "pipe" });
  const log: string[] = [];
  let url = "";
  const pump = async (s: ReadableStream<Uint8Array>) => {
    const dec = new TextDecoder();
    for await (const chunk of s) {
      for (const line of dec.decode(chunk, { stream: true }).split("\n")) {
        if (!line) continue;
        log.push(line);
        if (log.length > keep) log.shift();
        const m = /listening on (http:\/\/[^\s]+)/.exec(line);
        if (m && !url) url = m[1]!.replace("0.0.0.0", "127.0.0.1");
      }
    }
  };
  void pump(proc.stdout as ReadableStream<Uint8Array>);
  void pump(proc.stderr as ReadableStream<Uint8Array>);
  const until = performance.now() + (o.timeoutMs ?? 60_000);
  while (!url) {
    if (proc.exitCode !== null) throw new Error(`${entry} exited ${proc.exitCode}:\n${log.slice(-30).join("\n")}`);
    if (performance.now() > until) {
      proc.kill(9);
      throw new Error(`${entry} did not say where it listens:\n${log.slice(-30).join("\n")}`);
    }
    await Bun.sleep(50);
  }
  return { proc, url, log };
}

/** The gateway's entry point (`bun run gateway`). */
export const GATEWAY_ENTRY = "services/gateway/main.ts";
/** The node's entry point (`bun run node`). */
export const NODE_ENTRY = "src/node/main.ts";
