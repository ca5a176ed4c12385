// Socket calls through bun:ffi that Bun's socket API does not offer: options, splice(2) between
// sockets through pipes, epoll(7) for a thread that waits on them.

import { FFIType, dlopen, ptr } from "bun:ffi";
import { E, O_CLOEXEC, O_NONBLOCK, SyscallError, errno, syscall } from "./libc.ts";

const sym = dlopen("libc.so.6", {
  getsockopt: { args: ["i32", "i32", "i32", "ptr", "ptr"], returns: "i32" },
  setsockopt: { args: ["i32", "i32", "i32", "ptr", "u32"], returns: "i32" },
  splice: { args: ["i32", "ptr", "i32", "ptr", "u64", "u32"], returns: FFIType.i64_fast },
  pipe2: { args: ["ptr", "i32"], returns: "i32" },
  shutdown: { args: ["i32", "i32"], returns: "i32" },
  epoll_create1: { args: ["i32"], returns: "i32" },
  epoll_ctl: { args: ["i32", "i32", "i32", "ptr"], returns: "i32" },
  epoll_wait: { args: ["i32", "ptr", "i32", "i32"], returns: "i32" },
}).symbols;
const { getsockopt } = sym;

export const SOL_IP = 0;
/** linux/netfilter_ipv4.h: the destination a connection had before NAT (nft redirect/dnat) changed it. */
export const SO_ORIGINAL_DST = 80;

/** The IPv4 destination an accepted, redirected TCP connection was sent to (conntrack's original tuple). */
export function originalDst(fd: number): { address: string; port: number } {
  const sa = new Uint8Array(16); // struct sockaddr_in
  const len = new Uint32Array([sa.length]);
  if (getsockopt(fd, SOL_IP, SO_ORIGINAL_DST, ptr(sa), ptr(len)) !== 0) throw new SyscallError("getsockopt(SO_ORIGINAL_DST)", errno(), `fd ${fd}`);
  return { address: `${sa[4]}.${sa[5]}.${sa[6]}.${sa[7]}`, port: (sa[2]! << 8) | sa[3]! };
}

export const SHUT_WR = 1;
export const SPLICE_F_MOVE = 1;
export const SPLICE_F_NONBLOCK = 2;
const SYS_fcntl = 72;
const F_DUPFD_CLOEXEC = 1030;
const F_SETPIPE_SZ = 1031;

/** One splice(2) of up to `len` bytes from `from` to `to` (one of them a pipe): the count moved, 0 at EOF, or -errno (EINTR retried). */
export function splice(from: number, to: number, len: number, flags: number): number {
  for (;;) {
    const r = Number(sym.splice(from, null, to, null, len, flags));
    if (r >= 0) return r;
    const e = errno();
    if (e !== E.EINTR) return -e;
  }
}

/** A non-blocking, close-on-exec pipe: [read end, write end]. */
export function pipe(): [number, number] {
  const fds = new Int32Array(2);
  if (sym.pipe2(fds, O_NONBLOCK | O_CLOEXEC) !== 0) throw new SyscallError("pipe2", errno());
  return [fds[0]!, fds[1]!];
}

/** F_SETPIPE_SZ: the pipe holds `bytes` (the kernel rounds up to pages); returns the size it got. */
export function setPipeSize(fd: number, bytes: number): number {
  return syscall(SYS_fcntl, fd, F_SETPIPE_SZ, bytes);
}

/** A close-on-exec duplicate of `fd`: the same socket, kept open while either is. */
export function dupFd(fd: number): number {
  return syscall(SYS_fcntl, fd, F_DUPFD_CLOEXEC, 0);
}

const SOL_SOCKET = 1;
const SO_LINGER = 13;
/**
 * SO_LINGER off (struct linger {0, 0}): the last close of the socket sends what is queued, then
 * its FIN. Bun's terminate() sets it on (0 s): that close resets, dropping what is still queued.
 */
export function lingerOff(fd: number): void {
  if (sym.setsockopt(fd, SOL_SOCKET, SO_LINGER, new Int32Array(2), 8) !== 0) throw new SyscallError("setsockopt(SO_LINGER)", errno(), `fd ${fd}`);
}

const IPPROTO_TCP = 6;
const TCP_CONGESTION = 13;
/** TCP_CONGESTION: the socket's congestion control by name (one of net.ipv4.tcp_available_congestion_control); false when refused. */
export function setCongestion(fd: number, name: string): boolean {
  const n = Buffer.from(name);
  return sym.setsockopt(fd, IPPROTO_TCP, TCP_CONGESTION, n, n.length) === 0;
}

/** shutdown(2): 0, or -errno. */
export function shutdown(fd: number, how: number): number {
  return sym.shutdown(fd, how) === 0 ? 0 : -errno();
}

export const EPOLLIN = 0x1;
export const EPOLLOUT = 0x4;
export const EPOLLRDHUP = 0x2000;
export const EPOLLET = 1 << 31;
export const EPOLL_CTL_ADD = 1;
export const EPOLL_CTL_DEL = 2;
/** struct epoll_event on x86_64 is packed: u32 events @0, u64 data @4. */
export const EPOLL_EVENT_SIZE = 12;

export function epollCreate(): number {
  const fd = sym.epoll_create1(O_CLOEXEC); // EPOLL_CLOEXEC
  if (fd < 0) throw new SyscallError("epoll_create1", errno());
  return fd;
}

const ctlBuf = new Uint8Array(EPOLL_EVENT_SIZE);
const ctlEvent = new DataView(ctlBuf.buffer);
/** epoll_ctl(2) with `data` (below 2^32) as the event's tag; DEL ignores both. */
export function epollCtl(ep: number, op: number, fd: number, events = 0, data = 0): void {
  ctlEvent.setUint32(0, events >>> 0, true);
  ctlEvent.setUint32(4, data, true);
  ctlEvent.setUint32(8, 0, true);
  if (sym.epoll_ctl(ep, op, fd, ctlBuf) !== 0) throw new SyscallError("epoll_ctl", errno(), `fd ${fd}`);
}

/** epoll_wait(2) into `events` (EPOLL_EVENT_SIZE each): the ready count, 0 on timeout or EINTR. */
export function epollWait(ep: number, events: Uint8Array, max: number, timeoutMs: number): number {
  const n = sym.epoll_wait(ep, events, max, timeoutMs);
  if (n >= 0) return n;
  const e = errno();
  if (e === E.EINTR) return 0;
  throw new SyscallError("epoll_wait", e);
}
