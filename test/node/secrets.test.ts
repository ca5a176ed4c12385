// E2B secrets on a `bun run node`, driven by the stock e2b SDK's `Secret`: create, list page by
// page, get by ID and by name, update, delete, the SDK's errors for unknown secrets and bad input,
// two creates of one name racing, and values that no answer and no log line carries and that rest
// in 0600 files apart from the node's own secrets. Resolution at egress: test/network/egress_upstream.test.ts.
import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { mkdirSync, readdirSync, statSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { Secret, SecretError, SecretNotFoundError } from "e2b";
import { FIRST_START_MS, nodeSetup, nodeSkipReason, startNode, stopNode, type NodeProc } from "./harness.ts";

const skip = nodeSkipReason();
const KEY = "e2b_" + "5e".repeat(20);

describe.skipIf(!!skip)("E2B secrets on bun run node (the SDK's Secret)", () => {
  if (skip) return void test.skip(skip!, () => {});
  const setup = nodeSetup("sec", 244, KEY);
  let node: NodeProc;
  const opts = () => ({ apiKey: KEY, apiUrl: node.base, requestTimeoutMs: 60_000 });
  const api = (path: string, init: RequestInit = {}) =>
    fetch(`${node.base}${path}`, { ...init, headers: { "x-api-key": KEY, "content-type": "application/json", ...init.headers } });
  /** Every value written in this file: none may come back in any answer or log line. */
  const values: string[] = [];
  const value = (label: string) => {
    const v = `${label}-${crypto.randomUUID()}`;
    values.push(v);
    return v;
  };
  /** Raw answers of the routes, checked for values at the end. */
  const answers: string[] = [];
  const raw = async (r: Promise<Response>) => {
    const res = await r;
    const text = await res.text();
    answers.push(text, JSON.stringify([...res.headers]));
    return { status: res.status, body: text ? JSON.parse(text) : null, headers: res.headers };
  };
  const secretsDir = join(setup.home, "secrets");

  beforeAll(async () => {
    // One of the node's own files: never listed, got or overwritten through /secrets.
    mkdirSync(secretsDir, { recursive: true, mode: 0o700 });
    writeFileSync(join(secretsDir, "api-key"), "node-own-file", { mode: 0o600 });
    node = await startNode(setup.env, FIRST_START_MS);
  }, FIRST_START_MS + 60_000);

  afterAll(() => stopNode(node, setup), 180_000);

  test("create, get by ID and by name, update, list, delete: the SDK's shapes, names lower-cased, versions counted", async () => {
    expect(await Secret.list(opts()).nextItems()).toEqual([]);
    expect((await raw(api("/secrets/api-key"))).status).toBe(404);
    const v1 = value("v1");
    const made = await Secret.create("OpenAI-Key", v1, { ...opts(), metadata: { team: "ml", env: "prod" } });
    expect(made.secretId).toMatch(/^sec_[a-z0-9]{24}$/);
    expect([made.name, made.version, made.metadata]).toEqual(["openai-key", 1, { team: "ml", env: "prod" }]);
    expect(made.createdAt).toBeInstanceOf(Date);
    expect(made.updatedAt.getTime()).toBe(made.createdAt.getTime());
    for (const ref of [made.secretId, "openai-key", "OPENAI-KEY"]) expect(await Secret.getInfo(ref, opts())).toEqual(made);
    expect(await Secret.exists("openai-key", opts())).toBe(true);

    const v2 = value("v2");
    const updated = await Secret.update("OpenAI-KEY", v2, opts());
    expect([updated.secretId, updated.version, updated.metadata]).toEqual([made.secretId, 2, { team: "ml", env: "prod" }]);
    expect(updated.updatedAt.getTime()).toBeGreaterThanOrEqual(made.updatedAt.getTime());
    const v3 = value("v3");
    expect((await Secret.update(made.secretId, v3, { ...opts(), metadata: { team: "ai" } }))).toMatchObject({ version: 3, metadata: { team: "ai" } });

    // A name with what E2B allows beyond letters (space, slash), found by name through the path.
    const odd = await Secret.create("My Team/Token", value("odd"), opts());
    expect((await Secret.getInfo("my team/token", opts())).secretId).toBe(odd.secretId);

    // Pagination: newest first, X-Next-Token until the last page.
    for (let i = 0; i < 5; i++) await Secret.create(`page-${i}`, value(`p${i}`), opts());
    const pager = Secret.list({ ...opts(), limit: 3 });
    const pages: string[][] = [];
    while (pager.hasNext) pages.push((await pager.nextItems()).map((s) => s.name));
    expect(pages).toEqual([["page-4", "page-3", "page-2"], ["page-1", "page-0", "my team/token"], ["openai-key"]]);
    const first = await raw(api("/secrets?limit=3"));
    expect(first.status).toBe(200);
    expect(first.headers.get("x-next-token")).toBeTruthy();
    expect(first.body[0]).toEqual({ secretID: expect.stringMatching(/^sec_/), name: "page-4", currentVersion: 1, metadata: {}, createdAt: expect.any(String), updatedAt: expect.any(String) });
    expect((await raw(api(`/secrets?limit=3&nextToken=${first.headers.get("x-next-token")}`))).body.map((s: { name: string }) => s.name)).toEqual(["page-1", "page-0", "my team/token"]);

    answers.push(JSON.stringify([made, updated, odd, pages]));
    expect(await Secret.destroy("page-0", opts())).toBe(true);
    expect(await Secret.destroy("page-0", opts())).toBe(false);
    expect(await Secret.destroy(made.secretId, opts())).toBe(true);
    expect(await Secret.exists("openai-key", opts())).toBe(false);
    expect((await Secret.list(opts()).nextItems()).map((s) => s.name)).toEqual(["page-4", "page-3", "page-2", "page-1", "my team/token"]);
  }, 120_000);

  test("unknown secrets: SecretNotFoundError on get and update, false on delete; 404 {code, message}", async () => {
    expect(await Secret.getInfo("nope", opts()).catch((e) => e)).toBeInstanceOf(SecretNotFoundError);
    expect(await Secret.getInfo("sec_000000000000000000000000", opts()).catch((e) => e)).toBeInstanceOf(SecretNotFoundError);
    expect(await Secret.update("nope", value("x"), opts()).catch((e) => e)).toBeInstanceOf(SecretNotFoundError);
    expect(await Secret.destroy("nope", opts())).toBe(false);
    for (const [method, body] of [["GET", undefined], ["POST", JSON.stringify({ value: "x" })], ["DELETE", undefined]] as const) {
      const r = await raw(api("/secrets/nope", { method, body }));
      expect([r.status, r.body.code, typeof r.body.message]).toEqual([404, 404, "string"]);
    }
  }, 60_000);

  test("bad names, values and metadata: 400 {code, message} as SecretError; a taken name 409; nothing made", async () => {
    const refused = async (p: Promise<unknown>) => {
      const e = await p.then(() => undefined, (err) => err);
      expect(e).toBeInstanceOf(SecretError);
      return (e as Error).message.slice(0, 4);
    };
    const many = (n: number, v = "v") => Object.fromEntries(Array.from({ length: n }, (_, i) => [`k${i}`, v]));
    const before = (await Secret.list(opts()).nextItems()).length;
    for (const name of ["", "sec_mine", "SEC_x", "a{b", "a}b", "tab\there", "n".repeat(257)]) expect(await refused(Secret.create(name, value("bad"), opts()))).toBe("400:");
    for (const v of ["a\nb", "a\rb", "a\0b", "x".repeat(8193)]) expect(await refused(Secret.create("bad-value", v, opts()))).toBe("400:");
    for (const metadata of [many(33), { ["k".repeat(129)]: "v" }, { k: "v".repeat(1025) }, many(9, "v".repeat(1000))]) {
      expect(await refused(Secret.create("bad-meta", value("m"), { ...opts(), metadata }))).toBe("400:");
      expect(await refused(Secret.update("page-1", value("m"), { ...opts(), metadata }))).toBe("400:");
    }
    // At the bounds: accepted.
    expect((await Secret.create("meta-at-bounds", value("ok"), { ...opts(), metadata: many(32, "v".repeat(200)) })).version).toBe(1);
    expect(await refused(Secret.create("PAGE-1", value("dup"), opts()))).toBe("409:");
    for (const body of [{ name: "x" }, { name: "x", value: 5 }, { name: "x", value: "v", metadata: [1] }, { name: "x", value: "v", metadata: { k: 1 } }]) {
      const r = await raw(api("/secrets", { method: "POST", body: JSON.stringify(body) }));
      expect([r.status, r.body.code]).toEqual([400, 400]);
    }
    for (const q of ["limit=0", "limit=101", "limit=x", "nextToken=garbage"]) expect((await raw(api(`/secrets?${q}`))).status).toBe(400);
    expect((await fetch(`${node.base}/secrets`)).status).toBe(401);
    expect((await Secret.list(opts()).nextItems()).length).toBe(before + 1);
  }, 120_000);

  test("two creates of one name racing: one wins, the other is a 409", async () => {
    const [a, b] = await Promise.allSettled([Secret.create("race", value("ra"), opts()), Secret.create("RACE", value("rb"), opts())]);
    const results = [a, b].map((r) => r.status);
    expect(results.sort()).toEqual(["fulfilled", "rejected"]);
    const lost = [a, b].find((r) => r.status === "rejected") as PromiseRejectedResult;
    expect(lost.reason).toBeInstanceOf(SecretError);
    expect(String(lost.reason.message)).toStartWith("409:");
    expect((await Secret.list(opts()).nextItems()).filter((s) => s.name === "race").length).toBe(1);
  }, 60_000);

  test("values rest in 0600 files under $AENV_HOME/secrets/user (0700), apart from the node's own; no answer or log line carries one", async () => {
    const userDir = join(secretsDir, "user");
    expect(statSync(secretsDir).mode & 0o777).toBe(0o700);
    expect(statSync(userDir).mode & 0o777).toBe(0o700);
    const files = readdirSync(userDir);
    expect(files.length).toBe((await Secret.list(opts()).nextItems()).length);
    for (const f of files) {
      expect(f).toMatch(/^sec_[a-z0-9]{24}\.json$/);
      expect(statSync(join(userDir, f)).mode & 0o777).toBe(0o600);
    }
    expect(await Bun.file(join(secretsDir, "api-key")).text()).toBe("node-own-file");
    expect((await raw(api("/secrets/api-key"))).status).toBe(404);
    // Every answer this file read (bodies and headers) and every line the node printed.
    for (const s of await Secret.list(opts()).nextItems()) answers.push(JSON.stringify(await raw(api(`/secrets/${s.secretId}`))));
    const seen = [...answers, ...node.log].join("\n");
    expect(values.length).toBeGreaterThan(10);
    for (const v of values) expect(seen.includes(v)).toBe(false);
  }, 60_000);
});
