"""The plugs of the one :class:`~sidecar._src.controller.checkpoint.checkpointer.Checkpointer`.

The Checkpointer owns what every framework's checkpoints share: the options, the steps
(``retention.Retention``), one save in flight and the processes' agreement on it
(``if_busy``), the :class:`~sidecar._src.controller.checkpoint.target.SaveHandle`,
``wait``, ``close``, the RAM tier's drop. Every save is one ``save_run.SaveRun`` (begin,
stage, the one finish, the end). What differs between frameworks is one small object, as
Orbax v1's ``training.Checkpointer`` holds its policies, made from a :class:`Setup`
(what it needs, handed over explicitly):

- the **agreement plug** (:class:`Agreement`): who drives a save's run, how the trainer
  processes agree on it (its ``save_run.Coordination``) and how leaves are described,
  copied and rebuilt. :class:`KeyValueAgreement` (JAX's, the numpy core's): the
  framework's shards (``controller/framework.Framework``), process 0 begins and commits,
  the processes agree through their key-value store (``save_run.KeyValue``), each
  stages its own shards from one finisher thread (``save.SaveCoordinator``).
  ``torch/checkpointer.DcpAgreement``: DCP's planner over the state dict, through
  ``dcp.async_save`` with ``torch/storage.StorageWriter``, whose hooks drive the run
  (``save_run.Coordinator``: DCP's own gather and scatter around ``prepare_global_plan``
  and ``finish``).

A plug answers by method (``mark_committed``, ``restore_from``: an Orbax manager's items,
which only the key-value plug saves), never by a type test.
"""

from __future__ import annotations

import abc
import dataclasses
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from sidecar._src.controller.checkpoint.options import CheckpointOptions
from sidecar._src.controller.checkpoint.restore import Restorer, RestoreStats
from sidecar._src.controller.checkpoint.save import SaveCoordinator
from sidecar._src.controller.checkpoint.save_run import Ending
from sidecar._src.controller.checkpoint.target import Target
from sidecar._src.core import errors, interrupts


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Setup:
  """What an agreement plug is made with, from its Checkpointer (nothing read back from
  the Checkpointer itself).

  Attributes:
    directory: the checkpoint directory (absolute).
    options: the checkpointer's options (the format's choice, replica bandwidth).
    replicas: replica copies per shard (as many as there are other hosts, at most);
      ``placement``: each host's replica hosts.
    steps: the committed steps, as the Checkpointer lists them now.
  """
  directory: str
  options: CheckpointOptions
  replicas: int
  placement: Mapping[int, Sequence[int]]
  steps: Callable[[], list[int]]


class Agreement(abc.ABC):
  """Who drives a step's phases on the sidecars, and how the processes agree (see the module)."""

  @abc.abstractmethod
  def target(self, directory: str, step: int) -> Target:
    """Where step ``step`` of ``directory`` goes, in the layout of the format it saves."""

  @abc.abstractmethod
  def start(self, target: Target, tree: Any, *, data_state_json: str, ending: Ending
            ) -> None:
    """Copies ``tree`` into the arenas (returns once this process's copy is made or on its
    way: ``ending.handle.staged`` resolves when staged) and writes ``target`` in the
    background, one ``save_run.SaveRun``, which a thread of the save (not the caller's)
    ends once (``SaveRun.end``) when the step is committed (and the RAM tiers told) or the
    save failed. ``ending.key``: the save's agreement keys' prefix."""

  def mark_committed(self, target: Target) -> None:
    """Tells the RAM tiers that ``target`` (an item another commits) is visible."""
    del target
    raise errors.InvalidArgumentError(
        "this checkpointer saves through DCP's coordinator: items of an Orbax manager "
        "need ctl.checkpointer")

  def restore_from(self, final_dir: str, step: int, target: Any, *,
                   progress: Callable[[str], None] | None = None) -> Any:
    """Restores the committed item at ``final_dir`` onto ``target``."""
    del final_dir, step, target, progress
    raise errors.InvalidArgumentError(
        "this checkpointer saves through DCP's coordinator: items of an Orbax manager "
        "need ctl.checkpointer")

  @abc.abstractmethod
  def restore(self, step: int, target: Any, *, progress: Callable[[str], None] | None
              ) -> Any:
    """Restores committed step ``step`` onto ``target``; returns the restored tree."""

  def last_restore_stats(self) -> Any:
    """Where the latest restore's shards came from (None: not known)."""
    return None

  def data_state(self, step: int) -> dict[str, Any] | None:
    """The data position saved with ``step``, or None."""
    del step
    return None

  @abc.abstractmethod
  def join(self) -> None:
    """Waits until every save it started has called its ``end`` (Ctrl-C stops the wait)."""


class KeyValueAgreement(Agreement):
  """JAX's and the numpy core's: ``save.SaveCoordinator`` stages this process's shards,
  process 0 begins and commits, the processes agree through their key-value store; a
  restore reads each shard from a live copy (``restore.Restorer``)."""

  def __init__(self, coordinator: SaveCoordinator, restorer: Restorer):
    self.coordinator, self._restorer = coordinator, restorer
    self._last: RestoreStats | None = None

  def target(self, directory: str, step: int) -> Target:
    """Step ``step`` of ``directory`` as Begin takes it, in the chosen format's layout."""
    return Target.for_step(self.coordinator.fmt, directory, step)

  def start(self, target: Target, tree: Any, *, data_state_json: str, ending: Ending
            ) -> None:
    self.coordinator.save_to(target, tree, data_state_json=data_state_json, ending=ending)

  def mark_committed(self, target: Target) -> None:
    self.coordinator.mark_committed(target)

  def restore(self, step: int, target: Any, *, progress: Callable[[str], None] | None
              ) -> Any:
    return self.restore_from(self.target(self.coordinator.directory, step).final_dir,
                             step, target, progress=progress)

  def restore_from(self, final_dir: str, step: int, target: Any, *,
                   progress: Callable[[str], None] | None = None) -> Any:
    tree, self._last = self._restorer.restore(final_dir, step, target, progress=progress)
    return tree

  def last_restore_stats(self) -> RestoreStats | None:
    return self._last

  def data_state(self, step: int) -> dict[str, Any] | None:
    c = self.coordinator
    return interrupts.wait(c.client.info(
        c.local[0], self.target(c.directory, step).final_dir)).data_state

  def join(self) -> None:
    for finisher in list(self.coordinator.finishers):
      if finisher is not threading.current_thread():
        while finisher.is_alive():  # a join Ctrl-C can stop
          finisher.join(interrupts.POLL_S)
          interrupts.check()
