// Starts envd as a host process on a free loopback port, with its own passwd/group files so that
// "root" and "user" have homes inside a scratch directory (nothing outside it is written).
import { chmodSync, chownSync, mkdirSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { Sandbox } from "e2b";
import { connectFrames } from "../../src/orchestrator/envd_process.ts";

export const USER_UID = 65534; // "nobody" on the host: an unprivileged uid that surely exists
const MAIN = join(import.meta.dir, "../../guest/envd/main.ts");

export interface Envd {
  url: string;
  port: number;
  /** envd's own pid (for /proc/<pid>/status in memory checks). */
  pid: number;
  /** The address envd printed it listens on. */
  host: string;
  root: string;
  rootHome: string;
  userHome: string;
  stop(): Promise<void>;
  /** Lines envd wrote to stderr so far (for debugging failures). */
  logs(): string;
}

/** Grace for SIGTERM before stop() kills envd outright (a stuck envd must not hang the suite). */
const STOP_GRACE_MS = 10_000;

/** host: the --host given (null: none, envd picks its default). */
export async function startEnvd(extraArgs: string[] = [], { host = "127.0.0.1" }: { host?: string | null } = {}): Promise<Envd> {
  mkdirSync("/var/tmp/aenv-test", { recursive: true });
  const root = mkdtempSync("/var/tmp/aenv-test/envd-"); // on a real disk, so xattrs and inotify behave as in a guest
  chmodSync(root, 0o755); // the unprivileged user must be able to reach its home
  const rootHome = join(root, "root");
  const userHome = join(root, "home", "user");
  mkdirSync(rootHome, { recursive: true });
  mkdirSync(userHome, { recursive: true });
  chownSync(userHome, USER_UID, USER_UID);
  writeFileSync(join(root, "passwd"), `root:x:0:0:root:${rootHome}:/bin/bash\nuser:x:${USER_UID}:${USER_UID}::${userHome}:/bin/bash\n`);
  writeFileSync(join(root, "group"), `root:x:0:\nuser:x:${USER_UID}:\n`);

  const proc = Bun.spawn(
    [process.execPath, MAIN, "--port", "0", ...(host === null ? [] : ["--host", host]), "--default-user", "user",
      "--passwd", join(root, "passwd"), "--group", join(root, "group"), ...extraArgs],
    { cwd: root, stdout: "pipe", stderr: "pipe", env: { ...process.env, E2B_DEBUG: undefined } },
  );
  let errText = "";
  void (async () => {
    for await (const c of proc.stderr) errText += new TextDecoder().decode(c);
  })();
  const reader = proc.stdout.getReader();
  let out = "";
  const deadline = Date.now() + 15_000;
  const LISTENING = /listening on (\S+):(\d+)/;
  while (!LISTENING.test(out)) {
    if (Date.now() > deadline) throw new Error(`envd did not start: ${out}${errText}`);
    const { done, value } = await reader.read();
    if (done) throw new Error(`envd exited: ${out}${errText}`);
    out += new TextDecoder().decode(value);
  }
  reader.releaseLock();
  const [, listenHost, listenPort] = LISTENING.exec(out)!;
  const port = Number(listenPort);
  return {
    url: `http://127.0.0.1:${port}`,
    port,
    pid: proc.pid,
    host: listenHost!,
    root,
    rootHome,
    userHome,
    logs: () => errText,
    async stop() {
      proc.kill("SIGTERM");
      const killer = setTimeout(() => proc.kill("SIGKILL"), STOP_GRACE_MS);
      await proc.exited;
      clearTimeout(killer);
      rmSync(root, { recursive: true, force: true });
    },
  };
}

/**
 * The unmodified SDK aimed straight at envd: `debug: true` makes Sandbox.connect skip the E2B API
 * entirely (no control-plane call, envdVersion "99.99.99" so every feature is on), and `sandboxUrl`
 * overrides debug's fixed http://localhost:49983 with our port (ConnectionConfig.getSandboxUrl
 * prefers sandboxUrl over the debug URL). A secured sandbox (access token) has no public way in
 * debug mode, so `envdAccessToken` goes through the constructor, as Sandbox.connect does itself.
 */
export async function sdkSandbox(envd: Envd, accessToken?: string): Promise<Sandbox> {
  if (!accessToken) return Sandbox.connect("envdtest", { debug: true, sandboxUrl: envd.url });
  const Ctor = Sandbox as unknown as new (o: Record<string, unknown>) => Sandbox;
  return new Ctor({ sandboxId: "envdtest", envdVersion: "0.6.13", envdAccessToken: accessToken, debug: true, sandboxUrl: envd.url });
}

/** One Connect envelope around a JSON (or raw) message. */
export function envelope(msg: unknown, flags = 0): Uint8Array {
  const b = msg instanceof Uint8Array ? msg : new TextEncoder().encode(JSON.stringify(msg));
  const out = new Uint8Array(5 + b.length);
  out[0] = flags;
  new DataView(out.buffer).setUint32(1, b.length);
  out.set(b, 5);
  return out;
}

/** Splits a streaming response body into [flags, payload] envelopes. */
export function envelopes(body: Uint8Array): [number, Uint8Array][] {
  const out: [number, Uint8Array][] = [];
  let off = 0;
  while (off + 5 <= body.length) {
    const len = new DataView(body.buffer, body.byteOffset + off).getUint32(1);
    out.push([body[off]!, body.subarray(off + 5, off + 5 + len)]);
    off += 5 + len;
  }
  if (off !== body.length) throw new Error("trailing bytes after the last envelope");
  return out;
}

export function jsonEnvelopes(body: Uint8Array): [number, any][] {
  return envelopes(body).map(([f, p]) => [f, JSON.parse(new TextDecoder().decode(p))]);
}

/** Resident memory of a process in bytes (VmRSS from /proc/<pid>/status). */
export function rssBytes(pid: number): number {
  const m = /^VmRSS:\s+(\d+) kB$/m.exec(readFileSync(`/proc/${pid}/status`, "utf8"));
  if (!m) throw new Error(`no VmRSS for pid ${pid}`);
  return Number(m[1]) * 1024;
}

/** Polls `cond` until it holds; the bound is generous because the test machine is shared and loaded. */
export async function until(cond: () => boolean | Promise<boolean>, what = "condition", ms = 30_000) {
  const end = Date.now() + ms;
  while (!(await cond())) {
    if (Date.now() > end) throw new Error(`${what} not met within ${ms} ms`);
    await Bun.sleep(20);
  }
}

export interface RawExchange {
  /** Everything the server sent back before `done` held or the connection closed. */
  response: string;
  /** Body bytes the server accepted from us meanwhile. */
  sent: number;
}

/**
 * One HTTP/1.1 request over a raw loopback socket: `head` (request line and headers), then body
 * bytes from `body(i)` (null ends it) for as long as the server has not answered `done`. For
 * requests fetch() cannot make: huge declared lengths, answers expected before the body ends.
 */
export async function rawExchange(port: number, head: string, body: (i: number) => Uint8Array | null, done: (response: string) => boolean, ms = 60_000): Promise<RawExchange> {
  let response = "";
  let closed = false;
  let wake = () => {};
  const sock = await Bun.connect({
    hostname: "127.0.0.1",
    port,
    socket: {
      data: (_s, d) => {
        response += new TextDecoder().decode(d);
        wake();
      },
      drain: () => wake(),
      close: () => {
        closed = true;
        wake();
      },
      error: () => {
        closed = true;
        wake();
      },
    },
  });
  const idle = () => new Promise<void>((r) => (wake = r));
  const deadline = Date.now() + ms;
  let sent = 0;
  try {
    sock.write(head);
    for (let i = 0; !closed && !done(response); i++) {
      if (Date.now() > deadline) throw new Error(`no answer within ${ms} ms; got ${JSON.stringify(response.slice(0, 200))}`);
      const chunk = body(i);
      if (!chunk) break;
      for (let off = 0; off < chunk.length && !closed && !done(response); ) {
        const n = sock.write(chunk.subarray(off));
        off += Math.max(0, n);
        sent += Math.max(0, n);
        if (off < chunk.length) await Promise.race([idle(), Bun.sleep(50)]);
      }
    }
    while (!closed && !done(response)) {
      if (Date.now() > deadline) throw new Error(`no answer within ${ms} ms; got ${JSON.stringify(response.slice(0, 200))}`);
      await Promise.race([idle(), Bun.sleep(50)]);
    }
  } finally {
    sock.end();
  }
  return { response, sent };
}

/** A streaming response's envelopes as they arrive, JSON-decoded: for asserting order while a stream is open. */
export function jsonFrames(res: Response): AsyncGenerator<[number, any]> {
  return connectFrames(res.body as AsyncIterable<Uint8Array>);
}
