// Shared by the VM tests: guest artifacts, blockd-served disks, free loopback ports, talking to the
// guest's test CGI, and counting what a test leaves behind (QEMU processes, blockd devices).

import { existsSync, mkdtempSync, readdirSync, readFileSync, rmSync } from "node:fs";
import { join } from "node:path";
import { debianKernel, sealedLayer, testRootfs, toolsDisk, type GuestKernel } from "../../src/template/artifacts.ts";

/** Why QEMU VM tests cannot run here, or undefined when they can. */
export function vmSkipReason(): string | undefined {
  if (process.getuid?.() !== 0) return "VM tests need root (blockd mounts FUSE)";
  if (!existsSync("/dev/fuse")) return "VM tests need /dev/fuse for blockd";
  if (Bun.which("qemu-system-x86_64") === null) return "qemu-system-x86_64 is not installed (apt-get install qemu-system-x86)";
  for (const tool of ["mkfs.ext4", "apt-get", "dpkg-deb", "lz4", "depmod", "cpio"])
    if (Bun.spawnSync(["sh", "-c", `command -v ${tool}`]).exitCode !== 0) return `${tool} is missing (see .ci/run)`;
  return undefined;
}

export interface GuestFixture {
  kernel: GuestKernel;
  toolsImage: string;
  toolsLayer: string;
  rootfsImage: string;
  rootfsLayer: string;
}

/** Kernel, initramfs, tools disk and test rootfs, built on first use (cached under guest/.cache). */
export async function guestFixture(): Promise<GuestFixture> {
  const kernel = await debianKernel();
  const toolsImage = await toolsDisk();
  const rootfsImage = await testRootfs();
  return { kernel, toolsImage, toolsLayer: await sealedLayer(toolsImage), rootfsImage, rootfsLayer: await sealedLayer(rootfsImage) };
}

/** A loopback TCP port nothing listens on right now. */
export function freePort(): number {
  const s = Bun.listen({ hostname: "127.0.0.1", port: 0, socket: { data() {} } });
  const port = s.port;
  s.stop(true);
  return port;
}

/** A run root on tmpfs (guest RAM files live there), removed by the caller. */
export function runRoot(label: string): string {
  return mkdtempSync(join(existsSync("/dev/shm") ? "/dev/shm" : "/tmp", `aenv-${label}-`));
}

/** PIDs of QEMU processes whose command line mentions `marker` (our run root). */
export function qemuPids(marker: string): number[] {
  const pids: number[] = [];
  for (const e of readdirSync("/proc")) {
    if (!/^\d+$/.test(e)) continue;
    try {
      const cmd = readFileSync(`/proc/${e}/cmdline`, "utf8");
      if (cmd.includes("qemu-system") && cmd.includes(marker)) pids.push(Number(e));
    } catch {}
  }
  return pids;
}

/** Polls cond until it holds or ms pass; deadlines are generous (TCG on a shared, loaded machine). */
export async function until(cond: () => boolean | Promise<boolean>, ms = 30_000, what = "condition"): Promise<void> {
  const end = Date.now() + ms;
  while (!(await cond())) {
    if (Date.now() > end) throw new Error(`${what} not met within ${ms} ms`);
    await Bun.sleep(50);
  }
}

/** Milliseconds until GET url answers 200, or throws after timeoutMs. */
export async function waitHttp(url: string, timeoutMs = 30_000): Promise<number> {
  const t0 = performance.now();
  for (;;) {
    try {
      const r = await fetch(url, { signal: AbortSignal.timeout(1000) });
      if (r.ok) {
        await r.arrayBuffer();
        return performance.now() - t0;
      }
    } catch {}
    if (performance.now() - t0 > timeoutMs) throw new Error(`${url} did not answer within ${timeoutMs} ms`);
    await Bun.sleep(25);
  }
}

/** Run a shell command in the guest through the test rootfs's CGI; returns its output. */
export async function guestSh(port: number, command: string, timeoutMs = 10_000): Promise<string> {
  const r = await fetch(`http://127.0.0.1:${port}/cgi-bin/sh`, { method: "POST", body: command, signal: AbortSignal.timeout(timeoutMs) });
  const text = await r.text();
  if (!r.ok) throw new Error(`guest sh ${JSON.stringify(command)} → HTTP ${r.status}: ${text}`);
  return text;
}

/**
 * A guest command run to its end: the test CGI can answer a command that prints nothing before
 * the command is done (a dd still writing), so the command ends by printing a marker. Its output.
 */
export async function guestRun(port: number, command: string, timeoutMs = 60_000): Promise<string> {
  const out = await guestSh(port, `${command}; echo @done`, timeoutMs);
  if (!out.endsWith("@done\n")) throw new Error(`guest command ${JSON.stringify(command)} did not finish: ${out}`);
  return out.slice(0, -"@done\n".length).trim();
}

/** Bytes of anonymous (copy-on-write) pages in `pid`'s mapping of `path` (/proc/<pid>/smaps). */
export function anonymousBytes(pid: number, path: string): number {
  const smaps = readFileSync(`/proc/${pid}/smaps`, "utf8");
  const at = smaps.indexOf(` ${path}\n`);
  if (at < 0) throw new Error(`process ${pid} does not map ${path}`);
  const block = smaps.slice(at, smaps.indexOf("VmFlags", at));
  return Number(/\nAnonymous:\s+(\d+) kB/.exec(block)![1]) * 1024;
}

export function rmrf(p: string): void {
  rmSync(p, { recursive: true, force: true });
}
