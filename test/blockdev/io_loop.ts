// Fixture: holds a device open (O_DIRECT: every read reaches the device, none is served from the
// page cache) and reads 4 KiB from it over and over, printing "ok N" every 64 reads, until a read
// fails ("error CODE", exit 0) or SECONDS pass ("still reading", exit 2).
import { O_CLOEXEC, O_DIRECT, O_RDONLY, allocAligned, open, pread, type SyscallError } from "../../ffi/libc.ts";

const [path, secondsArg] = process.argv.slice(2);
const until = Date.now() + Number(secondsArg ?? 120) * 1000;
const buf = allocAligned(4096);
try {
  const fd = open(path!, O_RDONLY | O_DIRECT | O_CLOEXEC);
  for (let n = 1; Date.now() < until; n++) {
    pread(fd, buf.bytes, (n % 64) * 4096);
    if (n % 64 === 0) process.stdout.write(`ok ${n}\n`);
  }
  process.stdout.write("still reading\n");
  process.exit(2);
} catch (e) {
  process.stdout.write(`error ${(e as SyscallError).code ?? (e as Error).message}\n`);
}
