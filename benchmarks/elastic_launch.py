"""Recovery from a lost host in multi-controller JAX: ``sidecar launch --elastic``.

Run from the repository root: ``python -m benchmarks.elastic_launch [--runs 3]``. Not run
by CI. Each run launches tests/multiprocess/train_elastic.py as 3 processes x 1 CPU device
beside 3 sidecars; before batch 5 process 1 SIGKILLs its own sidecar, and the launcher
restarts hosts 0 and 2 as a job of 2, which restores step 3 and trains on. From that kill,
each phase until the first training step completes in the new job (the slowest process):

  detect        the kill -> the launcher's line that the sidecar died (it polls, 0.1 s)
  stop          SIGTERM (SIGKILL after the grace) to every old trainer, all reaped
  spawn         the lost sidecar stopped, the new trainers started, to their first line
  imports       ``import sidecar`` (and jax) in the new trainers
  jax init      ``sidecar.distributed.initialize()``: jax.distributed on a fresh port
  controller    ``Controller.from_env()``: handshakes, attach, host map
  restore       the latest step, from the RAM tiers (else storage), and its data state
  first step    the feed reopened at that position, its first batch, compile and step
  total         the kill -> the first step done in the new job
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
PHASES = ("detect", "stop", "spawn", "imports", "jax init", "controller", "restore",
          "first step", "total")


def one_run(directory: str) -> dict[str, float]:
  command = [sys.executable, "-m", "sidecar", "launch", "--hosts", "3", "--elastic",
             "--import", "tests.feed_fns", "--shm-size", "32MiB", "--", sys.executable, "-m",
             "tests.multiprocess.train_elastic", directory, "5"]
  p = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       text=True)
  err_lines: list[tuple[float, str]] = []

  def read_err():
    for line in p.stderr:  # type: ignore[union-attr]
      err_lines.append((time.time(), line))

  reader = threading.Thread(target=read_err)
  reader.start()
  out = p.stdout.read()  # type: ignore[union-attr]
  p.wait()
  reader.join()
  if p.returncode != 0:
    raise SystemExit(f"the launch failed ({p.returncode}):\n{out}\n"
                     + "".join(t for _, t in err_lines))
  results = [json.loads(m) for m in re.findall(r"RESULT (\{.*\})", out)]
  kill = next(r["t"] for r in results if r["kind"] == "kill")
  detected = next(t for t, line in err_lines if "sidecar was killed" in line)
  restart = next(line for _, line in err_lines if line.startswith("sidecar launch: restart 1"))
  stop = float(re.search(r"stopping the trainers ([\d.]+) s", restart).group(1))
  new = [r for r in results if r["restart"] == 1]
  start = [r for r in new if r["kind"] == "start"]
  last = lambda key, rs=start: max(r[key] for r in rs)  # noqa: E731
  restored = max(r["t"] for r in new if r["kind"] == "restored")
  first = min(r["i"] for r in new if r["kind"] == "batch")
  stepped = max(r["t"] for r in new if r["kind"] == "batch" and r["i"] == first)
  return {"detect": detected - kill, "stop": stop, "spawn": last("t_start") - detected - stop,
          "imports": last("t_import") - last("t_start"),
          "jax init": last("t_init") - last("t_import"),
          "controller": last("t_ctl") - last("t_init"), "restore": restored - last("t_ctl"),
          "first step": stepped - restored, "total": stepped - kill}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--runs", type=int, default=3)
  args = parser.parse_args()
  runs = []
  for i in range(args.runs):
    with tempfile.TemporaryDirectory(prefix="sidecar-elastic-launch-") as d:
      runs.append(one_run(d))
    print(f"run {i + 1}: total {runs[-1]['total']:.2f} s", flush=True)
  print(f"\n{'phase':12} " + " ".join(f"{f'run {i + 1}':>7}" for i in range(len(runs)))
        + f" {'median':>7}")
  for phase in PHASES:
    values = [r[phase] for r in runs]
    print(f"{phase:12} " + " ".join(f"{v:7.2f}" for v in values)
          + f" {statistics.median(values):7.2f}")


if __name__ == "__main__":
  main()
