import { describe, expect, test } from "bun:test";
import { FormatError, TruncatedError } from "../../src/storage/errors.ts";
import {
  OVERLAYBD_TAR_PAYLOAD_OFFSET,
  TarView,
  isOverlaybdTar,
  overlaybdTarHead,
  overlaybdTarSize,
  paxSize,
  writeOverlaybdTar,
} from "../../src/storage/tar.ts";
import { ZFileReader, writeZFile } from "../../src/storage/zfile.ts";
import { MemFile, randomBytes } from "../helpers/memfile.ts";

const text = (b: Uint8Array) => new TextDecoder().decode(b);
const hex = (b: Uint8Array) => Buffer.from(b).toString("hex");

async function tarOf(payload: Uint8Array, mode = 0o100644): Promise<MemFile> {
  const out = new MemFile("layer.tar");
  await writeOverlaybdTar(new MemFile("payload", payload), out, mode);
  return out;
}

// A plain ustar entry written by hand, with the checksum the usual way.
function ustarHeader(name: string, size: number, magic = "ustar\u000000"): Uint8Array {
  const h = new Uint8Array(512);
  const put = (at: number, s: string) => h.set(new TextEncoder().encode(s), at);
  put(0, name);
  put(100, "0000644\0");
  put(124, size.toString(8).padStart(11, "0") + "\0");
  h[156] = 0x30;
  put(257, magic);
  put(148, "        ");
  let sum = 0;
  for (const b of h) sum += b;
  put(148, sum.toString(8).padStart(6, "0") + "\0 ");
  return h;
}

describe("overlaybd tar layout", () => {
  test("head bytes match what the C++ tool writes", () => {
    const head = overlaybdTarHead(1043, 0o100644);
    expect(head.length).toBe(1536);
    // PAX header entry.
    expect(text(head.subarray(0, 14))).toBe("overlaybd.pax\0");
    expect(text(head.subarray(124, 136))).toBe("         15 "); // 13 bytes, in octal
    expect(String.fromCharCode(head[156]!)).toBe("x");
    expect(text(head.subarray(257, 265))).toBe("ustar\u000000");
    expect(hex(head.subarray(100, 124))).toBe("00".repeat(24)); // mode, uid, gid left empty
    expect(isOverlaybdTar(head.subarray(0, 512))).toBe(true);
    // PAX record.
    expect(text(head.subarray(512, 526))).toBe("13 size=1043\n\0");
    // The entry itself.
    const e = head.subarray(1024, 1536);
    expect(text(e.subarray(0, 17))).toBe("overlaybd.commit\0");
    expect(text(e.subarray(100, 108))).toBe("100644 \0");
    expect(text(e.subarray(108, 116))).toBe("     0 \0");
    expect(text(e.subarray(116, 124))).toBe("     0 \0");
    expect(text(e.subarray(124, 136))).toBe("          0 ");
    expect(text(e.subarray(136, 148))).toBe("          0 ");
    expect(String.fromCharCode(e[156]!)).toBe("0");
    expect(text(e.subarray(265, 270))).toBe("root\0");
    expect(text(e.subarray(297, 302))).toBe("root\0");
    expect(isOverlaybdTar(e)).toBe(true);
    // Checksum field: 6 octal digits right-aligned, a space, a NUL.
    expect(text(e.subarray(148, 156))).toMatch(/^[ 0-7]{6} \0$/);
  });

  test("the mode is a regular file's whole st_mode: a bare permission mode is refused", () => {
    expect(() => overlaybdTarHead(10, 0o644)).toThrow(/not a regular file's st_mode/);
    expect(() => overlaybdTarHead(10, 0o040755)).toThrow(/not a regular file's st_mode/);
    expect(text(overlaybdTarHead(10, 0o100600).subarray(1124, 1132))).toBe("100600 \0");
  });

  test("the PAX record length counts its own digits", () => {
    for (const n of [0, 5, 9, 10, 99, 100, 999999, 1e9, 2 ** 40]) {
      const head = overlaybdTarHead(n, 0o100644);
      const len = parseInt(text(head.subarray(124, 136)).trim(), 8);
      const record = text(head.subarray(512, 512 + len));
      expect(record).toBe(`${len} size=${n}\n`);
      expect(paxSize(head.subarray(512, 512 + len))).toBe(n);
    }
  });

  test("round trip with padding and two zero blocks", async () => {
    for (const n of [0, 1, 511, 512, 513, 5000]) {
      const payload = randomBytes(n, n + 1);
      const f = await tarOf(payload);
      const b = f.bytes();
      expect(b.length).toBe(overlaybdTarSize(n));
      expect(b.length).toBe(Math.ceil((1536 + n) / 512) * 512 + 1024);
      expect(hex(b.subarray(1536 + n))).toBe("00".repeat(b.length - 1536 - n));
      const v = await TarView.open(f);
      expect(v.payloadOffset).toBe(OVERLAYBD_TAR_PAYLOAD_OFFSET);
      expect(v.size()).toBe(n);
      const all = new Uint8Array(n + 100);
      expect(await v.pread(all, 0)).toBe(n);
      expect(hex(all.subarray(0, n))).toBe(hex(payload));
      if (n > 10) {
        const part = new Uint8Array(10);
        expect(await v.pread(part, n - 4)).toBe(4);
        expect(hex(part.subarray(0, 4))).toBe(hex(payload.subarray(n - 4)));
      }
      expect(await v.pread(new Uint8Array(4), n)).toBe(0);
    }
  });

  test("tar of a ZFile reads through both views", async () => {
    const data = randomBytes(10000, 5);
    const z = new MemFile("z");
    await writeZFile(new MemFile("d", data), z, { algorithm: "lz4" });
    const t = await tarOf(z.bytes());
    const r = await ZFileReader.open(await TarView.open(t));
    const back = new Uint8Array(r.size());
    await r.pread(back, 0);
    expect(hex(back)).toBe(hex(data));
    await r.close();
    expect(t.closed).toBe(true);
  });

  test("writing over a longer file cuts it", async () => {
    const out = new MemFile("reused", randomBytes(20000, 1));
    const size = await writeOverlaybdTar(new MemFile("p", randomBytes(100, 2)), out, 0o100600);
    expect(out.size()).toBe(size);
    expect((await TarView.open(out)).size()).toBe(100);
  });
});

describe("detection and errors", () => {
  test("isOverlaybdTar", () => {
    const good = overlaybdTarHead(10, 0o100644).subarray(0, 512);
    expect(isOverlaybdTar(good)).toBe(true);
    const badSum = good.slice();
    badSum[0] = badSum[0]! ^ 1;
    expect(isOverlaybdTar(badSum)).toBe(false);
    expect(isOverlaybdTar(ustarHeader("a", 1, "ustar  \0"))).toBe(false); // GNU
    expect(isOverlaybdTar(ustarHeader("a", 1))).toBe(true);
    expect(isOverlaybdTar(new Uint8Array(512))).toBe(false);
    expect(isOverlaybdTar(randomBytes(512, 3))).toBe(false);
    expect(isOverlaybdTar(good.subarray(0, 300))).toBe(false);
  });

  test("the signed checksum is accepted as well", () => {
    const h = ustarHeader("\u00e9t\u00e9", 3);
    let signed = 0;
    for (let i = 0; i < 512; i++) signed += i >= 148 && i < 156 ? 32 : h[i]! >= 128 ? h[i]! - 256 : h[i]!;
    h.set(new TextEncoder().encode(signed.toString(8).padStart(6, "0") + "\0 "), 148);
    expect(isOverlaybdTar(h)).toBe(true);
  });

  test("a plain ustar entry: payload at 512, size from the ustar field", async () => {
    const payload = randomBytes(700, 9);
    const file = new Uint8Array(512 + 1024 + 1024);
    file.set(ustarHeader("overlaybd.commit", 700), 0);
    file.set(payload, 512);
    const v = await TarView.open(new MemFile("plain.tar", file));
    expect(v.payloadOffset).toBe(512);
    expect(v.size()).toBe(700);
    const back = new Uint8Array(700);
    await v.pread(back, 0);
    expect(hex(back)).toBe(hex(payload));
  });

  test("not a tar, or a truncated one", async () => {
    await expect(TarView.open(new MemFile("x", randomBytes(4096, 1)))).rejects.toThrow(FormatError);
    await expect(TarView.open(new MemFile("x", new Uint8Array(100)))).rejects.toThrow(FormatError);
    const b = (await tarOf(randomBytes(5000, 2))).bytes();
    await expect(TarView.open(new MemFile("cut", b.subarray(0, 1536 + 4000)))).rejects.toThrow(TruncatedError);
    await expect(TarView.open(new MemFile("cut", b.subarray(0, 1000)))).rejects.toThrow(TruncatedError);
  });

  test("malformed PAX records are FormatErrors", () => {
    const enc = (s: string) => new TextEncoder().encode(s);
    expect(paxSize(enc("11 size=10\n"))).toBe(10);
    expect(paxSize(enc("12 path=abc\n"))).toBe(-1);
    expect(() => paxSize(enc("12 size=10\n"))).toThrow(FormatError);
    expect(() => paxSize(enc("x size=10\n"))).toThrow(FormatError);
    expect(() => paxSize(enc("11 size=1x\n"))).toThrow(FormatError);
  });
});
