"""``sidecar goodput`` during a run: the open gap of the life still running, as what it is.

The ledger's file ends with the last event a trainer sent (marks are coalesced: one every
10 s at most) or the sidecar wrote; what happened since is not in it. For a life that is
still running (no ``finish``, no ``died``), its sidecar knows the rest: ``Status.trainers``
has the trainer whose pid the life's name holds (``pid@start``), when its last step was,
whether it is stalled (past its stall timeout) and the long phase it announced. So
:func:`open_gap` asks the sidecars (the ADDR arguments, else the job's as
``Controller.from_env()`` finds them) and adds what the ledger would hold if the life ended
now, counted by the same rules (``core/accounting.py``):

- a hang in progress past its timeout: a mark now that says it is stalled since its last
  step, so the time since that step is ``stall`` (before its timeout it is step time, as
  the launcher's watchdog sees it);
- a long phase it announced (an evaluation): the phase's span to now, counted as that
  phase;
- otherwise: a mark now; the time since its last event is step time.

Each case is said in one line (to stderr: stdout stays the table or the JSON). A sidecar
that does not answer, or a trainer none lists, leaves the ledger as its file has it, and
that is said too.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

from sidecar._src.core import accounting, errors, goodput as goodput_lib


@dataclasses.dataclass(frozen=True, slots=True)
class Gap:
  """What :func:`open_gap` adds to the ledger's events, and the line that says so."""
  events: tuple[goodput_lib.Event, ...]
  said: str


def addresses(given: Sequence[str]) -> list[str]:
  """The sidecars to ask: ``given``, else the job's as ``Controller.from_env()`` finds them
  (none where the environment names none)."""
  if given:
    return list(given)
  from sidecar._src.controller import discovery  # the controller's, only where needed
  try:
    return [e.address for e in discovery.endpoints_from_env()]
  except errors.SidecarError:
    return []


def open_gap(events: Sequence[goodput_lib.Event], life: accounting.Life,
             trainers: Sequence[Any], *, now: float | None = None) -> Gap:
  """The events that count the time from ``life``'s last event to ``now`` (a running life
  of ``events``) as what it is, from ``trainers`` (``Status.trainers`` of its sidecars)."""
  now = time.time() if now is None else now
  pid = _pid(life.life)
  found = [t for t in trainers if pid is not None and t.pid == pid and t.pid_verified
           and not t.ended]
  since = now - life.end
  if not found:
    return Gap((), f"life {life.life} is still running, or its sidecar is gone: counted up "
                   f"to its last event, {since:.1f} s ago (name its sidecars' addresses, "
                   "sidecar goodput DIR ADDR..., to count the time since as what it is)")
  t = found[0]
  counters = next((e.counters for e in reversed(events)
                   if e.life == life.life and e.counters is not None), goodput_lib.Counters())
  mark: Callable[..., goodput_lib.Event] = lambda at, **kw: goodput_lib.Event(  # noqa: E731
      "mark", life.life, max(at, life.end), counters, **kw)
  if t.stalled and t.last_step_unix > 0:
    return Gap((mark(now, stalled=t.last_step_unix),),
               f"life {life.life} is stalled: no step for {t.since_step_s:.1f} s, past its "
               f"stall timeout of {t.stall_timeout_s:.1f} s: counted as stall since its "
               "last step")
  if t.phase:
    phase = goodput_lib.Event.from_dict({"kind": "phase", "life": life.life, "t": now,
                                         "begin": max(now - t.phase_s, life.start),
                                         "name": t.phase})
    return Gap((phase, mark(now)), f"life {life.life} is in phase {t.phase!r} for "
                                   f"{t.phase_s:.1f} s: counted as that phase")
  last = (f"its last step {t.since_step_s:.1f} s ago" if t.since_step_s >= 0 else
          "before its first completed step")
  limit = (f"its stall timeout {t.stall_timeout_s:.1f} s" if t.stall_timeout_s > 0
           else "no stall timeout")
  return Gap((mark(now),), f"life {life.life} is running, {last} ({limit}): counted to now")


def _pid(life: str) -> int | None:
  """The pid a life's name holds (``pid@start``), None where it holds none."""
  head = life.split("@", 1)[0]
  return int(head) if head.isdigit() else None


def fetch_trainers(addresses_: Sequence[str], *, timeout: float, token: str | None
                   ) -> tuple[list[Any], list[str]]:
  """Every sidecar's ``Status.trainers``, and a line for each that did not answer."""
  from sidecar._src.controller import status as status_lib  # gRPC, only where needed
  trainers: list[Any] = []
  missing = []
  for address in addresses_:
    try:
      trainers += list(status_lib.fetch(address, timeout=timeout, token=token).trainers)
    except Exception as e:  # noqa: BLE001 - any failure: that sidecar says nothing
      missing.append(f"the sidecar at {address} did not answer ({type(e).__name__}: "
                     f"{str(e).splitlines()[0] if str(e) else ''})")
  return trainers, missing
