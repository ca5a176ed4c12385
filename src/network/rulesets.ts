// The nftables rulesets, as text for `nft -f -`. Each one replaces its table in a single
// transaction ("add table; delete table; table { ... }"), so there is never a moment with no rules.
//
// Hooks for the egress policy (a later issue): the host table's `egress` chain sees every packet
// a slot sends towards anywhere but the host (empty = all refused, i.e. egress off), and
// `host_services` sees new connections from slots to the host itself (empty = all refused).
// The egress layer fills those chains (or jumps from them to per-slot chains) and, when it turns
// real egress on, enables host forwarding and adds its own masquerade towards the uplink.

import { GUEST_IP, NS_VETH, SLOT_TABLE, type NetworkConfig, type Slot } from "./addressing.ts";

/** Named counters in the host table; tests and operators read them with `nft list counter`. */
export const HOST_COUNTERS = ["slot_to_slot", "slot_to_host", "egress_refused", "into_slot_refused"] as const;

function replaceTable(family: string, name: string, body: string): string {
  return `add table ${family} ${name}\ndelete table ${family} ${name}\ntable ${family} ${name} {\n${body}}\n`;
}

/** The host table: slots never reach each other, the host, or (until egress exists) anything else. */
export function hostRuleset(cfg: NetworkConfig): string {
  const slots = JSON.stringify(`${cfg.prefix}*`);
  return replaceTable(
    "inet",
    cfg.hostTable,
    `${HOST_COUNTERS.map((c) => `  counter ${c} { }\n`).join("")}
  chain egress {
  }

  chain host_services {
  }

  chain forward {
    type filter hook forward priority filter; policy accept;
    iifname ${slots} oifname ${slots} counter name "slot_to_slot" drop
    oifname ${slots} ct state established,related accept
    oifname ${slots} counter name "into_slot_refused" drop
    iifname ${slots} jump egress
    iifname ${slots} counter name "egress_refused" reject with icmpx type admin-prohibited
  }

  chain input {
    type filter hook input priority filter; policy accept;
    iifname ${slots} ct state established,related accept
    iifname ${slots} jump host_services
    iifname ${slots} counter name "slot_to_host" reject with icmpx type admin-prohibited
  }
`,
  );
}

/**
 * The whole ruleset of a slot's namespace: `flush ruleset` first, so whatever a previous tenant's
 * policy added (any table, any family) is gone in the same transaction that installs ours.
 * - guard: spoofing and mid-stream adoption. Only a plain SYN opens a TCP connection, so a segment
 *   of a connection from before a release (the host's socket to the previous tenant) is never
 *   tracked anew and delivered to the next guest: the namespace answers it with a reset (input),
 *   so the host's stale socket fails at once instead of hanging.
 * - input (policy drop): the namespace offers nothing to the guest or the host; DNATed traffic is
 *   forwarded, never delivered here, so a listener on nsIp or the gateway address is unreachable.
 * - forward (policy drop): established, DNATed host→guest, guest→vpeer.
 */
export function slotRuleset(cfg: NetworkConfig, slot: Slot): string {
  const tap = JSON.stringify(cfg.tap);
  const veth = JSON.stringify(NS_VETH);
  return `flush ruleset
table inet ${SLOT_TABLE} {
  chain guard {
    type filter hook prerouting priority mangle; policy accept;
    iifname ${veth} ip saddr ${slot.hostIp} meta l4proto tcp ct state invalid accept
    ct state invalid drop
    iifname { ${veth}, ${tap} } ct state new tcp flags & (fin | syn | rst | ack) != syn drop
    iifname ${veth} ct state established,related accept
    iifname ${veth} ip saddr != ${slot.hostIp} drop
    iifname ${veth} meta nfproto ipv6 drop
    iifname ${tap} ip saddr != ${GUEST_IP} drop
    iifname ${tap} meta nfproto ipv6 drop
  }

  chain dnat_to_guest {
    type nat hook prerouting priority dstnat; policy accept;
    iifname ${veth} ip daddr ${slot.nsIp} dnat ip to ${GUEST_IP}
  }

  chain masquerade_guest {
    type nat hook postrouting priority srcnat; policy accept;
    oifname ${veth} ip saddr ${GUEST_IP} masquerade
  }

  chain input {
    type filter hook input priority filter; policy drop;
    iif "lo" accept
    ct state established,related accept
    iifname ${veth} meta l4proto tcp ct state invalid reject with tcp reset
    iifname ${tap} reject with icmpx type admin-prohibited
  }

  chain forward {
    type filter hook forward priority filter; policy drop;
    ct state established,related accept
    iifname ${veth} oifname ${tap} ip daddr ${GUEST_IP} ct status dnat accept
    iifname ${tap} oifname ${veth} accept
  }
}
`;
}
