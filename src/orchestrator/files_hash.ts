// The e2b SDK's files hash of a COPY step (its `calculateFilesHash`), recomputed from the archive
// its upload sends. The SDK hashes `COPY <src> <dest>`, then for each matched path in order its
// relative name, st_mode and st_size in decimal, and a file's bytes or a symlink's target; its
// archive (node-tar, no recursion) holds the same paths in the same order. For a regular file and
// a symlink the archive carries all of it: st_mode is the tar mode plus the type's bits, st_size
// the data's length (a symlink's: its target's bytes). For a directory it does not (the hash takes
// the directory's st_size, which the file system decides and the tar does not record), nor for a
// hard link (hashed per name, stored once): an archive with either cannot be checked.
import { createHash, type Hash } from "node:crypto";
import { createReadStream } from "node:fs";
import { open } from "node:fs/promises";
import { pipeline } from "node:stream/promises";
import { createGunzip } from "node:zlib";

export type FilesHashCheck =
  | { kind: "match" }
  | { kind: "mismatch"; detail: string }
  | { kind: "unchecked"; reason: string };

/** The unpacked tar a check reads at most: a gzip bomb is refused rather than hashed for hours. */
export const FILES_TAR_MAX_BYTES = 64 * 2 ** 30;
const BLOCK = 512;
const READ_CHUNK = 1 << 20;
/** PAX and GNU long-name records are read whole; node-tar's are a few hundred bytes. */
const META_MAX_BYTES = 1 << 20;
const S_IFREG = 0o100000;
const S_IFLNK = 0o120000;
const PERMISSION_BITS = 0o7777;

/** Stops the read: what follows cannot change the answer. */
class Verdict extends Error {
  constructor(readonly check: FilesHashCheck) {
    super("verdict");
  }
}

/** Whether `archive` (tar or tar.gz, as the SDK sends it) holds the files whose SDK hash for `COPY src dest` is `want`. */
export async function checkFilesHash(archive: string, src: string, dest: string, want: string): Promise<FilesHashCheck> {
  const hasher = new ArchiveHasher(`COPY ${src} ${dest}`);
  const sink = async (tar: AsyncIterable<Uint8Array>) => {
    for await (const chunk of tar) hasher.feed(chunk);
  };
  try {
    const file = createReadStream(archive, { highWaterMark: READ_CHUNK });
    if (await isGzip(archive)) await pipeline(file, createGunzip({ chunkSize: READ_CHUNK }), sink);
    else await pipeline(file, sink);
    const actual = hasher.digest();
    return actual === want ? { kind: "match" } : { kind: "mismatch", detail: `its files hash to ${actual}` };
  } catch (e) {
    if (e instanceof Verdict) return e.check;
    const code = (e as { code?: unknown }).code;
    if (typeof code === "string" && (code.startsWith("Z_") || code.startsWith("ERR_ZLIB"))) return { kind: "mismatch", detail: `it does not unpack: ${(e as Error).message}` };
    throw e;
  }
}

async function isGzip(path: string): Promise<boolean> {
  const fh = await open(path, "r");
  try {
    const head = new Uint8Array(2);
    const { bytesRead } = await fh.read(head, 0, 2, 0);
    return bytesRead === 2 && head[0] === 0x1f && head[1] === 0x8b;
  } finally {
    await fh.close();
  }
}

function text(b: Uint8Array): string {
  const nul = b.indexOf(0);
  return Buffer.from(nul < 0 ? b : b.subarray(0, nul)).toString("utf8");
}

/** A number field: octal, or GNU base-256 (high bit set) for large values. */
function octal(b: Uint8Array): number {
  if (b[0]! & 0x80) {
    let v = b[0]! & 0x7f;
    for (let i = 1; i < b.length; i++) v = v * 256 + b[i]!;
    return v;
  }
  const s = text(b).trim();
  if (!/^[0-7]*$/.test(s)) throw new Verdict({ kind: "mismatch", detail: `it is not a tar: number field ${JSON.stringify(s)}` });
  return s === "" ? 0 : parseInt(s, 8);
}

/** A ustar header's checksum: its bytes summed with the checksum field taken as spaces. */
function checksumOk(h: Uint8Array): boolean {
  let sum = 0;
  for (let i = 0; i < BLOCK; i++) sum += i >= 148 && i < 156 ? 0x20 : h[i]!;
  return sum === octal(h.subarray(148, 156));
}

/** PAX records "<len> <key>=<value>\n". */
function paxRecords(b: Uint8Array): Map<string, string> {
  const out = new Map<string, string>();
  for (let at = 0; at < b.length && b[at] !== 0;) {
    const sp = b.indexOf(0x20, at);
    const len = sp < 0 ? NaN : Number(Buffer.from(b.subarray(at, sp)).toString("latin1"));
    if (!Number.isSafeInteger(len) || len <= 0 || at + len > b.length) throw new Verdict({ kind: "mismatch", detail: "it is not a tar: a bad PAX record" });
    const rec = Buffer.from(b.subarray(sp + 1, at + len - 1)).toString("utf8"); // without the newline
    const eq = rec.indexOf("=");
    if (eq > 0) out.set(rec.slice(0, eq), rec.slice(eq + 1));
    at += len;
  }
  return out;
}

/** Feeds an unpacked tar stream and hashes its entries as the SDK hashed the files. */
class ArchiveHasher {
  private readonly hash: Hash;
  private header: Uint8Array = new Uint8Array(0);
  /** Bytes of the current entry still to come: data, then padding to the block. */
  private blockLeft = 0;
  private dataLeft = 0;
  private sink: "hash" | "meta" | "skip" = "skip";
  private meta: { type: string; parts: Uint8Array[] } | undefined;
  /** Overrides of the next entry's fields (PAX `path`, `linkpath`, `size`; GNU `L`, `K`). */
  private next: { path?: string; linkpath?: string; size?: number } = {};
  private total = 0;
  private ended = false;

  constructor(prefix: string) {
    this.hash = createHash("sha256").update(prefix);
  }

  digest(): string {
    if (this.meta || this.blockLeft > 0 || this.header.length > 0) throw new Verdict({ kind: "mismatch", detail: "it is not a tar: it ends inside an entry" });
    return this.hash.digest("hex");
  }

  feed(chunk: Uint8Array): void {
    this.total += chunk.byteLength;
    if (this.total > FILES_TAR_MAX_BYTES) throw new Verdict({ kind: "mismatch", detail: `it unpacks to more than ${FILES_TAR_MAX_BYTES} bytes` });
    for (let at = 0; at < chunk.length && !this.ended;) {
      if (this.blockLeft > 0) {
        const n = Math.min(this.blockLeft, chunk.length - at);
        this.data(chunk.subarray(at, at + n));
        this.blockLeft -= n;
        at += n;
        continue;
      }
      const n = Math.min(BLOCK - this.header.length, chunk.length - at);
      this.header = this.header.length === 0 && n === BLOCK ? chunk.subarray(at, at + n) : Buffer.concat([this.header, chunk.subarray(at, at + n)]);
      at += n;
      if (this.header.length === BLOCK) {
        const h = this.header;
        this.header = new Uint8Array(0);
        this.entry(h);
      }
    }
  }

  private data(part: Uint8Array): void {
    const d = part.subarray(0, Math.min(part.length, this.dataLeft));
    this.dataLeft -= d.length;
    if (this.sink === "hash") this.hash.update(d);
    else if (this.sink === "meta") this.meta!.parts.push(d.slice());
    if (this.dataLeft === 0 && this.meta) this.endMeta();
  }

  private endMeta(): void {
    const { type, parts } = this.meta!;
    this.meta = undefined;
    const body = Buffer.concat(parts);
    if (type === "x") {
      const pax = paxRecords(body);
      const path = pax.get("path");
      const linkpath = pax.get("linkpath");
      const size = pax.get("size");
      if (path !== undefined) this.next.path = path;
      if (linkpath !== undefined) this.next.linkpath = linkpath;
      if (size !== undefined) this.next.size = Number(size);
    } else if (type === "L") this.next.path = text(body);
    else if (type === "K") this.next.linkpath = text(body);
  }

  private entry(h: Uint8Array): void {
    if (h.every((b) => b === 0)) {
      this.ended = true;
      return;
    }
    if (!checksumOk(h)) throw new Verdict({ kind: "mismatch", detail: "it is not a tar: a header's checksum is wrong" });
    const type = h[156] === 0 ? "0" : String.fromCharCode(h[156]!);
    const ustarPrefix = text(h.subarray(257, 262)) === "ustar" ? text(h.subarray(345, 500)) : "";
    const name = this.next.path ?? (ustarPrefix ? `${ustarPrefix}/${text(h.subarray(0, 100))}` : text(h.subarray(0, 100)));
    const linkname = this.next.linkpath ?? text(h.subarray(157, 257));
    const size = this.next.size ?? octal(h.subarray(124, 136));
    const perm = octal(h.subarray(100, 108)) & PERMISSION_BITS;
    this.dataLeft = size;
    this.blockLeft = Math.ceil(size / BLOCK) * BLOCK;
    if (type === "x" || type === "L" || type === "K") {
      if (size > META_MAX_BYTES) throw new Verdict({ kind: "mismatch", detail: `it is not a tar node-tar writes: a ${size}-byte '${type}' record` });
      this.sink = "meta";
      this.meta = { type, parts: [] };
      if (size === 0) this.endMeta();
      return;
    }
    this.next = {};
    this.sink = "skip";
    switch (type) {
      case "g": return; // global PAX: no field of the hash
      case "0": case "7":
        this.hash.update(name).update(String(S_IFREG | perm)).update(String(size));
        this.sink = "hash";
        return;
      case "2":
        this.hash.update(name).update(String(S_IFLNK | perm)).update(String(Buffer.byteLength(linkname))).update(linkname);
        return;
      case "5": throw new Verdict({ kind: "unchecked", reason: `it holds a directory (${name}): the hash takes a directory's size on disk, which the archive does not record` });
      case "1": throw new Verdict({ kind: "unchecked", reason: `it holds a hard link (${name}): the hash takes its content per name, the archive once` });
      default: throw new Verdict({ kind: "unchecked", reason: `it holds an entry of tar type '${type}' (${name}), which the hash takes from the file system alone` });
    }
  }
}
