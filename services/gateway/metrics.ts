// The gateway's counters, as Prometheus text on GET /metrics.
import type { ClusterView } from "./cluster_view.ts";

export class GatewayMetrics {
  readonly creates = { placed: 0, retried: 0, failed: 0, none: 0 };
  forwarded = 0;
  moved = 0;
  proxied = 0;

  text(view: ClusterView): string {
    const lines = [
      "# HELP aenv_gateway_creates_total Creates by outcome: placed, retried on another node, failed (no retry), none (no node took it).",
      "# TYPE aenv_gateway_creates_total counter",
      ...Object.entries(this.creates).map(([k, v]) => `aenv_gateway_creates_total{outcome="${k}"} ${v}`),
      "# HELP aenv_gateway_forwarded_total API calls forwarded to the owning node.",
      "# TYPE aenv_gateway_forwarded_total counter",
      `aenv_gateway_forwarded_total ${this.forwarded}`,
      "# HELP aenv_gateway_moved_total Paused sandboxes taken onto another node (their node left or drains).",
      "# TYPE aenv_gateway_moved_total counter",
      `aenv_gateway_moved_total ${this.moved}`,
      "# HELP aenv_gateway_proxied_total Requests into sandboxes relayed to their node.",
      "# TYPE aenv_gateway_proxied_total counter",
      `aenv_gateway_proxied_total ${this.proxied}`,
      "# HELP aenv_gateway_nodes Live nodes in the view.",
      "# TYPE aenv_gateway_nodes gauge",
      `aenv_gateway_nodes ${view.nodes.size}`,
      "# HELP aenv_gateway_bindings Sandbox bindings in the view.",
      "# TYPE aenv_gateway_bindings gauge",
      `aenv_gateway_bindings ${view.bindings.size}`,
      "# HELP aenv_gateway_lost_sandboxes Bindings whose node left the cluster.",
      "# TYPE aenv_gateway_lost_sandboxes gauge",
      `aenv_gateway_lost_sandboxes ${view.lost().length}`,
    ];
    return lines.join("\n") + "\n";
  }
}
