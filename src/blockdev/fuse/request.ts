// FuseRequest: one request being served and where its reply goes, however it came: read from
// /dev/fuse into a slot (fuse/server.ts) or delivered into a ring entry (fuse/uring.ts). Every
// view starts at its struct; the handler reads and writes only through these.

export class FuseRequest {
  /** Set by the handler when it returns a promise: bytes of reply arguments once the I/O is done. */
  reply = 0;
  /** WRITE: bytes written, for fuse_write_out (-1 otherwise). */
  written = -1;
  /** The serve loop's callbacks for this request's I/O, made once per slot or entry. */
  done?: () => void;
  fail?: (e: unknown) => void;

  constructor(
    /** fuse_in_header. */
    readonly head: DataView,
    /** The opcode's argument struct (fuse_read_in, fuse_write_in, ...). */
    readonly args: DataView,
    /** WRITE payload. */
    readonly data: Uint8Array,
    /** Where the reply's fuse_out_header goes. */
    readonly outHead: DataView,
    /** Reply arguments, READ data. */
    readonly out: Uint8Array,
    readonly outView: DataView,
  ) {}
}
