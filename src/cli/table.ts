// Listings of aenv: a table for a person at a terminal, JSON for a program (stdout piped, or --json).

import type { Option } from "./verbs.ts";

export const JSON_OPTION: Option = { flag: "--json", help: "JSON even on a terminal (the default when stdout is not one)" };

export interface Column<T> {
  header: string;
  cell(row: T): string;
}

/** `items` as JSON (an array, the fields as `json` shapes them) or as a table of `columns`. */
export function printListing<T>(items: T[], columns: Column<T>[], o: { json: boolean; toJson?: (row: T) => unknown; empty: string }): void {
  if (o.json || !process.stdout.isTTY) {
    process.stdout.write(JSON.stringify(items.map(o.toJson ?? ((x) => x)), null, 2) + "\n");
    return;
  }
  if (items.length === 0) {
    process.stderr.write(`${o.empty}\n`);
    return;
  }
  const cells = items.map((row) => columns.map((c) => c.cell(row)));
  const widths = columns.map((c, i) => Math.max(c.header.length, ...cells.map((r) => r[i]!.length)));
  const line = (r: string[]) => r.map((v, i) => (i === r.length - 1 ? v : v.padEnd(widths[i]!))).join("  ").trimEnd();
  process.stdout.write([line(columns.map((c) => c.header)), ...cells.map(line)].join("\n") + "\n");
}

/** A time as a person reads it in a table: local date and time to the second. */
export function when(d: Date | string | undefined): string {
  if (d === undefined) return "-";
  const t = typeof d === "string" ? new Date(d) : d;
  if (Number.isNaN(t.getTime())) return "-";
  const p = (n: number) => String(n).padStart(2, "0");
  return `${t.getFullYear()}-${p(t.getMonth() + 1)}-${p(t.getDate())} ${p(t.getHours())}:${p(t.getMinutes())}:${p(t.getSeconds())}`;
}
