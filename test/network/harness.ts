// Helpers for the network tests: a per-run prefix and CIDR (so concurrent runs do not collide),
// a census of namespaces / links / nft tables for leak checks, a fake guest (169.254.0.21 on the
// namespace's loopback with a Bun HTTP server) and a TCP reachability probe run inside a namespace.

import { existsSync, readdirSync } from "node:fs";
import { join } from "node:path";
import { haveTool, netnsExecArgv, type Slot } from "../../src/network/index.ts";

export const canRun =
  process.getuid?.() === 0 && existsSync("/dev/net/tun") && ["ip", "nft", "sysctl", "conntrack"].every((t) => haveTool(t as "ip"));

const tag = (process.pid % 46656).toString(36).padStart(3, "0");
/** Only this run's names start with it; 7 bytes leave 8 for slot numbers and decoys. */
export const PREFIX = `aet${tag}-`;
export const HOST_TABLE = `aenv_test_${tag}`;
/** A /24 per run inside 10.213/16, picked by pid so two runs on one host rarely meet. */
export const HOST_CIDR = `10.213.${process.pid % 250}.0/24`;
export const GUEST_PORT = 18080;

export function testPoolOptions(extra: Record<string, unknown> = {}) {
  return { prefix: PREFIX, hostCidr: HOST_CIDR, hostTable: HOST_TABLE, ...extra };
}

export interface Census {
  netns: string[];
  links: string[];
  tables: string[];
}

/** Everything on the host a leak could show up in, not only names with our prefix. */
export function census(): Census {
  const netns = existsSync("/run/netns") ? readdirSync("/run/netns").sort() : [];
  const links = readdirSync("/sys/class/net").sort();
  const out = Bun.spawnSync(["nft", "list", "tables"], { stdout: "pipe", stderr: "pipe" });
  const tables = out.stdout.toString().split("\n").filter(Boolean).sort();
  return { netns, links, tables };
}

export function sh(argv: string[], stdin?: string): { code: number; out: string; err: string } {
  const p = Bun.spawnSync(argv, { stdin: stdin === undefined ? "ignore" : Buffer.from(stdin), stdout: "pipe", stderr: "pipe" });
  return { code: p.exitCode ?? -1, out: p.stdout.toString(), err: p.stderr.toString() };
}

/** Stand in for a VM: the guest address on the namespace's loopback and an HTTP server on it. */
export async function startFakeGuest(slot: Slot, body: string): Promise<Bun.Subprocess> {
  const add = sh(["ip", "-n", slot.netns, "address", "add", `${slot.guestIp}/32`, "dev", "lo"]);
  if (add.code !== 0 && !/File exists|already assigned/.test(add.err)) throw new Error(`address add: ${add.err}`);
  const code = `Bun.serve({ hostname: ${JSON.stringify(slot.guestIp)}, port: ${GUEST_PORT}, fetch: () => new Response(${JSON.stringify(body)}) }); console.log("listening");`;
  const proc = Bun.spawn(netnsExecArgv(slot, [process.execPath, "-e", code]), { stdout: "pipe", stderr: "inherit" });
  const reader = proc.stdout.getReader();
  const deadline = Date.now() + 15_000;
  let seen = "";
  while (!seen.includes("listening")) {
    if (Date.now() > deadline) throw new Error(`fake guest in ${slot.netns} did not start`);
    const { value, done } = await reader.read();
    if (done) throw new Error(`fake guest in ${slot.netns} exited: ${proc.exitCode}`);
    seen += new TextDecoder().decode(value);
  }
  reader.releaseLock();
  return proc;
}

export type ProbeOutcome = "connected" | "refused" | "timeout" | string;
export interface ProbeTarget {
  host: string;
  port: number;
  localAddress?: string;
}

/** TCP connect attempts from inside a namespace (or from the host when netns is undefined). */
export function probe(netns: string | undefined, targets: ProbeTarget[], timeoutMs = 1500): ProbeOutcome[] {
  const argv = [process.execPath, join(import.meta.dir, "probe.ts"), String(timeoutMs), JSON.stringify(targets)];
  const full = netns ? netnsExecArgv({ netns }, argv) : argv;
  const r = sh(full);
  if (r.code !== 0) throw new Error(`probe failed (${r.code}): ${r.err}`);
  return JSON.parse(r.out) as ProbeOutcome[];
}

export function hostCounter(name: string): number {
  const r = sh(["nft", "-j", "list", "counter", "inet", HOST_TABLE, name]);
  if (r.code !== 0) throw new Error(r.err);
  const doc = JSON.parse(r.out) as { nftables: { counter?: { packets: number } }[] };
  return doc.nftables.find((e) => e.counter)!.counter!.packets;
}

/** Remove anything with this run's prefix and table (the last line of defence after a failure). */
export function sweep(): void {
  for (const l of readdirSync("/sys/class/net")) if (l.startsWith(PREFIX)) sh(["ip", "link", "delete", l]);
  if (existsSync("/run/netns")) for (const n of readdirSync("/run/netns")) if (n.startsWith(PREFIX)) sh(["ip", "netns", "delete", n]);
  sh(["nft", "delete", "table", "inet", HOST_TABLE]);
}
