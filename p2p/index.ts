// p2p/: nodes share verified layers by content digest over iroh (docs/p2p.md).
export { PeerNode, DEFAULT_LIMITS, CLOSE_NOT_ALLOWED, CLOSE_SHUTDOWN } from "./node.ts";
export type { PeerConfig, LayerProvider, PeerLimits, PeerNodeOptions, PeerNodeStats, RequestOptions } from "./node.ts";
export { PeerChunkSource, DEFAULT_SOURCE_OPTIONS } from "./source.ts";
export type { PeerSourceOptions, FetchOptions, FetchResult } from "./source.ts";
export { PeerWorker, MAX_WORKER_CALLS } from "./worker.ts";
export type { PeerClient } from "./worker.ts";
export { LayerShelf, ShelfError, sha256OfFile, MAX_SHELF } from "./shelf.ts";
export { loadOrCreateSecretKey, keyPath, KeyFileError, KEY_BYTES } from "./key.ts";
export { LAYERS_ALPN, LAYERS_ALPN_BYTES, MAX_FRAME, MAX_HAVE, MAX_READ, WIRE_CHUNK, encodeFrame, readFrame, toNumbers } from "./protocol.ts";
export type { Request, Response, HaveEntry, ErrorCode } from "./protocol.ts";
export * from "./errors.ts";
