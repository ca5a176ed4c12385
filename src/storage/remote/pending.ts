// Remote work in flight in this thread: chunk fetches until they land in the cache, and whole-layer
// downloads with their promotion. That work completes on the event loop (fetch, timers,
// node:fs/promises), not on the thread's io_uring, so a thread that blocks in its own wait
// (blockd's device workers: poll or io_uring_enter) must keep the event loop turning while this is
// above 0: it waits at most PENDING_WAIT_MS at a time then.

/** The longest a serve loop blocks while remote work is in flight. */
export const PENDING_WAIT_MS = 1;

let pending = 0;

export function remoteWorkPending(): number {
  return pending;
}

/** Counts `p` as remote work until it settles; returns it. */
export function trackRemote<T>(p: Promise<T>): Promise<T> {
  pending++;
  const done = () => {
    pending--;
  };
  p.then(done, done);
  return p;
}
