"""``sidecar goodput CKPT_DIR [ADDR...]``: a job's goodput, from the ledger its sidecar kept.

The sidecar of the recording trainer (process 0) appends the job's time events to
``CKPT_DIR/goodput.jsonl`` across restarts (docs/goodput.md); this reads that file and
prints the table (category, seconds, share of wall time), ``--json`` one object for
scripts, ``--plot FILE.png`` the job's timeline (matplotlib: the ``lm`` or ``bench``
extra). During a run, the time since the running life's last event is counted as what
its sidecar says it is (a hang past its timeout as stall, a phase as that phase: the
sidecars at ADDR, else the job's from the environment; ``goodput_live.py``), in one line
to stderr. Exit status 1 where there is no ledger in CKPT_DIR, or the plot cannot be
written (one line naming the path and why).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from sidecar._src.core import accounting, errors, extras, goodput as goodput_lib
from sidecar._src.tools import cli_format, cli_types

# What each category looks like on the timeline.
COLORS = {"productive": "#2ca02c", "startup": "#7f7f7f", "redone": "#d62728",
          "stall": "#8c564b", "restart_gap": "#000000", "save": "#1f77b4",
          "data_wait": "#ff7f0e", "checkpoint": "#17becf", "restore": "#9467bd",
          "slow": "#bcbd22", "phase": "#e377c2"}
# The life's own time fills its row; the time it was blocked is drawn over its lower half.
BLOCKED = ("data_wait", "checkpoint", "restore")


@dataclasses.dataclass(frozen=True, slots=True)
class Bar:
  """One span of the timeline: ``category``'s time from ``start`` to ``end`` (seconds
  since the job began) in life ``row``."""
  row: int
  start: float
  end: float
  category: str


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
  ledger = accounting.account(reading.events, skipped_lines=reading.skipped)
  if ledger.lives and ledger.lives[-1].ended == "running":  # the job runs: ask its sidecars
    ledger = _with_open_gap(args, reading, ledger)
  if args.plot:
    try:
      plot(ledger, args.plot)
    except errors.InvalidArgumentError as e:
      print(f"sidecar goodput: {e}", file=sys.stderr)
      return 1
    print(f"sidecar goodput: drew the timeline to {os.path.abspath(args.plot)}",
          file=sys.stderr)  # stdout stays the table or the JSON
  print(json.dumps(ledger.to_dict(), sort_keys=True) if args.json else accounting.table(ledger))
  return 0


def _with_open_gap(args: argparse.Namespace, reading: goodput_lib.Reading,
                   ledger: accounting.Ledger) -> accounting.Ledger:
  """``ledger`` with its running life's open gap counted as its sidecars say
  (``goodput_live.open_gap``); each thing said in a line to stderr."""
  from sidecar._src.tools import cli_types, goodput_live
  where = goodput_live.addresses(args.addresses)
  trainers, missing = goodput_live.fetch_trainers(where, timeout=args.timeout,
                                                  token=cli_types.token(args))
  for line in missing:
    print(f"sidecar goodput: {line}", file=sys.stderr)
  gap = goodput_live.open_gap(reading.events, ledger.lives[-1], trainers)
  print(f"sidecar goodput: {gap.said}", file=sys.stderr)
  if not gap.events:
    return ledger
  return accounting.account([*reading.events, *gap.events], skipped_lines=reading.skipped)


def bars(ledger: accounting.Ledger) -> list[Bar]:
  """The timeline's spans: each life's startup, steps kept and steps thrown away (by its
  death, and by each rollback inside it), its phases and slow spans without a step, its
  stall before it was killed (if it stalled),
  the time it was blocked (data wait, checkpoint, restore: ``BLOCKED``), and the restart
  gap after a life that did not finish (in the row of the life it ends)."""
  t0 = ledger.lives[0].start if ledger.lives else 0.0
  out = []
  for row, life in enumerate(ledger.lives):
    first = life.end if life.first_step is None else life.first_step
    stalled = life.end - life.seconds.get("stall", 0.0)  # no step from here on
    thrown = stalled if life.redone_from is None else min(life.redone_from, stalled)
    spans = [(life.start, first, "startup"), (first, thrown, "productive"),
             *((a, b, "redone") for a, b in life.rolled_back),  # drawn over the steps kept
             (thrown, stalled, "redone"), (stalled, life.end, "stall"),
             *life.gaps, *life.blocked]  # a phase, slow work: drawn over the steps
    if row + 1 < len(ledger.lives) and life.ended != "finish":
      spans.append((life.end, ledger.lives[row + 1].start, "restart_gap"))
    out += [Bar(row, a - t0, b - t0, what) for a, b, what in spans if b > a]
  return out


def title(ledger: accounting.Ledger) -> str:
  """The timeline's title: the goodput of the wall time, and where the axis runs longer
  (a run that finished, then a later one: nothing ran between), by how much and why."""
  plural = "" if ledger.restarts == 1 else "s"
  text = f"goodput {100 * ledger.goodput:.1f}% of {ledger.wall_s:.1f} s, {ledger.restarts} " \
         f"restart{plural}"
  span = (ledger.lives[-1].end - ledger.lives[0].start) if ledger.lives else 0.0
  if span - ledger.wall_s >= 0.05:
    text += (f"; the axis runs {span:.1f} s: {span - ledger.wall_s:.1f} s between runs, "
             "nothing running, are not counted")
  return text


def life_label(row: int, life: accounting.Life) -> str:
  """A life's name on the timeline: where it started from, and where it rolled back to
  inside the process."""
  label = f"life {row}: " + ("from scratch" if life.resumed_from is None
                             else f"resumed from step {life.resumed_from}")
  if life.rollbacks:
    steps = ", ".join(str(step) for _, step in life.rollbacks[:3])
    label += f"; rolled back to {steps}" + (", ..." if len(life.rollbacks) > 3 else "")
  return label


def plot(ledger: accounting.Ledger, path: str) -> None:
  """Draws ``ledger``'s timeline to ``path`` (a PNG): one row per process life, labelled
  with the step it resumed from (:func:`life_label`), its spans (:func:`bars`), a tick
  at each save.

  Raises:
    ModuleNotFoundError: matplotlib is missing (naming the extra that brings it).
    InvalidArgumentError: ``path`` cannot be written (its directory missing or not
      writable, a directory itself, a format matplotlib does not draw), naming it and why.
  """
  try:
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib import pyplot
  except ImportError as e:
    raise extras.missing(e, "sidecar goodput --plot") from e
  t0 = ledger.lives[0].start if ledger.lives else 0.0
  fig, ax = pyplot.subplots(figsize=(10, 1.2 + 0.45 * max(len(ledger.lives), 1)))
  for bar in bars(ledger):
    if bar.category == "restart_gap":
      ax.barh(bar.row + 0.5, bar.end - bar.start, left=bar.start, height=0.15,
              color=COLORS[bar.category], label=bar.category)
    else:
      low = bar.category in BLOCKED  # over the lower half of the row
      ax.barh(bar.row + (0.2 if low else 0.0), bar.end - bar.start, left=bar.start,
              height=0.4 if low else 0.8, color=COLORS[bar.category], label=bar.category)
  for row, life in enumerate(ledger.lives):
    for t, _ in life.saves:
      ax.plot([t - t0] * 2, [row - 0.4, row + 0.4], color=COLORS["save"], lw=1, label="save")
  handles, labels = ax.get_legend_handles_labels()
  unique = dict(zip(labels, handles))
  ax.legend(unique.values(), unique.keys(), loc="center left", bbox_to_anchor=(1.0, 0.5),
            frameon=False)
  ax.set_yticks(range(len(ledger.lives)),
                [life_label(row, life) for row, life in enumerate(ledger.lives)])
  ax.invert_yaxis()
  ax.set_xlabel("seconds since the job started")
  ax.set_title(title(ledger))
  try:
    fig.savefig(path, dpi=120, bbox_inches="tight")
  except (OSError, ValueError) as e:  # a missing directory, no permission; no such format
    why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
    raise errors.InvalidArgumentError(
        f"cannot draw the timeline to {os.path.abspath(path)!r}: {why}; --plot names a "
        ".png file in a directory that exists and that you may write (--plot "
        "timeline.png writes it in this directory)") from e
  finally:
    pyplot.close(fig)


def register(subparsers: argparse._SubParsersAction) -> None:
  """Adds ``goodput`` to ``subparsers`` (``sidecar``'s commands)."""
  s = subparsers.add_parser(
      "goodput", help="a job's goodput: its time split into productive steps and badput",
      description=__doc__.split("\n\n")[1], formatter_class=cli_format.DefaultsFormatter)
  s.add_argument("directory", metavar="CKPT_DIR",
                 help="the job's checkpoint directory (its first checkpointer's)")
  cli_types.add_sidecar_flags(s, timeout=5.0)  # ADDR...: a running job's sidecars
  s.add_argument("--json", action="store_true",
                 help='print {"wall_s", "productive_s", "goodput", "badput_s": {category: '
                      'seconds}, "restarts", "skipped_lines"} (default: a table)')
  s.add_argument("--plot", metavar="FILE.png",
                 help="draw the job's timeline to this PNG (default: none)")
  s.set_defaults(func=_run, parser=s)
