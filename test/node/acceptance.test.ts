// The product end to end: `bun run node` started as a user would (fresh $AENV_HOME, nothing else
// configured but loopback and names that keep it apart from other test runs), driven only by the
// stock e2b SDK and plain HTTP. The base template (Debian) is built on first start into a cache
// shared by test runs on this machine, booted once and checkpointed; every create restores it.
import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { existsSync, readdirSync } from "node:fs";
import { join } from "node:path";
import { CommandExitError, FilesystemEventType, Sandbox, SandboxNotFoundError } from "e2b";
import { qemuPids } from "../vmm/harness.ts";
import { FIRST_START_MS, nodeSetup, nodeSkipReason, startNode, stopNode, until, type NodeProc } from "./harness.ts";

const skip = nodeSkipReason();
const KEY = "e2b_" + "5e".repeat(20);

describe.skipIf(!!skip)("bun run node with the stock e2b SDK", () => {
  if (skip) return void test.skip(skip!, () => {});
  const setup = nodeSetup("aat", 219, KEY, { AENV_MAX_SANDBOXES: "40", AENV_REAPER_INTERVAL_MS: "200" });
  const { tag, env, runDir } = setup;
  let node: NodeProc;
  const opts = () => ({ apiKey: KEY, apiUrl: node.base, sandboxUrl: node.base, requestTimeoutMs: 180_000 });

  beforeAll(async () => {
    node = await startNode(env, FIRST_START_MS);
  }, FIRST_START_MS + 60_000);

  afterAll(() => stopNode(node, setup), 180_000);

  let sbx: Sandbox;
  let bgPid = 0;

  test("Swagger and health answer; the API wants its key", async () => {
    const doc = (await (await fetch(`${node.base}/swagger/json`)).json()) as { paths: Record<string, unknown> };
    expect(Object.keys(doc.paths)).toEqual(expect.arrayContaining(["/v2/sandboxes", "/sandboxes/{sandboxID}/pause", "/sandboxes/{sandboxID}/fork", "/snapshots"]));
    const r = await fetch(`${node.base}/v2/sandboxes`);
    expect(r.status).toBe(401);
    expect(((await r.json()) as { code: number }).code).toBe(401);
  });

  test("create (base template, a restore) with metadata and env vars; commands", async () => {
    const t0 = performance.now();
    sbx = await Sandbox.create({ ...opts(), metadata: { suite: "acceptance", tag }, envs: { GREETING: "hello" } });
    console.log(`  create: ${Math.round(performance.now() - t0)} ms`);
    const r = await sbx.commands.run('echo "$GREETING"; echo err >&2; id -un; pwd');
    expect(r.stdout).toBe("hello\nuser\n/home/user\n");
    expect(r.stderr).toBe("err\n");
    const failed = await sbx.commands.run("exit 3").catch((e) => e);
    expect(failed).toBeInstanceOf(CommandExitError);
    expect(failed.exitCode).toBe(3);
    expect((await sbx.commands.run("echo $A; pwd", { envs: { A: "b" }, cwd: "/tmp" })).stdout).toBe("b\n/tmp\n");
    expect((await sbx.commands.run("id -u", { user: "root" })).stdout).toBe("0\n");
    expect((await sbx.commands.run("sudo -n id -u")).stdout).toBe("0\n");
    const py = await sbx.commands.run("python3 -c 'print(6*7)'; python -c 'print(1)'; node -e 'console.log(2)'; git --version | cut -d' ' -f1; tput -T xterm cols >/dev/null && echo tput");
    expect(py.stdout).toBe("42\n1\n2\ngit\ntput\n");
    const bg = await sbx.commands.run("sleep 3600", { background: true, timeoutMs: 0 });
    bgPid = bg.pid;
    expect((await sbx.commands.list()).some((p) => p.pid === bgPid)).toBe(true);
    const cat = await sbx.commands.run("cat", { background: true, stdin: true });
    let out = "";
    await sbx.commands.connect(cat.pid, { onStdout: (d) => void (out += d) });
    await sbx.commands.sendStdin(cat.pid, "via stdin");
    await until(() => out === "via stdin", 30_000, "stdin echoed");
    await cat.closeStdin();
    expect((await cat.wait()).stdout).toBe("via stdin");
    const sleeper = await sbx.commands.run("sleep 600", { background: true });
    expect(await sbx.commands.kill(sleeper.pid)).toBe(true);
    expect(await sleeper.wait().catch((e) => e)).toBeInstanceOf(CommandExitError);
  }, 300_000);

  test("files: write, read, list, remove, watch; 100 MiB up and down", async () => {
    await sbx.files.write("notes/a.txt", "A");
    expect(await sbx.files.read("notes/a.txt")).toBe("A");
    expect((await sbx.files.list("notes")).map((e) => e.name)).toEqual(["a.txt"]);
    const events: string[] = [];
    const w = await sbx.files.watchDir("notes", (e) => void events.push(`${e.type}:${e.name}`));
    await sbx.files.write("notes/b.txt", "B");
    await until(() => events.includes(`${FilesystemEventType.WRITE}:b.txt`), 30_000, "watch event");
    await w.stop();
    await sbx.files.remove("notes/a.txt");
    expect(await sbx.files.exists("notes/a.txt")).toBe(false);
    const big = new Uint8Array(100 << 20);
    for (let i = 0; i < big.length; i += 4096) big[i] = (i / 4096) & 0xff;
    const sum = new Bun.CryptoHasher("sha256").update(big).digest("hex");
    const t0 = performance.now();
    await sbx.files.write("/tmp/big.bin", new Blob([big]));
    const t1 = performance.now();
    const back = await sbx.files.read("/tmp/big.bin", { format: "bytes" });
    const t2 = performance.now();
    console.log(`  100 MiB upload ${Math.round(t1 - t0)} ms, download ${Math.round(t2 - t1)} ms`);
    expect(back.length).toBe(big.length);
    expect(new Bun.CryptoHasher("sha256").update(back).digest("hex")).toBe(sum);
    expect((await sbx.commands.run("sha256sum /tmp/big.bin | cut -c1-64")).stdout.trim()).toBe(sum);
  }, 300_000);

  test("pty", async () => {
    let out = "";
    const dec = new TextDecoder();
    const h = await sbx.pty.create({ cols: 80, rows: 24, onData: (d) => void (out += dec.decode(d, { stream: true })) });
    await sbx.pty.sendInput(h.pid, new TextEncoder().encode("echo pty-$((40+2)); exit\n"));
    await until(() => out.includes("pty-42"), 30_000, "pty output");
    expect((await h.wait()).exitCode).toBe(0);
  }, 60_000);

  test("getHost: a python3 http.server in the sandbox, reached through the proxy by host and by path", async () => {
    await sbx.files.write("/tmp/web/index.html", "served from the sandbox");
    await sbx.commands.run("python3 -m http.server 8000 --directory /tmp/web", { background: true, timeoutMs: 0 });
    const host = sbx.getHost(8000);
    expect(host.startsWith(`8000-${sbx.sandboxId}.`)).toBe(true);
    let body = "";
    await until(async () => {
      const r = await fetch(`${node.base}/`, { headers: { host } }).catch(() => undefined);
      body = r?.ok ? await r.text() : "";
      return body !== "";
    }, 30_000, "http.server answers through the proxy");
    expect(body).toBe("served from the sandbox");
    const viaPath = await fetch(`${node.base}/proxy/${sbx.sandboxId}/8000/index.html`);
    expect(await viaPath.text()).toBe("served from the sandbox");
  }, 90_000);

  test("WebSocket through the proxy: a python echo server in the sandbox", async () => {
    // RFC 6455 handshake and unmasked text echo, standard library only.
    await sbx.files.write("/tmp/ws.py", [
      "import socket, hashlib, base64, struct",
      "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(('0.0.0.0', 8765)); s.listen(4)",
      "while True:",
      "    c, _ = s.accept(); req = b''",
      "    while b'\\r\\n\\r\\n' not in req: req += c.recv(4096)",
      "    key = [l.split(b': ')[1] for l in req.split(b'\\r\\n') if l.lower().startswith(b'sec-websocket-key')][0]",
      "    acc = base64.b64encode(hashlib.sha1(key + b'258EAFA5-E914-47DA-95CA-C5AB0DC85B11').digest())",
      "    c.sendall(b'HTTP/1.1 101 Switching Protocols\\r\\nUpgrade: websocket\\r\\nConnection: Upgrade\\r\\nSec-WebSocket-Accept: ' + acc + b'\\r\\n\\r\\n')",
      "    while True:",
      "        h = c.recv(2)",
      "        if len(h) < 2 or h[0] & 0x0f == 8: break",
      "        n = h[1] & 0x7f",
      "        if n == 126: n = struct.unpack('>H', c.recv(2))[0]",
      "        mask = c.recv(4); data = b''",
      "        while len(data) < n: data += c.recv(n - len(data))",
      "        data = bytes(b ^ mask[i % 4] for i, b in enumerate(data))",
      "        out = b'echo:' + data",
      "        c.sendall(bytes([0x81, len(out)]) + out if len(out) < 126 else bytes([0x81, 126]) + struct.pack('>H', len(out)) + out)",
      "    c.close()",
    ].join("\n"));
    await sbx.commands.run("python3 /tmp/ws.py", { background: true, timeoutMs: 0 });
    const url = node.base.replace("http://", "ws://") + `/proxy/${sbx.sandboxId}/8765/`;
    let reply = "";
    await until(async () => {
      reply = await new Promise<string>((resolve) => {
        const ws = new WebSocket(url);
        const t = setTimeout(() => { ws.close(); resolve(""); }, 5000);
        ws.onopen = () => ws.send("hi from the host");
        ws.onmessage = (e) => { clearTimeout(t); resolve(String(e.data)); ws.close(); };
        ws.onerror = () => { clearTimeout(t); resolve(""); };
      });
      return reply !== "";
    }, 30_000, "WebSocket echo through the proxy");
    expect(reply).toBe("echo:hi from the host");
  }, 90_000);

  test("pause → not running → connect: files and the background process survive", async () => {
    expect(await sbx.pause()).toBe(true);
    expect(await sbx.isRunning()).toBe(false);
    sbx = await Sandbox.connect(sbx.sandboxId, opts());
    expect(await sbx.isRunning()).toBe(true);
    expect(await sbx.files.read("notes/b.txt")).toBe("B");
    expect((await sbx.commands.list()).some((p) => p.pid === bgPid)).toBe(true);
  }, 180_000);

  test("fork 16: the children diverge, the source is untouched", async () => {
    await sbx.files.write("/tmp/who", "source");
    const t0 = performance.now();
    const kids = await Sandbox.fork(sbx.sandboxId, { ...opts(), count: 16 });
    console.log(`  fork 16: ${Math.round(performance.now() - t0)} ms`);
    const ok = kids.filter((k): k is Sandbox => k instanceof Sandbox);
    try {
      expect(kids.filter((k) => !(k instanceof Sandbox)).map(String)).toEqual([]);
      await forkedChildrenDiverge(ok);
    } catch (e) {
      console.log(`  node log (last 40 lines):\n${node.log.slice(-40).join("\n")}`);
      throw e;
    } finally {
      await Promise.all(ok.map((k) => k.kill().catch(() => false)));
    }
  }, 900_000);

  async function forkedChildrenDiverge(ok: Sandbox[]) {
    expect(ok.length).toBe(16);
    expect(new Set(ok.map((k) => k.sandboxId)).size).toBe(16);
    await Promise.all(ok.map(async (k, i) => {
      expect(await k.files.read("/tmp/who")).toBe("source");
      await k.files.write("/tmp/who", `child ${i}`);
    }));
    for (const [i, k] of ok.entries()) expect(await k.files.read("/tmp/who")).toBe(`child ${i}`);
    expect(await sbx.files.read("/tmp/who")).toBe("source");
    for (const k of ok) expect(await k.kill()).toBe(true);
  }

  test("createSnapshot → two sandboxes from it; list by metadata with pagination", async () => {
    await sbx.files.write("/tmp/snap.txt", "snapshotted");
    const snap = await sbx.createSnapshot();
    const a = await Sandbox.create(snap.snapshotId, { ...opts(), metadata: { suite: "acceptance", tag, from: "snap" } });
    const b = await Sandbox.create(snap.snapshotId, { ...opts(), metadata: { suite: "acceptance", tag, from: "snap" } });
    expect(await a.files.read("/tmp/snap.txt")).toBe("snapshotted");
    await a.files.write("/tmp/snap.txt", "a");
    expect(await b.files.read("/tmp/snap.txt")).toBe("snapshotted");
    const pager = Sandbox.list({ ...opts(), limit: 1, query: { metadata: { tag, from: "snap" } } });
    const seen: string[] = [];
    while (pager.hasNext) seen.push(...(await pager.nextItems()).map((s) => s.sandboxId));
    expect(seen.sort()).toEqual([a.sandboxId, b.sandboxId].sort());
    expect(await a.kill()).toBe(true);
    expect(await b.kill()).toBe(true);
  }, 300_000);

  test("kill -9 the node while sandboxes run; the next node takes them back", async () => {
    const other = await Sandbox.create({ ...opts(), metadata: { tag } });
    await other.files.write("/tmp/survivor", "still here");
    node.proc.kill("SIGKILL");
    await node.proc.exited;
    node = await startNode(env, 5 * 60_000);
    expect(node.log.some((l) => /recovered: 2 running/.test(l))).toBe(true);
    const again = await Sandbox.connect(other.sandboxId, opts());
    expect(await again.files.read("/tmp/survivor")).toBe("still here");
    sbx = await Sandbox.connect(sbx.sandboxId, opts());
    expect((await sbx.commands.list()).some((p) => p.pid === bgPid)).toBe(true);
    expect(await again.kill()).toBe(true);
  }, 600_000);

  test("setTimeout: expiry kills and cuts open streams; then kill → false and getInfo → not found", async () => {
    let ticks = 0;
    const streaming = await sbx.commands.run("while true; do echo tick; sleep 0.2; done", { background: true, timeoutMs: 0, onStdout: () => void ticks++ });
    await until(() => ticks > 0, 30_000, "the stream runs");
    await sbx.setTimeout(2000);
    const ended = await Promise.race([streaming.wait().then(() => "ended", () => "cut"), Bun.sleep(60_000).then(() => "hung")]);
    expect(ended).toBe("cut");
    await until(async () => !(await Sandbox.getInfo(sbx.sandboxId, opts()).then(() => true, () => false)), 60_000, "reaper kills");
    await expect(Sandbox.getInfo(sbx.sandboxId, opts())).rejects.toBeInstanceOf(SandboxNotFoundError);
    expect(await Sandbox.kill(sbx.sandboxId, opts())).toBe(false);
  }, 90_000);

  test("nothing is left: no sandboxes, no VMs of this node", async () => {
    expect(await Sandbox.list(opts()).nextItems()).toEqual([]);
    expect(qemuPids(runDir)).toEqual([]);
    expect(existsSync(join(runDir, "vms")) ? readdirSync(join(runDir, "vms")) : []).toEqual([]);
  }, 30_000);
});
