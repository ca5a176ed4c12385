// An S3-compatible server for the snapshot store's tests, in its own process (so the test's RSS
// is the store's alone): s3rver on 127.0.0.1, an ephemeral port, objects under DIR, bucket
// `snapshots` (and those named in S3RVER_BUCKETS, comma-separated). Prints the port. A PUT of a
// key whose last part is `poison` fails with a 500 (the tests' fault: a put that fails midway).
// With S3RVER_LOG, each request appends a JSON line {method, path, status, bytes} (bytes: the
// body a GET answered with) to that file.
import { appendFile } from "node:fs/promises";
import S3rver from "s3rver";

const dir = process.argv[2];
if (!dir) throw new Error("usage: s3rver_main.ts DIR");
const buckets = ["snapshots", ...(process.env.S3RVER_BUCKETS ?? "").split(",").filter(Boolean)];
const srv = new S3rver({ address: "127.0.0.1", port: 0, silent: true, directory: dir, configureBuckets: buckets.map((name) => ({ name })) });
const log = process.env.S3RVER_LOG;
srv.middleware.unshift(async (ctx, next) => {
  if (ctx.method === "PUT" && ctx.path.endsWith("/poison")) {
    ctx.status = 500;
    ctx.body = "<Error><Code>InternalError</Code><Message>poisoned key</Message></Error>";
    return;
  }
  await next();
});
if (log) {
  srv.middleware.unshift(async (ctx, next) => {
    await next();
    const bytes = ctx.method === "GET" && ctx.status < 300 ? Number(ctx.response.length ?? 0) : 0;
    await appendFile(log, `${JSON.stringify({ method: ctx.method, path: ctx.path, status: ctx.status, bytes })}\n`);
  });
}
const { port } = await srv.run();
console.log(port);
