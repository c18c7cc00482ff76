"""Goodput computed from outside the job: its metrics lines, its processes' lifetimes.

The same arithmetic for every system, from what any trainer leaves behind: the
metrics file (one ``{"step", "loss", "time"}`` line per step) and the lifetime of
each trainer process (start, as ``/proc`` says; death: the SIGKILL, or the end of
the window). Lines belong to the process alive at their time. The job's wall
clock ``[t0, t_end]`` splits without overlap into:

  productive   the steps of the final lineage: for each step, its last computation
               (the one the finished job's trajectory holds); a step lasts from the
               line before it in the same process (a process's first step lasts the
               median step, the rest of its wait is startup)
  launch       t0 to the first trainer's start (the launcher and, for ours, its sidecars)
  startup      each process's start to its first step (imports, device, restore,
               data resume, compile)
  redone       steps computed and thrown away (a later process computed them again),
               and each killed process's work after its last line
  gap          each death to the next process's start
  other        the last process's work in flight when the window closed
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from collections.abc import Sequence

CATEGORIES = ("launch", "startup", "redone", "gap", "other")


@dataclasses.dataclass(frozen=True, slots=True)
class Line:
  step: int
  loss: float
  time: float


@dataclasses.dataclass(frozen=True, slots=True)
class Life:
  """One trainer process: its start and its end (kill time, or None: alive at the end)."""
  start: float
  end: float | None
  killed: bool


@dataclasses.dataclass(frozen=True, slots=True)
class Account:
  wall_s: float
  productive_s: float
  badput_s: dict[str, float]
  failures: int
  steps: int  # the final lineage's last step
  rates: tuple[float, ...]  # steps/s of each process between its first and last line
  startups: tuple[float, ...]  # each process's startup, seconds

  @property
  def goodput(self) -> float:
    return self.productive_s / self.wall_s if self.wall_s > 0 else 0.0

  def per_failure(self) -> dict[str, float]:
    """Badput per failure: startup, re-done work and gap of the restarts only."""
    if not self.failures:
      return {}
    restarts = self.startups[1:]
    return {"startup": sum(restarts) / self.failures,
            "redone": self.badput_s["redone"] / self.failures,
            "gap": self.badput_s["gap"] / self.failures}

  def to_dict(self) -> dict:
    return {"wall_s": self.wall_s, "productive_s": self.productive_s, "goodput": self.goodput,
            "badput_s": self.badput_s, "failures": self.failures, "steps": self.steps,
            "steps_per_s_between_failures": list(self.rates),
            "startup_s_each": list(self.startups), "per_failure_s": self.per_failure()}


def read_lines(path: str) -> list[Line]:
  """The metrics file's step lines, in the order written (a torn last line is skipped)."""
  out = []
  try:
    with open(path) as f:
      for text in f:
        try:
          d = json.loads(text)
        except ValueError:
          continue
        if isinstance(d, dict) and "step" in d and "time" in d:
          out.append(Line(int(d["step"]), float(d.get("loss", "nan")), float(d["time"])))
  except FileNotFoundError:
    pass
  return out


def final_lineage(lines: Sequence[Line]) -> set[int]:
  """Indices into ``lines`` of each step's last computation."""
  last: dict[int, int] = {}
  for i, line in enumerate(lines):
    last[line.step] = i
  return set(last.values())


def account(lines: Sequence[Line], lives: Sequence[Life], *, t0: float,
            t_end: float) -> Account:
  """Splits ``[t0, t_end]`` into productive time and badput; see the module doc."""
  lives = sorted(lives, key=lambda life: life.start)
  lines = sorted(lines, key=lambda line: line.time)
  keep = final_lineage(lines)
  bad = dict.fromkeys(CATEGORIES, 0.0)
  productive, rates, startups = 0.0, [], []
  bad["launch"] = (lives[0].start if lives else t_end) - t0
  all_dts = [b.time - a.time for a, b in zip(lines, lines[1:])]
  typical = statistics.median(all_dts) if all_dts else 0.0
  for n, life in enumerate(lives):
    end = min(life.end if life.end is not None else t_end, t_end)
    nxt = lives[n + 1].start if n + 1 < len(lives) else t_end
    mine = [i for i, line in enumerate(lines) if life.start <= line.time < end
            or (life.end is None and line.time == end)]
    prev = None
    for i in mine:
      if prev is None:
        dt = min(typical, lines[i].time - life.start)
        startups.append(lines[i].time - life.start - dt)
        bad["startup"] += startups[-1]
      else:
        dt = lines[i].time - prev
      if i in keep:
        productive += dt
      else:
        bad["redone"] += dt
      prev = lines[i].time
    if prev is None:  # died, or the window closed, before its first step
      startups.append(end - life.start)
      bad["startup"] += end - life.start
    else:
      tail = end - prev
      bad["redone" if life.killed else "other"] += tail
      if len(mine) >= 3:
        rates.append((len(mine) - 1) / (lines[mine[-1]].time - lines[mine[0]].time))
    bad["gap"] += max(0.0, nxt - end)
  final = max((lines[i].step for i in keep), default=0)
  failures = sum(1 for life in lives if life.killed)
  return Account(t_end - t0, productive, bad, failures, final, tuple(rates), tuple(startups))


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
