// Egress of sandboxes: each leased slot's policy in the host table, replaced atomically.
//
// The host table's `egress` chain (rulesets.ts) sees every packet a slot sends towards anything
// but the host. Egress.start fills it once:
//   DNS (udp/tcp 53) to the node's resolvers → accept
//   destination in @always_denied (internal ranges, the slot CIDR) → refused (counter internal_refused)
//   iifname vmap @egress_slots → jump s<n>          (a slot with no policy falls through: refused)
// and each slot's chain s<n> is
//   ip daddr @s<n>_allow accept; ip daddr @s<n>_deny refuse; accept (or refuse when the internet is off)
// Every packet is judged (no "established → accept" shortcut), so a policy change applies to open
// flows at once; Egress.apply also deletes the slot's conntrack entries to now-refused destinations.
// With domain or header rules, TCP to the proxied ports is redirected (nat prerouting,
// @redirect_slots → r<n>) to the domain proxy on the host; with an egress proxy, every TCP
// connection is (but DNS to the resolvers), and s<n> refuses whatever else the slot sends (UDP,
// ICMP: nothing leaves but through that proxy). `host_services` lets only redirected connections in.
// Forwarding is switched on per interface (the slot's host veth and the configured uplinks), never
// host-wide; traffic leaving for the uplink is masqueraded to the uplink's address.

import { readFile, writeFile } from "node:fs/promises";
import { formatIpv4, parseCidr, parseIpv4, slotIdOf, type NetworkConfig, type Slot } from "./addressing.ts";
import { NetworkError, run } from "./command.ts";
import { PolicyMatcher, redirectedPorts, type EgressPolicy } from "./policy.ts";

export interface EgressOptions {
  /** Ranges refused whatever a policy allows; the slot CIDR is always added. */
  alwaysDenied: string[];
  /** The node's DNS servers (IPv4): udp/tcp 53 to them is always allowed. */
  resolvers: string[];
  /** Interfaces egress leaves by: forwarding is switched on for them (replies come back through them). */
  uplinks: string[];
  /** The domain proxy's TCP port on the host (EgressProxy); redirected connections go there. */
  proxyPort?: number;
}

/** A slot's applied policy, by slot number. */
export interface AppliedPolicy {
  slot: Slot;
  sandboxId: string;
  policy: EgressPolicy;
  matcher: PolicyMatcher;
}

const q = JSON.stringify;


export class Egress {
  private readonly applied = new Map<number, AppliedPolicy>();
  /** nsIp → slot number, for the proxy's lookups of a connection's sandbox. */
  private readonly byNsIp = new Map<string, number>();
  private readonly listeners: ((nsIp: string, now: AppliedPolicy | undefined) => void)[] = [];
  /** One nft transaction at a time, in call order (each replaces whole per-slot state). */
  private queue: Promise<unknown> = Promise.resolve();
  readonly alwaysDenied: string[];

  constructor(private readonly cfg: NetworkConfig, private readonly opts: EgressOptions) {
    for (const r of opts.resolvers) parseIpv4(r);
    for (const c of opts.alwaysDenied) parseCidr(c);
    const slotCidr = `${formatIpv4(cfg.hostCidr.base)}/${cfg.hostCidr.prefixLen}`;
    this.alwaysDenied = [...new Set([...opts.alwaysDenied, slotCidr])];
  }

  private get t(): string {
    return `inet ${this.cfg.hostTable}`;
  }

  private serial<T>(fn: () => Promise<T>): Promise<T> {
    const p = this.queue.then(fn, fn);
    this.queue = p.catch(() => {});
    return p;
  }

  /**
   * Fills the host table's egress hooks (after SlotPool.start, which installs the table) and
   * switches forwarding on for the uplinks. Policies applied earlier are forgotten: the table was new.
   */
  async start(): Promise<void> {
    const t = this.t;
    const slots = q(`${this.cfg.prefix}*`);
    const resolvers = this.opts.resolvers;
    const lines = [
      `add counter ${t} internal_refused`,
      `add set ${t} always_denied { type ipv4_addr; flags interval; auto-merge; }`,
      `flush set ${t} always_denied`,
      `add element ${t} always_denied { ${this.alwaysDenied.join(", ")} }`,
      `add map ${t} egress_slots { type ifname : verdict; }`,
      `add map ${t} redirect_slots { type ifname : verdict; }`,
      `add chain ${t} refuse`,
      `flush chain ${t} refuse`,
      `add rule ${t} refuse meta l4proto tcp reject with tcp reset`,
      `add rule ${t} refuse reject with icmpx type admin-prohibited`,
      `flush chain ${t} egress`,
      ...(resolvers.length ? [`add rule ${t} egress ip daddr { ${resolvers.join(", ")} } meta l4proto { tcp, udp } th dport 53 accept`] : []),
      `add rule ${t} egress ip daddr @always_denied counter name internal_refused goto refuse`,
      `add rule ${t} egress iifname vmap @egress_slots`,
      `flush chain ${t} host_services`,
      ...(this.opts.proxyPort ? [`add rule ${t} host_services tcp dport ${this.opts.proxyPort} ct status dnat accept`] : []),
      `add chain ${t} egress_nat_pre { type nat hook prerouting priority dstnat; policy accept; }`,
      `flush chain ${t} egress_nat_pre`,
      `add rule ${t} egress_nat_pre iifname vmap @redirect_slots`,
      `add chain ${t} egress_nat_post { type nat hook postrouting priority srcnat; policy accept; }`,
      `flush chain ${t} egress_nat_post`,
      `add rule ${t} egress_nat_post iifname ${slots} oifname != ${slots} masquerade`,
    ];
    await this.serial(() => run(["nft", "-f", "-"], { stdin: lines.join("\n") + "\n" }));
    for (const u of this.opts.uplinks) await setForwarding(u, true);
    this.applied.clear();
    this.byNsIp.clear();
  }

  /** `cb(nsIp, now)` after each apply and clear (now undefined): the proxy re-judges the slot's open connections. */
  onChange(cb: (nsIp: string, now: AppliedPolicy | undefined) => void): void {
    this.listeners.push(cb);
  }

  /** The policy in force for the sandbox whose slot has this nsIp (the proxy's lookup). */
  bySource(nsIp: string): AppliedPolicy | undefined {
    const id = this.byNsIp.get(nsIp);
    return id === undefined ? undefined : this.applied.get(id);
  }

  get(slot: Pick<Slot, "id">): AppliedPolicy | undefined {
    return this.applied.get(slot.id);
  }

  /**
   * Puts `policy` in force for the slot's sandbox, replacing the one before in one nft transaction
   * (no moment with neither), then cuts the slot's connections the new policy refuses.
   */
  apply(slot: Slot, sandboxId: string, policy: EgressPolicy): Promise<void> {
    return this.serial(async () => {
      const previous = this.applied.get(slot.id);
      await run(["nft", "-f", "-"], { stdin: this.slotTransaction(slot, policy, previous?.policy) });
      await setForwarding(slot.hostVeth, true);
      const a: AppliedPolicy = { slot, sandboxId, policy, matcher: new PolicyMatcher(policy, this.alwaysDenied) };
      this.applied.set(slot.id, a);
      this.byNsIp.set(slot.nsIp, slot.id);
      if (previous) await this.cutRefused(a);
      for (const cb of this.listeners) cb(slot.nsIp, a);
    });
  }

  /** Removes the slot's policy (its traffic is refused again); idempotent. */
  clear(slot: Slot): Promise<void> {
    return this.serial(async () => {
      const previous = this.applied.get(slot.id);
      this.applied.delete(slot.id);
      this.byNsIp.delete(slot.nsIp);
      await setForwarding(slot.hostVeth, false).catch(() => {});
      for (const cb of this.listeners) cb(slot.nsIp, undefined);
      if (!previous) return;
      const t = this.t;
      const n = slot.id;
      const lines = [
        `delete element ${t} egress_slots { ${q(slot.hostVeth)} }`,
        ...(redirectedPorts(previous.policy) ? [`delete element ${t} redirect_slots { ${q(slot.hostVeth)} }`, `delete chain ${t} r${n}`] : []),
        `delete chain ${t} s${n}`,
        `delete set ${t} s${n}_allow`,
        `delete set ${t} s${n}_deny`,
        `delete counter ${t} s${n}_refused`,
      ];
      await run(["nft", "-f", "-"], { stdin: lines.join("\n") + "\n" });
    });
  }

  /** Packets of this slot refused by its own policy (denyOut, or the internet off). */
  async refusedPackets(slot: Pick<Slot, "id">): Promise<number> {
    const r = await run(["nft", "-j", "list", "counter", ...this.t.split(" "), `s${slot.id}_refused`]);
    const doc = JSON.parse(r.stdout) as { nftables: { counter?: { packets: number } }[] };
    return doc.nftables.find((e) => e.counter)?.counter?.packets ?? 0;
  }

  /** The transaction that replaces slot n's sets, chain and map entries with `policy`'s. */
  private slotTransaction(slot: Slot, policy: EgressPolicy, previous: EgressPolicy | undefined): string {
    const t = this.t;
    const n = slot.id;
    const veth = q(slot.hostVeth);
    const lines = [
      `add counter ${t} s${n}_refused`,
      `add set ${t} s${n}_allow { type ipv4_addr; flags interval; auto-merge; }`,
      `add set ${t} s${n}_deny { type ipv4_addr; flags interval; auto-merge; }`,
      `flush set ${t} s${n}_allow`,
      `flush set ${t} s${n}_deny`,
      ...(policy.allowCidrs.length ? [`add element ${t} s${n}_allow { ${policy.allowCidrs.join(", ")} }`] : []),
      ...(policy.denyCidrs.length ? [`add element ${t} s${n}_deny { ${policy.denyCidrs.join(", ")} }`] : []),
      `add chain ${t} s${n}`,
      `flush chain ${t} s${n}`,
      ...(policy.upstream ? [] : [
        `add rule ${t} s${n} ip daddr @s${n}_allow accept`,
        `add rule ${t} s${n} ip daddr @s${n}_deny counter name s${n}_refused goto refuse`,
      ]),
      policy.internet && !policy.upstream ? `add rule ${t} s${n} accept` : `add rule ${t} s${n} counter name s${n}_refused goto refuse`,
      `add element ${t} egress_slots { ${veth} : jump s${n} }`,
    ];
    const ports = redirectedPorts(policy);
    if (ports) {
      if (!this.opts.proxyPort) throw new NetworkError("NoProxy", "domain rules, header rules and egress proxies need the domain proxy (EgressOptions.proxyPort)");
      const resolvers = this.opts.resolvers;
      lines.push(
        `add chain ${t} r${n}`,
        `flush chain ${t} r${n}`,
        ...(ports === "all" && resolvers.length ? [`add rule ${t} r${n} ip daddr { ${resolvers.join(", ")} } tcp dport 53 return`] : []),
        ports === "all"
          ? `add rule ${t} r${n} meta l4proto tcp redirect to :${this.opts.proxyPort}`
          : `add rule ${t} r${n} tcp dport { ${ports.join(", ")} } redirect to :${this.opts.proxyPort}`,
        `add element ${t} redirect_slots { ${veth} : jump r${n} }`,
      );
    } else if (previous && redirectedPorts(previous)) {
      lines.push(`delete element ${t} redirect_slots { ${veth} }`, `delete chain ${t} r${n}`);
    }
    return lines.join("\n") + "\n";
  }

  /**
   * Deletes the host's conntrack entries of the slot's flows to destinations the policy now
   * refuses, so both ends learn at their next segment (the guest's is reset by the egress chain,
   * the server's meets no mapping and is reset by the host).
   */
  private async cutRefused(a: AppliedPolicy): Promise<void> {
    const listed = await run(["conntrack", "-L", "--orig-src", a.slot.nsIp], { alsoOk: [1] });
    for (const line of listed.stdout.split("\n")) {
      const proto = /^(tcp|udp)\b/.exec(line)?.[1];
      const m = /\bsrc=\S+ dst=(\S+) sport=(\d+) dport=(\d+) .*?\bsrc=(\S+)/.exec(line);
      if (!proto || !m) continue;
      const [, dst, sport, dport, replySrc] = m;
      // Redirected to the domain proxy (the reply comes from the host): the proxy judges it by name.
      if (replySrc !== dst) continue;
      // With an egress proxy, nothing the slot opened directly may stay.
      if (!a.policy.upstream && a.matcher.decide(dst!).allow) continue;
      await run(["conntrack", "-D", "-p", proto, "--orig-src", a.slot.nsIp, "--orig-dst", dst!, "--orig-port-src", sport!, "--orig-port-dst", dport!], { alsoOk: [1] });
    }
  }
}

/** IPv4 forwarding on one interface (the kernel checks the interface a packet came in on). */
async function setForwarding(ifname: string, on: boolean): Promise<void> {
  await writeFile(`/proc/sys/net/ipv4/conf/${ifname}/forwarding`, on ? "1" : "0");
}

/**
 * The host's DNS servers a sandbox can reach: the nameservers of systemd-resolved's upstream file
 * (when it runs) or /etc/resolv.conf, loopback ones left out (a guest cannot reach the host's 127/8).
 */
export async function hostResolvers(): Promise<string[]> {
  for (const f of ["/run/systemd/resolve/resolv.conf", "/etc/resolv.conf"]) {
    const text = await readFile(f, "utf8").catch(() => "");
    const found = [...text.matchAll(/^\s*nameserver\s+(\d+\.\d+\.\d+\.\d+)\s*$/gm)].map((m) => m[1]!).filter((ip) => !ip.startsWith("127."));
    if (found.length) return found;
  }
  return [];
}

/** The interfaces of the host's IPv4 default routes: where egress leaves by default. */
export async function defaultUplinks(): Promise<string[]> {
  const routes = JSON.parse((await run(["ip", "-j", "-4", "route", "show", "default"])).stdout || "[]") as { dev?: string }[];
  return [...new Set(routes.map((r) => r.dev).filter((d): d is string => !!d))];
}

/**
 * The IPv4 networks on the host's own interfaces (slot veths left out): the node's LANs, which a
 * sandbox must not reach (other nodes, routers, storage) whatever its policy allows.
 */
export async function hostNetworks(cfg: NetworkConfig): Promise<string[]> {
  const links = JSON.parse((await run(["ip", "-j", "-4", "address", "show"])).stdout || "[]") as { ifname: string; addr_info?: { local: string; prefixlen: number }[] }[];
  const out = new Set<string>();
  for (const l of links) {
    if (slotIdOf(cfg, l.ifname) !== undefined) continue;
    for (const a of l.addr_info ?? []) {
      const size = 2 ** (32 - a.prefixlen);
      out.add(`${formatIpv4(Math.floor(parseIpv4(a.local) / size) * size)}/${a.prefixlen}`);
    }
  }
  return [...out];
}
