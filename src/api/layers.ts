// `GET|HEAD /v1/layers/sha256:<hex>`: the layers this node holds verified (what it serves its iroh
// peers), for the other nodes of its cluster over plain HTTP (p2p/http_peers.ts), behind the API
// key. A GET takes one Range of at most MAX_LAYER_READ bytes and streams it from the file.
import { Elysia, t } from "elysia";
import { ApiError, errorResponses, notFound } from "./errors.ts";

/** HEAD's answer: the layer's size (a HEAD's content-length is not kept by every server on the way). */
export const LAYER_SIZE_HEADER = "x-aenv-layer-size";

/** One read's bound (a block cache fetch is 1–8 MiB; the peer reader asks 4 MiB). */
export const MAX_LAYER_READ = 16 << 20;

export interface LayerRoutesOptions {
  /** A verified file of the layer, or undefined when this node holds none. */
  provide: (digest: string) => Promise<{ path: string; size: number } | undefined>;
  /** Told the bytes of each range served (the node's aenv_p2p_served_bytes_total). */
  served?: (bytes: number) => void;
}

export function layerRoutes(o: LayerRoutesOptions) {
  const find = async (digest: string) => {
    const l = await o.provide(digest);
    if (!l) throw notFound(`layer ${digest} is not on this node`);
    return l;
  };
  const params = t.Object({ digest: t.String({ pattern: "^sha256:[0-9a-f]{64}$", description: "sha256:<64 hex>" }) });
  return new Elysia({ name: "layers" })
    // HEAD reaches this handler too (Elysia answers HEAD with the GET route): the size alone.
    .get("/v1/layers/:digest", async ({ params: p, request }) => {
      const l = await find(p.digest);
      if (request.method === "HEAD") return new Response(null, { status: 200, headers: { [LAYER_SIZE_HEADER]: String(l.size), "accept-ranges": "bytes" } });
      const r = /^bytes=(\d+)-(\d+)$/.exec(request.headers.get("range") ?? "");
      const start = r ? Number(r[1]) : NaN;
      const end = r ? Number(r[2]) : NaN;
      if (!(end >= start) || end - start + 1 > MAX_LAYER_READ || end >= l.size) throw new ApiError(416, `a Range of 1..${MAX_LAYER_READ} bytes inside the layer (${l.size} bytes) is required`);
      o.served?.(end - start + 1);
      return new Response(Bun.file(l.path).slice(start, end + 1), { status: 206, headers: { "content-range": `bytes ${start}-${end}/${l.size}`, "content-type": "application/octet-stream" } });
    }, {
      params,
      response: { 200: t.Unknown({ description: "HEAD: held; x-aenv-layer-size is its size" }), 206: t.Unknown({ description: "the range's bytes" }), ...errorResponses(401, 404, 416) },
      detail: { tags: ["layers"], summary: "aenv's: a Range of a layer this node holds verified (HEAD: its size), for the other nodes of its cluster" },
    });
}
