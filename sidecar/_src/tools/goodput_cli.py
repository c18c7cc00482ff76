"""``sidecar goodput CKPT_DIR``: a job's goodput, from the ledger its sidecar kept.

The sidecar of the recording trainer (process 0) appends the job's time events to
``CKPT_DIR/goodput.jsonl`` across restarts (docs/goodput.md); this reads that file and
prints the table (category, seconds, share of wall time), ``--json`` one object for
scripts, ``--plot FILE.png`` the job's timeline (matplotlib: the ``lm`` or ``bench``
extra). Exit status 1 where there is no ledger in CKPT_DIR.
"""

from __future__ import annotations

import argparse
import json
import sys

from sidecar._src.core import extras, goodput as goodput_lib
from sidecar._src.tools import cli_format

# What each category looks like on the timeline.
COLORS = {"productive": "#2ca02c", "startup": "#7f7f7f", "redone": "#d62728",
          "stall": "#ff7f0e", "restart_gap": "#000000", "save": "#1f77b4"}


def _run(args: argparse.Namespace) -> int:
  try:
    reading = goodput_lib.read_all(args.directory)
  except FileNotFoundError:
    print(f"sidecar goodput: no ledger in {args.directory} ({goodput_lib.FILE}): it is "
          "written by the sidecar beside a trainer whose Controller opened a checkpointer "
          "there", file=sys.stderr)
    return 1
  except OSError as e:
    print(f"sidecar goodput: cannot read the ledger in {args.directory}: {e}", file=sys.stderr)
    return 1
  ledger = goodput_lib.account(reading.events, skipped_lines=reading.skipped)
  if args.plot:
    plot(ledger, args.plot)
  print(json.dumps(ledger.to_dict(), sort_keys=True) if args.json else goodput_lib.table(ledger))
  return 0


def plot(ledger: goodput_lib.Ledger, path: str) -> None:
  """Draws ``ledger``'s timeline to ``path`` (a PNG): one bar per process life (startup,
  steps kept, steps thrown away), restart gaps between, a tick at each save.

  Raises:
    ModuleNotFoundError: matplotlib is missing (naming the extra that brings it).
  """
  try:
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib import pyplot
  except ImportError as e:
    raise extras.missing(e, "sidecar goodput --plot") from e
  t0 = ledger.lives[0].start if ledger.lives else 0.0
  fig, ax = pyplot.subplots(figsize=(10, 1.2 + 0.45 * max(len(ledger.lives), 1)))
  for row, life in enumerate(ledger.lives):
    first = life.end if life.first_step is None else life.first_step
    spans = [(life.start, first, "startup")]
    stalled = life.end - life.seconds.get("stall", 0.0)  # no step from here on
    thrown = stalled if life.redone_from is None else min(life.redone_from, stalled)
    spans += [(first, thrown, "productive"), (thrown, stalled, "redone"),
              (stalled, life.end, "stall")]
    for a, b, what in spans:
      if b > a:
        ax.barh(row, b - a, left=a - t0, color=COLORS[what], label=what)
    for t, _ in life.saves:
      ax.plot([t - t0] * 2, [row - 0.4, row + 0.4], color=COLORS["save"], lw=1, label="save")
    if row + 1 < len(ledger.lives) and life.ended != "finish":
      nxt = ledger.lives[row + 1].start
      ax.barh(row + 0.5, nxt - life.end, left=life.end - t0, height=0.15,
              color=COLORS["restart_gap"], label="restart_gap")
  handles, labels = ax.get_legend_handles_labels()
  unique = dict(zip(labels, handles))
  ax.legend(unique.values(), unique.keys(), loc="center left", bbox_to_anchor=(1.0, 0.5),
            frameon=False)
  ax.set_yticks(range(len(ledger.lives)), [f"life {i}" for i in range(len(ledger.lives))])
  ax.invert_yaxis()
  ax.set_xlabel("seconds since the job started")
  ax.set_title(f"goodput {100 * ledger.goodput:.1f}% of {ledger.wall_s:.1f} s, "
               f"{ledger.restarts} restart{'' if ledger.restarts == 1 else 's'}")
  fig.savefig(path, dpi=120, bbox_inches="tight")
  pyplot.close(fig)


def register(subparsers: argparse._SubParsersAction) -> None:
  """Adds ``goodput`` to ``subparsers`` (``sidecar``'s commands)."""
  s = subparsers.add_parser(
      "goodput", help="a job's goodput: its time split into productive steps and badput",
      description=__doc__.split("\n\n")[1], formatter_class=cli_format.DefaultsFormatter)
  s.add_argument("directory", metavar="CKPT_DIR",
                 help="the job's checkpoint directory (its first checkpointer's)")
  s.add_argument("--json", action="store_true",
                 help='print {"wall_s", "productive_s", "goodput", "badput_s": {category: '
                      'seconds}, "restarts", "skipped_lines"} (default: a table)')
  s.add_argument("--plot", metavar="FILE.png",
                 help="draw the job's timeline to this PNG (default: none)")
  s.set_defaults(func=_run, parser=s)
