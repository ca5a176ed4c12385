// Slot naming, addressing and ruleset text: pure functions, no privileges needed.
import { describe, expect, test } from "bun:test";
import { NetworkError, resolveConfig, slotFor } from "../../src/network/index.ts";
import { cidrsOverlap, formatIpv4, parseCidr, parseIpv4, slotIdOf } from "../../src/network/addressing.ts";
import { hostRuleset, slotRuleset } from "../../src/network/rulesets.ts";

describe("addressing", () => {
  test("slot n gets base+2n on the host and base+2n+1 in the namespace", () => {
    const cfg = resolveConfig();
    expect(slotFor(cfg, 0)).toMatchObject({ netns: "aenv-0", hostVeth: "aenv-0", hostIp: "10.200.0.0", nsIp: "10.200.0.1", tap: "tap0" });
    expect(slotFor(cfg, 200)).toMatchObject({ hostIp: "10.200.1.144", nsIp: "10.200.1.145" });
    expect(slotFor(cfg, 32767)).toMatchObject({ netns: "aenv-32767", hostIp: "10.200.255.254", nsIp: "10.200.255.255" });
    expect(cfg.maxSlots).toBe(32768);
    expect(() => slotFor(cfg, 32768)).toThrow(NetworkError);
    const s = slotFor(cfg, 5);
    expect([s.guestIp, s.gatewayIp, s.guestPrefixLen, s.guestMac]).toEqual(["169.254.0.21", "169.254.0.22", 30, "06:00:a9:fe:00:15"]);
    expect(s.netnsPath).toBe("/run/netns/aenv-5");
  });

  test("only canonical <prefix><n> names are ours", () => {
    const cfg = resolveConfig({ prefix: "sb-", hostCidr: "10.9.0.0/24" });
    expect(slotIdOf(cfg, "sb-7")).toBe(7);
    expect(slotIdOf(cfg, "sb-07")).toBeUndefined();
    expect(slotIdOf(cfg, "sb-x")).toBeUndefined();
    expect(slotIdOf(cfg, "sb-128")).toBeUndefined(); // a /24 holds slots 0..127
    expect(slotIdOf(cfg, "aenv-1")).toBeUndefined();
    expect(slotIdOf(cfg, "eth0")).toBeUndefined();
  });

  test("bad settings are refused", () => {
    expect(() => resolveConfig({ hostCidr: "10.200.0.1/16" })).toThrow(/host bits/);
    expect(() => resolveConfig({ hostCidr: "10.200.0.0/32" })).toThrow(/1\.\.31/);
    expect(() => resolveConfig({ prefix: "a*" })).toThrow(NetworkError);
    expect(() => resolveConfig({ prefix: "averyveryverylong" })).toThrow(/no room/);
    expect(() => resolveConfig({ hostTable: "x;y" })).toThrow(NetworkError);
    expect(() => resolveConfig({ guestMac: "zz:00:00:00:00:00" })).toThrow(NetworkError);
    // Names must fit 15 bytes: a 12-byte prefix leaves room for slots 0..999.
    expect(resolveConfig({ prefix: "abcdefghijk-" }).maxSlots).toBe(1000);
  });

  test("IPv4 helpers", () => {
    expect(formatIpv4(parseIpv4("192.168.10.255"))).toBe("192.168.10.255");
    expect(() => parseIpv4("1.2.3.256")).toThrow(NetworkError);
    expect(cidrsOverlap(parseCidr("10.200.0.0/16"), parseCidr("10.200.7.0/24"))).toBe(true);
    expect(cidrsOverlap(parseCidr("10.200.0.0/16"), parseCidr("10.201.0.0/16"))).toBe(false);
  });
});

describe("rulesets", () => {
  const cfg = resolveConfig({ prefix: "sb-", hostCidr: "10.9.0.0/24", hostTable: "sbtab" });
  test("host table replaces itself atomically and confines slots", () => {
    const text = hostRuleset(cfg);
    expect(text.startsWith("add table inet sbtab\ndelete table inet sbtab\ntable inet sbtab {")).toBe(true);
    expect(text).toContain(`iifname "sb-*" oifname "sb-*" counter name "slot_to_slot" drop`);
    expect(text).toContain(`iifname "sb-*" jump egress`);
    expect(text).toContain(`iifname "sb-*" counter name "slot_to_host" reject`);
  });
  test("namespace table DNATs to the guest, masquerades it, and lets only the host in", () => {
    const text = slotRuleset(cfg, slotFor(cfg, 3));
    expect(text).toContain(`iifname "vpeer" ip daddr 10.9.0.7 dnat ip to 169.254.0.21`);
    expect(text).toContain(`oifname "vpeer" ip saddr 169.254.0.21 masquerade`);
    expect(text).toContain(`iifname "vpeer" ip saddr != 10.9.0.6 drop`);
    expect(text).toContain(`iifname "tap0" ip saddr != 169.254.0.21 drop`);
  });
  test("namespace ruleset replaces the whole ruleset; only a SYN opens a connection; input is closed", () => {
    const text = slotRuleset(cfg, slotFor(cfg, 3));
    expect(text.startsWith("flush ruleset\ntable inet aenv_slot {")).toBe(true);
    expect(text).toContain(`ct state new tcp flags & (fin | syn | rst | ack) != syn drop`);
    expect(text).toMatch(/chain input \{\n\s+type filter hook input priority filter; policy drop;/);
  });
});
