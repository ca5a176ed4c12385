// Fixture for memory_layer.test.ts: a process that maps `image` copy-on-write (MAP_PRIVATE, as a
// VMM maps a memory image) with as many bytes of PROT_NONE after it (nothing there can be read),
// writes the pages the test names, prints the mapping's address and then waits to be killed. Page p written gets u32 p+1 at byte 0 and 0xdeadbeef at byte 100;
// a page in `zero` is written with zeros (dirtied, yet all zero).
//   bun private_mapping.ts <image> <bytes> <first:count,...> <zero page,...>
import { toArrayBuffer, type Pointer } from "bun:ffi";
import { MAP_ANONYMOUS, MAP_FIXED, MAP_NORESERVE, MAP_PRIVATE, O_CLOEXEC, O_RDONLY, PROT_NONE, PROT_READ, PROT_WRITE, close, mmap, open } from "../../ffi/libc.ts";

const [image, bytesArg, runsArg, zeroArg] = process.argv.slice(2);
const bytes = Number(bytesArg);
const fd = open(image!, O_RDONLY | O_CLOEXEC);
const reserved = mmap(0, 2 * bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
const address = mmap(reserved, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_FIXED, fd, 0);
close(fd);
const mem = new DataView(toArrayBuffer(address as unknown as Pointer, 0, bytes));
const zero = new Set((zeroArg ?? "").split(",").filter(Boolean).map(Number));
for (const run of runsArg!.split(",")) {
  const [first, count] = run.split(":").map(Number) as [number, number];
  for (let p = first; p < first + count; p++) {
    if (zero.has(p)) for (let i = 0; i < 4096; i += 4) mem.setUint32(p * 4096 + i, 0, true);
    else {
      mem.setUint32(p * 4096, p + 1, true);
      mem.setUint32(p * 4096 + 100, 0xdeadbeef, true);
    }
  }
}
console.log(address);
setInterval(() => {}, 1 << 30);
