"""A step that raises: recovered in-process (``sidecar.jax.Recovery``) against a restart.

  python -m benchmarks.recover [--config tiny|cpu|chip] [--rounds 2] [--fail-at 27]
                               [--save-every 10] [--steps 40] [--data DIR]
                               [--ways in-process,restart,standby] [--device-copies]

From the repository root; not run by CI. examples/lm/train.py trains under ``sidecar
launch --hosts 1`` and raises in step ``--fail-at`` (its ``--fail-at`` hook: after the
step's batch is taken, in the job's first start only). Three ways to go on, round by
round in one run:

  in-process   --recover-in-process: the step's error is caught, the latest committed
               step restored from the sidecar's RAM tier and the feed moved back to it
  restart      --max-restarts 1: the trainer exits, the launcher starts a new one,
               which restores the latest step (JAX's compilation cache kept)
  standby      the same with --standby: the next process waits with JAX imported

Rows, seconds from the exception (the trainer's line ``fault: raising in step N ... at
unix T``) to the first step computed after it (its metrics line: when its loss was
ready), and to the failed step computed again (the steps re-done from the restored
one included). For in-process, the Rollback's own figures beside them: its whole
``recover()``; the wait for a save in flight to be staged (its copy off the devices) where
the sidecars took it over and it is restored from their RAM tier; the restore; the wait
for a save in flight to be durable where they had not; the tier restored from ("device": the
save's copies on the devices, not staged yet). Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile

from benchmarks.common import table

ROOT = pathlib.Path(__file__).resolve().parents[1]
WAYS = {"in-process": ["--recover-in-process"], "restart": [], "standby": []}
LAUNCH = {"in-process": [], "restart": ["--max-restarts", "1"],
          "standby": ["--max-restarts", "1", "--standby", "--preload", "optax",
                      "--preload", "sidecar.jax"]}
FAULT = re.compile(r"fault: raising in step (\d+) \(--fail-at\) at unix ([\d.]+)")
# The trainer with ``--device-copies``: examples/lm/train.py, its controller's JAX adapter
# copying each save on the devices first, as on an accelerator.
DEVICE_COPIES = (
    "import runpy, sys, sidecar.jax; from sidecar._src.jax.framework import JaxFramework; "
    "sidecar.jax.Controller._default_framework = staticmethod("
    "lambda: JaxFramework(device_copies=True)); "
    "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')")
TIER = re.compile(r"rolled back in-process to step \d+ \((\w+) tier")
ROLLBACK = re.compile(r"(taken over and not durable yet, ([\d.]+) s waiting for its copy, )?"
                      r"restored in ([\d.]+) s(?:, ([\d.]+) s waiting for the save in flight)?"
                      r"\) in ([\d.]+) s")


def run(way: str, *, config: str, data: str, work: str, fail_at: int, save_every: int,
        steps: int, shm: str, device_copies: bool = False) -> dict:
  """One launch of ``way``: the exception's time, the first step after it, the failed
  step again; for in-process, the Rollback's figures."""
  out_dir = tempfile.mkdtemp(prefix=f"{way}-", dir=work)
  metrics = os.path.join(out_dir, "metrics.jsonl")
  command = [sys.executable, "-m", "sidecar", "launch", "--hosts", "1", "--import",
             "pipelines.lm", "--shm-size", shm, "--checkpoint-root", work, *LAUNCH[way], "--",
             sys.executable, *(["-c", DEVICE_COPIES] if device_copies else []),
             "examples/lm/train.py", "--config", config, "--data", data,
             "--ckpt", os.path.join(out_dir, "ckpt"), "--steps", str(steps),
             "--save-every", str(save_every), "--metrics", metrics, "--progress-every", "0",
             "--fail-at", str(fail_at), *WAYS[way]]
  # One compilation cache for every launch: only the first compiles cold (on the v5e the
  # chip config's programs take ~25 s), whichever way it is.
  done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900,
                        env={"JAX_COMPILATION_CACHE_DIR": os.path.join(work, "jax-cache"),
                             **os.environ, "PYTHONPATH": os.pathsep.join(
                                 [str(ROOT)] + [p for p in os.environ.get(
                                     "PYTHONPATH", "").split(os.pathsep) if p])})
  log = done.stdout + done.stderr
  fault = FAULT.search(log)
  if done.returncode != 0 or fault is None:
    raise RuntimeError(f"{way}: the launch ended with {done.returncode}:\n{log[-4000:]}")
  t = float(fault.group(2))
  lines = [json.loads(x) for x in pathlib.Path(metrics).read_text().splitlines()]
  after = [x for x in lines if x["time"] > t]
  result = {"next_step_s": after[0]["time"] - t,
            "failed_step_again_s": next(x["time"] for x in after if x["step"] == fail_at) - t,
            "restored_step": after[0]["step"] - 1}
  if (rolled := ROLLBACK.search(log)) is not None:
    result.update(restore_s=float(rolled.group(3)), waited_s=float(rolled.group(4) or 0),
                  recover_s=float(rolled.group(5)), taken_over=rolled.group(1) is not None,
                  staged_s=float(rolled.group(2) or 0))
  if (tier := TIER.search(log)) is not None:
    result["tier"] = tier.group(1)
  return result


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--config", default="tiny", help="examples/lm's model.CONFIGS key")
  p.add_argument("--rounds", type=int, default=2, help="launches of each way")
  p.add_argument("--fail-at", type=int, default=27, help="the step that raises")
  p.add_argument("--save-every", type=int, default=10, help="steps between saves")
  p.add_argument("--steps", type=int, default=40, help="the run's last step")
  p.add_argument("--shm-size", default=None,
                 help="the sidecar's arena (default: 256MiB for tiny, 12GiB for chip)")
  p.add_argument("--data", help="a corpus of examples/lm/prepare.py (default: 1 MB made here)")
  p.add_argument("--device-copies", action="store_true",
                 help="the trainer saves as on an accelerator: copies on the devices, landed "
                      "after save() returned (on CPU, a save in flight at the failure)")
  p.add_argument("--ways", default=",".join(WAYS),
                 help="which ways to run, comma-separated (default: all; the ratio column "
                      "needs restart)")
  args = p.parse_args(argv)
  ways = args.ways.split(",")
  if not ways or set(ways) - set(WAYS):
    p.error(f"--ways {args.ways!r}: each must be one of {', '.join(WAYS)}")
  if not args.save_every < args.fail_at <= args.steps:
    p.error("--fail-at must come after the first save and by --steps")
  with tempfile.TemporaryDirectory(prefix="bench-recover-") as work:
    data = args.data
    if data is None:
      data = os.path.join(work, "data")
      subprocess.run([sys.executable, "examples/lm/prepare.py", "--out", data, "--max-mb", "1"],
                     cwd=ROOT, check=True, capture_output=True)
    results: dict[str, list[dict]] = {way: [] for way in ways}
    for _ in range(args.rounds):
      for way in ways:
        results[way].append(run(way, config=args.config, data=data, work=work,
                                fail_at=args.fail_at, save_every=args.save_every,
                                steps=args.steps, device_copies=args.device_copies,
                                shm=args.shm_size or {"tiny": "256MiB", "cpu": "1GiB"}.get(
                                    args.config, "12GiB")))
  mean = lambda way, key: statistics.fmean(r[key] for r in results[way]) if all(
      key in r for r in results[way]) else None
  base = mean("restart", "next_step_s") if "restart" in ways else None
  rows = []
  for way in ways:
    nxt, again = mean(way, "next_step_s"), mean(way, "failed_step_again_s")
    rows.append([way, f"{nxt:.3f}", f"{again:.3f}", f"{base / nxt:.1f}x" if base and nxt else "-",
                 *(f"{v:.3f}" if (v := mean(way, k)) is not None else "-"
                   for k in ("recover_s", "staged_s", "restore_s", "waited_s")),
                 ",".join(sorted({r.get("tier", "-") for r in results[way]}))])
  print(f"{args.config} config, step {args.fail_at} raises, saves every {args.save_every}; "
        f"means of {args.rounds} rounds, seconds from the exception")
  print(table(["way", "next step", "failed step again", "vs restart", "recover()",
               "copy wait", "restore", "save wait", "tier"], rows))
  print(json.dumps({"config": args.config, "fail_at": args.fail_at,
                    "save_every": args.save_every, "rounds": results}))
  return 0


if __name__ == "__main__":
  sys.exit(main())
