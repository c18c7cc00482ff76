"""Recovery from a lost host in multi-controller JAX: ``sidecar launch --elastic``.

Run from the repository root: ``python -m benchmarks.elastic_launch [--runs 3]``. Not run
by CI. Each run launches tests/support/train_elastic.py as 3 processes x 1 CPU device
beside 3 sidecars; before batch 5 process 1 SIGKILLs its own sidecar, and the launcher
restarts hosts 0 and 2 as a job of 2, which restores step 3 and trains on. With
``--in-place`` the launcher instead starts host 1's sidecar again (empty) and restarts all 3
trainers, as Kubernetes restarts containers in place. Saves keep one peer replica
(``replicas=1``), so neither restore reads storage. From that kill, each phase until the
first training step completes in the new job (the slowest process):

  detect        the kill -> the launcher's line that the sidecar died (it polls, 0.1 s)
  stop          SIGTERM (SIGKILL after the grace) to every old trainer, all reaped
  sidecar       --in-place: the lost sidecar started again, until it serves (else 0)
  spawn         the lost sidecar stopped, the new trainers started, to their first line
  imports       ``import sidecar`` (and jax) in the new trainers
  jax init      ``sidecar.jax.initialize()``: jax.distributed on a fresh port
  controller    ``Controller.from_env()``: handshakes, attach, host map
  restore       the latest step, from the RAM tiers (else storage), and its data state
  first step    the feed reopened at that position, its first batch, compile and step
  total         the kill -> the first step done in the new job
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
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
PHASES = ("detect", "stop", "sidecar", "spawn", "imports", "jax init", "controller",
          "restore", "first step", "total")


def one_run(directory: str, *, in_place: bool) -> tuple[dict[str, float], list[str]]:
  command = [sys.executable, "-m", "sidecar", "launch", "--hosts", "3", "--elastic",
             *(["--in-place"] if in_place else []),
             "--import", "tests.support.feed_fns", "--shm-size", "32MiB", "--", sys.executable,
             "-m", "tests.support.train_elastic", directory, "5"]
  p = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       text=True, env={**os.environ, "SIDECAR_TEST_REPLICAS": "1"})
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
  found = re.search(r"the sidecar ([\d.]+) s", restart)
  sidecar = float(found.group(1)) if found else 0.0
  new = [r for r in results if r["restart"] == 1]
  start = [r for r in new if r["kind"] == "start"]
  last = lambda key, rs=start: max(r[key] for r in rs)  # noqa: E731
  restored = max(r["t"] for r in new if r["kind"] == "restored")
  first = min(r["i"] for r in new if r["kind"] == "batch")
  stepped = max(r["t"] for r in new if r["kind"] == "batch" and r["i"] == first)
  sources = sorted({s for r in new if r["kind"] == "restored" for s in r["sources"]})
  return {"detect": detected - kill, "stop": stop, "sidecar": sidecar,
          "spawn": last("t_start") - detected - stop - sidecar,
          "imports": last("t_import") - last("t_start"),
          "jax init": last("t_init") - last("t_import"),
          "controller": last("t_ctl") - last("t_init"), "restore": restored - last("t_ctl"),
          "first step": stepped - restored, "total": stepped - kill}, sources


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--runs", type=int, default=3)
  parser.add_argument("--in-place", action="store_true",
                      help="sidecar launch --elastic --in-place: the job keeps its 3 hosts")
  args = parser.parse_args()
  runs = []
  for i in range(args.runs):
    with tempfile.TemporaryDirectory(prefix="sidecar-elastic-launch-") as d:
      times, sources = one_run(d, in_place=args.in_place)
      runs.append(times)
    print(f"run {i + 1}: total {runs[-1]['total']:.2f} s; restored from {sources}", flush=True)
  print(f"\n{'phase':12} " + " ".join(f"{f'run {i + 1}':>7}" for i in range(len(runs)))
        + f" {'median':>7}")
  for phase in PHASES:
    values = [r[phase] for r in runs]
    print(f"{phase:12} " + " ".join(f"{v:7.2f}" for v in values)
          + f" {statistics.median(values):7.2f}")


if __name__ == "__main__":
  main()
