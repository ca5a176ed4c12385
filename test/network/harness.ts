// Helpers for the network tests: a per-run prefix and CIDR (so concurrent runs do not collide),
// a census of namespaces / links / nft tables for leak checks, a fake guest and a TCP
// reachability probe run inside a namespace.
//
// The fake guest stands in for a VM with a kernel of its own: a namespace of its own joined to the
// slot by a veth whose slot end takes the TAP's place (same name, address and MAC), so its traffic
// crosses the slot's rules exactly as a VM's does (a TAP with no reader carries nothing).

import { afterAll, afterEach, beforeEach, expect } from "bun:test";
import { existsSync, readdirSync } from "node:fs";
import { join } from "node:path";
import { DEFAULT_ALWAYS_DENIED, Egress, GATEWAY_IP, GATEWAY_MAC, GUEST_PREFIX_LEN, PolicyError, SlotPool, haveTool, netnsExecArgv, type EgressProxy, type Slot } from "../../src/network/index.ts";

export const canRun =
  process.getuid?.() === 0 && existsSync("/dev/net/tun") && ["ip", "nft", "sysctl", "conntrack"].every((t) => haveTool(t as "ip"));
/** A suite's name, with why it is skipped where it cannot run. */
export const slotSuite = (name: string) => (canRun ? name : `${name} (skipped: needs root, /dev/net/tun, ip, nft, sysctl and conntrack)`);

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

/**
 * What a leak of this run could show up as: namespaces and links with our prefix, interface names a
 * slot uses inside its namespace (found on the host if a move failed), our host table. Other runs
 * and other suites create namespaces and tables on this host at the same time, so not theirs.
 */
export function census(): Census {
  const ours = (n: string) => n.startsWith(PREFIX);
  const netns = existsSync("/run/netns") ? readdirSync("/run/netns").filter(ours).sort() : [];
  const links = readdirSync("/sys/class/net").filter((l) => ours(l) || ["vpeer", "tap0"].includes(l)).sort();
  const out = Bun.spawnSync(["nft", "list", "tables"], { stdout: "pipe", stderr: "pipe" });
  const tables = out.stdout.toString().split("\n").filter((t) => t.endsWith(` ${HOST_TABLE}`)).sort();
  return { netns, links, tables };
}

export function sh(argv: string[], stdin?: string): { code: number; out: string; err: string } {
  const p = Bun.spawnSync(argv, { stdin: stdin === undefined ? "ignore" : Buffer.from(stdin), stdout: "pipe", stderr: "pipe" });
  return { code: p.exitCode ?? -1, out: p.stdout.toString(), err: p.stderr.toString() };
}

/** sh that must succeed. */
export function must(argv: string[], stdin?: string): string {
  const r = sh(argv, stdin);
  if (r.code !== 0) throw new Error(`${argv.join(" ")} exited ${r.code}: ${r.err}`);
  return r.out;
}

/** Polls cond until it holds; the deadline is generous, the machine is shared and loaded. */
export async function eventually(cond: () => boolean | Promise<boolean>, what: string, ms = 20_000): Promise<void> {
  const end = Date.now() + ms;
  while (!(await cond())) {
    if (Date.now() > end) throw new Error(`${what}: not within ${ms} ms`);
    await Bun.sleep(20);
  }
}

export interface FakeGuest {
  /** The guest's own namespace. */
  netns: string;
  proc: Bun.Subprocess<"ignore", "pipe", "inherit">;
  /** Everything the guest process printed so far. */
  output(): string;
}

let guestCount = 0;

/**
 * A stand-in VM in its own namespace behind the slot's TAP name, running `code` (Bun) that prints
 * "listening" once it serves. Undo with vanishGuest.
 */
export async function startGuest(slot: Slot, code: string): Promise<FakeGuest> {
  const netns = `${PREFIX}g${guestCount++}`;
  must(["ip", "netns", "add", netns]);
  must(["ip", "-n", slot.netns, "link", "delete", slot.tap]);
  must(["ip", "-n", slot.netns, "link", "add", slot.tap, "type", "veth", "peer", "name", "eth0", "netns", netns]);
  must(["ip", "-n", slot.netns, "-batch", "-"], [
    `link set ${slot.tap} address ${GATEWAY_MAC}`,
    `address add ${GATEWAY_IP}/${GUEST_PREFIX_LEN} dev ${slot.tap}`,
    `link set ${slot.tap} up`,
  ].join("\n"));
  must(["ip", "-n", netns, "-batch", "-"], [
    `link set lo up`,
    `link set eth0 address ${slot.guestMac}`,
    `address add ${slot.guestIp}/${slot.guestPrefixLen} dev eth0`,
    `link set eth0 up`,
    `route add default via ${slot.gatewayIp}`,
  ].join("\n"));
  const proc = Bun.spawn(netnsExecArgv({ netns }, [process.execPath, "-e", code]), { stdin: "ignore", stdout: "pipe", stderr: "inherit" });
  let out = "";
  void (async () => {
    const decoder = new TextDecoder();
    for await (const chunk of proc.stdout) out += decoder.decode(chunk, { stream: true });
  })();
  const guest = { netns, proc, output: () => out };
  await eventually(() => out.includes("listening") || proc.exitCode !== null, `fake guest in ${netns} starts`);
  if (!out.includes("listening")) throw new Error(`fake guest in ${netns} exited ${proc.exitCode}`);
  return guest;
}

/** A guest answering every HTTP request on GUEST_PORT with `body`. */
export function startFakeGuest(slot: Slot, body: string): Promise<FakeGuest> {
  return startGuest(
    slot,
    `Bun.serve({ hostname: ${JSON.stringify(slot.guestIp)}, port: ${GUEST_PORT}, fetch: () => new Response(${JSON.stringify(body)}) }); console.log("listening");`,
  );
}

/**
 * The VM vanishes as a killed VMM's guest does, without a FIN or RST: the link goes first, then
 * the process and its namespace. The slot is left without its TAP, as a stopped VMM leaves it.
 */
export async function vanishGuest(slot: Slot, guest: FakeGuest): Promise<void> {
  sh(["ip", "-n", slot.netns, "link", "delete", slot.tap]);
  guest.proc.kill(9);
  await guest.proc.exited;
  sh(["ip", "netns", "delete", guest.netns]);
}

export type ProbeOutcome = "connected" | "refused" | "timeout" | string;
export interface ProbeTarget {
  host: string;
  port: number;
  localAddress?: string;
}

/** TCP connect attempts from inside a namespace (or from the host when netns is undefined). */
export function probe(netns: string | undefined, targets: ProbeTarget[], timeoutMs = 2000): ProbeOutcome[] {
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

/**
 * Per-test bookkeeping for a describe block: pools, processes and undo commands are cleaned up
 * after each test, and the host must look exactly as it did before it.
 */
export function slotTestScaffold() {
  const pools: SlotPool[] = [];
  const procs: Bun.Subprocess[] = [];
  const undo: string[][] = [];
  const after: (() => void)[] = [];
  let before: Census;

  async function cleanUp(): Promise<void> {
    for (const p of procs.splice(0)) {
      p.kill(9);
      await p.exited;
    }
    for (const pool of pools.splice(0)) await pool.destroy().catch(() => {});
    for (const argv of undo.splice(0)) sh(argv);
    for (const f of after.splice(0)) f();
    sweep();
  }

  beforeEach(() => {
    before = census();
  });
  afterEach(async () => {
    await cleanUp();
    expect(census()).toEqual(before);
  });
  afterAll(cleanUp);

  return {
    newPool(extra: Record<string, unknown> = {}): SlotPool {
      const pool = new SlotPool(testPoolOptions(extra));
      pools.push(pool);
      return pool;
    },
    /** A guest (or any process) killed after the test. */
    keep<T extends { proc: Bun.Subprocess } | Bun.Subprocess>(x: T): T {
      procs.push("proc" in x ? x.proc : x);
      return x;
    },
    /** argv run after the test (to undo a decoy the test made). */
    undo: (argv: string[]) => void undo.push(argv),
    /** Any other restoring step after the test. */
    after: (f: () => void) => void after.push(f),
    census: () => before,
  };
}

/** The field a PolicyError names for `f`'s input, or "accepted" when `f` takes it. */
export function policyErrorField(f: () => unknown): string {
  try {
    f();
  } catch (e) {
    expect(e).toBeInstanceOf(PolicyError);
    return (e as PolicyError).field;
  }
  return "accepted";
}

/**
 * A slot of a fresh pool under an Egress whose domain rules go to `proxy`, with the test
 * internet (`resolver`, `uplink`) behind it and a fake guest in the slot.
 */
export async function egressSlot(t: ReturnType<typeof slotTestScaffold>, net: { ips: string[]; uplink: string }, proxy: EgressProxy): Promise<{ egress: Egress; slot: Slot; guest: string }> {
  const pool = t.newPool({ size: 0 });
  await pool.start();
  const egress = new Egress(pool.config, { alwaysDenied: DEFAULT_ALWAYS_DENIED, resolvers: [net.ips[0]!], uplinks: [net.uplink], proxyPort: proxy.port });
  proxy.use(egress);
  await egress.start();
  const slot = await pool.acquire();
  const guest = t.keep(await startFakeGuest(slot, "guest"));
  return { egress, slot, guest: guest.netns };
}
