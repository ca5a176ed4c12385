// Image: a stack of read-only layers under one optional writable upper, served as one virtual
// disk (docs/storage.md). Reads consult the upper's index, then one merged index of every lower
// (tag = layer, base = 0); holes and zero segments read as zeros.

import { linkSync, renameSync } from "node:fs";
import { rename, rm, truncate, unlink } from "node:fs/promises";
import { IoRangeError, ConfigError, StorageError, TruncatedError } from "./errors.ts";
import type { ReadableFile, ReadWaiter, WritableFile } from "./file.ts";
import { type ImageConfig, MAX_LOWERS, resolveLayerPath } from "./image_config.ts";
import { openLayerFile } from "./open_layer.ts";
import { type CompactOptions, compact } from "./lsmt/compact.ts";
import { ReadOnlyLayer } from "./lsmt/readonly_layer.ts";
import { type Segment, SECTOR, clip } from "./lsmt/segment.ts";
import { comboVisit, type PieceSink } from "./lsmt/segment_index.ts";
import { SegmentTable } from "./lsmt/segment_table.ts";
import { WritableLayer } from "./lsmt/writable_layer.ts";
import type { IoLimiter } from "./io_limiter.ts";
import { handleFromSpec, registerRemoteLayer } from "./remote/layer.ts";
import { REMOTE_PREFIX } from "./remote/spec.ts";
import type { LayerDigest } from "./remote/source.ts";

export class Image {
  /** Merged index of the lowers; tag = position in `lowers` (base first). */
  private merged = SegmentTable.empty();
  private ops = 0;
  private idle: (() => void)[] = [];
  private gate: Promise<void> | undefined; // set while the stack is being restacked
  /** The last restack's leftover removal (its undo copy of the index). */
  private cleanup: Promise<void> = Promise.resolve();
  private plan = new ReadPlan(this);

  private constructor(
    readonly lowers: ReadOnlyLayer[],
    private upperLayer: WritableLayer | undefined,
  ) {
    if (lowers.length > MAX_LOWERS) throw new ConfigError(`${lowers.length} lowers exceed ${MAX_LOWERS}`);
    this.merged = SegmentTable.stack(lowers.map((l) => l.table));
  }

  static fromLayers(lowers: ReadOnlyLayer[], upper?: WritableLayer): Image {
    return new Image(lowers, upper);
  }

  /**
   * Open every layer a config names; the upper's files must already exist. `remoteIo` is the
   * node-wide budget that remote layer backends (registry, S3, peers) draw their reads from.
   */
  static async open(config: ImageConfig, opts: { remoteIo?: IoLimiter } = {}): Promise<Image> {
    const lowers = await Image.openLowers(config, 0, opts);
    try {
      const upper = config.upper ? await WritableLayer.open(config.upper.data, config.upper.index) : undefined;
      return new Image(lowers, upper);
    } catch (e) {
      for (const l of lowers) await l.close();
      throw e;
    }
  }

  /** The config's lowers from position `from` on, opened; all or none (a failure closes those opened). */
  static async openLowers(config: ImageConfig, from: number, opts: { remoteIo?: IoLimiter } = {}): Promise<ReadOnlyLayer[]> {
    // All at once (at most MAX_LOWERS, checked with the config): a stack opens in one layer's round trips.
    const opened = await Promise.allSettled(config.lowers.slice(from).map(async (ref, k) => {
      const path = resolveLayerPath(ref, from + k);
      if (path.startsWith(REMOTE_PREFIX)) registerRemoteLayer(await handleFromSpec(ref.digest as LayerDigest, ref.size!, ref.remote!));
      return openLayerFile(path, opts);
    }));
    const failed = opened.find((r) => r.status === "rejected");
    if (!failed) return opened.map((r) => (r as PromiseFulfilledResult<ReadOnlyLayer>).value);
    for (const r of opened) if (r.status === "fulfilled") await r.value.close();
    throw failed.reason;
  }

  get upper(): WritableLayer | undefined {
    return this.upperLayer;
  }

  /**
   * A fresh upper on top of an image of lowers only; the lowers and their merged index stay (a
   * rebuild is ~0.5 ms for a 9k-segment base). Fresh: it maps nothing, so no read in flight sees
   * the stack change.
   */
  attachUpper(upper: WritableLayer, above: ReadOnlyLayer[] = []): void {
    if (this.upperLayer) throw new ConfigError("the image already has a writable layer");
    if (upper.index.size) throw new ConfigError("only a fresh upper (one that maps nothing) can be attached", upper.dataPath);
    // `above`: more lowers between the open ones and the upper (a sandbox's own sealed layers over its template's).
    this.addLowers(above);
    this.upperLayer = upper;
  }
  /**
   * More read-only layers on top of an image of lowers only (a device nobody maps, growing into a
   * longer stack: docs/blockd.md, acquire `onto`); the open lowers and their merged index stay.
   */
  addLowers(above: ReadOnlyLayer[]): void {
    if (this.upperLayer) throw new ConfigError("lowers go on top only of an image without a writable layer");
    if (this.lowers.length + above.length > MAX_LOWERS) throw new ConfigError(`${this.lowers.length + above.length} lowers exceed ${MAX_LOWERS}`);
    this.lowers.push(...above);
    this.merged = this.merged.overlay(SegmentTable.stack(above.map((l) => l.table)), this.lowers.length - above.length);
  }
  /**
   * attachUpper undone (the acquire it was for did not go on): the upper, which nothing may have
   * written to, and the lowers past the first `keep` come off, the caller's to close or keep.
   */
  detachUpper(keep: number): { upper: WritableLayer; above: ReadOnlyLayer[] } {
    const upper = this.upperLayer;
    if (!upper) throw new ConfigError("the image has no writable layer to detach");
    if (upper.index.size) throw new ConfigError("only an upper nothing was written to can be detached", upper.dataPath);
    if (!Number.isInteger(keep) || keep < 0 || keep > this.lowers.length) throw new ConfigError(`cannot keep ${keep} of ${this.lowers.length} lowers`);
    const above = this.lowers.splice(keep);
    if (above.length) this.merged = SegmentTable.stack(this.lowers.map((l) => l.table));
    this.upperLayer = undefined;
    return { upper, above };
  }
  get readOnly(): boolean {
    return !this.upperLayer;
  }

  /** The upper's virtual size when set, else the top-most lower's non-zero one, as C++ sizes a stack. */
  get virtualSize(): number {
    if (this.upperLayer?.virtualSize) return this.upperLayer.virtualSize;
    for (let i = this.lowers.length - 1; i >= 0; i--) if (this.lowers[i]!.virtualSize) return this.lowers[i]!.virtualSize;
    return 0;
  }

  /** One past the last byte any layer maps: the smallest size a resize may keep. */
  usedEnd(): number {
    return Math.max(this.merged.end(), this.upperLayer?.index.end() ?? 0) * SECTOR;
  }

  /** The config that names this stack now (lowers grow on restack). */
  config(): ImageConfig {
    const cfg: ImageConfig = { lowers: this.lowers.map((l) => ({ file: l.name })) };
    if (this.upperLayer) cfg.upper = { index: this.upperLayer.indexPath, data: this.upperLayer.dataPath };
    return cfg;
  }

  private checkIo(offset: number, length: number): void {
    if (offset % SECTOR || length % SECTOR || offset < 0)
      throw new IoRangeError(`I/O at ${offset}+${length} is not 512-aligned`, "image", offset);
    if (offset + length > this.virtualSize)
      throw new IoRangeError(`I/O at ${offset}+${length} is past the disk's ${this.virtualSize} bytes`, "image", offset);
  }

  private async enter(): Promise<void> {
    while (this.gate) await this.gate;
    this.ops++;
  }
  private leave(): void {
    if (--this.ops === 0 && this.idle.length) for (const f of this.idle.splice(0)) f();
  }

  /** Read buf.length bytes at offset (both 512-aligned). */
  read(buf: Uint8Array, offset: number): Promise<void> {
    try {
      this.checkIo(offset, buf.length);
    } catch (e) {
      return Promise.reject(e);
    }
    if (this.gate) return this.enter().then(() => this.readNow(buf, offset));
    this.ops++;
    return this.readNow(buf, offset);
  }

  // Hot path: no async frames, no allocation in the mapping walk, one pread per run of pieces
  // that continue each other in one file, and one promise for all of them (the preads tell the
  // read's PendingRead, not promises of their own).
  private readNow(buf: Uint8Array, offset: number): Promise<void> {
    // Most small reads lie inside one run of one lower that the upper does not cover: one pread
    // straight away, with the checks and the one settle of any other read.
    const start = offset / SECTOR;
    const end = start + buf.length / SECTOR;
    const upper = this.upperLayer;
    if (!upper || !upper.index.maps(start, end)) {
      const merged = this.merged;
      const i = merged.covering(start, end);
      if (i >= 0 && !merged.zeroedAt(i)) {
        const read = new PendingRead(this, offset);
        read.want = buf.length;
        issueRead(this.lowers[merged.tagAt(i)]!.file, buf, merged.fileSectorAt(i, start) * SECTOR, read);
        read.walked();
        return read.promise;
      }
    }
    const plan = this.plan;
    let read: PendingRead | undefined;
    try {
      plan.begin(buf, offset);
      comboVisit(this.upperLayer?.index, this.merged, plan.start, plan.start + buf.length / SECTOR, plan);
      read = plan.finish();
    } catch (e) {
      read = plan.abandon();
      if (!read) {
        this.leave();
        return Promise.reject(e);
      }
      read.readFailed(e); // the walk's hold: the read settles once the preads it issued have
      return read.promise;
    }
    if (!read) {
      this.leave();
      return Promise.resolve();
    }
    read.walked();
    return read.promise;
  }

  /** @internal a read's preads have all settled. */
  readSettled(): void {
    this.leave();
  }

  private writable(offset: number, length: number): WritableLayer {
    this.checkIo(offset, length);
    if (!this.upperLayer) throw new IoRangeError("the image is read-only", "image", offset);
    return this.upperLayer;
  }

  async write(buf: Uint8Array, offset: number): Promise<void> {
    this.writable(offset, buf.length);
    await this.enter();
    try {
      await this.upperLayer!.write(buf, offset);
    } finally {
      this.leave();
    }
  }

  /** Discard and write-zeroes: the range reads as zeros from now on. */
  async discard(offset: number, length: number): Promise<void> {
    this.writable(offset, length);
    await this.enter();
    try {
      await this.upperLayer!.discard(offset, length);
    } finally {
      this.leave();
    }
  }

  async flush(): Promise<void> {
    if (this.upperLayer) await this.upperLayer.flush();
  }

  async resize(virtualSize: number): Promise<void> {
    if (!this.upperLayer) throw new IoRangeError("the image is read-only", "image");
    if (virtualSize < this.usedEnd())
      throw new IoRangeError(`resize to ${virtualSize} is below the ${this.usedEnd()} bytes in use`, "image");
    await this.upperLayer.resize(virtualSize);
  }

  /** Hold new I/O, wait for the I/O in flight, run fn, let I/O go on. */
  private async exclusive<T>(fn: () => Promise<T>): Promise<T> {
    while (this.gate) await this.gate;
    let open!: () => void;
    this.gate = new Promise((r) => (open = r));
    try {
      if (this.ops) await new Promise<void>((r) => this.idle.push(r));
      return await fn();
    } finally {
      this.gate = undefined;
      open();
    }
  }

  /**
   * Snapshot: seal the upper in place, name it `layerPath` as the newest read-only layer, and put
   * a fresh upper at the old paths. No data is copied: cost follows the index, not the data.
   * All or nothing: `layerPath` is claimed first (a hard link, so it must be new and on the
   * upper's filesystem) and the fresh upper is made beside the old one; on any failure the seal
   * is cut off again and the old upper reopened, so the image serves the stack it had. Its links
   * and renames are made directly: each is a metadata syscall of tens of µs, where a round trip
   * through libuv's pool cost 1–2.5 ms each while I/O waits at the gate.
   */
  async restack(layerPath: string): Promise<string> {
    if (!this.upperLayer) throw new IoRangeError("the image has no writable layer to restack", "image");
    if (this.lowers.length >= MAX_LOWERS) throw new ConfigError(`the stack already has ${MAX_LOWERS} layers`);
    return this.exclusive(async () => {
      const up = this.upperLayer!;
      await this.cleanup;
      try {
        linkSync(up.dataPath, layerPath);
      } catch (e) {
        throw new ConfigError(`restack target cannot be made: ${(e as NodeJS.ErrnoException).code ?? (e as Error).message}`, layerPath);
      }
      const next = { data: `${up.dataPath}.next`, index: `${up.indexPath}.next` };
      const prevIndex = `${up.indexPath}.prev`;
      const sealFrom = up.dataSize;
      let sealing = false;
      let closing = false;
      let indexSaved = false;
      let dataReplaced = false;
      let layer: ReadOnlyLayer | undefined;
      let merged: SegmentTable | undefined;
      let made: WritableLayer | undefined;
      let fresh: WritableLayer;
      try {
        // The fresh upper is made while the old one is sealed: neither waits on the other's syncs.
        const making = WritableLayer.create(next.data, next.index, { virtualSize: up.virtualSize, parentUuid: up.uuid, sparse: up.sparse }).then((l) => {
          made = l;
        });
        const sealed = (async () => {
          sealing = true;
          await up.seal();
          closing = true;
          await up.close();
          layer = await openLayerFile(layerPath);
          // One linear merge, while the fresh upper's syncs are still out.
          merged = this.merged.overlay(layer.table, this.lowers.length);
        })();
        const [madeOk, seal] = await Promise.allSettled([making, sealed]);
        if (seal.status === "rejected") throw seal.reason;
        if (madeOk.status === "rejected") throw madeOk.reason;
        if (!up.sparse) {
          linkSync(up.indexPath, prevIndex);
          indexSaved = true;
        }
        // A sparse index file is empty before and after (nothing to save for an undo).
        renameSync(next.index, up.indexPath);
        renameSync(next.data, up.dataPath); // the sealed data lives on at layerPath
        dataReplaced = true;
        // The fresh upper stays open: its files only changed names.
        fresh = made!;
        fresh.moved(up.dataPath, up.indexPath);
        fresh.appendOnly = up.appendOnly;
      } catch (e) {
        try {
          await made?.close(); // its files go below, or the undo puts the old ones back over them
          await layer?.close();
          if (dataReplaced) await rename(layerPath, up.dataPath);
          else await unlink(layerPath);
          if (indexSaved) await rename(prevIndex, up.indexPath);
          if (sealing) {
            if (!closing) await up.close();
            await truncate(up.dataPath, sealFrom); // cut the seal off
            this.upperLayer = await WritableLayer.open(up.dataPath, up.indexPath, { appendOnly: up.appendOnly });
          }
        } catch (u) {
          throw new StorageError(`restack failed (${(e as Error).message}) and undoing it failed (${(u as Error).message})`, up.dataPath);
        }
        await Promise.all([rm(next.data, { force: true }), rm(next.index, { force: true })]).catch(() => {});
        throw e instanceof StorageError ? e : new StorageError(`restack failed: ${(e as Error).message}`, layerPath);
      }
      this.lowers.push(layer!); // layer and merged are set once the seal settled without an error
      this.merged = merged!;
      this.upperLayer = fresh;
      // The undo copy goes after the gate opens; the next restack or close waits for it.
      this.cleanup = rm(prevIndex, { force: true }).catch(() => {});
      return layerPath;
    });
  }

  /**
   * Every visible segment of the stack in order (upper over merged lowers), with tags numbered
   * top-first (0 = upper or top layer), the numbering C++ overlaybd-merge writes.
   */
  private flatten(): { files: ReadableFile[]; index: Segment[] } {
    const files: ReadableFile[] = [];
    if (this.upperLayer) files.push(this.upperLayer.dataFile);
    for (let i = this.lowers.length - 1; i >= 0; i--) files.push(this.lowers[i]!.file);
    const top = this.lowers.length - 1;
    const base = this.upperLayer ? 1 : 0;
    const index: Segment[] = [];
    comboVisit(this.upperLayer?.index, this.merged, 0, Number.MAX_SAFE_INTEGER, {
      piece: (s, from, to, fromUpper) => index.push({ ...clip(s, from, to), tag: fromUpper ? 0 : base + top - s.tag }),
    });
    return { files, index };
  }

  /** Commit: the whole stack as one dense committed layer in `out`. */
  async commit(out: WritableFile, opts: CompactOptions = {}): Promise<{ size: number; entries: number }> {
    return this.exclusive(async () => {
      await this.flush();
      const { files, index } = this.flatten();
      const bottomParent = this.lowers[0]?.parentUuid ?? this.upperLayer!.parentUuid;
      return compact({ files, index, virtualSize: this.virtualSize, parentUuid: bottomParent }, out, opts);
    });
  }

  async close(): Promise<void> {
    await this.exclusive(async () => {
      await this.cleanup;
      if (this.upperLayer) await this.upperLayer.close();
      for (const l of this.lowers) await l.close();
    });
  }
}


/**
 * One read's preads: settles its promise once, when the last has settled, so a failed pread never
 * hands the caller's buffer back while another still writes into it. The mapping walk holds one
 * count until it has issued them all.
 */
class PendingRead implements ReadWaiter {
  readonly promise: Promise<void>;
  private resolve!: () => void;
  private reject!: (e: unknown) => void;
  private got = 0;
  /** Bytes the preads were asked for. */
  want = 0;
  /** Preads not settled, plus one while the walk runs. */
  left = 1;
  private error: unknown = undefined;

  constructor(
    private image: Image,
    private offset: number,
  ) {
    this.promise = new Promise<void>((res, rej) => {
      this.resolve = res;
      this.reject = rej;
    });
  }

  /** The walk has issued every pread. */
  walked(): void {
    if (--this.left === 0) this.settle();
  }

  readDone(n: number): void {
    this.got += n;
    if (--this.left === 0) this.settle();
  }

  readFailed(e: unknown): void {
    this.error ??= e;
    if (--this.left === 0) this.settle();
  }

  private settle(): void {
    this.image.readSettled();
    if (this.error !== undefined) return this.reject(this.error);
    // Validated layers map only bytes inside their files: a short read means one was cut.
    if (this.got !== this.want) return this.reject(new TruncatedError(`short read: ${this.got} of ${this.want} bytes`, "image", this.offset));
    this.resolve();
  }
}

/** One pread of a read, counted in its PendingRead, which hears how it ended whatever happens. */
function issueRead(file: ReadableFile, view: Uint8Array, pos: number, read: PendingRead): void {
  read.left++;
  if (file.preadTo) return file.preadTo(view, pos, read);
  let p: Promise<number>;
  try {
    p = file.pread(view, pos);
  } catch (e) {
    return read.readFailed(e);
  }
  p.then((n) => read.readDone(n), (e) => read.readFailed(e));
}

/**
 * The mapping phase of one read, turned into preads. One per Image and reused: the walk is
 * synchronous, so reads never share it while it runs.
 */
const NO_BYTES: Uint8Array = new Uint8Array(0);

class ReadPlan implements PieceSink {
  buf: Uint8Array = NO_BYTES;
  start = 0;
  private offset = 0;
  private cur = 0;
  private upperFile: ReadableFile | undefined;
  private read: PendingRead | undefined;
  private runFile: ReadableFile | undefined;
  private runAt = 0; // byte in buf
  private runLen = 0;
  private runOff = 0; // byte in runFile

  constructor(private image: Image) {}

  begin(buf: Uint8Array, offset: number): void {
    this.buf = buf;
    this.offset = offset;
    this.start = offset / SECTOR;
    this.cur = this.start;
    this.upperFile = this.image.upper?.dataFile;
    this.runLen = 0;
  }

  piece(s: Segment, from: number, to: number, fromUpper: boolean): void {
    const at = (from - this.start) * SECTOR;
    if (from > this.cur) this.buf.fill(0, (this.cur - this.start) * SECTOR, at);
    this.cur = to;
    const len = (to - from) * SECTOR;
    if (s.zeroed) {
      this.buf.fill(0, at, at + len);
      return;
    }
    const file = fromUpper ? this.upperFile! : this.image.lowers[s.tag]!.file;
    const off = (s.moffset + (from - s.offset)) * SECTOR;
    if (this.runLen && file === this.runFile && this.runAt + this.runLen === at && this.runOff + this.runLen === off) {
      this.runLen += len;
      return;
    }
    this.issue();
    this.runFile = file;
    this.runAt = at;
    this.runLen = len;
    this.runOff = off;
  }

  private issue(): void {
    const len = this.runLen;
    if (!len) return;
    this.runLen = 0;
    const read = (this.read ??= new PendingRead(this.image, this.offset));
    read.want += len;
    const whole = this.runAt === 0 && len === this.buf.length; // no view to make
    issueRead(this.runFile!, whole ? this.buf : this.buf.subarray(this.runAt, this.runAt + len), this.runOff, read);
  }

  /** The walk is over: the last run's pread, the tail's zeros; the read, if it issued any pread. */
  finish(): PendingRead | undefined {
    this.issue();
    const end = this.start + this.buf.length / SECTOR;
    if (this.cur < end) this.buf.fill(0, (this.cur - this.start) * SECTOR);
    return this.abandon();
  }

  /** Forget this read (the walk is over or failed); its PendingRead, if a pread was issued. */
  abandon(): PendingRead | undefined {
    const read = this.read;
    this.read = undefined;
    this.buf = NO_BYTES; // drop the caller's buffer
    this.runFile = undefined;
    this.runLen = 0;
    return read;
  }
}
