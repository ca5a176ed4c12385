// The Swagger UI renders the route list in a real browser with nothing but this machine's
// loopback: the API server and headless Chromium share a network namespace that has only `lo`,
// so a request for a CDN asset would fail and the page would not render.
import { afterAll, expect, test } from "bun:test";
import { join } from "node:path";
import { haveTool } from "../../src/network/index.ts";

const chromium = Bun.which("chromium");
const skip = process.getuid?.() !== 0 ? "needs root to make a network namespace"
  : !haveTool("ip") ? "ip (iproute2) is missing"
  : !chromium ? "chromium is missing (Debian's chromium; .ci/deps installs it)" : undefined;
const ns = `aenv-swagger-${process.pid}`;
const PORT = 18000 + (process.pid % 1000);

afterAll(() => void Bun.spawnSync(["ip", "netns", "del", ns]));

test.skipIf(!!skip)(`Swagger UI renders every route offline${skip ? ` (skipped: ${skip})` : ""}`, async () => {
  expect(Bun.spawnSync(["ip", "netns", "add", ns]).exitCode).toBe(0);
  expect(Bun.spawnSync(["ip", "-n", ns, "link", "set", "lo", "up"]).exitCode).toBe(0);
  const links = Bun.spawnSync(["ip", "-n", ns, "-o", "link"], { stdout: "pipe" }).stdout.toString().trim().split("\n");
  expect(links.length).toBe(1); // only lo: nothing can leave
  const server = Bun.spawn(["ip", "netns", "exec", ns, process.execPath, join(import.meta.dir, "swagger_serve.ts"), String(PORT)], { stdout: "pipe", stderr: "inherit" });
  try {
    const reader = server.stdout.getReader();
    const first = new TextDecoder().decode((await reader.read()).value);
    expect(first).toContain(`ready ${PORT}`);
    const run = Bun.spawn([
      "ip", "netns", "exec", ns, chromium!, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
      "--virtual-time-budget=15000", "--dump-dom", `http://127.0.0.1:${PORT}/swagger`,
    ], { stdout: "pipe", stderr: "pipe", env: { ...process.env, HOME: "/tmp" } });
    const timer = setTimeout(() => run.kill("SIGKILL"), 90_000);
    const dom = await new Response(run.stdout).text();
    clearTimeout(timer);
    await run.exited;
    // Rendered by swagger-ui's JavaScript from /swagger/json: operation blocks with their paths.
    expect(dom).toContain("opblock");
    for (const path of ["/v2/sandboxes", "/sandboxes/{sandboxID}/pause", "/sandboxes/{sandboxID}/fork", "/snapshots", "/health"]) expect(dom).toContain(path);
    expect(dom).toContain("AgentENV node API");
  } finally {
    server.kill("SIGKILL");
    await server.exited;
  }
}, 120_000);
