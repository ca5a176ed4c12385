// `aenv auth`: save a node's URL and API key for the other verbs, once the node has accepted them.
// What the flags do not give is asked for: on a terminal with the key unechoed, else one line
// each from stdin.

import { type ParsedArgs } from "./args.ts";
import {
  DEFAULT_URL,
  NODE_OPTIONS,
  NodeError,
  api,
  credentialsPath,
  normalizeUrl,
  readCredentials,
  resolveTarget,
  writeCredentials,
  type NodeTarget,
} from "./node_client.ts";
import type { Verb } from "./verbs.ts";

/** Bound on one answer: a URL or a key. */
const ANSWER_MAX = 4096;

let piped: AsyncIterator<string> | undefined;

async function* stdinLines(): AsyncGenerator<string> {
  let buf = "";
  for await (const chunk of process.stdin) {
    buf += Buffer.from(chunk as Uint8Array).toString("utf8");
    for (let i = buf.indexOf("\n"); i >= 0; i = buf.indexOf("\n")) {
      yield buf.slice(0, i).replace(/\r$/, "");
      buf = buf.slice(i + 1);
    }
    if (buf.length > ANSWER_MAX) throw new NodeError("BadAnswer", `a line of stdin is longer than ${ANSWER_MAX} characters`);
  }
  if (buf !== "") yield buf;
}

/** One answer; on a terminal read in raw mode, echoed unless `hidden`. */
async function ask(question: string, hidden: boolean): Promise<string> {
  process.stderr.write(question);
  const stdin = process.stdin;
  if (!stdin.isTTY) {
    piped ??= stdinLines();
    const next = await piped.next();
    process.stderr.write("\n");
    return next.done ? "" : next.value.trim();
  }
  return new Promise((resolve, reject) => {
    let line = "";
    const done = () => {
      stdin.off("data", onData);
      stdin.setRawMode(false);
      stdin.pause();
      process.stderr.write("\n");
    };
    const onData = (d: Buffer) => {
      for (const ch of d.toString("utf8")) {
        if (ch === "\r" || ch === "\n") return done(), resolve(line.trim());
        if (ch === "\x03" || ch === "\x04") return done(), reject(new NodeError("Interrupted", "nothing saved"));
        if (ch === "\x7f" || ch === "\b") {
          if (line !== "" && !hidden) process.stderr.write("\b \b");
          line = line.slice(0, -1);
        } else if (ch >= " " && line.length < ANSWER_MAX) {
          line += ch;
          if (!hidden) process.stderr.write(ch);
        }
      }
    };
    stdin.setRawMode(true);
    stdin.on("data", onData);
    stdin.resume();
  });
}

async function auth(a: ParsedArgs): Promise<void> {
  a.need(0, "no operands");
  const path = credentialsPath();
  const saved = await readCredentials(path).catch(() => null);
  const suggested = process.env.AENV_URL || saved?.url || DEFAULT_URL;
  const url = a.value("url") !== undefined
    ? normalizeUrl(a.value("url")!, "--url")
    : normalizeUrl((await ask(`node URL [${suggested}]: `, false)) || suggested, "the URL");
  // The key a verb would use for this URL now (a local node's key file among them), as the default.
  const current: NodeTarget | null = await resolveTarget({ ...a, value: (n) => (n === "url" ? url : a.value(n)) }).catch(() => null);
  let apiKey = a.value("api-key");
  if (apiKey === undefined) {
    apiKey = (await ask(current ? `API key [from ${current.keyFrom}]: ` : "API key: ", true)) || current?.apiKey;
    if (!apiKey) throw new NodeError("NoApiKey", `no API key given: nothing saved (a node prints where its key is when it starts)`);
  }
  const t: NodeTarget = { url, apiKey, keyFrom: "the key given" };
  try {
    await api(t, "GET", "/v2/sandboxes?limit=1");
  } catch (e) {
    if (e instanceof NodeError && e.status === 401) throw new NodeError("KeyRefused", `the node at ${url} refused this API key: nothing saved (a node prints where its key is when it starts)`, 401);
    throw e;
  }
  writeCredentials({ url, apiKey }, path);
  process.stderr.write(`aenv: the node at ${url} accepted the key; saved to ${path}\n`);
}

export const AUTH_VERB: Verb = {
  operands: "",
  summary: "check a node's URL and API key against the node and save them for the other verbs (~/.config/aenv/credentials, mode 0600)",
  options: [...NODE_OPTIONS],
  notes: "Asks for what --url and --api-key do not give; an empty answer takes the default shown.",
  run: auth,
};
