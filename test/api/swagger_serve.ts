// Serves the node's API with its sandbox routes (no orchestrator behind them) on 127.0.0.1:PORT,
// for the Swagger UI test, which runs this and Chromium in a network namespace of their own.
import { createApi } from "../../src/api/app.ts";
import { ApiError } from "../../src/api/errors.ts";
import { sandboxRoutes } from "../../src/api/sandboxes.ts";

const port = Number(process.argv[2]);
const app = createApi({ apiKey: "e2b_" + "00".repeat(20), maxBodyBytes: 1 << 20, notReadyReason: () => "no orchestrator in this test", version: "test" })
  .use(sandboxRoutes(() => { throw new ApiError(503, "no orchestrator in this test"); }, { domain: null, defaultTimeoutS: 300 }))
  .listen({ hostname: "127.0.0.1", port });
console.log(`ready ${app.server!.port}`);
