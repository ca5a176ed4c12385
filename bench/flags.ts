// Command-line flags of the benches: `--name N` a positive integer, else the default; anything else stops the bench.
export function intFlag(argv: readonly string[], name: string, dflt: number): number {
  const i = argv.indexOf(name);
  const v = i >= 0 ? Number(argv[i + 1]) : dflt;
  if (!Number.isInteger(v) || v < 1) throw new Error(`${name}: expected a positive integer`);
  return v;
}
