// Starts test/snapshot/s3rver_main.ts as a child process and waits for its port.
import { join } from "node:path";

export interface TestS3 {
  endpoint: string;
  pid: number;
  stop(): Promise<void>;
}

export async function startS3Server(dir: string, timeoutMs = 30_000): Promise<TestS3> {
  const proc = Bun.spawn([process.execPath, join(import.meta.dir, "s3rver_main.ts"), dir], { stdout: "pipe", stderr: "inherit" });
  const reader = proc.stdout.getReader();
  let text = "";
  const deadline = Date.now() + timeoutMs;
  let timer: Timer | undefined;
  try {
    while (!text.includes("\n")) {
      const left = deadline - Date.now();
      const chunk = await Promise.race([
        reader.read(),
        new Promise<never>((_, reject) => { timer = setTimeout(() => reject(new Error(`s3rver did not print its port in ${timeoutMs} ms`)), Math.max(0, left)); }),
      ]);
      clearTimeout(timer);
      if (chunk.done) throw new Error(`s3rver exited before printing its port (${await proc.exited})`);
      text += new TextDecoder().decode(chunk.value);
    }
  } catch (e) {
    proc.kill();
    throw e;
  } finally {
    reader.releaseLock();
  }
  const port = Number(text.trim());
  if (!Number.isInteger(port) || port <= 0) {
    proc.kill();
    throw new Error(`s3rver printed ${JSON.stringify(text)}, not a port`);
  }
  return {
    endpoint: `http://127.0.0.1:${port}`,
    pid: proc.pid,
    async stop() {
      proc.kill();
      await proc.exited;
    },
  };
}
