"""Goodput computed from outside the job: its metrics lines, its processes' lifetimes.

The same arithmetic for every system, from what any trainer leaves behind: the metrics
file (one ``{"step", "loss", "time"}`` line per step, ``"first"`` on a start's first),
the lifetime of each trainer process (start, as ``/proc`` says; death: the SIGKILL, its
exit, or the end of the window) with the failure that ended it, and the errors it
survived (rolled back in-process: the trainer's ``fault:`` line says when). Lines belong
to the process alive at their time. The job's wall clock ``[t0, t_end]`` splits without
overlap into:

  productive   the steps of the final lineage: for each step, its last computation
               (the one the finished job's trajectory holds); a step lasts from the
               line before it in the same process (a process's first step lasts the
               median step, the rest of its wait is startup)
  launch       t0 to the first trainer's start (the launcher and, for ours, its sidecars)
  startup      each process's start to its first step (imports, device, restore,
               data resume, compile)
  redone       steps computed and thrown away (a later computation of the same step
               replaced them: after a restart, or after an in-process rollback), and the
               work of a process that failed after its last line (a kill, an error)
  stall        a hung process's last line to its end (the launcher's kill, or the
               window's end where nothing killed it)
  rollback     an error survived in-process: the step in which it was raised, the
               rollback, to the first step after it, less one median step
  gap          each death to the next process's start
  other        the last process's work in flight when the window closed

Each failure is charged what it caused (:class:`Cost`): the work it threw away (each
re-done line goes to the first failure of its process after it), its stall, rollback and
gap, and the next process's startup. The launch and the first process's startup are no
failure's.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from collections.abc import Sequence

from sidecar._src.core import accounting

CATEGORIES = ("launch", "startup", "redone", "stall", "rollback", "gap", "other")
KINDS = ("kill", "hang", "error")  # the failures a benchmark injects
CHARGED = ("startup", "redone", "stall", "rollback", "gap")  # what a failure is charged


@dataclasses.dataclass(frozen=True, slots=True)
class Line:
  step: int
  loss: float
  time: float


@dataclasses.dataclass(frozen=True, slots=True)
class Life:
  """One trainer process: its start, its end (None: alive when the window closed), the
  kind of the injected failure that ended it (:data:`KINDS`; a hang that nothing ended
  has ``end`` None; None: it ended otherwise, or lived on), and when each error it
  survived was raised."""
  start: float
  end: float | None
  failure: str | None = None
  caught: tuple[float, ...] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class Cost:
  """What one failure cost: seconds by :data:`CHARGED` category; ``at``: seconds from the
  job's start to its last step before it (an error: when it was raised). ``recovered``: the job
  made a step after it (else the window's end, or the next failure, cut its cost short)."""
  kind: str
  at: float
  seconds: dict[str, float]
  recovered: bool

  @property
  def total_s(self) -> float:
    return sum(self.seconds.values())


@dataclasses.dataclass(frozen=True, slots=True)
class Account(accounting.Split):
  """The job's time as seen from outside (:func:`account`), with each failure's cost."""
  failures: int
  steps: int  # the final lineage's last step
  rates: tuple[float, ...]  # steps/s of each process between its first and last line
  startups: tuple[float, ...]  # each process's startup, seconds
  costs: tuple[Cost, ...] = ()  # each failure's, in order

  def per_failure(self) -> dict[str, float]:
    """Badput per failure, by category: what the failures were charged, over their
    number (startup, re-done work and gap; stall and rollback where any)."""
    return _mean(self.costs)

  def by_kind(self) -> dict[str, dict]:
    """For each kind of failure seen: ``{"failures", "recovered", "per_failure_s",
    "total_s"}`` (means over that kind's failures; a cost the window cut short counts
    what it reached)."""
    out = {}
    for kind in sorted({c.kind for c in self.costs}, key=_kind_order):
      mine = [c for c in self.costs if c.kind == kind]
      out[kind] = {"failures": len(mine), "recovered": sum(c.recovered for c in mine),
                   "per_failure_s": _mean(mine),
                   "total_s": statistics.fmean(c.total_s for c in mine)}
    return out

  def to_dict(self) -> dict:
    return {"wall_s": self.wall_s, "productive_s": self.productive_s, "goodput": self.goodput,
            "badput_s": self.badput_s, "failures": self.failures, "steps": self.steps,
            "steps_per_s_between_failures": list(self.rates),
            "startup_s_each": list(self.startups), "per_failure_s": self.per_failure(),
            "by_kind": self.by_kind(),
            "failures_each": [{"kind": c.kind, "at": c.at, "seconds": c.seconds,
                               "total_s": c.total_s, "recovered": c.recovered}
                              for c in self.costs]}


def _kind_order(kind: str) -> int:
  return KINDS.index(kind) if kind in KINDS else len(KINDS)


def _mean(costs: Sequence[Cost]) -> dict[str, float]:
  if not costs:
    return {}
  out = {k: sum(c.seconds[k] for c in costs) / len(costs) for k in CHARGED}
  return {k: v for k, v in out.items() if v or k in ("startup", "redone", "gap")}


def parse_line(text: str) -> Line | None:
  """The step line ``text`` holds; None where it holds none (a torn line, another record)."""
  try:
    d = json.loads(text)
  except ValueError:
    return None
  if not isinstance(d, dict) or "step" not in d or "time" not in d:
    return None
  return Line(int(d["step"]), float(d.get("loss", "nan")), float(d["time"]))


def read_lines(path: str) -> list[Line]:
  """The metrics file's step lines, in the order written (a torn last line is skipped)."""
  try:
    with open(path) as f:
      return [line for text in f if (line := parse_line(text)) is not None]
  except FileNotFoundError:
    return []


def final_lineage(lines: Sequence[Line]) -> set[int]:
  """Indices into ``lines`` of each step's last computation."""
  last: dict[int, int] = {}
  for i, line in enumerate(lines):
    last[line.step] = i
  return set(last.values())


class _Ledger:
  """What :func:`account` sums: badput by category, each failure's share of it, and the
  productive time, life by life (:meth:`life`)."""

  def __init__(self, lines: Sequence[Line], t0: float):
    self.lines, self.t0 = lines, t0
    self.keep = final_lineage(lines)
    dts = [b.time - a.time for a, b in zip(lines, lines[1:])]
    self.typical = statistics.median(dts) if dts else 0.0
    self.bad = dict.fromkeys(CATEGORIES, 0.0)
    self.productive = 0.0
    self.rates: list[float] = []
    self.startups: list[float] = []
    self.costs: list[dict] = []  # {"kind", "at", "seconds", "recovered"}

  def failure(self, kind: str, at: float) -> int:
    self.costs.append({"kind": kind, "at": at - self.t0, "seconds": dict.fromkeys(CHARGED, 0.0),
                       "recovered": False})
    return len(self.costs) - 1

  def add(self, category: str, seconds: float, failure: int | None) -> None:
    self.bad[category] += seconds
    if failure is not None and category in CHARGED:
      self.costs[failure]["seconds"][category] += seconds

  def life(self, life: Life, end: float, nxt: float, before: int | None) -> int | None:
    """Accounts ``life`` (ending at ``end``; the next life starts at ``nxt``) after the
    failure ``before`` ended the previous one; returns the failure that ended it."""
    lines = self.lines
    mine = [i for i, line in enumerate(lines) if life.start <= line.time < end
            or (life.end is None and line.time == end)]
    if before is not None and mine:
      self.costs[before]["recovered"] = True
    # Its failures in order: the errors it survived, then the one that ended it.
    caught = [(t, self.failure("error", t)) for t in sorted(life.caught)]
    for t, i in caught:
      self.costs[i]["recovered"] = any(lines[j].time > t for j in mine)
    ended = None if life.failure is None else self.failure(
        life.failure, lines[mine[-1]].time if mine else life.start)
    prev = None
    for i in mine:
      if prev is None:
        dt = min(self.typical, lines[i].time - life.start)
        self.startups.append(lines[i].time - life.start - dt)
        self.add("startup", self.startups[-1], before)
      else:
        dt = lines[i].time - prev
        rolled = next((j for tc, j in caught if prev < tc <= lines[i].time), None)
        if rolled is not None and dt > self.typical:
          self.add("rollback", dt - self.typical, rolled)
          dt = self.typical
      if i in self.keep:
        self.productive += dt
      else:  # thrown away by the first of its failures after it
        self.add("redone", dt, next((j for tc, j in caught if tc >= lines[i].time), ended))
      prev = lines[i].time
    if prev is None:  # died, or the window closed, before its first step
      self.startups.append(end - life.start)
      self.add("startup", end - life.start, before)
    else:
      tail = "stall" if life.failure == "hang" else "redone" if life.failure else "other"
      self.add(tail, end - prev, ended)
      if len(mine) >= 3:
        self.rates.append((len(mine) - 1) / (lines[mine[-1]].time - lines[mine[0]].time))
    self.add("gap", max(0.0, nxt - end), ended)
    return ended


def account(lines: Sequence[Line], lives: Sequence[Life], *, t0: float,
            t_end: float) -> Account:
  """Splits ``[t0, t_end]`` into productive time and badput; see the module doc."""
  lives = sorted(lives, key=lambda life: life.start)
  ledger = _Ledger(sorted(lines, key=lambda line: line.time), t0)
  ledger.add("launch", (lives[0].start if lives else t_end) - t0, None)
  before: int | None = None  # the failure that ended the previous life
  for n, life in enumerate(lives):
    end = min(life.end if life.end is not None else t_end, t_end)
    before = ledger.life(life, end, lives[n + 1].start if n + 1 < len(lives) else t_end,
                         before)
  final = max((ledger.lines[i].step for i in ledger.keep), default=0)
  costs = tuple(Cost(c["kind"], c["at"], c["seconds"], c["recovered"]) for c in ledger.costs)
  return Account(t_end - t0, ledger.productive, ledger.bad, len(costs), final,
                 tuple(ledger.rates), tuple(ledger.startups), costs)


def loss_diffs(lines: Sequence[Line], reference: Sequence[Line]) -> dict:
  """Each step's loss against the uninterrupted run's: every computation, and the final lineage."""
  ref = {line.step: line.loss for line in reference}
  keep = final_lineage(lines)
  every, final, missing = 0.0, 0.0, 0
  equal = True
  for i, line in enumerate(lines):
    if line.step not in ref:
      missing += 1
      continue
    d = abs(line.loss - ref[line.step])
    equal = equal and line.loss == ref[line.step]
    every = max(every, d)
    if i in keep:
      final = max(final, d)
  return {"bit_exact": equal and missing == 0, "max_abs_diff": every,
          "max_abs_diff_final": final, "compared": len(lines) - missing,
          "not_in_reference": missing}


def steady_rate(lines: Sequence[Line], *, skip: int = 3) -> float:
  """Steps per second of one uninterrupted process's lines, past the first ``skip``."""
  lines = sorted(lines, key=lambda line: line.time)[skip:]
  if len(lines) < 2 or lines[-1].time <= lines[0].time:
    return 0.0
  return (len(lines) - 1) / (lines[-1].time - lines[0].time)


def step_seconds(lines: Sequence[Line], *, skip: int = 3) -> dict[int, float]:
  """Each step's seconds (from the line before it) in one process's run, past ``skip``."""
  lines = sorted(lines, key=lambda line: line.time)[skip:]
  return {b.step: b.time - a.time for a, b in zip(lines, lines[1:])}


def save_cost(saving: Sequence[Line], none: Sequence[Line], *, every: int) -> tuple[float, float]:
  """(seconds of training lost per save, a step's seconds without saves).

  What a save costs is what the steps around it lose, wherever they fall: a stall at the
  save, and slowdowns of later steps whose place in the period varies (the device-to-host
  copy, the sidecar's writes). So the mean step of the saving run less the mean step of
  the run without saves, times ``every``. Steps over ten times their run's median (a
  process of the machine's scheduling, not a save: no save stalls a step that long) are
  left out of both means. (Per-phase medians, used before, missed the varying slowdowns:
  6.7 ms a save on the v5e where the rates said 40 ms.)
  """
  def mean(lines: Sequence[Line]) -> float:
    seconds = list(step_seconds(lines).values())
    cut = 10 * statistics.median(seconds)
    return statistics.fmean(dt for dt in seconds if dt <= cut)
  base = mean(none)
  return max(0.0, every * (mean(saving) - base)), base
