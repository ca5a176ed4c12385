#!/usr/bin/env bun
// aenv: the project's command. Errors print as "aenv: Name: message" with exit 1 (2 for usage).

import { layerCommand } from "./layer.ts";
import { UsageError } from "./args.ts";

const COMMANDS: Record<string, (args: string[]) => Promise<void>> = { layer: layerCommand };

async function main(argv: string[]): Promise<number> {
  const [cmd, ...rest] = argv;
  const fn = cmd ? COMMANDS[cmd] : undefined;
  try {
    if (!fn) throw new UsageError(`usage: aenv <${Object.keys(COMMANDS).join("|")}> ...`);
    await fn(rest);
    return 0;
  } catch (e) {
    const err = e as Error;
    process.stderr.write(`aenv: ${err.name}: ${err.message}\n`);
    return e instanceof UsageError ? 2 : 1;
  }
}

process.exitCode = await main(process.argv.slice(2));
