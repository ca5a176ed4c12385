// The aenv layer verbs, run as a user runs them: a real process, files on disk, exit codes.
import { describe, expect, setDefaultTimeout, test } from "bun:test";
import { join } from "node:path";
import { closeSync, existsSync, linkSync, mkdirSync, openSync, readdirSync, readFileSync, statSync, symlinkSync, writeFileSync } from "node:fs";
import { scratchDir, sha256 } from "../helpers/tmp.ts";
import { Image } from "../../src/storage/image.ts";
import { loadImageConfig, parseImageConfig } from "../../src/storage/image_config.ts";
import { ConfigError } from "../../src/storage/errors.ts";
import { isOverlaybdTar, overlaybdTarHead } from "../../src/storage/tar.ts";
import { lseek, SEEK_DATA, SEEK_HOLE } from "../../ffi/libc.ts";

const AENV = join(import.meta.dir, "../../src/cli/aenv.ts");
const dir = scratchDir("cli");

// A hung command is killed after this long and fails the test (exitCode null), instead of hanging it.
const HANG_MS = 30_000;
// Tests run a dozen commands each on a machine other suites load too: bound them by hangs, not by speed.
setDefaultTimeout(10 * HANG_MS);

function aenv(args: string[], stdin?: Uint8Array) {
  const r = Bun.spawnSync([process.execPath, AENV, ...args], { stdin: stdin ?? "ignore", stdout: "pipe", stderr: "pipe", timeout: HANG_MS });
  return { code: r.exitCode, out: r.stdout as Uint8Array, text: r.stdout.toString(), err: r.stderr.toString() };
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
    expect(b.err).toMatch(/FormatError: .*junk @0: no tar, ZFile or LSMT header at byte 0 \(it starts 07 07/);
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

describe("aenv layer replays overlaybd's own operations", () => {
  const d = join(dir, "replay");
  mkdirSync(d, { recursive: true });
  const fill = (n: number, v: number) => new Uint8Array(n).fill(v);
  /** [first hole, the data after it] of a file, from byte `from`. */
  const holeAt = (p: string, from: number) => {
    const fd = openSync(p, "r");
    try {
      const h = lseek(fd, from, SEEK_HOLE);
      return [h, lseek(fd, h, SEEK_DATA)];
    } finally {
      closeSync(fd);
    }
  };

  test("commit --tar records the tar file's whole st_mode (100644), as overlaybd's tar writer does", () => {
    ok(["layer", "create", "--size", "1M", join(d, "t")]);
    ok(["layer", "write", join(d, "t"), "--offset", "0"], fill(4096, 9));
    const old = process.umask(0o022); // the mode overlaybd-commit's 0644 open gets on a usual host
    try {
      for (const zfile of [[], ["--zfile"]]) {
        const out = join(d, `t${zfile.length}.tar`);
        ok(["layer", "commit", ...zfile, "--tar", join(d, "t"), out]);
        const b = new Uint8Array(readFileSync(out));
        expect(statSync(out).mode).toBe(0o100644);
        expect(new TextDecoder().decode(b.subarray(1024 + 100, 1024 + 108))).toBe("100644 \0");
        expect(isOverlaybdTar(b.subarray(1024, 1536))).toBe(true);
        const payload = Number(/size=(\d+)\n/.exec(new TextDecoder().decode(b.subarray(512, 1024)))![1]);
        expect(Buffer.from(b.subarray(0, 1536)).toString("hex")).toBe(Buffer.from(overlaybdTarHead(payload, 0o100644)).toString("hex"));
      }
    } finally {
      process.umask(old);
    }
  });

  test("the layer vector from the shell: create/write --append-only and discard give C++'s bytes", () => {
    const l = join(d, "a");
    ok(["layer", "create", "--append-only", "--size", "1G", "--uuid", "5D8A6F1E-2B3C-4D4E-8F90-A1B2C3D4E5F6", l]);
    ok(["layer", "write", "--append-only", l, "--offset", "0"], fill(4096, 0xaa));
    ok(["layer", "write", "--append-only", l, "--offset", "8192"], fill(1024, 0xbb));
    ok(["layer", "discard", l, "--offset", "16384", "--length", "2048"]);
    ok(["layer", "write", "--append-only", l, "--offset", "512"], fill(512, 0xcc));
    expect(sha256(readFileSync(join(l, "writable_data")))).toBe("9c0cd02f51fa571474133183ec21e7df345a32a359b7b5108b305e1245b8d00f");
    expect(sha256(readFileSync(join(l, "writable_index")))).toBe("7be2a4d1fde49b06b954fbb0e0ec16559c729963acd5fddfd74dcfa71f065782");
    // Without --append-only the rewrite of sector 1 goes in place: no new data, no new entry.
    const b = join(d, "b");
    ok(["layer", "create", "--size", "1G", b]);
    ok(["layer", "write", b, "--offset", "0"], fill(4096, 0xaa));
    ok(["layer", "write", b, "--offset", "512"], fill(512, 0xcc));
    expect(statSync(join(b, "writable_data")).size).toBe(4096 + 4096);
    expect(statSync(join(b, "writable_index")).size).toBe(4096 + 16);
  });

  test("discard: zeros over the lowers, whole dropped blocks punched out of the data file", () => {
    ok(["layer", "create", "--size", "1M", join(d, "low")]);
    ok(["layer", "write", join(d, "low"), "--offset", "0"], fill(1 << 20, 0x11));
    ok(["layer", "seal", join(d, "low"), join(d, "low.sealed")]);
    const up = join(d, "up");
    ok(["layer", "create", "--size", "1M", up]);
    ok(["layer", "write", up, "--offset", "0"], fill(65536, 0xaa)); // data file bytes 4096..69632
    ok(["layer", "discard", up, "--offset", "4096", "--length", "8192"]);
    expect(holeAt(join(up, "writable_data"), 4096)).toEqual([8192, 16384]);
    const want = fill(1 << 20, 0x11).fill(0xaa, 0, 65536).fill(0, 4096, 12288);
    expect(sha256(ok(["layer", "cat", "--upper", up, join(d, "low.sealed")]).out)).toBe(sha256(want));
    // --append-only: the zero entry only, the data stays where it was (C++'s discard).
    ok(["layer", "discard", "--append-only", up, "--offset", "16384", "--length", "8192"]);
    expect(holeAt(join(up, "writable_data"), 16384)[0]).toBe(69632);
    want.fill(0, 16384, 24576);
    expect(sha256(ok(["layer", "cat", "--upper", up, join(d, "low.sealed")]).out)).toBe(sha256(want));
  });

  test("a sparse layer from the shell: writable_index made empty as overlaybd-create -s does; write, discard, seal", () => {
    const sp = join(d, "sp");
    ok(["layer", "create", "--sparse", "--size", "1M", sp]);
    expect(readdirSync(sp).sort()).toEqual(["writable_data", "writable_index"]);
    expect(statSync(join(sp, "writable_index")).size).toBe(0);
    ok(["layer", "write", sp, "--offset", "0"], fill(65536, 0x77));
    ok(["layer", "discard", sp, "--offset", "8192", "--length", "4096"]);
    expect(holeAt(join(sp, "writable_data"), 4096)).toEqual([4096 + 8192, 4096 + 12288]);
    const want = new Uint8Array(1 << 20).fill(0x77, 0, 65536).fill(0, 8192, 12288);
    expect(sha256(ok(["layer", "cat", "--upper", sp]).out)).toBe(sha256(want));
    ok(["layer", "seal", sp, join(d, "sp.sealed")]);
    expect(sha256(ok(["layer", "cat", join(d, "sp.sealed")]).out)).toBe(sha256(want));
  });

  test("commit and zfile take --block-size and --algorithm, written into the ZFile header", () => {
    for (const [algo, bs, code] of [["lz4", "8K", 1], ["zstd", "64K", 2]] as const) {
      const out = join(d, `c-${algo}.zfile`);
      ok(["layer", "commit", "--zfile", "--algorithm", algo, "--block-size", bs, join(d, "low.sealed"), out]);
      const h = new DataView(readFileSync(out).buffer);
      expect([h.getUint32(72, true), h.getUint8(76)]).toEqual([bs === "8K" ? 8192 : 65536, code]);
      expect(sha256(ok(["layer", "cat", out]).out)).toBe(sha256(fill(1 << 20, 0x11)));
      const z = join(d, `z-${algo}.zfile`);
      ok(["layer", "zfile", "--algorithm", algo, "--block-size", bs, join(d, "low.sealed"), z]);
      expect(new DataView(readFileSync(z).buffer).getUint32(72, true)).toBe(bs === "8K" ? 8192 : 65536);
    }
  });

  test("each new option is checked at the boundary, naming the bound", () => {
    const up = join(d, "up");
    const low = join(d, "low.sealed");
    for (const [args, msg] of [
      [["commit", "--zfile", "--block-size", "128K", low, join(d, "x")], "--block-size 131072 is not a power of two from 4096 (4K) to 65536 (64K)"],
      [["commit", "--zfile", "--block-size", "2K", low, join(d, "x")], "from 4096 (4K) to 65536 (64K)"],
      [["zfile", "--block-size", "1M", low, join(d, "x")], "from 4096 (4K) to 65536 (64K)"],
      [["zfile", "--block-size", "12K", low, join(d, "x")], "is not a power of two"],
      [["commit", "--block-size", "8K", low, join(d, "x")], "--block-size needs --zfile"],
      [["commit", "--zfile", "--algorithm", "gzip", low, join(d, "x")], "--algorithm must be zstd or lz4, not gzip"],
      [["zfile", "--algorithm", "zlib", low, join(d, "x")], "--algorithm must be zstd or lz4, not zlib"],
      [["create", "--append-only", "--sparse", "--size", "1M", join(d, "x")], "--append-only and --sparse"],
      [["discard", up, "--length", "512"], "--offset is required"],
      [["discard", up, "--offset", "0"], "--length is required"],
      [["discard", up, "--offset", "100", "--length", "512"], "--offset 100 is not a multiple of 512"],
      [["discard", up, "--offset", "0", "--length", "1000"], "--length 1000 is not a multiple of 512"],
      [["discard", up, "--offset", "0", "--length", "0"], "--length 0 is out of range"],
      [["discard", up, "--offset", "1M", "--length", "512"], "--offset 1048576 + --length 512 passes the disk's end at 1048576"],
      [["discard", up, "--offset", "4096", "--length", "1M"], "passes the disk's end at 1048576"],
      [["discard", join(d, "x"), "--offset", "0", "--length", "512"], "is not a writable layer directory"],
    ] as const) {
      const r = aenv(["layer", ...args]);
      expect({ args, code: r.code, out: r.text }).toEqual({ args, code: 2, out: "" });
      expect({ args, err: r.err.includes(msg) }).toEqual({ args, err: true });
    }
    expect(existsSync(join(d, "x"))).toBe(false);
  });
});

const VERBS = ["create", "write", "discard", "seal", "commit", "zfile", "unzfile", "cat", "inspect"];
// Every option each verb accepts: its help must list all of them.
const OPTIONS: Record<string, string[]> = {
  create: ["--size", "--sparse", "--append-only", "--uuid", "--parent-uuid", "--force"],
  write: ["--offset", "--append-only"],
  discard: ["--offset", "--length", "--append-only"],
  seal: ["--force"],
  commit: ["--zfile", "--tar", "--algorithm", "--block-size", "-m", "--uuid", "--parent-uuid", "--force"],
  zfile: ["--algorithm", "--block-size", "--force"],
  unzfile: ["--force"],
  cat: ["--upper"],
  inspect: [],
};

describe("aenv help and usage", () => {
  const version = JSON.parse(readFileSync(join(import.meta.dir, "../../package.json"), "utf8")).version;

  test("--help, -h and help print every verb to stdout with rc 0", () => {
    for (const args of [["--help"], ["-h"], ["help"], ["layer", "--help"], ["layer", "-h"], ["layer", "help"], ["help", "layer"]]) {
      const r = aenv(args);
      expect({ args, code: r.code, err: r.err }).toEqual({ args, code: 0, err: "" });
      for (const v of VERBS) expect(r.text).toContain(`aenv layer ${v}`);
    }
  });

  test("--version prints package.json's version", () => {
    const r = aenv(["--version"]);
    expect(r.code).toBe(0);
    expect(r.text).toBe(`aenv ${version}\n`);
  });

  test("each verb's help lists every option it takes", () => {
    for (const v of VERBS) {
      const r = aenv(["layer", v, "--help"]);
      expect({ v, code: r.code, err: r.err }).toEqual({ v, code: 0, err: "" });
      expect(r.text).toContain(`aenv layer ${v}`);
      for (const o of OPTIONS[v]!) expect({ v, has: r.text.includes(o) }).toEqual({ v, has: true });
      expect(aenv(["layer", v, "-h"]).text).toBe(r.text);
    }
  });

  test("usage errors go to stderr with rc 2 and the verb list", () => {
    for (const args of [[], ["frobnicate"], ["layer"], ["layer", "frobnicate"]]) {
      const r = aenv(args);
      expect({ args, code: r.code, out: r.text }).toEqual({ args, code: 2, out: "" });
      expect(r.err).toContain("UsageError");
      for (const v of VERBS) expect(r.err).toContain(`aenv layer ${v}`);
    }
    const bad = aenv(["layer", "zfile", "--bogus", "a", "b"]);
    expect(bad.code).toBe(2);
    expect(bad.err).toContain("unknown option --bogus");
    expect(bad.err).toContain("aenv layer zfile");
    expect(bad.err).toContain("--block-size");
    const bs = aenv(["layer", "zfile", "--block-size", "3000", "a", "b"]);
    expect(bs.code).toBe(2);
    expect(bs.err).toContain("--block-size 3000 is not a power of two from 4096 (4K) to 65536 (64K)");
    expect(aenv(["layer", "commit", "--algorithm", "lz4", "a", "b"]).err).toContain("--algorithm needs --zfile");
  });
});

describe("aenv layer outputs: never an input, never silently replaced, never partial", () => {
  const d = join(dir, "outputs");
  mkdirSync(d, { recursive: true });
  const sealed = join(d, "s.sealed");
  const sum = (p: string) => sha256(readFileSync(p));
  const leftovers = () => readdirSync(d).filter((n) => n.includes(".aenv-") || n.endsWith(".tmp"));

  test("fixture", () => {
    ok(["layer", "create", "--size", "1M", join(d, "rw")]);
    const data = new Uint8Array(65536);
    crypto.getRandomValues(data);
    ok(["layer", "write", join(d, "rw"), "--offset", "8192"], data);
    ok(["layer", "seal", join(d, "rw"), sealed]);
    ok(["layer", "zfile", sealed, join(d, "s.zfile")]);
  });

  test("an output that is an input (same path, symlink or hard link) is refused; the input is untouched", () => {
    const before = sum(sealed);
    symlinkSync(sealed, join(d, "sym"));
    linkSync(sealed, join(d, "hard"));
    for (const out of [sealed, join(d, "sym"), join(d, "hard"), join(d, ".", "s.sealed")]) {
      for (const args of [["commit", sealed, out], ["commit", "--force", sealed, out], ["zfile", "--force", sealed, out], ["unzfile", "--force", sealed, out]]) {
        const r = aenv(["layer", ...args]);
        expect({ args, code: r.code }).toEqual({ args, code: 2 });
        expect(r.err).toContain("is also an input");
      }
    }
    expect(sum(sealed)).toBe(before);
    const z = join(d, "s.zfile");
    const zb = sum(z);
    expect(aenv(["layer", "unzfile", "--force", z, z]).code).toBe(2);
    expect(sum(z)).toBe(zb);
    ok(["layer", "create", "--size", "1M", join(d, "up")]);
    const upData = sum(join(d, "up", "writable_data"));
    expect(aenv(["layer", "commit", "--force", sealed, join(d, "up"), join(d, "up", "writable_data")]).err).toContain("is also an input");
    expect(aenv(["layer", "seal", "--force", join(d, "up"), join(d, "up", "writable_index")]).err).toContain("is also an input");
    const w = aenv(["layer", "write", join(d, "up"), "--offset", "0", join(d, "up", "writable_data")]);
    expect(w.code).toBe(2);
    expect(w.err).toContain("is one of the layer's own files");
    expect(sum(join(d, "up", "writable_data"))).toBe(upData);
    expect(existsSync(join(d, "up", "writable_index"))).toBe(true);
    expect(leftovers()).toEqual([]);
  });

  test("an existing output is refused without --force and replaced whole with it", () => {
    const out = join(d, "exists.bin");
    writeFileSync(out, "precious");
    for (const args of [["commit", sealed, out], ["zfile", sealed, out], ["unzfile", join(d, "s.zfile"), out]]) {
      const r = aenv(["layer", ...args]);
      expect({ args, code: r.code }).toEqual({ args, code: 2 });
      expect(r.err).toContain("exists");
      expect(readFileSync(out, "utf8")).toBe("precious");
    }
    ok(["layer", "unzfile", "--force", join(d, "s.zfile"), out]);
    expect(sum(out)).toBe(sum(sealed));
    ok(["layer", "commit", "--force", "--zfile", "--tar", sealed, out]);
    expect(JSON.parse(ok(["layer", "inspect", out]).text).wrappers).toEqual(["tar", "zfile"]);
    expect(leftovers()).toEqual([]);
  });

  test("create over an existing layer directory is refused without --force", () => {
    const rw = join(d, "rw2");
    ok(["layer", "create", "--size", "1M", rw]);
    ok(["layer", "write", rw, "--offset", "0"], new Uint8Array(512).fill(1));
    const before = sum(join(rw, "writable_index"));
    const r = aenv(["layer", "create", "--size", "2M", rw]);
    expect(r.code).toBe(2);
    expect(r.err).toContain("exists");
    expect(sum(join(rw, "writable_index"))).toBe(before);
    ok(["layer", "create", "--force", "--size", "2M", rw]);
    expect(JSON.parse(ok(["layer", "inspect", join(rw, "writable_index")]).text).header.virtualSize).toBe(2 << 20);
    // A failed create leaves no directory behind.
    expect(aenv(["layer", "create", "--size", "1M", "--uuid", "nope", join(d, "never")]).code).toBe(1);
    expect(existsSync(join(d, "never"))).toBe(false);
    expect(readdirSync(rw).sort()).toEqual(["writable_data", "writable_index"]);
  });

  test("a verb that fails halfway leaves no output and no temporary file", () => {
    const bytes = new Uint8Array(readFileSync(join(d, "s.zfile")));
    bytes[600] ^= 0x10; // a block's payload: its CRC fails when read
    const bad = join(d, "bad.zfile");
    writeFileSync(bad, bytes);
    // (zfile reads its input as plain bytes: only an I/O error could stop it halfway.)
    for (const args of [["unzfile", bad], ["commit", bad], ["commit", "--zfile", "--tar", bad]]) {
      const out = join(d, "half.out");
      const r = aenv(["layer", ...args, out]);
      expect({ args, code: r.code }).toEqual({ args, code: 1 });
      expect(r.err).toContain("ChecksumError");
      expect(existsSync(out)).toBe(false);
      expect(leftovers()).toEqual([]);
    }
  });
});

describe("aenv layer refuses bad input up front, by name", () => {
  const d = join(dir, "badin");
  mkdirSync(d, { recursive: true });
  const sealed = join(d, "s.sealed");
  const dv = (b: Uint8Array) => new DataView(b.buffer, b.byteOffset, b.byteLength);
  const variant = (name: string, fn: (b: Uint8Array, trailer: number) => void) => {
    const b = new Uint8Array(readFileSync(sealed));
    fn(b, b.length - 4096);
    writeFileSync(join(d, name), b);
    return join(d, name);
  };

  test("fixture", () => {
    ok(["layer", "create", "--size", "1M", join(d, "rw")]);
    ok(["layer", "write", join(d, "rw"), "--offset", "4096"], new Uint8Array(8192).fill(5));
    ok(["layer", "seal", join(d, "rw"), sealed]);
  });

  test("a FIFO, a directory or a device is refused instead of read (no hang)", () => {
    const fifo = join(d, "fifo");
    expect(Bun.spawnSync(["mkfifo", fifo]).exitCode).toBe(0);
    for (const args of [["cat", fifo], ["inspect", fifo], ["zfile", fifo, join(d, "o1")], ["unzfile", fifo, join(d, "o2")], ["commit", fifo, join(d, "o3")]]) {
      const r = aenv(["layer", ...args]);
      expect({ args, code: r.code, out: r.text }).toEqual({ args, code: 1, out: "" });
      expect(r.err).toContain("FileTypeError");
      expect(r.err).toContain("is a FIFO, not a regular file");
    }
    expect(aenv(["layer", "inspect", "/dev/null"]).err).toContain("is a character device, not a regular file");
    expect(aenv(["layer", "cat", join(d, "rw"), d]).code).toBe(2);
    expect(readdirSync(d).filter((n) => n.startsWith("o"))).toEqual([]);
  });

  test("a trailer that is not a sealed data trailer is an error, not a writable layer", () => {
    for (const [name, fn, what] of [
      ["t-flags", (b: Uint8Array, t: number) => dv(b).setUint32(t + 28, 0x02, true), "trailer flags 0x2"],
      ["t-isize", (b: Uint8Array, t: number) => dv(b).setUint32(t + 44, 0x100000, true), "index_size 4503599627370497"],
      ["t-ioff", (b: Uint8Array, t: number) => dv(b).setUint32(t + 32, 7, true), "outside the data area [8, 0)"],
    ] as const) {
      const p = variant(name, fn);
      for (const verb of ["inspect", "cat"]) {
        const r = aenv(["layer", verb, p]);
        expect({ name, verb, code: r.code, out: r.text }).toEqual({ name, verb, code: 1, out: "" });
        expect(r.err).toContain(what);
      }
    }
  });

  test("what C++ opens is opened: a length-0 entry, an index_offset off the sector grid", () => {
    const len0 = variant("len0", (b, t) => {
      const at = dv(b).getUint32(t + 32, true); // the one entry {offset 8, length 16}: length is bits 50..63 of word 0
      dv(b).setUint16(at + 6, dv(b).getUint16(at + 6, true) & 0x3, true);
    });
    const info = JSON.parse(ok(["layer", "inspect", len0]).text);
    expect(info.trailer.indexSize).toBe(1);
    expect(info.index.entries).toBe(0);
    expect(ok(["layer", "cat", len0]).out.every((x) => x === 0)).toBe(true);
    ok(["layer", "create", "--size", "64K", join(d, "empty")]);
    ok(["layer", "seal", join(d, "empty"), join(d, "empty.sealed")]);
    const b = new Uint8Array(readFileSync(join(d, "empty.sealed")));
    const t = b.length - 4096;
    dv(b).setUint32(t + 32, dv(b).getUint32(t + 32, true) - 100, true); // 0 entries at an unaligned offset
    writeFileSync(join(d, "ioff"), b);
    expect(ok(["layer", "cat", join(d, "ioff")]).out.length).toBe(65536);
  });

  test("a committed header without a trailer is an error", () => {
    const p = variant("h-sealed", (b) => dv(b).setUint32(28, 0x07, true));
    const cut = join(d, "h-sealed-cut");
    writeFileSync(cut, readFileSync(p).subarray(0, 8192));
    const r = aenv(["layer", "inspect", cut]);
    expect(r.code).toBe(1);
    expect(r.err).toContain("no trailer");
  });

  test("a damaged magic names the format it belongs to", () => {
    const z = join(d, "s.zfile");
    ok(["layer", "zfile", sealed, z]);
    const zb = new Uint8Array(readFileSync(z));
    zb[0] ^= 1;
    writeFileSync(join(d, "zmagic"), zb);
    for (const verb of ["cat", "inspect"]) {
      const r = aenv(["layer", verb, join(d, "zmagic")]);
      expect(r.code).toBe(1);
      expect(r.err).toContain("bad ZFile magic");
      expect(r.err).not.toContain("LSMT");
    }
    const lb = variant("lmagic", (b) => (b[9] ^= 1));
    expect(aenv(["layer", "cat", lb]).err).toContain("bad LSMT magic");
    writeFileSync(join(d, "junk"), new Uint8Array(10000).fill(7));
    expect(aenv(["layer", "inspect", join(d, "junk")]).err).toContain("no tar, ZFile or LSMT header");
  });

  test("a disk size of 0 or not whole sectors is refused before any output", () => {
    const zero = variant("vs0", (b, t) => dv(b).setUint32(t + 48, 0, true));
    const odd = variant("vsodd", (b, t) => dv(b).setUint32(t + 48, 1_000_000, true));
    for (const [p, what] of [[zero, "virtual_size 0"], [odd, "virtual_size 1000000 is not a multiple of 512"]] as const) {
      const r = aenv(["layer", "cat", p]);
      expect({ p, code: r.code, out: r.text }).toEqual({ p, code: 1, out: "" });
      expect(r.err).toContain("FieldError");
      expect(r.err).toContain(what);
    }
    // C++ opens both (a lower with size 0 takes the stack's), so inspect shows them, with a warning.
    const info = JSON.parse(ok(["layer", "inspect", zero]).text);
    expect(info.trailer.virtualSize).toBe(0);
    expect(info.warnings.join("\n")).toContain("virtual_size 0");
    // Under a layer that gives the disk its size, a size-0 lower is fine.
    ok(["layer", "create", "--size", "1M", join(d, "top")]);
    expect(ok(["layer", "cat", "--upper", join(d, "top"), zero]).out.length).toBe(1 << 20);
  });

  test("an entry past the virtual size is reported; the disk ends at the virtual size as in C++", () => {
    const small = variant("vssmall", (b, t) => dv(b).setUint32(t + 48, 8192, true));
    const info = JSON.parse(ok(["layer", "inspect", small]).text);
    expect(info.warnings.join("\n")).toContain("past virtual_size 8192");
    const r = ok(["layer", "cat", small]);
    expect(r.out.length).toBe(8192);
    expect(r.err).toContain("past virtual_size 8192");
  });
});
