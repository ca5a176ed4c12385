#!/usr/bin/env bun
// aenv: the project's command. Help goes to stdout (exit 0); errors print as "aenv: Name: message"
// to stderr with exit 1, or 2 for usage errors, which are followed by the usage that applies.
// `aenv exec` exits with its command's code.

import { layerCommand, layerVerbList } from "./layer.ts";
import { UsageError } from "./args.ts";
import { AUTH_VERB } from "./auth.ts";
import { CP_VERB } from "./files.ts";
import { NODE_GROUP_VERBS } from "./nodes.ts";
import { SANDBOX_VERBS, SNAPSHOT_VERBS } from "./sandbox.ts";
import { BUILD_VERBS, TEMPLATE_VERBS } from "./template.ts";
import { groupCommand, verbCommand, verbLine, type Command, type Verb } from "./verbs.ts";

/** The verbs that talk to a node, in the order the help lists them. */
const NODE_VERBS: Record<string, Verb> = { auth: AUTH_VERB, ...BUILD_VERBS, ...SANDBOX_VERBS, cp: CP_VERB };
const GROUPS: Record<string, Record<string, Verb>> = { template: TEMPLATE_VERBS, snapshot: SNAPSHOT_VERBS, node: NODE_GROUP_VERBS };

const COMMANDS: Record<string, Command> = {
  layer: layerCommand,
  ...Object.fromEntries(Object.entries(NODE_VERBS).map(([n, v]) => [n, verbCommand(n, v)])),
  ...Object.fromEntries(Object.entries(GROUPS).map(([g, vs]) => [g, groupCommand(g, vs)])),
};

function help(): string {
  const node = [
    ...Object.entries(NODE_VERBS).map(([n, v]) => verbLine(n, v)),
    ...Object.entries(GROUPS).flatMap(([g, vs]) => Object.entries(vs).map(([n, v]) => verbLine(`${g} ${n}`, v))),
  ].join("\n");
  return [
    "usage: aenv COMMAND ...",
    "",
    "sandboxes and templates on a node; every verb takes [--url URL] [--api-key KEY] (docs/cli.md):",
    node,
    "",
    "overlaybd layers on local files:",
    layerVerbList(),
    "",
    "  aenv help COMMAND [VERB] | aenv COMMAND [VERB] --help",
    "  aenv --version",
    "",
  ].join("\n");
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
    if (cmd === "help") return main([rest[0]!, "--help", ...rest.slice(1)]);
    if (cmd === undefined) throw new UsageError("aenv needs a command", help());
    const fn = Object.hasOwn(COMMANDS, cmd) ? COMMANDS[cmd] : undefined;
    if (!fn) throw new UsageError(`unknown command "${cmd}"`, help());
    return (await fn(rest)) ?? 0;
  } catch (e) {
    const err = e as Error;
    process.stderr.write(`aenv: ${err.name}: ${err.message}\n`);
    if (e instanceof UsageError && e.usage) process.stderr.write(`\n${e.usage.trimEnd()}\n`);
    return e instanceof UsageError ? 2 : 1;
  }
}

process.exitCode = await main(process.argv.slice(2));
