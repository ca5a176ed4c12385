// Bounded waits shared by the drivers: a promise with a deadline, and connecting to a VMM's unix
// socket that exists before it accepts (QEMU and Firecracker bind, then listen a moment later).

import { VmmError } from "./types.ts";

/** p, or a Timeout error after ms; the timer never outlives the race. */
export async function withTimeout<T>(p: Promise<T>, ms: number, what: string): Promise<T> {
  let timer: ReturnType<typeof setTimeout> | undefined;
  try {
    return await Promise.race([p, new Promise<never>((_, reject) => (timer = setTimeout(() => reject(new VmmError("Timeout", what)), ms)))]);
  } finally {
    clearTimeout(timer);
  }
}

/** A connect that failed before anything was sent: bound but not listening (ECONNREFUSED), or the file being replaced (ENOENT). */
function notListeningYet(e: unknown): boolean {
  const code = (e as { code?: unknown } | null)?.code;
  return code === "ECONNREFUSED" || code === "ENOENT";
}

/** First pause between connect attempts; it doubles up to the last. */
const CONNECT_PAUSE_MS = [5, 100] as const;

/**
 * `attempt` (a connect, or a request whose connect may be refused) again while it fails because
 * the socket does not accept yet, until `deadline` (epoch ms): then Timeout naming `what`. Safe for
 * any request: a refused connect sent nothing. Other errors are thrown at once.
 */
export async function retryUntilListening<T>(attempt: () => Promise<T>, deadline: number, what: string): Promise<T> {
  for (let pause: number = CONNECT_PAUSE_MS[0]; ; pause = Math.min(CONNECT_PAUSE_MS[1], pause * 2)) {
    try {
      return await attempt();
    } catch (e) {
      if (!notListeningYet(e)) throw e;
      if (Date.now() + pause > deadline) throw new VmmError("Timeout", `${what}: socket not accepting connections (${(e as { code: string }).code})`);
      await Bun.sleep(pause);
    }
  }
}
