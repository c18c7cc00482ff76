"""Goodput's accounting: a job's time ledger split from its events (``core/goodput.py``).

:func:`account` splits the events of a job's ledger file, in the order written, into
productive time and badput by category (:class:`Ledger`, life by life: :class:`Life`);
:func:`table` is that split as ``sidecar goodput`` prints it.

The accounting, for each life in order (its span: its start .. its end, a died or finish
event, else its last event):

- ``startup``: start .. first step done, less the data wait, checkpoint and restore in it;
- ``data_wait``, ``checkpoint``, ``restore``: the counters, whole;
- step time: the rest of the span. For a life that died, what the next life threw away
  is ``redone``: the step time after its ``save`` of the step the next life resumed from
  (all its step time if it saved no such step: the next life restored an older one, or
  started from scratch; a next life that died before it restored or stepped decides
  nothing, the one after it does); the last life of a job that ended in a death counts
  the step time after its last save as redone. A rollback in the process (a ``restore`` after the
  first step) throws away the step time from its save of the step it restored (its first
  step, where it saved no such step) to the rollback: ``redone`` too, counted once where
  the spans overlap. The rest of the step time is ``productive``;
- ``stall``: of a life that died stalled, its last step .. its end (its ``seen``, the
  moment the sidecar found it stalled): no step was made, and a launcher killed it; of a
  life still running that its sidecar finds stalled now (``sidecar goodput`` asks it:
  ``tools/goodput_live.open_gap``), its last step .. now;
- ``slow`` and ``phase``: the step time inside the life's ``slow`` and ``phase`` spans (less
  the blocked time the counters place there), taken out of its step time first, so never
  ``redone`` nor productive; ``phase`` is split by the phases' names
  (:attr:`Ledger.phases`);
- ``restart_gap``: a death (its ``seen``, the last sign of life, where it is later than
  the life's last event; or a life's last event, where its end was never seen) .. the
  next life's start; ``restarts`` counts them;
- wall: the first start .. the last life's end, less the time between a clean finish and
  a later run's start (nothing ran). The categories add up to it exactly (a next life
  that seems to start before the previous one ended is clipped to that end).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

from sidecar._src.core.goodput import Counters, Event

CATEGORIES = ("startup", "data_wait", "checkpoint", "restore", "redone", "stall", "slow",
              "phase", "restart_gap")


@dataclasses.dataclass(frozen=True, slots=True)
class Life:
  """One trainer process's time, as :func:`account` split it (for the timeline)."""
  life: str
  start: float  # clipped to the previous life's end
  first_step: float | None
  end: float
  ended: str  # "finish", "died" or "running" (its last event)
  saves: tuple[tuple[float, int], ...]  # (when save() returned, step)
  redone_from: float | None  # the step time after this is thrown away (None: none is)
  seconds: dict[str, float]  # this life's share of each category, and "productive"
  resumed_from: int | None = None  # the step it restored before its first step (None: none)
  rollbacks: tuple[tuple[float, int], ...] = ()  # (when, step) of restores after its first step
  # (from, to) of the step time each rollback threw away (redone): from the save of the
  # step it restored to the rollback.
  rolled_back: tuple[tuple[float, float], ...] = ()
  # (start, end, category) of the time it was blocked: "data_wait" (drawn at the end of
  # the interval between two events that counted it: marks come every 5 s at most),
  # "checkpoint" (ending when save() returned, or the checkpointer closed), "restore".
  blocked: tuple[tuple[float, float, str], ...] = ()
  # (start, end, "phase" or "slow") of its spans without a step that were what they were.
  gaps: tuple[tuple[float, float, str], ...] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class Split:
  """A job's wall-clock time split: ``productive_s`` and ``badput_s`` (seconds by
  category) add up to ``wall_s``. :func:`account` splits it from the job's own events
  (:class:`Ledger`); ``benchmarks/goodput_ledger.account`` from outside the job (its
  metrics lines and its processes' lifetimes, the same for any system it compares)."""
  wall_s: float
  productive_s: float
  badput_s: dict[str, float]

  @property
  def goodput(self) -> float:
    return self.productive_s / self.wall_s if self.wall_s > 0 else 0.0


@dataclasses.dataclass(frozen=True, slots=True)
class Ledger(Split):
  """The job's time as its events split it (:func:`account`), life by life."""
  restarts: int
  lives: tuple[Life, ...]
  skipped_lines: int = 0  # lines of the file that were no event (goodput.read_all)
  phases: dict[str, float] = dataclasses.field(default_factory=dict)  # "phase" by name

  def to_dict(self) -> dict[str, Any]:
    """What ``sidecar goodput --json`` prints."""
    return {"wall_s": self.wall_s, "productive_s": self.productive_s, "goodput": self.goodput,
            "badput_s": dict(self.badput_s), "phases_s": dict(self.phases),
            "restarts": self.restarts, "skipped_lines": self.skipped_lines}


@dataclasses.dataclass
class _Life:
  name: str
  start: float
  events: list[Event] = dataclasses.field(default_factory=list)

  def first(self, kind: str) -> Event | None:
    return next((e for e in self.events if e.kind == kind), None)

  def last_counters(self) -> Counters:
    return next((e.counters for e in reversed(self.events) if e.counters is not None),
                Counters())

  def end(self) -> tuple[float, str]:
    """When the life ended and how; a death at its last sign of life (``seen``, never
    before the life's own last event)."""
    for e in self.events:
      if e.kind == "finish":
        return e.t, e.kind
      if e.kind == "died":
        if e.seen is None:
          return e.t, e.kind
        last = max((x.t for x in self.events if x.kind != "died"), default=e.seen)
        return min(e.t, max(e.seen, last)), e.kind
    return max(e.t for e in self.events), "running"

  def stalled(self) -> float | None:
    """Its last step, where it died stalled (its died event says so), or, where it still
    runs, where its last event says it is stalled now (a hang in progress past its
    timeout: ``sidecar goodput``'s view of a live job, :func:`open_gap`)."""
    died = self.first("died")
    if died is not None:
      return died.stalled
    return self.events[-1].stalled if self.events[-1].kind == "mark" else None

  def resumed_from(self) -> int | None:
    """The step restored before the first step (a restart's); restores after it are
    rollbacks inside the process (``sidecar.jax.Recovery``)."""
    restore = self.first("restore")
    first = self.first("first_step")
    if restore is None or (first is not None and restore.t > first.t):
      return None
    return restore.step

  def rollback_events(self) -> list[Event]:
    """Its restores after its first step: rollbacks inside the process."""
    first = self.first("first_step")
    return [e for e in self.events
            if e.kind == "restore" and first is not None and e.t > first.t]

  def rollbacks(self) -> tuple[tuple[float, int], ...]:
    return tuple((e.t, e.step or 0) for e in self.rollback_events())

  def blocked(self, start: float, end: float) -> tuple[tuple[float, float, str], ...]:
    """Where the counters place the blocked time: see :attr:`Life.blocked`."""
    spans: list[tuple[float, float, str]] = []
    t0, c0 = start, Counters()
    for e in self.events:
      if e.counters is None:
        continue
      d, t = e.counters.minus(c0), min(max(e.t, t0), end)
      for category, seconds in (("checkpoint", d.ckpt_s), ("restore", d.restore_s),
                                ("data_wait", d.data_s)):
        seconds = min(seconds, t - t0)
        if seconds > 0:
          spans.append((t - seconds, t, category))
          t -= seconds
      t0, c0 = min(max(e.t, t0), end), e.counters
    return tuple(sorted(spans))

  def saves(self) -> list[Event]:
    return [e for e in self.events if e.kind == "save"]


def _lives(events: Iterable[Event]) -> list[_Life]:
  """The events grouped by life, in the order the lives started; a life with no start
  event (its start lost) starts at its first event."""
  lives: dict[str, _Life] = {}
  for e in events:
    life = lives.get(e.life)
    if life is None:
      life = lives[e.life] = _Life(e.life, e.start if e.start is not None else e.t)
    elif e.kind == "start" and e.start is not None:
      life.start = e.start
    life.events.append(e)
  return sorted(lives.values(), key=lambda x: x.start)


def _step_time(t0: float, c0: Counters, t1: float, c1: Counters) -> float:
  """Seconds from ``t0`` to ``t1`` not blocked on data, a save or a restore."""
  return max(0.0, (t1 - t0) - c1.minus(c0).blocked_s)


def account(events: Iterable[Event], *, skipped_lines: int = 0) -> Ledger:
  """The ledger of ``events`` (in the order written); see the module docstring.
  ``skipped_lines``: the lines of the file that were no event, to report."""
  lives = _lives(events)
  totals = dict.fromkeys(CATEGORIES, 0.0)
  phases: dict[str, float] = {}
  productive, wall, restarts, out = 0.0, 0.0, 0, []
  previous: Life | None = None
  for i, life in enumerate(lives):
    start = life.start if previous is None else max(life.start, previous.end)
    end, ended = life.end()
    end = max(end, start)
    if previous is not None and previous.ended != "finish":
      totals["restart_gap"] += start - previous.end
      wall += start - previous.end
      restarts += 1
    wall += end - start
    seconds = _split(life, start, end, ended, lives[i + 1:])
    for k in CATEGORIES[:-1]:
      totals[k] += seconds[k]
    gaps = seconds.pop("_gaps")
    for name, t in seconds.pop("_phases").items():
      phases[name] = phases.get(name, 0.0) + t
    productive += seconds["productive"]
    first = life.first("first_step")
    redone_from = seconds.pop("_redone_from")
    rolled_back = seconds.pop("_rolled_back")
    previous = Life(life.name, start, None if first is None else min(first.t, end), end, ended,
                    tuple((e.t, e.step or 0) for e in life.saves()), redone_from, seconds,
                    resumed_from=life.resumed_from(), rollbacks=life.rollbacks(),
                    blocked=life.blocked(start, end), rolled_back=rolled_back, gaps=gaps)
    out.append(previous)
  return Ledger(wall, productive, totals, restarts, tuple(out), skipped_lines, phases)


def _split(life: _Life, start: float, end: float, ended: str, later: Sequence[_Life], *,
           stall: bool = True) -> dict[str, Any]:
  """One life's span split into the categories (all but restart_gap) and productive;
  ``later``: the lives after it."""
  stalled = life.stalled() if ended in ("died", "running") and stall else None
  if stalled is not None:  # no step after it: that time is the stall's, not a step's
    stall_s = end - max(start, min(stalled, end))
    split = _split(life, start, end - stall_s, ended, later, stall=False)
    split["stall"] = stall_s
    return split
  last = life.last_counters()
  first = life.first("first_step")
  seconds: dict[str, Any] = {"data_wait": last.data_s, "checkpoint": last.ckpt_s,
                             "restore": last.restore_s}
  if first is None or first.t >= end:
    seconds["startup"] = max(0.0, (end - start) - last.blocked_s)
    step_s, first_t, first_c = 0.0, end, last
  else:
    first_t, first_c = max(first.t, start), first.counters or Counters()
    seconds["startup"] = max(0.0, (first_t - start) - first_c.blocked_s)
    step_s = _step_time(first_t, first_c, end, last)
  # Rounding (counters measured apart from the time stamps): the span stays whole.
  span = end - start
  step_s = max(0.0, min(step_s, span - sum(seconds.values())))
  seconds["startup"] = span - step_s - last.blocked_s
  rolled = _rolled_back(life, first_t, first_c, end)
  thrown = list(rolled)
  redone_from = None
  if ended != "finish" and (ended == "died" or later):
    kept = _kept_save(life, later)
    if kept is None:
      redone_from, from_c = first_t, first_c
    elif kept.t < end:
      redone_from, from_c = max(kept.t, first_t), kept.counters or first_c
    if redone_from is not None:
      thrown.append((redone_from, from_c, end, last))
  # Spans without steps that were what they were (a phase, slow work): never step time.
  blocked = life.blocked(start, end)
  gaps = _gaps(life, first_t, end)
  by_name: dict[str, float] = {}
  for a, b, kind, name in gaps:
    by_name[f"{kind}:{name}"] = by_name.get(f"{kind}:{name}", 0.0) + _unblocked(a, b, blocked)
  gap_s = min(step_s, sum(by_name.values()))
  thrown_gap = sum(_unblocked(max(a, ua), min(b, ub), blocked) for a, b, _, _ in gaps
                   for ua, ub in _union((x[0], x[2]) for x in thrown))
  redone = max(0.0, min(step_s - gap_s, _union_step_time(thrown) - thrown_gap))
  seconds["redone"] = redone
  seconds["stall"] = 0.0
  seconds["slow"] = by_name.pop("slow:slow", 0.0)
  seconds["_phases"] = {k.split(":", 1)[1]: v for k, v in by_name.items()}
  seconds["_gaps"] = tuple((a, b, kind) for a, b, kind, _ in gaps)
  seconds["phase"] = sum(seconds["_phases"].values())
  seconds["productive"] = max(0.0, step_s - gap_s - redone)
  seconds["_redone_from"] = redone_from
  seconds["_rolled_back"] = tuple((a, b) for a, _, b, _ in rolled if b > a)
  return seconds


_Span = tuple[float, Counters, float, Counters]  # (from, its counters, to, its counters)


def _gaps(life: _Life, begin: float, end: float) -> list[tuple[float, float, str, str]]:
  """The life's ``phase`` and ``slow`` spans as ``(from, to, kind, name)``, clipped to
  ``begin`` .. ``end`` (its first step .. its end) and to one another (in order of their
  start, each from the end of the one before at the earliest)."""
  out, reach = [], begin
  for e in sorted((e for e in life.events if e.kind in ("phase", "slow")),
                  key=lambda e: e.begin or e.t):
    a, b = max(e.begin or e.t, reach), min(e.t, end)
    if b > a:
      out.append((a, b, e.kind, e.name or "slow" if e.kind == "phase" else "slow"))
      reach = b
  return out


def _union(spans: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
  """``spans`` merged where they overlap."""
  out: list[tuple[float, float]] = []
  for a, b in sorted(spans):
    if out and a <= out[-1][1]:
      out[-1] = (out[-1][0], max(out[-1][1], b))
    elif b > a:
      out.append((a, b))
  return out


def _unblocked(a: float, b: float, blocked: Sequence[tuple[float, float, str]]) -> float:
  """Seconds of ``a`` .. ``b`` outside the ``blocked`` spans (``Life.blocked``)."""
  if b <= a:
    return 0.0
  return max(0.0, (b - a) - sum(max(0.0, min(b, y) - max(a, x)) for x, y, _ in blocked))


def _rolled_back(life: _Life, first_t: float, first_c: Counters, end: float) -> list[_Span]:
  """The spans whose step time each rollback threw away: from this life's save of the
  step it restored (its first step, where it saved no such step) to the rollback."""
  out = []
  for r in life.rollback_events():
    saved = next((e for e in reversed(life.saves()) if e.step == r.step and e.t <= r.t), None)
    start, start_c = ((max(saved.t, first_t), saved.counters or first_c) if saved is not None
                      else (first_t, first_c))
    out.append((start, start_c, min(r.t, end), r.counters or first_c))
  return out


def _union_step_time(spans: Sequence[_Span]) -> float:
  """The step time of the union of ``spans`` (overlapping ones counted once)."""
  total, current = 0.0, None
  for span in sorted(spans, key=lambda x: x[0]):
    if current is not None and span[0] <= current[2]:
      if span[2] > current[2]:
        current = (current[0], current[1], span[2], span[3])
      continue
    if current is not None:
      total += _step_time(*current)
    current = span
  return total + (_step_time(*current) if current is not None else 0.0)


def _kept_save(life: _Life, later: Sequence[_Life]) -> Event | None:
  """The save of ``life`` whose step the next life to go on resumed from: the first of
  ``later`` that restored a step or made a first step (one that died before either, a
  restart cut short, decided nothing). Without one: its last save, the step a restart
  would resume from. None where there is none (the next life started from scratch)."""
  saves = life.saves()
  after = next((x for x in later if x.resumed_from() is not None
                or x.first("first_step") is not None), None)
  if after is None:
    return saves[-1] if saves else None
  step = after.resumed_from()
  if step is None:
    return None
  return next((e for e in reversed(saves) if e.step == step), None)


def table(ledger: Ledger) -> str:
  """The ledger as ``sidecar goodput`` prints it: category, seconds, share of wall time."""
  wall = ledger.wall_s
  share = lambda s: f"{100 * s / wall:6.2f}%" if wall > 0 else "      -"
  rows = [("productive", ledger.productive_s)]
  for k, v in ledger.badput_s.items():
    rows.append((k, v))
    if k == "phase":  # what each phase was, by its name
      rows += [(f"  {name}", t) for name, t in sorted(ledger.phases.items())]
  lines = [f"{'category':<12} {'seconds':>12} {'share':>8}"]
  lines += [f"{name:<12} {s:12.3f} {share(s):>8}" for name, s in rows]
  lines.append(f"{'wall':<12} {wall:12.3f} {share(wall):>8}")
  lines.append(f"goodput {100 * ledger.goodput:.2f}%, {ledger.restarts} restart"
               f"{'' if ledger.restarts == 1 else 's'}, {len(ledger.lives)} process "
               f"li{'fe' if len(ledger.lives) == 1 else 'ves'}")
  if ledger.skipped_lines:
    lines.append(f"{ledger.skipped_lines} line{'' if ledger.skipped_lines == 1 else 's'} of "
                 "the file skipped: no event (torn by a killed sidecar, or not written by one)")
  return "\n".join(lines)
