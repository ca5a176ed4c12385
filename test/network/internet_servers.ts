// The test "internet"'s servers, run inside its namespace:
//   bun internet_servers.ts '{"ips":[...],"zone":{name:[ip]},"cert":path,"key":path}'
// On every ip: HTTP :80 and TLS :443 answering "<host header>@<local ip>" (GET /bytes?n=N: N bytes;
// POST /echo: the body streamed back;
// GET /auth: the SHA-256 of the Authorization header and the X-Extra header, as JSON), a TCP echo
// on :7. On ips[0]: a DNS server on :53 (udp) answering A records from `zone`. On ips[3]: an
// upstream egress proxy on :1080 speaking SOCKS5 (no auth or RFC 1929) and HTTP CONNECT; each
// tunnel it opens is printed as `proxied {"kind","target","user","pass"}`.
// Prints "listening" once all serve.
import { createHash } from "node:crypto";
import { encodeAnswer, parseQuestion } from "../../src/network/dns.ts";

const cfg = JSON.parse(process.argv[2]!) as { ips: string[]; zone: Record<string, string[]>; cert: string; key: string };
const tls = { cert: Bun.file(cfg.cert), key: Bun.file(cfg.key) };
const blob = new Uint8Array(64 << 20).fill(120);

function handler(ip: string) {
  return (req: Request) => {
    const url = new URL(req.url);
    if (url.pathname === "/bytes") return new Response(blob.subarray(0, Math.min(blob.length, Number(url.searchParams.get("n") ?? 0))));
    if (url.pathname === "/echo") return new Response(req.body);
    if (url.pathname === "/auth") {
      const auth = req.headers.get("authorization");
      return Response.json({ auth: auth === null ? null : createHash("sha256").update(auth).digest("hex"), extra: req.headers.get("x-extra") });
    }
    return new Response(`${req.headers.get("host")}@${ip}`);
  };
}

for (const ip of cfg.ips) {
  Bun.serve({ hostname: ip, port: 80, fetch: handler(ip) });
  Bun.serve({ hostname: ip, port: 443, tls, fetch: handler(ip) });
  Bun.listen({ hostname: ip, port: 7, socket: { data: (s, d) => void s.write(d) } });
}
/** The upstream proxy: one tunnel per connection, the handshake parsed from the first bytes. */
interface Tun { buf: Buffer; phase: "greet" | "auth" | "req" | "http" | "open"; user?: string; pass?: string; kind?: string; peer?: Bun.Socket<undefined> }
Bun.listen<Tun>({
  hostname: cfg.ips[3],
  port: 1080,
  socket: {
    open: (s) => void (s.data = { buf: Buffer.alloc(0), phase: "greet" }),
    data: async (s, d) => {
      const t = s.data;
      if (t.phase === "open") return void t.peer?.write(d);
      t.buf = Buffer.concat([t.buf, Buffer.from(d)]);
      const b = t.buf;
      const tunnel = async (host: string, port: number, ok: Buffer, rest: Buffer) => {
        const ip = /^\d+\.\d+\.\d+\.\d+$/.test(host) ? host : cfg.zone[host]?.[0];
        console.log(`proxied ${JSON.stringify({ kind: t.kind, target: `${host}:${port}`, user: t.user, pass: t.pass })}`);
        if (!ip) return void s.end(t.kind === "http" ? "HTTP/1.1 502 Bad Gateway\r\n\r\n" : Buffer.from([5, 4, 0, 1, 0, 0, 0, 0, 0, 0]));
        t.phase = "open";
        t.peer = await Bun.connect({ hostname: ip, port, socket: { data: (_p, x) => void s.write(x), close: () => void s.end(), error: () => void s.end() } });
        s.write(ok);
        if (rest.length) t.peer.write(rest);
      };
      if (t.phase === "greet") {
        if (b[0] !== 5) t.phase = "http";
        else {
          if (b.length < 2 || b.length < 2 + b[1]!) return;
          const methods = [...b.subarray(2, 2 + b[1]!)];
          t.kind = "socks5";
          t.buf = b.subarray(2 + b[1]!);
          t.phase = methods.includes(2) ? "auth" : "req";
          return void s.write(Buffer.from([5, methods.includes(2) ? 2 : 0]));
        }
      }
      if (t.phase === "auth") {
        if (b.length < 2 || b.length < 3 + b[1]! || b.length < 3 + b[1]! + b[2 + b[1]!]!) return;
        t.user = b.subarray(2, 2 + b[1]!).toString();
        t.pass = b.subarray(3 + b[1]!, 3 + b[1]! + b[2 + b[1]!]!).toString();
        t.buf = b.subarray(3 + b[1]! + b[2 + b[1]!]!);
        t.phase = "req";
        return void s.write(Buffer.from([1, 0]));
      }
      if (t.phase === "req") {
        if (b.length < 5) return;
        const alen = b[3] === 1 ? 4 : 1 + b[4]!;
        if (b.length < 4 + alen + 2) return;
        const host = b[3] === 1 ? [...b.subarray(4, 8)].join(".") : b.subarray(5, 5 + b[4]!).toString();
        const port = b.readUInt16BE(4 + alen);
        return tunnel(host, port, Buffer.from([5, 0, 0, 1, 0, 0, 0, 0, 0, 0]), b.subarray(4 + alen + 2));
      }
      if (t.phase === "http") {
        const end = b.indexOf("\r\n\r\n");
        if (end < 0) return;
        t.kind = "http";
        const head = b.subarray(0, end).toString();
        const m = /^CONNECT ([^ :]+):(\d+) /.exec(head);
        const basic = /\r\nproxy-authorization: basic (\S+)/i.exec(head)?.[1];
        if (basic) [t.user, t.pass] = Buffer.from(basic, "base64").toString().split(":");
        if (!m) return void s.end("HTTP/1.1 405 Method Not Allowed\r\n\r\n");
        return tunnel(m[1]!, Number(m[2]), Buffer.from("HTTP/1.1 200 Connection established\r\n\r\n"), b.subarray(end + 4));
      }
    },
    close: (s) => void s.data.peer?.end(),
  },
});

await Bun.udpSocket({
  hostname: cfg.ips[0],
  port: 53,
  socket: {
    data(s, buf, port, addr) {
      try {
        const q = parseQuestion(Buffer.from(buf));
        s.send(encodeAnswer(Buffer.from(buf), cfg.zone[q.name] ?? []), port, addr);
      } catch {}
    },
  },
});
console.log("listening");
