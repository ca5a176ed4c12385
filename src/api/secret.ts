// Comparing a secret a client presents (API key, traffic token, upload signature) with the node's:
// in constant time over equal lengths, so the answer's timing tells nothing of the content.
import { timingSafeEqual } from "node:crypto";

/** Whether `given` is `want`; a different length is false at once (the length alone is not secret). */
export function secretMatches(given: string | null | undefined, want: string): boolean {
  if (given === null || given === undefined) return false;
  const a = Buffer.from(given);
  const b = Buffer.from(want);
  return a.length === b.length && timingSafeEqual(a, b);
}
