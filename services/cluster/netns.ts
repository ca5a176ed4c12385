// The network of a cluster on one machine: a bridge in the host's namespace (etcd and the
// gateways reach the nodes through it) and one network namespace per node, joined to the bridge by
// a veth pair, each node with an address of its own. Nodes run in their namespace through
// `nsenter --net` only: they share the host's mount namespace, so blockd's FUSE devices, /run and
// a restarted node see the same files.
import { run } from "../../src/network/command.ts";

export interface ClusterNet {
  /** Bridge name (at most 15 characters, Linux's IFNAMSIZ - 1). */
  bridge: string;
  /** `10.x.y` of the /24 the bridge (.1) and the nodes (.10 + i) use. */
  subnet: string;
  /** Prefix of the nodes' namespaces and host-side veths. */
  prefix: string;
}

export const bridgeAddress = (n: ClusterNet) => `${n.subnet}.1`;
export const nodeAddress = (n: ClusterNet, i: number) => `${n.subnet}.${10 + i}`;
export const nodeNetns = (n: ClusterNet, i: number) => `${n.prefix}n${i}`;

/** The bridge, up, with its address (kept if it exists). */
export async function createBridge(n: ClusterNet): Promise<void> {
  const exists = await run(["ip", "link", "show", n.bridge], { alsoOk: [1] });
  if (exists.exitCode !== 0) await run(["ip", "link", "add", n.bridge, "type", "bridge"]);
  await run(["ip", "addr", "replace", `${bridgeAddress(n)}/24`, "dev", n.bridge]);
  await run(["ip", "link", "set", n.bridge, "up"]);
}

/** Node i's namespace: loopback up, a veth to the bridge, its address; rebuilt when it exists. */
export async function createNodeNetns(n: ClusterNet, i: number): Promise<void> {
  const ns = nodeNetns(n, i);
  const hostSide = `${ns}h`;
  await run(["ip", "netns", "del", ns], { alsoOk: [1] });
  await run(["ip", "link", "del", hostSide], { alsoOk: [1] });
  await run(["ip", "netns", "add", ns]);
  await run(["ip", "link", "add", hostSide, "type", "veth", "peer", "name", "eth0", "netns", ns]);
  await run(["ip", "link", "set", hostSide, "master", n.bridge, "up"]);
  await run(["ip", "-n", ns, "link", "set", "lo", "up"]);
  await run(["ip", "-n", ns, "addr", "add", `${nodeAddress(n, i)}/24`, "dev", "eth0"]);
  await run(["ip", "-n", ns, "link", "set", "eth0", "up"]);
}

/** The link of node i to the bridge up or down (a node cut off, and back). */
export async function setNodeLink(n: ClusterNet, i: number, up: boolean): Promise<void> {
  await run(["ip", "link", "set", `${nodeNetns(n, i)}h`, up ? "up" : "down"]);
}

/** argv prefix that runs a command in node i's namespace (network only). */
export const inNodeNetns = (n: ClusterNet, i: number) => ["nsenter", `--net=/run/netns/${nodeNetns(n, i)}`, "--"];

/** Namespaces whose names start with `prefix` (a node's slots). */
export async function netnsWithPrefix(prefix: string): Promise<string[]> {
  const out = await run(["ip", "netns", "list"]);
  return out.stdout.split("\n").map((l) => l.split(" ")[0]!).filter((name) => name.startsWith(prefix));
}

/** Deletes node namespaces, the slots' namespaces of `slotPrefixes`, and the bridge. */
export async function destroyClusterNet(n: ClusterNet, nodes: number, slotPrefixes: string[]): Promise<void> {
  for (const p of slotPrefixes) for (const ns of await netnsWithPrefix(p)) await run(["ip", "netns", "del", ns], { alsoOk: [1] });
  for (let i = 0; i < nodes; i++) {
    await run(["ip", "netns", "del", nodeNetns(n, i)], { alsoOk: [1] });
    await run(["ip", "link", "del", `${nodeNetns(n, i)}h`], { alsoOk: [1] });
  }
  await run(["ip", "link", "del", n.bridge], { alsoOk: [1] });
}
