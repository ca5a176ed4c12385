// What a node tells the cluster about itself beyond its counts: the URL gateways reach it at, and
// the bytes of each template's layers on its disk (the scheduler's cache bonus).
import { stat } from "node:fs/promises";
import { networkInterfaces } from "node:os";
import { localLayers, type TemplateRecord } from "../orchestrator/templates.ts";

/** The address it listens on when that is one address, else http://<first non-internal IPv4>:<port>, else loopback. */
export function advertisedUrl(host: string, port: number): string {
  if (host !== "0.0.0.0" && host !== "::") return `http://${host.includes(":") ? `[${host}]` : host}:${port}`;
  for (const list of Object.values(networkInterfaces())) {
    for (const a of list ?? []) if (a.family === "IPv4" && !a.internal) return `http://${a.address}:${port}`;
  }
  return `http://127.0.0.1:${port}`;
}

/** Each template's ID, alias and names with the bytes of its layer files here (a layer still remote counts 0). */
export async function cachedTemplateBytes(templates: TemplateRecord[]): Promise<Record<string, number>> {
  const out: Record<string, number> = {};
  const sizes = new Map<string, number>();
  for (const t of templates) {
    let bytes = 0;
    for (const path of localLayers(t.layers)) {
      let n = sizes.get(path);
      if (n === undefined) {
        n = await stat(path).then((s) => s.blocks * 512, () => 0);
        sizes.set(path, n);
      }
      bytes += n;
    }
    // Every way a create may name it: ID, alias, `name:tag` (a snapshot's `<id>:default`).
    for (const name of [t.id, ...(t.alias ? [t.alias] : []), ...t.names]) out[name] = bytes;
  }
  return out;
}

/** The iroh endpoint as peers in other hosts dial it: a wildcard bind address replaced by the advertised host. */
export function dialableEndpoint(self: { id: string; addrs: string[] }, apiUrl: string): { id: string; addrs: string[] } {
  const host = new URL(apiUrl).hostname;
  return { id: self.id, addrs: self.addrs.map((a) => a.replace(/^0\.0\.0\.0:/, `${host}:`)) };
}
