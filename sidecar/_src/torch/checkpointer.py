"""``sidecar.torch.Checkpointer``: numbered steps of DCP checkpoints through the sidecars.

The PyTorch counterpart of ``ctl.checkpointer``: ``save(step, state_dict)`` runs
``dcp.async_save`` with :class:`~sidecar._src.torch.storage.StorageWriter` into
``<directory>/<step>`` and returns once this rank's tensors are copied into its sidecar's
arena (``handle.staged``); the sidecars write and commit in the background
(``handle.durable``), then steps beyond ``max_to_keep`` are deleted. ``restore`` runs
``dcp.load`` with :class:`~sidecar._src.torch.storage.StorageReader`: from the RAM tier
when the sidecars kept the step, else from storage. Each step is a plain DCP checkpoint:
``dcp.load(sd, storage_reader=FileSystemReader(f"{directory}/{step}"))`` reads it too.
Every rank makes the same calls in the same order.
"""

from __future__ import annotations

import concurrent.futures
import functools
import itertools
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from sidecar._src.ckptfmt import registry as formats_lib
from sidecar._src.controller import controller as core
from sidecar._src.controller.checkpoint import checkpointer as checkpointer_lib
from sidecar._src.controller.checkpoint.options import CheckpointOptions, options_or
from sidecar._src.controller.checkpoint.plugs import Driver, Setup
from sidecar._src.controller.checkpoint.restore import RestoreStats
from sidecar._src.controller.checkpoint.save_protocol import Target
from sidecar._src.controller.checkpoint.save_run import Ending, SaveHandle
from sidecar._src.core import errors, interrupts
from sidecar._src.torch import controller as torch_controller, storage

__all__ = ["CheckpointOptions", "Checkpointer", "DcpDriver", "SaveHandle"]

_instances = itertools.count()  # every rank makes its Checkpointers in the same order


class Checkpointer(checkpointer_lib.Checkpointer):
  """Steps of a training run as DCP checkpoints under ``directory``, through the sidecars:
  the one :class:`~sidecar._src.controller.checkpoint.checkpointer.Checkpointer` (as
  ``ctl.checkpointer``'s, ``sidecar.jax.Checkpointer``) with DCP's driver
  (:class:`DcpDriver`).

  Example::

    ckpt = sidecar.torch.Checkpointer("/ckpt/run1", max_to_keep=3)
    start = ckpt.latest_step()
    if start is not None:
      ckpt.restore(start, state)          # state: {"model": ..., "optim": ..., "data": ...}
    ...
    ckpt.save(step, state)                # returns after one copy into the arena
    ckpt.close()                          # waits for the last save to be durable

  Args:
    directory: where the steps go, ``<directory>/<step>``.
    max_to_keep: the newest steps kept; older ones are deleted once a newer is durable.
    replicas: other sidecars that also keep each shard (see ``StorageWriter``);
      ``handle.replicated`` resolves once every rank's part has its copies (at once,
      holding the step, with none).
    if_busy: what ``save`` does while the previous save is not durable yet: ``"wait"``
      for it (the default), or ``"skip"`` this save (its handle's futures hold None), as
      ``ctl.checkpointer``'s; every rank takes the same decision.
    options: a :class:`CheckpointOptions` (the same as ``ctl.checkpointer``'s) instead of
      the keyword arguments above; it also sets ``ram_steps``, ``ram_budget``,
      ``keep_period`` and ``replica_bandwidth``.
    controller: default this rank's, from :func:`sidecar.torch.connect`.
  """

  def __init__(self, directory: str | os.PathLike, *, max_to_keep: int | None = None,
               replicas: int = 0, if_busy: str = "wait",
               options: CheckpointOptions | None = None,
               controller: core.Controller | None = None):
    options = options_or(options, max_to_keep=max_to_keep, replicas=replicas, if_busy=if_busy)
    ctl = torch_controller.controller_or_connect(controller)
    # Saves run on their own thread: their collectives get a group of their own, so they
    # never interleave with the training step's on the default group.
    group: Any = (dist.new_group(backend="gloo")
                  if dist.is_initialized() and dist.get_world_size() > 1 else None)
    super().__init__(
        directory, site=ctl.checkpoint_sidecars(), options=options, peers=ctl.peers,
        driver=functools.partial(DcpDriver, controller=ctl, group=group),
        key=f"torch-ckpt/{next(_instances)}")


class DcpDriver(Driver):
  """DCP's driver: ``dcp.async_save`` with :class:`~sidecar._src.torch.storage.
  StorageWriter` (DCP's coordinator rank begins and commits, DCP's planner describes the
  state dict), ``dcp.load`` with ``StorageReader``. Each step is a plain DCP checkpoint:
  ``dcp.load(sd, storage_reader=FileSystemReader(f"{directory}/{step}"))`` reads it too.
  """

  def __init__(self, setup: Setup, *, controller: core.Controller, group: Any):
    self._options, self._ctl, self._group = setup.options, controller, group
    self._directory = setup.directory
    self._fmt = formats_lib.DEFAULT.get(storage.dcp_format(setup.options))
    self._last: SaveHandle | None = None
    self._restored: RestoreStats | None = None  # where the last restore's items came from
    self._lock = threading.Lock()
    self._pending: list[threading.Event] = []  # set once a save called its end

  def target(self, directory: str, step: int) -> Target:
    """A DCP step is a checkpoint of its own, ``<directory>/<step>``: what Begin takes."""
    return Target.for_step(self._fmt, os.path.join(directory, str(step)), step,
                           directory=directory)

  def start(self, target: Target, tree: Any, *, data_state_json: str, ending: Ending
            ) -> None:
    if data_state_json:
      raise errors.InvalidArgumentError(
          "sidecar.torch.Checkpointer keeps the data position in the state dict "
          "(state['data'] = loader.state_dict()), not as data_state")
    self._settle()  # one save at a time, as DCP's async_save asks
    writer = storage.StorageWriter(target.final_dir, options=self._options,
                                   controller=self._ctl)
    writer.ending = ending  # its step's run ends the Checkpointer's save
    handle = ending.handle
    response = dcp.async_save(tree, storage_writer=writer, process_group=self._group)
    upload = response if isinstance(response, concurrent.futures.Future) else (
        response.upload_completion)
    handle.staged.set_result(target.step)
    self._last = handle
    done = threading.Event()
    with self._lock:
      self._pending = [e for e in self._pending if not e.is_set()] + [done]
    upload.add_done_callback(functools.partial(self._ended, writer, target, done))

  @staticmethod
  def _ended(writer: storage.StorageWriter, target: Target, done: threading.Event,
             upload: concurrent.futures.Future) -> None:
    """The save's upload ended (on DCP's thread, which ends it: ``SaveRun.end``)."""
    try:
      error = upload.exception()
    except concurrent.futures.CancelledError as e:
      error = e
    try:
      writer.end(error, target)
    finally:
      done.set()

  def restore(self, step: int, target: Any, *, progress: Callable[[str], None] | None
              ) -> Any:
    """Loads step ``step`` into the state dict ``target`` in place, as ``dcp.load``."""
    del progress
    self._settle()  # one save or load at a time, as DCP asks
    reader = storage.StorageReader(os.path.join(self._directory, str(step)),
                                   controller=self._ctl)
    reader.check()  # a step of another format is named here: dcp.load would wrap it
    t0 = time.perf_counter()
    try:
      dcp.load(target, storage_reader=reader, process_group=self._group)
    except CheckpointException as e:  # the sidecars' error as itself (a corrupt step's
      found = next((f for f, _ in e.failures.values()  # is what fallback=True skips)
                    if isinstance(f, errors.SidecarError)), None)
      if found is None:
        raise
      raise found.with_traceback(None) from e
    self._restored = RestoreStats(step, time.perf_counter() - t0, dict(reader.sources),
                                  dict(reader.source_bytes))
    return target

  def last_restore_stats(self) -> RestoreStats | None:
    """Where this rank's items of the last restore came from (its ``dcp.load``'s reads)."""
    return self._restored

  def _settle(self) -> None:
    """Waits for the save in flight to end, durable or failed."""
    last = self._last
    if last is not None:
      interrupts.wait_done(last.durable)

  def join(self) -> None:
    with self._lock:
      pending = list(self._pending)
    for done in pending:
      while not done.wait(interrupts.POLL_S):  # a wait Ctrl-C can stop
        interrupts.check()
