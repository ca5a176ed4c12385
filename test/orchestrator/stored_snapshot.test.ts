// A stored snapshot's record comes from whoever writes the store: its layer counts must be whole
// numbers in bounds, each index naming a file the store holds (or a remote layer), before the
// orchestrator builds a stack of them.
import { expect, test } from "bun:test";
import { storedCount } from "../../src/orchestrator/snapshots.ts";

test("a count past the bound, negative, fractional or not a number is refused; so is one naming a file the store lacks", () => {
  const all = () => true;
  for (const n of [1e9, -1, 1.5, "3", null, Number.NaN]) expect(() => storedCount(n, "layers", all, "s1")).toThrow(/is not a count/);
  expect(() => storedCount(3, "layers", (i) => i < 2, "s1")).toThrow(/names layers 2, which the store does not hold/);
  expect(storedCount(2, "layers", (i) => i < 2, "s1")).toBe(2);
  expect(storedCount(0, "memLayers", () => false, "s1")).toBe(0);
});
