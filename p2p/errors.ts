// Named errors of the peer layer protocol. Each says which peer, which layer and why; the ones a
// PeerChunkSource rejects with are SourceErrors, so the remote file reader knows whether asking
// the same peer again could help.

import { SourceError } from "../src/storage/remote/source.ts";

/** A peer's failure to answer a request: timeout, lost connection, short data, protocol error. */
export class PeerError extends SourceError {
  override name = "PeerError";
  constructor(
    message: string,
    /** The peer's endpoint ID ("" for the local side). */
    readonly peerId: string,
    retryable = true,
  ) {
    super(peerId ? `peer ${peerId.slice(0, 10)}: ${message}` : message, retryable);
  }
}

/** A frame that does not follow docs/p2p.md: bad length, not JSON, unknown op, bad field. */
export class MalformedFrameError extends PeerError {
  override name = "MalformedFrameError";
  constructor(message: string, peerId = "") {
    super(`malformed frame: ${message}`, peerId, false);
  }
}

/** The peer does not hold a verified copy of the layer. */
export class UnknownDigestError extends PeerError {
  override name = "UnknownDigestError";
  constructor(readonly digest: string, peerId = "") {
    super(`unknown layer ${digest}`, peerId, false);
  }
}

/** A read asked for more than one request may carry, or past the layer's end. */
export class PeerRangeError extends PeerError {
  override name = "PeerRangeError";
  constructor(message: string, peerId = "") {
    super(message, peerId, false);
  }
}

/** The request did not finish within its deadline. */
export class PeerTimeoutError extends PeerError {
  override name = "PeerTimeoutError";
  constructor(what: string, readonly ms: number, peerId = "") {
    super(`${what} took longer than ${ms} ms`, peerId, true);
  }
}

/** The peer's answer ended before the bytes it announced (a peer that died, or lied). */
export class ShortReadError extends PeerError {
  override name = "ShortReadError";
  constructor(readonly got: number, readonly want: number, peerId = "") {
    super(`short answer: ${got} of ${want} bytes`, peerId, true);
  }
}

/** The peer closed the connection because this endpoint is not on its allow-list. */
export class PeerRefusedError extends PeerError {
  override name = "PeerRefusedError";
  constructor(peerId: string, reason: string) {
    super(`refused the connection: ${reason}`, peerId, false);
  }
}

/** No peer (and no origin) could serve the layer. */
export class NoPeerError extends SourceError {
  override name = "NoPeerError";
  constructor(readonly digest: string, why: string) {
    super(`no peer serves ${digest}: ${why}`, false);
  }
}

/** A layer fetched from peers hashed to another digest: dropped, and its peers blamed. */
export class PeerDigestMismatchError extends SourceError {
  override name = "PeerDigestMismatchError";
  constructor(
    readonly digest: string,
    readonly actual: string,
    /** Every peer that served a range of the dropped copy; `peerId` is the first of them. */
    readonly peerIds: string[],
  ) {
    super(`layer ${digest} from peer(s) ${peerIds.map((p) => p.slice(0, 10)).join(", ")} hashed to ${actual}`, false);
  }
  get peerId(): string {
    return this.peerIds[0] ?? "";
  }
}
