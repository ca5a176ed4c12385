// `aenv build`'s Dockerfile conversion: the steps the e2b SDK's builder will send, read back from
// the builder itself (Template.toJSON, without hashing COPY sources), and the refusals.
import { describe, expect, test } from "bun:test";
import { Template } from "e2b";
import { DockerfileError, dockerfileTemplate, words } from "../../src/cli/dockerfile.ts";

type Wire = { fromImage: string; startCmd?: string; readyCmd?: string; steps: { type: string; args: string[] }[] };
const wire = async (text: string, readyCmd?: string): Promise<Wire> =>
  JSON.parse(await Template.toJSON(dockerfileTemplate(text, { context: "/nonexistent", readyCmd }), false)) as Wire;
const steps = (w: Wire) => w.steps.map((s) => [s.type, ...s.args]);

describe("Dockerfile → template build steps", () => {
  test("every supported instruction, in file order, with E2B's user and workdir around them", async () => {
    const w = await wire([
      "# a comment",
      "ARG BASE_TAG=1",
      "FROM --platform=linux/amd64 reg.local:5000/img:1 AS only",
      "ARG LEVEL=3 EMPTY",
      'ENV A=1 B="two words"',
      "ENV OLD legacy value",
      "LABEL org.example.x=y",
      "EXPOSE 8080 9090/udp",
      'VOLUME ["/data"]',
      "MAINTAINER someone",
      "WORKDIR /app",
      "COPY --chown=me:me --chmod=755 a.txt b.txt /app/",
      "ADD c.tar /app/c",
      "RUN apt-get update && \\",
      "    # a comment inside a continuation",
      "    echo hi",
      'RUN ["echo", "it\'s"]',
      "",
    ].join("\n"));
    expect(w.fromImage).toBe("reg.local:5000/img:1");
    expect(w.startCmd).toBeUndefined();
    expect(steps(w)).toEqual([
      ["USER", "root"],
      ["WORKDIR", "/"],
      ["ARG", "LEVEL", "3", "EMPTY", ""],
      ["ENV", "A", "1", "B", "two words"],
      ["ENV", "OLD", "legacy value"],
      ["LABEL", "org.example.x", "y"],
      ["EXPOSE", "8080", "9090/udp"],
      ["VOLUME", "/data"],
      ["WORKDIR", "/app"],
      ["COPY", "a.txt", "/app/", "me", "0755"],
      ["COPY", "b.txt", "/app/", "me", "0755"],
      ["COPY", "c.tar", "/app/c", "", ""],
      ["RUN", "apt-get update &&     echo hi"],
      ["RUN", "echo 'it'\\''s'"],
      ["USER", "user"],
    ]);
  });

  test("CMD and ENTRYPOINT become the start command; the ready command defaults to sleep 20", async () => {
    expect(await wire('FROM x\nENTRYPOINT ["python3", "-m"]\nCMD ["http.server", "8000"]\n')).toMatchObject({ startCmd: "python3 -m http.server 8000", readyCmd: "sleep 20" });
    expect(await wire("FROM x\nENTRYPOINT exec server --flag\nCMD ignored\n")).toMatchObject({ startCmd: "exec server --flag" });
    expect(await wire("FROM x\nCMD python3 -m http.server\n", "curl -sf localhost:8000")).toMatchObject({ startCmd: "python3 -m http.server", readyCmd: "curl -sf localhost:8000" });
    const plain = await wire("FROM x\nUSER app:app\n");
    expect(steps(plain)).toEqual([["USER", "root"], ["WORKDIR", "/"], ["USER", "app"], ["WORKDIR", "/home/user"]]);
  });

  test("refused, naming the line: a second stage, no FROM, unsupported instructions, heredocs, URLs, bad flags", () => {
    const refused = (text: string) => {
      try {
        dockerfileTemplate(text, { context: "/nonexistent" });
      } catch (e) {
        expect(e).toBeInstanceOf(DockerfileError);
        return (e as Error).message;
      }
      throw new Error(`accepted: ${text}`);
    };
    expect(refused("FROM a AS one\nRUN true\nFROM b\n")).toBe("line 3: one stage only (a second FROM)");
    expect(refused("RUN true\n")).toBe("no FROM: the image to start from");
    expect(refused("FROM a\nHEALTHCHECK CMD true\n")).toStartWith("line 2: HEALTHCHECK is not supported");
    expect(refused("FROM a\nRUN <<EOF\necho hi\nEOF\n")).toBe("line 2: heredocs are not supported");
    expect(refused("FROM a\nADD https://example.com/x /x\n")).toBe("line 2: ADD from a URL is not supported (local sources only)");
    expect(refused("FROM a\nCOPY --from=builder /x /x\n")).toBe("line 2: COPY --from is not supported");
    expect(refused("FROM a\nRUN --mount=type=cache,target=/x true\n")).toBe("line 2: RUN --mount is not supported");
    expect(refused("FROM a\nCOPY --chmod=rwx a /a\n")).toBe("line 2: --chmod=rwx: expected octal digits");
    expect(refused("FROM a\nLABEL novalue\n")).toBe('line 2: "novalue" is not key=value');
  });

  test("words: quotes group, backslashes escape", () => {
    expect(words(`a "b c" 'd "e"' f\\ g`)).toEqual(["a", "b c", 'd "e"', "f g"]);
    expect(() => words('a "b')).toThrow(DockerfileError);
  });
});
