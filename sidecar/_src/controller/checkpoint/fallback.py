"""Which step a restore returns when the one asked for is corrupt: an error that names the
older steps that are intact, or, where the user asks (``restore(..., fallback=True)``),
the newest step that restores whole, saying which were skipped and why.

A step is corrupt where a restore of it raises ``CorruptCheckpointError`` (a chunk that
fails its crc32c, metadata changed after the save, a manifest edited or gone, shards
with no valid copy left: ``ShardsLostError``). An older step is named intact where its
manifest and stored metadata check (the sidecar's Info: no byte of its shards is read);
``fallback=True`` then restores it for real, and goes on to the next older one if that
fails too. ``latest_step()`` stays the newest committed step whatever a restore found:
the user decides.

A restore starts from the step asked, or the latest committed (:func:`pick`). Under N
processes, process 0 lists the steps to try (:func:`steps_to_try`) and every process tries
each in turn, all agreeing after each try (``Peers.all_gather``) whether every process
restored it: a step corrupt in one process's shards is skipped by all.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable, Sequence
from typing import Any

from sidecar._src.controller.peers import Peers
from sidecar._src.core import errors

log = logging.getLogger(__name__)
# Older steps whose manifests a corrupt step's error checks (one Info each); past them,
# the error says how many more there are.
MAX_CHECKED = 8


@dataclasses.dataclass(frozen=True, slots=True)
class Skipped:
  """A step a fallback restore skipped, and why (the first line of its error)."""

  step: int
  reason: str


@dataclasses.dataclass(frozen=True, slots=True)
class Restored:
  """What a restore returned: the tree, its step, and the steps skipped on the way."""

  tree: Any
  step: int
  skipped: tuple[Skipped, ...] = ()


def pick(step: int | None, committed: Sequence[int], directory: str) -> int:
  """The step a restore of ``step`` (or its ``data_state``) starts from: ``step``, or the
  latest of ``committed`` (ascending) where None.

  Raises:
    InvalidArgumentError: ``step`` is not committed, or no step is.
  """
  if step is None:
    if not committed:
      raise errors.InvalidArgumentError(f"no committed step in {directory} to restore")
    return committed[-1]
  if step not in committed:
    raise errors.InvalidArgumentError(
        f"step {step} does not exist in {directory}; committed steps: "
        f"{list(committed) or 'none'}")
  return step


def steps_to_try(step: int, committed: Sequence[int], *, peers: Peers, key: str
                 ) -> list[int]:
  """The steps a restore of ``step`` tries (:func:`restore`): ``step``, then the older of
  ``committed``, newest first, as process 0 lists them (``key``: its broadcast)."""
  steps = [step, *sorted((s for s in committed if s < step), reverse=True)]
  if peers.count > 1:  # process 0 decides which steps; every process restores them
    steps = json.loads(peers.broadcast(key, json.dumps(steps) if peers.index == 0 else None))
  return steps


def restore(steps: Sequence[int], attempt: Callable[[int], Any], *, fallback: bool,
            intact: Callable[[int], bool], peers: Peers, key: str, directory: str
            ) -> Restored:
  """Restores the first of ``steps`` (newest first) that ``attempt`` restores; without
  ``fallback`` only the first, its CorruptCheckpointError naming the older ones that are
  ``intact``.

  Raises:
    CorruptCheckpointError: the step is corrupt (without ``fallback``), or every one is.
    SidecarError: another failure of a try (an arena full, a host lost, a target that does
      not fit), as it is: no fallback past what is not the step's fault.
  """
  skipped: list[Skipped] = []
  for i, step in enumerate(steps):
    error: BaseException | None
    try:
      tree, error = attempt(step), None
    except errors.CorruptCheckpointError as e:
      if not fallback:
        raise _named(e, step, steps[i + 1:], intact, directory) from None
      tree, error = None, e
    except errors.SidecarError as e:
      if not fallback or peers.count == 1:
        raise
      tree, error = None, e
    if fallback and peers.count > 1:
      error = _agreed(peers, f"{key}/{i}", step, error)
    if error is None:
      if skipped:
        log.warning("restored step %d of %s instead of step %s (fallback=True): %s", step,
                    directory, skipped[0].step,
                    "; ".join(f"step {s.step} skipped: {s.reason}" for s in skipped))
      return Restored(tree, step, tuple(skipped))
    if not isinstance(error, errors.CorruptCheckpointError):
      raise error
    del tree
    skipped.append(Skipped(step, str(error).splitlines()[0]))
  raise errors.CorruptCheckpointError(
      f"no committed step of {directory} restores whole: "
      + "; ".join(f"step {s.step}: {s.reason}" for s in skipped)
      + (". Restore from another copy of the checkpoints, or start anew" if skipped else
         f"no committed step in {directory} to restore"))


def _agreed(peers: Peers, key: str, step: int, error: BaseException | None
            ) -> BaseException | None:
  """Every process's outcome of its try of ``step``: None where all restored it; else this
  process's own error, or one naming the process that failed."""
  mine = "" if error is None else json.dumps(
      [isinstance(error, errors.CorruptCheckpointError), str(error).splitlines()[0]])
  outcomes = peers.all_gather(key, mine)
  if error is not None:
    return error
  failed = [(p, json.loads(o)) for p, o in enumerate(outcomes) if o]
  if not failed:
    return None
  p, (corrupt, text) = failed[0]
  cls = errors.CorruptCheckpointError if corrupt else errors.SidecarError
  return cls(f"process {p} could not restore step {step}: {text}")


def _named(e: errors.CorruptCheckpointError, step: int, older: Sequence[int],
           intact: Callable[[int], bool], directory: str) -> errors.CorruptCheckpointError:
  """``e`` (a corrupt ``step``'s), of its own kind, its message ending with the older steps
  that check intact and how to restore one."""
  checked = list(older[:MAX_CHECKED])
  good = [s for s in checked if _checks(intact, s)]
  more = len(older) - len(checked)
  if good:
    advice = (f"older committed steps that check intact: {good}"
              + (f" (and {more} older, not checked)" if more else "")
              + f"; restore one (restore({good[0]}, ...)), or pass fallback=True to restore "
              f"the newest that reads whole")
  elif older:
    advice = (f"no older committed step checks intact ({checked} do not"
              + (f"; {more} older, not checked" if more else "") + ")")
  else:
    advice = "it is the only committed step"
  return type(e)(f"{e}\nStep {step} of {directory} is not restored as saved: {advice}. "
                 f"latest_step() stays {step} (the newest committed)")


def _checks(intact: Callable[[int], bool], step: int) -> bool:
  try:
    return intact(step)
  except errors.SidecarError:
    return False
