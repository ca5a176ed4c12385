// Bun runs TypeScript without checking its types: this is where type errors fail the build.
import { expect, test } from "bun:test";
import { join } from "node:path";

test("the tree type-checks under tsc --strict (tsconfig.json)", () => {
  const root = join(import.meta.dir, "..");
  const r = Bun.spawnSync([join(root, "node_modules/.bin/tsc"), "-p", root], { cwd: root, stdout: "pipe", stderr: "pipe" });
  expect(r.stdout.toString() + r.stderr.toString()).toBe("");
  expect(r.exitCode).toBe(0);
}, 120_000);
