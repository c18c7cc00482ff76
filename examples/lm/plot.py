"""Draws the loss curves of train.py's metrics files, against step and against time.

  python examples/lm/plot.py /tmp/lm-metrics.jsonl [more.jsonl ...] --out /tmp/lm-loss.png

Each file is one curve; where a file holds a step more than once (a run killed and
resumed appends), its last line counts, and time runs on across the restart.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys


def read(path: str) -> tuple[list[int], list[float], list[float]]:
  """(steps, losses, seconds since the first line) of a metrics file, last line per step."""
  lines = [json.loads(line) for line in pathlib.Path(path).read_text().splitlines() if line]
  last = {line["step"]: line for line in lines}
  steps = sorted(last)
  start = min(line["time"] for line in lines)
  return steps, [last[s]["loss"] for s in steps], [last[s]["time"] - start for s in steps]


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("metrics", nargs="+", help="JSON-lines files written by train.py")
  parser.add_argument("--out", required=True, help="PNG to write")
  args = parser.parse_args(argv)
  import matplotlib
  matplotlib.use("Agg")
  from matplotlib import pyplot as plt

  fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(11, 4))
  for path in args.metrics:
    steps, losses, seconds = read(path)
    by_step.plot(steps, losses, label=pathlib.Path(path).stem)
    by_time.plot(seconds, losses, label=pathlib.Path(path).stem)
  by_step.set(xlabel="step", ylabel="loss (nats per byte)")
  by_time.set(xlabel="seconds", ylabel="loss (nats per byte)")
  by_step.legend()
  fig.tight_layout()
  fig.savefig(args.out, dpi=100)
  print(f"wrote {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
