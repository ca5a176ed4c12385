// Image references as Docker writes them: `[registry[:port]/]path[:tag][@sha256:hex]`. A name
// without a registry is Docker Hub's (`docker.io`, served by `registry-1.docker.io`), a one-part
// Hub name is under `library/`, and a reference with neither tag nor digest means `latest`.
import { RegistryError } from "./errors.ts";

export const DOCKER_HUB = "docker.io";
/** The host that serves Docker Hub's distribution API. */
export const DOCKER_HUB_ENDPOINT = "registry-1.docker.io";
/** Names Docker also writes for the Hub (config.json keys, old references). */
const HUB_ALIASES = new Set(["docker.io", "index.docker.io", "registry-1.docker.io", "registry.hub.docker.com"]);
/** The distribution spec's bound on a repository name (registry included). */
const MAX_NAME = 255;

const COMPONENT = /^[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*$/;
const DOMAIN_LABEL = "(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])";
const HOST = new RegExp(`^(?:${DOMAIN_LABEL}(?:\\.${DOMAIN_LABEL})*|\\[[0-9a-fA-F:.]+\\])(?::[0-9]{1,5})?$`);
const TAG = /^[\w][\w.-]{0,127}$/;
export const SHA256_DIGEST = /^sha256:[0-9a-f]{64}$/;

export interface ImageRef {
  /** The registry as named (`docker.io`, `127.0.0.1:5000`): the key for credentials. */
  registry: string;
  /** host[:port] the HTTP requests go to. */
  endpoint: string;
  /** `library/busybox`, `team/app`. */
  repository: string;
  /** The tag, when one was given or implied (`latest`). */
  tag?: string;
  /** `sha256:<64 hex>`, when pinned. */
  digest?: string;
}

/** What goes in `/v2/<name>/manifests/<reference>`: the digest when pinned, else the tag. */
export function manifestReference(ref: ImageRef): string {
  return ref.digest ?? ref.tag ?? "latest";
}

/** `registry/repository[:tag][@digest]`, the form messages and logs name an image by. */
export function formatImageRef(ref: ImageRef): string {
  return `${ref.registry}/${ref.repository}${ref.tag ? `:${ref.tag}` : ""}${ref.digest ? `@${ref.digest}` : ""}`;
}

/** The same repository at another tag or digest (a child manifest of an index, a push target). */
export function withReference(ref: ImageRef, reference: string): ImageRef {
  const { tag: _t, digest: _d, ...base } = ref;
  return SHA256_DIGEST.test(reference) ? { ...base, digest: reference } : { ...base, tag: reference };
}

/** The registry name credentials are filed under: Hub aliases become `docker.io`, a scheme and path are dropped. */
export function canonicalRegistry(name: string): string {
  const host = name.replace(/^[a-z]+:\/\//i, "").replace(/\/.*$/, "").toLowerCase();
  return HUB_ALIASES.has(host) ? DOCKER_HUB : host;
}

function bad(s: string, why: string): RegistryError {
  return new RegistryError("BadReference", `image reference ${JSON.stringify(s.slice(0, 300))}: ${why}`);
}

export function parseImageRef(s: string): ImageRef {
  if (typeof s !== "string" || s.length === 0) throw bad(String(s), "empty");
  if (s.length > MAX_NAME + 200) throw bad(s, "too long");
  let rest = s;
  let digest: string | undefined;
  const at = rest.indexOf("@");
  if (at >= 0) {
    digest = rest.slice(at + 1);
    rest = rest.slice(0, at);
    if (!SHA256_DIGEST.test(digest)) throw bad(s, `digest ${JSON.stringify(digest)} is not sha256:<64 lowercase hex>`);
  }
  let tag: string | undefined;
  const colon = rest.lastIndexOf(":");
  if (colon > rest.lastIndexOf("/")) {
    tag = rest.slice(colon + 1);
    rest = rest.slice(0, colon);
    if (!TAG.test(tag)) throw bad(s, `tag ${JSON.stringify(tag)} is not [A-Za-z0-9_][A-Za-z0-9_.-]{0,127}`);
  }
  let registry = DOCKER_HUB;
  const slash = rest.indexOf("/");
  const first = slash >= 0 ? rest.slice(0, slash) : "";
  if (slash >= 0 && (first.includes(".") || first.includes(":") || first === "localhost" || first.startsWith("["))) {
    if (!HOST.test(first)) throw bad(s, `registry ${JSON.stringify(first)} is not host[:port]`);
    registry = canonicalRegistry(first);
    rest = rest.slice(slash + 1);
  }
  if (rest.length === 0) throw bad(s, "no repository name");
  const parts = rest.split("/");
  for (const p of parts) {
    if (!COMPONENT.test(p)) throw bad(s, `path component ${JSON.stringify(p)} must be lowercase letters, digits and . _ __ - separators`);
  }
  let repository = rest;
  if (registry === DOCKER_HUB && parts.length === 1) repository = `library/${rest}`;
  if (registry.length + 1 + repository.length > MAX_NAME) throw bad(s, `name longer than ${MAX_NAME} characters`);
  if (tag === undefined && digest === undefined) tag = "latest";
  const endpoint = registry === DOCKER_HUB ? DOCKER_HUB_ENDPOINT : registry;
  const ref: ImageRef = { registry, endpoint, repository };
  if (tag !== undefined) ref.tag = tag;
  if (digest !== undefined) ref.digest = digest;
  return ref;
}

/** A registry blob URL's repository (`…/v2/<name>/blobs/<digest>`), or undefined for any other URL. */
export function blobRepository(url: string): { ref: ImageRef; digest: string } | undefined {
  let u: URL;
  try {
    u = new URL(url);
  } catch {
    return undefined;
  }
  const m = /^\/v2\/(.+)\/blobs\/(sha256:[0-9a-f]{64})$/.exec(u.pathname);
  if (!m) return undefined;
  try {
    return { ref: parseImageRef(`${u.host}/${m[1]}@${m[2]}`), digest: m[2]! };
  } catch {
    return undefined;
  }
}
