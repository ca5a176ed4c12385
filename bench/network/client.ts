// The benchmark's client, run inside the fake guest's namespace:
//   bun client.ts '{"ip","port","host","tls":bool,"n":N,"bytes":B}'
// bytes 0: N sequential connections, each one GET / (connect to the body's last byte; the client
// closes, so a server's close never races the last bytes);
// prints {"p50","p90"} in ms. bytes > 0: N sequential downloads of B bytes (GET /bytes?n=B); prints
// {"mbps"} (MB/s, the median). Certificates are not checked (the test internet's are self-signed).
import net from "node:net";
import tls from "node:tls";

const o = JSON.parse(process.argv[2]!) as { ip: string; port: number; host: string; tls: boolean; n: number; bytes: number };
const TIMEOUT_MS = 60_000;

function once(path: string): Promise<{ ms: number; bytes: number }> {
  return new Promise((resolve, reject) => {
    const t0 = performance.now();
    let bytes = 0;
    let head = Buffer.alloc(0);
    let want = -1;
    const sock = o.tls
      ? tls.connect({ host: o.ip, port: o.port, servername: o.host, rejectUnauthorized: false })
      : net.connect({ host: o.ip, port: o.port });
    const timer = setTimeout(() => (sock.destroy(), reject(new Error("timeout"))), TIMEOUT_MS);
    sock.once(o.tls ? "secureConnect" : "connect", () => sock.write(`GET ${path} HTTP/1.1\r\nHost: ${o.host}\r\n\r\n`));
    sock.on("data", (d: Buffer) => {
      if (want < 0) {
        head = Buffer.concat([head, d]);
        const end = head.indexOf("\r\n\r\n");
        if (end < 0) return;
        want = Number(/\r\ncontent-length: (\d+)/i.exec(head.subarray(0, end).toString())?.[1] ?? 0);
        d = head.subarray(end + 4);
      }
      bytes += d.length;
      if (bytes >= want) {
        clearTimeout(timer);
        resolve({ ms: performance.now() - t0, bytes });
        sock.destroy();
      }
    });
    sock.once("error", (e) => (clearTimeout(timer), reject(e)));
    sock.once("close", () => (clearTimeout(timer), reject(new Error(`closed after ${bytes} of ${want} bytes`))));
  });
}

const runs: { ms: number; bytes: number }[] = [];
for (let i = 0; i < o.n; i++) runs.push(await once(o.bytes ? `/bytes?n=${o.bytes}` : "/"));
const q = (xs: number[], p: number) => xs.sort((a, b) => a - b)[Math.min(xs.length - 1, Math.floor(xs.length * p))]!;
if (o.bytes) {
  if (runs.some((r) => r.bytes < o.bytes)) throw new Error(`short download: ${runs.map((r) => r.bytes).join(", ")}`);
  console.log(JSON.stringify({ mbps: q(runs.map((r) => r.bytes / 1e6 / (r.ms / 1000)), 0.5) }));
} else {
  const ms = runs.map((r) => r.ms);
  console.log(JSON.stringify({ p50: q(ms, 0.5), p90: q(ms, 0.9) }));
}
