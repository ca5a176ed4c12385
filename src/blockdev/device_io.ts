// DeviceIo: what a frontend (ublk queue, FUSE server) needs from the device it serves. The
// device worker implements it over an overlaybd Image; frontends never see layers.

export interface DeviceIo {
  /** Device size in bytes. */
  size(): number;
  readonly readOnly: boolean;
  /** Read buf.length bytes at offset (512-aligned). */
  read(buf: Uint8Array, offset: number): Promise<void>;
  write(buf: Uint8Array, offset: number): Promise<void>;
  /** Make every completed write durable. */
  flush(): Promise<void>;
  /** Discard and write-zeroes: the range reads as zeros afterwards. */
  discard(offset: number, length: number): Promise<void>;
}

/** How a frontend loop hears that its worker has control work (restack, swap, stop). */
export interface WakeSource {
  /** An eventfd the loop must watch; it becomes readable when control work is queued. */
  readonly fd: number;
  /** Called on the loop's thread after the eventfd fired (and was read). */
  onWake(): Promise<void>;
  /** True once the loop should return. */
  stopping(): boolean;
}
