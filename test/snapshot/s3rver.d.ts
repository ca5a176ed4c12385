// The part of s3rver (an S3-compatible server on the local disk, npm) the tests use.
declare module "s3rver" {
  interface S3rverOptions {
    address?: string;
    port?: number;
    silent?: boolean;
    directory: string;
    configureBuckets?: { name: string }[];
  }
  export default class S3rver {
    constructor(opts: S3rverOptions);
    /** Koa's middleware list: a fault injector goes first. */
    middleware: ((ctx: { method: string; path: string; status: number; body: unknown; response: { length?: number } }, next: () => Promise<void>) => Promise<void>)[];
    run(): Promise<{ address: string; port: number }>;
    close(): Promise<void>;
  }
}
