"""The stall rule: how long a trainer may go without a step before it counts as hung.

One rule for every place that watches (the sidecar's ``server/goodput/steps.py``, which applies it
to each worker session; ``sidecar launch --stall-timeout`` and ``sidecar serve
--stall-timeout``, which set its floor; docs/elastic.md): a trainer's clock starts at its
**first completed step**, which its Controller tells its sidecar (:data:`STARTUP` ends:
the trainer's thread took its feed's second batch, or its second ``save()`` returned), so
its start (imports, a restore, the first ``jit`` compile, a first save) is never watched:
a feed's first batch is taken *before* the compile. From then on it is **stalled** once it
has made no step for :func:`timeout` seconds, the larger of the floor and :data:`MULTIPLE`
times the slowest step seen since. A slow step seen once (a save, a recompile) so never
trips it later; a gap past the timeout that ended in a step (slow work the watchdog let
run: below) is no step, and raises nothing. A floor of 0 turns it off.

A trainer may announce a long phase (an evaluation, a large restore: :class:`Phase`, sent by
``Worker.phase``): while it lasts, the trainer is stalled only after no step for the larger
of its timeout and the phase's budget (at most :data:`MAX_BUDGET_S`), counted from the
phase's start; its start and its end count as steps, and its length never enters the
slowest step. A trainer whose Controller closes is in :data:`CLOSE` (the saves it waits
for, its exit) until its session ends.

**Busy is not hung** (:func:`judge`). A stalled trainer whose processes burn CPU
(``core/busy.py``) is **slow**: it is reported (its stacks, and the fix: declare the phase,
or raise the timeout) and left to work until it has made no step for :data:`SLOW_MULTIPLE`
times its timeout. One that burns nothing while another trainer of its job works (burns
CPU, or is in a phase it announced) is **waiting** for it, under the same bound: on several
hosts, a recompile, a restore or an evaluation on one keeps the others in a collective. One
that burns nothing while none works is **hung**: stopped at its timeout. Past the bound a
slow or waiting trainer is hung too (a busy loop that never steps is a livelock), and one
whose work cannot be read is taken as hung, as before this rule.

An attempt of ``sidecar.elastic.retry`` starts as a trainer does (a restore on the hosts
left, a new mesh, its first step's recompile): each attempt is the phase :data:`ATTEMPT`
with a budget of :data:`ATTEMPT_BUDGET_S` until its first completed step (its feed's second
batch; a trainer with no feed of ours, its second save returned in the attempt: its saves are
its only steps, and a first one may precede the recompile). Its first startup is never
timed; an attempt's is, but with an hour, so that a compile at scale (minutes to tens of
minutes) is never a stall and a restore that hangs is still found.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Any

DEFAULT_FLOOR_S = 120.0  # sidecar launch's and sidecar serve's --stall-timeout
MULTIPLE = 10.0  # a stall lasts at least this many times the slowest step seen
SLOW_MULTIPLE = 5.0  # a slow (working) or waiting trainer is stopped past this x its timeout
EXIT_CODE = 124  # sidecar launch's exit code for a stall it may not restart (as timeout(1))
MAX_BUDGET_S = 24 * 3600.0  # the longest budget a phase may ask for
MAX_NAME = 64  # characters of a phase's name
STARTUP = "startup"  # the phase every trainer begins in: until its first completed step
CLOSE = "close"  # the phase a trainer ends in: its Controller closes (its saves waited for)
OP = "phase"  # the worker socket's frame (``server/workers/workers.py``)
ATTEMPT = "elastic-attempt"  # sidecar.elastic.retry's attempt, until its first step
ATTEMPT_BUDGET_S = 3600.0  # its budget: a restore and a recompile at scale, with room

RULE = (f"no step (a feed's batches taken, a save) for the larger of SECONDS and "
        f"{MULTIPLE:g}x the slowest step seen, counted from its first completed step "
        f"(a long phase it announces: its own budget)")


def timeout(floor_s: float, slowest_s: float) -> float:
  """Seconds without a step after which a trainer is stalled (0: never)."""
  return 0.0 if floor_s <= 0 else max(floor_s, MULTIPLE * slowest_s)


class Verdict(enum.Enum):
  """What a trainer that made no step for its timeout is (see the module docstring)."""
  SLOW = "slow"  # it works (burns CPU): reported, left to work until the bound
  WAITING = "waiting"  # idle while another trainer of its start works: the same bound
  HUNG = "hung"  # idle while none works, past the bound, or its work cannot be read


def judge(since_s: float, timeout_s: float, *, busy: bool | None, others_work: bool
          ) -> Verdict:
  """The verdict on a trainer without a step for ``since_s`` seconds, past its
  ``timeout_s``: ``busy``, whether its own processes work (None: not known);
  ``others_work``, whether another trainer of its start does (burns CPU, or is in an
  announced phase)."""
  if busy is None or since_s > SLOW_MULTIPLE * timeout_s:
    return Verdict.HUNG
  if busy:
    return Verdict.SLOW
  return Verdict.WAITING if others_work else Verdict.HUNG


def check_floor(value: float) -> float:
  """``value`` as a floor, checked.

  Raises:
    ValueError: not finite seconds >= 0.
  """
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
      0 <= value < float("inf")):
    raise ValueError(f"the stall timeout must be seconds >= 0 (0: off), got {value!r}")
  return float(value)


@dataclasses.dataclass(frozen=True, slots=True)
class Phase:
  """A trainer's word to its sidecar's stall rule: phase ``name`` begins, and may take
  ``budget_s`` seconds without a step; or it ends (``budget_s`` None). :data:`STARTUP`
  only ends (the trainer's first step completed).

  Raises:
    ValueError: a name that is not 1..MAX_NAME printable characters, a budget that is not
      seconds in (0, MAX_BUDGET_S], or a start of STARTUP.
  """
  name: str
  budget_s: float | None = None  # None: the phase ends

  def __post_init__(self):
    if not isinstance(self.name, str) or not 0 < len(self.name) <= MAX_NAME or (
        not self.name.isprintable()):
      raise ValueError(f"a phase's name must be 1 to {MAX_NAME} printable characters, "
                       f"got {self.name!r:.80}")
    b = self.budget_s
    if b is not None and (isinstance(b, bool) or not isinstance(b, (int, float))
                          or not 0 < b <= MAX_BUDGET_S or math.isnan(b)):
      raise ValueError(f"phase {self.name!r}'s budget must be seconds in (0, "
                       f"{MAX_BUDGET_S:g}], got {b!r:.40}; a longer phase is a hang to "
                       "the watchdog, or give sidecar launch a larger --stall-timeout")
    if b is not None and self.name == STARTUP:
      raise ValueError(f"{STARTUP!r} is the phase every trainer begins in; name yours "
                       "otherwise")

  @property
  def ends(self) -> bool:
    return self.budget_s is None

  def to_dict(self) -> dict[str, Any]:
    return {"op": OP, "name": self.name, "budget_s": self.budget_s}

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> Phase:
    """The frame ``d``, checked (ValueError as the constructor's)."""
    return cls(d.get("name"), d.get("budget_s"))  # type: ignore[arg-type]
