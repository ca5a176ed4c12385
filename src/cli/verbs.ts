// The verb tables of aenv's node commands: each verb states its operands, options and summary once;
// its help, its usage errors and the parsing of its arguments all come from that one entry.

import { UsageError, asksForHelp, parseArgs, type ParsedArgs } from "./args.ts";

export interface Option {
  /** As typed: "--timeout", "-n". */
  flag: string;
  /** Placeholder of the option's value; absent for a switch. */
  value?: string;
  required?: boolean;
  /** Taken by every verb of a family (--url, --api-key): in the verb's help, not in verb lists. */
  common?: boolean;
  help: string;
}

export interface Verb {
  operands: string;
  summary: string;
  options: Option[];
  /** Lines after the options in `--help` (examples, what the output is). */
  notes?: string;
  /** The exit code; nothing means 0. */
  run(a: ParsedArgs): Promise<number | void>;
}

/** A command of aenv: a function of its arguments that returns the exit code. */
export type Command = (args: string[]) => Promise<number | void>;

const optionText = (o: Option) => (o.value ? `${o.flag} ${o.value}` : o.flag);
const optionUsage = (o: Option) => (o.required ? optionText(o) : `[${optionText(o)}]`);
const synopsis = (name: string, v: Verb, all = true) =>
  ["aenv", name, ...v.options.filter((o) => all || !o.common).map(optionUsage), v.operands].filter(Boolean).join(" ");
const HELP_OPTION: Option = { flag: "-h, --help", help: "this help" };

/** `name` (e.g. "snapshot create") with its synopsis and summary: one entry of a verb list. */
export function verbLine(name: string, v: Verb): string {
  return `  ${synopsis(name, v, false)}\n      ${v.summary}`;
}

export function verbHelp(name: string, v: Verb): string {
  const options = [...v.options, HELP_OPTION];
  const width = Math.max(...options.map((o) => optionText(o).length));
  return [
    `usage: ${synopsis(name, v)}`,
    "",
    `${v.summary[0]!.toUpperCase()}${v.summary.slice(1)}.`,
    "",
    "options:",
    ...options.map((o) => `  ${optionText(o).padEnd(width)}  ${o.help}${o.required ? " (required)" : ""}`),
    ...(v.notes ? ["", v.notes.trimEnd()] : []),
    "",
  ].join("\n");
}

/** `aenv NAME …`: `--help` prints the verb's help; a usage error carries it. */
export function verbCommand(name: string, v: Verb): Command {
  return async (args) => {
    if (asksForHelp(args)) {
      process.stdout.write(verbHelp(name, v));
      return 0;
    }
    const bare = (o: Option) => o.flag.replace(/^--?/, "");
    try {
      const parsed = parseArgs(args, { flags: v.options.filter((o) => !o.value).map(bare), values: v.options.filter((o) => o.value).map(bare) });
      for (const o of v.options) if (o.required && parsed.value(bare(o)) === undefined) throw new UsageError(`${o.flag} is required`);
      return await v.run(parsed);
    } catch (e) {
      if (e instanceof UsageError && !e.usage) e.usage = verbHelp(name, v);
      throw e;
    }
  };
}

/** `aenv GROUP VERB …` (template, snapshot): the group's verb list on `aenv GROUP` or `--help`. */
export function groupCommand(group: string, verbs: Record<string, Verb>): Command {
  const list = () => Object.entries(verbs).map(([n, v]) => verbLine(`${group} ${n}`, v)).join("\n");
  return async (args) => {
    const [verb, ...rest] = args;
    if (verb === undefined) throw new UsageError(`aenv ${group} needs a verb`, list());
    if (verb === "help" || verb === "-h" || verb === "--help") {
      const name = rest[0];
      if (name === undefined) process.stdout.write(`usage: aenv ${group} VERB ...\n\n${list()}\n`);
      else if (Object.hasOwn(verbs, name)) process.stdout.write(verbHelp(`${group} ${name}`, verbs[name]!));
      else throw new UsageError(`unknown verb "${group} ${name}"`, list());
      return 0;
    }
    const v = Object.hasOwn(verbs, verb) ? verbs[verb] : undefined;
    if (!v) throw new UsageError(`unknown verb "${group} ${verb}"`, list());
    return verbCommand(`${group} ${verb}`, v)(rest);
  };
}

/** A whole number of seconds, or N in `-n N`: a usage error otherwise. */
export function wholeNumber(raw: string | undefined, what: string, min: number, max: number): number | undefined {
  if (raw === undefined) return undefined;
  const n = Number(raw);
  if (!/^\d+$/.test(raw) || !Number.isSafeInteger(n) || n < min || n > max) throw new UsageError(`${what} ${JSON.stringify(raw)}: expected a whole number in ${min}..${max}`);
  return n;
}
