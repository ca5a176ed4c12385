// A unix socket that is bound at once but listened on only when told, as a VMM's API socket is
// between bind() and listen(): `bun bound_socket.ts PATH`. Prints "bound"; on a line "listen" from
// stdin it listens, prints "listening", then answers each HTTP request with 204 and prints
// "<METHOD> <path> <body>" for it. Blocking calls throughout: this process does nothing else.
import { ptr } from "bun:ffi";
import { errno, libc, strerror } from "../../ffi/libc.ts";

const SYS_SOCKET = 41;
const SYS_BIND = 49;
const SYS_LISTEN = 50;
const SYS_ACCEPT4 = 288;
const AF_UNIX = 1;
const SOCK_STREAM = 1;

/** Straight to fd 1: the event loop never runs here to flush a buffered console. */
function say(line: string): void {
  const b = new TextEncoder().encode(line + "\n");
  libc.write(1, ptr(b), b.length);
}

function check(what: string, r: number | bigint): number {
  if (Number(r) < 0) {
    console.error(`${what}: ${strerror(errno())}`);
    process.exit(1);
  }
  return Number(r);
}

const path = process.argv[2]!;
const fd = check("socket", libc.syscall(SYS_SOCKET, AF_UNIX, SOCK_STREAM, 0, 0, 0, 0));
const addr = new Uint8Array(110); // struct sockaddr_un: sa_family_t + char sun_path[108]
new DataView(addr.buffer).setUint16(0, AF_UNIX, true);
addr.set(new TextEncoder().encode(path), 2);
check("bind", libc.syscall(SYS_BIND, fd, Number(ptr(addr)), addr.length, 0, 0, 0));
say("bound");

const one = new Uint8Array(1);
let input = "";
while (!input.includes("listen\n")) {
  if (Number(libc.read(0, ptr(one), 1)) !== 1) process.exit(0);
  input += String.fromCharCode(one[0]!);
}
check("listen", libc.syscall(SYS_LISTEN, fd, 16, 0, 0, 0, 0));
say("listening");

const buf = new Uint8Array(65536);
const reply = new TextEncoder().encode("HTTP/1.1 204 No Content\r\nConnection: close\r\n\r\n");
for (;;) {
  const conn = check("accept", libc.syscall(SYS_ACCEPT4, fd, 0, 0, 0, 0, 0));
  let req = "";
  for (;;) {
    const n = Number(libc.read(conn, ptr(buf), buf.length));
    if (n <= 0) break;
    req += new TextDecoder().decode(buf.subarray(0, n));
    const end = req.indexOf("\r\n\r\n");
    if (end < 0) continue;
    const length = Number(/content-length:\s*(\d+)/i.exec(req)?.[1] ?? 0);
    if (req.length >= end + 4 + length) break;
  }
  const [head = "", body = ""] = req.split("\r\n\r\n");
  const [method, target] = head.split(" ");
  say(`${method} ${target} ${body}`);
  libc.write(conn, ptr(reply), reply.length);
  libc.close(conn);
}
