// `aenv layer …`: build, seal, commit, compress and read overlaybd layers from the shell.
// Tests and users make fixtures with these verbs; every one works on plain files.

import { existsSync, mkdirSync, statSync, unlinkSync, renameSync, writeSync } from "node:fs";
import { join } from "node:path";
import { Image } from "../storage/image.ts";
import { FormatError } from "../storage/errors.ts";
import { LocalFile } from "../storage/local_file.ts";
import { openLayerFile, unwrap } from "../storage/open_layer.ts";
import { ReadOnlyLayer } from "../storage/lsmt/readonly_layer.ts";
import { WRITABLE_DATA, WRITABLE_INDEX, WritableLayer } from "../storage/lsmt/writable_layer.ts";
import { decodeHeader, parseUuidArg, isLsmtHeader, HT_SPACE, userTagText, FLAG_DATA, FLAG_SEALED, type HeaderTrailer } from "../storage/lsmt/header.ts";
import { SECTOR, SEGMENT_BYTES, decodeSegments, type Segment } from "../storage/lsmt/segment.ts";
import { writeZFile, ZFileReader } from "../storage/zfile.ts";
import { writeOverlaybdTar } from "../storage/tar.ts";
import { UsageError, parseArgs, parseSize } from "./args.ts";


const USAGE = `usage:
  aenv layer create --size BYTES [--sparse] [--uuid U] [--parent-uuid P] DIR
  aenv layer write DIR --offset N [FILE]
  aenv layer seal DIR OUT
  aenv layer commit [--zfile [--algorithm zstd|lz4]] [--tar] [-m MSG] [--uuid U] [--parent-uuid P] IN... OUT
  aenv layer zfile [--algorithm zstd|lz4] [--block-size N] IN OUT
  aenv layer unzfile IN OUT
  aenv layer cat [--upper DIR] LAYER...
  aenv layer inspect FILE`;

const isDir = (p: string) => existsSync(p) && statSync(p).isDirectory();

async function openUpper(dir: string): Promise<WritableLayer> {
  return WritableLayer.open(join(dir, WRITABLE_DATA), join(dir, WRITABLE_INDEX));
}

/** A stack from CLI operands, lowest first: files are read-only layers, a directory is the upper (last only). */
async function openStack(operands: string[], upperDir?: string): Promise<Image> {
  const lowers: ReadOnlyLayer[] = [];
  let upper: WritableLayer | undefined;
  for (let i = 0; i < operands.length; i++) {
    const p = operands[i]!;
    if (isDir(p)) {
      if (i !== operands.length - 1 || upperDir) throw new UsageError(`${p}: a writable layer directory can only be the top of the stack`);
      upper = await openUpper(p);
    } else lowers.push(await openLayerFile(p));
  }
  if (upperDir) upper = await openUpper(upperDir);
  return Image.fromLayers(lowers, upper);
}

async function create(args: string[]): Promise<void> {
  const a = parseArgs(args, { flags: ["sparse"], values: ["size", "uuid", "parent-uuid"] });
  const [dir] = a.need(1, "DIR");
  const size = parseSize(a.value("size"), "--size");
  mkdirSync(dir!, { recursive: true });
  const l = await WritableLayer.create(join(dir!, WRITABLE_DATA), join(dir!, WRITABLE_INDEX), {
    virtualSize: size,
    uuid: uuidArg(a.value("uuid")),
    parentUuid: uuidArg(a.value("parent-uuid")),
    sparse: a.flag("sparse"),
  });
  await l.close();
}

async function write(args: string[]): Promise<void> {
  const a = parseArgs(args, { values: ["offset"] });
  const [dir, file] = a.between(1, 2, "DIR [FILE]");
  const offset = parseSize(a.value("offset"), "--offset", true);
  if (offset % SECTOR) throw new UsageError(`--offset ${offset} is not a multiple of 512`);
  const layer = await openUpper(dir!);
  try {
    const stream = file ? Bun.file(file).stream() : Bun.stdin.stream();
    const buf = new Uint8Array(4 << 20);
    let used = 0;
    let pos = offset;
    const put = async (n: number) => {
      // The tail of the input is zero-padded to a whole sector.
      const len = Math.ceil(n / SECTOR) * SECTOR;
      buf.fill(0, n, len);
      await layer.write(buf.subarray(0, len), pos);
      pos += len;
    };
    for await (const chunk of stream as AsyncIterable<Uint8Array>) {
      let c = chunk;
      while (c.length) {
        const k = Math.min(c.length, buf.length - used);
        buf.set(c.subarray(0, k), used);
        used += k;
        c = c.subarray(k);
        if (used === buf.length) {
          await put(used);
          used = 0;
        }
      }
    }
    if (used) await put(used);
  } finally {
    await layer.close();
  }
}

async function seal(args: string[]): Promise<void> {
  const [dir, out] = parseArgs(args, {}).need(2, "DIR OUT");
  if (existsSync(out!)) throw new UsageError(`${out} exists`);
  const layer = await openUpper(dir!);
  await layer.seal();
  await layer.close();
  renameSync(layer.dataPath, out!);
  unlinkSync(layer.indexPath);
}

async function commit(args: string[]): Promise<void> {
  const a = parseArgs(args, { flags: ["zfile", "tar"], values: ["algorithm", "m", "uuid", "parent-uuid"] });
  const ops = a.atLeast(2, "IN... OUT");
  const out = ops.pop()!;
  const algorithm = algorithmOf(a.value("algorithm"));
  const image = await openStack(ops);
  const wrapped = a.flag("zfile") || a.flag("tar");
  const rawPath = wrapped ? `${out}.commit.tmp` : out;
  try {
    const raw = await LocalFile.open(rawPath, { write: true, create: true });
    try {
      await image.commit(raw, { uuid: uuidArg(a.value("uuid")), parentUuid: uuidArg(a.value("parent-uuid")), message: a.value("m") });
    } finally {
      await raw.close();
    }
  } finally {
    await image.close();
  }
  if (!wrapped) return;
  let cur = rawPath;
  if (a.flag("zfile")) {
    // overlaybd-commit -z semantics: verify on, header overwritten with the index information.
    const next = a.flag("tar") ? `${out}.zfile.tmp` : out;
    await zfileFile(cur, next, { algorithm, headerOverwrite: true });
    unlinkSync(cur);
    cur = next;
  }
  if (a.flag("tar")) {
    const src = await LocalFile.open(cur, {});
    const dst = await LocalFile.open(out, { write: true, create: true });
    try {
      await writeOverlaybdTar(src, dst, 0o644);
    } finally {
      await src.close();
      await dst.close();
    }
    unlinkSync(cur);
  }
}

/** A UUID option: a malformed one is an error, not silently the null UUID. */
const uuidArg = (v: string | undefined) => (v === undefined ? undefined : parseUuidArg(v));

function algorithmOf(v: string | undefined): "zstd" | "lz4" {
  if (v === undefined || v === "zstd" || v === "lz4") return v ?? "zstd";
  throw new UsageError(`--algorithm must be zstd or lz4, not ${v}`);
}

async function zfileFile(inPath: string, outPath: string, opts: { algorithm: "zstd" | "lz4"; blockSize?: number; headerOverwrite?: boolean }): Promise<void> {
  const src = await LocalFile.open(inPath, {});
  const dst = await LocalFile.open(outPath, { write: true, create: true });
  try {
    await dst.truncate(0);
    await writeZFile(src, dst, opts);
  } finally {
    await src.close();
    await dst.close();
  }
}

async function zfile(args: string[]): Promise<void> {
  const a = parseArgs(args, { values: ["algorithm", "block-size"] });
  const [inPath, outPath] = a.need(2, "IN OUT");
  const bs = a.value("block-size");
  await zfileFile(inPath!, outPath!, { algorithm: algorithmOf(a.value("algorithm")), blockSize: bs ? parseSize(bs, "--block-size") : undefined });
}

async function unzfile(args: string[]): Promise<void> {
  const [inPath, outPath] = parseArgs(args, {}).need(2, "IN OUT");
  const src = await LocalFile.open(inPath!, {});
  const dst = await LocalFile.open(outPath!, { write: true, create: true });
  try {
    const z = await ZFileReader.open(src);
    await dst.truncate(0);
    const buf = new Uint8Array(4 << 20);
    for (let pos = 0; pos < z.size(); ) {
      const n = await z.pread(buf, pos);
      await dst.pwrite(buf.subarray(0, n), pos);
      pos += n;
    }
    await dst.fdatasync();
  } finally {
    await src.close();
    await dst.close();
  }
}

async function cat(args: string[]): Promise<void> {
  const a = parseArgs(args, { values: ["upper"] });
  const ops = a.rest;
  if (!ops.length && !a.value("upper")) throw new UsageError("cat needs at least one layer or --upper DIR");
  const image = await openStack(ops, a.value("upper"));
  try {
    const size = image.virtualSize;
    const buf = new Uint8Array(1 << 20);
    for (let pos = 0; pos < size; pos += buf.length) {
      const view = buf.subarray(0, Math.min(buf.length, size - pos));
      await image.read(view, pos);
      try {
        for (let done = 0; done < view.length; ) done += writeSync(1, view, done);
      } catch (e) {
        if ((e as NodeJS.ErrnoException).code === "EPIPE") return; // the reader has seen enough (cat | head)
        throw e;
      }
    }
  } finally {
    await image.close();
  }
}

function headerJson(h: HeaderTrailer) {
  return {
    flags: `0x${h.flags.toString(16).padStart(2, "0")}`,
    indexOffset: h.indexOffset,
    indexSize: h.indexSize,
    virtualSize: h.virtualSize,
    uuid: h.uuid,
    parentUuid: h.parentUuid,
    version: h.version,
    subVersion: h.subVersion,
    userTag: userTagText(h.userTag),
  };
}

function indexSummary(index: Segment[]) {
  let data = 0;
  let zero = 0;
  let sectors = 0;
  for (const s of index) {
    if (s.zeroed) zero++;
    else data++;
    sectors += s.length;
  }
  return {
    entries: index.length,
    dataEntries: data,
    zeroEntries: zero,
    mappedBytes: sectors * SECTOR,
    firstByte: index.length ? index[0]!.offset * SECTOR : null,
    endByte: index.length ? (index[index.length - 1]!.offset + index[index.length - 1]!.length) * SECTOR : null,
  };
}

async function inspect(args: string[]): Promise<void> {
  const [path] = parseArgs(args, {}).need(1, "FILE");
  const local = await LocalFile.open(path!, {});
  try {
    const { file, wrappers } = await unwrap(local);
    const report: Record<string, unknown> = { file: path, size: local.size(), logicalSize: file.size(), wrappers };
    const hb = new Uint8Array(HT_SPACE);
    await file.pread(hb, 0);
    if (!isLsmtHeader(hb)) throw new FormatError("not an LSMT layer (no LSMT header)", path!, 0);
    const header = decodeHeader(hb, path, 0);
    report.header = headerJson(header);
    const tb = new Uint8Array(HT_SPACE);
    const size = file.size();
    const hasTrailer = size >= 2 * HT_SPACE && (await file.pread(tb, size - HT_SPACE)) === HT_SPACE && isSealedTrailer(tb);
    if (hasTrailer) {
      const layer = await ReadOnlyLayer.open(file);
      report.kind = header.flags & FLAG_SEALED ? "committed" : "sealed";
      report.trailer = headerJson(layer.trailer);
      report.index = indexSummary(layer.index);
    } else if (header.flags & FLAG_DATA) {
      report.kind = "rw-data";
    } else {
      report.kind = "rw-index";
      const n = Math.floor((size - HT_SPACE) / SEGMENT_BYTES);
      const raw = new Uint8Array(n * SEGMENT_BYTES);
      await file.pread(raw, HT_SPACE);
      report.index = { ...indexSummary(decodeSegments(raw)), note: "entries in file order, before replay" };
    }
    console.log(JSON.stringify(report, null, 2));
  } finally {
    await local.close();
  }
}

function isSealedTrailer(tb: Uint8Array): boolean {
  try {
    const t = decodeHeader(tb);
    return !(t.flags & 1) && (t.flags & FLAG_SEALED) !== 0;
  } catch {
    return false;
  }
}

const VERBS: Record<string, (args: string[]) => Promise<void>> = { create, write, seal, commit, zfile, unzfile, cat, inspect };

export async function layerCommand(args: string[]): Promise<void> {
  const [verb, ...rest] = args;
  const fn = verb ? VERBS[verb] : undefined;
  if (!fn) throw new UsageError(verb ? `unknown verb "layer ${verb}"\n${USAGE}` : USAGE);
  await fn(rest);
}
