// Swagger UI served from the swagger-ui-dist package: the page and its assets come from this node,
// so /swagger works with no request leaving the machine. The OpenAPI document is
// @elysiajs/swagger's, at /swagger/json.
import { dirname, join } from "node:path";

const DIST = dirname(Bun.resolveSync("swagger-ui-dist/package.json", import.meta.dir));
const ASSETS: Record<string, string> = {
  "swagger-ui.css": "text/css; charset=utf-8",
  "swagger-ui-bundle.js": "text/javascript; charset=utf-8",
  "swagger-ui-standalone-preset.js": "text/javascript; charset=utf-8",
  "favicon-32x32.png": "image/png",
};

const PAGE = `<!doctype html>
<html lang="en">
<head>
  <meta charset="utf-8"><title>AgentENV API</title>
  <link rel="stylesheet" href="/swagger/assets/swagger-ui.css">
  <link rel="icon" type="image/png" href="/swagger/assets/favicon-32x32.png">
</head>
<body>
  <div id="swagger-ui"></div>
  <script src="/swagger/assets/swagger-ui-bundle.js"></script>
  <script src="/swagger/assets/swagger-ui-standalone-preset.js"></script>
  <script>
    window.ui = SwaggerUIBundle({ url: "/swagger/json", dom_id: "#swagger-ui", deepLinking: true,
      presets: [SwaggerUIBundle.presets.apis, SwaggerUIStandalonePreset], layout: "StandaloneLayout" });
  </script>
</body>
</html>`;

/** The UI's response for a path under /swagger, or undefined for any other path. */
export function swaggerUiResponse(pathname: string): Response | undefined {
  if (pathname === "/swagger" || pathname === "/swagger/") {
    return new Response(PAGE, { headers: { "content-type": "text/html; charset=utf-8" } });
  }
  const prefix = "/swagger/assets/";
  if (!pathname.startsWith(prefix)) return undefined;
  const name = pathname.slice(prefix.length);
  const type = ASSETS[name];
  if (type === undefined) return undefined;
  return new Response(Bun.file(join(DIST, name)), { headers: { "content-type": type, "cache-control": "public, max-age=86400" } });
}
