// The aenv layer verbs, run as a user runs them: a real process, files on disk, exit codes.
import { describe, expect, test } from "bun:test";
import { join } from "node:path";
import { readFileSync, writeFileSync } from "node:fs";
import { scratchDir, sha256 } from "../helpers/tmp.ts";
import { Image } from "../../src/storage/image.ts";
import { loadImageConfig, parseImageConfig } from "../../src/storage/image_config.ts";
import { ConfigError } from "../../src/storage/errors.ts";

const AENV = join(import.meta.dir, "../../src/cli/aenv.ts");
const dir = scratchDir("cli");

function aenv(args: string[], stdin?: Uint8Array) {
  const r = Bun.spawnSync([process.execPath, AENV, ...args], { stdin: stdin ?? "ignore", stdout: "pipe", stderr: "pipe" });
  return { code: r.exitCode, out: r.stdout as Uint8Array, err: r.stderr.toString() };
}
const ok = (args: string[], stdin?: Uint8Array) => {
  const r = aenv(args, stdin);
  if (r.code !== 0) throw new Error(`aenv ${args.join(" ")} → ${r.code}: ${r.err}`);
  return r;
};

describe("aenv layer", () => {
  const base = new Uint8Array(256 * 1024);
  crypto.getRandomValues(base.subarray(0, 65536));
  base.set(base.subarray(0, 65536), 131072);
  const top = new TextEncoder().encode("hello from the upper layer\n");

  test("create, write, seal, commit --zfile --tar, inspect, cat", () => {
    writeFileSync(join(dir, "base.bin"), base);
    ok(["layer", "create", "--size", "1M", join(dir, "l0")]);
    ok(["layer", "write", join(dir, "l0"), "--offset", "0", join(dir, "base.bin")]);
    ok(["layer", "seal", join(dir, "l0"), join(dir, "l0.sealed")]);
    ok(["layer", "create", "--size", "1M", join(dir, "up")]);
    ok(["layer", "write", join(dir, "up"), "--offset", "4096"], top);
    const want = new Uint8Array(1 << 20);
    want.set(base);
    want.set(top, 4096);
    want.fill(0, 4096 + top.length, 4096 + 512);
    expect(sha256(ok(["layer", "cat", "--upper", join(dir, "up"), join(dir, "l0.sealed")]).out)).toBe(sha256(want));

    ok(["layer", "commit", "--zfile", "--tar", "-m", "cli test", join(dir, "l0.sealed"), join(dir, "up"), join(dir, "flat.commit")]);
    const info = JSON.parse(ok(["layer", "inspect", join(dir, "flat.commit")]).out.toString());
    expect(info.wrappers).toEqual(["tar", "zfile"]);
    expect(info.kind).toBe("committed");
    expect(info.header.flags).toBe("0x07");
    expect(info.header.userTag).toBe("cli test");
    expect(info.trailer.indexSize % 256).toBe(0);
    expect(info.index.mappedBytes).toBe(256 * 1024);
    expect(sha256(ok(["layer", "cat", join(dir, "flat.commit")]).out)).toBe(sha256(want));

    ok(["layer", "zfile", join(dir, "l0.sealed"), join(dir, "l0.zfile")]);
    ok(["layer", "unzfile", join(dir, "l0.zfile"), join(dir, "l0.back")]);
    expect(sha256(readFileSync(join(dir, "l0.back")))).toBe(sha256(readFileSync(join(dir, "l0.sealed"))));
  });

  test("usage errors exit 2, bad files exit 1 with a named error", () => {
    const u = aenv(["layer", "create", join(dir, "nosize")]);
    expect(u.code).toBe(2);
    expect(u.err).toContain("--size is required");
    expect(aenv(["layer", "write", join(dir, "up"), "--offset", "100"]).err).toContain("not a multiple of 512");
    expect(aenv(["layer", "frobnicate"]).code).toBe(2);
    const badUuid = aenv(["layer", "create", "--size", "1M", "--uuid", "not-a-uuid", join(dir, "baduuid")]);
    expect(badUuid.code).toBe(1);
    expect(badUuid.err).toContain("not a UUID");
    writeFileSync(join(dir, "junk"), new Uint8Array(10000).fill(7));
    const b = aenv(["layer", "cat", join(dir, "junk")]);
    expect(b.code).toBe(1);
    expect(b.err).toMatch(/FormatError: .*junk @0: bad LSMT magic/);
    const bytes = new Uint8Array(readFileSync(join(dir, "l0.zfile")));
    bytes[600] ^= 0x10;
    writeFileSync(join(dir, "flipped.zfile"), bytes);
    const c = aenv(["layer", "cat", join(dir, "flipped.zfile")]);
    expect(c.code).toBe(1);
    expect(c.err).toContain("ChecksumError");
  });
});

describe("image config", () => {
  test("a config names a stack; relative paths are from the config's folder", async () => {
    writeFileSync(join(dir, "config.v1.json"), JSON.stringify({ lowers: [{ file: "l0.sealed" }], upper: { data: "up/writable_data", index: "up/writable_index" } }));
    const image = await Image.open(await loadImageConfig(join(dir, "config.v1.json")));
    expect(image.lowers.length).toBe(1);
    expect(image.virtualSize).toBe(1 << 20);
    await image.close();
  });
  test("bad configs are refused by name", async () => {
    expect(() => parseImageConfig([])).toThrow(ConfigError);
    expect(() => parseImageConfig({ lowers: [{}] })).toThrow(/names neither/);
    expect(() => parseImageConfig({ lowers: [{ file: "a", targetFile: "x" }] })).toThrow(/turboOCI/);
    expect(() => parseImageConfig({ upper: { data: "d" } })).toThrow(/both "index" and "data"/);
    expect(() => parseImageConfig({ lowers: new Array(256).fill({ file: "x" }) })).toThrow(/exceed 255/);
    await expect(Image.open(parseImageConfig({ lowers: [{ dir: join(dir, "nothing-here") }] }))).rejects.toThrow(/no layer file/);
    await expect(Image.open(parseImageConfig({ lowers: [{ dir: join(dir, "remote"), digest: "sha256:00" }] }))).rejects.toThrow(/remote/);
    writeFileSync(join(dir, "bad.json"), "{nope");
    await expect(loadImageConfig(join(dir, "bad.json"))).rejects.toThrow(ConfigError);
  });
});
