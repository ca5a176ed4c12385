// A build step's tool run: a timeout ends the tool and every child it started, a failure carries
// the output's last lines, each output line reaches the callback.
import { expect, test } from "bun:test";
import { join } from "node:path";
import { TemplateBuildError } from "../../src/template/definition.ts";
import { runStep } from "../../src/template/step.ts";
import { scratchDir } from "../helpers/tmp.ts";

function alive(pid: number): boolean {
  try {
    process.kill(pid, 0);
    return true;
  } catch {
    return false;
  }
}

test("past its limit a step is Timeout, and the children it started are gone too", async () => {
  const pidFile = join(scratchDir("template-step"), "child.pid");
  const err = await runStep({
    step: "setup",
    argv: ["sh", "-c", `sleep 600 & echo $! > ${pidFile}; echo started; wait`],
    timeoutMs: 500,
  }).catch((e) => e);
  expect(err).toBeInstanceOf(TemplateBuildError);
  expect(err.code).toBe("Timeout");
  expect(err.step).toBe("setup");
  expect(err.outputTail).toBe("started");
  const child = Number((await Bun.file(pidFile).text()).trim());
  expect(child).toBeGreaterThan(0);
  // SIGTERM reached the whole group; give the kernel a moment to reap.
  for (let i = 0; i < 100 && alive(child); i++) await Bun.sleep(50);
  expect(alive(child)).toBe(false);
});

test("a failing step is StepFailed with the last 40 lines of its output, stdout and stderr both", async () => {
  const lines: string[] = [];
  const err = await runStep({
    step: "image",
    argv: ["sh", "-c", "for i in $(seq 1 100); do echo out$i; done; echo 'bad thing' >&2; exit 7"],
    timeoutMs: 30_000,
    onLine: (l) => lines.push(l),
  }).catch((e) => e);
  expect(err).toBeInstanceOf(TemplateBuildError);
  expect(err.code).toBe("StepFailed");
  expect(err.message).toContain("step image");
  expect(err.message).toContain("exited 7");
  const tail = err.outputTail.split("\n");
  expect(tail.length).toBe(40);
  expect(tail).toContain("bad thing");
  expect(tail).not.toContain("out1");
  expect(lines.length).toBe(101);
});

test("stdin reaches the tool; a throwing progress callback does not break the step", async () => {
  const seen: string[] = [];
  await runStep({
    step: "setup",
    argv: ["sh", "-s"],
    stdin: new TextEncoder().encode("echo from-stdin\n"),
    timeoutMs: 30_000,
    onLine: (l) => {
      seen.push(l);
      throw new Error("callback bug");
    },
  });
  expect(seen).toEqual(["from-stdin"]);
});

test("a tool that does not exist is SpawnFailed", async () => {
  const err = await runStep({ step: "bootstrap", argv: ["/nonexistent/aenv-tool"], timeoutMs: 1000 }).catch((e) => e);
  expect(err).toBeInstanceOf(TemplateBuildError);
  expect(err.code).toBe("SpawnFailed");
});
