// A peer in its own process for the p2p tests and bench: serves the given layer files to the
// allow-listed endpoint IDs and prints `{"id","addrs"}` as one JSON line once it listens.
// Usage: bun test/p2p/peer_process.ts HOME ALLOW_ID[,ALLOW_ID…] LAYER_FILE…
import { LayerShelf, PeerNode } from "../../p2p/index.ts";

const [home, allow, ...files] = process.argv.slice(2);
if (!home || !allow) throw new Error("usage: peer_process.ts HOME ALLOW_IDS LAYER_FILE…");
const shelf = new LayerShelf();
for (const f of files) await shelf.add(f);
const node = await PeerNode.start({ home, bindAddr: "127.0.0.1:0", allow: allow.split(","), layers: shelf.provider });
console.log(JSON.stringify(node.self()));
process.on("SIGTERM", () => { node.close().finally(() => process.exit(0)); });
