// Egress policies on real slots: a fake guest (harness.ts) behind the slot sends traffic to a test
// "internet" (internet.ts), a namespace of this run reached through the host's routing over a veth
// of this run. Nothing leaves for the host's real networks.
import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import tls from "node:tls";
import { DEFAULT_ALWAYS_DENIED, Egress, EgressProxy, parseEgressPolicy, sniff, type SlotPool } from "../../src/network/index.ts";
import { netnsExecArgv, type Slot } from "../../src/network/index.ts";
import { canRun, slotSuite, egressSlot, eventually, hostCounter, policyErrorField, slotTestScaffold, startFakeGuest } from "./harness.ts";
import { fromGuest, startInternet, type TestInternet } from "./internet.ts";

describe("egress policy input", () => {
  test("E2B's fields become a policy; allow_internet_access false denies the internet", () => {
    const p = parseEgressPolicy(false, { allowOut: ["1.2.3.4", "10.0.0.0/8", "*.Example.com", "api.example.org"], denyOut: ["0.0.0.0/0", "::/0"], httpsPorts: [8443] });
    expect(p).toEqual({
      internet: false, allowCidrs: ["1.2.3.4/32", "10.0.0.0/8"], denyCidrs: ["0.0.0.0/0"],
      allowDomains: ["*.example.com", "api.example.org"], denyDomains: [], proxiedPorts: [80, 443, 8443], rules: [], upstream: undefined,
    });
    expect(parseEgressPolicy(undefined, undefined).internet).toBe(true);
  });

  test("malformed entries are refused naming the field", () => {
    const field = policyErrorField;
    expect(field(() => parseEgressPolicy(true, { allowOut: ["1.2.3.4", "300.1.1.1"] }))).toBe("network.allowOut[1]");
    expect(field(() => parseEgressPolicy(true, { denyOut: ["10.0.0.1/8"] }))).toBe("network.denyOut[0]");
    expect(field(() => parseEgressPolicy(true, { denyOut: ["exa mple.com"] }))).toBe("network.denyOut[0]");
    expect(field(() => parseEgressPolicy(true, { allowOut: ["*.*.com"] }))).toBe("network.allowOut[0]");
    expect(field(() => parseEgressPolicy(true, { allowOut: ["-bad.com"] }))).toBe("network.allowOut[0]");
    expect(field(() => parseEgressPolicy(true, { allowOut: "1.2.3.4" }))).toBe("network.allowOut");
    expect(field(() => parseEgressPolicy(true, { httpsPorts: [0] }))).toBe("network.httpsPorts[0]");
    expect(field(() => parseEgressPolicy("yes", {}))).toBe("allow_internet_access");
    expect(field(() => parseEgressPolicy(true, { allowOut: ["1.2.3.4/33"] }))).toBe("network.allowOut[0]");
  });
});

/** The ClientHello a real TLS client (Bun's) sends for `servername`, caught by a plain TCP listener. */
async function clientHello(servername: string): Promise<Buffer> {
  const { promise, resolve } = Promise.withResolvers<Buffer>();
  const srv = Bun.listen({ hostname: "127.0.0.1", port: 0, socket: { data: (s, d) => (resolve(Buffer.from(d)), void s.terminate()) } });
  const sock = tls.connect({ host: "127.0.0.1", port: srv.port, servername, rejectUnauthorized: false });
  sock.on("error", () => {});
  try {
    return await promise;
  } finally {
    sock.destroy();
    srv.stop(true);
  }
}

describe("the name a connection claims", () => {
  test("TLS SNI, whole or in pieces; HTTP Host; garbage and missing names", async () => {
    const hello = await clientHello("x.a.test");
    expect(sniff(hello)).toEqual({ kind: "tls", name: "x.a.test" });
    for (const cut of [1, 5, 9, 40, hello.length - 1]) expect(sniff(hello.subarray(0, cut))).toEqual({ kind: "more" });
    // The same handshake message carried by two TLS records.
    const body = hello.subarray(5);
    const rec = (b: Buffer) => Buffer.concat([Buffer.from([0x16, 0x03, 0x01, b.length >> 8, b.length & 255]), b]);
    expect(sniff(Buffer.concat([rec(body.subarray(0, 30)), rec(body.subarray(30))]))).toEqual({ kind: "tls", name: "x.a.test" });
    expect(sniff(Buffer.from("GET / HTTP/1.1\r\nHost: Example.COM:8080\r\n\r\n"))).toEqual({ kind: "http", name: "example.com" });
    expect(sniff(Buffer.from("GET / HTTP/1.1\r\nUser-Agent: x\r\n\r\n"))).toEqual({ kind: "http", name: undefined });
    expect(sniff(Buffer.from("GET / HTTP/1.1\r\nHost: a"))).toEqual({ kind: "more" });
    expect(sniff(Buffer.from("GE"))).toEqual({ kind: "more" });
    expect(sniff(Buffer.from([0, 1, 2, 3, 250, 13, 10]))).toEqual({ kind: "unknown" });
    expect(sniff(Buffer.from([0x16, 0x03, 0x01, 0x00, 0x05, 0x02, 0, 0, 1, 0]))).toEqual({ kind: "tls", name: undefined });
  });
});

describe.skipIf(!canRun)(slotSuite("egress by CIDR"), () => {
  const t = slotTestScaffold();
  let net: TestInternet;

  beforeAll(async () => {
    net = await startInternet();
  });
  afterAll(async () => {
    await net?.stop();
  });

  async function setup(o: { proxy?: EgressProxy } = {}): Promise<{ pool: SlotPool; egress: Egress; slot: Slot; guest: string }> {
    const pool = t.newPool({ size: 0 });
    await pool.start();
    const egress = new Egress(pool.config, { alwaysDenied: DEFAULT_ALWAYS_DENIED, resolvers: [net.ips[0]!], uplinks: [net.uplink], proxyPort: o.proxy?.port });
    o.proxy?.use(egress);
    await egress.start();
    const slot = await pool.acquire();
    const guest = t.keep(await startFakeGuest(slot, "guest"));
    return { pool, egress, slot, guest: guest.netns };
  }

  const http = (ip: string) => ({ op: "http", ip, port: 80, host: "h" });

  test("no policy: nothing leaves; E2B's default: the internet, as the uplink's address", async () => {
    const { egress, slot, guest } = await setup();
    expect(await fromGuest(guest, [http(net.ips[0]!)])).not.toEqual([`h@${net.ips[0]}`]);
    await egress.apply(slot, "sbx1", parseEgressPolicy(undefined, undefined));
    expect(await fromGuest(guest, [http(net.ips[0]!), http(net.ips[1]!), { op: "tcp", ip: net.ips[0], port: 7 }])).toEqual([`h@${net.ips[0]}`, `h@${net.ips[1]}`, "connected"]);
    await egress.clear(slot);
    expect(await fromGuest(guest, [{ op: "tcp", ip: net.ips[0], port: 7 }])).not.toEqual(["connected"]);
  }, 60_000);

  test("allow_internet_access false blocks everything but DNS to the node's resolver", async () => {
    const { egress, slot, guest } = await setup();
    await egress.apply(slot, "sbx1", parseEgressPolicy(false, undefined));
    const out = await fromGuest(guest, [http(net.ips[0]!), { op: "tcp", ip: net.ips[1], port: 7 }, { op: "dns", server: net.ips[0], name: "two.test" }, { op: "dns", server: net.ips[1], name: "a.test" }]);
    expect(out.slice(0, 2)).toEqual(["refused", "refused"]); // a TCP reset answers the SYN
    expect(out[2]).toEqual(net.zone["two.test"]);
    expect(Array.isArray(out[3])).toBe(false); // DNS elsewhere is ordinary traffic: refused
    expect(await egress.refusedPackets(slot)).toBeGreaterThan(0);
  }, 60_000);

  test("CIDR rules: allowOut wins over denyOut, the rest follows the internet default", async () => {
    const { egress, slot, guest } = await setup();
    const [a, b, c] = net.ips as [string, string, string];
    await egress.apply(slot, "sbx1", parseEgressPolicy(false, { allowOut: [`${a}/32`] }));
    expect(await fromGuest(guest, [http(a), http(b)])).toEqual([`h@${a}`, "refused"]);
    const subnet = `${a.split(".").slice(0, 3).join(".")}.0/24`;
    await egress.apply(slot, "sbx1", parseEgressPolicy(true, { allowOut: [b], denyOut: [subnet] }));
    expect(await fromGuest(guest, [http(a), http(b), http(c)])).toEqual(["refused", `h@${b}`, "refused"]);
    await egress.apply(slot, "sbx1", parseEgressPolicy(true, { denyOut: [c] }));
    expect(await fromGuest(guest, [http(a), http(b), http(c)])).toEqual([`h@${a}`, `h@${b}`, "refused"]);
  }, 60_000);

  test("the host, other slots and internal ranges are refused whatever the policy allows", async () => {
    const { pool, egress, slot, guest } = await setup();
    const other = await pool.acquire();
    t.keep(await startFakeGuest(other, "other"));
    const host = Bun.listen({ hostname: net.hostIp, port: 0, socket: { data() {} } });
    try {
      await egress.apply(slot, "sbx1", parseEgressPolicy(true, { allowOut: ["0.0.0.0/0", net.internalIp, other.nsIp, net.hostIp, slot.hostIp] }));
      const before = hostCounter("internal_refused");
      const out = await fromGuest(guest, [
        { op: "tcp", ip: net.internalIp, port: 7 },
        { op: "tcp", ip: other.nsIp, port: 18080 },
        { op: "tcp", ip: net.hostIp, port: host.port },
        { op: "tcp", ip: slot.hostIp, port: host.port },
        { op: "tcp", ip: "169.254.169.254", port: 80 },
        { op: "tcp", ip: net.ips[0], port: 7 }, // control
      ]);
      expect(out.slice(0, 5).filter((o) => o === "connected")).toEqual([]);
      expect(out[5]).toBe("connected");
      expect(hostCounter("internal_refused")).toBeGreaterThan(before);
    } finally {
      host.stop(true);
    }
  }, 60_000);

  test("a live policy change cuts an open connection the new policy refuses", async () => {
    const { egress, slot, guest } = await setup();
    const [a, b] = net.ips as [string, string];
    await egress.apply(slot, "sbx1", parseEgressPolicy(true, undefined));
    // Two echo clients inside the guest, writing every 100 ms and printing what happens.
    const code = (ip: string) => `const s = require("node:net").connect({host:${JSON.stringify(ip)},port:7});
      s.on("connect",()=>setInterval(()=>s.write("x"),100)); s.on("data",()=>console.log("echo"));
      s.on("error",(e)=>console.log("closed "+e.code)); s.on("close",()=>{console.log("closed");process.exit(0)});`;
    const clients = [a, b].map((ip) => {
      const p = t.keep(Bun.spawn(netnsExecArgv({ netns: guest }, [process.execPath, "-e", code(ip)]), { stdout: "pipe", stderr: "inherit" }));
      let out = "";
      void (async () => {
        for await (const c of p.stdout) out += new TextDecoder().decode(c);
      })();
      return { output: () => out };
    });
    await eventually(() => clients.every((c) => c.output().includes("echo")), "both echo clients get echoes");
    await egress.apply(slot, "sbx1", parseEgressPolicy(true, { denyOut: [a] }));
    await eventually(() => clients[0]!.output().includes("closed"), "the connection to the denied address is cut");
    const seen = clients[1]!.output().length;
    await eventually(() => clients[1]!.output().length > seen + 20, "the allowed connection carries on");
    expect(clients[1]!.output()).not.toContain("closed");
  }, 60_000);
});

describe.skipIf(!canRun)(slotSuite("egress by domain"), () => {
  const t = slotTestScaffold();
  let net: TestInternet;
  let proxy: EgressProxy;

  beforeAll(async () => {
    net = await startInternet();
    proxy = new EgressProxy({ resolvers: [net.ips[0]!] }).listen();
  });
  afterAll(async () => {
    proxy?.stop();
    await net?.stop();
  });

  const setup = () => egressSlot(t, net, proxy);

  test("allowed names pass over HTTP and HTTPS; other names, lying names and nameless connections are refused", async () => {
    const { egress, slot, guest } = await setup();
    const [a, b, c] = net.ips as [string, string, string];
    await egress.apply(slot, "sbxd", parseEgressPolicy(true, { allowOut: ["*.a.test", "two.test"], denyOut: ["0.0.0.0/0"] }));
    const out = await fromGuest(guest, [
      { op: "http", ip: a, port: 80, host: "x.a.test" },
      { op: "https", ip: a, port: 443, servername: "x.a.test" },
      { op: "https", ip: a, port: 443, servername: "two.test" },
      { op: "https", ip: b, port: 443, servername: "two.test" }, // one name, two addresses
      { op: "http", ip: a, port: 80, host: "a.test" }, // the wildcard is below a.test only
      { op: "http", ip: a, port: 80, host: "b.test" }, // refused on the same address as allowed names
      { op: "https", ip: a, port: 443, servername: "b.test" },
      { op: "https", ip: c, port: 443, servername: "x.a.test" }, // x.a.test is not c's name
      { op: "http", ip: a, port: 80 }, // no Host: judged by address alone
      { op: "tcp", ip: a, port: 7 }, // not a proxied port: the CIDR rules
    ]);
    expect(out.slice(0, 4)).toEqual([`x.a.test@${a}`, `x.a.test@${a}`, `two.test@${a}`, `two.test@${b}`]);
    expect(out.slice(4, 6)).toEqual(["status 403", "status 403"]);
    expect(out.slice(6, 8).filter((o) => typeof o === "string" && o.includes("@"))).toEqual([]);
    expect(out.slice(8)).toEqual(["status 403", "refused"]);
    const stats = proxy.statsOf("sbxd");
    expect(stats.allowed).toBe(4);
    expect(stats.denied).toBe(5);
    expect(stats.recent.some((d) => d.name === "x.a.test" && d.reason.includes("does not resolve"))).toBe(true);
  }, 60_000);

  test("a ClientHello split across packets passes; garbage is refused and the proxy keeps serving", async () => {
    const { egress, slot, guest } = await setup();
    const [a] = net.ips as [string];
    await egress.apply(slot, "sbxs", parseEgressPolicy(false, { allowOut: ["a.test"] }));
    const hello = await clientHello("a.test");
    const denied = await clientHello("b.test");
    const split = [hello.subarray(0, 3), hello.subarray(3, 60), hello.subarray(60)].map((b) => b.toString("base64"));
    const out = (await fromGuest(guest, [
      { op: "raw", ip: a, port: 443, chunks: split, gapMs: 150 },
      { op: "raw", ip: a, port: 443, chunks: [denied.toString("base64")] },
      { op: "raw", ip: a, port: 443, chunks: [Buffer.from("\x00\x01garbage\r\n\r\n").toString("base64")] },
      { op: "raw", ip: a, port: 80, chunks: [Buffer.from("NOT-HTTP at all\r\n\r\n").toString("base64")] },
    ])) as string[];
    // The server's handshake answer came back through the proxy (binary, starting with a handshake record).
    expect(out[0]!.length).toBeGreaterThan(0);
    expect(out[0]!.charCodeAt(0)).toBe(0x16);
    expect(out.slice(1)).toEqual(["reset", "reset", "reset"]); // closed without a byte
    expect(await fromGuest(guest, [{ op: "https", ip: a, port: 443, servername: "a.test" }])).toEqual([`a.test@${a}`]);
  }, 60_000);

  /** Runs `code` in the guest and collects what it prints. */
  const inGuest = (guest: string, code: string) => {
    const p = t.keep(Bun.spawn(netnsExecArgv({ netns: guest }, [process.execPath, "-e", code]), { stdout: "pipe", stderr: "inherit" }));
    let out = "";
    void (async () => {
      for await (const chunk of p.stdout) out += new TextDecoder().decode(chunk);
    })();
    return { output: () => out, exited: p.exited };
  };

  test("past SPLICE_AFTER bytes the kernel relay carries a connection: every byte both ways in order, each direction's end", async () => {
    const { egress, slot, guest } = await setup();
    const [a] = net.ips as [string];
    await egress.apply(slot, "sbxk", parseEgressPolicy(false, { allowOut: ["a.test"] }));
    // 8 MiB of random bytes up to /echo and back at once; the server's FIN first, the client's once it has read it.
    // (Not a FIN before the answer ends: Bun.serve drops the rest of an answer then, even without a proxy.)
    const code = `const c = require("node:crypto"), N = 8 << 20, data = c.randomBytes(N), got = [];
      const s = require("node:net").connect({ host: ${JSON.stringify(a)}, port: 80 });
      s.on("connect", () => {
        s.write("POST /echo HTTP/1.1\\r\\nHost: a.test\\r\\nContent-Length: " + N + "\\r\\nConnection: close\\r\\n\\r\\n");
        for (let i = 0; i < N; i += 65536) s.write(data.subarray(i, i + 65536));
      });
      s.on("data", (d) => got.push(d));
      s.on("error", (e) => console.log("error " + e.code));
      s.on("close", () => {
        let all = Buffer.concat(got), at = all.indexOf("\\r\\n\\r\\n") + 4;
        const head = all.subarray(0, at).toString(), parts = [];
        if (/transfer-encoding: chunked/i.test(head)) {
          for (;;) {
            const eol = all.indexOf("\\r\\n", at), n = parseInt(all.subarray(at, eol).toString(), 16);
            if (!(n > 0)) break;
            parts.push(all.subarray(eol + 2, eol + 2 + n));
            at = eol + 2 + n + 2;
          }
        } else parts.push(all.subarray(at));
        const body = Buffer.concat(parts), sha = (b) => c.createHash("sha256").update(b).digest("hex");
        console.log(JSON.stringify({ status: head.split(" ")[1], length: body.length, same: sha(body) === sha(data) }));
      });`;
    const g = inGuest(guest, code);
    await g.exited;
    expect(JSON.parse(g.output())).toEqual({ status: "200", length: 8 << 20, same: true });
    await eventually(() => proxy.openConnections === 0, "the proxy lets the connection go");
  }, 60_000);

  test("a live policy change closes a connection the kernel relay carries", async () => {
    const { egress, slot, guest } = await setup();
    const [a] = net.ips as [string];
    await egress.apply(slot, "sbxm", parseEgressPolicy(true, { allowOut: ["a.test"] }));
    // 1 MiB at once (past SPLICE_AFTER), then 4 KiB every 50 ms, echoed back.
    const code = `const s = require("node:net").connect({ host: ${JSON.stringify(a)}, port: 80 });
      s.on("connect", () => {
        s.write("POST /echo HTTP/1.1\\r\\nHost: a.test\\r\\nContent-Length: 104857600\\r\\n\\r\\n");
        s.write(Buffer.alloc(1 << 20, 1));
        setInterval(() => s.write(Buffer.alloc(4096, 2)), 50);
      });
      s.on("data", () => console.log("echo"));
      s.on("error", (e) => console.log("closed " + e.code)); s.on("close", () => { console.log("closed"); process.exit(0); });`;
    const g = inGuest(guest, code);
    await eventually(() => proxy.splicedConnections === 1, "the kernel relay carries the connection");
    const seen = g.output().length;
    await eventually(() => g.output().length > seen + 20, "echoes keep coming through the kernel relay");
    await egress.apply(slot, "sbxm", parseEgressPolicy(true, { denyOut: ["a.test"] }));
    await eventually(() => g.output().includes("closed"), "the relayed connection is closed");
    await eventually(() => proxy.openConnections === 0 && proxy.splicedConnections === 0, "the proxy holds nothing of it");
  }, 60_000);

  test("a live policy change closes proxied connections it now refuses", async () => {
    const { egress, slot, guest } = await setup();
    const [a] = net.ips as [string];
    await egress.apply(slot, "sbxl", parseEgressPolicy(true, { allowOut: ["a.test"] }));
    // A TLS connection held open by the guest, sending a request every 100 ms on keep-alive.
    const code = `const s = require("node:tls").connect({host:${JSON.stringify(a)},port:443,servername:"a.test",rejectUnauthorized:false});
      s.on("secureConnect",()=>setInterval(()=>s.write("GET / HTTP/1.1\\r\\nHost: a.test\\r\\n\\r\\n"),100)); s.on("data",()=>console.log("answer"));
      s.on("error",(e)=>console.log("closed "+e.code)); s.on("close",()=>{console.log("closed");process.exit(0)});`;
    const p = t.keep(Bun.spawn(netnsExecArgv({ netns: guest }, [process.execPath, "-e", code]), { stdout: "pipe", stderr: "inherit" }));
    let out = "";
    void (async () => {
      for await (const chunk of p.stdout) out += new TextDecoder().decode(chunk);
    })();
    await eventually(() => out.includes("answer"), "the held connection gets answers");
    await egress.apply(slot, "sbxl", parseEgressPolicy(true, { denyOut: ["a.test"] }));
    await eventually(() => out.includes("closed"), "the proxied connection is closed");
  }, 60_000);
});
