// Fixture: PASSES sequential passes of CHUNK-sized writes over the first BYTES of a device file,
// fsync after each, printing "pass N" once pass N is durable. Any error: "error CODE", exit 1.
import { closeSync, fsyncSync, openSync, writeSync } from "node:fs";
import { CHUNK, chunkPattern } from "./patterns.ts";

const [path, bytesArg, passesArg] = process.argv.slice(2);
const chunks = Number(bytesArg) / CHUNK;
try {
  const fd = openSync(path!, "r+");
  for (let pass = 0; pass < Number(passesArg); pass++) {
    for (let c = 0; c < chunks; c++) writeSync(fd, chunkPattern(pass, c), 0, CHUNK, c * CHUNK);
    fsyncSync(fd);
    process.stdout.write(`pass ${pass}\n`);
  }
  closeSync(fd);
} catch (e) {
  process.stdout.write(`error ${(e as NodeJS.ErrnoException).code ?? (e as Error).message}\n`);
  process.exit(1);
}
