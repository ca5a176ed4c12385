// What the cluster tests share: free loopback ports, and etcd members for a describe block.
import { afterAll, beforeAll } from "bun:test";
import { createServer } from "node:net";
import { EtcdMembers } from "../../services/cluster/etcd.ts";
import { EtcdClient } from "../../src/cluster/etcd_client.ts";
import { scratchDir } from "../helpers/tmp.ts";

function portFree(port: number): Promise<boolean> {
  return new Promise((resolve) => {
    const s = createServer();
    s.once("error", () => resolve(false));
    s.listen(port, "127.0.0.1", () => s.close(() => resolve(true)));
  });
}

/** The first of `n` consecutive ports free on loopback now, from a random start in 20000..39999. */
export async function freePortBase(n: number): Promise<number> {
  for (let tries = 0; tries < 100; tries++) {
    const base = 20_000 + Math.floor(Math.random() * 20_000);
    let ok = true;
    for (let i = 0; i < n && ok; i++) ok = await portFree(base + i);
    if (ok) return base;
  }
  throw new Error(`no ${n} consecutive free ports found`);
}

/**
 * etcd members for one describe block: started before its tests (scratch data, free loopback
 * ports), stopped after, with a client on them. Call inside `describe`.
 */
export function etcdSuite(label: string, members: 1 | 3 = 1, timeoutMs?: number): { etcd: () => EtcdMembers; client: () => EtcdClient } {
  const dir = scratchDir(label);
  let etcd: EtcdMembers | undefined;
  let client: EtcdClient | undefined;
  beforeAll(async () => {
    etcd = await EtcdMembers.start({ dir, members, host: "127.0.0.1", basePort: await freePortBase(2 * members) });
    client = new EtcdClient(etcd.endpoints.split(","), timeoutMs);
  });
  afterAll(async () => {
    client?.close();
    await etcd?.stop();
  });
  return { etcd: () => etcd!, client: () => client! };
}

/** Why the etcd tests cannot run here, or undefined. */
export const etcdSkipReason = (): string | undefined => (Bun.which("etcd") ? undefined : "etcd is missing (Debian's etcd-server, see .ci/deps)");
