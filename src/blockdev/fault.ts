// Fault injection for tests: AENV_BLOCKD_FAULT names one crash or hang for a blockd thread to act
// out, the way a bug in that thread would end or stall it (process.exit in a Worker ends only that
// thread). Test-only, not a node setting; a value that names no fault here is ignored.
//   worker-exit:<device id>:<control op>  the device's worker ends when it is asked for <op>
//   worker-hang:<device id>:<op>          the device's worker stops answering anything (its thread
//                                         blocked) when asked for <op>, or once mounted for "start"
//   reader-exit:<n>                       a FUSE reader ends after taking its n-th request, before handing it on

/** The argument of fault `kind` ("worker-exit", "worker-hang", "reader-exit") when AENV_BLOCKD_FAULT arms it. */
export function faultArg(kind: string): string | undefined {
  const v = process.env.AENV_BLOCKD_FAULT;
  return v?.startsWith(`${kind}:`) ? v.slice(kind.length + 1) : undefined;
}

/** End the calling Worker thread at once, as a crash would: no finally, no message to its parent. */
export function crashThread(why: string): never {
  console.error(`blockd fault injected: ${why}`);
  process.exit(70);
}

/** Block the calling Worker thread for good, as a deadlock or a stuck call would: only terminate() ends it. */
export function hangThread(why: string): never {
  console.error(`blockd fault injected: ${why} hangs`);
  const never = new Int32Array(new SharedArrayBuffer(4));
  for (;;) Atomics.wait(never, 0, 0);
}
