// The guest's built pieces (kernel, initramfs, tools disk, a test rootfs) as paths, built on the
// host by the scripts in guest/ when missing or stale. Tests, benchmarks and the node call this.

import { existsSync, mkdirSync, readdirSync, renameSync, rmSync, statSync } from "node:fs";
import { open } from "node:fs/promises";
import { basename, dirname, join } from "node:path";
import { WritableLayer } from "../storage/lsmt/writable_layer.ts";

/** guest/: the build scripts and envd sources (what runs inside the VM). */
const GUEST_DIR = join(import.meta.dir, "../../guest");

/**
 * Where tests and benchmarks cache built artifacts: AENV_GUEST_CACHE, else guest/.cache
 * (gitignored), as lib.sh decides. The node passes its own (its guest_cache setting, docs/node.md).
 */
export function guestCache(): string {
  return process.env.AENV_GUEST_CACHE ?? join(GUEST_DIR, ".cache");
}

export interface GuestKernel {
  /** Uncompressed PVH ELF: QEMU boots it without decompressing. */
  vmlinux: string;
  /** Busybox plus the virtio modules; hands over to the tools disk. */
  initrd: string;
  vmlinuz: string;
  /** The kernel has CONFIG_DAMON_RECLAIM=y (Debian 6.1's cloud kernel does not; guest/kernel/build-firecracker-kernel.sh builds it in). */
  damonReclaim: boolean;
}

/** Whether a kernel config file (`config-<version>`) builds DAMON_RECLAIM in. */
export async function kernelHasDamonReclaim(config: string): Promise<boolean> {
  const text = await Bun.file(config).text().catch(() => "");
  return /^CONFIG_DAMON_RECLAIM=y$/m.test(text);
}

/** A build script's stdout lines, built into `cache`; asynchronous, so a node building its guest keeps serving. */
async function run(script: string, args: string[], cache: string): Promise<string[]> {
  const env = { ...process.env, AENV_GUEST_CACHE: cache };
  const p = Bun.spawn(["bash", join(GUEST_DIR, script), ...args], { stdout: "pipe", stderr: "pipe", env });
  const timer = setTimeout(() => p.kill("SIGKILL"), BUILD_TIMEOUT_MS);
  const [out, err, code] = await Promise.all([new Response(p.stdout).text(), new Response(p.stderr).text(), p.exited]);
  clearTimeout(timer);
  if (code !== 0) throw new Error(`guest/${script} failed (${code}${p.signalCode ? `, ${p.signalCode}` : ""}): ${err.trim().slice(-4000)}`);
  return out.trim().split("\n").filter(Boolean);
}

/** One build script or envd compile: a kernel download and unpack, or a tools disk, take seconds. */
const BUILD_TIMEOUT_MS = 10 * 60_000;

/** Debian's stock cloud kernel with our initramfs. */
export async function debianKernel(cache = guestCache()): Promise<GuestKernel> {
  const [vmlinux, initrd, vmlinuz] = await run("kernel/fetch-debian-kernel.sh", [], cache);
  const version = basename(vmlinux!).replace(/^vmlinux-/, "");
  const damonReclaim = await kernelHasDamonReclaim(join(dirname(vmlinux!), `pkg-${version}`, "boot", `config-${version}`));
  return { vmlinux: vmlinux!, initrd: initrd!, vmlinuz: vmlinuz!, damonReclaim };
}

/** The read-only tools disk; with envd, the binary goes in at /agentenv/envd. */
export async function toolsDisk(opts: { envd?: string; out?: string; cache?: string } = {}): Promise<string> {
  const args: string[] = [];
  if (opts.envd) args.push("--envd", opts.envd);
  if (opts.out) args.push("--out", opts.out);
  return (await run("build-tools-disk.sh", args, opts.cache ?? guestCache())).at(-1)!;
}

/**
 * envd as one `bun build --compile` binary, built from guest/envd/*.ts with the Bun running this
 * code; rebuilt when any source file is newer. Still linked against the host's glibc: the tools
 * disk build points it at its own copy of the loader and libraries.
 */
export async function envdBinary(cache = guestCache()): Promise<string> {
  const out = join(cache, "envd", "envd");
  const srcDir = join(GUEST_DIR, "envd");
  const newest = Math.max(...readdirSync(srcDir).filter((f) => f.endsWith(".ts")).map((f) => statSync(join(srcDir, f)).mtimeMs));
  if (existsSync(out) && statSync(out).mtimeMs >= newest) return out;
  mkdirSync(join(out, ".."), { recursive: true });
  const tmp = `${out}.tmp`;
  const p = Bun.spawn([process.execPath, "build", "--compile", join(srcDir, "main.ts"), "--outfile", tmp], { stdout: "pipe", stderr: "pipe" });
  const timer = setTimeout(() => p.kill("SIGKILL"), BUILD_TIMEOUT_MS);
  const [err, code] = await Promise.all([new Response(p.stderr).text(), p.exited]);
  clearTimeout(timer);
  if (code !== 0) throw new Error(`bun build --compile envd failed (${code}): ${err.trim()}`);
  renameSync(tmp, out);
  return out;
}

/** The tools disk with the real envd on it (a separate image, so the envd-less default stays). */
export async function envdToolsDisk(cache = guestCache()): Promise<string> {
  return toolsDisk({ envd: await envdBinary(cache), out: join(cache, "tools-envd.img"), cache });
}

/** A busybox-only root filesystem image (raw ext4), standing in for a user's image. */
export async function testRootfs(opts: { out?: string; sizeMiB?: number } = {}): Promise<string> {
  const args: string[] = [];
  if (opts.out) args.push("--out", opts.out);
  if (opts.sizeMiB) args.push("--size", String(opts.sizeMiB));
  return (await run("build-test-rootfs.sh", args, guestCache())).at(-1)!;
}

export interface GuestCmdline {
  /** Guest address with prefix; QEMU user networking's default when absent. */
  ip?: string;
  gw?: string;
  dns?: string;
  hostname?: string;
  /** envd binary inside the guest ("off" disables it); /agentenv/envd by default. */
  envd?: string;
  envdPort?: number;
  /** Start busybox httpd on this port serving /health: an agent stand-in for tests. */
  httpdPort?: number;
  /** Directory (in the user's image) httpd serves instead of the built-in /health page. */
  httpdRoot?: string;
  /** Kernel console on the serial port (slow under TCG; keep "quiet"). */
  console?: boolean;
  /** Turn on DAMON_RECLAIM (cold guest pages paged out by the guest itself); only for a kernel that has it (GuestKernel.damonReclaim). */
  damonReclaim?: boolean;
  extra?: string;
}

/** Kernel command line for the stock kernel + initramfs + tools disk layout. */
export function guestCmdline(o: GuestCmdline = {}): string {
  const parts = [
    o.console === false ? "" : "console=ttyS0",
    "quiet",
    // reboot=t with QEMU's -no-reboot turns a guest reboot or panic into a VMM exit.
    "reboot=t",
    "panic=-1",
    // The crypto self-tests cost ~0.5 s of boot under TCG and test nothing of ours.
    "cryptomgr.notests",
  ];
  if (o.ip) parts.push(`aenv.ip=${o.ip}`);
  if (o.gw) parts.push(`aenv.gw=${o.gw}`);
  if (o.dns) parts.push(`aenv.dns=${o.dns}`);
  if (o.hostname) parts.push(`aenv.hostname=${o.hostname}`);
  if (o.envd) parts.push(`aenv.envd=${o.envd}`);
  if (o.envdPort) parts.push(`aenv.envd_port=${o.envdPort}`);
  if (o.httpdPort) parts.push(`aenv.httpd=${o.httpdPort}`);
  if (o.httpdRoot) parts.push(`aenv.httpd_root=${o.httpdRoot}`);
  if (o.damonReclaim) parts.push("damon_reclaim.enabled=Y");
  if (o.extra) parts.push(o.extra);
  return parts.filter(Boolean).join(" ");
}

/**
 * A raw disk image as one sealed overlaybd layer (what `aenv layer create/write/seal` makes), with
 * all-zero blocks left as holes. Cached: rebuilt only when the image is newer than the layer.
 */
export async function sealedLayer(image: string, out = `${image}.sealed`): Promise<string> {
  if (existsSync(out) && statSync(out).mtimeMs >= statSync(image).mtimeMs) return out;
  const size = Math.ceil(statSync(image).size / 512) * 512;
  const tmp = `${out}.tmp`;
  const layer = await WritableLayer.create(`${tmp}.data`, `${tmp}.index`, { virtualSize: size });
  // Asynchronous reads: a 2 GiB image must not hold the event loop of whoever builds it.
  const fh = await open(image, "r");
  try {
    const block = new Uint8Array(64 << 10);
    for (let pos = 0; pos < size; pos += block.length) {
      const { bytesRead: n } = await fh.read(block, 0, Math.min(block.length, size - pos), pos);
      if (n <= 0) break;
      const len = Math.ceil(n / 512) * 512;
      block.fill(0, n, len);
      const chunk = block.subarray(0, len);
      if (chunk.some((b) => b !== 0)) await layer.write(chunk, pos);
    }
    await layer.seal();
  } finally {
    await fh.close();
    await layer.close();
  }
  renameSync(`${tmp}.data`, out);
  rmSync(`${tmp}.index`, { force: true });
  return out;
}
