// `bun run node` as a user starts it, for the suites that drive a whole node from outside (the e2b
// SDK's acceptance test, the aenv CLI's): a fresh $AENV_HOME, loopback, and slot names, a run
// directory and a CIDR of its own so parallel runs never meet. The base template is built on
// first start into a cache shared by every run on this machine; later starts restore from it.
import { expect } from "bun:test";
import { mkdirSync, rmSync } from "node:fs";
import { join } from "node:path";
import { Sandbox } from "e2b";
import { SlotPool } from "../../src/network/index.ts";
import { guestCache } from "../../src/template/artifacts.ts";
import { stopBlockd } from "../blockdev/harness.ts";
import { scratchDir } from "../helpers/tmp.ts";
import { sandboxSkipReason } from "../orchestrator/harness.ts";
import { qemuPids, until } from "../vmm/harness.ts";
import { NODE_ENTRY, startService } from "../../services/cluster/procs.ts";

/** Lines of a test node's output kept (tests look for its start and recovery lines). */
const NODE_LOG_LINES = 100_000;

const ROOT = join(import.meta.dir, "../..");
export const TEMPLATE_CACHE = "/var/tmp/aenv-template-cache";
/** A first start builds base (minutes on 2 cores); later ones restore from the cache. */
export const FIRST_START_MS = 20 * 60_000;

/** Why a node cannot run its sandboxes here, or undefined when it can. */
export function nodeSkipReason(): string | undefined {
  return sandboxSkipReason() ?? (Bun.which("mmdebstrap") ? undefined : "mmdebstrap is missing: the base template cannot be built (see .ci/deps)");
}

export interface NodeProc {
  proc: ReturnType<typeof Bun.spawn>;
  base: string;
  log: string[];
}

export { until };

/** A JSON POST to a node's API with its key. */
export function postJson(n: NodeProc, key: string, path: string, body: unknown): Promise<Response> {
  return fetch(`${n.base}${path}`, { method: "POST", body: JSON.stringify(body), headers: { "x-api-key": key, "content-type": "application/json" } });
}

/** The e2b SDK's options for a node. */
export function sdkOpts(n: NodeProc, key: string) {
  return { apiKey: key, apiUrl: n.base, sandboxUrl: n.base, requestTimeoutMs: 180_000 };
}

/** The aenv CLI against a node, bounded by timeoutMs: its exit code and output. */
export async function aenvAt(n: NodeProc, key: string, args: string[], timeoutMs: number): Promise<{ code: number; out: string; err: string }> {
  const p = Bun.spawn([process.execPath, join(ROOT, "src/cli/aenv.ts"), ...args, "--url", n.base, "--api-key", key], { stdout: "pipe", stderr: "pipe", timeout: timeoutMs });
  const [out, err] = await Promise.all([new Response(p.stdout).text(), new Response(p.stderr).text()]);
  return { code: await p.exited, out, err };
}

/** One test file's node: its settings and where its state lives. */
export interface NodeSetup {
  /** Short and unique to this process: in names and metadata. */
  tag: string;
  home: string;
  runDir: string;
  env: Record<string, string | undefined> & { AENV_SLOT_PREFIX: string; AENV_SLOT_CIDR: string };
}

/**
 * Settings for a node of one test file: `name` (2-3 letters) and `octet` keep its slot names and
 * addresses apart from other files' nodes; `extra` adds or overrides settings.
 */
export function nodeSetup(name: string, octet: number, key: string, extra: Record<string, string> = {}): NodeSetup {
  const tag = ((process.pid + 3) % 46656).toString(36).padStart(3, "0");
  const home = scratchDir("node-home", { keep: true }); // removed by stopNode, once blockd's mounts are gone
  const runDir = `/run/aenv-test-${name}${tag}`;
  return {
    tag,
    home,
    runDir,
    env: {
      ...process.env,
      AENV_HOME: home,
      HOST: "127.0.0.1",
      PORT: "0",
      AENV_API_KEY: key,
      AENV_TEMPLATE_CACHE: TEMPLATE_CACHE,
      // The kernel and tools disk the other suites built, not a fresh build under this home.
      AENV_GUEST_CACHE: guestCache(),
      AENV_RUN_DIR: runDir,
      AENV_SLOT_PREFIX: `${name}${tag}-`,
      AENV_SLOT_CIDR: `10.${octet}.${process.pid % 250}.0/24`,
      AENV_SLOT_POOL: "2",
      // Forwarding is never switched on for this shared host's own interfaces.
      AENV_EGRESS_UPLINKS: "none",
      AENV_DEVICE_POOL: "2",
      ...extra,
    },
  };
}

/** Start the node and wait until /health says sandboxes can be created. */
export async function startNode(env: Record<string, string | undefined>, readyMs: number): Promise<NodeProc> {
  mkdirSync(TEMPLATE_CACHE, { recursive: true });
  // What `bun run node` runs, without a shell in between (so kill -9 reaches the node itself).
  const { proc, url, log } = await startService(NODE_ENTRY, env, { logLines: NODE_LOG_LINES });
  const base = url;
  try {
    // /health: 503 with the step while starting, 200 once sandboxes can be created.
    const first = await fetch(`${base}/health`);
    expect([200, 503]).toContain(first.status);
    await until(async () => {
      if (proc.exitCode !== null) throw new Error(`node exited: ${log.slice(-30).join("\n")}`);
      const r = await fetch(`${base}/health`).catch(() => undefined);
      if (r?.status === 503) {
        const body = (await r.json()) as { message: string };
        if (body.message.startsWith("start failed")) throw new Error(body.message);
      }
      return r?.status === 200;
    }, readyMs, "node /health 200");
  } catch (e) {
    // A node that never got ready is not the caller's to stop: it goes here (its blockd and slots go with the caller's stopNode).
    proc.kill("SIGKILL");
    await proc.exited;
    throw e;
  }
  return { proc, base, log };
}

/**
 * Kill what the run left through the API (with `apiKey`, default the configured one), stop the
 * node and its blockd, remove its slots and state.
 */
export async function stopNode(node: NodeProc | undefined, s: NodeSetup, apiKey = s.env.AENV_API_KEY): Promise<void> {
  if (node) {
    const opts = { apiKey, apiUrl: node.base, sandboxUrl: node.base };
    try {
      for (const sbx of await Sandbox.list({ ...opts }).nextItems()) await Sandbox.kill(sbx.sandboxId, opts).catch(() => {});
    } catch {}
    node.proc.kill("SIGTERM");
    await node.proc.exited;
  }
  for (const pid of qemuPids(s.runDir)) try { process.kill(pid, "SIGKILL"); } catch {}
  await stopBlockd(join(s.home, "blockd"));
  // The node leaves its slots for sandboxes that outlive it; this run's are removed here.
  const prefix = s.env.AENV_SLOT_PREFIX;
  const slots = new SlotPool({ size: 0, prefix, hostCidr: s.env.AENV_SLOT_CIDR, hostTable: `${prefix.replace(/[^A-Za-z0-9]/g, "_")}host` });
  await slots.start().then(() => slots.destroy()).catch((e) => console.error(`slot cleanup: ${(e as Error).message}`));
  rmSync(s.home, { recursive: true, force: true });
  rmSync(s.runDir, { recursive: true, force: true });
}
