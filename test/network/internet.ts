// A test "internet": a namespace of this run joined to the host by a veth pair of its own
// (aei<tag>-up ↔ eth0) on a /24 of the benchmark range 198.18.0.0/15 picked by pid, holding HTTP,
// TLS, TCP echo and DNS servers (internet_servers.ts) on four addresses. Slots reach it as egress
// leaves a slot: through the host's routing over this veth (forwarding switched on for it only)
// and the host table's masquerade. The host's own routes, eth0 and default route are never touched.
import { readFileSync, rmSync } from "node:fs";
import { join } from "node:path";
import { netnsExecArgv } from "../../src/network/index.ts";
import { scratchDir } from "../helpers/tmp.ts";
import { PREFIX, eventually, must, sh } from "./harness.ts";

/** Not under PREFIX: the slot scaffold sweeps PREFIX names after every test, this outlives them. */
const NAME = PREFIX.replace(/^aet/, "aei");

/** Names in the TLS certificate; several on one address, "two.test" on two. */
export const TLS_NAMES = ["a.test", "b.test", "x.a.test", "two.test", "liar.test", "c.other.test"];

export interface TestInternet {
  netns: string;
  /** The host end of the veth: the slots' uplink. */
  uplink: string;
  hostIp: string;
  /** Server addresses: ips[0] also serves DNS. */
  ips: string[];
  /** An address inside 100.64.0.0/10 (an always-denied range) that also serves, via the same veth. */
  internalIp: string;
  zone: Record<string, string[]>;
  /** The TLS servers' (self-signed) certificate. */
  certPem: string;
  /** ips[3]:1080, the upstream egress proxy (SOCKS5 and HTTP CONNECT). */
  proxyAddress: string;
  /** The tunnels that proxy opened so far, in order. */
  proxied(): { kind: string; target: string; user?: string; pass?: string }[];
  stop(): Promise<void>;
}

export async function startInternet(): Promise<TestInternet> {
  const net = `198.18.${process.pid % 250}`;
  const internal = `100.127.${process.pid % 250}`;
  for (const r of [net, internal]) {
    if (sh(["ip", "-4", "route", "show", "to", "match", `${r}.1`]).out.split("\n").some((l) => l && !l.startsWith("default"))) {
      throw new Error(`${r}.0/24 is already routed on this host; pick another run`);
    }
  }
  const netns = `${NAME}net`;
  const uplink = `${NAME}up`;
  const ips = [2, 3, 4, 5].map((i) => `${net}.${i}`);
  const internalIp = `${internal}.2`;
  const zone: Record<string, string[]> = {
    "a.test": [ips[0]!],
    "b.test": [ips[0]!],
    "x.a.test": [ips[0]!],
    "two.test": [ips[0]!, ips[1]!],
    "liar.test": [ips[2]!],
    "c.other.test": [ips[3]!],
    "inside.test": [internalIp],
  };
  must(["ip", "netns", "add", netns]);
  must(["ip", "link", "add", uplink, "type", "veth", "peer", "name", "eth0", "netns", netns]);
  must(["ip", "-batch", "-"], [`address add ${net}.1/24 dev ${uplink}`, `address add ${internal}.1/30 dev ${uplink}`, `link set ${uplink} up`].join("\n"));
  must(["ip", "-n", netns, "-batch", "-"], [
    `link set lo up`,
    ...ips.map((ip) => `address add ${ip}/24 dev eth0`),
    `address add ${internalIp}/30 dev eth0`,
    `link set eth0 up`,
  ].join("\n"));
  const dir = scratchDir("internet", { keep: true }); // removed by stop(): benchmarks run it outside bun test
  const cert = join(dir, "cert.pem");
  const key = join(dir, "key.pem");
  must(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=a.test", "-keyout", key, "-out", cert,
    "-addext", `subjectAltName=${TLS_NAMES.map((n) => `DNS:${n}`).join(",")}`]);
  const proc = Bun.spawn(netnsExecArgv({ netns }, [process.execPath, join(import.meta.dir, "internet_servers.ts"), JSON.stringify({ ips: [...ips, internalIp], zone, cert, key })]), {
    stdout: "pipe",
    stderr: "inherit",
  });
  let out = "";
  void (async () => {
    for await (const c of proc.stdout) out += new TextDecoder().decode(c);
  })();
  await eventually(() => out.includes("listening") || proc.exitCode !== null, "test internet servers start");
  if (!out.includes("listening")) throw new Error(`test internet servers exited ${proc.exitCode}`);
  return {
    netns, uplink, hostIp: `${net}.1`, ips, internalIp, zone, certPem: readFileSync(cert, "utf8"), proxyAddress: `${ips[3]}:1080`,
    proxied: () => [...out.matchAll(/^proxied (.*)$/gm)].map((m) => JSON.parse(m[1]!)),
    async stop() {
      proc.kill(9);
      await proc.exited;
      sh(["ip", "link", "delete", uplink]);
      sh(["ip", "netns", "delete", netns]);
      rmSync(dir, { recursive: true, force: true });
    },
  };
}

/** Runs egress_client.ts actions inside `netns` (the fake guest's) and returns their outcomes. */
export async function fromGuest(netns: string, actions: Record<string, unknown>[]): Promise<unknown[]> {
  const p = Bun.spawn(netnsExecArgv({ netns }, [process.execPath, join(import.meta.dir, "egress_client.ts"), JSON.stringify(actions)]), { stdout: "pipe", stderr: "pipe" });
  const [out, err, code] = await Promise.all([new Response(p.stdout).text(), new Response(p.stderr).text(), p.exited]);
  if (code !== 0) throw new Error(`egress client exited ${code}: ${err}`);
  return JSON.parse(out) as unknown[];
}
