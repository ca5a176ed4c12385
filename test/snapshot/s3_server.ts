// Starts test/snapshot/s3rver_main.ts as a child process and waits for its port.
import { join } from "node:path";

export interface TestS3 {
  endpoint: string;
  pid: number;
  stop(): Promise<void>;
}

export interface S3ServerOptions {
  /** Buckets besides `snapshots`. */
  buckets?: string[];
  /** A file each request appends a JSON line to: {method, path, status, bytes} (requestLog reads it). */
  log?: string;
}

export interface S3Request {
  method: string;
  /** `/bucket/key` */
  path: string;
  status: number;
  /** The body a GET answered with (0 for other methods and errors). */
  bytes: number;
}

/** The requests a server started with `log` has answered so far. */
export async function requestLog(path: string): Promise<S3Request[]> {
  const f = Bun.file(path);
  if (!(await f.exists())) return [];
  return (await f.text()).split("\n").filter(Boolean).map((l) => JSON.parse(l) as S3Request);
}

export async function startS3Server(dir: string, timeoutMs = 30_000, opts: S3ServerOptions = {}): Promise<TestS3> {
  const env = { ...process.env, ...(opts.buckets?.length ? { S3RVER_BUCKETS: opts.buckets.join(",") } : {}), ...(opts.log ? { S3RVER_LOG: opts.log } : {}) };
  const proc = Bun.spawn([process.execPath, join(import.meta.dir, "s3rver_main.ts"), dir], { stdout: "pipe", stderr: "inherit", env });
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
