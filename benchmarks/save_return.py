"""How long ``save()`` takes to return: a small state, one host, the step taken over.

Run from the repository root: ``python -m benchmarks.save_return [--saves 60]``. Not run
by CI.

One 1-host ``LocalCluster``; one ``ctl.checkpointer`` saves a 4 MiB float32 state (a host
array, as ``benchmarks.pool``'s tenants save it) ``--saves`` times, each once the one
before has ended (durable, and the step ``max_to_keep`` drops deleted: ``ckpt.wait()``),
so only the call itself is timed: the copy into the arena, the Stage
that begins the step (one host: no Begin of its own since issue 69) and the sidecar's
takeover of the step (``save()`` returns once every host took it
over: ARCHITECTURE.md, "The sidecars' agreement"). The first ``--warmup`` saves are not
counted. Between two saves, once the first has ended, one ``ctl.status()`` is timed: a
Status round trip to the same sidecar, the baseline ``save()`` is measured against (issue
69 asks for ``save()`` within 2x of it). Printed per ``--rounds`` round (the machine's
spread), in ms, median, p90 and min-max: ``save()``'s return time, the Status round trip,
their medians' ratio, and, for reference, ``durable`` (committed on storage).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import numpy as np

import sidecar
from benchmarks.common import pct, table

STATE_BYTES = 4 << 20


def one_round(ctl, directory: str, saves: int, warmup: int
              ) -> tuple[list[float], list[float], list[float]]:
  """``saves`` timed saves (after ``warmup``): each one's return and durable, and a Status
  round trip timed between each two, in s."""
  state = {"w": np.ones(STATE_BYTES // 4, np.float32)}
  returned, durable, status = [], [], []
  with ctl.checkpointer(directory, max_to_keep=2) as ckpt:
    for step in range(warmup + saves):
      t0 = time.perf_counter()
      handle = ckpt.save(step, state)
      t1 = time.perf_counter()
      handle.durable.result(120)
      t2 = time.perf_counter()
      ckpt.wait()  # and the step max_to_keep drops is deleted: no Delete beside the next
      t3 = time.perf_counter()
      ctl.status()
      t4 = time.perf_counter()
      if step >= warmup:
        returned.append(t1 - t0)
        durable.append(t2 - t0)
        status.append(t4 - t3)
  return sorted(returned), sorted(durable), sorted(status)


def summary(values: list[float]) -> str:
  ms = [v * 1e3 for v in values]
  return (f"{statistics.median(ms):.2f} / {pct(ms, 90):.2f} "
          f"({ms[0]:.2f}-{ms[-1]:.2f})")


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--saves", type=int, default=60)
  ap.add_argument("--warmup", type=int, default=5)
  ap.add_argument("--rounds", type=int, default=2)
  args = ap.parse_args()
  rows = []
  with tempfile.TemporaryDirectory(prefix="sidecar-save-return-") as directory, \
      sidecar.testing.LocalCluster(1, 1, shm_size="64MiB",
                                   checkpoint_roots=[directory]) as cluster, \
      cluster.controller() as ctl:
    for r in range(args.rounds):
      returned, durable, status = one_round(ctl, f"{directory}/round{r}", args.saves,
                                            args.warmup)
      ratio = statistics.median(returned) / statistics.median(status)
      rows.append((r + 1, summary(returned), summary(status), f"{ratio:.2f}x",
                   summary(durable)))
  print(f"## save() of a {STATE_BYTES >> 20} MiB state, 1 host, {args.saves} saves a round\n")
  print(table(("round", "save() returns, ms: median / p90 (min-max)",
               "Status round trip, ms: median / p90 (min-max)", "save() / Status",
               "durable, ms: median / p90 (min-max)"), rows))


if __name__ == "__main__":
  main()
