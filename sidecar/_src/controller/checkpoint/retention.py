"""Retention for :class:`~sidecar._src.controller.checkpoint.checkpointer.Checkpointer`: the
committed steps, the deletion of those ``max_to_keep`` and ``keep_period`` no longer keep,
and a step set aside (``Checkpointer.set_aside``)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

from sidecar._src.controller.checkpoint.client import CheckpointTransport
from sidecar._src.core import errors

# The checkpointer's one logger, whichever of its modules logs.
log = logging.getLogger(__name__)


class Retention:
  """The committed steps of ``directory``, and their deletion.

  Args:
    client: the sidecars.
    directory: the checkpoint directory (absolute).
    local: the hosts this process stages into (their RAM tiers forget deleted steps).
    lead: whether this is process 0, which deletes the steps from storage.
    max_to_keep: how many of the latest steps to keep, or None: all.
    keep_period: keep also the steps divisible by it, or None.
    steps: the committed steps at open.
  """

  def __init__(self, *, client: CheckpointTransport, directory: str, local: Sequence[int],
               lead: bool, max_to_keep: int | None, keep_period: int | None,
               steps: list[int]):
    self._client, self.directory, self._lead = client, directory, lead
    self._local = list(local)
    self._max_to_keep, self._keep_period = max_to_keep, keep_period
    self._lock = threading.Lock()
    self._steps = list(steps)

  def all(self) -> list[int]:
    with self._lock:
      return list(self._steps)

  def rehost(self, local: Sequence[int]) -> None:
    """The hosts whose RAM tiers forget deleted steps are ``local`` from now on (the
    checkpointer follows the controller's live hosts)."""
    with self._lock:
      self._local = list(local)

  def add(self, step: int) -> None:
    """Lists a committed step."""
    with self._lock:
      self._steps = sorted(set(self._steps) | {step})

  def collect(self) -> None:
    """Deletes the steps ``max_to_keep`` and ``keep_period`` no longer keep."""
    if self._max_to_keep is None:
      return
    with self._lock:
      steps, local = list(self._steps), list(self._local)
    keep = set(steps[-self._max_to_keep:])
    if self._keep_period:
      keep |= {s for s in steps if s % self._keep_period == 0}
    for s in steps:
      if s in keep:
        continue
      with self._lock:  # unlisted first: a restore must not pick a step being deleted
        self._steps = [t for t in self._steps if t != s]
      try:  # out of the RAM tiers too (own shards and replicas), where a budget kept it
        for f in [self._client.forget(h, self.directory, s) for h in local]:
          f.result()
      except errors.SidecarError:
        pass  # a lost host's RAM tier is gone anyway
      if not self._lead:
        continue  # process 0 deletes it
      try:
        self._client.delete(local[0], self.directory, s).result()
      except errors.SidecarError as e:  # the step is durable all the same; retried next save
        log.warning("could not delete step %d of %s: %s", s, self.directory, str(e))
        with self._lock:
          self._steps = sorted(set(self._steps) | {s})
        return

  def set_aside(self, step: int) -> str:
    """Unlists committed ``step``, drops it from the RAM tiers of this process's hosts, and
    (process 0) has its sidecar move it out of the directory's steps; where it went
    (process 0's; "" in the others).

    Raises:
      InvalidArgumentError: ``step`` is not a committed step.
      SidecarError: the sidecar could not move it (listed again).
    """
    with self._lock:
      if step not in self._steps:
        raise errors.InvalidArgumentError(
            f"step {step} is not a committed step of {self.directory} (committed steps: "
            f"{self._steps or 'none'}); set_aside moves a committed step only")
      self._steps = [t for t in self._steps if t != step]
      local = list(self._local)
    try:  # its RAM-tier copies too, own and replicas: a save of its number comes next
      for f in [self._client.forget(h, self.directory, step) for h in local]:
        f.result()
    except errors.SidecarError:
      pass  # a lost host's RAM tier is gone anyway
    if not self._lead:
      return ""
    try:
      return self._client.delete(local[0], self.directory, step, set_aside=True).result()
    except BaseException:
      with self._lock:
        self._steps = sorted(set(self._steps) | {step})
      raise
