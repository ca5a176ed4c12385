import { describe, expect, test } from "bun:test";
import { mkdirSync, readFileSync, statSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { API_KEY_FORMAT, ConfigError, SETTINGS, loadConfig, resolveApiKey, s3Scopes } from "../../src/node/config.ts";
import { scratchDir } from "../helpers/tmp.ts";

const dir = scratchDir("config");

describe("node settings", () => {
  test("defaults with nothing configured; $AENV_HOME expands", () => {
    const home = join(dir, "h1");
    const c = loadConfig({ AENV_HOME: home });
    expect(c.host).toBe("0.0.0.0");
    expect(c.port).toBe(3000);
    expect(c.defaultTimeoutS).toBe(300);
    expect(c.uploadUrlTtlS).toBe(3600);
    expect(c.vmm).toBe("auto");
    expect(c.snapshotStore).toBe(join(home, "snapshots"));
  });

  test("node.toml sets values; the environment wins over it", () => {
    const home = join(dir, "h2");
    mkdirSync(home, { recursive: true });
    writeFileSync(join(home, "node.toml"), 'port = 4000\nhost = "127.0.0.1"\nvmm = "qemu"\n');
    const c = loadConfig({ AENV_HOME: home, PORT: "5000" });
    expect(c.port).toBe(5000);
    expect(c.host).toBe("127.0.0.1");
    expect(c.vmm).toBe("qemu");
  });

  test("malformed values and unknown keys are ConfigErrors naming the setting", () => {
    const home = join(dir, "h3");
    mkdirSync(home, { recursive: true });
    expect(() => loadConfig({ AENV_HOME: home, PORT: "70000" })).toThrow(/PORT=70000/);
    expect(() => loadConfig({ AENV_HOME: home, AENV_VMM: "xen" })).toThrow(ConfigError);
    writeFileSync(join(home, "node.toml"), "prot = 1\n");
    expect(() => loadConfig({ AENV_HOME: home })).toThrow(/unknown setting 'prot'/);
    writeFileSync(join(home, "node.toml"), "port = [\n");
    expect(() => loadConfig({ AENV_HOME: home })).toThrow(ConfigError);
  });

  test("the guest cache, VMM binaries, blockd, S3 and Docker settings: defaults, node.toml, environment", () => {
    const home = join(dir, "h4");
    const c = loadConfig({ AENV_HOME: home });
    expect(c.guestCache).toBe(join(home, "guest"));
    expect([c.qemuBin, c.qemuAccel, c.firecrackerBin]).toEqual(["qemu-system-x86_64", "auto", "firecracker"]);
    expect([c.blockdFrontend, c.fuseUring, c.fuseReaderSlots]).toEqual(["auto", false, 8]);
    expect([c.s3Endpoint, c.s3Region, c.s3AccessKeyId, c.s3SecretAccessKey, c.s3SessionToken]).toEqual(["", "us-east-1", "", "", ""]);
    expect(c.dockerConfig).toBe("");
    mkdirSync(home, { recursive: true });
    writeFileSync(join(home, "node.toml"), 'fuse_uring = true\nqemu_accel = "tcg"\ns3_endpoint = "http://127.0.0.1:9000"\nguest_cache = "/srv/guest"\n');
    const t = loadConfig({ AENV_HOME: home, AENV_FUSE_READER_SLOTS: "0", AWS_ACCESS_KEY_ID: "k", AENV_BLOCKD_FRONTEND: "fuse" });
    expect([t.fuseUring, t.qemuAccel, t.s3Endpoint, t.guestCache]).toEqual([true, "tcg", "http://127.0.0.1:9000", "/srv/guest"]);
    expect([t.fuseReaderSlots, t.s3AccessKeyId, t.blockdFrontend]).toEqual([0, "k", "fuse"]);
    expect(loadConfig({ AENV_HOME: home, AENV_FUSE_URING: "0" }).fuseUring).toBe(false);
  });

  test("a malformed new setting names it", () => {
    const home = join(dir, "h5");
    expect(() => loadConfig({ AENV_HOME: home, AENV_QEMU_ACCEL: "hvf" })).toThrow(/AENV_QEMU_ACCEL=hvf/);
    expect(() => loadConfig({ AENV_HOME: home, AENV_BLOCKD_FRONTEND: "nbd" })).toThrow(/AENV_BLOCKD_FRONTEND=nbd/);
    expect(() => loadConfig({ AENV_HOME: home, AENV_FUSE_URING: "yes" })).toThrow(/AENV_FUSE_URING=yes/);
    expect(() => loadConfig({ AENV_HOME: home, AENV_FUSE_READER_SLOTS: "65" })).toThrow(/AENV_FUSE_READER_SLOTS=65/);
    expect(() => loadConfig({ AENV_HOME: home, AENV_S3_ENDPOINT: "ftp://x" })).toThrow(/AENV_S3_ENDPOINT=ftp:\/\/x/);
    expect(() => loadConfig({ AENV_HOME: home, AWS_REGION: "US East" })).toThrow(/AWS_REGION=US East/);
    mkdirSync(home, { recursive: true });
    writeFileSync(join(home, "node.toml"), 'blockd_frontend = "loop"\n');
    expect(() => loadConfig({ AENV_HOME: home })).toThrow(/blockd_frontend=loop/);
  });

  test("docs/node.md lists every setting with its env, key and default", () => {
    const doc = readFileSync(join(import.meta.dir, "../../docs/node.md"), "utf8");
    for (const s of Object.values(SETTINGS)) {
      const row = doc.split("\n").find((l) => l.startsWith(`| \`${s.env}\` |`));
      expect(row, s.env).toBeDefined();
      expect(row).toContain(`\`${s.toml}\``);
      expect(row).toContain(s.default === "" ? "(empty)" : `\`${s.default}\``);
    }
  });
});

describe("API key", () => {
  test("generated once in E2B's format, mode 0600, then read back", () => {
    const home = join(dir, "k1");
    const a = resolveApiKey({ apiKey: "", home });
    expect(a.key).toMatch(API_KEY_FORMAT);
    expect(a.path).toBe(join(home, "secrets/api-key"));
    expect(statSync(a.path!).mode & 0o777).toBe(0o600);
    expect(resolveApiKey({ apiKey: "", home }).key).toBe(a.key);
  });

  test("a configured key wins; a malformed configured or stored key is refused", () => {
    const home = join(dir, "k2");
    const key = "k".repeat(40);
    expect(resolveApiKey({ apiKey: key, home })).toEqual({ key, path: null });
    expect(() => resolveApiKey({ apiKey: "short", home })).toThrow(ConfigError);
    mkdirSync(join(home, "secrets"), { recursive: true });
    writeFileSync(join(home, "secrets/api-key"), "bad key with spaces\n");
    expect(() => resolveApiKey({ apiKey: "", home })).toThrow(/not an API key/);
  });
});

describe("outbound and disk settings", () => {
  test("insecure registries, blob and disk bounds, the disk reserve and S3 buckets: defaults, lists, malformed entries named", () => {
    const home = join(dir, "h-bounds");
    const c = loadConfig({ AENV_HOME: home });
    expect([c.insecureRegistries, c.maxBlobMB, c.maxDiskSizeMB, c.diskReserveMB, c.s3Buckets]).toEqual([[], 10240, 65536, 2048, []]);
    const t = loadConfig({ AENV_HOME: home, AENV_INSECURE_REGISTRIES: "127.0.0.1:5000, reg.lan ,[::1]:5001", AENV_S3_BUCKETS: "templates,team-bucket/a/b" });
    expect(t.insecureRegistries).toEqual(["127.0.0.1:5000", "reg.lan", "[::1]:5001"]);
    expect(t.s3Buckets).toEqual(["templates", "team-bucket/a/b"]);
    expect(() => loadConfig({ AENV_HOME: home, AENV_INSECURE_REGISTRIES: "http://reg.lan" })).toThrow(/AENV_INSECURE_REGISTRIES=http:\/\/reg.lan: 'http:\/\/reg.lan' is not host or host:port/);
    expect(() => loadConfig({ AENV_HOME: home, AENV_S3_BUCKETS: "ok-bucket,x/../y" })).toThrow(/'x\/..\/y' is not bucket or bucket\/prefix/);
    expect(() => loadConfig({ AENV_HOME: home, AENV_MAX_DISK_SIZE_MB: "100" })).toThrow(/AENV_MAX_DISK_SIZE_MB=100/);
  });

  test("S3 scopes: s3_buckets, else the snapshot store's bucket when it is in S3, else none", () => {
    const home = join(dir, "h-scopes");
    expect(s3Scopes(loadConfig({ AENV_HOME: home }))).toEqual([]);
    expect(s3Scopes(loadConfig({ AENV_HOME: home, AENV_SNAPSHOT_STORE: "s3://snaps/node1" }))).toEqual(["snaps"]);
    expect(s3Scopes(loadConfig({ AENV_HOME: home, AENV_SNAPSHOT_STORE: "s3://snaps/node1", AENV_S3_BUCKETS: "images/team" }))).toEqual(["images/team"]);
  });
});
