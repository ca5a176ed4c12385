// Building, scrubbing and removing one slot, plus the host table and the leftover scan. All
// synchronous: each step is a handful of short ip/nft runs.

import { existsSync, readdirSync, writeFileSync } from "node:fs";
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

/** argv that runs `argv` inside the slot's namespace (for the VMM driver's spawn). */
export function netnsExecArgv(slot: Pick<Slot, "netns">, argv: string[]): string[] {
  return [toolPath("ip"), "netns", "exec", slot.netns, ...argv];
}

/** Install (or atomically replace) the host table. */
export function applyHostTable(cfg: NetworkConfig): void {
  run(["nft", "-f", "-"], { stdin: hostRuleset(cfg) });
}

export function removeHostTable(cfg: NetworkConfig): void {
  if (hostTableExists(cfg)) run(["nft", "delete", "table", "inet", cfg.hostTable]);
}

export function hostTableExists(cfg: NetworkConfig): boolean {
  return run(["nft", "list", "tables", "inet"]).stdout.split("\n").some((l) => l.trim() === `table inet ${cfg.hostTable}`);
}

/** Refuse a host CIDR that any interface or route not of ours already uses (it would be hijacked). */
export function checkHostCidrFree(cfg: NetworkConfig): void {
  const links = JSON.parse(run(["ip", "-j", "-4", "address", "show"]).stdout || "[]") as { ifname: string; addr_info?: { local: string; prefixlen: number }[] }[];
  for (const l of links) {
    if (slotIdOf(cfg, l.ifname) !== undefined) continue;
    for (const a of l.addr_info ?? []) {
      if (cidrsOverlap(parseCidr(`${a.local}/32`), cfg.hostCidr)) {
        throw new NetworkError("CidrInUse", `host CIDR holds ${a.local}, already on ${l.ifname}; choose another hostCidr`);
      }
    }
  }
  const routes = JSON.parse(run(["ip", "-j", "-4", "route", "show", "table", "all"]).stdout || "[]") as { dst?: string; dev?: string; type?: string }[];
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
export function createSlot(cfg: NetworkConfig, id: number): Slot {
  const slot = slotFor(cfg, id);
  run(["ip", "netns", "add", slot.netns]);
  let vethCreated = false;
  try {
    // Before any interface exists in it, so "default" covers vpeer and the TAP too.
    run(["ip", "netns", "exec", slot.netns, toolPath("sysctl"), "-q", "-w",
      "net.ipv4.ip_forward=1",
      "net.ipv6.conf.all.disable_ipv6=1",
      "net.ipv6.conf.default.disable_ipv6=1",
    ]);
    // Rules match interfaces by name, so they can (and should) be in place before any link is up.
    applySlotTable(cfg, slot);
    run(["ip", "link", "add", slot.hostVeth, "type", "veth", "peer", "name", NS_VETH, "netns", slot.netns]);
    vethCreated = true;
    run(["ip", "-batch", "-"], {
      stdin: [`address add ${slot.hostIp}/31 dev ${slot.hostVeth}`, `link set ${slot.hostVeth} up`].join("\n"),
    });
    disableHostVethIpv6(slot.hostVeth);
    const owner = cfg.tapOwner ? ` user ${cfg.tapOwner.uid} group ${cfg.tapOwner.gid}` : "";
    run(["ip", "-n", slot.netns, "-batch", "-"], {
      stdin: [
        `link set lo up`,
        `address add ${slot.nsIp}/31 dev ${NS_VETH}`,
        `link set ${NS_VETH} up`,
        `tuntap add dev ${slot.tap} mode tap${owner}`,
        `link set ${slot.tap} address ${GATEWAY_MAC}`,
        `address add ${GATEWAY_IP}/${GUEST_PREFIX_LEN} dev ${slot.tap}`,
        `link set ${slot.tap} up`,
        `route add default via ${slot.hostIp} dev ${NS_VETH}`,
      ].join("\n"),
    });
  } catch (e) {
    // Undo only what this call made, then report the step that failed, not the cleanup.
    const undo = [...(vethCreated ? [["ip", "link", "delete", slot.hostVeth]] : []), ["ip", "netns", "delete", slot.netns]];
    for (const argv of undo) {
      try {
        run(argv);
      } catch {}
    }
    throw e;
  }
  return slot;
}

/** (Re)install the namespace's table: resets whatever a previous tenant's policy added. */
export function applySlotTable(cfg: NetworkConfig, slot: Slot): void {
  run(["ip", "netns", "exec", slot.netns, toolPath("nft"), "-f", "-"], { stdin: slotRuleset(cfg, slot) });
}

/** Processes still living in the namespace (a VMM that was not stopped). */
export function netnsPids(netns: string): number[] {
  return run(["ip", "netns", "pids", netns])
    .stdout.split(/\s+/)
    .filter(Boolean)
    .map(Number);
}

/**
 * Make a used slot fit for the next sandbox: forget its connections (host and namespace conntrack),
 * neighbours and any rules a policy added. The caller stops the VMM first; a slot with processes
 * still inside is refused, since one of them may hold the TAP.
 */
export function scrubSlot(cfg: NetworkConfig, slot: Slot): void {
  const pids = netnsPids(slot.netns);
  if (pids.length > 0) {
    throw new NetworkError("SlotBusy", `namespace ${slot.netns} still has processes ${pids.join(",")}; stop the VMM before releasing`);
  }
  applySlotTable(cfg, slot);
  run(["ip", "-n", slot.netns, "-batch", "-"], {
    stdin: [`neighbour flush dev ${slot.tap} nud all`, `link set ${slot.tap} up`, `link set ${NS_VETH} up`].join("\n"),
  });
  run(["ip", "netns", "exec", slot.netns, toolPath("conntrack"), "-F"]);
  // conntrack -D exits 1 when nothing matched, which is the common case.
  run(["conntrack", "-D", "--orig-src", slot.nsIp], { alsoOk: [1] });
  run(["conntrack", "-D", "--orig-dst", slot.nsIp], { alsoOk: [1] });
}

/** Remove a slot's namespace and host veth (deleting either end removes the pair). Idempotent. */
export function removeSlotByName(cfg: NetworkConfig, name: string): void {
  if (slotIdOf(cfg, name) === undefined) throw new NetworkError("NotOurs", `${name} is not a ${cfg.prefix}<n> name; refusing to touch it`);
  if (linkExists(name)) {
    const kind = linkKind(name);
    if (kind !== "veth") throw new NetworkError("NotOurs", `host link ${name} is a ${kind ?? "plain"} device, not our veth; refusing to delete it`);
    run(["ip", "link", "delete", name]);
  }
  if (existsSync(`${NETNS_DIR}/${name}`)) run(["ip", "netns", "delete", name]);
}

function linkKind(name: string): string | undefined {
  const info = JSON.parse(run(["ip", "-j", "-d", "link", "show", "dev", name]).stdout || "[]") as { linkinfo?: { info_kind?: string } }[];
  return info[0]?.linkinfo?.info_kind;
}

export function linkExists(name: string): boolean {
  return existsSync(`/sys/class/net/${name}`);
}

/** Names of our namespaces and host links present now (from this or an earlier run). */
export function listOurs(cfg: NetworkConfig): { netns: string[]; links: string[] } {
  const netns = existsSync(NETNS_DIR) ? readdirSync(NETNS_DIR).filter((n) => slotIdOf(cfg, n) !== undefined) : [];
  const links = readdirSync("/sys/class/net").filter((n) => slotIdOf(cfg, n) !== undefined);
  return { netns: netns.sort(), links: links.sort() };
}

function disableHostVethIpv6(name: string): void {
  // Slots speak IPv4 only; without this the host end would get a link-local v6 address.
  const knob = `/proc/sys/net/ipv6/conf/${name}/disable_ipv6`;
  if (existsSync(knob)) writeFileSync(knob, "1");
}
