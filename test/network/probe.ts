// Reachability probe for the network tests: `bun probe.ts TIMEOUT_MS '[{host,port,localAddress?}]'`
// prints one outcome per target (connected / refused / timeout / error code) as a JSON array.
import net from "node:net";

const timeoutMs = Number(process.argv[2]);
const targets = JSON.parse(process.argv[3]!) as { host: string; port: number; localAddress?: string }[];

function attempt(t: { host: string; port: number; localAddress?: string }): Promise<string> {
  return new Promise((resolve) => {
    const sock = net.connect({ host: t.host, port: t.port, localAddress: t.localAddress });
    const timer = setTimeout(() => {
      sock.destroy();
      resolve("timeout");
    }, timeoutMs);
    sock.once("connect", () => {
      clearTimeout(timer);
      sock.destroy();
      resolve("connected");
    });
    sock.once("error", (e: NodeJS.ErrnoException) => {
      clearTimeout(timer);
      resolve(e.code === "ECONNREFUSED" ? "refused" : (e.code ?? e.message));
    });
  });
}

console.log(JSON.stringify(await Promise.all(targets.map(attempt))));
