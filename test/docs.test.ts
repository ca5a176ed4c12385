// The project stands alone: a clone has only its own files, so nothing in it cites documents that
// live outside it, and every path README.md and docs/*.md point at exists.
import { describe, expect, test } from "bun:test";
import { existsSync, readdirSync, readFileSync, statSync } from "node:fs";
import { dirname, join, relative, resolve } from "node:path";

const root = resolve(import.meta.dir, "..");
const self = relative(root, import.meta.path);

/** The project's files: tracked and untracked-but-not-ignored (git), else every file outside dot folders and node_modules. */
function projectFiles(): string[] {
  const git = Bun.spawnSync(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], { cwd: root, stdout: "pipe", stderr: "pipe" });
  if (git.exitCode === 0) return git.stdout.toString().split("\0").filter((f) => f !== "" && existsSync(join(root, f)));
  const out: string[] = [];
  const walk = (dir: string) => {
    for (const name of readdirSync(join(root, dir))) {
      if (name.startsWith(".") || name === "node_modules") continue;
      const p = dir ? `${dir}/${name}` : name;
      if (statSync(join(root, p)).isDirectory()) walk(p);
      else out.push(p);
    }
  };
  walk("");
  return out;
}

// Documents that are not in the repository, and section numbers of them.
const OUTSIDE = [
  /\.\.\/shared\b/,
  /\bshared\/docs\b/,
  /\bDESIGN\b/,
  /\breference\/[\w-]+\.md\b/,
  /\breference §/,
  /\bkernel-and-vmm\b/,
  /\boverlaybd-format\b/,
  /\bbun-measurements\b/,
  /\bvm-measurements\b/,
  /\be2b-protocol\b/,
  /\bagentenv\.md\b/,
  /§\s*\d/,
];

/** README.md, docs/*.md and the guest's READMEs: the pages a user reads. */
const pages = ["README.md", ...readdirSync(join(root, "docs")).filter((f) => f.endsWith(".md")).map((f) => `docs/${f}`), "guest/README.md", "guest/envd/README.md"];

/** Folders a path in backquotes starts with when it names a file of the project. */
const TOP = /^(?:docs|src|test|guest|bench|ffi|p2p|templates|\.ci)\//;

describe("the project stands alone", () => {
  test("no file cites a document outside the repository", () => {
    const files = projectFiles();
    expect(files.length).toBeGreaterThan(100);
    const found: string[] = [];
    for (const f of files) {
      if (f === self) continue;
      const text = readFileSync(join(root, f)).subarray(0, 1 << 20).toString("utf8");
      text.split("\n").forEach((line, i) => {
        for (const re of OUTSIDE) if (re.test(line)) found.push(`${f}:${i + 1}: ${line.trim().slice(0, 160)}`);
      });
    }
    expect(found).toEqual([]);
  });

  const ignoredByGit = (path: string) => Bun.spawnSync(["git", "check-ignore", "-q", "--no-index", path], { cwd: root }).exitCode === 0;

  test("every relative link and every project path in README.md and docs/*.md exists", () => {
    const missing: string[] = [];
    let checked = 0;
    for (const page of pages) {
      const text = readFileSync(join(root, page), "utf8");
      // Markdown links, relative to the page.
      for (const m of text.matchAll(/\]\(([^)\s]+)\)/g)) {
        const target = m[1]!;
        if (/^[a-z][a-z0-9+.-]*:/i.test(target) || target.startsWith("#")) continue;
        checked++;
        const path = resolve(dirname(join(root, page)), target.replace(/#.*$/, ""));
        if (!existsSync(path)) missing.push(`${page}: link ${target}`);
      }
      // Paths in backquotes, from the repository root; patterns and placeholders are not paths.
      for (const m of text.matchAll(/`([^`\s]+)`/g)) {
        const p = m[1]!;
        if (!TOP.test(p) || /[*<>{}$|]/.test(p)) continue;
        checked++;
        const path = p.replace(/[:#].*$/, "");
        // A build output git ignores (guest/.cache/) is made by the first run, not cloned.
        if (!existsSync(join(root, path)) && !ignoredByGit(path)) missing.push(`${page}: ${p}`);
      }
    }
    expect(checked).toBeGreaterThan(100);
    expect(missing).toEqual([]);
  });

  test("the patterns catch what they are for", () => {
    const hits = (s: string) => OUTSIDE.some((re) => re.test(s));
    // Samples made of parts, so this file holds no such citation itself.
    const up = "..";
    for (const s of [`see ${up}/shared/docs/x`, ["DESIGN", "md §3"].join("."), ["overlaybd", "format.md"].join("-"), "reference §4.7", "(§11.2)", ["agentenv", "md"].join(".")]) expect(hits(s), s).toBe(true);
    for (const s of ["docs/formats.md, LSMT header", "src/template/registry/reference.ts", "a shared filesystem"]) expect(hits(s), s).toBe(false);
  });
});
