// An S3-compatible server for the snapshot store's tests, in its own process (so the test's RSS
// is the store's alone): s3rver on 127.0.0.1, an ephemeral port, objects under DIR, bucket
// `snapshots`. Prints the port. A PUT of a key whose last part is `poison` fails with a 500
// (the tests' fault: a put that fails midway).
import S3rver from "s3rver";

const dir = process.argv[2];
if (!dir) throw new Error("usage: s3rver_main.ts DIR");
const srv = new S3rver({ address: "127.0.0.1", port: 0, silent: true, directory: dir, configureBuckets: [{ name: "snapshots" }] });
srv.middleware.unshift(async (ctx, next) => {
  if (ctx.method === "PUT" && ctx.path.endsWith("/poison")) {
    ctx.status = 500;
    ctx.body = "<Error><Code>InternalError</Code><Message>poisoned key</Message></Error>";
    return;
  }
  await next();
});
const { port } = await srv.run();
console.log(port);
