"""A job's time ledger: the events that make it, its file, and the accounting.

Goodput is the share of a job's wall-clock time spent on steps that count. The trainer
process that records (process 0) counts its own time as it goes (``controller/goodput.py``:
data wait, checkpoint, restore, batches taken), and its host's sidecar, which outlives it,
appends what it sends to :data:`FILE` in the job's checkpoint directory, and a ``died``
event when the process's worker session ends without a ``finish``
(``server/goodput/ledgers.py``). :func:`account` turns the events into the ledger.

Every event is one JSON object, one line of the file::

  {"kind": "save", "life": "4242@1700000000.12", "t": 1700000012.5, "step": 10,
   "batches": 11, "data_s": 0.4, "ckpt_s": 0.1, "restore_s": 0.0}

- ``life``: the process life it belongs to (``pid@start``); ``t``: when (Unix seconds).
- The counters (``batches``, ``data_s``, ``ckpt_s``, ``restore_s``) are cumulative over
  the life, so a lost or late event loses nothing but its own time stamp.
- ``kind``: ``start`` (``start``: when the process began, from ``/proc``), ``first_step``
  (the first step is done: the second batch taken, or the first save), ``restore``
  (``step``: the step it resumed from; one after the first step is a rollback inside the
  process, ``sidecar.jax.Recovery``'s), ``save`` (``step``, when ``save()`` returned),
  ``mark`` (the counters now), ``finish`` (``Controller.close()``), ``died`` (written by
  the sidecar: the worker session ended without a finish; ``seen``: the last time the
  sidecar heard from that process, a frame or a feed credit: a SIGKILLed process's
  session ends only once its exit is done, seconds later on an accelerator;
  ``stalled``: where the sidecar found the process stalled, the time of its last step:
  ``sidecar launch --stall-timeout`` killed it, server/goodput/steps.py), ``phase``
  (written by the sidecar: a long phase the trainer announced, ``name``, ran from ``begin``
  to ``t``: an evaluation, a large restore) and ``slow`` (written by the sidecar: no step
  from ``begin`` to ``t``, longer than the stall timeout, and then a step: the trainer
  worked, or waited for one that did; a hung one is killed, and its time is ``stall``).

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
  :func:`open_gap`), its last step .. now;
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
import json
import math
import os
from collections.abc import Iterable, Sequence
from typing import Any

FILE = "goodput.jsonl"  # in the job's checkpoint directory (the first checkpointer's)
KINDS = ("start", "first_step", "restore", "save", "mark", "finish", "died", "phase", "slow")
SIDECARS = ("died", "phase", "slow")  # the kinds only a sidecar writes, never a trainer
CATEGORIES = ("startup", "data_wait", "checkpoint", "restore", "redone", "stall", "slow",
              "phase", "restart_gap")
COUNTERS = ("batches", "data_s", "ckpt_s", "restore_s")
MAX_LINE = 4096  # bytes of one event's JSON: bigger ones are refused
MAX_LIFE = 200  # characters of a life's name
MAX_INT = 2**63  # steps, pids and counters are below it
MAX_NAME = 64  # characters of a phase's name (core/stall.MAX_NAME)


@dataclasses.dataclass(frozen=True, slots=True)
class Counters:
  """What a life counted since it began: batches taken and seconds blocked."""
  batches: int = 0
  data_s: float = 0.0
  ckpt_s: float = 0.0
  restore_s: float = 0.0

  @property
  def blocked_s(self) -> float:
    """Seconds counted in the three blocked categories."""
    return self.data_s + self.ckpt_s + self.restore_s

  def minus(self, other: Counters) -> Counters:
    return Counters(self.batches - other.batches, self.data_s - other.data_s,
                    self.ckpt_s - other.ckpt_s, self.restore_s - other.restore_s)


@dataclasses.dataclass(frozen=True, slots=True)
class Event:
  """One line of the ledger; see the module docstring for its kinds."""
  kind: str
  life: str
  t: float
  counters: Counters | None = None  # None: a died event (the sidecar knows no counters)
  step: int | None = None  # restore, save
  start: float | None = None  # start: when the process began
  pid: int | None = None  # start
  seen: float | None = None  # died: the last time the sidecar heard from the process
  stalled: float | None = None  # died: its last step, where it died stalled
  begin: float | None = None  # phase, slow: when the span began (``t``: its end)
  name: str | None = None  # phase: the phase's name (core/stall.Phase's)

  def __post_init__(self):
    if self.kind not in KINDS:
      raise ValueError(f"event kind must be one of {', '.join(KINDS)}, got "
                       f"{_short(self.kind)}")
    if not isinstance(self.life, str) or not 0 < len(self.life) <= MAX_LIFE:
      raise ValueError(f"an event's life must be a name of 1 to {MAX_LIFE} characters, got "
                       f"{_short(self.life)}")
    for name in ("t", "start", "seen", "stalled", "begin"):
      value = getattr(self, name)
      if value is not None and not _seconds(value):
        raise ValueError(f"an event's {name} must be finite seconds, got {_short(value)}")
    for name in ("step", "pid"):
      value = getattr(self, name)
      if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                or not 0 <= value < MAX_INT):
        raise ValueError(f"an event's {name} must be an int in [0, 2**63), got "
                         f"{_short(value)}")
    if self.kind == "start" and self.start is None:
      raise ValueError("a start event needs the process's start time")
    if self.kind in ("phase", "slow") and (self.begin is None or self.begin > self.t):
      raise ValueError(f"a {self.kind} event needs its begin, at or before its t")
    if self.name is not None and (not isinstance(self.name, str)
                                  or not 0 < len(self.name) <= MAX_NAME):
      raise ValueError(f"an event's name must be 1 to {MAX_NAME} characters, got "
                       f"{_short(self.name)}")
    if self.kind == "phase" and self.name is None:
      raise ValueError("a phase event needs the phase's name")

  def to_dict(self) -> dict[str, Any]:
    out: dict[str, Any] = {"kind": self.kind, "life": self.life, "t": self.t}
    if self.counters is not None:
      out.update(dataclasses.asdict(self.counters))
    for name in ("step", "start", "pid", "seen", "stalled", "begin", "name"):
      if (value := getattr(self, name)) is not None:
        out[name] = value
    return out

  @classmethod
  def from_dict(cls, d: Any) -> Event:
    """The event ``d`` holds (a dict read from JSON).

    Raises:
      ValueError: ``d`` is no event (a field missing, of the wrong type or out of range).
    """
    if not isinstance(d, dict):
      raise ValueError(f"an event is a JSON object, got {_short(d)}")
    counters = None
    if any(k in d for k in COUNTERS):
      values = [d.get(k, 0) for k in COUNTERS]
      if not all(_seconds(v) and 0 <= v < MAX_INT for v in values):
        raise ValueError(f"an event's counters must be numbers >= 0, got {_short(values)}")
      counters = Counters(int(values[0]), *map(float, values[1:]))
    try:
      # Any value: __post_init__ checks each field's type and says what was wrong.
      return cls(kind=d.get("kind"), life=d.get("life"), t=d.get("t"),  # type: ignore[arg-type]
                 counters=counters, step=d.get("step"), start=d.get("start"), pid=d.get("pid"),
                 seen=d.get("seen"), stalled=d.get("stalled"), begin=d.get("begin"),
                 name=d.get("name"))
    except TypeError as e:
      raise ValueError(f"malformed event {_short(d)}: {e}") from None

  def line(self) -> bytes:
    """This event as one line of the file."""
    return json.dumps(self.to_dict(), separators=(",", ":")).encode() + b"\n"


def path_in(directory: str) -> str:
  """The ledger's file in the checkpoint directory ``directory``."""
  return os.path.join(directory, FILE)


def _seconds(value: Any) -> bool:
  """Whether ``value`` is a finite number (never raising: an int of 400 digits is not)."""
  if not isinstance(value, (int, float)) or isinstance(value, bool):
    return False
  try:
    return math.isfinite(value)
  except OverflowError:
    return False


def _short(value: Any) -> str:
  """``value``'s repr, cut short, for an error message (never raising: a 400-digit int
  passes Python's limit on int-to-string conversion)."""
  try:
    return f"{value!r:.100}"
  except (ValueError, RecursionError):
    return f"<a {type(value).__name__} too big to show>"


def _no_constant(name: str) -> Any:
  raise ValueError(f"{name} is no number of seconds")


def parse_line(raw: bytes) -> Event:
  """The event on one line of the file.

  Raises:
    ValueError: the line is no event: not JSON, too long, NaN or infinity, a value out
      of range, nested too deep. Never anything else, whatever the bytes.
  """
  if len(raw) > MAX_LINE + 1:
    raise ValueError(f"a line of {len(raw)} bytes, more than an event's {MAX_LINE}")
  try:
    return Event.from_dict(json.loads(raw, parse_constant=_no_constant))
  except (ValueError, TypeError, OverflowError, RecursionError, UnicodeDecodeError) as e:
    raise ValueError(f"no event: {type(e).__name__}: {e}"[:200]) from None


@dataclasses.dataclass(frozen=True, slots=True)
class Reading:
  """What :func:`read_all` found: the events, and how many lines were not events."""
  events: tuple[Event, ...]
  skipped: int


def read_all(directory: str) -> Reading:
  """The events of the ledger in ``directory``, skipping (and counting) every line that
  is no event: a torn last line of a sidecar killed mid-append, or anything a hostile or
  broken writer left. A blank line is no line.

  Raises:
    FileNotFoundError: no ledger there (OSError: it cannot be read).
  """
  events, skipped = [], 0
  with open(path_in(directory), "rb") as f:
    while raw := f.readline(MAX_LINE + 2):
      if len(raw) > MAX_LINE + 1 and not raw.endswith(b"\n"):
        while (more := f.readline(1 << 16)) and not more.endswith(b"\n"):
          pass  # the rest of a line too long to be an event, read in bounded pieces
        skipped += 1
        continue
      if not raw.strip():
        continue
      try:
        events.append(parse_line(raw))
      except ValueError:
        skipped += 1
  return Reading(tuple(events), skipped)


def read(directory: str) -> list[Event]:
  """The events of the ledger in ``directory`` (:func:`read_all`'s, without the count).

  Raises:
    FileNotFoundError: no ledger there.
  """
  return list(read_all(directory).events)


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
  skipped_lines: int = 0  # lines of the file that were no event (read_all)
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


def check_events(items: Sequence[Any], *, limit: int) -> list[Event]:
  """The events in ``items`` (dicts from a request), at most ``limit`` of them.

  Raises:
    ValueError: too many, or one is no event or is too big.
  """
  if not isinstance(items, list) or len(items) > limit:
    raise ValueError(f"events must be a list of at most {limit}, got {type(items).__name__} "
                     f"of {len(items) if isinstance(items, list) else '?'}")
  events = [Event.from_dict(d) for d in items]
  for e in events:
    if e.kind in SIDECARS:
      raise ValueError(f"a {e.kind} event is the sidecar's to write, never a trainer's")
    if e.stalled is not None:
      raise ValueError("an event's stalled is the sidecar's to say, never a trainer's")
    if len(e.line()) > MAX_LINE:
      raise ValueError(f"an event's line must be at most {MAX_LINE} bytes")
  return events
