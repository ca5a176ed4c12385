// What a node holds, counted from outside it (blockd's list, /proc, the kernel's namespaces, links,
// nft tables, conntrack, the files under $AENV_HOME): the soak test and bench/soak compare these
// counts after a workload with their values after start. Memory (RSS) is compared with a bound, not
// for equality: a heap settles where its collector leaves it.
import { existsSync, readdirSync, readFileSync, readlinkSync } from "node:fs";
import { join } from "node:path";
import { BlockdClient } from "../../src/blockdev/client.ts";
import { qemuPids } from "../vmm/harness.ts";

/** Where one node's things are. */
export interface CensusScope {
  home: string;
  runDir: string;
  /** The node's slot prefix (namespaces, host veths). */
  slotPrefix: string;
  /** The node's slot CIDR, as `a.b.c.0/24`: conntrack entries of its addresses. */
  slotCidr: string;
  nodePid: number;
}

/** Counts that must come back to their start values. */
export type Counts = Record<string, number>;

export interface Census {
  counts: Counts;
  /** Anonymous resident memory (KiB) of blockd and the node. */
  memoryKiB: { blockd: number; node: number };
}

/** The host table of a slot prefix, as SlotPool names it. */
const hostTable = (prefix: string) => `${prefix.replace(/[^A-Za-z0-9]/g, "_")}host`;

export async function census(s: CensusScope): Promise<Census> {
  const state = join(s.home, "blockd");
  const blockdPid = Number(readFileSync(join(state, "blockd.pid"), "utf8"));
  const bd = await BlockdClient.connect(join(state, "blockd.sock"));
  let devices: { kind: string; acquired?: boolean; config?: unknown }[];
  try {
    devices = await bd.call("list");
  } finally {
    bd.close();
  }
  const blockd = proc(blockdPid);
  const node = proc(s.nodePid);
  const mounts = readFileSync("/proc/mounts", "utf8").split("\n").filter((l) => l.includes(s.home)).length;
  const netns = (await run(["ip", "netns", "list"])).split("\n").filter((l) => l.startsWith(s.slotPrefix)).length;
  const links = (await run(["ip", "-o", "link", "show"])).split("\n").filter((l) => l.includes(` ${s.slotPrefix}`)).length;
  const tables = (await run(["nft", "list", "tables"])).split("\n").filter((l) => l.trim() && l.includes(hostTable(s.slotPrefix))).length;
  const hostRules = (await run(["nft", "-a", "list", "table", "inet", hostTable(s.slotPrefix)])).split("\n").filter((l) => /# handle \d+$/.test(l.trim())).length;
  const net = s.slotCidr.split(".").slice(0, 3).join(".") + ".";
  const conntrack = (await run(["conntrack", "-L"])).split("\n").filter((l) => l.includes(`=${net}`)).length;
  const sandboxDir = join(s.home, "sandboxes");
  const checkpoints = join(s.home, "checkpoints");
  return {
    counts: {
      "blockd devices": devices.length,
      "blockd acquired devices": devices.filter((d) => d.acquired).length,
      "blockd pool devices idle": devices.filter((d) => d.kind === "pool" && !d.acquired && !d.config).length,
      // Bun Workers: device workers, FUSE readers, memory writers (Bun's own pools and io_uring's io-wq threads come and go).
      "blockd worker threads": blockd.threads.Worker ?? 0,
      "node worker threads": node.threads.Worker ?? 0,
      "blockd open files": blockd.fds,
      "blockd deleted-but-open files": blockd.deleted,
      "node open files": node.fds,
      "node deleted-but-open files": node.deleted,
      "FUSE mounts": mounts,
      "loop devices": loopsOver(s.home),
      "network namespaces": netns,
      "host links": links,
      "host nft tables": tables,
      "host nft rules": hostRules,
      "conntrack entries": conntrack,
      "VMM processes": qemuPids(s.runDir).length,
      "VM run directories": entries(join(s.runDir, "vms")).length,
      "sandbox directories": entries(sandboxDir).length,
      "checkpoint directories": entries(checkpoints).filter((c) => !c.startsWith("template-")).length,
      "blockd prepared folders": entries(join(state, "prepared")).length,
    },
    memoryKiB: { blockd: blockd.anonKiB, node: node.anonKiB },
  };
}

/** The names whose counts differ, each with both values: "" when none do. */
export function diffCounts(start: Counts, now: Counts): string {
  return Object.keys(start)
    .filter((k) => start[k] !== now[k])
    .map((k) => `${k}: ${start[k]} at start, ${now[k]} now`)
    .join("; ");
}

/**
 * The counts above their start value. A count below it is no leak (something of the start, such
 * as a file the node had just deleted and not yet closed, went away) and is left to the log.
 */
export function grownCounts(start: Counts, now: Counts): string {
  return Object.keys(start)
    .filter((k) => (now[k] ?? 0) > (start[k] ?? 0))
    .map((k) => `${k}: ${start[k]} at start, ${now[k]} now`)
    .join("; ");
}

/**
 * A process's threads by name, its open files other than sockets (a client's keep-alive connection
 * is the client's), the deleted ones among them, and its anonymous memory.
 */
function proc(pid: number): { threads: Record<string, number>; fds: number; deleted: number; anonKiB: number } {
  const status = readFileSync(`/proc/${pid}/status`, "utf8");
  const links = readdirSync(`/proc/${pid}/fd`).map((f) => {
    try {
      return readlinkSync(`/proc/${pid}/fd/${f}`);
    } catch {
      return ""; // closed meanwhile
    }
  }).filter((l) => l && !l.startsWith("socket:"));
  const threads: Record<string, number> = {};
  for (const t of entries(`/proc/${pid}/task`)) {
    try {
      const name = readFileSync(`/proc/${pid}/task/${t}/comm`, "utf8").trim();
      threads[name] = (threads[name] ?? 0) + 1;
    } catch {} // ended meanwhile
  }
  return {
    threads,
    fds: links.length,
    deleted: links.filter((l) => l.endsWith(" (deleted)")).length,
    anonKiB: Number(/^RssAnon:\s+(\d+)/m.exec(status)?.[1] ?? -1),
  };
}

function loopsOver(dir: string): number {
  let n = 0;
  for (const b of entries("/sys/block")) {
    const f = `/sys/block/${b}/loop/backing_file`;
    if (b.startsWith("loop") && existsSync(f) && readFileSync(f, "utf8").includes(dir)) n++;
  }
  return n;
}

function entries(dir: string): string[] {
  try {
    return readdirSync(dir);
  } catch {
    return [];
  }
}

async function run(argv: string[]): Promise<string> {
  const p = Bun.spawn(argv, { stdout: "pipe", stderr: "ignore", timeout: 20_000 });
  const out = await new Response(p.stdout).text();
  await p.exited;
  return out;
}
