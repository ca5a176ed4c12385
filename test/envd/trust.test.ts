// /init's caBundle (the node's egress CA): envd adds it to the trust store under --trust-root (the
// guest's / in guest mode), once however often /init repeats it; a bundle that is not PEM
// certificates is a 400. A host process writes only inside its scratch directory.
import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { mkdirSync, readdirSync, readFileSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { EgressCa } from "../../src/network/index.ts";
import { startEnvd, type Envd } from "./harness.ts";

describe("/init caBundle", () => {
  let e: Envd;
  let trust: string;
  const ca = EgressCa.generate();
  const existing = EgressCa.generate("an image's own CA").certPem;

  beforeAll(async () => {
    e = await startEnvd(["--trust-root", "trust"]); // relative to envd's cwd: its scratch root
    trust = join(e.root, "trust");
    mkdirSync(join(trust, "etc/ssl/certs"), { recursive: true });
    writeFileSync(join(trust, "etc/ssl/certs/ca-certificates.crt"), existing.trimEnd()); // no final newline
  });
  afterAll(async () => {
    await e?.stop();
  });

  const init = (body: unknown) => fetch(`${e.url}/init`, { method: "POST", body: JSON.stringify({ ...(body as object), timestamp: new Date().toISOString() }) });

  test("the CA lands in ca-certificates and the bundle, once; malformed bundles are refused", async () => {
    expect((await init({ caBundle: ca.certPem })).status).toBe(204);
    expect((await init({ caBundle: ca.certPem })).status).toBe(204); // a resume's /init repeats it
    const bundle = readFileSync(join(trust, "etc/ssl/certs/ca-certificates.crt"), "utf8");
    expect(bundle.split("BEGIN CERTIFICATE").length - 1).toBe(2);
    expect(bundle.startsWith(existing.trimEnd() + "\n")).toBe(true);
    expect(bundle).toContain(ca.certPem.trim());
    const files = readdirSync(join(trust, "usr/local/share/ca-certificates"));
    expect(files.length).toBe(1);
    expect(files[0]).toMatch(/^aenv-[0-9a-f]{16}\.crt$/);
    for (const caBundle of [5, "not a certificate", "-----BEGIN CERTIFICATE-----\n!!\n-----END CERTIFICATE-----"]) {
      expect((await init({ caBundle })).status).toBe(400);
    }
  });
});
