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

/** The table inside a slot's namespace: DNAT host→guest ports, masquerade guest egress, and a guard. */
export function slotRuleset(cfg: NetworkConfig, slot: Slot): string {
  const tap = JSON.stringify(cfg.tap);
  const veth = JSON.stringify(NS_VETH);
  return replaceTable(
    "inet",
    SLOT_TABLE,
    `  chain guard {
    type filter hook prerouting priority mangle; policy accept;
    ct state invalid drop
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

  chain forward {
    type filter hook forward priority filter; policy drop;
    ct state established,related accept
    iifname ${veth} oifname ${tap} ip daddr ${GUEST_IP} ct status dnat accept
    iifname ${tap} oifname ${veth} accept
  }
`,
  );
}
