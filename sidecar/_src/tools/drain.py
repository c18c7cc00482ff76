"""Before a launch stops its sidecars: the steps they accepted are written first.

A step staged in a sidecar is the sidecar's to write, and to commit once its trainers'
last Stage took it over (``server/checkpoint/agreement.py``: the sidecars commit it among
themselves), whether or not its trainers are still there. So once the trainers are
stopped (a signal to the launcher, every trainer ended, a failure with no restarts left),
``sidecar launch`` asks each live sidecar which steps it is still writing or committing
(:func:`poll`, the Status RPC) and waits for them (:func:`wait`), for at most a grace it
prints; a signal during the wait (a Ctrl-C) ends it at once. Whatever is not written by
then is named once the sidecars have stopped (:func:`settle`): a sidecar given its stop's
grace may still commit it, so the launcher looks in the checkpoint directory and says
what became of it (committed, or abandoned and not committed); a step written but never
committed (its trainers went before they committed it) is named as abandoned. A job that
ended with a failure or a signal is told how to resume: "re-run the same command to
resume from step N", N the newest step committed in its directory (:func:`resume_from`).

:func:`poll` is the one place that reads what a sidecar holds, in the sidecar's own words
for a step (``server/checkpoint/lifecycle.py``'s table, read backwards from the Status lists
a step is in: ``lifecycle.drain_of``): the steps it took over and has not yet seen committed or
abandoned (``CheckpointStatus.committing``) are waited for as :data:`WRITING`.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import time
from collections.abc import Callable, Collection, Mapping

from sidecar._src.core import errors
from sidecar._src.server.checkpoint import lifecycle

WRITING = lifecycle.Word.WRITING  # staged there, still being written, or taken over, not committed
UNCOMMITTED = lifecycle.Word.UNCOMMITTED  # written there, its commit never came
COMMITTED = lifecycle.Word.COMMITTED  # in its RAM tier, committed
POLL_S = 0.1
SETTLE_S = 1.0
STATUS_TIMEOUT_S = 5.0


@dataclasses.dataclass(frozen=True, slots=True, order=True)
class SidecarStep:
  """Step ``step`` of checkpoint directory ``directory`` on host ``host``'s sidecar."""
  step: int
  host: int
  directory: str


Poll = Callable[[int, str, float], "dict[SidecarStep, str]"]


@dataclasses.dataclass(frozen=True, slots=True)
class Drained:
  """How a wait ended: the steps ``abandoned`` (said), those still being written when it
  ended (``pending``, because of ``why``: :func:`settle` says what became of them once
  the sidecars stopped), and the checkpoint directories the sidecars hold steps of."""
  abandoned: tuple[SidecarStep, ...] = ()
  pending: tuple[SidecarStep, ...] = ()
  why: str = ""
  directories: frozenset[str] = frozenset()


def on_disk(step: SidecarStep) -> bool:
  """Whether ``step`` is committed in its directory (as a restore would find it)."""
  # The formats load numpy: here, when a launch ends, not when `sidecar --help` starts.
  from sidecar._src.ckptfmt import registry as formats_lib
  return formats_lib.is_checkpoint(pathlib.Path(step.directory) / str(step.step))


def poll(host: int, address: str, timeout: float, *, token: str | None = None
         ) -> dict[SidecarStep, str]:
  """The steps host ``host``'s sidecar at ``address`` holds that a stop concerns, each
  with its state (:data:`WRITING`, :data:`UNCOMMITTED`, :data:`COMMITTED`).

  Raises:
    SidecarError: it did not answer within ``timeout`` seconds.
  """
  # gRPC loads here, when a launch ends, not when `sidecar --help` imports the launcher.
  from sidecar._src.controller import status as status_lib
  lists: dict[SidecarStep, set[str]] = {}
  for c in status_lib.fetch(address, timeout=timeout, token=token).checkpoints:
    for name in lifecycle.Listed:
      for s in getattr(c, name):
        lists.setdefault(SidecarStep(int(s), host, c.directory), set()).add(name)
  return {s: lifecycle.drain_of(frozenset(names)) for s, names in lists.items()}


def wait(sidecars: Mapping[int, str], *, grace: float, say: Callable[[str], None],
         interrupted: Callable[[], str | None], poll: Poll) -> Drained:
  """Waits up to ``grace`` seconds for the steps ``sidecars`` (``{host: address}``, the live
  ones) are writing; returns the steps abandoned (on a sidecar that stopped answering, or
  not committed) and those still being written when the time ran out or a signal came
  (``interrupted`` names one, else None; the wait then ends at once). Says what it waits
  for and how the steps ended."""
  t0 = time.monotonic()
  deadline = t0 + grace
  live = dict(sidecars)
  states = _poll_all(live, poll, deadline, say)
  directories = frozenset(s.directory for s in states)
  waited = sorted(s for s, state in states.items() if state == WRITING)
  why = None
  if waited:
    say(f"waiting up to {grace:g} s for {_steps(waited)} to be written (Ctrl-C to stop "
        f"now, abandoning {'them' if len(waited) > 1 else 'it'})")
  settled = None
  while waited:
    if not any(states.get(s) == WRITING for s in waited):
      # A sidecar that commits a step itself shows it uncommitted between its write's end
      # and its commit's: a moment more before calling it abandoned.
      settled = settled or time.monotonic() + SETTLE_S
      if time.monotonic() >= settled or not any(states.get(s) == UNCOMMITTED for s in waited):
        break
    signal = interrupted()
    if signal or time.monotonic() >= deadline:
      why = f"got {signal} while waiting" if signal else f"still being written after {grace:g} s"
      break
    time.sleep(POLL_S)
    states = _poll_all(live, poll, deadline, say)
  still, abandoned = _outcome(waited, states, live, why, time.monotonic() - t0, say)
  return Drained(tuple(abandoned), tuple(still), why or "", directories)


def settle(drained: Drained, say: Callable[[str], None],
           committed: Callable[[SidecarStep], bool] = on_disk) -> list[SidecarStep]:
  """Once the sidecars stopped: says what became of the steps still being written when
  the wait ended, as their directory shows (``committed``); returns those abandoned."""
  done = [s for s in drained.pending if committed(s)]
  lost = [s for s in drained.pending if s not in done]
  if done:
    say(f"{drained.why}: {_steps(done)} committed as the sidecars stopped")
  if lost:
    say(f"{drained.why}: abandoned {_steps(lost)} (not committed)")
  return sorted({*drained.abandoned, *lost})


def after_stop(drained: Drained, code: int, say: Callable[[str], None], *,
               seen: Collection[str] = (), fails_again: bool = False) -> None:
  """Once the sidecars of a job that ended with ``code`` stopped: what became of the
  steps they were still writing (:func:`settle`), and, where it did not end well, the
  step a re-run of the same command resumes from (:func:`resume_from`, in the
  directories they held then and those ``seen`` while the job ran: a sidecar that died
  said nothing at the end). ``fails_again``: the job ended because a restart would fail
  the same way; a re-run would too, until what failed is fixed."""
  settle(drained, say)
  if not code or (step := resume_from({*drained.directories, *seen})) is None:
    return
  if fails_again:
    say(f"once what failed is fixed, re-run the same command to resume from step {step} "
        "(as it is, it would fail the same way again)")
  else:
    say(f"re-run the same command to resume from step {step}")


def resume_from(directories: Collection[str]) -> int | None:
  """The newest step committed in any of ``directories`` (None: none)."""
  from sidecar._src.ckptfmt import registry as formats_lib  # numpy, as on_disk()
  steps = []
  for directory in directories:
    try:
      names = os.listdir(directory)
    except OSError:
      continue
    steps += [int(n) for n in names if n.isdigit()
              and formats_lib.is_checkpoint(pathlib.Path(directory) / n)]
  return max(steps, default=None)


def _poll_all(live: dict[int, str], poll: Poll, deadline: float, say: Callable[[str], None]
              ) -> dict[SidecarStep, str]:
  """Every live sidecar's steps; one that does not answer is said and dropped from ``live``."""
  states: dict[SidecarStep, str] = {}
  for host, address in list(live.items()):
    try:
      states |= poll(host, address, max(min(STATUS_TIMEOUT_S, deadline - time.monotonic()), 1.0))
    except errors.SidecarError as e:
      say(f"host {host}'s sidecar did not say which steps it is writing: {e}")
      del live[host]
  return states


def _outcome(waited: list[SidecarStep], states: dict[SidecarStep, str], live: Mapping[int, str],
             why: str | None, seconds: float, say: Callable[[str], None]
             ) -> tuple[list[SidecarStep], list[SidecarStep]]:
  """Says how the steps ended; returns those still being written, and those abandoned."""
  still = [s for s in waited if states.get(s) == WRITING]
  if still:
    say(f"{why}: {_steps(still)} still being written; the sidecars stop now, then what "
        f"became of {'them' if len(still) > 1 else 'it'} is said")
  committed = [s for s in waited if states.get(s) == COMMITTED]
  if committed:
    say(f"{_steps(committed)} written and committed {seconds:.1f} s after the trainers stopped")
  lost = [s for s in waited if s.host not in live]
  if lost:
    say(f"abandoned {_steps(lost)}: its sidecar stopped answering")
  # A failed write leaves its step uncommitted (or gone, where its trainer was): Status
  # does not tell the two apart.
  failed = sorted({*(s for s, state in states.items() if state == UNCOMMITTED),
                   *(s for s in waited if s.host in live and s not in states)})
  if failed:
    say(f"abandoned {_steps(failed)}: not committed (no trainer is left to commit it, or "
        "its write failed: the sidecar's log says which)")
  return still, sorted({*lost, *failed})


def _steps(steps: list[SidecarStep]) -> str:
  """``step 200 on host 0``, ``steps 200, 300 on hosts 0, 1``: a directory named only
  where there are several."""
  by_step: dict[tuple[str, int], list[int]] = {}
  for s in sorted(steps):
    by_step.setdefault((s.directory, s.step), []).append(s.host)
  several = len({d for d, _ in by_step}) > 1
  parts = []
  for (directory, step), hosts in by_step.items():
    where = f"host{'s' * (len(hosts) > 1)} {', '.join(map(str, hosts))}"
    parts.append(f"step {step}" + (f" of {directory}" if several else "") + f" on {where}")
  return "; ".join(parts)
