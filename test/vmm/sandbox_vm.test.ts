// The real sandbox end to end under QEMU (TCG here): a busybox rootfs on a blockd device, the tools
// disk carrying our compiled envd, the VM inside a network slot (namespace + TAP), and the stock
// e2b SDK talking to envd at http://<slot.nsIp>:49983. Commands, files, watch, PTY, envd killed and
// restarted, pause/resume, snapshot → restore into another slot, two restores side by side, the
// guest clock after a restore, a VMM that cannot start, and nothing left behind.

import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { existsSync, readdirSync, readFileSync, statSync } from "node:fs";
import { join } from "node:path";
import { CommandExitError, FilesystemEventType, Sandbox, type CommandHandle } from "e2b";
import { envdToolsDisk, guestCmdline, sealedLayer } from "../../src/template/artifacts.ts";
import { haveTool, SlotPool, type Slot } from "../../src/network/index.ts";
import { QemuDriver } from "../../src/vmm/qemu.ts";
import type { SnapshotInfo, Vmm } from "../../src/vmm/types.ts";
import { startBlockd } from "../blockdev/harness.ts";
import { guestFixture, qemuPids, rmrf, runRoot, until, vmSkipReason, type GuestFixture } from "./harness.ts";

function skipReason(): string | undefined {
  const vm = vmSkipReason();
  if (vm) return vm;
  if (!existsSync("/dev/net/tun")) return "no /dev/net/tun for the slot's TAP";
  for (const t of ["ip", "nft", "sysctl", "conntrack"] as const) if (!haveTool(t)) return `${t} is missing (see .ci/run)`;
  if (Bun.spawnSync(["sh", "-c", "command -v patchelf && command -v ldd"]).exitCode !== 0) return "patchelf or ldd is missing (see .ci/run)";
  return undefined;
}

const skip = skipReason();
if (skip) console.log(`sandbox VM tests skipped: ${skip}`);

const ENVD_PORT = 49983;
const DISK = 64 << 20;
const tag = (process.pid % 46656).toString(36).padStart(3, "0");

const PREFIX = `avm${tag}-`;
// Only this run's: other suites on this host start QEMUs and namespaces at the same time. Every VM
// here has its run directory under the run root, which its argv names (qemuPids).
const namespaces = () => (existsSync("/run/netns") ? readdirSync("/run/netns").filter((n) => n.startsWith(PREFIX)).sort() : []);
const hostLinks = () => readdirSync("/sys/class/net").filter((l) => l.startsWith(PREFIX) || ["vpeer", "tap0"].includes(l)).sort();

describe.skipIf(!!skip)("sandbox VMs: envd in the guest, VM in a network slot, the e2b SDK", async () => {
  // bun runs a skipped describe's body: start nothing there, and show why it skipped.
  if (skip) return void test.skip(skip!, () => {});
  const { dir, client } = await startBlockd("sandbox-vm");
  const root = runRoot("sandbox-vm");
  const driver = new QemuDriver();
  const pool = new SlotPool({ size: 0, prefix: PREFIX, hostCidr: `10.214.${process.pid % 250}.0/24`, hostTable: `aenv_vmtest_${tag}` });
  let fx: GuestFixture;
  let toolsLayer = "";
  const live = new Set<Vmm>();
  const leased = new Set<Slot>();
  const devices: string[] = []; // every device we create, deleted in the last test
  const before = { qemu: [] as number[], netns: [] as string[], links: [] as string[], devices: 0 };
  console.log(`sandbox VM tests: accel ${driver.accel}`);

  beforeAll(async () => {
    before.qemu = qemuPids(root);
    before.netns = namespaces();
    before.links = hostLinks();
    before.devices = (await client.call<unknown[]>("list")).length;
    fx = await guestFixture();
    const t0 = performance.now();
    toolsLayer = await sealedLayer(await envdToolsDisk()); // compiles envd when its sources changed
    console.log(`  envd binary + tools disk layer: ${Math.round(performance.now() - t0)} ms`);
    await pool.start();
  }, 240_000);

  afterAll(async () => {
    // Last line of defence after a failure; the final test checks that none of this was needed.
    for (const vm of live) await vm.stop().catch(() => {});
    for (const s of leased) await pool.release(s).catch(() => {});
    await pool.destroy().catch(() => {});
    rmrf(root);
  });

  async function acquire(): Promise<Slot> {
    const s = await pool.acquire();
    leased.add(s);
    return s;
  }
  async function release(s: Slot) {
    await pool.release(s);
    leased.delete(s);
  }
  async function stop(vm: Vmm) {
    await vm.stop();
    live.delete(vm);
  }

  async function drives(lowers: string[], name: string) {
    const tools = await client.call("createReadOnly", { lowers: [toolsLayer] });
    devices.push(tools.id);
    const rootfs = await client.call("create", { lowers, upperDir: join(dir, "uppers", name), size: DISK });
    devices.push(rootfs.id);
    return { rootfsId: rootfs.id as string, drives: [{ path: tools.path as string, readOnly: true }, { path: rootfs.path as string }] };
  }

  const envdUrl = (s: Slot) => `http://${s.nsIp}:${ENVD_PORT}`;
  const sdk = (s: Slot) => Sandbox.connect(`vm-${s.id}`, { debug: true, sandboxUrl: envdUrl(s) });

  /** Milliseconds until envd's /health answers 204 through the slot. */
  async function waitEnvd(s: Slot, vm: Vmm, timeoutMs: number): Promise<number> {
    const t0 = performance.now();
    for (;;) {
      try {
        const r = await fetch(`${envdUrl(s)}/health`, { signal: AbortSignal.timeout(1000) });
        if (r.status === 204) return performance.now() - t0;
      } catch {}
      if (performance.now() - t0 > timeoutMs || vm.state === "stopped") {
        await vm.syncConsole().catch(() => {});
        const con = existsSync(vm.consoleLog) ? readFileSync(vm.consoleLog, "utf8").slice(-2000) : "";
        throw new Error(`envd in ${vm.id} did not answer within ${timeoutMs} ms (VM ${vm.state}); console:\n${con}`);
      }
      await Bun.sleep(25);
    }
  }

  /** The guest's wall clock (whole seconds: busybox date) and the host's just before and after reading it. */
  async function guestClock(sbx: Sandbox): Promise<{ guest: number; hostBefore: number; hostAfter: number }> {
    const hostBefore = Date.now() / 1000;
    const guest = Number((await sbx.commands.run("date +%s")).stdout.trim());
    return { guest, hostBefore, hostAfter: Date.now() / 1000 };
  }

  // State carried from test to test: one VM in slot A until its snapshot, then restores.
  let slotA: Slot;
  let vmA: Vmm;
  let rootfsA = "";
  let sbxA: Sandbox;
  let counterPid = 0;
  let snap: SnapshotInfo;
  let snapAt = 0;
  const snapLayer = join(dir, "snap.rootfs.layer"); // on the uppers' filesystem: restack renames into it
  let slotB: Slot;
  let vmB: Vmm;
  let sbxB: Sandbox;

  test(
    "cold boot in a slot: envd answers /health at nsIp:49983; QEMU runs in the slot's namespace",
    async () => {
      slotA = await acquire();
      const t0 = performance.now();
      const d = await drives([fx.rootfsLayer], "a");
      rootfsA = d.rootfsId;
      const t1 = performance.now();
      vmA = await driver.boot({
        id: "sbx-a",
        runDir: join(root, "a"),
        kernel: fx.kernel.vmlinux,
        initrd: fx.kernel.initrd,
        cmdline: guestCmdline({ ip: `${slotA.guestIp}/${slotA.guestPrefixLen}`, gw: slotA.gatewayIp }),
        vcpus: 1,
        memMiB: 256,
        drives: d.drives,
        net: { tap: slotA.tap, mac: slotA.guestMac },
        netnsPath: slotA.netnsPath,
      });
      live.add(vmA);
      const t2 = performance.now();
      const guest = await waitEnvd(slotA, vmA, 60_000);
      console.log(`  cold boot → envd /health: ${Math.round(performance.now() - t0)} ms (devices ${Math.round(t1 - t0)} ms, QEMU ${Math.round(t2 - t1)} ms, guest + envd ${Math.round(guest)} ms)`);
      // The pid we hold is QEMU itself (nsenter execs in place), inside the slot's namespace.
      expect(readFileSync(`/proc/${vmA.pid}/cmdline`, "utf8")).toContain("qemu-system");
      expect(statSync(`/proc/${vmA.pid}/ns/net`).ino).toBe(statSync(slotA.netnsPath).ino);
      await vmA.syncConsole(); // the node drains QEMU's console ring on a timer: take what it holds now
      expect(readFileSync(vmA.consoleLog, "utf8")).toContain("aenv: ready");
      sbxA = await sdk(slotA);
    },
    180_000,
  );

  test(
    "envd runs from the tools disk with its own loader and libc; the user image has none",
    async () => {
      const r = await sbxA.commands.run("echo $PPID; cat /proc/$PPID/cmdline | tr '\\0' ' '; echo; grep -o '/agentenv/lib/[a-z.0-9-]*' /proc/$PPID/maps | sort -u; ls /lib /lib64 /usr/lib 2>&1 | head -3");
      const [pid, cmd, ...rest] = r.stdout.trim().split("\n");
      expect(Number(pid)).toBeGreaterThan(1);
      expect(cmd!.trim()).toBe(`/agentenv/envd --guest --port ${ENVD_PORT}`);
      expect(rest).toContain("/agentenv/lib/libc.so.6");
      expect(rest).toContain("/agentenv/lib/ld-linux-x86-64.so.2");
      expect(rest.join("\n")).toMatch(/No such file/); // a busybox image: no /lib of its own
    },
    150_000,
  );

  test(
    "commands: stdout, stderr, exit codes, env, background + wait, stdin, kill",
    async () => {
      const r = await sbxA.commands.run("echo out; echo err >&2; id -u; pwd");
      expect(r.exitCode).toBe(0);
      expect(r.stdout).toBe("out\n0\n/root\n");
      expect(r.stderr).toBe("err\n");
      // user's supplementary group comes from the image's /etc/group, through the tools disk's setpriv.
      expect((await sbxA.commands.run("id -G", { user: "user" })).stdout.trim()).toBe("1000 10");

      const err = await sbxA.commands.run("echo partial; exit 7").catch((e) => e);
      expect(err).toBeInstanceOf(CommandExitError);
      expect(err.exitCode).toBe(7);
      expect(err.stdout).toBe("partial\n");

      const env = await sbxA.commands.run('echo "$FOO|$E2B_SANDBOX"; pwd', { envs: { FOO: "bar baz" }, cwd: "/tmp" });
      expect(env.stdout).toBe("bar baz|true\n/tmp\n");

      const bg = await sbxA.commands.run("sleep 0.3; echo done", { background: true });
      expect((await sbxA.commands.list()).some((p) => p.pid === bg.pid)).toBe(true);
      expect((await bg.wait()).stdout).toBe("done\n");

      const cat = await sbxA.commands.run("cat", { background: true, stdin: true });
      let out = "";
      await sbxA.commands.connect(cat.pid, { onStdout: (d) => void (out += d) });
      await sbxA.commands.sendStdin(cat.pid, "hello ");
      await sbxA.commands.sendStdin(cat.pid, "guest");
      await until(() => out === "hello guest", 30_000, "stdin echoed");
      await cat.closeStdin();
      expect((await cat.wait()).stdout).toBe("hello guest");

      const sleeper = await sbxA.commands.run("sleep 60", { background: true });
      expect(await sbxA.commands.kill(sleeper.pid)).toBe(true);
      const killed = await sleeper.wait().catch((e) => e);
      expect(killed).toBeInstanceOf(CommandExitError);
      expect(killed.error).toBe("signal: killed");
    },
    150_000,
  );

  test(
    "files: write, read, list, remove; watchDir sees writes, creates and removes",
    async () => {
      const w = await sbxA.files.write("notes/a.txt", "hello from the host");
      expect(w.path).toBe("/root/notes/a.txt");
      expect(await sbxA.files.read("notes/a.txt")).toBe("hello from the host");
      await sbxA.files.write([
        { path: "/srv/data/x.bin", data: new Blob([new Uint8Array(100_000).fill(7)]) },
        { path: "/srv/data/y.txt", data: "y" },
      ]);
      expect((await sbxA.files.list("/srv/data")).map((e) => e.name)).toEqual(["x.bin", "y.txt"]);
      expect((await sbxA.files.getInfo("/srv/data/x.bin")).size).toBe(100_000);
      expect((await sbxA.commands.run("md5sum /srv/data/x.bin | cut -c1-32")).stdout.trim()).toBe(
        new Bun.CryptoHasher("md5").update(new Uint8Array(100_000).fill(7)).digest("hex"),
      );
      await sbxA.files.remove("/srv/data/y.txt");
      expect(await sbxA.files.exists("/srv/data/y.txt")).toBe(false);

      await sbxA.files.makeDir("watched");
      const events: { name: string; type: string }[] = [];
      const handle = await sbxA.files.watchDir("watched", (e) => void events.push({ name: e.name, type: e.type }), { recursive: true });
      try {
        await sbxA.files.write("watched/f.txt", "1");
        await until(() => events.some((e) => e.name === "f.txt" && e.type === FilesystemEventType.WRITE), 30_000, "write event");
        await sbxA.commands.run("mkdir /root/watched/sub && echo g > /root/watched/sub/g.txt");
        await until(() => events.some((e) => e.name === "sub/g.txt"), 30_000, "nested create event");
        await sbxA.files.remove("watched/f.txt");
        await until(() => events.some((e) => e.name === "f.txt" && e.type === FilesystemEventType.REMOVE), 30_000, "remove event");
      } finally {
        await handle.stop();
      }
    },
    150_000,
  );

  test(
    "PTY: interactive shell on /dev/pts, resize, exit",
    async () => {
      let out = "";
      const dec = new TextDecoder();
      const h = await sbxA.pty.create({ cols: 80, rows: 24, envs: { FOO: "bar" }, onData: (d) => void (out += dec.decode(d, { stream: true })) });
      await sbxA.pty.sendInput(h.pid, new TextEncoder().encode("echo pty-$FOO; tty\n"));
      await until(() => out.includes("pty-bar") && out.includes("/dev/pts/"), 30_000, "pty output");
      await sbxA.pty.resize(h.pid, { cols: 100, rows: 30 });
      await sbxA.pty.sendInput(h.pid, new TextEncoder().encode("stty size\n"));
      await until(() => /\b30 100\b/.test(out), 30_000, "resized");
      await sbxA.pty.sendInput(h.pid, new TextEncoder().encode("exit\n"));
      expect((await h.wait()).exitCode).toBe(0);
    },
    150_000,
  );

  test(
    "kill -9 envd inside the guest: the supervisor brings it back within seconds",
    async () => {
      const old = Number((await sbxA.commands.run("echo $PPID")).stdout.trim());
      // Detached, so the kill does not depend on the request that started it.
      const tKill = performance.now() + 200;
      await sbxA.commands.run(`setsid sh -c 'sleep 0.2; kill -9 ${old}' </dev/null >/dev/null 2>&1 &`);
      await until(
        async () => {
          try {
            await fetch(`${envdUrl(slotA)}/health`, { signal: AbortSignal.timeout(300) });
            return false;
          } catch {
            return true;
          }
        },
        30_000,
        "envd gone",
      );
      await waitEnvd(slotA, vmA, 60_000);
      const back = performance.now() - tKill;
      console.log(`  envd answers again ${Math.round(back)} ms after kill -9 (the supervisor waits 1 s, then envd starts)`);
      const r = await sbxA.commands.run("echo $PPID; cat /run/aenv/envd.restarts");
      const [pid, restarts] = r.stdout.trim().split("\n").map(Number);
      expect(pid).not.toBe(old);
      expect(restarts).toBe(1);
    },
    150_000,
  );

  test(
    "pause/resume: envd stops answering while paused; a running process survives and carries on",
    async () => {
      // Tracked by envd (no deadline), so after a restore envd still lists it.
      const h: CommandHandle = await sbxA.commands.run("n=0; while :; do n=$((n+1)); echo $n > /tmp/counter; sleep 0.1; done", { background: true, timeoutMs: 0 });
      counterPid = h.pid;
      await h.disconnect();
      await until(async () => (await sbxA.files.exists("/tmp/counter")), 30_000, "counter started");
      await vmA.pause();
      const stalled = await fetch(`${envdUrl(slotA)}/health`, { signal: AbortSignal.timeout(700) }).then(
        () => "answered",
        () => "no answer",
      );
      expect(stalled).toBe("no answer");
      await vmA.resume();
      const c1 = Number(await sbxA.files.read("/tmp/counter"));
      await until(async () => Number(await sbxA.files.read("/tmp/counter")) > c1, 30_000, "the counter carries on");
      expect((await sbxA.commands.list()).some((p) => p.pid === counterPid)).toBe(true);
    },
    150_000,
  );

  test(
    "snapshot + restack, restore into a second VM in a second slot: same files, same processes, clock set by /init",
    async () => {
      await sbxA.files.write("/root/marker", "before-snapshot");
      await sbxA.commands.run("sync");
      const t0 = performance.now();
      snap = await vmA.snapshot(join(root, "snap"));
      snapAt = Date.now();
      const t1 = performance.now();
      await client.call("restack", { id: rootfsA, layerPath: snapLayer });
      console.log(`  snapshot ${Math.round(t1 - t0)} ms (state ${statSync(snap.statePath).size} B) + restack ${Math.round(performance.now() - t1)} ms`);
      expect(vmA.state).toBe("snapshotted");
      await stop(vmA);
      // Slot A stays leased until B is taken, so the restore really lands in another namespace.
      slotB = await acquire();
      await release(slotA);
      expect(slotB.nsIp).not.toBe(slotA.nsIp);

      // Let the guest clock fall visibly behind, so /init has something to correct.
      await Bun.sleep(Math.max(0, 4000 - (Date.now() - snapAt)));
      const r0 = performance.now();
      const d = await drives([fx.rootfsLayer, snapLayer], "b");
      const r1 = performance.now();
      vmB = await driver.restore(snap, { id: "sbx-b", runDir: join(root, "b"), drives: d.drives, net: { tap: slotB.tap, mac: slotB.guestMac }, netnsPath: slotB.netnsPath });
      live.add(vmB);
      const r2 = performance.now();
      const guest = await waitEnvd(slotB, vmB, 60_000);
      console.log(`  restore → envd /health: ${Math.round(performance.now() - r0)} ms (devices ${Math.round(r1 - r0)} ms, QEMU + state ${Math.round(r2 - r1)} ms, guest ${Math.round(guest)} ms)`);
      expect(statSync(`/proc/${vmB.pid}/ns/net`).ino).toBe(statSync(slotB.netnsPath).ino);
      sbxB = await sdk(slotB);

      const before = await guestClock(sbxB);
      const initAt = Date.now() / 1000;
      const init = await fetch(`${envdUrl(slotB)}/init`, { method: "POST", body: JSON.stringify({ timestamp: new Date(initAt * 1000).toISOString() }) });
      expect(init.status).toBe(204);
      const after = await guestClock(sbxB);
      console.log(`  guest clock vs host: ${(before.guest - before.hostBefore).toFixed(1)} s after restore, ${(after.guest - after.hostBefore).toFixed(1)} s after /init`);
      // Order, not a skew figure: stopped at the snapshot's time (≥ 4 s before the restore), then
      // set to the /init timestamp and running from there, never ahead of the host.
      expect(before.guest).toBeLessThan(before.hostBefore - 2);
      expect(after.guest).toBeGreaterThanOrEqual(Math.floor(initAt));
      expect(after.guest).toBeLessThanOrEqual(Math.ceil(after.hostAfter));

      expect(await sbxB.files.read("/root/marker")).toBe("before-snapshot");
      expect(await sbxB.files.read("/root/notes/a.txt")).toBe("hello from the host");
      expect((await sbxB.commands.list()).some((p) => p.pid === counterPid)).toBe(true);
      const c1 = Number(await sbxB.files.read("/tmp/counter"));
      await until(async () => Number(await sbxB.files.read("/tmp/counter")) > c1, 30_000, "the counter carries on in B");
      // Its writes reach its own upper: they survive dropping the guest's page cache.
      await sbxB.commands.run("echo b > /root/who; sync; echo 3 > /proc/sys/vm/drop_caches");
      expect(await sbxB.files.read("/root/who")).toBe("b\n");
    },
    150_000,
  );

  test(
    "two restores of one snapshot side by side in separate slots: both answer, separate state",
    async () => {
      expect(vmB?.state).toBe("running");
      const md5 = () => new Bun.CryptoHasher("md5").update(readFileSync(snap.memPath!)).digest("hex");
      const memBefore = md5();
      const slotC = await acquire();
      const d = await drives([fx.rootfsLayer, snapLayer], "c");
      const vmC = await driver.restore(snap, { id: "sbx-c", runDir: join(root, "c"), drives: d.drives, net: { tap: slotC.tap, mac: slotC.guestMac }, netnsPath: slotC.netnsPath });
      live.add(vmC);
      try {
        await waitEnvd(slotC, vmC, 60_000);
        const sbxC = await sdk(slotC);
        await sbxC.files.write("/root/who", "c\n");
        await sbxC.commands.run(`kill ${counterPid}`);
        await Promise.all([
          sbxB.commands.run("echo from-b > /tmp/own"),
          sbxC.commands.run("echo from-c > /tmp/own"),
        ]);
        expect([await sbxB.files.read("/root/who"), await sbxC.files.read("/root/who")]).toEqual(["b\n", "c\n"]);
        expect([await sbxB.files.read("/tmp/own"), await sbxC.files.read("/tmp/own")]).toEqual(["from-b\n", "from-c\n"]);
        // The counter was killed in C only; B's copy of the same process runs on.
        await until(async () => !(await sbxC.commands.list()).some((p) => p.pid === counterPid), 30_000, "counter gone in C");
        expect((await sbxB.commands.list()).some((p) => p.pid === counterPid)).toBe(true);
        expect(await sbxC.files.read("/root/marker")).toBe("before-snapshot");
        expect(new Set([vmB.pid, vmC.pid]).size).toBe(2);
        // Both restores woke with one CRNG state; /init's fresh entropy makes their randomness differ.
        for (const s of [slotB, slotC]) {
          const seed = Buffer.from(crypto.getRandomValues(new Uint8Array(64))).toString("base64");
          const r = await fetch(`${envdUrl(s)}/init`, { method: "POST", body: JSON.stringify({ timestamp: new Date().toISOString(), aenvEntropy: seed }) });
          expect(r.status).toBe(204);
        }
        const rnd = "head -c 16 /dev/urandom | od -An -tx1";
        const [rb, rc] = await Promise.all([sbxB.commands.run(rnd), sbxC.commands.run(rnd)]);
        expect(rb.stdout.trim().length).toBeGreaterThan(0);
        expect(rb.stdout).not.toBe(rc.stdout);
      } finally {
        await stop(vmC);
        await release(slotC);
      }
      expect(md5()).toBe(memBefore); // restores map the image copy-on-write; nobody wrote it
    },
    150_000,
  );

  test(
    "a QEMU that cannot start reports its stderr and leaves nothing running",
    async () => {
      const pidsBefore = qemuPids(root);
      const spec = {
        id: "bad",
        runDir: join(root, "bad"),
        kernel: fx.kernel.vmlinux,
        initrd: fx.kernel.initrd,
        cmdline: guestCmdline(),
        vcpus: 1,
        memMiB: 128,
        drives: [{ path: fx.toolsImage, readOnly: true }],
      };
      // A VM that starts after all must not outlive the test.
      const failure = (p: Promise<Vmm>) => p.then(async (vm) => void (await vm.stop()), (e: Error) => e);
      // Slot B's TAP is held by the running restore: a second VMM cannot attach to it.
      expect(vmB?.state).toBe("running");
      const busy = await failure(driver.boot({ ...spec, net: { tap: slotB.tap }, netnsPath: slotB.netnsPath }));
      expect(busy?.name).toContain("StartFailed");
      expect(busy?.message).toContain("could not configure /dev/net/tun (tap0): Device or resource busy");
      // A namespace that does not exist: nsenter's own complaint comes back.
      const nons = await failure(driver.boot({ ...spec, netnsPath: `/run/netns/${PREFIX}nonexistent` }));
      expect(nons?.name).toContain("StartFailed");
      expect(nons?.message).toContain("No such file or directory");
      expect(qemuPids(root)).toEqual(pidsBefore);
    },
    150_000,
  );

  test(
    "nothing leaks: QEMU processes, slots (namespaces, links), blockd devices",
    async () => {
      if (vmB) await stop(vmB);
      if (slotB) await release(slotB);
      expect(live.size).toBe(0);
      expect(leased.size).toBe(0);
      expect(qemuPids(root)).toEqual([]);
      expect(qemuPids(root)).toEqual(before.qemu);
      await pool.destroy();
      expect(namespaces()).toEqual(before.netns);
      expect(hostLinks()).toEqual(before.links);
      for (const id of devices) await client.call("delete", { id });
      expect((await client.call<unknown[]>("list")).length).toBe(before.devices);
    },
    150_000,
  );
});
