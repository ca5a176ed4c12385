// Raw wire tests for envd: Connect framing in JSON and binary protobuf, error codes, malformed
// input of every kind, /files edge cases, /init, signing, and that nothing kills the process.
import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { existsSync, mkdirSync, readFileSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { schema } from "../../guest/envd/schema.ts";
import { envelope, envelopes, jsonEnvelopes, jsonFrames, startEnvd, until, type Envd } from "./harness.ts";

let envd: Envd;

beforeAll(async () => {
  envd = await startEnvd();
});
afterAll(async () => {
  await envd?.stop();
});

const JSON_CT = { "content-type": "application/json" };
const STREAM_CT = { "content-type": "application/connect+json" };

function post(path: string, body: RequestInit["body"] | Uint8Array, headers: Record<string, string> = JSON_CT) {
  return fetch(`${envd.url}${path}`, { method: "POST", headers, body: body as RequestInit["body"] });
}

async function unary(path: string, msg: unknown, headers: Record<string, string> = {}) {
  const r = await post(path, JSON.stringify(msg), { ...JSON_CT, ...headers });
  return { status: r.status, body: (await r.json()) as any };
}

/** The pid of the live process carrying `tag`, once envd lists it. */
async function listedPid(tag: string): Promise<number> {
  let pid = 0;
  await until(async () => {
    const l = await unary("/process.Process/List", {});
    pid = (l.body.processes ?? []).find((p: any) => p.tag === tag)?.pid ?? 0;
    return pid > 0;
  }, `a process tagged ${tag}`);
  return pid;
}

/** A flag file the test creates to let a waiting process go on (no timing in the test). */
const waitFor = (flag: string) => `while [ ! -e ${flag} ]; do sleep 0.05; done`;

async function stream(path: string, msg: unknown, headers: Record<string, string> = {}) {
  const r = await post(path, envelope(msg), { ...STREAM_CT, ...headers });
  expect(r.status).toBe(200);
  expect(r.headers.get("content-type")).toBe("application/connect+json");
  return jsonEnvelopes(new Uint8Array(await r.arrayBuffer()));
}

/** Bytes of a length-delimited field, for hand-built protobuf. */
function ld(no: number, payload: Uint8Array | string): number[] {
  const b = typeof payload === "string" ? new TextEncoder().encode(payload) : payload;
  return [(no << 3) | 2, b.length, ...b];
}

describe("routing and Connect errors", () => {
  test("health is 204 no-store", async () => {
    const r = await fetch(`${envd.url}/health`);
    expect([r.status, r.headers.get("cache-control")]).toEqual([204, "no-store"]);
  });

  test("unknown paths, methods, verbs and content types", async () => {
    const nf = await fetch(`${envd.url}/nope`);
    expect([nf.status, ((await nf.json()) as any).code]).toEqual([404, 404]);
    const um = await unary("/process.Process/Explode", {});
    expect([um.status, um.body.code]).toEqual([404, "unimplemented"]);
    expect((await unary("/filesystem.Filesystem/constructor", {})).body.code).toBe("unimplemented");
    expect((await fetch(`${envd.url}/filesystem.Filesystem/Stat`)).status).toBe(405);
    expect((await post("/filesystem.Filesystem/Stat", "{}", { "content-type": "text/plain" })).status).toBe(415);
    // A unary method spoken to with the streaming content type (and vice versa) is refused.
    expect((await post("/filesystem.Filesystem/Stat", envelope({}), STREAM_CT)).status).toBe(415);
    expect((await post("/process.Process/Start", "{}")).status).toBe(415);
  });

  test("malformed unary JSON and wrong field types are invalid_argument", async () => {
    for (const body of ["{", "[]", '"x"', '{"path":5}', '{"depth":"abc"}', '{"depth":-1}', "\xff\xfe"]) {
      const r = await post("/filesystem.Filesystem/ListDir", body);
      expect(r.status).toBe(400);
      expect(((await r.json()) as any).code).toBe("invalid_argument");
    }
    // Unknown fields are ignored, both spellings of a field are accepted.
    const ok = await unary("/filesystem.Filesystem/ListDir", { path: envd.root, bogus: 1, depth: 1 });
    expect(ok.status).toBe(200);
    const watcher = await unary("/filesystem.Filesystem/CreateWatcher", { path: envd.root, include_entry: true });
    expect(watcher.status).toBe(200);
    expect((await unary("/filesystem.Filesystem/RemoveWatcher", { watcher_id: watcher.body.watcherId })).status).toBe(200);
  });

  test("errors map to Connect codes and HTTP statuses", async () => {
    expect(await unary("/filesystem.Filesystem/Stat", { path: "/no/such" })).toMatchObject({ status: 404, body: { code: "not_found" } });
    mkdirSync(join(envd.root, "exists"), { recursive: true });
    expect(await unary("/filesystem.Filesystem/MakeDir", { path: join(envd.root, "exists") })).toMatchObject({ status: 409, body: { code: "already_exists" } });
    writeFileSync(join(envd.root, "file"), "x");
    expect(await unary("/filesystem.Filesystem/ListDir", { path: join(envd.root, "file") })).toMatchObject({ status: 400, body: { code: "invalid_argument" } });
    expect(await unary("/process.Process/SendInput", { process: { pid: 999999 }, input: { stdin: "" } })).toMatchObject({ status: 404, body: { code: "not_found" } });
    expect(await unary("/process.Process/SendSignal", { process: { pid: 1 }, signal: "SIGNAL_SIGKILL" })).toMatchObject({ status: 404, body: { code: "not_found" } });
    expect(await unary("/filesystem.Filesystem/Stat", { path: "~bob/x" })).toMatchObject({ status: 400, body: { code: "invalid_argument" } });
    const bad = await unary("/filesystem.Filesystem/Stat", { path: "/" }, { authorization: `Basic ${btoa("mallory:")}` });
    expect(bad).toMatchObject({ status: 401, body: { code: "unauthenticated", message: "invalid username: 'mallory'" } });
    expect((await unary("/filesystem.Filesystem/Stat", { path: "/" }, { "connect-timeout-ms": "soon" })).body.code).toBe("invalid_argument");
  });

  test("relative paths resolve against the user's home; Basic auth picks the user", async () => {
    writeFileSync(join(envd.userHome, "mine.txt"), "m");
    const st = await unary("/filesystem.Filesystem/Stat", { path: "mine.txt" });
    expect(st.body.entry).toMatchObject({ name: "mine.txt", path: join(envd.userHome, "mine.txt"), type: "FILE_TYPE_FILE", size: "1", mode: 0o644 });
    const asRoot = await unary("/filesystem.Filesystem/Stat", { path: "~" }, { authorization: `Basic ${btoa("root:")}` });
    expect(asRoot.body.entry.path).toBe(envd.rootHome);
  });

  test("gzip-compressed unary request body", async () => {
    const r = await post("/filesystem.Filesystem/Stat", Bun.gzipSync(JSON.stringify({ path: envd.root })), { ...JSON_CT, "content-encoding": "gzip" });
    expect(r.status).toBe(200);
    const bad = await post("/filesystem.Filesystem/Stat", "not gzip", { ...JSON_CT, "content-encoding": "gzip" });
    expect(((await bad.json()) as any).code).toBe("invalid_argument");
    const unknown = await post("/filesystem.Filesystem/Stat", "{}", { ...JSON_CT, "content-encoding": "br" });
    expect(((await unknown.json()) as any).code).toBe("unimplemented");
  });
});

describe("binary protobuf", () => {
  test("unary Stat in application/proto", async () => {
    const req = new Uint8Array(ld(1, envd.root));
    const r = await post("/filesystem.Filesystem/Stat", req, { "content-type": "application/proto" });
    expect([r.status, r.headers.get("content-type")]).toEqual([200, "application/proto"]);
    const bytes = new Uint8Array(await r.arrayBuffer());
    expect(bytes[0]).toBe(0x0a); // field 1 (entry), length-delimited
    const msg = schema.decode("filesystem.StatResponse", bytes) as any;
    expect(msg.entry.path).toBe(envd.root);
    expect(msg.entry.type).toBe(2);
    expect(msg.entry.modifiedTime.seconds).toBeGreaterThan(1_600_000_000);
  });

  test("malformed protobuf is invalid_argument", async () => {
    for (const body of [[0x0a, 0x10, 0x41], [0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff], [0x08, 0x01], [0x0b], [0x0a, 0x02, 0xc3, 0x28]]) {
      const r = await post("/filesystem.Filesystem/Stat", new Uint8Array(body), { "content-type": "application/proto" });
      expect(r.status).toBe(400);
      expect(((await r.json()) as any).code).toBe("invalid_argument");
    }
  });

  test("streaming Start in application/connect+proto", async () => {
    const config = ld(1, "/bin/sh").concat(ld(2, "-c"), ld(2, "echo $$"));
    const req = envelope(new Uint8Array(ld(1, new Uint8Array(config)).concat([0x20, 0x00]))); // stdin=false
    const r = await post("/process.Process/Start", req, { "content-type": "application/connect+proto" });
    expect(r.headers.get("content-type")).toBe("application/connect+proto");
    const frames = envelopes(new Uint8Array(await r.arrayBuffer()));
    // StartResponse{event{start{pid}}}: 0a len 0a len 08 <varint>
    expect([...frames[0]![1].subarray(0, 1)]).toEqual([0x0a]);
    const events = frames.slice(0, -1).map(([, p]) => (schema.decode("process.StartResponse", p) as any).event);
    const out = events.filter((e) => e.data).map((e) => new TextDecoder().decode(e.data.stdout)).join("");
    expect(out).toBe(`${events[0].start.pid}\n`); // the pid envd reported is the process's own
    expect(events.at(-1).end).toMatchObject({ exited: true, status: "exit status 0" });
    const [flags, end] = frames.at(-1)!;
    expect([flags, new TextDecoder().decode(end)]).toEqual([2, "{}"]);
  });
});

describe("streams", () => {
  test("errors before the stream starts are 200 + end-stream error", async () => {
    const broken = await post("/process.Process/Start", new Uint8Array([0, 0, 0, 0, 99, 1, 2]), STREAM_CT);
    expect(broken.status).toBe(200);
    expect(jsonEnvelopes(new Uint8Array(await broken.arrayBuffer()))).toEqual([[2, { error: { code: "invalid_argument", message: "incomplete envelope" } }]]);
    const garbage = await post("/process.Process/Start", envelope(new TextEncoder().encode("{nope")), STREAM_CT);
    const [[f, e]] = jsonEnvelopes(new Uint8Array(await garbage.arrayBuffer())) as any;
    expect([f, e.error.code]).toEqual([2, "invalid_argument"]);
    expect(await stream("/process.Process/Start", { process: {} })).toMatchObject([[2, { error: { code: "invalid_argument" } }]]);
    expect(await stream("/process.Process/Start", { process: { cmd: "/no/such/binary" } })).toMatchObject([[2, { error: { code: "invalid_argument" } }]]);
    // The same for a user with supplementary groups (started through setpriv): still refused up front.
    const groupFile = join(envd.root, "group");
    const groups = readFileSync(groupFile, "utf8");
    writeFileSync(groupFile, `${groups}wheel:x:4242:user\n`);
    try {
      for (const cmd of ["/no/such/binary", "no-such-command-anywhere"])
        expect(await stream("/process.Process/Start", { process: { cmd } })).toMatchObject([[2, { error: { code: "invalid_argument" } }]]);
    } finally {
      writeFileSync(groupFile, groups);
    }
    expect(await stream("/process.Process/Connect", { process: { pid: 999999 } })).toMatchObject([[2, { error: { code: "not_found" } }]]);
    expect(await stream("/filesystem.Filesystem/WatchDir", { path: "/no/such" })).toMatchObject([[2, { error: { code: "not_found" } }]]);
    const unauth = await stream("/process.Process/Start", { process: { cmd: "/bin/true" } }, { authorization: `Basic ${btoa("mallory:")}` });
    expect(unauth).toMatchObject([[2, { error: { code: "unauthenticated" } }]]);
    expect(await stream("/process.Process/Start", { process: { cmd: "/bin/true" } }, { "connect-content-encoding": "zstd" })).toMatchObject([[2, { error: { code: "unimplemented" } }]]);
  });

  test("exit code, signal and stdin-less start; start event first, end-stream last", async () => {
    const frames = await stream("/process.Process/Start", { process: { cmd: "/bin/sh", args: ["-c", "echo $$; echo e >&2; exit 3"] }, stdin: false });
    expect(frames[0]).toEqual([0, { event: { start: { pid: expect.any(Number) } } }]);
    expect(frames[1]).toEqual([0, { event: { data: { stdout: btoa(`${frames[0]![1].event.start.pid}\n`) } } }]);
    expect(frames.at(-2)).toEqual([0, { event: { end: { exitCode: 3, exited: true, status: "exit status 3", error: "exit status 3" } } }]);
    expect(frames.at(-1)).toEqual([2, {}]);
    const killed = await stream("/process.Process/Start", { process: { cmd: "/bin/sh", args: ["-c", "kill -TERM $$"] } });
    expect(killed.at(-2)).toEqual([0, { event: { end: { exitCode: -1, status: "signal: terminated", error: "signal: terminated" } } }]);
  });

  test("keepalives flow on idle streams, between start and end", async () => {
    // cat idles until the test closes its stdin, which it does once a keepalive has come.
    const res = await post("/process.Process/Start", envelope({ process: { cmd: "/bin/cat" }, stdin: true }), { ...STREAM_CT, "keepalive-ping-interval": "1" });
    const kinds: (string | undefined)[] = [];
    let pid = 0;
    for await (const [flags, m] of jsonFrames(res)) {
      kinds.push(flags & 2 ? undefined : Object.keys(m.event)[0]);
      if (kinds.at(-1) === "start") {
        pid = m.event.start.pid;
        expect(readFileSync(`/proc/${pid}/cmdline`, "utf8")).toBe("/bin/cat\0");
      }
      if (kinds.at(-1) === "keepalive" && kinds.indexOf("keepalive") === kinds.length - 1) {
        expect((await unary("/process.Process/CloseStdin", { process: { pid } })).status).toBe(200);
      }
    }
    expect(kinds[0]).toBe("start");
    expect(kinds.slice(-2)).toEqual(["end", undefined]);
    const middle = kinds.slice(1, -2);
    expect(middle.length).toBeGreaterThan(0);
    expect(middle.every((k) => k === "keepalive")).toBe(true);
  }, 60_000);

  test("Connect-Timeout-Ms ends the stream with deadline_exceeded and kills the process", async () => {
    const frames = await stream("/process.Process/Start", { process: { cmd: "/bin/sleep", args: ["30"] } }, { "connect-timeout-ms": "300" });
    expect(frames.at(-1)).toEqual([2, { error: { code: "deadline_exceeded", message: "deadline exceeded" } }]);
    const pid = frames[0]![1].event.start.pid;
    await until(async () => !((await unary("/process.Process/List", {})).body.processes ?? []).some((p: any) => p.pid === pid), "the process gone from the list");
    await until(() => !existsSync(`/proc/${pid}`), "the process killed and reaped");
    // Just-exited processes still answer Connect with start + end.
    const again = await stream("/process.Process/Connect", { process: { pid } });
    expect(again.map(([, m]) => Object.keys(m.event ?? {})[0] as string | undefined)).toEqual(["start", "end", undefined]);
  });

  test("StreamInput (client streaming), CloseStdin, List with tag, SendSignal validation", async () => {
    // After EOF the process waits for the flag, so a second CloseStdin still finds it.
    const flag = join(envd.root, "cat-1-go");
    const started = post("/process.Process/Start", envelope({ process: { cmd: "/bin/sh", args: ["-c", `cat; ${waitFor(flag)}`] }, tag: "cat-1", stdin: true }), STREAM_CT);
    const pid = await listedPid("cat-1");
    expect(readFileSync(`/proc/${pid}/cmdline`, "utf8")).toContain("cat; while");
    const body = new Uint8Array([
      ...envelope({ start: { process: { tag: "cat-1" } } }),
      ...envelope({ keepalive: {} }),
      ...envelope({ data: { input: { stdin: btoa("via stream") } } }),
    ]);
    const si = await post("/process.Process/StreamInput", body, STREAM_CT);
    expect(jsonEnvelopes(new Uint8Array(await si.arrayBuffer()))).toEqual([[0, {}], [2, {}]]);
    expect((await unary("/process.Process/SendSignal", { process: { pid }, signal: "SIGNAL_UNSPECIFIED" })).body.code).toBe("unimplemented");
    expect((await unary("/process.Process/Update", { process: { pid }, pty: { size: { cols: 1, rows: 1 } } })).body.code).toBe("internal");
    expect((await unary("/process.Process/SendInput", { process: { pid }, input: { pty: "" } })).body.code).toBe("internal");
    expect((await unary("/process.Process/CloseStdin", { process: { pid } })).status).toBe(200);
    expect((await unary("/process.Process/CloseStdin", { process: { pid } })).status).toBe(200); // idempotent
    writeFileSync(flag, "");
    const frames = jsonEnvelopes(new Uint8Array(await (await started).arrayBuffer()));
    const out = frames.filter(([, m]) => m.event?.data).map(([, m]) => atob(m.event.data.stdout)).join("");
    expect(out).toBe("via stream");
    expect(frames.at(-2)![1].event.end.status).toBe("exit status 0");
  });

  test("pty processes refuse stdin operations", async () => {
    const started = post("/process.Process/Start", envelope({ process: { cmd: "/bin/sh" }, pty: { size: { cols: 80, rows: 24 } }, tag: "pty-1" }), STREAM_CT);
    const pid = await listedPid("pty-1");
    expect(existsSync(`/proc/${pid}`)).toBe(true);
    expect(await unary("/process.Process/CloseStdin", { process: { pid } })).toMatchObject({ status: 400, body: { code: "failed_precondition" } });
    expect((await unary("/process.Process/SendInput", { process: { pid }, input: { stdin: "" } })).body.code).toBe("internal");
    expect((await unary("/process.Process/SendInput", { process: { pid }, input: { pty: btoa("exit 5\n") } })).status).toBe(200);
    const frames = jsonEnvelopes(new Uint8Array(await (await started).arrayBuffer()));
    expect(frames.at(-2)![1].event.end).toMatchObject({ exitCode: 5 });
  });

  test("polling watcher API", async () => {
    const dir = join(envd.root, "pollwatch");
    mkdirSync(dir);
    const { body } = await unary("/filesystem.Filesystem/CreateWatcher", { path: dir, includeEntry: true });
    writeFileSync(join(dir, "a"), "1");
    const events: any[] = [];
    await until(async () => {
      events.push(...((await unary("/filesystem.Filesystem/GetWatcherEvents", { watcherId: body.watcherId })).body.events ?? []));
      return events.some((e) => e.type === "EVENT_TYPE_WRITE");
    }, "the write's events");
    expect(events[0]).toMatchObject({ name: "a", type: "EVENT_TYPE_CREATE", entry: { name: "a" } });
    expect((await unary("/filesystem.Filesystem/GetWatcherEvents", { watcherId: body.watcherId })).body).toEqual({});
    expect((await unary("/filesystem.Filesystem/RemoveWatcher", { watcherId: body.watcherId })).status).toBe(200);
    expect((await unary("/filesystem.Filesystem/GetWatcherEvents", { watcherId: body.watcherId })).body.code).toBe("not_found");
  });
});

describe("/files", () => {
  test("download errors, ranges, encodings", async () => {
    const miss = await fetch(`${envd.url}/files?path=nothing.txt`);
    expect([miss.status, await miss.json()]).toEqual([404, { code: 404, message: `path '${join(envd.userHome, "nothing.txt")}' does not exist` }]);
    expect((await fetch(`${envd.url}/files?path=${envd.root}`)).status).toBe(400);
    expect((await fetch(`${envd.url}/files?path=x&username=mallory`)).status).toBe(401);
    writeFileSync(join(envd.userHome, "r.txt"), "0123456789");
    const range = await fetch(`${envd.url}/files?path=r.txt`, { headers: { range: "bytes=2-4", "accept-encoding": "identity" } });
    expect([range.status, await range.text(), range.headers.get("content-range")]).toEqual([206, "234", "bytes 2-4/10"]);
    const plain = await fetch(`${envd.url}/files?path=r.txt`, { headers: { "accept-encoding": "identity" } });
    expect([plain.headers.get("content-length"), plain.headers.get("content-disposition")]).toEqual(["10", 'inline; filename="r.txt"']);
    const gz = await fetch(`${envd.url}/files?path=r.txt`, { headers: { "accept-encoding": "gzip" }, decompress: false } as RequestInit);
    expect(gz.headers.get("content-encoding")).toBe("gzip");
    expect(new TextDecoder().decode(Bun.gunzipSync(new Uint8Array(await gz.arrayBuffer())))).toBe("0123456789");
    expect((await fetch(`${envd.url}/files?path=r.txt`, { headers: { "accept-encoding": "identity;q=0" } })).status).toBe(406);
  });

  test("upload errors", async () => {
    const up = (qs: string, body: RequestInit["body"] | Uint8Array, headers: Record<string, string> = {}) => fetch(`${envd.url}/files${qs}`, { method: "POST", body: body as RequestInit["body"], headers });
    expect((await up("?path=a", "x", { "content-type": "text/plain" })).status).toBe(400);
    expect((await up("", "x", { "content-type": "application/octet-stream" })).status).toBe(400);
    expect((await up("?path=z.txt", "not gzip", { "content-type": "application/octet-stream", "content-encoding": "gzip" })).status).toBe(400);
    expect((await up(`?path=${envd.root}`, "x", { "content-type": "application/octet-stream" })).status).toBe(400);
    expect((await up("?path=a", "x", { "content-type": "application/octet-stream", "x-metadata-bad": "\x7f" })).status).toBe(400);
    const dup = new FormData();
    dup.append("file", new Blob(["1"]), "same.txt");
    dup.append("file", new Blob(["2"]), "same.txt");
    expect((await up("", dup)).status).toBe(400);
    const truncated = `--b\r\nContent-Disposition: form-data; name="file"; filename="t.txt"\r\n\r\npartial`;
    expect((await up("", truncated, { "content-type": "multipart/form-data; boundary=b" })).status).toBe(400);
    expect((await up("", "--b--\r\n", { "content-type": "multipart/form-data; boundary=b" })).status).toBe(400);
  });

  test("multipart: verbatim filenames, other fields ignored, large streamed file", async () => {
    const big = new Uint8Array(3 * 1024 * 1024 + 17).map((_, i) => (i * 31) & 0xff);
    const form = new FormData();
    form.append("note", "ignored");
    form.append("file", new Blob([big]), "deep/dir/big.bin");
    form.append("file", new Blob(["tiny"]), join(envd.root, "abs-tiny.txt"));
    const r = await fetch(`${envd.url}/files`, { method: "POST", body: form });
    expect(r.status).toBe(200);
    expect(((await r.json()) as any[]).map((e) => e.path)).toEqual([join(envd.userHome, "deep/dir/big.bin"), join(envd.root, "abs-tiny.txt")]);
    const back = new Uint8Array(await (await fetch(`${envd.url}/files?path=deep/dir/big.bin`)).arrayBuffer());
    expect(back.length).toBe(big.length);
    expect(Bun.hash(back)).toBe(Bun.hash(big));
  });
});

describe("/init, token, signing, /envs, /metrics", () => {
  test("full secured lifecycle on a separate envd", async () => {
    const e = await startEnvd();
    try {
      const token = "0tQG31xiMp0IOQfaz9dcwi72L1CPo8e0";
      const init = (body: unknown, headers: Record<string, string> = {}) => fetch(`${e.url}/init`, { method: "POST", body: JSON.stringify(body), headers });
      expect((await fetch(`${e.url}/init`, { method: "POST", body: "{" })).status).toBe(400);
      // Our aenvEntropy extension is checked even where (not --guest) it is not applied.
      expect((await init({ aenvEntropy: 7 })).status).toBe(400);
      expect((await init({ aenvEntropy: Buffer.from("short").toString("base64") })).status).toBe(400);
      const first = await init({ accessToken: token, envVars: { A: "1" }, timestamp: new Date().toISOString(), defaultWorkdir: "/tmp" });
      expect([first.status, first.headers.get("x-envd-version")]).toEqual([204, "0.6.13"]);
      // A replayed (older) init changes nothing but still answers 204.
      expect((await init({ accessToken: token, envVars: { A: "old" }, timestamp: new Date(0).toISOString() }, { "x-access-token": token })).status).toBe(204);
      // Without the token: RPCs, /envs and re-init are refused; health is open.
      expect((await fetch(`${e.url}/envs`)).status).toBe(401);
      const rpc = await fetch(`${e.url}/filesystem.Filesystem/Stat`, { method: "POST", headers: JSON_CT, body: "{}" });
      expect([rpc.status, ((await rpc.json()) as any).code]).toEqual([401, 401]);
      expect((await init({ accessToken: "other" })).status).toBe(401);
      expect((await fetch(`${e.url}/health`)).status).toBe(204);
      const auth = { "x-access-token": token };
      expect(await (await fetch(`${e.url}/envs`, { headers: auth })).json()).toEqual({ E2B_SANDBOX: "true", A: "1" });
      const run = await fetch(`${e.url}/process.Process/Start`, { method: "POST", headers: { ...STREAM_CT, ...auth }, body: envelope({ process: { cmd: "/bin/sh", args: ["-c", "echo $A; pwd"] } }) });
      const out = jsonEnvelopes(new Uint8Array(await run.arrayBuffer())).filter(([, m]) => m.event?.data).map(([, m]) => atob(m.event.data.stdout)).join("");
      expect(out).toBe("1\n/tmp\n");
      const m = (await (await fetch(`${e.url}/metrics`, { headers: auth })).json()) as any;
      for (const k of ["ts", "cpu_count", "cpu_used_pct", "mem_total", "mem_used", "mem_cache", "mem_total_mib", "mem_used_mib", "disk_used", "disk_total"]) {
        expect(typeof m[k]).toBe("number");
      }
      // /files signing: the known vector from the E2B tests, then each failure message.
      writeFileSync(join(e.userHome, "hello.txt"), "hello world");
      const signed = await fetch(`${e.url}/files?path=hello.txt&username=user&signature=v1_gUtH/s9YCJWgCizjfUxuWfhFE4QSydOWEIIvfLwDr6E`.replace("/s9", "%2Fs9"));
      expect([signed.status, await signed.text()]).toEqual([200, "hello world"]);
      const msg = async (r: Response) => [r.status, ((await r.json()) as any).message];
      expect(await msg(await fetch(`${e.url}/files?path=hello.txt`))).toEqual([401, "missing signature query parameter"]);
      expect(await msg(await fetch(`${e.url}/files?path=hello.txt&signature=v1_x`))).toEqual([401, "invalid signature"]);
      expect(await msg(await fetch(`${e.url}/files?path=hello.txt`, { headers: { "x-access-token": "nope" } }))).toEqual([401, "access token present in header but does not match"]);
      // Clearing the token needs the current one.
      expect((await init({}, auth)).status).toBe(204);
      expect((await fetch(`${e.url}/envs`)).status).toBe(200);
    } finally {
      await e.stop();
    }
  }, 20_000);
});

describe("robustness", () => {
  test("raw garbage over TCP and aborted streams leave envd serving", async () => {
    const sock = await Bun.connect({
      hostname: "127.0.0.1",
      port: envd.port,
      socket: { data() {}, error() {}, close() {} },
    });
    sock.write(new Uint8Array(4096).map((_, i) => (i * 7919) & 0xff));
    sock.write("POST /process.Process/Start HTTP/1.1\r\nContent-Length: 99999999999999999999\r\n\r\n");
    sock.end();
    const ac = new AbortController();
    const pending = fetch(`${envd.url}/process.Process/Start`, { method: "POST", headers: STREAM_CT, body: envelope({ process: { cmd: "/bin/sleep", args: ["0.5"] } }), signal: ac.signal });
    const res = await pending;
    ac.abort();
    await res.body?.cancel().catch(() => {});
    for (const body of ["", "null", "{}", "[1,2]", "\u0000".repeat(100)]) {
      await post("/process.Process/SendInput", body);
      await post("/process.Process/Update", body, { "content-type": "application/proto" });
      await post("/filesystem.Filesystem/WatchDir", body, STREAM_CT);
      await fetch(`${envd.url}/init`, { method: "POST", body });
      await fetch(`${envd.url}/files?path=x`, { method: "POST", body, headers: { "content-type": "multipart/form-data; boundary=zz" } });
    }
    expect((await fetch(`${envd.url}/health`)).status).toBe(204);
    expect(envd.logs()).not.toContain("uncaught");
  });
});
