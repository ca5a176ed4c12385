// The guest's serial console on the host (docs/vmm.md, Console): `<runDir>/console.log`, mode 0600,
// never more than CONSOLE_LOG_MAX_BYTES. No VMM writes that file: each keeps the console in a
// bounded place of its own (QEMU: a ringbuf chardev read over QMP; Firecracker: a FIFO) and the
// node drains it into the file, so a guest writing without end fills neither the host's disk nor
// its memory. A drained VMM outlives the node; the next node's drain picks up what it kept meanwhile.

import { open, rm } from "node:fs/promises";
import { E, O_CLOEXEC, O_NONBLOCK, O_RDONLY, O_RDWR, errno, errnoName, libc, open as openFd } from "../../ffi/libc.ts";
import { mkfifo } from "../../ffi/unix_fd.ts";
import type { QmpClient } from "./qmp.ts";
import { RUN_FILE_MODE, VmmError } from "./types.ts";

/** The console file keeps the console's last 1 MiB at most. */
export const CONSOLE_LOG_MAX_BYTES = 1 << 20;
/** QEMU's ringbuf chardev keeps the last 256 KiB the node has not drained (a power of two, as QEMU requires). */
export const CONSOLE_RING_BYTES = 256 << 10;
/** One read from a console source is at most 64 KiB (a QMP reply of ~88 KiB of base64). */
export const CONSOLE_READ_BYTES = 64 << 10;
/** A drain reads at most 1 MiB: a guest that writes faster loses the surplus, never the node its time. */
const CONSOLE_DRAIN_MAX_BYTES = CONSOLE_LOG_MAX_BYTES;
/** Drains come every 100 ms while the console is busy, slowing (doubling) to once a second while it is quiet. */
const CONSOLE_DRAIN_INTERVAL_MS = [100, 1000] as const;

/**
 * A log file that never grows past `maxBytes`: an append that would take it past keeps the last
 * half of the bound (old tail, then the new bytes), rewritten in place (no second file). The file
 * is created with mode 0600.
 */
export class BoundedLogFile {
  private size: number | undefined;
  constructor(
    readonly path: string,
    readonly maxBytes = CONSOLE_LOG_MAX_BYTES,
  ) {}

  async append(bytes: Uint8Array): Promise<void> {
    if (bytes.length === 0) return;
    const f = await open(this.path, "a+", RUN_FILE_MODE);
    try {
      this.size ??= (await f.stat()).size;
      if (this.size + bytes.length <= this.maxBytes) {
        await f.write(bytes);
        this.size += bytes.length;
        return;
      }
    } finally {
      await f.close();
    }
    const keep = Math.floor(this.maxBytes / 2);
    const fresh = bytes.subarray(Math.max(0, bytes.length - keep));
    const oldBytes = Math.min(this.size, keep - fresh.length);
    const g = await open(this.path, "r+");
    try {
      const tail = Buffer.alloc(oldBytes);
      if (oldBytes > 0) await g.read(tail, 0, oldBytes, this.size - oldBytes);
      await g.write(tail, 0, oldBytes, 0);
      await g.write(fresh, 0, fresh.length, oldBytes);
      await g.truncate(oldBytes + fresh.length);
      this.size = oldBytes + fresh.length;
    } finally {
      await g.close();
    }
  }

  /** Makes the file (empty, mode 0600) if it is not there. */
  async create(): Promise<void> {
    await (await open(this.path, "a", RUN_FILE_MODE)).close();
  }
}

/** Where a VMM keeps console output the node has not taken yet. */
export interface ConsoleSource {
  /** Up to `max` bytes it holds (taking them); empty when it holds none now. */
  read(max: number): Promise<Uint8Array>;
  close?(): void;
}

/**
 * Moves a console source's bytes into the console file: on a timer (CONSOLE_DRAIN_INTERVAL_MS,
 * unref'd) and on demand (`drain()`). One drain at a time; a source that fails stops the drain
 * (its VMM is gone).
 */
export class ConsoleDrain {
  private timer: ReturnType<typeof setTimeout> | undefined;
  private running: Promise<void> | undefined;
  private stopped = false;
  private interval: number = CONSOLE_DRAIN_INTERVAL_MS[0];

  constructor(
    private readonly source: ConsoleSource,
    readonly file: BoundedLogFile,
  ) {}

  start(): this {
    this.schedule();
    return this;
  }

  /** Takes what the source holds now (up to CONSOLE_DRAIN_MAX_BYTES) into the file. */
  drain(): Promise<void> {
    if (this.stopped) return Promise.resolve();
    this.running ??= this.drainOnce().finally(() => (this.running = undefined));
    return this.running;
  }

  /** Drains once more, then stops the timer and closes the source. */
  async stop(): Promise<void> {
    if (this.stopped) return;
    await this.drain().catch(() => {});
    this.stopped = true;
    clearTimeout(this.timer);
    this.source.close?.();
  }

  private async drainOnce(): Promise<void> {
    let moved = 0;
    try {
      while (moved < CONSOLE_DRAIN_MAX_BYTES) {
        const bytes = await this.source.read(Math.min(CONSOLE_READ_BYTES, CONSOLE_DRAIN_MAX_BYTES - moved));
        if (bytes.length === 0) break;
        await this.file.append(bytes);
        moved += bytes.length;
      }
    } catch {
      this.stopped = true;
      clearTimeout(this.timer);
      this.source.close?.();
      return;
    }
    this.interval = moved > 0 ? CONSOLE_DRAIN_INTERVAL_MS[0] : Math.min(CONSOLE_DRAIN_INTERVAL_MS[1], this.interval * 2);
  }

  private schedule(): void {
    if (this.stopped) return;
    this.timer = setTimeout(() => {
      void this.drain().finally(() => this.schedule());
    }, this.interval);
    this.timer.unref();
  }
}

/** QEMU's ringbuf chardev `device`, read (and emptied) with QMP `ringbuf-read`. */
export class RingbufConsole implements ConsoleSource {
  constructor(
    private readonly qmp: QmpClient,
    readonly device: string,
  ) {}

  async read(max: number): Promise<Uint8Array> {
    const data = await this.qmp.execute<string>("ringbuf-read", { device: this.device, size: max, format: "base64" });
    return Buffer.from(data, "base64");
  }
}

/**
 * A named pipe the VMM writes its console into. The VMM's end is opened O_RDWR|O_NONBLOCK
 * (`openForVmm`): it never blocks and never meets a closed reader, and a full pipe (64 KiB while
 * no node drains it) drops what the guest writes next. The node reads it non-blocking.
 */
export class FifoConsole implements ConsoleSource {
  private fd: number | undefined;
  constructor(readonly path: string) {}

  /** A fresh FIFO at `path` (mode 0600) and the descriptor the VMM gets as its stdout; the caller closes it once the VMM has it. */
  static async openForVmm(path: string): Promise<number> {
    await rm(path, { force: true });
    mkfifo(path, RUN_FILE_MODE);
    return openFd(path, O_RDWR | O_NONBLOCK | O_CLOEXEC);
  }

  async read(max: number): Promise<Uint8Array> {
    this.fd ??= openFd(this.path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    const buf = new Uint8Array(max);
    for (;;) {
      const n = Number(libc.read(this.fd, buf, max));
      if (n >= 0) return buf.subarray(0, n); // 0: no writer holds it open (the VMM is gone)
      const e = errno();
      if (e === E.EINTR) continue;
      if (e === E.EAGAIN) return buf.subarray(0, 0);
      throw new VmmError("Protocol", `reading console ${this.path}: ${errnoName(e)}`);
    }
  }

  close(): void {
    if (this.fd !== undefined) libc.close(this.fd);
    this.fd = undefined;
  }
}
