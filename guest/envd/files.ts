// The /files HTTP API: download (identity or gzip, with Range), upload (multipart with many files,
// or one raw octet-stream body, optionally gzip-encoded), X-Metadata-* xattrs, and v1 URL signing.
import { constants, type Stats } from "node:fs";
import { open, stat, unlink, type FileHandle } from "node:fs/promises";
import { posix } from "node:path";
import { Readable } from "node:stream";
import { createGzip } from "node:zlib";
import { BodyTooLarge, readBounded } from "./body.ts";
import { ConnectError } from "./connect.ts";
import { entryInfo, META_PREFIX, readMetadata } from "./entry.ts";
import { boundaryOf, MultipartError, readMultipart } from "./multipart.ts";
import { StagedFile } from "./staging.ts";
import type { EnvdState } from "./state.ts";
import { xattr } from "./sys.ts";
import { resolvePath, type User } from "./users.ts";

/** /files/compose takes a JSON list of paths: 1 MiB is thousands of them. */
const MAX_COMPOSE_BODY = 1024 * 1024;
/** Files in one multipart upload: each is staged until the last part is in. */
const MAX_UPLOAD_FILES = 10_000;
/** Files whose size says 0 (/proc and the like) are read in chunks of this size. */
const READ_CHUNK = 64 * 1024;

export function httpError(status: number, message: string): Response {
  return Response.json({ code: status, message }, { status });
}

class HttpError extends Error {
  constructor(readonly status: number, message: string) {
    super(message);
  }
}

function timingSafeEqual(a: string, b: string): boolean {
  const x = Buffer.from(a);
  const y = Buffer.from(b);
  let diff = x.length ^ y.length;
  for (let i = 0; i < Math.max(x.length, y.length); i++) diff |= (x[i % x.length] ?? 0) ^ (y[i % y.length] ?? 0);
  return diff === 0 && x.length === y.length;
}

export function tokenMatches(given: string | null, token: string): boolean {
  return given !== null && timingSafeEqual(given, token);
}

/** Header token, else a v1 URL signature over "<path>:<op>:<username>:<token>[:<expiration>]". */
function checkSigning(req: Request, url: URL, op: "read" | "write", state: EnvdState) {
  const token = state.accessToken;
  if (!token) return;
  const header = req.headers.get("x-access-token");
  if (header !== null) {
    if (!tokenMatches(header, token)) throw new HttpError(401, "access token present in header but does not match");
    return;
  }
  const sig = url.searchParams.get("signature");
  if (!sig) throw new HttpError(401, "missing signature query parameter");
  const exp = url.searchParams.get("signature_expiration");
  const path = url.searchParams.get("path") ?? "";
  const user = url.searchParams.get("username") ?? "";
  const raw = `${path}:${op}:${user}:${token}${exp !== null ? `:${exp}` : ""}`;
  const expected = `v1_${new Bun.CryptoHasher("sha256").update(raw).digest("base64").replace(/=+$/, "")}`;
  if (!timingSafeEqual(sig, expected)) throw new HttpError(401, "invalid signature");
  if (exp !== null && !(Number(exp) >= Date.now() / 1000)) throw new HttpError(401, "signature is already expired");
}

function fileUser(url: URL, state: EnvdState): User {
  const name = url.searchParams.get("username") || state.defaultUser;
  if (!name) throw new HttpError(400, "no user specified and no default user is set");
  const u = state.users.lookup(name);
  if (!u) throw new HttpError(401, `error looking up user '${name}': user: unknown user ${name}`);
  return u;
}

function resolve(p: string, user: User, state: EnvdState): string {
  try {
    return resolvePath(p, user, state.defaultWorkdir);
  } catch (e) {
    throw new HttpError(400, (e as Error).message);
  }
}

/** Picks the response encoding from Accept-Encoding; undefined means nothing acceptable (406). */
function negotiate(accept: string | null): "gzip" | "identity" | undefined {
  if (!accept) return "identity";
  const q = new Map<string, number>();
  for (const part of accept.split(",")) {
    const [name, ...params] = part.trim().toLowerCase().split(";");
    if (!name) continue;
    const qp = params.map((p) => p.trim()).find((p) => p.startsWith("q="));
    q.set(name, qp ? Number(qp.slice(2)) || 0 : 1);
  }
  const gzip = q.get("gzip") ?? q.get("*") ?? 0;
  const identity = q.get("identity") ?? (q.has("*") ? q.get("*")! : 1);
  if (gzip > 0) return "gzip";
  return identity > 0 ? "identity" : undefined;
}

function disposition(name: string): string {
  return /^[\x20-\x7e]*$/.test(name) && !/["\\]/.test(name)
    ? `inline; filename="${name}"`
    : `inline; filename*=utf-8''${encodeURIComponent(name)}`;
}

async function statOf(path: string): Promise<Stats> {
  try {
    return await stat(path);
  } catch (e) {
    const code = (e as { code?: string }).code;
    if (code === "ENOENT" || code === "ENOTDIR") throw new HttpError(404, `path '${path}' does not exist`);
    throw e;
  }
}

/**
 * Opens a file that stat said is regular. Non-blocking, so a /proc file with nothing to say
 * (/proc/kmsg) answers EAGAIN instead of holding a thread; the fd is checked to still be a file.
 */
async function openRegular(path: string): Promise<FileHandle> {
  const fh = await open(path, constants.O_RDONLY | constants.O_NONBLOCK | constants.O_NOCTTY);
  try {
    if (!(await fh.stat()).isFile()) throw new HttpError(400, `path '${path}' is not a regular file`);
    return fh;
  } catch (e) {
    await fh.close().catch(() => {});
    throw e;
  }
}

/** The next chunk of a non-blocking read; null at the end, or where going on would block (EAGAIN). */
async function readChunk(fh: FileHandle): Promise<Uint8Array | null> {
  const buf = new Uint8Array(READ_CHUNK);
  try {
    const { bytesRead } = await fh.read(buf, 0, READ_CHUNK, null);
    return bytesRead ? buf.subarray(0, bytesRead) : null;
  } catch (e) {
    if ((e as { code?: string }).code === "EAGAIN") return null;
    throw e;
  }
}

/** Streams the fd (after `first`, already read) as the client pulls, and closes it at the end or on cancel. */
function fileStream(fh: FileHandle, first?: Uint8Array): ReadableStream<Uint8Array> {
  let open = true;
  const close = () => {
    if (open) void fh.close().catch(() => {});
    open = false;
  };
  return new ReadableStream<Uint8Array>({
    start(c) {
      if (first) c.enqueue(first);
    },
    async pull(c) {
      try {
        const chunk = await readChunk(fh);
        if (chunk) return c.enqueue(chunk);
        close();
        c.close();
      } catch (e) {
        close();
        c.error(e);
      }
    },
    cancel: close,
  });
}

export async function getFile(req: Request, url: URL, state: EnvdState): Promise<Response> {
  try {
    checkSigning(req, url, "read", state);
    const user = fileUser(url, state);
    const path = resolve(url.searchParams.get("path") ?? "", user, state);
    const st = await statOf(path);
    if (st.isDirectory()) throw new HttpError(400, `path '${path}' is a directory`);
    // Devices and FIFOs are never opened: they may never end, and opening some acts (a watchdog).
    if (!st.isFile()) throw new HttpError(400, `path '${path}' is not a regular file`);
    const encoding = negotiate(req.headers.get("accept-encoding"));
    if (!encoding) throw new HttpError(406, "no acceptable content encoding");
    const headers = new Headers({
      "Content-Type": Bun.file(path).type || "application/octet-stream",
      "Content-Disposition": disposition(posix.basename(path)),
      Vary: "Accept-Encoding",
    });
    if (encoding === "gzip") {
      headers.set("Content-Encoding", "gzip");
      // Level 1: the link to the host is fast, guest CPU is the scarce resource.
      const gz = Readable.fromWeb(fileStream(await openRegular(path)) as never).pipe(createGzip({ level: 1 }));
      return new Response(Readable.toWeb(gz) as unknown as ReadableStream, { headers });
    }
    headers.set("Accept-Ranges", "bytes");
    const range = /^bytes=(\d*)-(\d*)$/.exec(req.headers.get("range") ?? "");
    if (range && (range[1] || range[2])) {
      const size = st.size;
      let start = range[1] ? Number(range[1]) : Math.max(0, size - Number(range[2]));
      let end = range[1] && range[2] ? Math.min(Number(range[2]), size - 1) : size - 1;
      if (start >= size || start > end) {
        headers.set("Content-Range", `bytes */${size}`);
        return new Response(null, { status: 416, headers });
      }
      headers.set("Content-Range", `bytes ${start}-${end}/${size}`);
      return new Response(Bun.file(path).slice(start, end + 1), { status: 206, headers });
    }
    if (st.size > 0) return new Response(Bun.file(path), { headers }); // sent by Bun with its length
    // Size 0: empty, or a pseudo-file whose content only shows when read (and may never end).
    const fh = await openRegular(path);
    const first = await readChunk(fh).catch(async (e) => {
      await fh.close().catch(() => {});
      throw e;
    });
    if (!first) {
      await fh.close().catch(() => {});
      return new Response(new Uint8Array(0), { headers });
    }
    return new Response(fileStream(fh, first), { headers });
  } catch (e) {
    return fileError(e);
  }
}

function fileError(e: unknown): Response {
  if (e instanceof HttpError) return httpError(e.status, e.message);
  if (e instanceof MultipartError) return httpError(400, e.message);
  if (e instanceof BodyTooLarge) return httpError(413, e.message);
  if (e instanceof ConnectError) return httpError(e.code === "invalid_argument" ? 400 : e.code === "not_found" ? 404 : 500, e.message);
  const code = (e as { code?: string }).code;
  const msg = e instanceof Error ? e.message : String(e);
  if (code === "ENOSPC" || code === "EDQUOT") return httpError(507, `not enough disk space: ${msg}`);
  if (code === "EACCES" || code === "EPERM" || code === "EROFS") return httpError(403, msg);
  if (code === "EISDIR" || code === "ENOTDIR" || code === "ENAMETOOLONG" || code === "ELOOP" || code === "ERR_INVALID_ARG_VALUE") {
    return httpError(400, msg);
  }
  return httpError(500, msg);
}

/** X-Metadata-<Key>: value headers, validated like envd does (printable ASCII, size limits). */
function metadataFrom(req: Request): Record<string, string> {
  const out: Record<string, string> = {};
  let total = 0;
  for (const [k, v] of req.headers) {
    if (!k.toLowerCase().startsWith("x-metadata-")) continue;
    const key = k.slice("x-metadata-".length).toLowerCase();
    if (!key || !/^[\x20-\x7e]+$/.test(key) || !/^[\x20-\x7e]*$/.test(v)) throw new HttpError(400, `invalid metadata header '${k}'`);
    if (key.length > 246) throw new HttpError(400, `metadata key '${key}' is too long`);
    total += META_PREFIX.length + key.length + v.length;
    if (total > 4096) throw new HttpError(400, "metadata is too large");
    out[key] = v;
  }
  return out;
}

/** Replaces the whole user.e2b.* set on a file. */
function applyMetadata(path: string, meta: Record<string, string>) {
  try {
    for (const name of xattr.list(path)) if (name.startsWith(META_PREFIX)) xattr.remove(path, name);
  } catch (e) {
    if (Object.keys(meta).length) throw new HttpError(500, `failed to update metadata: ${(e as Error).message}`);
    return;
  }
  for (const [k, v] of Object.entries(meta)) {
    try {
      xattr.set(path, META_PREFIX + k, v);
    } catch (e) {
      throw new HttpError(500, `failed to set metadata: ${(e as Error).message}`);
    }
  }
}

/** The upload body, decompressed if needed; failures while reading it are the client's (400), not I/O errors. */
function requestBody(req: Request): ReadableStream<Uint8Array> {
  let body = req.body ?? new Blob([]).stream();
  const enc = (req.headers.get("content-encoding") ?? "").trim().toLowerCase();
  if (enc === "gzip") body = body.pipeThrough(new DecompressionStream("gzip"));
  else if (enc && enc !== "identity") throw new HttpError(400, `unsupported content encoding '${enc}'`);
  const reader = body.getReader();
  return new ReadableStream<Uint8Array>({
    async pull(c) {
      try {
        const { done, value } = await reader.read();
        if (done) c.close();
        else c.enqueue(value);
      } catch (e) {
        c.error(new HttpError(400, `invalid request body: ${(e as Error)?.message ?? e}`));
      }
    },
    cancel: (r) => reader.cancel(r),
  });
}

/**
 * POST /files. Every file of the request is staged (staging.ts) and the targets are replaced only
 * once the whole body has arrived and checked out: a refused request leaves every file as it was.
 */
export async function postFile(req: Request, url: URL, state: EnvdState): Promise<Response> {
  const staged: StagedFile[] = [];
  try {
    checkSigning(req, url, "write", state);
    const user = fileUser(url, state);
    const meta = metadataFrom(req);
    const queryPath = url.searchParams.get("path");
    const ct = req.headers.get("content-type") ?? "";
    const media = ct.split(";")[0]!.trim().toLowerCase();

    if (media === "application/octet-stream") {
      if (!queryPath) throw new HttpError(400, "path query parameter is required for octet-stream uploads");
      const body = requestBody(req);
      const f = await StagedFile.create(resolve(queryPath, user, state), user);
      staged.push(f);
      for await (const chunk of body) await f.write(chunk);
      await f.finish();
    } else if (media === "multipart/form-data") {
      const boundary = boundaryOf(ct);
      if (!boundary) throw new HttpError(400, "multipart boundary is missing");
      const body = requestBody(req);
      const seen = new Set<string>();
      await readMultipart(body, boundary, async (part) => {
        if (part.name !== "file") return null;
        const given = queryPath ?? part.filename;
        if (!given) throw new HttpError(400, "file part has no filename and no path was given");
        const path = resolve(given, user, state);
        if (seen.has(path)) throw new HttpError(400, `cannot write to the same path '${path}' twice in one request`);
        if (seen.size >= MAX_UPLOAD_FILES) throw new HttpError(400, `more than ${MAX_UPLOAD_FILES} files in one request`);
        seen.add(path);
        const f = await StagedFile.create(path, user);
        staged.push(f);
        return { write: (c: Uint8Array) => f.write(c), end: () => f.finish() };
      });
    } else {
      throw new HttpError(400, `unsupported content type '${media || "(none)"}'`);
    }
    if (!staged.length) throw new HttpError(400, "no file part in the request");

    const results: Record<string, unknown>[] = [];
    for (const f of staged) {
      await f.commit((p) => applyMetadata(p, meta));
      const out: Record<string, unknown> = { path: f.path, name: posix.basename(f.path), type: "file" };
      const stored = Object.keys(meta).length ? readMetadata(f.path) : {};
      if (Object.keys(stored).length) out.metadata = stored;
      results.push(out);
    }
    return Response.json(results);
  } catch (e) {
    for (const f of staged) await f.discard();
    return fileError(e);
  }
}

/** POST /files/compose: concatenates sources into destination (staged, like an upload), then removes the sources. */
export async function composeFiles(req: Request, state: EnvdState): Promise<Response> {
  let out: StagedFile | undefined;
  try {
    let body: { source_paths?: unknown; destination?: unknown; username?: unknown };
    const raw = await readBounded(req, MAX_COMPOSE_BODY);
    try {
      body = JSON.parse(new TextDecoder().decode(raw)) as typeof body;
    } catch {
      throw new HttpError(400, "invalid JSON body");
    }
    const sources = body?.source_paths;
    if (!Array.isArray(sources) || !sources.every((s) => typeof s === "string") || typeof body.destination !== "string") {
      throw new HttpError(400, "source_paths (string[]) and destination (string) are required");
    }
    const name = (typeof body.username === "string" && body.username) || state.defaultUser;
    const user = state.users.lookup(name);
    if (!user) throw new HttpError(401, `error looking up user '${name}': user: unknown user ${name}`);
    const srcs = sources.map((s: string) => resolve(s, user, state));
    const srcStats: Stats[] = [];
    for (const s of srcs) {
      const st = await statOf(s);
      if (!st.isFile()) throw new HttpError(400, `path '${s}' is not a regular file`);
      srcStats.push(st);
    }
    const dest = resolve(body.destination, user, state);
    const destStat = await stat(dest).catch(() => undefined);
    if (srcs.includes(dest) || (destStat && srcStats.some((s) => s.dev === destStat.dev && s.ino === destStat.ino))) {
      throw new HttpError(400, "destination cannot be one of the sources");
    }
    out = await StagedFile.create(dest, user);
    for (const s of srcs) for await (const chunk of fileStream(await openRegular(s))) await out.write(chunk);
    await out.commit();
    for (const s of srcs) await unlink(s).catch(() => {});
    const e = entryInfo(dest, state.users);
    return Response.json({ path: e.path, name: e.name, type: "file" });
  } catch (e) {
    await out?.discard();
    return fileError(e);
  }
}
