// envd entry point: `bun guest/envd/main.ts [--port N] ...`, or the `bun build --compile` binary in the guest.
import { dirname, join } from "node:path";
import { serve } from "./server.ts";
import { ENVD_VERSION, type EnvdOptions } from "./state.ts";

const USAGE = `usage: envd [options]
  --port N            listen port (default 49983; 0 picks a free one)
  --host ADDR         listen address (default 127.0.0.1; with --guest 0.0.0.0)
  --default-user U    user for requests that name none, until /init sets one (default root)
  --passwd FILE       passwd database (default /etc/passwd)
  --group FILE        group database (default /etc/group)
  --guest             own the machine: /init may set the clock, /run/e2b markers are written
  --setpriv FILE      util-linux setpriv for supplementary groups (default: setpriv in --tools, then /usr/bin)
  --tools DIR         the tools disk's bin: its sh stands in for a missing /bin/bash or /bin/sh, it goes last on PATH (default: bin/ next to envd)
  --trust-root DIR    /init's caBundle goes into DIR/usr/local/share/ca-certificates and DIR/etc/ssl/certs (default: / with --guest, else nowhere)
  -version, --version print the version and exit`;

function parse(argv: string[]): EnvdOptions {
  let host: string | undefined;
  const o: EnvdOptions = { port: 49983, host: "", defaultUser: "root", passwd: "/etc/passwd", group: "/etc/group", guest: false, tools: join(dirname(process.execPath), "bin") };
  for (let i = 0; i < argv.length; i++) {
    const a = argv[i]!;
    const [flag, inline] = a.includes("=") ? [a.slice(0, a.indexOf("=")), a.slice(a.indexOf("=") + 1)] : [a, undefined];
    const value = () => {
      const v = inline ?? argv[++i];
      if (v === undefined) throw new Error(`${flag} needs a value`);
      return v;
    };
    switch (flag) {
      case "--port": case "-port": {
        const p = Number(value());
        if (!Number.isInteger(p) || p < 0 || p > 65535) throw new Error("invalid --port");
        o.port = p;
        break;
      }
      case "--host": case "-host": host = value(); break;
      case "--default-user": o.defaultUser = value(); break;
      case "--passwd": o.passwd = value(); break;
      case "--group": o.group = value(); break;
      case "--guest": o.guest = true; break;
      case "--setpriv": o.setpriv = value(); break;
      case "--tools": o.tools = value(); break;
      case "--trust-root": o.trustRoot = value(); break;
      case "-version": case "--version":
        console.log(ENVD_VERSION);
        process.exit(0);
        break;
      case "-h": case "--help":
        console.log(USAGE);
        process.exit(0);
        break;
      default:
        throw new Error(`unknown argument ${a}`);
    }
  }
  // Until /init sets a token, envd runs anything as root for whoever reaches it: a host process
  // answers only this machine unless told otherwise; in the guest the host must reach it.
  o.host = host ?? (o.guest ? "0.0.0.0" : "127.0.0.1");
  if (o.guest) o.trustRoot ??= "/";
  return o;
}

let opts: EnvdOptions;
try {
  opts = parse(process.argv.slice(2));
} catch (e) {
  console.error(`envd: ${(e as Error).message}\n${USAGE}`);
  process.exit(2);
}

// One bad callback must never take down every sandbox session with it.
process.on("uncaughtException", (e) => console.error(`envd: uncaught: ${e?.stack ?? e}`));
process.on("unhandledRejection", (e) => console.error(`envd: unhandled rejection: ${(e as Error)?.stack ?? e}`));
process.umask(0o022); // files 0644, dirs 0755, whatever umask the launcher had

const { server, state, processes } = serve(opts);
if (!state.canSwitchUser) {
  console.error(`envd: not running as root: every process runs as uid ${process.getuid?.()} whatever user is requested`);
}
for (const sig of ["SIGTERM", "SIGINT"] as const) {
  process.on(sig, () => {
    processes.killAll();
    server.stop(true);
    process.exit(0);
  });
}
// Tests read this line to learn the port when started with --port 0.
console.log(`envd ${ENVD_VERSION} listening on ${server.hostname}:${server.port}`);
