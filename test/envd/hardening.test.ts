// Envd under bad input and concurrency: a failed upload leaves the target as it was, every body is
// bounded, no request can stall the process, NUL bytes in paths are a client error, and a host
// process listens on loopback unless told otherwise.
import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { chmodSync, chownSync, existsSync, lstatSync, mkdirSync, readdirSync, readFileSync, statSync, symlinkSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { readEnvelopes } from "../../guest/envd/connect.ts";
import { xattr } from "../../guest/envd/sys.ts";
import { envelope, jsonEnvelopes, rawExchange, rssBytes, startEnvd, until, USER_UID, type Envd } from "./harness.ts";

let envd: Envd;

beforeAll(async () => {
  envd = await startEnvd();
});
afterAll(async () => {
  await envd?.stop();
});

const MiB = 2 ** 20;
const JSON_CT = { "content-type": "application/json" };
const STREAM_CT = { "content-type": "application/connect+json" };

function upload(qs: string, body: RequestInit["body"] | Uint8Array, headers: Record<string, string> = {}) {
  return fetch(`${envd.url}/files${qs}`, { method: "POST", body: body as RequestInit["body"], headers });
}

async function unary(path: string, msg: unknown, headers: Record<string, string> = {}) {
  const r = await fetch(`${envd.url}${path}`, { method: "POST", headers: { ...JSON_CT, ...headers }, body: JSON.stringify(msg) });
  return { status: r.status, body: (await r.json()) as any };
}

async function stream(path: string, msg: unknown) {
  const r = await fetch(`${envd.url}${path}`, { method: "POST", headers: STREAM_CT, body: envelope(msg) as RequestInit["body"] });
  expect(r.status).toBe(200);
  return jsonEnvelopes(new Uint8Array(await r.arrayBuffer()));
}

/** /health answers 204 while something else is going on (each try bounded, so a stuck envd fails instead of hanging). */
async function healthy(): Promise<boolean> {
  const r = await fetch(`${envd.url}/health`, { signal: AbortSignal.timeout(20_000) });
  return r.status === 204;
}

/** A dedicated directory per test, so "nothing else was left behind" can be checked exactly. */
function scratch(name: string): string {
  const dir = join(envd.userHome, name);
  mkdirSync(dir, { recursive: true });
  chownSync(dir, USER_UID, USER_UID);
  return dir;
}

describe("POST /files: a failed upload changes nothing", () => {
  test("bad Content-Encoding, bad gzip and a cut-short multipart body leave the old content and no temp file", async () => {
    const dir = scratch("keep");
    const file = join(dir, "f.txt");
    writeFileSync(file, "original");
    const octet = { "content-type": "application/octet-stream" };
    const refusals = [
      await upload(`?path=${file}`, "new", { ...octet, "content-encoding": "br" }),
      await upload(`?path=${file}`, "not gzip at all", { ...octet, "content-encoding": "gzip" }),
      await upload(`?path=${file}`, Bun.gzipSync("new content").subarray(0, 12), { ...octet, "content-encoding": "gzip" }),
      await upload("", `--b\r\nContent-Disposition: form-data; name="file"; filename="${file}"\r\n\r\npartial`, { "content-type": "multipart/form-data; boundary=b" }),
    ];
    for (const r of refusals) expect([r.status, ((await r.json()) as any).code]).toEqual([400, 400]);
    expect(readFileSync(file, "utf8")).toBe("original");
    expect(readdirSync(dir)).toEqual(["f.txt"]);
  });

  test("a multipart request is all or nothing: a later part cut short leaves the earlier part's file as it was", async () => {
    const dir = scratch("allornothing");
    writeFileSync(join(dir, "a.txt"), "old a");
    const body =
      `--b\r\nContent-Disposition: form-data; name="file"; filename="${join(dir, "a.txt")}"\r\n\r\nnew a\r\n` +
      `--b\r\nContent-Disposition: form-data; name="file"; filename="${join(dir, "b.txt")}"\r\n\r\nnew b, cut`;
    const r = await upload("", body, { "content-type": "multipart/form-data; boundary=b" });
    expect(r.status).toBe(400);
    expect(readFileSync(join(dir, "a.txt"), "utf8")).toBe("old a");
    expect(readdirSync(dir)).toEqual(["a.txt"]);
  });

  test("an overwrite keeps the file's owner and mode; a new file is 0644 and the user's; a symlink stays a symlink", async () => {
    const dir = scratch("owners");
    const kept = join(dir, "kept.txt");
    writeFileSync(kept, "old");
    chmodSync(kept, 0o600);
    chownSync(kept, 0, USER_UID);
    xattr.set(kept, "user.note", "kept");
    xattr.set(kept, "user.e2b.old", "replaced");
    const r1 = await upload(`?path=${kept}`, "new", { "content-type": "application/octet-stream", "x-metadata-fresh": "1" });
    expect(r1.status).toBe(200);
    const st = statSync(kept);
    expect([readFileSync(kept, "utf8"), st.mode & 0o7777, st.uid, st.gid]).toEqual(["new", 0o600, 0, USER_UID]);
    expect(xattr.list(kept).sort()).toEqual(["user.e2b.fresh", "user.note"]);
    expect(xattr.get(kept, "user.note")).toBe("kept");

    const fresh = join(dir, "fresh.txt");
    expect((await upload(`?path=${fresh}`, "f", { "content-type": "application/octet-stream" })).status).toBe(200);
    const fst = statSync(fresh);
    expect([fst.mode & 0o7777, fst.uid, fst.gid]).toEqual([0o644, USER_UID, USER_UID]);

    symlinkSync("kept.txt", join(dir, "link"));
    expect((await upload(`?path=${join(dir, "link")}`, "via link", { "content-type": "application/octet-stream" })).status).toBe(200);
    expect(lstatSync(join(dir, "link")).isSymbolicLink()).toBe(true);
    expect(readFileSync(kept, "utf8")).toBe("via link");
    expect(readdirSync(dir).sort()).toEqual(["fresh.txt", "kept.txt", "link"]);
  });

  test("an existing FIFO is refused as a target instead of blocking the upload", async () => {
    const dir = scratch("fifo-target");
    const fifo = join(dir, "pipe");
    Bun.spawnSync(["mkfifo", fifo]);
    const r = await upload(`?path=${fifo}`, "x", { "content-type": "application/octet-stream" });
    expect([r.status, ((await r.json()) as any).message]).toEqual([400, `path '${fifo}' is not a regular file`]);
    expect(readdirSync(dir)).toEqual(["pipe"]);
  });

  test("a multipart request of more than 10 000 files is refused whole", async () => {
    const dir = scratch("many");
    const part = (i: number) => `--b\r\nContent-Disposition: form-data; name="file"; filename="${dir}/f${i}"\r\n\r\n${i}\r\n`;
    const body = Array.from({ length: 10_001 }, (_, i) => part(i)).join("") + "--b--\r\n";
    const r = await upload("", body, { "content-type": "multipart/form-data; boundary=b" });
    expect([r.status, ((await r.json()) as any).message]).toEqual([400, "more than 10000 files in one request"]);
    expect(readdirSync(dir)).toEqual([]);
  }, 120_000);

  test("two uploads racing for one path both succeed and the file is exactly one of them", async () => {
    const dir = scratch("race");
    const target = join(dir, "t.bin");
    const a = new Uint8Array(4 * MiB).fill(0x61);
    const b = new Uint8Array(3 * MiB).fill(0x62);
    const [ra, rb] = await Promise.all([
      upload(`?path=${target}`, a, { "content-type": "application/octet-stream" }),
      upload(`?path=${target}`, b, { "content-type": "application/octet-stream" }),
    ]);
    expect([ra.status, rb.status]).toEqual([200, 200]);
    const got = readFileSync(target);
    expect(got.equals(Buffer.from(a)) || got.equals(Buffer.from(b))).toBe(true);
    expect(readdirSync(dir)).toEqual(["t.bin"]);
  });
});

describe("POST /files/compose", () => {
  const compose = (body: unknown, headers: Record<string, string> = {}) =>
    fetch(`${envd.url}/files/compose`, { method: "POST", headers: { ...JSON_CT, ...headers }, body: typeof body === "string" ? body : JSON.stringify(body) });

  test("concatenates the sources into the destination and removes them", async () => {
    const dir = scratch("compose-ok");
    writeFileSync(join(dir, "p1"), "hello ");
    writeFileSync(join(dir, "p2"), "world");
    const r = await compose({ source_paths: ["compose-ok/p1", join(dir, "p2")], destination: "compose-ok/out/joined.txt" });
    expect([r.status, await r.json()]).toEqual([200, { path: join(dir, "out/joined.txt"), name: "joined.txt", type: "file" }]);
    expect(readFileSync(join(dir, "out/joined.txt"), "utf8")).toBe("hello world");
    const st = statSync(join(dir, "out/joined.txt"));
    expect([st.mode & 0o7777, st.uid]).toEqual([0o644, USER_UID]);
    expect(readdirSync(dir).sort()).toEqual(["out"]);
  });

  test("a missing source, a bad destination or a bad body change nothing", async () => {
    const dir = scratch("compose-bad");
    writeFileSync(join(dir, "p1"), "one");
    writeFileSync(join(dir, "dest"), "old dest");
    mkdirSync(join(dir, "adir"));
    const cases: [unknown, number][] = [
      [{ source_paths: [join(dir, "p1"), join(dir, "missing")], destination: join(dir, "dest") }, 404],
      [{ source_paths: [join(dir, "p1")], destination: join(dir, "adir") }, 400], // a directory
      [{ source_paths: [join(dir, "p1")], destination: join(dir, "p1/under-a-file") }, 400],
      [{ source_paths: [join(dir, "p1")], destination: join(dir, "p1") }, 400], // one of the sources
      [{ source_paths: [join(dir, "adir")], destination: join(dir, "dest") }, 400], // a source that is no file
      [{ source_paths: "p1", destination: join(dir, "dest") }, 400],
      ["{", 400],
    ];
    for (const [body, status] of cases) {
      const r = await compose(body);
      expect([r.status, ((await r.json()) as any).code]).toEqual([status, status]);
    }
    expect(readFileSync(join(dir, "p1"), "utf8")).toBe("one");
    expect(readFileSync(join(dir, "dest"), "utf8")).toBe("old dest");
    expect(readdirSync(dir).sort()).toEqual(["adir", "dest", "p1"]);
  });

  test("needs the access token once /init set one", async () => {
    const e = await startEnvd();
    try {
      expect((await fetch(`${e.url}/init`, { method: "POST", body: JSON.stringify({ accessToken: "tok" }) })).status).toBe(204);
      writeFileSync(join(e.userHome, "s"), "s");
      const body = JSON.stringify({ source_paths: ["s"], destination: "d" });
      const anon = await fetch(`${e.url}/files/compose`, { method: "POST", headers: JSON_CT, body });
      expect(anon.status).toBe(401);
      expect(existsSync(join(e.userHome, "s"))).toBe(true);
      const ok = await fetch(`${e.url}/files/compose`, { method: "POST", headers: { ...JSON_CT, "x-access-token": "tok" }, body });
      expect(ok.status).toBe(200);
      expect(readFileSync(join(e.userHome, "d"), "utf8")).toBe("s");
    } finally {
      await e.stop();
    }
  });
});

describe("bounded bodies", () => {
  const statusOf = (response: string) => Number(/^HTTP\/1\.1 (\d{3})/.exec(response)?.[1] ?? 0);
  const answered = (response: string) => response.includes("\r\n\r\n");
  const zeros = new Uint8Array(MiB);
  const upTo = (total: number) => (i: number) => (i * MiB < total ? zeros : null);

  test("/init checks the token before reading the body, and bounds the body", async () => {
    const e = await startEnvd();
    try {
      expect((await fetch(`${e.url}/init`, { method: "POST", body: JSON.stringify({ accessToken: "tok" }) })).status).toBe(204);
      const before = rssBytes(e.pid);
      // A wrong header with a 600 MiB body is answered before the body is read.
      const wrong = await rawExchange(e.port, `POST /init HTTP/1.1\r\nHost: x\r\nX-Access-Token: nope\r\nContent-Length: ${600 * MiB}\r\n\r\n`, upTo(600 * MiB), answered);
      expect(statusOf(wrong.response)).toBe(401);
      // No header: the body is read only up to the bound, which a declared or an actual excess hits.
      const declared = await rawExchange(e.port, `POST /init HTTP/1.1\r\nHost: x\r\nContent-Length: ${600 * MiB}\r\n\r\n`, upTo(600 * MiB), answered);
      expect(statusOf(declared.response)).toBe(413);
      const chunked = await rawExchange(e.port, "POST /init HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n",
        (i) => (i < 600 ? new TextEncoder().encode(`${MiB.toString(16)}\r\n${"x".repeat(MiB)}\r\n`) : null), answered);
      expect(statusOf(chunked.response)).toBe(413);
      expect(rssBytes(e.pid) - before).toBeLessThan(128 * MiB);
      // The token still holds, and a right one still works.
      expect((await fetch(`${e.url}/envs`)).status).toBe(401);
      expect((await fetch(`${e.url}/init`, { method: "POST", headers: { "x-access-token": "tok" }, body: JSON.stringify({ accessToken: "tok", envVars: { A: "1" } }) })).status).toBe(204);
      expect(await (await fetch(`${e.url}/envs`, { headers: { "x-access-token": "tok" } })).json()).toEqual({ E2B_SANDBOX: "true", A: "1" });
    } finally {
      await e.stop();
    }
  }, 120_000);

  test("an oversized Connect stream message is refused with resource_exhausted, memory stays bounded, /health answers", async () => {
    const e = await startEnvd();
    try {
      const before = rssBytes(e.pid);
      const header = new Uint8Array(5);
      new DataView(header.buffer).setUint32(1, 300 * MiB);
      const ex = await rawExchange(
        e.port,
        `POST /process.Process/StreamInput HTTP/1.1\r\nHost: x\r\nContent-Type: application/connect+json\r\nContent-Length: ${300 * MiB + 5}\r\n\r\n`,
        (i) => (i === 0 ? header : i <= 300 ? zeros : null),
        (r) => r.includes("resource_exhausted"),
      );
      expect(statusOf(ex.response)).toBe(200); // Connect streams answer 200 and carry the error in the end-stream message
      expect(ex.response).toContain('"code":"resource_exhausted"');
      expect(rssBytes(e.pid) - before).toBeLessThan(128 * MiB);
      const h = await fetch(`${e.url}/health`, { signal: AbortSignal.timeout(20_000) });
      expect(h.status).toBe(204);
    } finally {
      await e.stop();
    }
  }, 120_000);

  test("oversized unary bodies and decompression bombs are resource_exhausted", async () => {
    const big = JSON.stringify({ path: "x".repeat(17 * MiB) });
    expect(await unary("/filesystem.Filesystem/Stat", JSON.parse(big))).toMatchObject({ status: 429, body: { code: "resource_exhausted" } });
    const bomb = Bun.gzipSync(new Uint8Array(64 * MiB));
    const ru = await fetch(`${envd.url}/filesystem.Filesystem/Stat`, { method: "POST", headers: { ...JSON_CT, "content-encoding": "gzip" }, body: bomb });
    expect([ru.status, ((await ru.json()) as any).code]).toEqual([429, "resource_exhausted"]);
    const rs = await fetch(`${envd.url}/process.Process/StreamInput`, {
      method: "POST",
      headers: { ...STREAM_CT, "connect-content-encoding": "gzip" },
      body: envelope(bomb, 1) as RequestInit["body"],
    });
    expect(jsonEnvelopes(new Uint8Array(await rs.arrayBuffer())).at(-1)).toMatchObject([2, { error: { code: "resource_exhausted" } }]);
    expect(await healthy()).toBe(true);
  }, 60_000);

  /** n copies of one small StreamInput message, back to back in one buffer. */
  function keepalives(n: number): { one: Uint8Array; all: Uint8Array } {
    const one = envelope({ keepalive: {} });
    const all = new Uint8Array(one.length * n);
    for (let i = 0; i < n; i++) all.set(one, i * one.length);
    return { one, all };
  }

  test("many small messages parse in linear time (one chunk of 400 000 envelopes)", async () => {
    const n = 400_000;
    const { one, all } = keepalives(n);
    const body = new ReadableStream<Uint8Array>({
      start(c) {
        c.enqueue(all);
        c.close();
      },
    });
    const t0 = performance.now();
    let count = 0;
    for await (const m of readEnvelopes(body, null)) {
      expect(m.length).toBe(one.length - 5);
      count++;
    }
    expect(count).toBe(n);
    // Linear: under a second here; copying the rest of the buffer per message (quadratic) took 176 s.
    expect(performance.now() - t0).toBeLessThan(30_000);
  }, 60_000);

  test("a client stream of many small messages is served whole", async () => {
    const { all } = keepalives(200_000);
    const r = await fetch(`${envd.url}/process.Process/StreamInput`, { method: "POST", headers: STREAM_CT, body: all as RequestInit["body"] });
    expect(jsonEnvelopes(new Uint8Array(await r.arrayBuffer()))).toEqual([[0, {}], [2, {}]]);
  }, 120_000);
});

describe("special files never stall envd", () => {
  const kmsgReadable = (() => {
    try {
      return process.getuid?.() === 0 && statSync("/proc/kmsg").isFile();
    } catch {
      return false;
    }
  })();

  test.skipIf(!kmsgReadable)("GET /files?path=/proc/kmsg (a read that blocks) leaves /health answering (skipped: no readable /proc/kmsg)", async () => {
    const kmsg = fetch(`${envd.url}/files?path=/proc/kmsg&username=root`, { signal: AbortSignal.timeout(60_000) });
    expect(await healthy()).toBe(true);
    const r = await kmsg; // what the kernel had pending, then the end: a read that would block is where it stops
    expect(r.status).toBe(200);
    await r.arrayBuffer();
    expect(await healthy()).toBe(true);
  }, 90_000);

  test("a FIFO or a device is refused, a size-0 proc file streams, an empty file has Content-Length 0", async () => {
    const dir = scratch("special");
    const fifo = join(dir, "pipe");
    Bun.spawnSync(["mkfifo", fifo]);
    for (const p of [fifo, "/dev/zero"]) {
      const r = await fetch(`${envd.url}/files?path=${p}`, { signal: AbortSignal.timeout(20_000) });
      expect([r.status, ((await r.json()) as any).message]).toEqual([400, `path '${p}' is not a regular file`]);
    }
    const stat = await fetch(`${envd.url}/files?path=/proc/self/status`, { headers: { "accept-encoding": "identity" } });
    expect([stat.status, (await stat.text()).startsWith("Name:")]).toEqual([200, true]);
    const gz = await fetch(`${envd.url}/files?path=/proc/self/status`, { headers: { "accept-encoding": "gzip" } });
    expect((await gz.text()).startsWith("Name:")).toBe(true);
    writeFileSync(join(dir, "empty"), "");
    const empty = await fetch(`${envd.url}/files?path=${join(dir, "empty")}`, { headers: { "accept-encoding": "identity" } });
    expect([empty.status, empty.headers.get("content-length"), await empty.text()]).toEqual([200, "0", ""]);
    expect(await healthy()).toBe(true);
  });
});

describe("NUL bytes in paths are a client error", () => {
  test("/files, /files/compose and /init answer 400", async () => {
    const get = await fetch(`${envd.url}/files?path=a%00b`);
    expect([get.status, ((await get.json()) as any).message]).toEqual([400, "path must not contain NUL bytes"]);
    const post = await upload("?path=a%00b", "x", { "content-type": "application/octet-stream" });
    expect([post.status, ((await post.json()) as any).code]).toEqual([400, 400]);
    const form = new FormData();
    form.append("file", new Blob(["x"]), "a\0b");
    expect((await upload("", form)).status).toBe(400);
    const compose = await fetch(`${envd.url}/files/compose`, { method: "POST", headers: JSON_CT, body: JSON.stringify({ source_paths: ["a\0b"], destination: "c" }) });
    expect(compose.status).toBe(400);
    const e = await startEnvd();
    try {
      for (const body of [{ defaultWorkdir: "/tmp\0x" }, { envVars: { "A\0": "1" } }, { envVars: { A: "1\0" } }, { defaultUser: "us\0er" }]) {
        const r = await fetch(`${e.url}/init`, { method: "POST", body: JSON.stringify(body) });
        expect([r.status, ((await r.json()) as any).code]).toEqual([400, 400]);
      }
    } finally {
      await e.stop();
    }
  });

  test("filesystem RPCs and process cwd answer invalid_argument", async () => {
    const bad = "/tmp/a\0b";
    for (const [method, msg] of [
      ["Stat", { path: bad }], ["ListDir", { path: bad }], ["MakeDir", { path: bad }], ["Remove", { path: bad }],
      ["Move", { source: bad, destination: "/tmp/x" }], ["Move", { source: "/tmp", destination: bad }], ["CreateWatcher", { path: bad }],
    ] as const) {
      expect([method, await unary(`/filesystem.Filesystem/${method}`, msg)]).toMatchObject([method, { status: 400, body: { code: "invalid_argument", message: "path must not contain NUL bytes" } }]);
    }
    expect(await stream("/filesystem.Filesystem/WatchDir", { path: bad })).toMatchObject([[2, { error: { code: "invalid_argument" } }]]);
    expect(await stream("/process.Process/Start", { process: { cmd: "/bin/true", cwd: bad } })).toEqual([
      [2, { error: { code: "invalid_argument", message: "path must not contain NUL bytes" } }],
    ]);
    expect(await healthy()).toBe(true);
  });
});

describe("listening address", () => {
  test("as a host process envd listens on loopback unless --host says otherwise", async () => {
    const e = await startEnvd([], { host: null });
    try {
      expect(e.host).toBe("127.0.0.1");
      expect((await fetch(`${e.url}/health`)).status).toBe(204);
    } finally {
      await e.stop();
    }
  });
});
