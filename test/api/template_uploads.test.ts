// COPY archive uploads without a VM: the node's API and the real TemplateBuilder over a stand-in
// for the orchestrator (only its template store), and an image source that fails every pull (a
// started build ends there). The archives and files hashes are the e2b SDK's: its Template's hash
// and a tar made as its upload makes one (node-tar, gzip, the matched paths, no recursion).
import { afterAll, describe, expect, setSystemTime, test } from "bun:test";
import { Database } from "bun:sqlite";
import { mkdirSync, readFileSync, symlinkSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { create as createTar } from "tar";
import { Template } from "e2b";
import { createApi } from "../../src/api/app.ts";
import { templateRoutes } from "../../src/api/templates.ts";
import { TemplateBuilder } from "../../src/orchestrator/builder.ts";
import type { Orchestrator } from "../../src/orchestrator/orchestrator.ts";
import { TemplateStore } from "../../src/orchestrator/templates.ts";
import { scratchDir, sha256 } from "../helpers/tmp.ts";

const KEY = "e2b_" + "3c".repeat(20);
const TTL_S = 600;
const home = scratchDir("uploads");
const db = new Database(join(home, "node.db"));
/** Stand-in for the orchestrator: the builder's upload and check paths read only its template store. */
const orchestrator = { templates: new TemplateStore(db) } as unknown as Orchestrator;
const builder = new TemplateBuilder(orchestrator, db, {
  filesDir: join(home, "files"), stepsDir: join(home, "steps"),
  images: { pull: () => Promise.reject(new Error("no registry in this test")) },
});
const node = createApi({ apiKey: KEY, maxBodyBytes: 1 << 20, notReadyReason: () => undefined, version: "test" })
  .use(templateRoutes(() => builder, { uploadUrlTtlS: TTL_S }))
  .listen({ hostname: "127.0.0.1", port: 0 });
afterAll(async () => { node.stop(); await builder.close(); db.close(); });
const base = `http://127.0.0.1:${node.server!.port}`;
const api = (path: string, init: RequestInit = {}) => fetch(base + path, { ...init, headers: { "x-api-key": KEY, "content-type": "application/json", ...init.headers } });

// The build context.
const ctx = join(home, "ctx");
mkdirSync(join(ctx, "files", "sub"), { recursive: true });
writeFileSync(join(ctx, "a.txt"), "from the context\n");
writeFileSync(join(ctx, "b.txt"), "another file\n");
writeFileSync(join(ctx, "files", "one.txt"), "one\n");
writeFileSync(join(ctx, "files", "sub", "two.txt"), "two\n");
symlinkSync("a.txt", join(ctx, "link-to-a"));
/** Past ustar's 100-byte name field: node-tar writes it as a PAX path record. */
const LONG_NAME = `${"long-".repeat(25)}name.txt`;
writeFileSync(join(ctx, LONG_NAME), "a long name\n");
writeFileSync(join(ctx, "grüße.txt"), "non-ASCII name\n");

/** The SDK's files hash of `COPY src dest` in ctx. */
async function sdkHash(src: string, dest: string): Promise<string> {
  const t = Template({ fileContextPath: ctx }).fromImage("x").copy(src, dest) as unknown as { instructionsWithHashes(): Promise<{ type: string; filesHash?: string }[]> };
  return (await t.instructionsWithHashes()).find((i) => i.type === "COPY")!.filesHash!;
}
/** A gzipped tar of `paths` (relative to `dir`) as the SDK's upload makes it. */
async function sdkArchive(paths: string[], dir = ctx): Promise<Uint8Array> {
  const file = join(home, `archive-${Math.random().toString(36).slice(2)}.tar.gz`);
  await createTar({ gzip: true, cwd: dir, follow: false, noDirRecurse: true, file }, paths);
  return readFileSync(file);
}

async function newTemplate(name: string): Promise<{ templateID: string; buildID: string }> {
  const r = await api("/v3/templates", { method: "POST", body: JSON.stringify({ name }) });
  expect(r.status).toBe(202);
  return (await r.json()) as { templateID: string; buildID: string };
}
async function uploadUrl(templateID: string, hash: string): Promise<{ present: boolean; url: string }> {
  const r = await api(`/templates/${templateID}/files/${hash}`);
  expect(r.status).toBe(201);
  return (await r.json()) as { present: boolean; url: string };
}
const put = (url: string, body: string | Uint8Array | ReadableStream<Uint8Array>) => fetch(url, { method: "PUT", body });
async function expectError(r: Response, status: number, words: string): Promise<void> {
  const body = (await r.json()) as { code: number; message: string };
  expect({ status: r.status, code: body.code }).toEqual({ status, code: status });
  expect(body.message).toContain(words);
}

describe("upload URLs", () => {
  test("signed over method, path, hash and expiry: an altered URL is 403 {code, message}", async () => {
    const t = await newTemplate("signed");
    const other = await newTemplate("signed-other");
    const hash = "a".repeat(64);
    const { url } = await uploadUrl(t.templateID, hash);
    const u = new URL(url);
    expect(u.pathname).toBe(`/templates/${t.templateID}/files/${hash}`);
    const expires = Number(u.searchParams.get("expires"));
    expect(expires - Date.now() / 1000).toBeGreaterThan(TTL_S - 5);
    expect(expires - Date.now() / 1000).toBeLessThanOrEqual(TTL_S);
    const signature = u.searchParams.get("signature")!;
    const flipped = signature.slice(0, -1) + (signature.endsWith("0") ? "1" : "0");
    const at = (path: string, query: Record<string, string>) => `${base}${path}?${new URLSearchParams(query)}`;
    for (const [what, altered] of [
      ["signature changed", at(u.pathname, { expires: String(expires), signature: flipped })],
      ["expiry moved", at(u.pathname, { expires: String(expires + 3600), signature })],
      ["another hash", at(`/templates/${t.templateID}/files/${"b".repeat(64)}`, { expires: String(expires), signature })],
      ["another template", at(`/templates/${other.templateID}/files/${hash}`, { expires: String(expires), signature })],
      ["no signature", at(u.pathname, { expires: String(expires) })],
      ["no expiry", at(u.pathname, { signature })],
      ["expiry not a number", at(u.pathname, { expires: `${expires}.0`, signature })],
    ] as const) {
      const r = await put(altered, "x");
      expect({ what, status: r.status }).toEqual({ what, status: 403 });
      await expectError(r, 403, "upload URL");
    }
    expect((await put(url, await sdkArchive(["a.txt"]))).status).toBe(200);
  });

  test(`expires after ${TTL_S} s: then 403, and a new URL works`, async () => {
    const t = await newTemplate("expiring");
    const hash = await sdkHash("a.txt", "/app/a.txt");
    const { url } = await uploadUrl(t.templateID, hash);
    try {
      setSystemTime(new Date(Date.now() + (TTL_S + 1) * 1000));
      await expectError(await put(url, await sdkArchive(["a.txt"])), 403, "expired");
      const fresh = await uploadUrl(t.templateID, hash);
      expect(fresh.present).toBe(false);
      expect((await put(fresh.url, await sdkArchive(["a.txt"]))).status).toBe(200);
    } finally {
      setSystemTime();
    }
  });

  test("replay: a PUT of a hash already here keeps the stored archive (200, idempotent); one while another uploads it is 409", async () => {
    const t = await newTemplate("replayed");
    const hash = await sdkHash("a.txt", "/app/a.txt");
    const { url } = await uploadUrl(t.templateID, hash);
    const first = await sdkArchive(["a.txt"]);
    expect((await put(url, first)).status).toBe(200);
    expect((await uploadUrl(t.templateID, hash)).present).toBe(true);
    expect((await put(url, "something else")).status).toBe(200);
    expect(sha256(readFileSync(join(home, "files", t.templateID, `${hash}.tar`)))).toBe(sha256(first));

    // Two uploads of one hash at once: the second is refused while the first runs.
    const hash2 = await sdkHash("b.txt", "/app/b.txt");
    const { url: url2 } = await uploadUrl(t.templateID, hash2);
    let finish!: () => void;
    const held = new Promise<void>((r) => { finish = r; });
    const archive = await sdkArchive(["b.txt"]);
    const slow = put(url2, new ReadableStream<Uint8Array>({
      async start(c) { c.enqueue(archive.subarray(0, 10)); await held; c.enqueue(archive.subarray(10)); c.close(); },
    }));
    await Bun.sleep(100);
    await expectError(await put(url2, archive), 409, "being uploaded");
    finish();
    expect((await slow).status).toBe(200);
  });
});

describe("the files hash", () => {
  const start = (t: { templateID: string; buildID: string }, src: string, dest: string, filesHash: string) =>
    api(`/v2/templates/${t.templateID}/builds/${t.buildID}`, { method: "POST", body: JSON.stringify({ fromImage: "x", steps: [{ type: "COPY", args: [src, dest, "", ""], filesHash }] }) });
  const logsOf = async (t: { templateID: string; buildID: string }) =>
    ((await (await api(`/templates/${t.templateID}/builds/${t.buildID}/status`)).json()) as { logEntries: { message: string }[] }).logEntries.map((e) => e.message);

  test("an archive whose files do not hash to its COPY step's filesHash: the start is 400 and the archive is gone", async () => {
    const t = await newTemplate("mismatch");
    const hash = await sdkHash("a.txt", "/app/a.txt");
    const { url } = await uploadUrl(t.templateID, hash);
    const elsewhere = join(home, "elsewhere");
    mkdirSync(elsewhere, { recursive: true });
    writeFileSync(join(elsewhere, "a.txt"), "not the file the hash names\n");
    expect((await put(url, await sdkArchive(["a.txt"], elsewhere))).status).toBe(200);
    await expectError(await start(t, "a.txt", "/app/a.txt", hash), 400, "do not match");
    // Gone, so the SDK uploads again (it skips a present hash).
    expect((await uploadUrl(t.templateID, hash)).present).toBe(false);
    // The same archive under the step's other destination is no match either: the hash covers `COPY src dest`.
    const again = await uploadUrl(t.templateID, hash);
    expect((await put(again.url, await sdkArchive(["a.txt"]))).status).toBe(200);
    await expectError(await start(t, "a.txt", "/elsewhere", hash), 400, "do not match");
    // Not a tar, or a gzip stream cut short: no match either.
    const archive = await sdkArchive(["a.txt"]);
    for (const [body, words] of [[new Uint8Array(2048).fill(7), "not a tar"], [archive.subarray(0, archive.length - 12), "does not unpack"]] as const) {
      const u = await uploadUrl(t.templateID, hash);
      expect(u.present).toBe(false);
      expect((await put(u.url, body)).status).toBe(200);
      await expectError(await start(t, "a.txt", "/app/a.txt", hash), 400, words);
    }
  });

  test("matching archives start: a file, a glob of files, a symlink, long and non-ASCII names (checked), a directory (not checkable: logged)", async () => {
    for (const [src, dest, paths, checked] of [
      ["a.txt", "/app/a.txt", ["a.txt"], true],
      [LONG_NAME, "/app/", [LONG_NAME], true],
      ["grüße.txt", "/app/", ["grüße.txt"], true],
      ["?.txt", "/app/", ["a.txt", "b.txt"], true],
      ["link-to-a", "/app/link", ["link-to-a"], true],
      ["files", "/app/files", ["files", "files/one.txt", "files/sub", "files/sub/two.txt"], false],
    ] as const) {
      const t = await newTemplate(`match-${src.replace(/[^a-z]/g, "").slice(0, 32)}`);
      const hash = await sdkHash(src, dest);
      const { url } = await uploadUrl(t.templateID, hash);
      expect((await put(url, await sdkArchive([...paths]))).status).toBe(200);
      const r = await start(t, src, dest, hash);
      expect({ src, status: r.status }).toEqual({ src, status: 202 });
      const notChecked = (await logsOf(t)).some((m) => m.includes("not checked"));
      expect({ src, notChecked }).toEqual({ src, notChecked: !checked });
    }
  });
});
