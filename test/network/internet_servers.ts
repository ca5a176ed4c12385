// The test "internet"'s servers, run inside its namespace:
//   bun internet_servers.ts '{"ips":[...],"zone":{name:[ip]},"cert":path,"key":path}'
// On every ip: HTTP :80 and TLS :443 answering "<host header>@<local ip>" (GET /bytes?n=N: N bytes),
// a TCP echo on :7. On ips[0]: a DNS server on :53 (udp) answering A records from `zone`.
// Prints "listening" once all serve.
import { encodeAnswer, parseQuestion } from "../../src/network/dns.ts";

const cfg = JSON.parse(process.argv[2]!) as { ips: string[]; zone: Record<string, string[]>; cert: string; key: string };
const tls = { cert: Bun.file(cfg.cert), key: Bun.file(cfg.key) };
const blob = new Uint8Array(64 << 20).fill(120);

function handler(ip: string) {
  return (req: Request) => {
    const url = new URL(req.url);
    if (url.pathname === "/bytes") return new Response(blob.subarray(0, Math.min(blob.length, Number(url.searchParams.get("n") ?? 0))));
    return new Response(`${req.headers.get("host")}@${ip}`);
  };
}

for (const ip of cfg.ips) {
  Bun.serve({ hostname: ip, port: 80, fetch: handler(ip) });
  Bun.serve({ hostname: ip, port: 443, tls, fetch: handler(ip) });
  Bun.listen({ hostname: ip, port: 7, socket: { data: (s, d) => void s.write(d) } });
}
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
