// The host's client of envd's `process.Process/Start` (Connect server stream, JSON envelopes) and
// `/files` upload, for template builds: a command runs as a named user in a cwd with an env, its
// output arrives chunk by chunk, and the call ends with the exit code. Each call has a deadline.

import { readBoundedText } from "./envd.ts";

export class EnvdProcessError extends Error {
  constructor(message: string) { super(message); this.name = "EnvdProcessError"; }
}

/** An error answer (or an upload's answer) is read up to 64 KiB; 300 characters of it are shown. */
const ENVD_ANSWER_MAX_BYTES = 64 << 10;
/** Reading an error answer gets 10 s, whatever deadline the call has. */
const ENVD_ANSWER_TIMEOUT_MS = 10_000;

export interface ProcessSpec {
  cmd: string;
  args: string[];
  user: string;
  cwd?: string;
  envs?: Record<string, string>;
}

export interface ProcessResult {
  exitCode: number;
  /** envd's words for how it ended ("exit status 3", "signal: killed"). */
  status: string;
}

/** A Connect envelope: flags byte, big-endian length, JSON payload. */
function envelope(msg: unknown): Uint8Array {
  const payload = new TextEncoder().encode(JSON.stringify(msg));
  const out = new Uint8Array(5 + payload.length);
  new DataView(out.buffer).setUint32(1, payload.length);
  out.set(payload, 5);
  return out;
}

/**
 * Envelopes of a Connect stream as they arrive: [flags, parsed JSON]. One is at most 16 MiB;
 * bytes left after the last whole envelope are an error.
 */
export async function* connectFrames(body: AsyncIterable<Uint8Array>): AsyncGenerator<[number, any]> {
  let buf = new Uint8Array(0);
  for await (const chunk of body) {
    const next = new Uint8Array(buf.length + chunk.length);
    next.set(buf);
    next.set(chunk, buf.length);
    buf = next;
    while (buf.length >= 5) {
      const len = new DataView(buf.buffer, buf.byteOffset).getUint32(1);
      if (len > 16 * 1024 * 1024) throw new EnvdProcessError(`envd sent a ${len}-byte frame (limit 16 MiB)`);
      if (buf.length < 5 + len) break;
      const flags = buf[0]!;
      const text = new TextDecoder().decode(buf.subarray(5, 5 + len));
      buf = buf.slice(5 + len);
      yield [flags, text === "" ? {} : JSON.parse(text)];
    }
  }
  if (buf.length) throw new EnvdProcessError("trailing bytes after the last envelope");
}

function headers(user: string, token: string | null, extra: Record<string, string> = {}): Record<string, string> {
  return {
    authorization: `Basic ${btoa(`${user}:`)}`,
    ...(token ? { "x-access-token": token } : {}),
    ...extra,
  };
}

/**
 * Runs a process to its end (or until `signal` aborts the stream: the process then keeps running,
 * as envd leaves a process whose client went away). `onOutput` gets each stdout/stderr chunk.
 * `timeoutMs` is envd's deadline: past it envd kills the process.
 */
export async function runProcess(baseUrl: string, token: string | null, spec: ProcessSpec, o: {
  timeoutMs?: number;
  signal?: AbortSignal;
  onOutput?: (text: string, stream: "stdout" | "stderr") => void;
}): Promise<ProcessResult> {
  const extra: Record<string, string> = { "content-type": "application/connect+json", "connect-protocol-version": "1" };
  if (o.timeoutMs !== undefined) extra["connect-timeout-ms"] = String(Math.max(1, Math.floor(o.timeoutMs)));
  const signals = [o.signal, o.timeoutMs !== undefined ? AbortSignal.timeout(o.timeoutMs + 10_000) : undefined].filter((s): s is AbortSignal => !!s);
  const res = await fetch(`${baseUrl}/process.Process/Start`, {
    method: "POST",
    headers: headers(spec.user, token, extra),
    body: envelope({ process: { cmd: spec.cmd, args: spec.args, envs: spec.envs ?? {}, ...(spec.cwd ? { cwd: spec.cwd } : {}) }, stdin: false }),
    signal: signals.length ? AbortSignal.any(signals) : undefined,
  });
  if (res.status !== 200 || !res.body) {
    const text = await readBoundedText(res, ENVD_ANSWER_MAX_BYTES, `envd ${baseUrl} Start`, AbortSignal.timeout(ENVD_ANSWER_TIMEOUT_MS)).catch((e: Error) => `(${e.message})`);
    throw new EnvdProcessError(`envd Start answered HTTP ${res.status}: ${text.slice(0, 300)}`);
  }
  const decoder = { stdout: new TextDecoder(), stderr: new TextDecoder() };
  for await (const [flags, msg] of connectFrames(res.body)) {
    if (flags & 2) {
      const err = msg.error as { code?: string; message?: string } | undefined;
      throw new EnvdProcessError(err ? `envd: ${err.code}: ${err.message}` : "envd ended the stream before the process ended");
    }
    const ev = (msg.event ?? {}) as Record<string, Record<string, unknown>>;
    if (ev.data) {
      for (const k of ["stdout", "stderr"] as const) {
        const b64 = ev.data[k] as string | undefined;
        if (b64) o.onOutput?.(decoder[k].decode(Buffer.from(b64, "base64"), { stream: true }), k);
      }
    } else if (ev.end) {
      return { exitCode: Number(ev.end.exitCode ?? 0), status: String(ev.end.status ?? "") };
    }
  }
  throw new EnvdProcessError("envd's stream ended without the process's end");
}

/** Writes a host file into the guest at `path` (envd `/files`, raw body) as `user`. */
export async function uploadFile(baseUrl: string, token: string | null, user: string, path: string, file: string, timeoutMs: number): Promise<void> {
  const url = `${baseUrl}/files?path=${encodeURIComponent(path)}&username=${encodeURIComponent(user)}`;
  const signal = AbortSignal.timeout(timeoutMs);
  const res = await fetch(url, {
    method: "POST",
    headers: headers(user, token, { "content-type": "application/octet-stream" }),
    body: Bun.file(file),
    signal,
  });
  const text = await readBoundedText(res, ENVD_ANSWER_MAX_BYTES, `envd ${baseUrl} upload of ${path}`, signal);
  if (!res.ok) throw new EnvdProcessError(`envd upload of ${path} answered HTTP ${res.status}: ${text.slice(0, 300)}`);
}
