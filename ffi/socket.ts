// Socket options through bun:ffi that Bun's socket API does not offer.

import { dlopen, ptr } from "bun:ffi";
import { SyscallError, errno } from "./libc.ts";

const { getsockopt } = dlopen("libc.so.6", {
  getsockopt: { args: ["i32", "i32", "i32", "ptr", "ptr"], returns: "i32" },
}).symbols;

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
