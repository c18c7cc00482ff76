"""The plugs of the one :class:`~sidecar._src.controller.checkpoint.checkpointer.Checkpointer`.

The Checkpointer owns what every framework's checkpoints share: the options, the steps
(``retention.Retention``), one save in flight and the processes' agreement on it
(``if_busy``), the :class:`~sidecar._src.controller.checkpoint.target.SaveHandle`, the end
of a save (``save_protocol.end_save``: listed, ``durable``, old steps deleted, then
``replicated``), ``wait``, ``close``, the RAM tier's drop. Two small objects hold what
differs, as Orbax v1's ``training.Checkpointer`` holds its policies:

- the **agreement plug** (:class:`Agreement`): who drives a save's phases
  (``save_protocol.SaveProtocol``) and how the trainer processes agree between them.
  :class:`KeyValueAgreement` (JAX's, the numpy core's): process 0 begins and commits, the
  processes agree through their key-value store (``controller/peers.Peers``), each
  stages its own shards (``save.SaveCoordinator``). ``torch/checkpointer.DcpAgreement``:
  DCP's coordinator rank, through ``dcp.async_save`` with ``torch/storage.StorageWriter``
  (DCP's own gather and scatter around ``prepare_global_plan`` and ``finish``).
- the **framework plug**: how leaves are described, copied and rebuilt. Under the
  key-value agreement, ``controller/framework.Framework`` (``save_leaves``,
  ``restore_target``: JAX's, PyTorch's tensors in Orbax's layout, numpy's); under DCP's,
  DCP's own planner over the state dict.

Both plugs copy into the arena through the one stager (``staging.copy_in``), and both
start the replication at the same phase: once every host's part is staged, before
the commit.
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Callable
from typing import Any

from sidecar._src.controller.checkpoint.restore import Restorer, RestoreStats
from sidecar._src.controller.checkpoint.save import SaveCoordinator
from sidecar._src.controller.checkpoint.save_protocol import End
from sidecar._src.controller.checkpoint.target import SaveHandle, Target
from sidecar._src.core import interrupts


class Agreement(abc.ABC):
  """Who drives a step's phases on the sidecars, and how the processes agree (see the module)."""

  @abc.abstractmethod
  def target(self, directory: str, step: int) -> Target:
    """Where step ``step`` of ``directory`` goes, in the layout of the format it saves."""

  @abc.abstractmethod
  def start(self, target: Target, tree: Any, *, data_state_json: str, key: str,
            handle: SaveHandle, end: End) -> None:
    """Copies ``tree`` into the arenas (returns once this process's copy is made or on its
    way: ``handle.staged`` resolves when staged) and writes ``target`` in the background;
    calls ``end`` once, from a thread of its own, when the step is committed (and the RAM
    tiers told) or the save failed. ``key``: the save's agreement keys' prefix."""

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

  def start(self, target: Target, tree: Any, *, data_state_json: str, key: str,
            handle: SaveHandle, end: End) -> None:
    self.coordinator.save_to(target, tree, data_state_json=data_state_json, key=key,
                             handle=handle, end=end)

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
