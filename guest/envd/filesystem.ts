// filesystem.Filesystem: stat/list/mkdir/move/remove on behalf of a user, plus inotify watches
// as a stream (WatchDir) or as a polled queue (CreateWatcher/GetWatcherEvents/RemoveWatcher).
import { cp, lstat, readdir, realpath, rename, rm, stat } from "node:fs/promises";
import { posix } from "node:path";
import { ConnectError, type Method, type RpcCtx } from "./connect.ts";
import { ensureDirs, entryInfo } from "./entry.ts";
import { EventType } from "./schema.ts";
import type { EnvdState } from "./state.ts";
import { resolvePath } from "./users.ts";
import { DirWatcher, isNetworkMount, type WatchEvent } from "./watch.ts";

type Msg = Record<string, unknown>;

const MAX_QUEUED_EVENTS = 10_000;

export class FilesystemService {
  private watchers = new Map<string, { watcher: DirWatcher; events: Msg[] }>();

  constructor(private state: EnvdState) {}

  private path(ctx: RpcCtx, p: unknown): string {
    return resolvePath(typeof p === "string" ? p : "", this.state.user(ctx.username), this.state.defaultWorkdir);
  }

  private entry(path: string, shown = path): Msg {
    return entryInfo(path, this.state.users, shown);
  }

  /** Lexical pre-order walk (like Go's filepath.WalkDir), not following symlinks below the root. */
  private async listDir(root: string, shown: string, depth: number): Promise<Msg[]> {
    const out: Msg[] = [];
    const walk = async (rel: string, level: number) => {
      let names: string[];
      try {
        names = (await readdir(rel ? `${root}/${rel}` : root)).sort((a, b) => Buffer.compare(Buffer.from(a), Buffer.from(b)));
      } catch (e) {
        if (!rel) throw e;
        return; // unreadable subdirectory
      }
      for (const name of names) {
        const childRel = rel ? `${rel}/${name}` : name;
        let isDir = false;
        try {
          out.push(this.entry(`${root}/${childRel}`, `${shown}/${childRel}`));
          isDir = (await lstat(`${root}/${childRel}`)).isDirectory();
        } catch {
          continue; // vanished while walking
        }
        if (isDir && level < depth) await walk(childRel, level + 1);
      }
    };
    await walk("", 1);
    return out;
  }

  /** Checks a watch target and arms a watcher on it. */
  private async watch(ctx: RpcCtx, req: Msg, onEvent: (ev: Msg) => void): Promise<DirWatcher> {
    const path = this.path(ctx, req.path);
    let st;
    try {
      st = await stat(path);
    } catch (e) {
      if ((e as { code?: string }).code === "ENOENT") throw new ConnectError("not_found", `path '${path}' does not exist`);
      throw e;
    }
    if (!st.isDirectory()) throw new ConnectError("invalid_argument", `path '${path}' is not a directory`);
    if (!req.allowNetworkMounts && (await isNetworkMount(path))) {
      throw new ConnectError("invalid_argument", `path '${path}' is on a network mount; set allowNetworkMounts to watch it`);
    }
    const includeEntry = req.includeEntry === true;
    const watcher = new DirWatcher(path, req.recursive === true, (ev: WatchEvent) => {
      const out: Msg = { name: ev.name, type: ev.type };
      if (includeEntry && (ev.type === EventType.CREATE || ev.type === EventType.WRITE || ev.type === EventType.CHMOD)) {
        try {
          out.entry = this.entry(`${path}/${ev.name}`);
        } catch {
          // gone already: best effort
        }
      }
      onEvent(out);
    });
    try {
      await watcher.start();
    } catch (e) {
      throw new ConnectError("internal", `failed to watch '${path}': ${(e as Error).message}`);
    }
    return watcher;
  }

  methods(): Record<string, Method> {
    return {
      Stat: {
        kind: "unary",
        input: "filesystem.StatRequest",
        output: "filesystem.StatResponse",
        handle: (req, ctx) => ({ entry: this.entry(this.path(ctx, req.path)) }),
      },
      MakeDir: {
        kind: "unary",
        input: "filesystem.MakeDirRequest",
        output: "filesystem.MakeDirResponse",
        handle: async (req, ctx) => {
          const path = this.path(ctx, req.path);
          const existing = await stat(path).catch(() => undefined); // undefined: does not exist yet
          if (existing?.isDirectory()) throw new ConnectError("already_exists", `directory '${path}' already exists`);
          if (existing) throw new ConnectError("invalid_argument", `path '${path}' already exists and is not a directory`);
          ensureDirs(path, this.state.user(ctx.username));
          return { entry: this.entry(path) };
        },
      },
      Move: {
        kind: "unary",
        input: "filesystem.MoveRequest",
        output: "filesystem.MoveResponse",
        handle: async (req, ctx) => {
          const src = this.path(ctx, req.source);
          const dst = this.path(ctx, req.destination);
          try {
            await lstat(src);
          } catch {
            throw new ConnectError("not_found", `source path '${src}' does not exist`);
          }
          ensureDirs(posix.dirname(dst), this.state.user(ctx.username));
          try {
            await rename(src, dst);
          } catch (e) {
            if ((e as { code?: string }).code !== "EXDEV") throw e;
            await cp(src, dst, { recursive: true, preserveTimestamps: true, verbatimSymlinks: true });
            await rm(src, { recursive: true, force: true });
          }
          return { entry: this.entry(dst) };
        },
      },
      ListDir: {
        kind: "unary",
        input: "filesystem.ListDirRequest",
        output: "filesystem.ListDirResponse",
        handle: async (req, ctx) => {
          const path = this.path(ctx, req.path);
          const depth = Math.max(1, Number(req.depth ?? 0));
          let real: string;
          try {
            real = await realpath(path);
          } catch (e) {
            if ((e as { code?: string }).code === "ENOENT") throw new ConnectError("not_found", `path '${path}' does not exist`);
            throw e;
          }
          if (!(await stat(real)).isDirectory()) throw new ConnectError("invalid_argument", `path '${path}' is not a directory`);
          return { entries: await this.listDir(real, path, depth) };
        },
      },
      Remove: {
        kind: "unary",
        input: "filesystem.RemoveRequest",
        output: "filesystem.RemoveResponse",
        handle: async (req, ctx) => {
          await rm(this.path(ctx, req.path), { recursive: true, force: true });
          return {};
        },
      },
      WatchDir: {
        kind: "server",
        input: "filesystem.WatchDirRequest",
        output: "filesystem.WatchDirResponse",
        keepalive: { keepalive: {} },
        handle: async (req, ctx, send) => {
          const watcher = await this.watch(ctx, req, (ev) => send({ filesystem: ev }));
          send({ start: {} });
          try {
            await new Promise<void>((resolve) => {
              if (ctx.signal.aborted) resolve();
              else ctx.signal.addEventListener("abort", () => resolve(), { once: true });
            });
          } finally {
            watcher.close();
          }
        },
      },
      CreateWatcher: {
        kind: "unary",
        input: "filesystem.CreateWatcherRequest",
        output: "filesystem.CreateWatcherResponse",
        handle: async (req, ctx) => {
          const events: Msg[] = [];
          const watcher = await this.watch(ctx, req, (ev) => {
            events.push(ev);
            if (events.length > MAX_QUEUED_EVENTS) events.shift(); // an abandoned watcher must not grow without bound
          });
          const id = crypto.randomUUID();
          this.watchers.set(id, { watcher, events });
          return { watcherId: id };
        },
      },
      GetWatcherEvents: {
        kind: "unary",
        input: "filesystem.GetWatcherEventsRequest",
        output: "filesystem.GetWatcherEventsResponse",
        handle: (req) => {
          const w = this.watchers.get(String(req.watcherId ?? ""));
          if (!w) throw new ConnectError("not_found", `watcher '${req.watcherId ?? ""}' not found`);
          return { events: w.events.splice(0) };
        },
      },
      RemoveWatcher: {
        kind: "unary",
        input: "filesystem.RemoveWatcherRequest",
        output: "filesystem.RemoveWatcherResponse",
        handle: (req) => {
          const id = String(req.watcherId ?? "");
          const w = this.watchers.get(id);
          if (!w) throw new ConnectError("not_found", `watcher '${id}' not found`);
          w.watcher.close();
          this.watchers.delete(id);
          return {};
        },
      },
    };
  }
}
