// The gateway's answers to the volume routes (docs/volumes.md, In a cluster): a create to a ready
// node, a call on one volume to the node that holds it (its holder key, from the view), else to
// the first node that knows it (asked with the gateway's key: in a cluster sharing its snapshot
// store every node does). A content call's body streams through as it comes.
import { ApiError, notFound } from "../../src/api/errors.ts";
import { forwardedHeaders, relayHttp } from "../../src/api/relay.ts";
import type { NodeRecord } from "../../src/cluster/records.ts";
import type { ClusterView } from "./cluster_view.ts";
import { NODE_LIST_TIMEOUT_MS, NodeUnreachable, callNode, passOn } from "./upstream.ts";

export interface GatewayVolumesOptions {
  /** The cluster's API key: the gateway's own lookups carry it. */
  apiKey: string;
  view: ClusterView;
}

export class GatewayVolumes {
  constructor(private readonly o: GatewayVolumesOptions) {}

  /** Live nodes, ready ones first. */
  private nodes(): NodeRecord[] {
    const all = this.o.view.liveNodes();
    return [...all.filter((n) => n.status === "ready"), ...all.filter((n) => n.status !== "ready")];
  }

  /** POST /volumes: the first node that takes it; one refusing the connection or still starting (503) is passed over. */
  async create(req: Request, pathAndQuery: string, body: unknown): Promise<Response> {
    let last: Response | undefined;
    for (const node of this.nodes()) {
      let r: Response;
      try {
        r = await callNode(node, req, pathAndQuery, body, NODE_LIST_TIMEOUT_MS);
      } catch (e) {
        if (e instanceof NodeUnreachable && e.refused) continue;
        throw new ApiError(502, (e as Error).message);
      }
      if (r.status !== 503) return passOn(r);
      last = r;
    }
    if (last) return passOn(last);
    throw new ApiError(503, "no node is in the cluster");
  }

  /** A call on volume `id` (`content`: the volume-content API, its body relayed as it streams). */
  async byId(req: Request, pathAndQuery: string, id: string, body: unknown, content: boolean): Promise<Response> {
    if (content && !req.headers.get("authorization")?.startsWith("Bearer ")) throw new ApiError(401, "the volume's token must be sent as Authorization: Bearer <token>");
    const node = this.holder(id) ?? (await this.knowing(req, id));
    // The content API answers an unknown volume as it answers a wrong token.
    if (!node) throw content ? new ApiError(403, `the token does not open volume ${id}`) : notFound(`volume ${id} not found`);
    try {
      if (content) return await relayHttp(req, `${node.apiUrl}${pathAndQuery}`, forwardedHeaders(req), new AbortController(), () => {});
      return passOn(await callNode(node, req, pathAndQuery, body));
    } catch (e) {
      throw new ApiError(502, `node ${node.id} did not answer: ${(e as Error).message}`);
    }
  }

  /** The live node holding volume `id` for a sandbox or its content calls. */
  private holder(id: string): NodeRecord | undefined {
    const h = this.o.view.volumeHolders.get(id);
    return h ? this.o.view.nodes.get(h.node) : undefined;
  }

  /** The first node (ready ones first) whose GET /volumes/{id} is 200. */
  private async knowing(req: Request, id: string): Promise<NodeRecord | undefined> {
    const probe = new Request(req.url, { method: "GET", headers: { "x-api-key": this.o.apiKey } });
    for (const node of this.nodes()) {
      const r = await callNode(node, probe, `/volumes/${encodeURIComponent(id)}`, undefined, NODE_LIST_TIMEOUT_MS).catch(() => undefined);
      if (!r) continue;
      await r.arrayBuffer().catch(() => {});
      if (r.status === 200) return node;
    }
    return undefined;
  }
}
