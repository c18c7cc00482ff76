"""Re-done steps: the trainer's wait for their batches against the first pass's.

  python -m benchmarks.replay --data DIR [--config tiny|chip] [--steps 60]
                              [--save-every 20] [--fail-at 35] [--workers 2]
                              [--ways kill,rollback] [--replay on,off] [--out FILE]

From the repository root; not run by CI. ``examples/vision/train.py`` trains under
``sidecar launch --hosts 1 --max-restarts 1`` and fails once step ``--fail-at`` is
reached, after the save of step ``--save-every`` x k before it:

  kill       the trainer is SIGKILLed once its metrics hold step ``--fail-at`` and that
             save is committed; the launcher starts a new trainer beside the same sidecar,
             which restores the save and re-does the steps after it
  rollback   ``--recover-in-process --fail-at``: the step raises and is rolled back in the
             same process (``sidecar.jax.Recovery``)

each with the sidecar keeping the batches since the last save (``--replay on``, the
default) and without (``off``: ``--replay 0``, every batch decoded anew). Each metrics
line holds the wait for that step's batch (``examples/vision/train.py``): rows give the
mean (and median) wait of the first pass's steps (``analyse`` says which), of the re-done
steps (all of them: the first includes the feed's opening), their ratio, and the wait of
the steps after the re-done ones (the longest: the feed's workers catching up, or starting
where the ended feed's were not kept idle for it), and check
every loss against an uninterrupted run of the same command, bit for bit. Prints a
table and one JSON line (``--out``: also written there).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks.common import table

ROOT = pathlib.Path(__file__).resolve().parents[1]
PID = re.compile(r"pid (\d+) (?:initialised|restored)")


def launch(args, work: pathlib.Path, name: str, *extra: str) -> subprocess.Popen:
  cmd = [sys.executable, "-m", "sidecar", "launch", "--hosts", "1", "--import",
         "pipelines.vision", "--shm-size", args.shm_size, "--max-restarts", "1", "--",
         sys.executable, "examples/vision/train.py", "--config", args.config, "--data",
         os.path.abspath(args.data), "--ckpt", str(work / f"{name}-ckpt"), "--steps",
         str(args.steps), "--save-every", str(args.save_every), "--metrics",
         str(work / f"{name}.jsonl"), "--workers", str(args.workers), "--progress-every", "0",
         *extra]
  env = {**os.environ, "PYTHONPATH": os.pathsep.join(
      p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
  return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, env=env)


def lines(path: pathlib.Path) -> list[dict]:
  if not path.exists():
    return []
  return [json.loads(x) for x in path.read_text().splitlines() if x.endswith("}")]


def finish(p: subprocess.Popen, out: str, timeout: float) -> str:
  rest, _ = p.communicate(timeout=timeout)
  out += rest
  if p.returncode != 0:
    raise RuntimeError(f"the launch failed ({p.returncode}):\n{out[-3000:]}")
  return out


def killed(args, work: pathlib.Path, name: str, extra: list[str]) -> str:
  """A launch whose trainer is SIGKILLed once step ``--fail-at`` is written and the save
  before it committed; what it printed."""
  p = launch(args, work, name, *extra)
  out, pid = "", None
  save = (args.fail_at - 1) // args.save_every * args.save_every
  deadline = time.monotonic() + args.timeout
  assert p.stdout is not None
  while pid is None:
    line = p.stdout.readline()
    if not line:
      raise RuntimeError(f"the launch ended before its trainer started:\n{out[-3000:]}")
    out += line
    if (m := PID.search(line)) is not None:
      pid = int(m.group(1))
  while not (any(x["step"] >= args.fail_at for x in lines(work / f"{name}.jsonl"))
             and (work / f"{name}-ckpt" / str(save)).is_dir()):
    if time.monotonic() > deadline or p.poll() is not None:
      p.kill()
      raise RuntimeError(f"step {args.fail_at} never came:\n{out[-3000:]}")
    time.sleep(0.02)
  os.kill(pid, signal.SIGKILL)
  return finish(p, out, args.timeout)


def analyse(metrics: list[dict], reference: dict[int, float], fail_at: int) -> dict:
  """First-pass and re-done waits of one run's metrics; its losses against ``reference``.

  The run's lines are in segments, a new one where the step goes back (a restart or a
  rollback); a step of a later segment is re-done where the first segment's trainer had
  taken its batch already: up to ``fail_at`` (the step that raised, or was reached when
  the trainer was killed) or the first segment's last line, whichever is later. (A line is
  written once the next step is queued: the first segment's last steps may have none.)
  The first pass is the first segment, steps 1-4 left out (the compile's, the feed's
  workers starting); the re-done mean takes every re-done step, the first one included (it
  waits for the feed's opening: what a restart or a rollback pays); the longest wait of the
  steps after them apart (where the re-done steps were served from memory, the first step
  past the kept batches waits for the feed's workers if they are not done yet: started
  again where the sidecar did not keep the ended feed's idle, ``--feed-idle-s``)."""
  segments: list[list[dict]] = [[]]
  for x in metrics:
    if segments[-1] and x["step"] <= segments[-1][-1]["step"]:
      segments.append([])
    segments[-1].append(x)
  limit = max([fail_at] + [x["step"] for x in segments[0]])
  redone = [x for seg in segments[1:] for x in seg if x["step"] <= limit]
  after = [x for seg in segments[1:] for x in seg if x["step"] > limit]
  last = {x["step"]: x["loss"] for x in metrics}
  exact = all(last[s] == reference.get(s) for s in last) and set(last) == set(reference)
  base = [x["wait"] for x in segments[0] if x["step"] > 4]
  again = [x["wait"] for x in redone]
  return {"first_pass_wait_ms": statistics.fmean(base) * 1e3,
          "first_pass_median_ms": statistics.median(base) * 1e3,
          "redone_steps": len(redone),
          "redone_first_wait_ms": again[0] * 1e3 if again else None,
          "redone_wait_ms": statistics.fmean(again) * 1e3 if again else None,
          "redone_median_ms": statistics.median(again) * 1e3 if again else None,
          "after_max_wait_ms": max(x["wait"] for x in after) * 1e3 if after else None,
          "bit_exact": exact}


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--data", required=True, help="images written by examples/vision/prepare.py")
  p.add_argument("--config", default="tiny")
  p.add_argument("--steps", type=int, default=60)
  p.add_argument("--save-every", type=int, default=20)
  p.add_argument("--fail-at", type=int, default=35)
  p.add_argument("--workers", type=int, default=2)
  p.add_argument("--ways", default="kill,rollback")
  p.add_argument("--replay", default="on,off")
  p.add_argument("--shm-size", default="1GiB")
  p.add_argument("--timeout", type=float, default=600.0, help="seconds a launch may take")
  p.add_argument("--out", default=None)
  args = p.parse_args(argv)
  results: dict = {"config": args.config, "steps": args.steps, "save_every": args.save_every,
                   "fail_at": args.fail_at, "workers": args.workers, "rows": {}}
  with tempfile.TemporaryDirectory(prefix="replay-bench-") as tmp:
    work = pathlib.Path(tmp)
    t0 = time.perf_counter()
    finish(launch(args, work, "reference"), "", args.timeout)
    reference = {x["step"]: x["loss"] for x in lines(work / "reference.jsonl")}
    results["reference_s"] = time.perf_counter() - t0
    print(f"reference: {len(reference)} steps in {results['reference_s']:.1f} s", flush=True)
    for way in args.ways.split(","):
      for replay in args.replay.split(","):
        name = f"{way}-{replay}"
        extra = [] if replay == "on" else ["--replay", "0"]
        t0 = time.perf_counter()
        if way == "kill":
          killed(args, work, name, extra)
        else:
          finish(launch(args, work, name, "--recover-in-process", "--fail-at",
                        str(args.fail_at), *extra), "", args.timeout)
        row = analyse(lines(work / f"{name}.jsonl"), reference, args.fail_at)
        row["seconds"] = time.perf_counter() - t0
        results["rows"][name] = row
        print(f"{name}: {json.dumps(row)}", flush=True)
        if args.out:
          pathlib.Path(args.out).write_text(json.dumps(results, indent=1))
  fmt = lambda v: "-" if v is None else f"{v:.2f}"
  print(table(["run", "first pass ms/step (median)", "re-done ms/step (median)",
               "the first re-done ms", "ratio of means", "re-done steps",
               "longest wait after ms", "bit-exact"],
              [[name, f"{fmt(r['first_pass_wait_ms'])} ({fmt(r['first_pass_median_ms'])})",
                f"{fmt(r['redone_wait_ms'])} ({fmt(r['redone_median_ms'])})",
                fmt(r["redone_first_wait_ms"]),
                fmt(r["redone_wait_ms"] / r["first_pass_wait_ms"])
                if r["redone_wait_ms"] is not None and r["first_pass_wait_ms"] else None,
                str(r["redone_steps"]), fmt(r["after_max_wait_ms"]), str(r["bit_exact"])]
               for name, r in results["rows"].items()]))
  print(json.dumps(results))
  if args.out:
    pathlib.Path(args.out).write_text(json.dumps(results, indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())
