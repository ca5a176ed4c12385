// sealedLayer on a thread of its own: it reads the raw image with synchronous reads, which would
// hold the node's event loop for the whole image (15-20 s for 2 GiB here, no timer firing).
import { sealedLayer } from "./artifacts.ts";

declare const self: Worker;

self.onmessage = async (ev: MessageEvent<{ image: string; out: string }>) => {
  try {
    self.postMessage({ ok: true, layer: await sealedLayer(ev.data.image, ev.data.out) });
  } catch (e) {
    const err = e as Error;
    self.postMessage({ ok: false, error: `${err.name}: ${err.message}` });
  }
};
