#!/usr/bin/env bun
// aenv: the project's command. Help goes to stdout (exit 0); errors print as "aenv: Name: message"
// to stderr with exit 1, or 2 for usage errors, which are followed by the usage that applies.

import { layerCommand, layerVerbList } from "./layer.ts";
import { UsageError } from "./args.ts";

const COMMANDS: Record<string, (args: string[]) => Promise<void>> = { layer: layerCommand };

function help(): string {
  return `usage: aenv COMMAND ...\n\ncommands:\n${layerVerbList()}\n\n  aenv help [layer [VERB]] | aenv COMMAND [VERB] --help\n  aenv --version\n`;
}

async function version(): Promise<string> {
  const pkg = await Bun.file(new URL("../../package.json", import.meta.url)).json();
  return `aenv ${pkg.version}\n`;
}

async function main(argv: string[]): Promise<number> {
  const [cmd, ...rest] = argv;
  try {
    if (cmd === "--version") {
      process.stdout.write(await version());
      return 0;
    }
    if (cmd === "--help" || cmd === "-h" || (cmd === "help" && rest.length === 0)) {
      process.stdout.write(help());
      return 0;
    }
    if (cmd === "help") return main([rest[0]!, "help", ...rest.slice(1)]);
    if (cmd === undefined) throw new UsageError("aenv needs a command", help());
    const fn = Object.hasOwn(COMMANDS, cmd) ? COMMANDS[cmd] : undefined;
    if (!fn) throw new UsageError(`unknown command "${cmd}"`, help());
    await fn(rest);
    return 0;
  } catch (e) {
    const err = e as Error;
    process.stderr.write(`aenv: ${err.name}: ${err.message}\n`);
    if (e instanceof UsageError && e.usage) process.stderr.write(`\n${e.usage.trimEnd()}\n`);
    return e instanceof UsageError ? 2 : 1;
  }
}

process.exitCode = await main(process.argv.slice(2));
