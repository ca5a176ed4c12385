// `aenv layer …`: build, seal, commit, compress and read overlaybd layers from the shell.
// Tests and users make fixtures with these verbs; every one works on plain files. Inputs must be
// regular files; outputs go through withOutputs (never an input, never half-written).

import { fstatSync, mkdirSync, renameSync, statSync, unlinkSync, writeSync } from "node:fs";
import { dirname, join } from "node:path";
import { Image } from "../storage/image.ts";
import { FieldError, FormatError, TruncatedError } from "../storage/errors.ts";
import { LocalFile } from "../storage/local_file.ts";
import { openLayerFile, requireRegularFile, unwrap } from "../storage/open_layer.ts";
import { ReadOnlyLayer, entriesPast, layerWarnings } from "../storage/lsmt/readonly_layer.ts";
import { WRITABLE_DATA, WRITABLE_INDEX, WritableLayer } from "../storage/lsmt/writable_layer.ts";
import {
  FLAG_DATA,
  FLAG_HEADER,
  FLAG_SEALED,
  HT_FIELD,
  HT_SPACE,
  checkDiskSize,
  decodeHeader,
  hasDamagedLsmtMagic,
  hasLsmtMagic,
  parseUuidArg,
  userTagText,
  type HeaderTrailer,
} from "../storage/lsmt/header.ts";
import { SECTOR, SEGMENT_BYTES, decodeSegments, type Segment } from "../storage/lsmt/segment.ts";
import { writeZFile, ZFileReader } from "../storage/zfile.ts";
import { writeOverlaybdTar } from "../storage/tar.ts";
import { UsageError, parseSize, type ParsedArgs } from "./args.ts";
import { groupCommand, verbLine, type Command, type Option, type Verb } from "./verbs.ts";
import { fileIdentity, withOutputs } from "./outputs.ts";

const FORCE: Option = { flag: "--force", help: "replace OUT if it exists (never an input)" };
const UUID: Option = { flag: "--uuid", value: "U", help: "the layer's UUID (8-4-4-4-12 hex)" };
const PARENT: Option = { flag: "--parent-uuid", value: "P", help: "the parent layer's UUID" };
const ALGORITHM: Option = { flag: "--algorithm", value: "zstd|lz4", help: "ZFile block compression (default zstd)" };
const BLOCK_SIZE: Option = {
  flag: "--block-size",
  value: "N",
  help: "uncompressed ZFile block size: a power of two from 4K to 64K, the most C++ overlaybd reads (default 4K)",
};
const APPEND_ONLY: Option = {
  flag: "--append-only",
  help: "append every write, rewrites too, and keep discarded data, as C++ overlaybd's writer does (byte-identical files; not recorded on disk)",
};

const VERBS: Record<string, Verb> = {
  create: {
    operands: "DIR",
    summary: "fresh writable layer in DIR: writable_data + writable_index",
    options: [
      { flag: "--size", value: "BYTES", required: true, help: "virtual disk size: bytes, or with a K/M/G/T suffix; a multiple of 512" },
      { flag: "--sparse", help: "sparse data file (the disk stored in place; writable_index stays empty)" },
      { flag: "--append-only", help: "a log-structured layer, the kind C++ overlaybd calls append-only (the default kind; refuses --sparse)" },
      UUID,
      PARENT,
      { flag: "--force", help: "replace the layer already in DIR" },
    ],
    run: create,
  },
  write: {
    operands: "DIR [FILE]",
    summary: "write FILE (or stdin) into the layer at byte N; the tail is zero-padded to 512",
    options: [{ flag: "--offset", value: "N", required: true, help: "byte offset on the disk, a multiple of 512" }, APPEND_ONLY],
    run: write,
  },
  discard: {
    operands: "DIR",
    summary: "discard a range of the layer's disk: it reads as zeros, over any lower layer",
    options: [
      { flag: "--offset", value: "N", required: true, help: "byte offset on the disk, a multiple of 512" },
      { flag: "--length", value: "N", required: true, help: "bytes to discard, a multiple of 512; the range ends by the disk's end" },
      { ...APPEND_ONLY, help: "only map the range as zeros, as C++ overlaybd does (default: also punch the whole 4 KiB blocks of data it drops)" },
    ],
    run: discard,
  },
  seal: {
    operands: "DIR OUT",
    summary: "seal the writable layer in DIR in place and move it to OUT (a read-only layer file)",
    options: [FORCE],
    run: seal,
  },
  commit: {
    operands: "IN... OUT",
    summary: "dense committed layer from one layer or a stack (lowest first; a DIR only on top)",
    options: [
      { flag: "--zfile", help: "compress the result as a ZFile (header overwritten, as overlaybd-commit -z)" },
      { ...ALGORITHM, help: "with --zfile: block compression (default zstd)" },
      { ...BLOCK_SIZE, help: `with --zfile: ${BLOCK_SIZE.help}` },
      { flag: "--tar", help: "wrap the result in the overlaybd tar" },
      { flag: "-m", value: "MSG", help: "commit message (user tag, at most 256 bytes)" },
      { ...UUID, help: "UUID of the committed layer (default: the null UUID, as C++)" },
      { ...PARENT, help: "parent UUID (default: the bottom layer's parent)" },
      FORCE,
    ],
    run: commit,
  },
  zfile: {
    operands: "IN OUT",
    summary: "compress IN as a ZFile",
    options: [ALGORITHM, BLOCK_SIZE, FORCE],
    run: zfile,
  },
  unzfile: { operands: "IN OUT", summary: "decompress the ZFile IN", options: [FORCE], run: unzfile },
  cat: {
    operands: "LAYER...",
    summary: "the stack's virtual disk to stdout, lowest layer first",
    options: [{ flag: "--upper", value: "DIR", help: "a writable layer on top of the LAYERs" }],
    run: cat,
  },
  inspect: {
    operands: "FILE",
    summary: "header, trailer, index summary and warnings of a layer file as JSON",
    options: [],
    run: inspect,
  },
};

/** Every verb with its synopsis and summary: the help of `aenv layer` and what follows its usage errors. */
export function layerVerbList(): string {
  return Object.entries(VERBS).map(([name, v]) => verbLine(`layer ${name}`, v)).join("\n");
}

/** Dispatch `aenv layer VERB …`; help goes to stdout, a usage error carries the verb's usage. */
export const layerCommand: Command = groupCommand("layer", VERBS);

// ---------------------------------------------------------------------------------------------
// inputs

/** The writable layer in `dir`: its files must be regular (a FIFO would block the open). */
async function openUpper(dir: string, appendOnly = false): Promise<WritableLayer> {
  const [data, index] = upperFiles(dir);
  requireRegularFile(data);
  requireRegularFile(index);
  return WritableLayer.open(data, index, { appendOnly });
}

const upperFiles = (dir: string) => [join(dir, WRITABLE_DATA), join(dir, WRITABLE_INDEX)] as const;
const isDir = (p: string) => statSync(p, { throwIfNoEntry: false })?.isDirectory() ?? false;

/** Every file a stack operand list reads (a directory stands for its writable layer's two files). */
const stackFiles = (operands: string[]) => operands.flatMap((p) => (isDir(p) ? upperFiles(p) : [p]));

/** A stack from CLI operands, lowest first: files are read-only layers, a directory is the upper (last only). */
async function openStack(operands: string[], upperDir?: string): Promise<Image> {
  const lowers: ReadOnlyLayer[] = [];
  let upper: WritableLayer | undefined;
  try {
    for (let i = 0; i < operands.length; i++) {
      const p = operands[i]!;
      if (isDir(p)) {
        if (i !== operands.length - 1 || upperDir) throw new UsageError(`${p}: a writable layer directory can only be the top of the stack`);
        upper = await openUpper(p);
      } else lowers.push(await openLayerFile(p));
    }
    if (upperDir) upper = await openUpper(upperDir);
  } catch (e) {
    for (const l of lowers) await l.close();
    await upper?.close();
    throw e;
  }
  const image = Image.fromLayers(lowers, upper);
  try {
    checkStackSize(image);
  } catch (e) {
    await image.close();
    throw e;
  }
  return image;
}

/** The disk takes its size from the upper, else the topmost lower with one (as C++): it must be a real disk size. */
function checkStackSize(image: Image): void {
  const up = image.upper;
  if (up?.virtualSize) return checkDiskSize(up.virtualSize, up.dataPath);
  const from = image.lowers.findLast((l) => l.virtualSize > 0) ?? image.lowers.at(-1);
  if (!from) return checkDiskSize(up?.virtualSize ?? 0, up?.dataPath ?? "");
  checkDiskSize(from.virtualSize, from.name, from.file.size() - HT_SPACE + HT_FIELD.virtualSize);
}

// ---------------------------------------------------------------------------------------------
// verbs that write

/** A UUID option: a malformed one is an error, not silently the null UUID. */
const uuidArg = (v: string | undefined) => (v === undefined ? undefined : parseUuidArg(v));

function algorithmOf(v: string | undefined): "zstd" | "lz4" {
  if (v === undefined || v === "zstd" || v === "lz4") return v ?? "zstd";
  throw new UsageError(`--algorithm must be zstd or lz4, not ${v}`);
}

/** ZFile block sizes C++ overlaybd reads: its reader refuses blocks over 64 KiB (MAX_READ_SIZE). */
const MIN_BLOCK = 4096;
const MAX_BLOCK = 65536;

function blockSizeOf(v: string | undefined): number | undefined {
  if (v === undefined) return undefined;
  const n = parseSize(v, "--block-size");
  if (n < MIN_BLOCK || n > MAX_BLOCK || (n & (n - 1)) !== 0)
    throw new UsageError(`--block-size ${n} is not a power of two from ${MIN_BLOCK} (4K) to ${MAX_BLOCK} (64K)`);
  return n;
}

/** A byte offset (or length) on the disk: whole 512-byte sectors. */
function sectorArg(a: ParsedArgs, name: string, zeroOk: boolean): number {
  const n = parseSize(a.value(name), `--${name}`, zeroOk);
  if (n % SECTOR) throw new UsageError(`--${name} ${n} is not a multiple of 512`);
  return n;
}

async function create(a: ParsedArgs): Promise<void> {
  const [dir] = a.need(1, "DIR");
  const opts = {
    virtualSize: parseSize(a.value("size"), "--size"),
    uuid: uuidArg(a.value("uuid")),
    parentUuid: uuidArg(a.value("parent-uuid")),
    sparse: a.flag("sparse"),
  };
  if (opts.sparse && a.flag("append-only")) throw new UsageError("--append-only and --sparse exclude each other: a sparse layer writes in place");
  const make = async (data: string, index: string) => (await WritableLayer.create(data, index, opts)).close();
  const st = statSync(dir!, { throwIfNoEntry: false });
  if (!st) {
    // A new directory appears whole: built under a temporary name, then renamed.
    mkdirSync(dirname(dir!), { recursive: true });
    await withOutputs({ outs: [dir!], inputs: [], force: false }, async ([tmp]) => {
      mkdirSync(tmp!);
      await make(...upperFiles(tmp!));
    });
    return;
  }
  if (!st.isDirectory()) throw new UsageError(`${dir} exists and is not a directory`);
  const [data, index] = upperFiles(dir!);
  // Index first: a crash between the two renames leaves the old data under an empty index, not old entries over new data.
  await withOutputs({ outs: [index, data], inputs: [], force: a.flag("force") }, async ([i, d]) => make(d!, i!));
}

async function write(a: ParsedArgs): Promise<void> {
  const [dir, file] = a.between(1, 2, "DIR [FILE]");
  const offset = sectorArg(a, "offset", true);
  // The layer's own file as input would read what the write appends, forever.
  if (file !== undefined && fileIdentity(file) !== undefined && upperFiles(dir!).some((p) => fileIdentity(p) === fileIdentity(file)))
    throw new UsageError(`input ${file} is one of the layer's own files`);
  const layer = await openUpper(dir!, a.flag("append-only"));
  try {
    const stream = file ? Bun.file(file).stream() : Bun.stdin.stream();
    const buf = new Uint8Array(4 << 20);
    let used = 0;
    let pos = offset;
    const put = async (n: number) => {
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

async function discard(a: ParsedArgs): Promise<void> {
  const [dir] = a.need(1, "DIR");
  const offset = sectorArg(a, "offset", true);
  const length = sectorArg(a, "length", false);
  if (!isDir(dir!)) throw new UsageError(`${dir} is not a writable layer directory`);
  const layer = await openUpper(dir!, a.flag("append-only"));
  try {
    if (offset + length > layer.virtualSize)
      throw new UsageError(`--offset ${offset} + --length ${length} passes the disk's end at ${layer.virtualSize}`);
    await layer.discard(offset, length);
  } finally {
    await layer.close();
  }
}

async function seal(a: ParsedArgs): Promise<void> {
  const [dir, out] = a.need(2, "DIR OUT");
  const [data, index] = upperFiles(dir!);
  await withOutputs({ outs: [out!], inputs: [data, index], force: a.flag("force") }, async ([tmp]) => {
    const layer = await openUpper(dir!);
    await layer.seal();
    await layer.close();
    renameSync(layer.dataPath, tmp!);
    unlinkSync(layer.indexPath);
  });
}

async function commit(a: ParsedArgs): Promise<void> {
  const ops = a.atLeast(2, "IN... OUT");
  const out = ops.pop()!;
  for (const o of ["algorithm", "block-size"]) if (a.value(o) !== undefined && !a.flag("zfile")) throw new UsageError(`--${o} needs --zfile`);
  const algorithm = algorithmOf(a.value("algorithm"));
  const blockSize = blockSizeOf(a.value("block-size"));
  const opts = { uuid: uuidArg(a.value("uuid")), parentUuid: uuidArg(a.value("parent-uuid")), message: a.value("m") };
  await withOutputs({ outs: [out], inputs: stackFiles(ops), force: a.flag("force") }, async ([tmp], scratch) => {
    const image = await openStack(ops);
    const raw = a.flag("zfile") || a.flag("tar") ? scratch() : tmp!;
    try {
      await writeLocal(raw, (f) => image.commit(f, opts));
    } finally {
      await image.close();
    }
    let cur = raw;
    if (a.flag("zfile")) {
      // overlaybd-commit -z semantics: verify on, header overwritten with the index information.
      const next = a.flag("tar") ? scratch() : tmp!;
      await zfileFile(cur, next, { algorithm, blockSize, headerOverwrite: true });
      cur = next;
    }
    // overlaybd records the tar file's own st_mode (0100644 for its 0644 open under umask 022).
    if (a.flag("tar")) await readWrite(cur, tmp!, (src, dst) => writeOverlaybdTar(src, dst, fstatSync(dst.fd).mode));
  });
}

/** Create `path`, fill it, sync it, close it (also on failure). */
async function writeLocal(path: string, fill: (f: LocalFile) => Promise<unknown>): Promise<void> {
  const f = LocalFile.open(path, { write: true, create: true });
  try {
    await fill(f);
    await f.fdatasync();
  } finally {
    await f.close();
  }
}

/** Read the regular file `inPath` while writing a new `outPath`. */
async function readWrite(inPath: string, outPath: string, fn: (src: LocalFile, dst: LocalFile) => Promise<unknown>): Promise<void> {
  requireRegularFile(inPath);
  const src = LocalFile.open(inPath);
  try {
    await writeLocal(outPath, (dst) => fn(src, dst));
  } finally {
    await src.close();
  }
}

function zfileFile(inPath: string, outPath: string, opts: { algorithm: "zstd" | "lz4"; blockSize?: number; headerOverwrite?: boolean }): Promise<void> {
  return readWrite(inPath, outPath, (src, dst) => writeZFile(src, dst, opts));
}

async function zfile(a: ParsedArgs): Promise<void> {
  const [inPath, outPath] = a.need(2, "IN OUT");
  const opts = { algorithm: algorithmOf(a.value("algorithm")), blockSize: blockSizeOf(a.value("block-size")) };
  await withOutputs({ outs: [outPath!], inputs: [inPath!], force: a.flag("force") }, ([tmp]) => zfileFile(inPath!, tmp!, opts));
}

async function unzfile(a: ParsedArgs): Promise<void> {
  const [inPath, outPath] = a.need(2, "IN OUT");
  await withOutputs({ outs: [outPath!], inputs: [inPath!], force: a.flag("force") }, ([tmp]) =>
    readWrite(inPath!, tmp!, async (src, dst) => {
      const z = await ZFileReader.open(src);
      const buf = new Uint8Array(4 << 20);
      for (let pos = 0; pos < z.size(); ) {
        const n = await z.pread(buf, pos);
        if (n <= 0) throw new TruncatedError(`ZFile ended at ${pos} of ${z.size()} bytes`, inPath!, pos);
        await dst.pwrite(buf.subarray(0, n), pos);
        pos += n;
      }
    }),
  );
}

// ---------------------------------------------------------------------------------------------
// verbs that read

async function cat(a: ParsedArgs): Promise<void> {
  const ops = a.rest;
  if (!ops.length && !a.value("upper")) throw new UsageError("cat needs at least one layer or --upper DIR");
  const image = await openStack(ops, a.value("upper"));
  try {
    const size = image.virtualSize;
    for (const l of image.lowers) {
      const past = entriesPast(l.index, size);
      if (past) process.stderr.write(`aenv: warning: ${l.name}: ${past}\n`);
    }
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

/**
 * The file's kind and fields. A last block with the LSMT magic is a trailer and the file is
 * opened as a read-only layer with the C++ rules, so a broken trailer is an error, never a
 * writable layer; what C++ opens but a disk cannot show is listed under "warnings".
 */
async function inspect(a: ParsedArgs): Promise<void> {
  const [path] = a.need(1, "FILE");
  requireRegularFile(path!);
  const local = LocalFile.open(path!);
  try {
    const { file, wrappers } = await unwrap(local);
    const report: Record<string, unknown> = { file: path, size: local.size(), logicalSize: file.size(), wrappers };
    const size = file.size();
    const hb = new Uint8Array(HT_SPACE);
    if (size < HT_SPACE || (await file.pread(hb, 0)) < HT_SPACE) throw new TruncatedError(`${size} bytes is too small for an LSMT header`, path!, 0);
    const header = decodeHeader(hb, path, 0);
    const hex = (f: number) => `0x${f.toString(16)}`;
    if (!(header.flags & FLAG_HEADER)) throw new FieldError("header flags", hex(header.flags), "lack the header bit 0x01", path!, HT_FIELD.flags);
    report.header = headerJson(header);
    const tb = new Uint8Array(HT_SPACE);
    const hasTrailer =
      size >= 2 * HT_SPACE && (await file.pread(tb, size - HT_SPACE)) === HT_SPACE && (hasLsmtMagic(tb) || hasDamagedLsmtMagic(tb));
    if (hasTrailer) {
      const layer = await ReadOnlyLayer.open(file);
      report.kind = header.flags & FLAG_SEALED ? "committed" : "sealed";
      report.trailer = headerJson(layer.trailer);
      report.index = indexSummary(layer.index);
      const warnings = layerWarnings(layer);
      if (warnings.length) report.warnings = warnings;
    } else if (header.flags & FLAG_SEALED) {
      throw new FormatError(`header flags ${hex(header.flags)} say sealed, but the last ${HT_SPACE} bytes hold no trailer (no LSMT magic)`, path!, size - HT_SPACE);
    } else if (header.flags & FLAG_DATA) {
      report.kind = "rw-data";
    } else {
      if (header.indexOffset !== HT_SPACE)
        throw new FieldError("index_offset", header.indexOffset, `of a writable index file must be ${HT_SPACE}`, path!, HT_FIELD.indexOffset);
      report.kind = "rw-index";
      const n = Math.floor((size - HT_SPACE) / SEGMENT_BYTES);
      const raw = new Uint8Array(n * SEGMENT_BYTES);
      await file.pread(raw, HT_SPACE);
      report.index = { ...indexSummary(decodeSegments(raw)), note: "entries in file order, before replay" };
    }
    process.stdout.write(JSON.stringify(report, null, 2) + "\n");
  } finally {
    await local.close();
  }
}
