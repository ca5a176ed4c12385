// A small, strict argument parser for aenv: unknown options are errors, not ignored.

/** The command line is wrong: exit 2, with `usage` (the verb's, or the verb list) after the message. */
export class UsageError extends Error {
  override name = "UsageError";
  constructor(
    message: string,
    public usage = "",
  ) {
    super(message);
  }
}

/** `-h` or `--help` before any `--`. */
export function asksForHelp(argv: string[]): boolean {
  for (const a of argv) {
    if (a === "--") return false;
    if (a === "-h" || a === "--help") return true;
  }
  return false;
}

export interface ParsedArgs {
  rest: string[];
  flag(name: string): boolean;
  value(name: string): string | undefined;
  need(n: number, what: string): string[];
  between(min: number, max: number, what: string): string[];
  atLeast(n: number, what: string): string[];
}

export function parseArgs(argv: string[], spec: { flags?: string[]; values?: string[] }): ParsedArgs {
  const flags = new Set<string>();
  const values = new Map<string, string>();
  const rest: string[] = [];
  for (let i = 0; i < argv.length; i++) {
    const a = argv[i]!;
    if (a === "--") {
      rest.push(...argv.slice(i + 1));
      break;
    }
    if (!a.startsWith("-") || a === "-") {
      rest.push(a);
      continue;
    }
    let name = a.replace(/^--?/, "");
    let inline: string | undefined;
    const eq = name.indexOf("=");
    if (eq >= 0) {
      inline = name.slice(eq + 1);
      name = name.slice(0, eq);
    }
    if (spec.flags?.includes(name) && inline === undefined) flags.add(name);
    else if (spec.values?.includes(name)) {
      const v = inline ?? argv[++i];
      if (v === undefined) throw new UsageError(`option --${name} needs a value`);
      values.set(name, v);
    } else throw new UsageError(`unknown option ${a}`);
  }
  const count = (min: number, max: number, what: string) => {
    if (rest.length < min || rest.length > max) throw new UsageError(`expected ${what}, got ${rest.length} operand(s)`);
    return rest;
  };
  return {
    rest,
    flag: (n) => flags.has(n),
    value: (n) => values.get(n),
    need: (n, what) => count(n, n, what),
    between: (min, max, what) => count(min, max, what),
    atLeast: (n, what) => count(n, Infinity, what),
  };
}

/** A byte count: decimal, or with a K/M/G/T suffix (powers of 1024). */
export function parseSize(v: string | undefined, what: string, zeroOk = false): number {
  if (v === undefined) throw new UsageError(`${what} is required`);
  const m = /^(\d+)([KMGT]?)i?B?$/i.exec(v);
  if (!m) throw new UsageError(`${what} ${JSON.stringify(v)} is not a size`);
  const n = Number(m[1]) * 1024 ** " KMGT".indexOf((m[2] || " ").toUpperCase());
  if (!Number.isSafeInteger(n) || (!zeroOk && n === 0)) throw new UsageError(`${what} ${v} is out of range`);
  return n;
}
