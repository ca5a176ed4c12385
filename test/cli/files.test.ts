// `aenv cp ID:/dir LOCAL` against a hostile guest: a loopback HTTP stub plays the node's API and a
// sandbox's envd (the SDK's Connect JSON for Stat and ListDir, GET /files for bytes), answering
// names and paths that would lead outside LOCAL. Nothing of such an answer is written; an honest
// listing is copied whole, its modes without setuid.
import { afterAll, describe, expect, test } from "bun:test";
import { existsSync, mkdirSync, readdirSync, readFileSync, statSync } from "node:fs";
import { join } from "node:path";
import { scratchDir } from "../helpers/tmp.ts";

const AENV = join(import.meta.dir, "../../src/cli/aenv.ts");
const KEY = "e2b_" + "cd".repeat(20);
const ID = "hostile0000000000000";
/** A CLI call is killed after this long. */
const HANG_MS = 60_000;
const FILE = 1;
const DIR = 2;

interface Entry { name: string; type: number; path: string; mode?: number }
/** What the stub's sandbox answers: Stat of any path, ListDir of any folder, the bytes of any file. */
let answer: { stat: Entry; list: Entry[] } = { stat: { name: "dir", type: DIR, path: "/dir" }, list: [] };

const entry = (e: Entry) => ({ size: "5", mode: 0o644, permissions: "-rw-r--r--", owner: "root", group: "root", ...e });
const stub = Bun.serve({
  hostname: "127.0.0.1",
  port: 0,
  async fetch(req) {
    const u = new URL(req.url);
    if (req.method === "GET" && u.pathname === `/sandboxes/${ID}`) {
      return Response.json({ sandboxID: ID, templateID: "base", state: "running", envdVersion: "0.6.13", envdAccessToken: "tok", domain: null });
    }
    if (u.pathname === "/filesystem.Filesystem/Stat") return Response.json({ entry: entry(answer.stat) });
    if (u.pathname === "/filesystem.Filesystem/ListDir") return Response.json({ entries: answer.list.map(entry) });
    if (req.method === "GET" && u.pathname === "/files") return new Response("owned", { headers: { "content-type": "application/octet-stream" } });
    return new Response("not here", { status: 404 });
  },
});
afterAll(() => stub.stop(true));
const home = scratchDir("cli-files-home");

async function cp(remote: string, local: string): Promise<{ code: number; err: string }> {
  const p = Bun.spawn([process.execPath, AENV, "cp", `${ID}:${remote}`, local, "--url", `http://127.0.0.1:${stub.port}`, "--api-key", KEY], {
    env: { PATH: process.env.PATH, HOME: home },
    stdout: "pipe",
    stderr: "pipe",
    timeout: HANG_MS,
  });
  const [, err] = await Promise.all([new Response(p.stdout).text(), new Response(p.stderr).text()]);
  return { code: await p.exited, err };
}

/** Every file under dir, relative, sorted. */
const tree = (dir: string) => (readdirSync(dir, { recursive: true }) as string[]).map(String).sort();

describe("aenv cp out of a hostile sandbox", () => {
  test("a source named '..' (Stat's path /x/..) into an existing folder: refused, nothing written beside it", async () => {
    const root = scratchDir("cli-cp-dotdot");
    const inner = join(root, "inner");
    mkdirSync(inner);
    answer = { stat: { name: "..", type: DIR, path: "/x/.." }, list: [{ name: "evil", type: FILE, path: "/x/../evil" }] };
    const r = await cp("/x/..", inner);
    expect(r.code).toBe(1);
    expect(r.err).toContain("UnsafePath");
    expect(r.err).toContain('".."');
    expect(existsSync(join(root, "evil"))).toBe(false);
    expect(tree(root)).toEqual(["inner"]);
  }, HANG_MS);

  test.each([
    ["an entry named '..'", [{ name: "..", type: DIR, path: "/dir/.." }, { name: "evil", type: FILE, path: "/dir/../evil" }]],
    ["an entry whose name holds '/'", [{ name: "../evil", type: FILE, path: "/dir/../evil" }]],
    ["an entry with a '..' part in its path", [{ name: "evil", type: FILE, path: "/dir/../../evil" }]],
    ["an entry outside the listed folder", [{ name: "evil", type: FILE, path: "/elsewhere/evil" }]],
    ["an entry whose name is not its path's last part", [{ name: "a", type: FILE, path: "/dir/b" }]],
    ["an entry with NUL in its name", [{ name: "a\0b", type: FILE, path: "/dir/a\0b" }]],
  ])("%s: refused before anything is written", async (_what, list) => {
    const root = scratchDir("cli-cp-list");
    const out = join(root, "out");
    // An honest entry first: nothing of it is written either, the listing is refused whole.
    answer = { stat: { name: "dir", type: DIR, path: "/dir" }, list: [{ name: "fine", type: FILE, path: "/dir/fine" }, ...list] };
    const r = await cp("/dir", out);
    expect(r.code).toBe(1);
    expect(r.err).toContain("UnsafePath");
    expect(tree(root)).toEqual([]);
  }, HANG_MS);

  test("an honest listing is copied whole; setuid and setgid bits are dropped", async () => {
    const root = scratchDir("cli-cp-honest");
    const out = join(root, "out");
    answer = {
      stat: { name: "dir", type: DIR, path: "/dir" },
      list: [
        { name: "a", type: FILE, path: "/dir/a", mode: 0o6755 },
        { name: "..b", type: FILE, path: "/dir/..b" },
        { name: "sub", type: DIR, path: "/dir/sub", mode: 0o755 },
        { name: "c", type: FILE, path: "/dir/sub/c" },
      ],
    };
    const r = await cp("/dir", out);
    expect(r).toEqual({ code: 0, err: "" });
    expect(tree(out)).toEqual(["..b", "a", "sub", join("sub", "c")]);
    expect(readFileSync(join(out, "sub", "c"), "utf8")).toBe("owned");
    expect(statSync(join(out, "a")).mode & 0o7777).toBe(0o755);
  }, HANG_MS);
});
