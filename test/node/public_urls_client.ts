// The stock e2b SDK in its normal https mode (a domain, no sandbox URL, not debug), run as its own
// process so that NODE_EXTRA_CA_CERTS (the test's CA) is read at its start. One step per run:
// `bun public_urls_client.ts <step> [sandboxId]`; the last stdout line is the step's JSON result.
// Settings from the environment: PUB_DOMAIN, PUB_API_URL, E2B_API_KEY. Names under `*.localhost`
// resolve to loopback in Bun's fetch, so `{port}-{id}.sbx.localhost:<port>` reaches the node.
import { Sandbox } from "e2b";

const domain = process.env.PUB_DOMAIN!;
const apiUrl = process.env.PUB_API_URL!;
const opts = { apiKey: process.env.E2B_API_KEY!, domain, apiUrl, requestTimeoutMs: 180_000 };
/** How long the step waits for a server started in the sandbox to answer. */
const SERVER_WAIT_MS = 60_000;

type Step = (id?: string) => Promise<Record<string, unknown>>;

/** A fetch's status and body text, or the error's message. */
async function get(url: string, init?: RequestInit): Promise<{ status: number; body: string }> {
  try {
    const r = await fetch(url, init);
    return { status: r.status, body: await r.text() };
  } catch (e) {
    return { status: 0, body: (e as Error).message };
  }
}

const steps: Record<string, Step> = {
  /** Create over the HTTPS API; commands and files through the proxy's https envd host. */
  async create() {
    const sbx = await Sandbox.create({ ...opts, timeoutMs: 1_200_000 });
    const run = await sbx.commands.run("echo hello $((6*7)); id -un");
    await sbx.files.write("/tmp/pub/a.txt", "written over https");
    const read = await sbx.files.read("/tmp/pub/a.txt");
    // Without apiUrl the SDK's API is https://api.<domain>: the node answers it too.
    const listed = await Sandbox.list({ apiKey: opts.apiKey, domain, requestTimeoutMs: 60_000 }).nextItems();
    return {
      id: sbx.sandboxId, domain: sbx.sandboxDomain, envdApiUrl: (sbx as unknown as { envdApiUrl: string }).envdApiUrl,
      stdout: run.stdout, read, listedByDomain: listed.map((s) => s.sandboxId),
    };
  },

  /** getHost(port) over https: a python3 http.server in the sandbox. */
  async host(id) {
    const sbx = await Sandbox.connect(id!, opts);
    await sbx.commands.run("python3 -m http.server 8000 --directory /tmp/pub", { background: true, timeoutMs: 0 });
    const host = sbx.getHost(8000);
    const deadline = Date.now() + SERVER_WAIT_MS;
    let got = await get(`https://${host}/a.txt`);
    while (got.status !== 200 && Date.now() < deadline) {
      await Bun.sleep(500);
      got = await get(`https://${host}/a.txt`);
    }
    return { host, ...got };
  },

  /** Signed upload and download URLs (with an expiration) through the proxy; expired and tampered ones. */
  async signed(id) {
    const sbx = await Sandbox.connect(id!, opts);
    const upUrl = await sbx.uploadUrl("/tmp/pub/up.txt", { useSignatureExpiration: 120 });
    const form = new FormData();
    form.append("file", new Blob(["uploaded through a signed url"]), "up.txt");
    const upload = await get(upUrl, { method: "POST", body: form });
    const uploaded = await sbx.files.read("/tmp/pub/up.txt");
    const downUrl = await sbx.downloadUrl("/tmp/pub/a.txt", { useSignatureExpiration: 120 });
    const download = await get(downUrl);

    // Tampered: one character of the signature changed; a signature for another path.
    const bad = new URL(downUrl);
    const sig = bad.searchParams.get("signature")!;
    bad.searchParams.set("signature", sig.slice(0, -1) + (sig.endsWith("A") ? "B" : "A"));
    const tampered = await get(bad.toString());
    const otherPath = new URL(downUrl);
    otherPath.searchParams.set("path", "/tmp/pub/up.txt");
    const wrongPath = await get(otherPath.toString());
    const tamperedUpload = new URL(upUrl);
    tamperedUpload.searchParams.set("signature_expiration", String(Number(tamperedUpload.searchParams.get("signature_expiration")) + 3600));
    const form2 = new FormData();
    form2.append("file", new Blob(["must not land"]), "up.txt");
    const uploadLater = await get(tamperedUpload.toString(), { method: "POST", body: form2 });
    const afterRefused = await sbx.files.read("/tmp/pub/up.txt");

    // Expired: valid for 1 s (the SDK adds it to the current whole second), used 2.5 s later.
    const shortUrl = await sbx.downloadUrl("/tmp/pub/a.txt", { useSignatureExpiration: 1 });
    await Bun.sleep(2500);
    const expired = await get(shortUrl);
    return { upUrl, downUrl, upload, uploaded, download, tampered, wrongPath, uploadLater, afterRefused, expired };
  },

  async kill(id) {
    return { killed: await Sandbox.kill(id!, opts) };
  },
};

const [name, id] = process.argv.slice(2);
const step = steps[name ?? ""];
if (!step) throw new Error(`unknown step ${name}: one of ${Object.keys(steps).join(", ")}`);
console.log(JSON.stringify(await step(id)));
// A background command's stream stays open (the process goes on in the sandbox): leave it.
process.exit(0);
