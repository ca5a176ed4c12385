// An HTTP origin for remote-layer tests: serves one blob by Range on loopback, counts requests
// and bytes, and misbehaves on demand (404, 500, never answering, wrong bytes, short answers).
//
//   const o = startBlobOrigin(bytes);           // o.url(digest), o.requests, o.bytesSent, o.stop()
//   o.fault = "corrupt";                        // from now on every answer has one byte flipped
//   o.hold = (start) => start < 8 << 20;        // ranges starting below 8 MiB wait for o.releaseHeld()
import { sha256 } from "../helpers/tmp.ts";

export type OriginFault = "none" | "404" | "500" | "hang" | "corrupt" | "short";

export interface BlobOrigin {
  digest: `sha256:${string}`;
  url: string;
  fault: OriginFault;
  /** Delay before each answer (ms). */
  delayMs: number;
  requests: number;
  bytesSent: number;
  /** Requests per "start-end" range. */
  ranges: Map<string, number>;
  /** Ranged requests it matches wait, unanswered, until releaseHeld(); none while undefined. */
  hold: ((start: number, end: number) => boolean) | undefined;
  /** Requests waiting on `hold` now. */
  held: number;
  /** Answers every held request (hold itself stays as set). */
  releaseHeld(): void;
  stop(): void;
}

export function startBlobOrigin(bytes: Uint8Array): BlobOrigin {
  const digest = `sha256:${sha256(bytes)}` as const;
  const hangs: (() => void)[] = [];
  const holds: (() => void)[] = [];
  const o: BlobOrigin = {
    digest,
    url: "",
    fault: "none",
    delayMs: 0,
    requests: 0,
    bytesSent: 0,
    ranges: new Map(),
    hold: undefined,
    held: 0,
    releaseHeld: () => {
      for (const h of holds.splice(0)) h();
    },
    stop: () => {
      for (const h of hangs) h();
      o.releaseHeld();
      server.stop(true);
    },
  };
  const server = Bun.serve({
    hostname: "127.0.0.1",
    port: 0,
    idleTimeout: 0,
    async fetch(req) {
      o.requests++;
      if (o.delayMs) await Bun.sleep(o.delayMs);
      if (o.fault === "404") return new Response("no such blob", { status: 404 });
      if (o.fault === "500") return new Response("broken", { status: 500 });
      if (o.fault === "hang") await new Promise<void>((r) => hangs.push(r));
      const m = /^bytes=(\d+)-(\d+)$/.exec(req.headers.get("range") ?? "");
      if (!m) return new Response(bytes);
      const start = Number(m[1]);
      const end = Math.min(Number(m[2]), bytes.length - 1);
      if (o.hold?.(start, end)) {
        o.held++;
        await new Promise<void>((r) => holds.push(r));
        o.held--;
      }
      o.ranges.set(`${start}-${end}`, (o.ranges.get(`${start}-${end}`) ?? 0) + 1);
      let body = bytes.slice(start, end + 1);
      if (o.fault === "corrupt") body[body.length >> 1]! ^= 0xff;
      const header = `bytes ${start}-${end}/${bytes.length}`;
      if (o.fault === "short") body = body.subarray(0, body.length >> 1);
      o.bytesSent += body.length;
      return new Response(body, { status: 206, headers: { "content-range": header } });
    },
  });
  o.url = `http://127.0.0.1:${server.port}/v2/test/blobs/${digest}`;
  return o;
}
