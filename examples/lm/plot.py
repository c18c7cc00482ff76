"""Draws the loss curves of train.py's metrics files, against step and against time.

  python examples/lm/plot.py /tmp/lm-metrics.jsonl [more.jsonl ...] --out /tmp/lm-loss.png

Each file is one curve; where a file holds a step more than once (a run killed and
resumed, or rolled back in-process, appends), its last line counts, and time runs on
across the restart. Each run is its own segment: no line is drawn across a restart. A run
begins at a line that says ``"first": true`` (train.py writes it on the first step of each
start and rollback), or where a step is not more than the one before it (a file written
before that mark).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from typing import NamedTuple


class Segment(NamedTuple):
  """The steps one run kept: its steps, their losses, seconds since the file's first line."""
  steps: list[int]
  losses: list[float]
  seconds: list[float]


def segments(path: str) -> list[Segment]:
  """A metrics file's curve, one segment per run: a run begins at a line marked
  ``"first"``, or where a step is not more than the one before it; of a step written more
  than once, the last line counts."""
  lines = [json.loads(line) for line in pathlib.Path(path).read_text().splitlines() if line]
  if not lines:
    return []
  run, last, previous = 0, {}, None
  for line in lines:
    if previous is not None and (line.get("first") or line["step"] <= previous):
      run += 1
    last[line["step"]] = (run, line)
    previous = line["step"]
  start = min(line["time"] for line in lines)
  out: list[Segment] = []
  before = None  # (run, step) of the previous point kept
  for step in sorted(last):
    run, line = last[step]
    if before is None or before != (run, step - 1):
      out.append(Segment([], [], []))
    out[-1].steps.append(step)
    out[-1].losses.append(line["loss"])
    out[-1].seconds.append(line["time"] - start)
    before = (run, step)
  return out


def read(path: str) -> tuple[list[int], list[float], list[float]]:
  """(steps, losses, seconds since the first line) of a metrics file, last line per step."""
  parts = segments(path)
  return ([s for p in parts for s in p.steps], [x for p in parts for x in p.losses],
          [t for p in parts for t in p.seconds])


def draw(paths: list[str]):
  """The figure: loss by step (left) and by time (right), a segment per run of each file."""
  import matplotlib
  matplotlib.use("Agg")
  from matplotlib import pyplot as plt

  fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(11, 4))
  for i, path in enumerate(paths):
    color, name = f"C{i}", pathlib.Path(path).stem
    for j, part in enumerate(segments(path)):
      style = {"color": color, "label": name if j == 0 else None,  # one legend entry a file
               "marker": "." if len(part.steps) == 1 else None}  # a lone point shows
      by_step.plot(part.steps, part.losses, **style)
      by_time.plot(part.seconds, part.losses, **style)
  by_step.set(xlabel="step", ylabel="loss (nats per byte)")
  by_time.set(xlabel="seconds", ylabel="loss (nats per byte)")
  by_step.legend()
  fig.tight_layout()
  return fig


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("metrics", nargs="+", help="JSON-lines files written by train.py")
  parser.add_argument("--out", required=True, help="PNG to write")
  args = parser.parse_args(argv)
  fig = draw(args.metrics)
  from matplotlib import pyplot as plt
  fig.savefig(args.out, dpi=100)
  plt.close(fig)
  print(f"wrote {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
