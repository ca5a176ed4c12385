// Where the node's registry requests may go (src/storage/remote/destination.ts): internal
// addresses told apart, insecure hosts matched by host or host:port, and blockd's range reads
// following a redirect only within the blob URL's origin or to https at a public address.
import { describe, expect, test } from "bun:test";
import { networkInterfaces } from "node:os";
import { destinationRefusal, InsecureHosts, internalKind, normalizeIp } from "../../src/storage/remote/destination.ts";
import { RegistryRangeSource } from "../../src/storage/remote/http_source.ts";
import { SourceError } from "../../src/storage/remote/source.ts";

const DIGEST = `sha256:${"ab".repeat(32)}` as const;

describe("destinations", () => {
  test("loopback, link-local, unspecified and this machine's addresses are internal; others are not", () => {
    const kinds: [string, string | undefined][] = [
      ["127.0.0.1", "loopback"], ["127.8.9.10", "loopback"], ["::1", "loopback"], ["[::1]", "loopback"], ["::ffff:127.0.0.1", "loopback"], ["::ffff:7f00:1", "loopback"],
      ["169.254.169.254", "link-local"], ["fe80::1", "link-local"], ["febf::1", "link-local"], ["fe80::1%eth0", "link-local"],
      ["0.0.0.0", "unspecified"], ["::", "unspecified"],
      ["8.8.8.8", undefined], ["10.0.0.1", undefined], ["2001:db8::1", undefined], ["fec0::1", undefined], ["169.255.0.1", undefined],
    ];
    for (const [ip, kind] of kinds) expect({ ip, kind: internalKind(ip, new Set()) }).toEqual({ ip, kind: kind as never });
    expect(internalKind("192.0.2.7", new Set(["192.0.2.7"]))).toBe("this machine's");
    const own = Object.values(networkInterfaces()).flat().find((a) => a && !a.internal)?.address;
    if (own) expect(internalKind(own)).toBe(internalKind(own, new Set()) ?? "this machine's");
    expect(normalizeIp("::FFFF:7F00:1")).toBe("127.0.0.1");
  });

  test("insecure hosts: host:port is that port only; a host alone is any port", () => {
    const listed = new InsecureHosts(["127.0.0.1:5000", "reg.example.com", "[::1]:5001"]);
    expect(listed.hasHostPort("127.0.0.1:5000")).toBe(true);
    expect(listed.hasHostPort("127.0.0.1:5001")).toBe(false);
    expect(listed.hasHostPort("REG.example.com:8443")).toBe(true);
    expect(listed.hasHostPort("[::1]:5001")).toBe(true);
    expect(listed.has(new URL("https://reg.example.com/v2/"))).toBe(true);
    expect(listed.has(new URL("http://127.0.0.1:5000/x"))).toBe(true);
    expect(new InsecureHosts(["reg.example.com:443"]).has(new URL("https://reg.example.com/x"))).toBe(true);
  });

  test("an unlisted destination must be https and not internal; a listed one may be anything", async () => {
    const none = new InsecureHosts();
    expect(await destinationRefusal(new URL("http://192.0.2.1/x"), none)).toContain("plain http");
    expect(await destinationRefusal(new URL("https://127.0.0.1:9/x"), none)).toContain("a loopback address (127.0.0.1)");
    expect(await destinationRefusal(new URL("https://localhost/x"), none)).toContain("a loopback address");
    expect(await destinationRefusal(new URL("https://169.254.169.254/"), none)).toContain("a link-local address");
    expect(await destinationRefusal(new URL("https://[fe80::1]/"), none)).toContain("a link-local address");
    expect(await destinationRefusal(new URL("https://192.0.2.1/x"), none)).toBeUndefined();
    expect(await destinationRefusal(new URL("http://127.0.0.1:9/x"), new InsecureHosts(["127.0.0.1:9"]))).toBeUndefined();
  });
});

describe("blockd's range reads and redirects", () => {
  /** A loopback server: `/v2/x/blobs/<digest>` answers `answer`; it records each request's path and Authorization. */
  function server(answer: (req: Request) => Response) {
    const seen: { path: string; auth: string | null }[] = [];
    const s = Bun.serve({
      hostname: "127.0.0.1",
      port: 0,
      fetch(req) {
        seen.push({ path: new URL(req.url).pathname, auth: req.headers.get("authorization") });
        return answer(req);
      },
    });
    return { base: `http://127.0.0.1:${s.port}`, seen, stop: () => s.stop(true) };
  }
  const ranged = () => new Response("abcd", { status: 206, headers: { "content-range": "bytes 0-3/4" } });
  const abort = new AbortController().signal;

  test("a redirect to another loopback port is refused (not retried) and never followed", async () => {
    const target = server(ranged);
    const origin = server(() => new Response(null, { status: 307, headers: { location: `${target.base}/cdn` } }));
    try {
      const src = new RegistryRangeSource({ url: `${origin.base}/v2/x/blobs/${DIGEST}`, headers: () => ({ authorization: "Bearer secret" }) });
      const e = await src.read(DIGEST, 0, 4, abort).then(() => undefined, (x: unknown) => x);
      expect(e).toBeInstanceOf(SourceError);
      expect((e as SourceError).retryable).toBe(false);
      expect((e as SourceError).message).toContain(`redirect to ${target.base} refused`);
      expect(target.seen).toEqual([]);
    } finally {
      origin.stop();
      target.stop();
    }
  });

  test("a redirect within the blob URL's origin is followed with its headers; more than 5 hops is refused", async () => {
    const origin = server((req) => (new URL(req.url).pathname.startsWith("/v2/") ? new Response(null, { status: 302, headers: { location: "/moved" } }) : ranged()));
    const loop = server(() => new Response(null, { status: 307, headers: { location: "/again" } }));
    try {
      const src = new RegistryRangeSource({ url: `${origin.base}/v2/x/blobs/${DIGEST}`, headers: () => ({ authorization: "Bearer secret" }) });
      expect(new TextDecoder().decode(await src.read(DIGEST, 0, 4, abort))).toBe("abcd");
      expect(origin.seen).toEqual([{ path: `/v2/x/blobs/${DIGEST}`, auth: "Bearer secret" }, { path: "/moved", auth: "Bearer secret" }]);
      const e = await new RegistryRangeSource({ url: `${loop.base}/v2/x/blobs/${DIGEST}` }).read(DIGEST, 0, 4, abort).then(() => undefined, (x: unknown) => x);
      expect((e as SourceError).message).toContain("redirected 6 times");
      expect(loop.seen.length).toBe(6);
    } finally {
      origin.stop();
      loop.stop();
    }
  });
});
