// Building, scrubbing and removing one slot, plus the host table and the leftover scan. Every step
// is a handful of short ip/nft runs, awaited (command.ts), so the event loop keeps turning.

import { access, readdir, writeFile } from "node:fs/promises";
import {
  GATEWAY_IP,
  GATEWAY_MAC,
  GUEST_PREFIX_LEN,
  NETNS_DIR,
  NS_VETH,
  cidrsOverlap,
  parseCidr,
  slotFor,
  slotIdOf,
  type NetworkConfig,
  type Slot,
} from "./addressing.ts";
import { NetworkError, run, toolPath } from "./command.ts";
import { hostRuleset, slotRuleset } from "./rulesets.ts";

/**
 * Sysctls of every slot namespace, written on creation and again on every scrub (a tenant's change
 * never survives). The namespace forwards between vpeer and the TAP; IPv4 only; conntrack never
 * adopts a mid-stream TCP segment as a connection (the ruleset's guard says the same).
 */
export const NAMESPACE_SYSCTLS: Readonly<Record<string, string>> = {
  "net.ipv4.ip_forward": "1",
  "net.ipv6.conf.all.disable_ipv6": "1",
  "net.ipv6.conf.default.disable_ipv6": "1",
  "net.netfilter.nf_conntrack_tcp_loose": "0",
};

/** argv that runs `argv` inside the slot's namespace (for the VMM driver's spawn). */
export function netnsExecArgv(slot: Pick<Slot, "netns">, argv: string[]): string[] {
  return [toolPath("ip"), "netns", "exec", slot.netns, ...argv];
}

/** Install (or atomically replace) the host table. */
export async function applyHostTable(cfg: NetworkConfig): Promise<void> {
  await run(["nft", "-f", "-"], { stdin: hostRuleset(cfg) });
}

export async function removeHostTable(cfg: NetworkConfig): Promise<void> {
  if (await hostTableExists(cfg)) await run(["nft", "delete", "table", "inet", cfg.hostTable]);
}

export async function hostTableExists(cfg: NetworkConfig): Promise<boolean> {
  return (await run(["nft", "list", "tables", "inet"])).stdout.split("\n").some((l) => l.trim() === `table inet ${cfg.hostTable}`);
}

/** Refuse a host CIDR that any interface or route not of ours already uses (it would be hijacked). */
export async function checkHostCidrFree(cfg: NetworkConfig): Promise<void> {
  const links = JSON.parse((await run(["ip", "-j", "-4", "address", "show"])).stdout || "[]") as { ifname: string; addr_info?: { local: string; prefixlen: number }[] }[];
  for (const l of links) {
    if (slotIdOf(cfg, l.ifname) !== undefined) continue;
    for (const a of l.addr_info ?? []) {
      if (cidrsOverlap(parseCidr(`${a.local}/32`), cfg.hostCidr)) {
        throw new NetworkError("CidrInUse", `host CIDR holds ${a.local}, already on ${l.ifname}; choose another hostCidr`);
      }
    }
  }
  const routes = JSON.parse((await run(["ip", "-j", "-4", "route", "show", "table", "all"])).stdout || "[]") as { dst?: string; dev?: string; type?: string }[];
  for (const r of routes) {
    if (!r.dst || r.dst === "default" || (r.dev && slotIdOf(cfg, r.dev) !== undefined)) continue;
    const dst = r.dst.includes("/") ? r.dst : `${r.dst}/32`;
    let c;
    try {
      c = parseCidr(dst);
    } catch {
      continue;
    }
    if (cidrsOverlap(c, cfg.hostCidr)) {
      throw new NetworkError("CidrInUse", `host CIDR overlaps route ${r.type ?? ""} ${r.dst} dev ${r.dev ?? "?"}; choose another hostCidr`);
    }
  }
}

/** Create slot `id` from nothing: namespace, veth pair, TAP, addresses, routes, sysctls, rules. */
export async function createSlot(cfg: NetworkConfig, id: number): Promise<Slot> {
  const slot = slotFor(cfg, id);
  await run(["ip", "netns", "add", slot.netns]);
  let vethCreated = false;
  try {
    // Rules match interfaces by name, so they can (and should) be in place before any link is up;
    // they also load conntrack, whose sysctls come next.
    await applyNamespaceRules(cfg, slot);
    // Before any interface exists in it, so "default" covers vpeer and the TAP too.
    await applyNamespaceSysctls(slot);
    await run(["ip", "link", "add", slot.hostVeth, "type", "veth", "peer", "name", NS_VETH, "netns", slot.netns]);
    vethCreated = true;
    await run(["ip", "-batch", "-"], {
      stdin: [`address add ${slot.hostIp}/31 dev ${slot.hostVeth}`, `link set ${slot.hostVeth} up`].join("\n"),
    });
    await disableHostVethIpv6(slot.hostVeth);
    await run(["ip", "-n", slot.netns, "-batch", "-"], { stdin: namespaceLinks(cfg, slot) });
  } catch (e) {
    // Undo only what this call made, then report the step that failed, not the cleanup.
    const undo = [...(vethCreated ? [["ip", "link", "delete", slot.hostVeth]] : []), ["ip", "netns", "delete", slot.netns]];
    for (const argv of undo) {
      try {
        await run(argv);
      } catch {}
    }
    throw e;
  }
  return slot;
}

/**
 * `ip -batch` lines that (re)build the namespace's addresses, routes and neighbours around lo and
 * vpeer, with a fresh TAP (the namespace holds no other link by then).
 */
function namespaceLinks(cfg: NetworkConfig, slot: Slot): string {
  const owner = cfg.tapOwner ? ` user ${cfg.tapOwner.uid} group ${cfg.tapOwner.gid}` : "";
  return [
    `route flush table main`,
    `address flush dev lo`,
    `address add 127.0.0.1/8 dev lo`,
    `link set lo up`,
    `neighbour flush dev ${NS_VETH} nud all`,
    `address flush dev ${NS_VETH}`,
    `address add ${slot.nsIp}/31 dev ${NS_VETH}`,
    `link set ${NS_VETH} up`,
    `tuntap add dev ${slot.tap} mode tap${owner}`,
    `link set ${slot.tap} address ${GATEWAY_MAC}`,
    `address add ${GATEWAY_IP}/${GUEST_PREFIX_LEN} dev ${slot.tap}`,
    `link set ${slot.tap} up`,
    `route add default via ${slot.hostIp} dev ${NS_VETH}`,
  ].join("\n");
}

/** Replace the namespace's whole nftables ruleset with ours, in one transaction. */
export async function applyNamespaceRules(cfg: NetworkConfig, slot: Slot): Promise<void> {
  await run(["ip", "netns", "exec", slot.netns, toolPath("nft"), "-f", "-"], { stdin: slotRuleset(cfg, slot) });
}

async function applyNamespaceSysctls(slot: Slot): Promise<void> {
  const pairs = Object.entries(NAMESPACE_SYSCTLS).map(([k, v]) => `${k}=${v}`);
  await run(["ip", "netns", "exec", slot.netns, toolPath("sysctl"), "-q", "-w", ...pairs]);
}

/** Processes still living in the namespace (a VMM that was not stopped). */
export async function netnsPids(netns: string): Promise<number[]> {
  return (await run(["ip", "netns", "pids", netns])).stdout
    .split(/\s+/)
    .filter(Boolean)
    .map(Number);
}

/** SlotBusy when processes still live in the slot's namespace: one of them may hold the TAP. */
export async function assertNoProcesses(slot: Slot): Promise<void> {
  const pids = await netnsPids(slot.netns);
  if (pids.length > 0) {
    throw new NetworkError("SlotBusy", `namespace ${slot.netns} still has processes ${pids.join(",")}; stop the VMM before releasing`);
  }
}

/**
 * Make a used slot fit for the next sandbox by rebuilding the namespace's state: the whole
 * nftables ruleset, the sysctls, every link but vpeer (a fresh TAP), addresses, routes and
 * neighbours; then forget its connections (namespace conntrack, host conntrack to/from nsIp).
 * The caller checks that no process is left in the namespace (assertNoProcesses).
 */
export async function scrubSlot(cfg: NetworkConfig, slot: Slot): Promise<void> {
  await applyNamespaceRules(cfg, slot);
  await applyNamespaceSysctls(slot);
  // Every link but lo and vpeer goes, the TAP included (it comes back with none of the last VMM's
  // state). One at a time: deleting one end of a pair or a parent takes others with it.
  for (const name of await foreignLinks(slot)) {
    try {
      await run(["ip", "-n", slot.netns, "link", "delete", "dev", name]);
    } catch (e) {
      if (!/Cannot find device/.test((e as NetworkError).detail?.stderr ?? "")) throw e;
    }
  }
  const left = await foreignLinks(slot);
  if (left.length > 0) throw new NetworkError("SlotBroken", `namespace ${slot.netns} keeps links ${left.join(", ")} after deleting them`);
  await run(["ip", "-n", slot.netns, "-batch", "-"], { stdin: namespaceLinks(cfg, slot) });
  await run(["ip", "netns", "exec", slot.netns, toolPath("conntrack"), "-F"]);
  await forgetHostConnections(slot);
}

/** Links in the namespace other than lo and vpeer; SlotBroken when vpeer is gone (its pair was deleted). */
async function foreignLinks(slot: Slot): Promise<string[]> {
  const links = JSON.parse((await run(["ip", "-n", slot.netns, "-j", "link", "show"])).stdout || "[]") as { ifname: string }[];
  if (!links.some((l) => l.ifname === NS_VETH)) throw new NetworkError("SlotBroken", `namespace ${slot.netns} lost its ${NS_VETH}`);
  return links.map((l) => l.ifname).filter((n) => n !== "lo" && n !== NS_VETH);
}

/**
 * Forget the tenant's connections on the host: close the host's own TCP sockets to the slot's
 * nsIp (a keep-alive pool would otherwise reuse one with the next tenant, who resets it) and
 * delete the host's conntrack entries to and from nsIp.
 */
async function forgetHostConnections(slot: Pick<Slot, "nsIp">): Promise<void> {
  await run(["ss", "-K", "-t", "dst", slot.nsIp]);
  // conntrack -D exits 1 when nothing matched, which is the common case.
  await run(["conntrack", "-D", "--orig-src", slot.nsIp], { alsoOk: [1] });
  await run(["conntrack", "-D", "--orig-dst", slot.nsIp], { alsoOk: [1] });
}

/**
 * Remove a slot's namespace and host veth (deleting either end removes the pair), then the
 * host's conntrack entries for its nsIp, so a recreated slot inherits none. Idempotent.
 */
export async function removeSlotByName(cfg: NetworkConfig, name: string): Promise<void> {
  const id = slotIdOf(cfg, name);
  if (id === undefined) throw new NetworkError("NotOurs", `${name} is not a ${cfg.prefix}<n> name; refusing to touch it`);
  if (await linkExists(name)) {
    const kind = await linkKind(name);
    if (kind !== "veth") throw new NetworkError("NotOurs", `host link ${name} is a ${kind ?? "plain"} device, not our veth; refusing to delete it`);
    await run(["ip", "link", "delete", name]);
  }
  if (await exists(`${NETNS_DIR}/${name}`)) await run(["ip", "netns", "delete", name]);
  await forgetHostConnections(slotFor(cfg, id));
}

async function linkKind(name: string): Promise<string | undefined> {
  const info = JSON.parse((await run(["ip", "-j", "-d", "link", "show", "dev", name])).stdout || "[]") as { linkinfo?: { info_kind?: string } }[];
  return info[0]?.linkinfo?.info_kind;
}

async function exists(path: string): Promise<boolean> {
  return access(path).then(
    () => true,
    () => false,
  );
}

export function linkExists(name: string): Promise<boolean> {
  return exists(`/sys/class/net/${name}`);
}

/** Whether slot `id`'s names are held on this host now (by us or by something else). */
export async function slotNamesTaken(cfg: NetworkConfig, id: number): Promise<boolean> {
  const { netns } = slotFor(cfg, id);
  return (await linkExists(netns)) || (await exists(`${NETNS_DIR}/${netns}`));
}

/** Names of our namespaces and host links present now (from this or an earlier run). */
export async function listOurs(cfg: NetworkConfig): Promise<{ netns: string[]; links: string[] }> {
  const ours = (names: string[]) => names.filter((n) => slotIdOf(cfg, n) !== undefined).sort();
  const netns = (await exists(NETNS_DIR)) ? ours(await readdir(NETNS_DIR)) : [];
  return { netns, links: ours(await readdir("/sys/class/net")) };
}

async function disableHostVethIpv6(name: string): Promise<void> {
  // Slots speak IPv4 only; without this the host end would get a link-local v6 address.
  const knob = `/proc/sys/net/ipv6/conf/${name}/disable_ipv6`;
  if (await exists(knob)) await writeFile(knob, "1");
}
