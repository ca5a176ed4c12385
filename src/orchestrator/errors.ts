// The orchestrator's failures: each carries the HTTP status the API answers it with.

/** An orchestrator failure with the HTTP status the API answers it with. */
export class OrchestratorError extends Error {
  constructor(readonly status: number, message: string) {
    super(message);
    this.name = "OrchestratorError";
  }
}

export const notFound = (id: string) => new OrchestratorError(404, `sandbox ${id} not found`);

/** A failure of a part (blockd, VMM, envd) as a 500 that says what failed and why. */
export function asOrchestratorError(e: unknown, what: string): OrchestratorError {
  if (e instanceof OrchestratorError) return e;
  return new OrchestratorError(500, `${what}: ${(e as Error).message ?? String(e)}`);
}
