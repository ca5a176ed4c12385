// src/network: per-sandbox network slots (namespace + veth + TAP + nftables), pooled.
export { NetworkError, haveTool } from "./command.ts";
export {
  DEFAULT_GUEST_MAC,
  DEFAULT_HOST_CIDR,
  DEFAULT_HOST_TABLE,
  DEFAULT_PREFIX,
  GATEWAY_IP,
  GATEWAY_MAC,
  GUEST_IP,
  GUEST_PREFIX_LEN,
  SLOT_TABLE,
  resolveConfig,
  slotFor,
  type NetworkConfig,
  type NetworkConfigInput,
  type Slot,
} from "./addressing.ts";
export { DEFAULT_ACQUIRE_TIMEOUT_MS, MAX_WAITERS, SlotPool, type PoolStats, type ReconcileReport, type SlotPoolOptions } from "./pool.ts";
export { NAMESPACE_SYSCTLS, netnsExecArgv } from "./slot.ts";
export { HOST_COUNTERS, hostRuleset, slotRuleset } from "./rulesets.ts";
export { Egress, defaultUplinks, hostNetworks, hostResolvers, type AppliedPolicy, type EgressOptions } from "./egress.ts";
export {
  DEFAULT_ALWAYS_DENIED,
  MAX_RULES,
  OPEN_POLICY,
  PolicyError,
  PolicyMatcher,
  MAX_HEADERS_PER_RULE,
  MAX_HEADER_VALUE,
  MAX_PLACEHOLDERS_PER_VALUE,
  MAX_SECRET_NAME,
  SECRET_PLACEHOLDER,
  MAX_RULE_HOSTS,
  MAX_RULES_PER_HOST,
  hasDomainRules,
  parseEgressPolicy,
  parseInboundPolicy,
  redirectedPorts,
  rulesFor,
  secretNameProblem,
  type EgressPolicy,
  type HeaderValue,
  type HostRules,
  type InboundPolicy,
  type UpstreamProxy,
} from "./policy.ts";
export { resolve4 } from "./dns.ts";
export { EgressProxy, type Denial, type EgressProxyOptions, type SandboxEgressStats } from "./egress_proxy.ts";
export { MAX_SNIFF_BYTES, sniff, type Sniffed } from "./sniff.ts";
export { MAX_REQUEST_HEAD, RequestRewriter, type HeadDecision, type RequestHead } from "./http_rewrite.ts";
export { MAX_SECRETS, SECRET_METADATA_LIMITS, SecretStore, SecretStoreError, type SecretInfo } from "./secrets.ts";
export { Tunnel, type TunnelStep } from "./upstream.ts";
export { EgressCa, loadOrCreateCa, type LeafCert } from "./x509.ts";
