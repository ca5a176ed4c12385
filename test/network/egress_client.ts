// What a guest does in the egress tests, run inside the fake guest's namespace:
//   bun egress_client.ts '[{op,...}, ...]'   → one outcome per action, as a JSON array.
// ops: tcp {ip,port} → "connected" | "refused" | "timeout" | "reset" | code
//      http {ip,port,host?,path?,headers?} → the response body, or an error word
//      https {ip,port,servername,path?,headers?,ca?} → the response body (the certificate checked
//            against `ca` when given, else not checked), or an error word
//      raw {ip,port,chunks:[base64],gapMs} → everything answered, as text ("" when closed silently)
//      dns {server,name} → the A records, or "timeout" / an error code
import net from "node:net";
import tls from "node:tls";
import { encodeQuery, parseAnswer } from "../../src/network/dns.ts";

type Action =
  | { op: "tcp"; ip: string; port: number }
  | { op: "http"; ip: string; port: number; host?: string; path?: string; headers?: Record<string, string> }
  | { op: "https"; ip: string; port: number; servername: string; path?: string; headers?: Record<string, string>; ca?: string }
  | { op: "raw"; ip: string; port: number; chunks: string[]; gapMs?: number }
  | { op: "dns"; server: string; name: string };

const TIMEOUT_MS = 4000;

function errorWord(e: NodeJS.ErrnoException): string {
  if (!e) return "error";
  if (e.code === "ECONNREFUSED") return "refused";
  if (e.code === "ECONNRESET" || e.code === "EPIPE") return "reset";
  return e.code ?? e.message;
}

/** Sends `chunks` over `sock` once connected and collects everything until it closes. */
function exchange(sock: net.Socket, chunks: Buffer[], gapMs: number, connectEvent: string): Promise<string> {
  return new Promise((resolve) => {
    let got = "";
    const timer = setTimeout(() => {
      sock.destroy();
      resolve(got ? got : "timeout");
    }, TIMEOUT_MS);
    sock.once(connectEvent, async () => {
      for (const c of chunks) {
        sock.write(c);
        if (gapMs) await Bun.sleep(gapMs);
      }
    });
    sock.on("data", (d) => (got += d.toString()));
    sock.once("error", (e: NodeJS.ErrnoException) => {
      clearTimeout(timer);
      resolve(got ? got : errorWord(e));
    });
    sock.once("close", () => {
      clearTimeout(timer);
      resolve(got);
    });
  });
}

const extra = (h: Record<string, string> = {}) => Object.entries(h).map(([k, v]) => `${k}: ${v}\r\n`).join("");

function body(response: string): string {
  if (!response.startsWith("HTTP/")) return response === "" ? "closed" : response;
  const [head, rest] = response.split("\r\n\r\n", 2);
  const status = head!.split(" ")[1];
  return status === "200" ? rest ?? "" : `status ${status}`;
}

async function one(a: Action): Promise<unknown> {
  switch (a.op) {
    case "tcp":
      return new Promise((resolve) => {
        const sock = net.connect({ host: a.ip, port: a.port });
        const timer = setTimeout(() => (sock.destroy(), resolve("timeout")), TIMEOUT_MS);
        sock.once("connect", () => (clearTimeout(timer), sock.destroy(), resolve("connected")));
        sock.once("error", (e) => (clearTimeout(timer), resolve(errorWord(e))));
      });
    case "http": {
      const host = a.host === undefined ? "" : `Host: ${a.host}\r\n`;
      const req = Buffer.from(`GET ${a.path ?? "/"} HTTP/1.1\r\n${host}${extra(a.headers)}Connection: close\r\n\r\n`);
      return body(await exchange(net.connect({ host: a.ip, port: a.port }), [req], 0, "connect"));
    }
    case "https": {
      const req = Buffer.from(`GET ${a.path ?? "/"} HTTP/1.1\r\nHost: ${a.servername}\r\n${extra(a.headers)}Connection: close\r\n\r\n`);
      const sock = tls.connect({ host: a.ip, port: a.port, servername: a.servername, ...(a.ca ? { ca: a.ca } : { rejectUnauthorized: false }) });
      return body(await exchange(sock, [req], 0, "secureConnect"));
    }
    case "raw":
      return exchange(net.connect({ host: a.ip, port: a.port }), a.chunks.map((c) => Buffer.from(c, "base64")), a.gapMs ?? 0, "connect");
    case "dns": {
      const id = 4242;
      return new Promise(async (resolve) => {
        const timer = setTimeout(() => (s.close(), resolve("timeout")), TIMEOUT_MS);
        const s = await Bun.udpSocket({
          socket: {
            data(_s, buf) {
              clearTimeout(timer);
              s.close();
              resolve(parseAnswer(Buffer.from(buf), id));
            },
            error(e: unknown) {
              clearTimeout(timer);
              s.close();
              resolve(e instanceof Error ? errorWord(e as NodeJS.ErrnoException) : "error");
            },
          },
        });
        s.send(encodeQuery(id, a.name), 53, a.server);
      });
    }
  }
}

const actions = JSON.parse(process.argv[2]!) as Action[];
console.log(JSON.stringify(await Promise.all(actions.map(one))));
