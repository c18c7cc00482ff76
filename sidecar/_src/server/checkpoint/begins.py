"""The saves begun on this sidecar, and which of them are in flight.

A Begin makes a step's uncommitted directory; from then on that save is *in flight* (no
other session begins its step, no open's sweep removes its directory) until it is
committed or aborted, while its trainer is there, as long as it stages. :class:`Begins`
records each Begin (:class:`Begun`) and answers, from them and the RAM tier's steps,
whether a save is in flight (``save.StepWriter.begin``, ``open``; the agreement's committer
asks whether a step it has no part of yet was begun here).
"""

from __future__ import annotations

import dataclasses
import pathlib
import threading
import time
from collections.abc import Callable

from sidecar._src.core import errors
from sidecar._src.server.checkpoint import ram_tier, write as write_lib
from sidecar._src.server.checkpoint.step import Takeover


@dataclasses.dataclass(frozen=True, slots=True)
class Begun:
  """A save that a Begin started here: in flight (no other session begins its step, no
  open's sweep removes its directory) until committed or aborted, while its trainer is
  there (``alive``: its worker is attached), as long as it stages (its first part within
  ``write.STAGE_TIMEOUT_S``, then until its step is written and committed)."""
  owner: str  # the handshake session that began it
  step: int
  tmp: pathlib.Path  # its uncommitted step directory (resolved)
  # Whether the trainer that began it is there; None: not known (no worker of it here),
  # and then only its staging in progress keeps it in flight (as before Begin was recorded).
  alive: Callable[[], bool] | None
  at: float = dataclasses.field(default_factory=time.monotonic)


class Begins:
  """The saves begun on one sidecar (``host_id``), by uncommitted step directory, beside
  its RAM ``tier``; one Begin at a time checks and records them (``_lock``, taken before
  the tier's), so two Begins of one step never both pass."""

  def __init__(self, host_id: int, *, tier: ram_tier.RamTier):
    self._host_id = host_id
    self._tier = tier
    self._begun: dict[pathlib.Path, Begun] = {}
    self._lock = threading.Lock()

  def reserve(self, directory: str, step: int, fmt: str, tmp: pathlib.Path, owner: str,
              alive: Callable[[], bool] | None) -> None:
    """Records a Begin of ``step`` by ``owner`` into ``tmp``, unless a save of it is in
    flight that it would break: PermissionDeniedError then."""
    with self._lock:
      self._refuse_busy(directory, step, fmt, tmp, owner)
      self._begun[tmp] = Begun(owner, step, tmp, alive)

  def unreserve(self, tmp: pathlib.Path, owner: str) -> None:
    """Forgets ``owner``'s Begin into ``tmp`` (its directory could not be made)."""
    with self._lock:
      if self._begun.get(tmp) is not None and self._begun[tmp].owner == owner:
        del self._begun[tmp]

  def _refuse_busy(self, directory: str, step: int, fmt: str, tmp: pathlib.Path,
                   owner: str) -> None:
    """PermissionDeniedError if a save of the step whose directory is ``tmp`` is in flight
    that a Begin by ``owner`` would break; forgets the begun saves that ended. The lock is
    held."""
    # This session's own save is in flight until committed or aborted (a second
    # checkpointer of the directory), once staged: before, its Begin again is a retry.
    # Another session's, from its Begin on, while its trainer is there (one that died
    # must not keep a relaunched job from saving the step), and while its commit runs
    # (whoever's: the directory made anew under it would be committed without its files).
    for gone in [b for b in self._begun.values() if not self._in_flight(b)]:
      del self._begun[gone.tmp]  # (forget_ended, under the lock this Begin holds)
    other = self._begun.get(tmp)
    busy = [s for s in self._tier.steps()
            if s.format == fmt and pathlib.Path(s.tmp_dir).is_relative_to(tmp)
            and (s.view().writing or s.commit_gate.under_way
                 or (owner in s.owners and s.view().awaits_commit))]
    another = "another session (another trainer process or Controller)"
    if other is not None and other.owner != owner:
      by = another
    elif busy:
      by = (another if owner not in busy[0].owners else
            "another checkpointer of this directory in the same process")
    else:
      return
    raise errors.PermissionDeniedError(
        f"begin: step {step} of {directory!r:.200} is being saved by {by} on host "
        f"{self._host_id}: another save of step {step} into this directory is in flight; "
        "wait for that save to end, or save each step from one checkpointer")

  def _in_flight(self, begun: Begun) -> bool:
    """Whether the save ``begun`` may still stage, write or commit: its trainer is there,
    and it staged within ``STAGE_TIMEOUT_S`` of its Begin and its step is not committed,
    failed nor dropped since (where its trainer is not known, while being written)."""
    mine = [s for s in self._tier.steps() if s.started >= begun.at and s.step == begun.step
            and pathlib.Path(s.tmp_dir).is_relative_to(begun.tmp)]
    if any(s.takeover is Takeover.PENDING for s in mine):  # committed here, trainer or not
      return True
    if begun.alive is not None and not begun.alive():
      return False
    if not mine:
      return time.monotonic() - begun.at < write_lib.STAGE_TIMEOUT_S
    return any(s.view().writing or (begun.alive is not None and s.view().awaits_commit)
               for s in mine)

  def forget_ended(self) -> None:
    """Forgets the begun saves that are no longer in flight (their trainers gone)."""
    with self._lock:
      for gone in [b for b in self._begun.values() if not self._in_flight(b)]:
        del self._begun[gone.tmp]

  def begun(self, tmp: pathlib.Path) -> Begun | None:
    """The Begin into the uncommitted directory ``tmp`` (resolved) here, if any."""
    with self._lock:
      return self._begun.get(tmp)

  def in_flight_at(self, tmp: pathlib.Path) -> bool:
    """Whether a save into ``tmp`` (resolved) is in flight here, whoever began it (an
    open's sweep leaves its directory whole): a Begin of it in flight, or a step held in
    it whose commit runs, or is still to come from its trainers while they are not known
    to be gone (one with no worker session here: until the step expires,
    ``RamTier.uncommitted_s``)."""
    with self._lock:
      begun = self._begun.get(tmp)
      if begun is not None and self._in_flight(begun):
        return True
    held = [s for s in self._tier.steps() if pathlib.Path(s.tmp_dir).is_relative_to(tmp)]
    return any(s.commit_gate.under_way or (s.view().awaits_commit and s.takeover is
                                           Takeover.NONE and s.trainers_alive() is not False)
               for s in held)

  def ended(self, path: pathlib.Path) -> None:
    """Forgets the begun saves of the uncommitted directory ``path`` is, or lies in or
    holds (a commit's or an abort's)."""
    with self._lock:
      for tmp in [t for t in self._begun if path.is_relative_to(t) or t.is_relative_to(path)]:
        del self._begun[tmp]
