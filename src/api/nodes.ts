// The node's own routes: Prometheus `GET /metrics` (no key, as E2B and AgentENV leave it open) and
// AgentENV's `GET /nodes` and `GET /nodes/{nodeID}`, which know this node only: a node is its
// own cluster, so the list has one entry and any other ID or clusterID is unknown.
import { Elysia, t } from "elysia";
import { randomUUID } from "node:crypto";
import { readFileSync } from "node:fs";
import { statfs } from "node:fs/promises";
import { cpus, freemem, hostname, totalmem } from "node:os";
import { ApiError, errorResponses, notFound } from "./errors.ts";
import { publicState, type SandboxStore } from "../orchestrator/store.ts";
import type { Orchestrator } from "../orchestrator/orchestrator.ts";
import type { TemplateStore } from "../orchestrator/templates.ts";

export type NodeStatus = "ready" | "connecting" | "unhealthy" | "draining" | "cordoned";

export interface NodeRoutesOptions {
  store: SandboxStore;
  templates: TemplateStore;
  /** The orchestrator once the node can create sandboxes. */
  orch: () => Orchestrator | undefined;
  /** ready; connecting while it starts; unhealthy when its start failed. */
  status: () => NodeStatus;
  /** Proxied requests in flight, once the proxy exists. */
  openStreams: () => number | undefined;
  /** Peer traffic counters, when the node has an iroh endpoint. */
  p2p?: () => Promise<{ servedBytes: number; fetchedBytes: number; misses: number } | undefined>;
  version: string;
  /** The state directory: its filesystem is the node's disk. */
  home: string;
  /**
   * In a cluster: sets whether the node takes new sandboxes (ready) or not (draining, cordoned);
   * `pause` also pauses its running sandboxes. Absent: the node is alone and the route answers 409.
   */
  changeStatus?: (status: "ready" | "draining" | "cordoned", pause: boolean) => Promise<{ paused: number; failed: string[] }>;
  /** This node's ID (its cluster ID in a cluster); default: the host name. */
  nodeId?: string;
  /** Bytes on disk of a sandbox's upper layer (aenv_sandbox_upper_bytes); unset: not exported. */
  upperBytes?: (sandboxId: string) => Promise<number>;
}

/** A node is its own cluster: E2B's cluster IDs are UUIDs, this one is the nil UUID. */
export const CLUSTER_ID = "00000000-0000-0000-0000-000000000000";

const ARCH: Record<string, string> = { x64: "x86_64", arm64: "aarch64" };

function machineInfo() {
  const info = { cpuFamily: "", cpuModel: "", cpuModelName: "", cpuArchitecture: ARCH[process.arch] ?? process.arch };
  try {
    const text = readFileSync("/proc/cpuinfo", "utf8");
    const field = (name: string) => new RegExp(`^${name}\\s*:\\s*(.*)$`, "m").exec(text)?.[1]?.trim() ?? "";
    Object.assign(info, { cpuFamily: field("cpu family"), cpuModel: field("model"), cpuModelName: field("model name") });
  } catch {
    // not Linux: the architecture only
  }
  return info;
}

/** The checkout's commit (12 hex digits), or "unknown" outside a git checkout. */
function gitCommit(): string {
  try {
    const r = Bun.spawnSync(["git", "rev-parse", "--short=12", "HEAD"], { cwd: import.meta.dir, stdout: "pipe", stderr: "ignore" });
    const out = r.stdout.toString().trim();
    return r.exitCode === 0 && out ? out : "unknown";
  } catch {
    return "unknown";
  }
}

/** The mount `path` lives on (longest mount point that prefixes it) from /proc/self/mounts. */
function mountOf(path: string): { mountPoint: string; device: string; filesystemType: string } {
  let best = { mountPoint: "/", device: "", filesystemType: "" };
  try {
    for (const line of readFileSync("/proc/self/mounts", "utf8").split("\n")) {
      const [device, mountPoint, filesystemType] = line.split(" ");
      if (!device || !mountPoint || !filesystemType) continue;
      const inside = path === mountPoint || path.startsWith(mountPoint.endsWith("/") ? mountPoint : `${mountPoint}/`);
      if (inside && mountPoint.length >= best.mountPoint.length) best = { mountPoint, device, filesystemType };
    }
  } catch {
    // no /proc: the root, unnamed
  }
  return best;
}

const Num = (description?: string) => t.Number(description ? { description } : {});
const NodeMetrics = t.Object({
  allocatedCPU: Num("vCPUs of the sandboxes that run (paused ones excluded)"), cpuPercent: Num("host CPU use since the previous call, %"),
  cpuCount: Num(), allocatedMemoryBytes: Num(), memoryUsedBytes: Num(), memoryTotalBytes: Num(),
  disks: t.Array(t.Object({ mountPoint: t.String(), device: t.String(), filesystemType: t.String(), usedBytes: Num(), totalBytes: Num() }), { description: "the filesystem of AENV_HOME" }),
  pausedAllocatedCPU: Num(), pausedAllocatedMemoryBytes: Num(),
});
const nodeFields = {
  version: t.String(), commit: t.String(), id: t.String({ description: "the host's name" }),
  serviceInstanceID: t.String({ description: "this run of the node (new at every start)" }), clusterID: t.String({ format: "uuid" }),
  machineInfo: t.Object({ cpuFamily: t.String(), cpuModel: t.String(), cpuModelName: t.String(), cpuArchitecture: t.String() }),
  status: t.Union([t.Literal("ready"), t.Literal("connecting"), t.Literal("unhealthy"), t.Literal("draining"), t.Literal("cordoned")], { description: "connecting while the node starts, unhealthy when its start failed; in a cluster draining or cordoned when it takes no new sandboxes" }),
  sandboxCount: Num("running"), sandboxPausedCount: Num(), metrics: NodeMetrics,
  createSuccesses: Num("creates (fork children too) since the node started"), createFails: Num(),
};
const Node = t.Object({ ...nodeFields, sandboxStartingCount: Num("being created") });
const HeldDevice = t.Object({
  id: t.String(), kind: t.String({ description: "pool, ro (read-only, shared) or rw" }), acquired: t.Boolean(), readOnly: t.Boolean(),
  holder: t.String({ description: "who holds it: a sandbox and what for, a memory stack's users, the tools disk, blockd's pool; \"orphan\": nobody (given back by the reaper's next sweep)" }),
}, { description: "a blockd device" });
const NodeDetail = t.Object({
  ...nodeFields,
  cachedBuilds: t.Array(t.String(), { description: "templates and snapshots this node restores from its own checkpoints" }),
  devices: t.Array(HeldDevice, { description: "blockd's devices with their holders (the leak report)" }),
}, { description: "this node" });
const ClusterQuery = t.Object({ clusterID: t.Optional(t.String({ description: `this node's is ${CLUSTER_ID}` })) });

export function nodeRoutes(o: NodeRoutesOptions) {
  const id = o.nodeId ?? hostname();
  const serviceInstanceID = randomUUID();
  const commit = gitCommit();
  const machine = machineInfo();
  // Host CPU times at the previous /nodes call: cpuPercent is measured since then (the first: since boot).
  let lastCpu = { busy: 0, total: 0 };

  const cpuPercent = () => {
    let busy = 0;
    let total = 0;
    for (const c of cpus()) {
      const all = c.times.user + c.times.nice + c.times.sys + c.times.irq + c.times.idle;
      total += all;
      busy += all - c.times.idle;
    }
    const pct = total > lastCpu.total ? Math.round(((busy - lastCpu.busy) / (total - lastCpu.total)) * 100) : 0;
    lastCpu = { busy, total };
    return pct;
  };

  const snapshot = async () => {
    const counts = { running: 0, starting: 0, paused: 0, cpu: 0, mem: 0, pausedCpu: 0, pausedMem: 0 };
    for (const r of o.store.all()) {
      const mem = r.memoryMB * 2 ** 20;
      if (publicState(r.state) === "paused") {
        counts.paused++;
        counts.pausedCpu += r.cpuCount;
        counts.pausedMem += mem;
        continue;
      }
      if (r.state === "creating") counts.starting++;
      else counts.running++;
      counts.cpu += r.cpuCount;
      counts.mem += mem;
    }
    const mount = mountOf(o.home);
    let disk = { usedBytes: 0, totalBytes: 0 };
    try {
      const fs = await statfs(o.home);
      disk = { usedBytes: (fs.blocks - fs.bfree) * fs.bsize, totalBytes: fs.blocks * fs.bsize };
    } catch {
      // no statfs: zeros
    }
    const creates = o.orch()?.creates ?? { successes: 0, fails: 0 };
    return {
      version: o.version, commit, id, serviceInstanceID, clusterID: CLUSTER_ID, machineInfo: machine, status: o.status(),
      sandboxCount: counts.running, sandboxPausedCount: counts.paused, sandboxStartingCount: counts.starting,
      metrics: {
        allocatedCPU: counts.cpu, cpuPercent: cpuPercent(), cpuCount: cpus().length, allocatedMemoryBytes: counts.mem,
        memoryUsedBytes: totalmem() - freemem(), memoryTotalBytes: totalmem(), disks: [{ ...mount, ...disk }],
        pausedAllocatedCPU: counts.pausedCpu, pausedAllocatedMemoryBytes: counts.pausedMem,
      },
      createSuccesses: creates.successes, createFails: creates.fails,
    };
  };

  const prometheus = async (): Promise<string> => {
    const by = new Map<string, number>();
    for (const r of o.store.all()) by.set(r.state, (by.get(r.state) ?? 0) + 1);
    const lines = ["# HELP aenv_sandboxes Sandboxes on this node by state.", "# TYPE aenv_sandboxes gauge"];
    for (const [state, n] of by) lines.push(`aenv_sandboxes{state="${state}"} ${n}`);
    lines.push("# HELP aenv_ready 1 once the node can create sandboxes.", "# TYPE aenv_ready gauge", `aenv_ready ${o.orch() ? 1 : 0}`);
    const creates = o.orch()?.creates;
    if (creates) {
      lines.push("# HELP aenv_sandbox_creates_total Sandbox creates (fork children too) since the node started, by result.", "# TYPE aenv_sandbox_creates_total counter");
      lines.push(`aenv_sandbox_creates_total{result="success"} ${creates.successes}`, `aenv_sandbox_creates_total{result="fail"} ${creates.fails}`);
    }
    if (o.upperBytes) {
      const rows = o.store.all();
      const bytes = await Promise.all(rows.map((r) => o.upperBytes!(r.id).catch(() => 0)));
      lines.push("# HELP aenv_sandbox_upper_bytes Bytes on disk of each sandbox's upper layer (its writes to its rootfs).", "# TYPE aenv_sandbox_upper_bytes gauge");
      rows.forEach((r, i) => lines.push(`aenv_sandbox_upper_bytes{sandbox="${r.id}"} ${bytes[i]}`));
    }
    const orphans = o.orch()?.orphansReclaimed;
    if (orphans !== undefined) lines.push("# HELP aenv_orphans_reclaimed_total blockd devices nobody held, given back by the reaper.", "# TYPE aenv_orphans_reclaimed_total counter", `aenv_orphans_reclaimed_total ${orphans}`);
    const streams = o.openStreams();
    if (streams !== undefined) lines.push("# HELP aenv_proxy_open_streams Proxied requests in flight.", "# TYPE aenv_proxy_open_streams gauge", `aenv_proxy_open_streams ${streams}`);
    const p2p = await o.p2p?.().catch(() => undefined);
    if (p2p) {
      lines.push("# HELP aenv_p2p_served_bytes_total Layer bytes this node served to peers.", "# TYPE aenv_p2p_served_bytes_total counter", `aenv_p2p_served_bytes_total ${p2p.servedBytes}`);
      lines.push("# HELP aenv_p2p_fetched_bytes_total Layer bytes blockd read from peers.", "# TYPE aenv_p2p_fetched_bytes_total counter", `aenv_p2p_fetched_bytes_total ${p2p.fetchedBytes}`);
      lines.push("# HELP aenv_p2p_fetch_misses_total Reads no peer could serve (blockd went to the origin).", "# TYPE aenv_p2p_fetch_misses_total counter", `aenv_p2p_fetch_misses_total ${p2p.misses}`);
    }
    return lines.join("\n") + "\n";
  };

  const tag = { tags: ["node"] };
  return new Elysia({ name: "nodes" })
    .get("/metrics", async () => new Response(await prometheus(), { headers: { "content-type": "text/plain; version=0.0.4" } }), {
      response: { 200: t.String({ description: "Prometheus text format 0.0.4: aenv_sandboxes{state}, aenv_ready, aenv_sandbox_creates_total{result}, aenv_sandbox_upper_bytes{sandbox}, aenv_proxy_open_streams, aenv_p2p_served_bytes_total, aenv_p2p_fetched_bytes_total, aenv_p2p_fetch_misses_total" }) },
      detail: {
        ...tag, summary: "Prometheus metrics (no API key)", security: [],
        responses: { 200: { description: "Prometheus text format 0.0.4: aenv_sandboxes{state}, aenv_ready, aenv_sandbox_creates_total{result}, aenv_sandbox_upper_bytes{sandbox}, aenv_proxy_open_streams, aenv_p2p_served_bytes_total, aenv_p2p_fetched_bytes_total, aenv_p2p_fetch_misses_total", content: { "text/plain": { schema: { type: "string" } } } } },
      },
    })
    .get("/nodes", async ({ query }) => (query.clusterID !== undefined && query.clusterID !== CLUSTER_ID ? [] : [await snapshot()]), {
      query: ClusterQuery,
      response: { 200: t.Array(Node, { description: "this node (none for another clusterID)" }), ...errorResponses(401, 500) },
      detail: { ...tag, summary: "The nodes: this one" },
    })
    .get("/nodes/:nodeID", async ({ params, query }) => {
      if (params.nodeID !== id || (query.clusterID !== undefined && query.clusterID !== CLUSTER_ID)) throw notFound(`node ${params.nodeID} not found: this node is ${id}`);
      const { sandboxStartingCount: _, ...node } = await snapshot();
      const devices = (await o.orch()?.devicesReport()) ?? [];
      return { ...node, cachedBuilds: [...o.templates.list("template"), ...o.templates.list("snapshot")].filter((x) => x.checkpoint).map((x) => x.id), devices };
    }, {
      params: t.Object({ nodeID: t.String({ minLength: 1, maxLength: 255 }) }),
      query: ClusterQuery,
      response: { 200: NodeDetail, ...errorResponses(400, 401, 404, 500) },
      detail: { ...tag, summary: "This node, with the builds it has cached and blockd's devices with their holders" },
    })
    .post("/nodes/:nodeID", async ({ params, body, set }) => {
      if (params.nodeID !== id || (body.clusterID !== undefined && body.clusterID !== CLUSTER_ID)) throw notFound(`node ${params.nodeID} not found: this node is ${id}`);
      if (!o.changeStatus) throw new ApiError(409, "this node is not in a cluster (AENV_CLUSTER): it has no placement status to change");
      if (body.status !== "ready" && body.status !== "draining" && body.status !== "cordoned") throw new ApiError(400, "status must be ready, draining or cordoned");
      if (body.pause && body.status === "ready") throw new ApiError(400, "pause goes with draining or cordoned");
      const r = await o.changeStatus(body.status, body.pause ?? false);
      set.status = 200;
      return { status: body.status, paused: r.paused, failed: r.failed };
    }, {
      params: t.Object({ nodeID: t.String({ minLength: 1, maxLength: 255 }) }),
      body: t.Object({
        status: t.String({ description: "ready, draining (no new sandboxes; E2B's) or cordoned (the same, set by an operator)" }),
        clusterID: t.Optional(t.String()),
        pause: t.Optional(t.Boolean({ description: "aenv's: also pause every running sandbox (they resume on this node)" })),
      }),
      response: {
        200: t.Object({ status: t.String(), paused: t.Number({ description: "sandboxes paused" }), failed: t.Array(t.String(), { description: "sandboxes whose pause failed, with why" }) }, { description: "the status is in force" }),
        ...errorResponses(400, 401, 404, 409, 500),
      },
      detail: { ...tag, summary: "Change this node's placement status (E2B's NodeStatusChange); draining with pause empties it" },
    });
}
