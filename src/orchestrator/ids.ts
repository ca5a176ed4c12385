// Names the orchestrator draws: sandbox, boot and checkpoint ids, access tokens.

/** `len` characters of [a-z0-9] (a sandbox id is 20 of them). */
export function randomId(len = 20): string {
  const alphabet = "abcdefghijklmnopqrstuvwxyz0123456789";
  const bytes = crypto.getRandomValues(new Uint8Array(len));
  let s = "";
  for (const b of bytes) s += alphabet[b % 36];
  return s;
}

/** An envd or traffic access token: 24 random bytes as hex. */
export function accessToken(): string {
  return Buffer.from(crypto.getRandomValues(new Uint8Array(24))).toString("hex");
}
