// `bun run gateway`: one E2B endpoint over the nodes of a cluster (docs/cluster.md). Stateless:
// what it knows comes from etcd (AENV_CLUSTER), so any number run side by side and a killed one
// loses nothing. Settings come from the environment only (a gateway has no home).
import { IDLE_TIMEOUT_S } from "../../src/api/server.ts";
import type { WsData } from "../../src/api/relay.ts";
import { EtcdClient } from "../../src/cluster/etcd_client.ts";
import { Reservations } from "../scheduler/reservations.ts";
import { gatewayApp } from "./app.ts";
import { ClusterView } from "./cluster_view.ts";
import { GatewayMetrics } from "./metrics.ts";
import { GatewaySandboxes } from "./sandboxes.ts";
import { GatewayVolumes } from "./volumes.ts";
import pkg from "../../package.json";

function env(name: string, fallback?: string): string {
  const v = process.env[name];
  if (v !== undefined && v !== "") return v;
  if (fallback !== undefined) return fallback;
  console.error(`aenv gateway: ${name} is required`);
  process.exit(2);
}

const cluster = env("AENV_CLUSTER");
const apiKey = env("AENV_API_KEY");
if (!/^[A-Za-z0-9._~-]{32,256}$/.test(apiKey)) {
  console.error("aenv gateway: AENV_API_KEY: expected 32..256 characters of A-Z a-z 0-9 . _ ~ - (the nodes' key)");
  process.exit(2);
}
const port = Number(env("PORT", "8080"));
const host = env("HOST", "0.0.0.0");
const cacheWeight = Number(env("AENV_CACHE_WEIGHT", "1.5"));

const etcd = EtcdClient.parse(cluster);
const view = new ClusterView(etcd, (l) => console.log(l));
const metrics = new GatewayMetrics();
const sandboxes = new GatewaySandboxes({ apiKey, view, reservations: new Reservations(etcd), metrics, placement: { cacheWeight } });
const volumes = new GatewayVolumes({ apiKey, view });
const { app, proxy, relays } = gatewayApp({ apiKey, maxBodyBytes: 1 << 20, version: pkg.version, domain: env("AENV_DOMAIN", ""), view, sandboxes, volumes, metrics });

const server = Bun.serve<WsData>({
  hostname: host,
  port,
  idleTimeout: IDLE_TIMEOUT_S,
  maxRequestBodySize: Number.MAX_SAFE_INTEGER,
  async fetch(req, srv) {
    const p = await proxy(req, srv);
    if (p === "upgraded") return undefined;
    return p ?? app.handle(req);
  },
  websocket: relays.websocket,
});
console.log(`aenv gateway ${pkg.version} listening on http://${host}:${server.port} (etcd ${cluster})`);
void view.start().then(() => console.log(`  cluster: ${view.nodes.size} nodes, ${view.bindings.size} sandboxes`));

for (const sig of ["SIGINT", "SIGTERM"] as const) {
  process.on(sig, () => {
    view.close();
    server.stop();
    process.exit(0);
  });
}
