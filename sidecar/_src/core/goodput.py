"""A job's time ledger: the events that make it, their checks, and its file.

Goodput is the share of a job's wall-clock time spent on steps that count. The trainer
process that records (process 0) counts its own time as it goes (``controller/goodput.py``:
data wait, checkpoint, restore, batches taken), and its host's sidecar, which outlives it,
appends what it sends to :data:`FILE` in the job's checkpoint directory, and a ``died``
event when the process's worker session ends without a ``finish``
(``server/goodput/ledgers.py``). ``core/accounting.py`` turns the events into the ledger:
productive time and badput by category.

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
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Sequence
from typing import Any

FILE = "goodput.jsonl"  # in the job's checkpoint directory (the first checkpointer's)
KINDS = ("start", "first_step", "restore", "save", "mark", "finish", "died", "phase", "slow")
SIDECARS = ("died", "phase", "slow")  # the kinds only a sidecar writes, never a trainer
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
