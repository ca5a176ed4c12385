// `bun run node`: the node on its settings (docs/node.md). It listens at once; /health answers 503
// with the step it is on (blockd, network slots, VMM, guest kernel, the base template) until it
// can create sandboxes, then 200. blockd and the VMMs outlive it: a stop leaves sandboxes running.
import { mkdirSync, readFileSync } from "node:fs";
import { rename, rm, writeFile } from "node:fs/promises";
import { hostname } from "node:os";
import { join } from "node:path";
import { debianKernel, envdToolsDisk, guestCmdline, sealedLayer } from "../template/artifacts.ts";
import { createApi } from "../api/app.ts";
import { ApiError } from "../api/errors.ts";
import { SandboxProxy } from "../api/proxy.ts";
import { serveNode } from "../api/server.ts";
import { nodeRoutes } from "../api/nodes.ts";
import { sandboxRoutes } from "../api/sandboxes.ts";
import { templateRoutes } from "../api/templates.ts";
import { volumeRoutes } from "../api/volumes.ts";
import { VolumeStore } from "../orchestrator/volumes.ts";
import { volumeLayers } from "./volume_layers.ts";
import { ClusterVolumes, sharesVolumes } from "./volume_cluster.ts";
import { secretRoutes } from "../api/secrets.ts";
import { TemplateBuilder } from "../orchestrator/builder.ts";
import { defaultDockerConfigPath } from "../template/registry.ts";
import { nodeImages, remoteLayerView, type NodeRemoteLayers } from "./images.ts";
import { RegistryAuthFiles } from "./registry_auth.ts";
import { sandboxUpperBytes } from "./upper_usage.ts";
import { NodePeers, facadeSocket, parsePeers } from "./peers.ts";
import { ClusterMember } from "./cluster.ts";
import { advertisedUrl, cachedTemplateBytes, dialableEndpoint } from "./cluster_info.ts";
import { EtcdClient } from "../cluster/etcd_client.ts";
import { MAX_LAYER_DIGESTS } from "../cluster/records.ts";
import { HttpPeers } from "../../p2p/http_peers.ts";
import { layerRoutes } from "../api/layers.ts";
import { BlockdClient } from "../blockdev/client.ts";
import { Egress, EgressProxy, SecretStore, SlotPool, defaultUplinks, hostNetworks, hostResolvers, loadOrCreateCa } from "../network/index.ts";
import { Orchestrator, type SandboxRuntime } from "../orchestrator/orchestrator.ts";
import { SandboxStore } from "../orchestrator/store.ts";
import { TemplateStore, isRemoteLayer, type TemplateRecord } from "../orchestrator/templates.ts";
import { buildBaseTemplate } from "../template/debian.ts";
import { openSnapshotStore } from "../snapshot/index.ts";
import { selectDriver } from "../vmm/select.ts";
import { ConfigError, loadConfig, resolveApiKey, s3Scopes, type NodeConfig } from "./config.ts";
import { loadTls, type NodeTls } from "./tls.ts";
import pkg from "../../package.json";

/** The settings and the HTTPS files; a bad one ends the start with one line naming it (exit 2). */
function settings(): { cfg: NodeConfig; tls: NodeTls | undefined } {
  try {
    const cfg = loadConfig();
    return { cfg, tls: loadTls(cfg) };
  } catch (e) {
    if (!(e instanceof ConfigError)) throw e;
    console.error(`aenv node: ${e.message}`);
    process.exit(2);
  }
}
const { cfg, tls } = settings();
const { key, path: keyPath } = resolveApiKey(cfg);
/** The node's ID: in a cluster its key in etcd, and what GET /nodes names it. */
const nodeId = cfg.nodeId || hostname().toLowerCase().replace(/[^a-z0-9.-]/g, "-").slice(0, 63);
mkdirSync(cfg.home, { recursive: true });
const store = new SandboxStore(join(cfg.home, "node.db"));
const templates = new TemplateStore(store.db);
/** User secrets: the /secrets routes make them, header rules read them at egress (docs/secrets.md). */
const secrets = new SecretStore(join(cfg.home, "secrets"));

let step = "starting";
let orch: Orchestrator | undefined;
/** Volumes (docs/volumes.md): served once blockd is up, before the rest of the start. */
let volumes: VolumeStore | undefined;
let proxy: SandboxProxy | undefined;
let builder: TemplateBuilder | undefined;
let failed: string | undefined;
let peers: NodePeers | undefined;
let member: ClusterMember | undefined;
/** In a cluster: the other nodes, asked for layers over HTTP before the iroh peers. */
const httpPeers = cfg.cluster.length > 0 ? new HttpPeers(key) : undefined;
/** In a cluster: its store (etcd), for the node's membership and its shared volumes. */
const etcd = cfg.cluster.length > 0 ? new EtcdClient(cfg.cluster) : undefined;
const notReady = () => (orch ? undefined : failed ? `start failed at ${step}: ${failed}` : `starting: ${step}`);

const app = createApi({
  apiKey: key,
  maxBodyBytes: cfg.maxBodyBytes,
  notReadyReason: notReady,
  version: pkg.version,
})
  .use(sandboxRoutes(() => {
    if (!orch) throw new ApiError(503, notReady() ?? "starting");
    return orch;
  }, {
    domain: cfg.domain || null, defaultTimeoutS: cfg.defaultTimeoutS,
    placement: cfg.cluster.length > 0 ? {
      admit: () => {
        if (!member) throw new ApiError(503, notReady() ?? "joining the cluster");
        member.admit();
      },
      bind: (rec) => member!.bind(rec),
      adopt: (id) => {
        if (!member) throw new ApiError(503, notReady() ?? "joining the cluster");
        return member.adopt(id);
      },
      ensureTemplate: async (ref) => {
        if (!member || !orch || !builder || orch.templates.resolve(ref)) return;
        const t = await member.findTemplate(ref);
        if (t) await builder.importTemplate(t);
      },
    } : undefined,
    coldTemplate: (image, size) => {
      if (!builder) throw new ApiError(503, notReady() ?? "starting");
      return builder.coldTemplate(image, size);
    },
  }))
  // keepOpen: Bun's timeout(req) acts on the request's own connection, whichever listener (HTTP or HTTPS) took it.
  .use(templateRoutes(() => {
    if (!builder) throw new ApiError(503, notReady() ?? "starting");
    return builder;
  }, { keepOpen: (req) => server.timeout(req, 0), uploadUrlTtlS: cfg.uploadUrlTtlS }))
  .use(secretRoutes(secrets))
  .use(nodeRoutes({
    store, templates, orch: () => orch, status: () => (orch ? (member?.nodeStatus ?? "ready") : failed ? "unhealthy" : "connecting"),
    changeStatus: cfg.cluster.length > 0 ? async (status, pause) => {
      if (!member || !orch) throw new ApiError(503, notReady() ?? "joining the cluster");
      await member.setStatus(status);
      const out = { paused: 0, failed: [] as string[] };
      // Drained one at a time: each pause writes its memory layer (disk-bound), and new ones are refused meanwhile.
      if (pause) for (const r of store.all().filter((x) => x.state === "running")) {
        await orch.pause(r.id).then(() => out.paused++, (e) => out.failed.push(`${r.id}: ${(e as Error).message}`));
      }
      return out;
    } : undefined,
    openStreams: () => proxy?.streams.count(), version: pkg.version, home: cfg.home, nodeId, upperBytes: (id) => sandboxUpperBytes(cfg.home, id),
    p2p: async () => {
      if (!peers) return undefined;
      const st = await peers.stats();
      // Served: to iroh peers and, in a cluster, to the other nodes over HTTP.
      return { servedBytes: st.endpoint.bytesServed + st.httpServed, fetchedBytes: st.facade.bytes, misses: st.facade.misses };
    },
  }));
app.use(layerRoutes({
  provide: async (digest) => (peers && /^sha256:[0-9a-f]{64}$/.test(digest) ? peers.provide(digest as `sha256:${string}`) : undefined),
  served: (n) => peers?.countHttpServed(n),
}));
app.use(volumeRoutes(() => {
  if (!volumes) throw new ApiError(503, notReady() ?? "starting");
  return volumes;
}, { maxBodyBytes: cfg.maxBodyBytes }));
const server = serveNode(app, { hostname: cfg.host, port: cfg.port, proxy: () => proxy });
/** The same API and proxy over HTTPS, for the SDK's https:// URLs (docs/node.md, Public URLs). */
const tlsServer = tls ? serveNode(app, { hostname: cfg.host, port: cfg.tlsPort, proxy: () => proxy, tls }) : undefined;

const shown = cfg.host === "0.0.0.0" ? "127.0.0.1" : cfg.host;
console.log(`aenv node ${pkg.version} listening on http://${cfg.host}:${server.port}`);
console.log(`  API key:  ${keyPath ?? "from AENV_API_KEY"}`);
console.log(`  Swagger:  http://${shown}:${server.port}/swagger`);
if (tlsServer && tls) {
  console.log(`  HTTPS:    https://${cfg.host}:${tlsServer.port} (${tls.names}, until ${tls.notAfter.toISOString()}); sandboxes at https://{port}-{id}.${cfg.domain || "<the clients' domain>"}`);
  for (const w of tls.warnings) console.warn(`  HTTPS warning: ${w}`);
}
console.log(`  state:    ${cfg.home}`);

async function start(): Promise<void> {
  const t0 = performance.now();
  // /health always shows the latest step; the log gets a line per new step, or every 5 s within one.
  let logged = "";
  let loggedAt = 0;
  const progress = (s: string, detail = "") => {
    step = detail ? `${s} (${detail})` : s;
    const now = performance.now();
    if (s === logged && now - loggedAt < 5000) return;
    logged = s;
    loggedAt = now;
    console.log(`  [${((now - t0) / 1000).toFixed(1)} s] ${step}`);
  };
  progress("blockd");
  mkdirSync(join(cfg.home, "blockd"), { recursive: true });
  const blockd = await BlockdClient.ensure(join(cfg.home, "blockd"), {
    pool: cfg.devicePool, settings: { frontend: cfg.blockdFrontend, fuseUring: cfg.fuseUring, fuseReaderSlots: cfg.fuseReaderSlots },
  });
  // The node's S3 settings: the snapshot store's, s3:// images', and the credentials S3 origins get at each use.
  const s3 = { endpoint: cfg.s3Endpoint, region: cfg.s3Region, accessKeyId: cfg.s3AccessKeyId, secretAccessKey: cfg.s3SecretAccessKey, sessionToken: cfg.s3SessionToken };
  // Snapshots: a directory or S3; with peers, a snapshot's shared files are asked of them first.
  const snapshots = openSnapshotStore(cfg.snapshotStore, {
    home: cfg.home,
    s3,
    fromPeers: (sha256, size, dest, signal) => peers?.fetchBlob(sha256, size, dest, signal) ?? Promise.resolve(false),
  });
  progress("volumes");
  // In a cluster sharing the snapshot store, volumes are the cluster's: records in etcd, layers in the store.
  const sharedVolumes = etcd && sharesVolumes(cfg)
    ? new ClusterVolumes({ etcd, store: snapshots, nodeId, leaseFile: join(cfg.home, "volume-lease"), log: (line) => console.log(`  ${line}`) })
    : undefined;
  await sharedVolumes?.start();
  // A device the last process left open is sealed, one whose sandbox is gone let go (docs/volumes.md).
  const vols = new VolumeStore(store.db, blockd, {
    dir: join(cfg.home, "volumes"), sizeMB: cfg.volumeSizeMB, ...volumeLayers(join(cfg.home, "volumes"), blockd), shared: sharedVolumes,
  });
  await vols.start((id) => store.get(id) !== undefined);
  volumes = vols;
  progress("network slots");
  const slots = new SlotPool({ size: cfg.slotPool, hostCidr: cfg.slotCidr, prefix: cfg.slotPrefix, hostTable: `${cfg.slotPrefix.replace(/[^A-Za-z0-9]/g, "_")}host` });
  // Slots of sandboxes that kept running while the node was down are kept; the rest rebuilt.
  await slots.start({ adopt: Orchestrator.slotsInUse(store) });
  progress("egress");
  const list = (v: string) => v.split(",").map((x) => x.trim()).filter(Boolean);
  const resolvers = cfg.egressResolvers ? list(cfg.egressResolvers) : await hostResolvers();
  // The CA every guest trusts (header rules that terminate TLS); header rules' secrets from the user secrets.
  const egressCa = loadOrCreateCa(join(cfg.home, "egress-ca"));
  const egressProxy = new EgressProxy({
    port: cfg.egressProxyPort, resolvers, ca: egressCa, secrets,
    upstreamCa: cfg.egressExtraCa ? [readFileSync(cfg.egressExtraCa, "utf8")] : undefined,
  }).listen();
  const egress = new Egress(slots.config, {
    // The node's own LANs too: other nodes and routers are not the internet.
    alwaysDenied: [...list(cfg.egressAlwaysDenied), ...(await hostNetworks(slots.config))], resolvers, proxyPort: egressProxy.port,
    uplinks: cfg.egressUplinks === "none" ? [] : cfg.egressUplinks ? list(cfg.egressUplinks) : await defaultUplinks(),
  });
  egressProxy.use(egress);
  await egress.start();
  // Remote layers (lazily pulled overlaybd images): the block cache blockd's workers share, and
  // the registry auth files their reads carry, kept fresh for every remote layer in use.
  const cache = { dir: cfg.blockCacheDir, capacity: cfg.blockCacheMB * 2 ** 20 };
  // Every registry client of the node: its Docker config, the registries it may reach insecurely, its blob bound.
  const registry = { dockerConfigPath: defaultDockerConfigPath(cfg.dockerConfig), insecureRegistries: cfg.insecureRegistries, maxBlobBytes: cfg.maxBlobMB * 2 ** 20 };
  const s3Buckets = s3Scopes(cfg);
  if (cfg.p2p) {
    progress("p2p");
    peers = await NodePeers.start({
      home: cfg.home, db: store.db, bindAddr: cfg.p2pBind, peers: parsePeers(cfg.p2pPeers), allow: list(cfg.p2pAllow),
      relayUrls: list(cfg.p2pRelays), cache, socketPath: facadeSocket(cfg.runDir), blobDirs: [snapshots.blobsDir], httpPeers,
    });
    console.log(`  p2p: endpoint ${peers.worker.id} on ${peers.worker.addrs().join(", ")}, ${peers.worker.peerIds().length} peers`);
  }
  // In a cluster blockd reads layers from the other nodes directly, with the cluster's key from this file (0600).
  let clusterHeadersFile: string | undefined;
  if (cfg.cluster.length > 0) {
    clusterHeadersFile = join(cfg.home, "secrets", "cluster-headers.json");
    mkdirSync(join(cfg.home, "secrets"), { recursive: true, mode: 0o700 });
    await rm(`${clusterHeadersFile}.tmp`, { force: true });
    await writeFile(`${clusterHeadersFile}.tmp`, JSON.stringify({ headers: { "x-api-key": key } }), { mode: 0o600, flag: "wx" });
    await rename(`${clusterHeadersFile}.tmp`, clusterHeadersFile);
  }
  const remote: NodeRemoteLayers = {
    cache, download: cfg.blockCacheDownload, peers, s3, s3Buckets, clusterHeadersFile,
    auth: new RegistryAuthFiles({ dir: join(cfg.home, "registry-auth"), secretsDir: join(cfg.home, "secrets", "registry"), registry }),
  };
  const inUse = [...templates.remoteLayers(), ...store.all().flatMap((r) => ((r.runtime as SandboxRuntime | null)?.layers ?? []).filter(isRemoteLayer))];
  for (const l of inUse) void remoteLayerView(l, remote);
  progress("VMM");
  const { driver, reason } = selectDriver({
    vmm: cfg.vmm, qemu: { binary: cfg.qemuBin, accel: cfg.qemuAccel === "auto" ? undefined : cfg.qemuAccel, tcgCacheMiB: cfg.qemuTcgCacheMB || undefined, nice: cfg.vmmNice, bootDirs: [cfg.guestCache] },
    firecracker: { binary: cfg.firecrackerBin, nice: cfg.vmmNice },
  });
  console.log(`  VMM: ${reason}`);
  progress("guest kernel and tools disk");
  const kernel = await debianKernel(cfg.guestCache);
  const toolsLayer = await sealedLayer(await envdToolsDisk(cfg.guestCache));
  if (!templates.resolve("base")) {
    progress("template base");
    const built = await buildBaseTemplate({
      cacheDir: cfg.templateCache,
      blockd,
      onProgress: (p) => progress(`template base: ${p.step}`, [p.bytes ? `${(p.bytes / 2 ** 20).toFixed(0)} MiB` : "", `${(p.elapsedMs / 1000).toFixed(0)} s`, p.detail ?? ""].filter(Boolean).join(", ")),
    });
    templates.insert({
      id: `base${built.key.slice(0, 12)}`, alias: "base", kind: "template", names: ["base:default"], cpuCount: built.cpuCount,
      memoryMB: built.memoryMB, diskSizeMB: built.diskSizeMB, layers: built.layers, checkpoint: null, sourceSandboxId: null,
      envdVersion: "0.6.13", createdAt: Date.now(),
    });
  }
  const o = new Orchestrator(store, templates, blockd, slots, driver, {
    kernel: kernel.vmlinux, initrd: kernel.initrd, toolsLayer,
    // The base image maps the hostname `sandbox` in /etc/hosts (sudo looks its host up).
    cmdline: (s) => guestCmdline({ ip: `${s.guestIp}/${s.guestPrefixLen}`, gw: s.gatewayIp, hostname: "sandbox", damonReclaim: kernel.damonReclaim }),
  }, { home: cfg.home, runRoot: join(cfg.runDir, "vms"), defaultTimeoutS: cfg.defaultTimeoutS, maxSandboxes: cfg.maxSandboxes, diskReserveBytes: cfg.diskReserveMB * 2 ** 20, maxDiskSizeMB: cfg.maxDiskSizeMB, preparedDevices: cfg.devicePool, balloonPressurePct: cfg.balloonPressurePct, memoryLayersMax: cfg.memoryLayersMax, memoryZfile: cfg.memoryZfile || undefined,
    snapshots, egress, caBundle: egressCa.certPem, remoteLayer: (l) => remoteLayerView(l, remote), volumes: vols,
    moves: cfg.cluster.length > 0 && cfg.resumeAnywhere ? { paused: (id) => member?.paused(id), resuming: (id) => member?.resuming(id) ?? Promise.resolve() } : undefined });
  const base = templates.resolve("base")!;
  if (!base.checkpoint) {
    progress("template base: boot and checkpoint");
    await o.prepareTemplate(base);
  }
  const recovered = await o.recover();
  if (recovered.adopted.length + recovered.lost.length + recovered.paused.length > 0)
    console.log(`  recovered: ${recovered.adopted.length} running, ${recovered.paused.length} paused, ${recovered.lost.length} lost`);
  const imported = await o.importSnapshots();
  if (imported.length) console.log(`  snapshots imported from the store: ${imported.length}`);
  o.warmUp();
  o.startReaper(cfg.reaperIntervalMs);
  proxy = new SandboxProxy(o, { domain: cfg.domain });
  // fromImage parents: pulled and converted into the node's layer cache (src/node/images.ts).
  const { source: images } = nodeImages({
    dir: join(cfg.home, "image-layers"), capacityMB: cfg.layerCacheMB, templates, sandboxes: store, blockd,
    registry, remote, s3, s3Buckets, maxBlobBytes: cfg.maxBlobMB * 2 ** 20, maxDiskSizeMB: cfg.maxDiskSizeMB,
  });
  builder = new TemplateBuilder(o, store.db, {
    filesDir: join(cfg.home, "template-files"), stepsDir: join(cfg.home, "template-steps"),
    maxConcurrent: cfg.maxBuilds, buildTimeoutMs: cfg.buildTimeoutS * 1000, stepCacheBytes: cfg.stepCacheMB * 2 ** 20, images,
    // In a cluster with a templates location: each template built here is pushed there and published for the other nodes.
    onReady: cfg.cluster.length > 0 && cfg.clusterTemplates ? (t) => void publishTemplate(t) : undefined,
  });
  if (cfg.cluster.length > 0) {
    progress("cluster");
    const apiUrl = cfg.advertiseUrl || advertisedUrl(cfg.host, server.port!);
    member = new ClusterMember({
      etcd: etcd!, nodeId, apiUrl, version: pkg.version,
      home: cfg.home, leaseFile: join(cfg.home, "cluster-lease"), maxSandboxes: cfg.maxSandboxes,
      layers: peers ? () => peers!.heldDigests(MAX_LAYER_DIGESTS) : undefined,
      sandboxes: () => store.all(), running: () => o.runningCount(), cached: () => cachedTemplateBytes(templates.list("template").concat(templates.list("snapshot"))),
      p2p: peers ? () => dialableEndpoint(peers!.worker.self(), apiUrl) : undefined,
      onPeers: peers ? (list, others) => {
        httpPeers?.setPeers(others);
        void peers!.worker.setPeers(list).catch((e) => console.error(`cluster: peers: ${(e as Error).message}`));
      } : undefined,
      log: (line) => console.log(`  ${line}`),
      moves: cfg.resumeAnywhere ? { exportPaused: (id) => o.exportPaused(id), adoptPaused: (id) => o.adoptPaused(id), dropMoved: (id) => o.dropMoved(id), forgetExport: (id) => o.forgetExport(id) } : undefined,
    });
    o.onRemoved((id) => member!.unbind(id));
    // Registers now when etcd answers; otherwise the node serves what it runs and keeps trying.
    await member.start().catch((e) => console.error(`  cluster: not registered yet: ${(e as Error).message}`));
  }
  orch = o;
  progress(`ready (${((performance.now() - t0) / 1000).toFixed(1)} s)`);
}

/** A template built here, pushed to AENV_CLUSTER_TEMPLATES and published in etcd (logged when it fails: it stays here only). */
async function publishTemplate(t: TemplateRecord): Promise<void> {
  const ref = `${cfg.clusterTemplates}/${t.id}:${(t.config?.buildId ?? "1").slice(0, 64)}`;
  try {
    const pushed = await builder!.push(t.id, ref);
    await member!.publishTemplate({
      layers: pushed.layers.map((l) => ({ digest: l.digest, size: l.size })),
      id: t.id, alias: t.alias ?? t.id, names: t.names, ref, cpuCount: t.cpuCount, memoryMB: t.memoryMB,
      ...(t.config?.startCmd ? { startCmd: t.config.startCmd } : {}), ...(t.config?.readyCmd ? { readyCmd: t.config.readyCmd } : {}),
    });
    console.log(`  cluster: template ${t.alias ?? t.id} (${t.id}) pushed to ${ref}`);
  } catch (e) {
    console.error(`  cluster: template ${t.id} not published (it stays on this node): ${(e as Error).message}`);
  }
}

start().catch((e) => {
  failed = (e as Error).message;
  console.error(`aenv node: start failed at ${step}: ${(e as Error).stack ?? e}`);
});

for (const sig of ["SIGINT", "SIGTERM"] as const) {
  process.on(sig, async () => {
    console.log(`aenv node: ${sig}: stopping (sandboxes, blockd and VMMs keep running)`);
    const builds = builder?.close();
    void member?.close();
    orch?.close();
    server.stop();
    tlsServer?.stop();
    // What operations left for after their answers (a pause's slot and device) is finished, and
    // build VMs are given back, for at most 10 s; what is left then is found by the next start.
    // In a cluster, volumes open for content calls are published too, for their claims lapse with this process.
    await Promise.race([Promise.all([orch?.settledCleanups(), builds, peers?.close(), volumes?.settle()]), Bun.sleep(10_000)]);
    store.close();
    process.exit(0);
  });
}
