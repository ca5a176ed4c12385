// services/k8s: every manifest validates against Kubernetes' schemas (kubernetes-models, whose JSON-schema
// validators are generated from the Kubernetes OpenAPI spec), and the manifests agree with each other
// (kustomization, selectors, Secrets, Services). Every failure names its file and document.
//
// The validator checks types, required fields, enums and formats (quantities, int-or-string), not
// unknown fields: its schemas allow additional properties (see the last test). A misspelt field passes
// here; `kubectl apply --dry-run=server` or kubeconform -strict catch those.
import { describe, expect, test } from "bun:test";
import { readdirSync, readFileSync } from "node:fs";
import { join, resolve } from "node:path";
import { DaemonSet, Deployment, StatefulSet } from "kubernetes-models/apps/v1";
import { PodDisruptionBudget } from "kubernetes-models/policy/v1";
import { Namespace, Secret, Service } from "kubernetes-models/v1";

type Obj = Record<string, any>;

const dir = resolve(import.meta.dir, "../../services/k8s");

/** apiVersion/kind → the kubernetes-models class that validates it. A kind used in services/k8s needs a row. */
const models: Record<string, new (data: Obj) => { validate(): void }> = {
  "v1/Namespace": Namespace,
  "v1/Secret": Secret,
  "v1/Service": Service,
  "apps/v1/Deployment": Deployment,
  "apps/v1/DaemonSet": DaemonSet,
  "apps/v1/StatefulSet": StatefulSet,
  "policy/v1/PodDisruptionBudget": PodDisruptionBudget,
};

interface Doc {
  file: string;
  /** 0-based position among the file's non-empty documents. */
  index: number;
  obj: Obj;
  /** "node.yaml doc 0 (DaemonSet aenv-node)" */
  label: string;
}

const files = readdirSync(dir).filter((f) => f.endsWith(".yaml") && f !== "kustomization.yaml").sort();

function documents(file: string): Doc[] {
  const text = readFileSync(join(dir, file), "utf8");
  const docs: Doc[] = [];
  // Split on `---` lines rather than let the parser decide: a file of one document and a file of
  // several come back alike, and each document keeps its position for the messages.
  for (const chunk of text.split(/^---[ \t]*(?:#.*)?$/m)) {
    let obj: unknown;
    try {
      obj = Bun.YAML.parse(chunk);
    } catch (e) {
      throw new Error(`${file} doc ${docs.length}: not YAML: ${(e as Error).message}`);
    }
    if (obj === null || obj === undefined) continue; // comments only
    if (typeof obj !== "object" || Array.isArray(obj)) throw new Error(`${file} doc ${docs.length}: not a mapping`);
    const o = obj as Obj;
    docs.push({ file, index: docs.length, obj: o, label: `${file} doc ${docs.length} (${o.kind} ${o.metadata?.name})` });
  }
  return docs;
}

const docs = files.flatMap(documents);
const ofKind = (kind: string) => docs.filter((d) => d.obj.kind === kind);
const workloads = docs.filter((d) => ["Deployment", "DaemonSet", "StatefulSet"].includes(d.obj.kind));

function one(kind: string, name: string): Doc {
  const found = docs.filter((d) => d.obj.kind === kind && d.obj.metadata?.name === name);
  expect(found.map((d) => d.label), `exactly one ${kind} ${name} in services/k8s`).toHaveLength(1);
  return found[0]!;
}

function containers(d: Doc): Obj[] {
  const spec = d.obj.spec?.template?.spec ?? {};
  return [...(spec.initContainers ?? []), ...(spec.containers ?? [])];
}

describe("services/k8s", () => {
  test("has the manifests of the cluster", () => {
    expect(files).toEqual(["etcd.yaml", "gateway.yaml", "namespace.yaml", "node.yaml", "secret.yaml"]);
    one("Namespace", "agentenv-system");
    one("Secret", "aenv-api-key");
    one("StatefulSet", "aenv-etcd");
    one("DaemonSet", "aenv-node");
    one("Deployment", "aenv-gateway");
    one("Service", "aenv-gateway");
    for (const d of docs) {
      if (d.obj.kind !== "Namespace") expect(d.obj.metadata?.namespace, `${d.label}: namespace`).toBe("agentenv-system");
    }
  });

  test("every document validates against its Kubernetes schema", () => {
    const failures: string[] = [];
    for (const d of docs) {
      const key = `${d.obj.apiVersion}/${d.obj.kind}`;
      const Model = models[key];
      if (Model === undefined) {
        failures.push(`${d.label}: no kubernetes-models class for ${key} (add a row to the table)`);
        continue;
      }
      try {
        new Model(d.obj).validate();
      } catch (e) {
        failures.push(`${d.label}: ${(e as Error).message}`);
      }
    }
    expect(failures).toEqual([]);
  });

  test("kustomization.yaml lists every manifest, and only those", () => {
    const k = Bun.YAML.parse(readFileSync(join(dir, "kustomization.yaml"), "utf8")) as Obj;
    expect(k.kind, "kustomization.yaml: kind").toBe("Kustomization");
    const resources: string[] = k.resources ?? [];
    for (const f of files) expect(resources, `kustomization.yaml: resources lacks ${f}`).toContain(f);
    for (const r of resources) expect(files, `kustomization.yaml: lists ${r}, which is not in services/k8s`).toContain(r);
  });

  test("the node DaemonSet runs privileged with /dev/kvm mounted", () => {
    const d = one("DaemonSet", "aenv-node");
    const [c, ...rest] = containers(d);
    expect(rest, `${d.label}: one container`).toHaveLength(0);
    expect(c!.securityContext?.privileged, `${d.label}: container ${c!.name} privileged`).toBe(true);
    const mount = (c!.volumeMounts ?? []).find((m: Obj) => m.mountPath === "/dev/kvm");
    expect(mount, `${d.label}: container ${c!.name} mounts /dev/kvm`).toBeDefined();
    const volume = (d.obj.spec.template.spec.volumes ?? []).find((v: Obj) => v.name === mount.name);
    expect(volume?.hostPath, `${d.label}: volume ${mount.name} is the host's /dev/kvm`).toEqual({ path: "/dev/kvm", type: "CharDevice" });
    expect(d.obj.spec.template.spec.hostNetwork, `${d.label}: hostNetwork`).toBe(true);
  });

  test("the gateway runs at least 2 replicas, etcd 3 members that --initial-cluster lists", () => {
    const g = one("Deployment", "aenv-gateway");
    expect(typeof g.obj.spec.replicas, `${g.label}: spec.replicas is a number`).toBe("number");
    expect(g.obj.spec.replicas, `${g.label}: spec.replicas`).toBeGreaterThanOrEqual(2);

    const e = one("StatefulSet", "aenv-etcd");
    expect(e.obj.spec.replicas, `${e.label}: spec.replicas`).toBe(3);
    const [etcd] = containers(e);
    const flag = [...(etcd!.command ?? []), ...(etcd!.args ?? [])].find((a: string) => a.startsWith("--initial-cluster="));
    expect(flag, `${e.label}: --initial-cluster`).toBeDefined();
    const { name, namespace } = e.obj.metadata;
    const expected = Array.from({ length: 3 }, (_, i) =>
      `${name}-${i}=http://${name}-${i}.${e.obj.spec.serviceName}.${namespace}.svc:2380`).join(",");
    expect(flag, `${e.label}: --initial-cluster names every member by its headless DNS name`).toBe(`--initial-cluster=${expected}`);
    const headless = one("Service", e.obj.spec.serviceName);
    expect(headless.obj.spec.clusterIP, `${headless.label}: headless (the StatefulSet's serviceName)`).toBe("None");
  });

  test("every workload's selector matches its pod template's labels", () => {
    expect(workloads.length).toBe(3);
    for (const d of workloads) {
      const selector: Obj = d.obj.spec?.selector?.matchLabels ?? {};
      const labels: Obj = d.obj.spec?.template?.metadata?.labels ?? {};
      expect(Object.keys(selector).length, `${d.label}: spec.selector.matchLabels is empty`).toBeGreaterThan(0);
      for (const [k, v] of Object.entries(selector)) {
        expect(labels[k], `${d.label}: template label ${k} (the selector wants ${v})`).toBe(v);
      }
    }
  });

  test("every Service and PodDisruptionBudget selects the pods of a workload", () => {
    const selects = (selector: Obj, d: Doc) =>
      Object.entries(selector).every(([k, v]) => d.obj.spec?.template?.metadata?.labels?.[k] === v);
    for (const d of [...ofKind("Service"), ...ofKind("PodDisruptionBudget")]) {
      const selector: Obj = d.obj.kind === "Service" ? d.obj.spec?.selector ?? {} : d.obj.spec?.selector?.matchLabels ?? {};
      expect(Object.keys(selector).length, `${d.label}: empty selector`).toBeGreaterThan(0);
      const targets = workloads.filter((w) => selects(selector, w));
      expect(targets.length, `${d.label}: selects no workload's pods (${JSON.stringify(selector)})`).toBeGreaterThan(0);
      // A Service's named targetPort must be a port its pods name.
      for (const p of d.obj.kind === "Service" ? d.obj.spec.ports : []) {
        if (typeof p.targetPort !== "string") continue;
        for (const w of targets) {
          const named = containers(w).flatMap((c) => c.ports ?? []).map((cp: Obj) => cp.name);
          expect(named, `${d.label}: targetPort ${p.targetPort} is no port of ${w.label}`).toContain(p.targetPort);
        }
      }
    }
  });

  test("every Secret a container reads is defined, with the key it reads", () => {
    const secrets = new Map(ofKind("Secret").map((d) => [d.obj.metadata.name as string, d.obj]));
    let reads = 0;
    for (const d of workloads) {
      for (const c of containers(d)) {
        for (const e of c.env ?? []) {
          const ref = e.valueFrom?.secretKeyRef;
          if (ref === undefined) continue;
          reads++;
          const where = `${d.label}: container ${c.name} env ${e.name}`;
          const s = secrets.get(ref.name);
          expect(s, `${where} reads Secret ${ref.name}, which services/k8s does not define`).toBeDefined();
          const keys = [...Object.keys(s!.data ?? {}), ...Object.keys(s!.stringData ?? {})];
          expect(keys, `${where} reads key ${ref.key} of Secret ${ref.name}`).toContain(ref.key);
        }
        for (const e of c.envFrom ?? []) {
          if (e.secretRef === undefined) continue;
          reads++;
          expect(secrets.has(e.secretRef.name), `${d.label}: container ${c.name} envFrom Secret ${e.secretRef.name}, which services/k8s does not define`).toBe(true);
        }
      }
    }
    expect(reads, "node and gateway read the API key").toBeGreaterThanOrEqual(2);
    const key = secrets.get("aenv-api-key")!.stringData?.["api-key"];
    expect(key, "secret.yaml: the placeholder has E2B's key format").toMatch(/^e2b_[0-9a-f]{40}$/);
  });

  test("AENV_CLUSTER names a ClusterIP Service of the manifests, at its port", () => {
    let seen = 0;
    for (const d of workloads) {
      for (const c of containers(d)) {
        const v = (c.env ?? []).find((e: Obj) => e.name === "AENV_CLUSTER")?.value;
        if (v === undefined) continue;
        seen++;
        const where = `${d.label}: container ${c.name} AENV_CLUSTER=${v}`;
        const m = /^http:\/\/([a-z0-9-]+)\.([a-z0-9-]+)\.svc:(\d+)$/.exec(v);
        expect(m, `${where}: http://<service>.<namespace>.svc:<port>`).not.toBeNull();
        const svc = docs.find((s) => s.obj.kind === "Service" && s.obj.metadata.name === m![1] && s.obj.metadata.namespace === m![2]);
        expect(svc, `${where}: no such Service`).toBeDefined();
        // A headless Service that publishes not-ready members would hand clients members without a quorum.
        expect(svc!.obj.spec.clusterIP, `${where}: ${svc!.label} is headless`).not.toBe("None");
        expect(svc!.obj.spec.ports.map((p: Obj) => p.port), `${where}: ${svc!.label} ports`).toContain(Number(m![3]));
      }
    }
    expect(seen, "node and gateway set AENV_CLUSTER").toBe(2);
  });

  describe("the validator rejects what Kubernetes rejects", () => {
    const gateway = () => structuredClone(one("Deployment", "aenv-gateway").obj);

    test("the gateway as written passes", () => {
      expect(() => new Deployment(gateway()).validate()).not.toThrow();
    });

    test("spec.replicas as a string", () => {
      const g = gateway();
      g.spec.replicas = "two";
      expect(() => new Deployment(g).validate()).toThrow("data/spec/replicas must be integer");
    });

    test("a container port as a string", () => {
      const g = gateway();
      g.spec.template.spec.containers[0].ports[0].containerPort = "http";
      expect(() => new Deployment(g).validate()).toThrow("containers/0/ports/0/containerPort must be integer");
    });

    test("a container without a name", () => {
      const g = gateway();
      delete g.spec.template.spec.containers[0].name;
      expect(() => new Deployment(g).validate()).toThrow("must have required property name");
    });

    test("a resource request that is no quantity", () => {
      const g = gateway();
      g.spec.template.spec.containers[0].resources.requests.cpu = "lots";
      expect(() => new Deployment(g).validate()).toThrow('must match format "quantity"');
    });

    test("a hostPath type Kubernetes does not know", () => {
      const n = structuredClone(one("DaemonSet", "aenv-node").obj);
      n.spec.template.spec.volumes[0].hostPath.type = "Folder";
      expect(() => new DaemonSet(n).validate()).toThrow("hostPath/type must be equal to one of the allowed values");
    });

    // The blind spot: the generated schemas allow additional properties, so a misspelt field passes.
    // Should a kubernetes-models release close it, this fails: then make unknown fields a check above.
    test("unknown fields pass (not checked by kubernetes-models)", () => {
      const g = gateway();
      g.spec.template.spec.containers[0].readinesProbe = g.spec.template.spec.containers[0].readinessProbe;
      g.spec.replica = 2;
      expect(() => new Deployment(g).validate()).not.toThrow();
    });
  });
});
