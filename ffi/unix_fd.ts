// Unix-socket and FIFO calls through bun:ffi that Bun's APIs do not offer: a non-blocking connect
// by path, sendmsg(2) with one descriptor attached (SCM_RIGHTS), and mkfifo(3).

import { FFIType, dlopen, ptr } from "bun:ffi";
import { E, O_CLOEXEC, O_NONBLOCK, SyscallError, cString, errno, libc } from "./libc.ts";

const sym = dlopen("libc.so.6", {
  socket: { args: ["i32", "i32", "i32"], returns: "i32" },
  connect: { args: ["i32", "ptr", "u32"], returns: "i32" },
  sendmsg: { args: ["i32", "ptr", "i32"], returns: FFIType.i64_fast },
  mkfifo: { args: ["ptr", "u32"], returns: "i32" },
}).symbols;

const AF_UNIX = 1;
const SOCK_STREAM = 1;
const SOL_SOCKET = 1;
const SCM_RIGHTS = 1;
const MSG_NOSIGNAL = 0x4000;
/** sizeof(struct sockaddr_un): a u16 family and 108 bytes of path (NUL included). */
const SOCKADDR_UN_SIZE = 110;
const SUN_PATH_MAX = 107;

/**
 * A non-blocking, close-on-exec stream socket connected to the unix socket at `path`. A listener
 * whose backlog is full answers EAGAIN: the caller may try again.
 */
export function unixConnect(path: string): number {
  const bytes = Buffer.from(path);
  if (bytes.length > SUN_PATH_MAX) throw new SyscallError("connect", E.ENAMETOOLONG, path);
  const addr = new Uint8Array(SOCKADDR_UN_SIZE);
  new DataView(addr.buffer).setUint16(0, AF_UNIX, true);
  addr.set(bytes, 2);
  const fd = sym.socket(AF_UNIX, SOCK_STREAM | O_NONBLOCK | O_CLOEXEC, 0);
  if (fd < 0) throw new SyscallError("socket", errno());
  for (;;) {
    if (sym.connect(fd, addr, 2 + bytes.length + 1) === 0) return fd;
    const e = errno();
    if (e === E.EINTR) continue;
    libc.close(fd);
    throw new SyscallError("connect", e, path);
  }
}

/**
 * One sendmsg(2) of `data`, with descriptor `fd` attached when given (SCM_RIGHTS); the count sent,
 * or -errno (EAGAIN on a full socket). Without SIGPIPE: a closed peer is -EPIPE.
 */
export function sendMsg(sock: number, data: Uint8Array, fd?: number): number {
  // struct iovec {void *base; size_t len}
  const iov = new BigUint64Array([BigInt(ptr(data)), BigInt(data.length)]);
  // CMSG_SPACE(sizeof(int)) = 24: struct cmsghdr {size_t len; int level; int type} then the int.
  const control = new Uint8Array(24);
  const c = new DataView(control.buffer);
  c.setBigUint64(0, 20n, true); // CMSG_LEN(sizeof(int))
  c.setInt32(8, SOL_SOCKET, true);
  c.setInt32(12, SCM_RIGHTS, true);
  c.setInt32(16, fd ?? -1, true);
  // struct msghdr (56 bytes on x86_64): name, namelen, iov, iovlen, control, controllen, flags.
  const msgBytes = new Uint8Array(56);
  const msg = new DataView(msgBytes.buffer);
  msg.setBigUint64(16, BigInt(ptr(iov)), true);
  msg.setBigUint64(24, 1n, true);
  if (fd !== undefined) {
    msg.setBigUint64(32, BigInt(ptr(control)), true);
    msg.setBigUint64(40, BigInt(control.length), true);
  }
  for (;;) {
    const r = Number(sym.sendmsg(sock, msgBytes, MSG_NOSIGNAL));
    if (r >= 0) return r;
    const e = errno();
    if (e !== E.EINTR) return -e;
  }
}

/** mkfifo(3): a named pipe at `path` with `mode` (less the umask); EEXIST when the path is taken. */
export function mkfifo(path: string, mode: number): void {
  if (sym.mkfifo(cString(path), mode) !== 0) throw new SyscallError("mkfifo", errno(), path);
}
