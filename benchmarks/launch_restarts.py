"""A trainer with a multiprocess feed, SIGKILLed and restarted: ``sidecar launch --max-restarts``.

Run from the repository root: ``python -m benchmarks.launch_restarts [--restarts 5]
[--steps 3000] [--workers 2]``. Not run by CI. One launch: a sidecar and
tests/support/feed_restarts.py beside it, which opens a feed with ``--workers`` worker
processes, times ``--steps`` steps (a batch from the feed and a jitted matmul on it) and
SIGKILLs itself with its feed open, ``--restarts`` times; the launcher restarts it beside
the same sidecar each time, and the last start ends with 0.

The failure this guards against: MaxText's colocated Grain sidecar leaked its worker
processes at each restart (re-parented to PID 1) and step time went from 1.85 s to 60-200 s.
Here every start's steps/s is printed beside the first's, with the feed worker processes
its sidecar ran when it started (the killed trainer's, kept idle for the next feed of the
same work: ``--workers`` expected, never more) and what became of each killed trainer's
feed workers: adopted by the next start's feed (the same processes), or gone how long after
the SIGKILL (the sidecar's ``--feed-idle-s 0``, or a worker busy in a batch).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import subprocess
import sys
import threading
import time

from benchmarks.common import table

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEADLINE = 10.0  # seconds to wait for a killed trainer's feed workers to go


def _alive(pid: int) -> bool:
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0] != "Z"
  except OSError:
    return False


def _gone_after(workers: list[int], killed_at: float) -> float:
  """Seconds from ``killed_at`` (time.time()) until none of ``workers`` runs; inf if some
  still run after DEADLINE."""
  deadline = time.monotonic() + DEADLINE
  while any(_alive(w) for w in workers):
    if time.monotonic() > deadline:
      return float("inf")
    time.sleep(0.005)
  return time.time() - killed_at


def one_launch(restarts: int, steps: int, workers: int) -> tuple[list[dict], list[float]]:
  command = [sys.executable, "-m", "sidecar", "launch", "--hosts", "1", "--shm-size", "64MiB",
             "--max-restarts", str(restarts), "--import", "tests.support.feed_fns", "--",
             sys.executable, "-m", "tests.support.feed_restarts", str(steps), str(workers),
             str(restarts)]
  p = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
  err: list[str] = []
  reader = threading.Thread(target=lambda: err.extend(p.stderr))  # type: ignore[arg-type]
  reader.start()
  results, gone, watchers = [], {}, []
  for line in p.stdout:  # type: ignore[union-attr]
    if m := re.search(r"RESULT (\{.*\})", line):
      r = json.loads(m.group(1))
      results.append(r)
      if r["kind"] == "kill":  # watched while the next start runs (it may adopt them)
        watchers.append(threading.Thread(target=lambda r=r: gone.__setitem__(
            r["restart"], _gone_after(r["feed_workers"], r["t"]))))
        watchers[-1].start()
  p.wait()
  reader.join()
  for w in watchers:
    w.join()
  if p.returncode != 0:
    raise SystemExit(f"the launch failed ({p.returncode}):\n" + "".join(err))
  return results, [gone[k] for k in sorted(gone)]


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--restarts", type=int, default=5)
  parser.add_argument("--steps", type=int, default=3000, help="timed steps of each start")
  parser.add_argument("--workers", type=int, default=2, help="the feed's worker processes")
  args = parser.parse_args()
  results, gone = one_launch(args.restarts, args.steps, args.workers)
  starts = {r["restart"]: r for r in results if r["kind"] == "start"}
  runs = {r["restart"]: r for r in results if r["kind"] == "run"}
  first = runs[0]["steps_per_s"]
  kills = {r["restart"]: r for r in results if r["kind"] == "kill"}

  def fate(k: int) -> str:
    if k not in kills:
      return "-"
    if k + 1 in runs and set(runs[k + 1]["feed_workers"]) == set(kills[k]["feed_workers"]):
      return "adopted by the next"
    return f"gone after {gone[k]:.3f} s"

  rows = []
  for k in sorted(runs):
    rows.append([k, len(starts[k]["feed_workers"]), starts[k]["feeds"],
                 f"{runs[k]['steps_per_s']:.0f}", f"{runs[k]['steps_per_s'] / first:.3f}",
                 fate(k)])
  print(table(["start (SIDECAR_RESTART)", "feed workers at start (idle)", "feeds left",
               "steps/s", "vs first", "its workers after its SIGKILL"], rows))
  last = runs[max(runs)]["steps_per_s"]
  most = max(len(r["feed_workers"]) for r in [*starts.values(), *runs.values()])
  print(f"\nfirst run {first:.0f} steps/s, after restart {max(runs)} {last:.0f} steps/s: "
        f"ratio {last / first:.3f}; at most {most} feed worker processes at once "
        f"(--workers {args.workers}); {sum(fate(k).startswith('adopted') for k in kills)} of "
        f"{len(kills)} killed trainers' workers adopted by the next start")


if __name__ == "__main__":
  main()
