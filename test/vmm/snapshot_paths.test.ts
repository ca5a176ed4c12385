// A snapshot from a shared store chooses no host path: entries crafted into a directory store (as
// any node that writes the store could) are confined the way the orchestrator materializes them,
// and the QEMU driver refuses a kernel or initrd outside the node's guest files before it starts anything.
import { expect, test } from "bun:test";
import { existsSync, mkdirSync, symlinkSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { DirSnapshotStore, type Json } from "../../src/snapshot/index.ts";
import { QemuDriver } from "../../src/vmm/qemu.ts";
import { confineSnapshot, isInside, SnapshotPathError } from "../../src/vmm/snapshot_paths.ts";
import { type SnapshotInfo, VmmError } from "../../src/vmm/types.ts";
import { scratchDir } from "../helpers/tmp.ts";

const root = scratchDir("snapshot-paths");
const guest = join(root, "guest");
mkdirSync(join(guest, "kernel"), { recursive: true });
const kernel = join(guest, "kernel", "vmlinux");
const initrd = join(guest, "kernel", "initramfs.cpio");
for (const f of [kernel, initrd]) writeFileSync(f, "x");
// A link inside the guest directory that leads out of it.
symlinkSync("/etc/hostname", join(guest, "kernel", "escape"));
const store = new DirSnapshotStore(join(root, "store"));
const stateFile = join(root, "vmstate-src");
writeFileSync(stateFile, "QEVM");

/** What a node on the store would have written: the VM as it ran there, with `spec` overrides. */
function storedVm(spec: Partial<SnapshotInfo["spec"]>, extra?: Record<string, unknown>): SnapshotInfo {
  return {
    vmm: "qemu", dir: "/elsewhere/checkpoints/x", statePath: "/elsewhere/checkpoints/x/vmstate", createdAt: new Date().toISOString(),
    spec: {
      id: "src", runDir: "/run/aenv/vms/src", kernel, initrd, cmdline: "console=ttyS0", vcpus: 1, memMiB: 128,
      drives: [{ path: "/run/blockd/dev/ro-1", readOnly: true }, { path: "/run/blockd/dev/rw-2" }], memFile: "/dev/shm/src/ram", netnsPath: "/run/netns/aenv-1", ...spec,
    },
    ...(extra ? { extra } : {}),
  };
}

/** Put `vm` into the store as a snapshot, take it out again and build its description as the orchestrator's materializeSnapshot does, then confine it. */
async function materialize(id: string, vm: SnapshotInfo): Promise<SnapshotInfo> {
  await store.put(id, [{ name: "vmstate", path: stateFile }], { vm } as unknown as Json);
  const got = await store.get(id);
  const meta = got.meta as unknown as { vm: SnapshotInfo };
  const dir = join(root, "checkpoints", `snapshot-${id}`);
  mkdirSync(dir, { recursive: true });
  const described: SnapshotInfo = { ...meta.vm, dir, statePath: join(dir, "vmstate"), memPath: got.paths.mem ? join(dir, "mem") : undefined };
  return confineSnapshot(described, { checkpointDir: dir, bootDirs: [join(guest, "kernel")] });
}

test("a stored snapshot whose kernel or initrd leads out of the node's guest files is refused, by name", async () => {
  const refused = async (id: string, vm: SnapshotInfo) => {
    const e = await materialize(id, vm).catch((err) => err);
    expect(e).toBeInstanceOf(SnapshotPathError);
    return (e as Error).message;
  };
  expect(await refused("k-abs", storedVm({ kernel: "/etc/shadow" }))).toContain(`snapshot kernel "/etc/shadow" is outside this node's guest files`);
  expect(await refused("i-dots", storedVm({ initrd: join(guest, "kernel", "..", "..", "..", "etc", "passwd") }))).toContain("snapshot initrd");
  expect(await refused("k-link", storedVm({ kernel: join(guest, "kernel", "escape") }))).toContain("escape");
  expect(await refused("k-rel", storedVm({ kernel: "vmlinux" }))).toContain("outside");
  expect(await refused("k-type", storedVm({ kernel: 7 as unknown as string }))).toContain("not a path");
  expect(await refused("k-nul", storedVm({ kernel: `${kernel}\0/etc/shadow` }))).toContain("outside");
});

test("a good stored snapshot keeps its boot files and loses the source VM's paths", async () => {
  const vm = await materialize("good", storedVm({}, { base: "/elsewhere/mem", accel: "tcg" }));
  const dir = join(root, "checkpoints", "snapshot-good");
  expect(vm.spec.kernel).toBe(kernel);
  expect(vm.spec.initrd).toBe(initrd);
  expect(vm.statePath).toBe(join(dir, "vmstate"));
  expect(vm.spec.drives).toEqual([{ path: "", readOnly: true }, { path: "" }]);
  expect(vm.spec.runDir).toBe(dir);
  expect("memFile" in vm.spec || "netnsPath" in vm.spec).toBe(false);
  expect(vm.extra).toEqual({ accel: "tcg" });
});

test("the checkpoint's own files must lie in it", () => {
  const dir = join(root, "checkpoints", "own");
  const vm = { ...storedVm({}), dir, statePath: join(dir, "vmstate") };
  const places = { checkpointDir: dir, bootDirs: [join(guest, "kernel")] };
  expect(() => confineSnapshot({ ...vm, statePath: "/etc/shadow" }, places)).toThrow(/statePath "\/etc\/shadow" is outside its checkpoint directory/);
  expect(() => confineSnapshot({ ...vm, memPath: join(dir, "..", "other", "mem") }, places)).toThrow(/memPath/);
  expect(() => confineSnapshot({ ...vm, dir: "/" }, places)).toThrow(/dir/);
  expect(isInside(join(dir, "vmstate"), dir)).toBe(true);
  expect(isInside(`${dir}-sibling/vmstate`, dir)).toBe(false);
});

test("the QEMU driver with the node's guest directories refuses such a snapshot before anything starts", async () => {
  const driver = new QemuDriver({ accel: "tcg", bootDirs: [guest], runAs: null });
  const runDir = join(root, "run", "r1");
  const err = await driver.restore({ ...storedVm({ kernel: "/etc/shadow" }), statePath: stateFile }, { id: "r1", runDir, drives: [] }).catch((e) => e);
  expect(err).toBeInstanceOf(VmmError);
  expect([err.code, err.message]).toEqual(["BadSpec", expect.stringContaining(`snapshot kernel "/etc/shadow" is outside this node's guest files`)]);
  expect(existsSync(runDir)).toBe(false);
});
