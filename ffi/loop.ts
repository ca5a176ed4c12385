// Loop devices (linux/loop.h): attach a file as /dev/loopN with LOOP_CONFIGURE, detach it.

import { close, ioctl, open, O_RDWR, O_RDONLY, O_CLOEXEC, SyscallError } from "./libc.ts";

export const LOOP_SET_FD = 0x4c00;
export const LOOP_CLR_FD = 0x4c01;
export const LOOP_SET_STATUS64 = 0x4c04;
export const LOOP_GET_STATUS64 = 0x4c05;
export const LOOP_SET_CAPACITY = 0x4c07;
export const LOOP_SET_DIRECT_IO = 0x4c08;
export const LOOP_SET_BLOCK_SIZE = 0x4c09;
export const LOOP_CONFIGURE = 0x4c0a;
export const LOOP_CTL_ADD = 0x4c80;
export const LOOP_CTL_REMOVE = 0x4c81;
export const LOOP_CTL_GET_FREE = 0x4c82;

export const LO_FLAGS_READ_ONLY = 1;
export const LO_FLAGS_AUTOCLEAR = 4;
export const LO_FLAGS_PARTSCAN = 8;
export const LO_FLAGS_DIRECT_IO = 16;

export const LOOP_CONFIG_SIZE = 304;
export const LOOP_INFO64_SIZE = 232;

/** struct loop_config: fd @0, block_size @4, loop_info64 @8 (lo_flags @8+52), reserved zero. */
export function encodeLoopConfig(fd: number, blockSize: number, loFlags: number): Uint8Array {
  const b = new Uint8Array(LOOP_CONFIG_SIZE);
  const dv = new DataView(b.buffer);
  dv.setUint32(0, fd, true);
  dv.setUint32(4, blockSize, true);
  dv.setUint32(8 + 52, loFlags, true);
  return b;
}

export function decodeLoFlags(info64: Uint8Array): number {
  return new DataView(info64.buffer, info64.byteOffset).getUint32(52, true);
}

export interface LoopDevice {
  path: string;
  index: number;
  directIo: boolean;
}

/** Attach `file` to a free loop device (retrying EBUSY races), direct I/O on unless refused. */
export function loopAttach(file: string, opts: { readOnly?: boolean; blockSize?: number; directIo?: boolean } = {}): LoopDevice {
  const ctl = open("/dev/loop-control", O_RDWR | O_CLOEXEC);
  try {
    for (let attempt = 0; attempt < 16; attempt++) {
      const n = ioctl(ctl, LOOP_CTL_GET_FREE);
      const path = `/dev/loop${n}`;
      const lfd = open(path, (opts.readOnly ? O_RDONLY : O_RDWR) | O_CLOEXEC);
      const bfd = open(file, (opts.readOnly ? O_RDONLY : O_RDWR) | O_CLOEXEC);
      try {
        const flags = (opts.readOnly ? LO_FLAGS_READ_ONLY : 0) | (opts.directIo === false ? 0 : LO_FLAGS_DIRECT_IO);
        ioctl(lfd, LOOP_CONFIGURE, encodeLoopConfig(bfd, opts.blockSize ?? 512, flags));
        const info = new Uint8Array(LOOP_INFO64_SIZE);
        ioctl(lfd, LOOP_GET_STATUS64, info);
        return { path, index: n, directIo: (decodeLoFlags(info) & LO_FLAGS_DIRECT_IO) !== 0 };
      } catch (e) {
        if (e instanceof SyscallError && e.code === "EBUSY") continue; // another attacher took index n
        throw e;
      } finally {
        close(bfd);
        close(lfd);
      }
    }
    throw new Error(`loop attach ${file}: no free loop device after 16 tries`);
  } finally {
    close(ctl);
  }
}

/** Detach (the kernel finishes it when the last opener closes). */
export function loopDetach(path: string): void {
  const fd = open(path, O_RDONLY | O_CLOEXEC);
  try {
    ioctl(fd, LOOP_CLR_FD);
  } finally {
    close(fd);
  }
}
