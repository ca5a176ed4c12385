// The API's one error type: it carries its HTTP status, and its body is E2B's `{code, message}`
// with `code` the status as a number (the SDK compares it with 404 and 409).
export class ApiError extends Error {
  constructor(readonly status: number, message: string, readonly extra: Record<string, unknown> = {}) {
    super(message);
    this.name = "ApiError";
  }

  body(): Record<string, unknown> {
    return { code: this.status, message: this.message, ...this.extra };
  }

  response(headers: Record<string, string> = {}): Response {
    return Response.json(this.body(), { status: this.status, headers });
  }
}

export const badRequest = (message: string) => new ApiError(400, message);
export const unauthorized = () => new ApiError(401, "Invalid API key, it must be sent as X-API-Key or Authorization: Bearer");
export const notFound = (message: string) => new ApiError(404, message);
export const conflict = (message: string) => new ApiError(409, message);
export const tooLarge = (limit: number) => new ApiError(413, `request body is larger than ${limit} bytes`);
