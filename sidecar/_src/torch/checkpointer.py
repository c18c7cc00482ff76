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
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from sidecar._src.controller import controller as core
from sidecar._src.controller.checkpoint.options import CheckpointOptions, options_or
from sidecar._src.controller.checkpoint.retention import Retention
from sidecar._src.controller.checkpoint.save_protocol import agree_on_save, end_save
from sidecar._src.controller.checkpoint.target import SaveHandle, done_handle
from sidecar._src.core import errors, interrupts
from sidecar._src.torch import controller as torch_controller, storage

__all__ = ["CheckpointOptions", "Checkpointer", "SaveHandle"]

_instances = itertools.count()  # every rank makes its Checkpointers in the same order


class Checkpointer:
  """Steps of a training run as DCP checkpoints under ``directory``, through the sidecars.

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
    replicas: peer sidecars that also keep each shard (see ``StorageWriter``);
      ``handle.replicated`` resolves once every rank's part has its copies.
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
    self.options = options_or(options, max_to_keep=max_to_keep, replicas=replicas,
                                    if_busy=if_busy)
    self.directory = os.path.abspath(os.fspath(directory))
    self._ctl = torch_controller.controller_or_connect(controller)
    site = self._ctl.checkpoint_sidecars()
    self._host = site.local[0]
    # Saves run on their own thread: their collectives get a group of their own, so they
    # never interleave with the training step's on the default group.
    self._group: Any = (dist.new_group(backend="gloo")
                   if dist.is_initialized() and dist.get_world_size() > 1 else None)
    self._last: SaveHandle | None = None
    self._key, self._saves = f"torch-ckpt/{next(_instances)}", 0
    self._enders: list[threading.Thread] = []  # each ends a save (durable, replicated)
    self._closed = False
    lead = self._ctl.peers.index == 0
    steps = site.client.open(self._host, self.directory, ram_steps=self.options.ram_steps,
                             ram_budget=self.options.ram_budget, sweep=lead).result()
    # The core's retention, as ``ctl.checkpointer``'s: rank 0 deletes, every rank forgets
    # a deleted step in its sidecar's RAM tier, a failed delete is logged and retried.
    self._retention = Retention(client=site.client, directory=self.directory,
                                local=[self._host], lead=lead,
                                max_to_keep=self.options.max_to_keep,
                                keep_period=self.options.keep_period, steps=list(steps))

  def all_steps(self) -> list[int]:
    """The committed steps, ascending."""
    return self._retention.all()

  def latest_step(self) -> int | None:
    steps = self.all_steps()
    return steps[-1] if steps else None

  @interrupts.deferring  # Ctrl-C: the copy stops, nothing is saved; a save begun goes on
  def save(self, step: int, state_dict: dict[str, Any]) -> SaveHandle:
    """Saves ``state_dict`` as step ``step``; returns once it is staged (see the class)."""
    self._check_open()
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
      raise errors.InvalidArgumentError(f"step must be an int >= 0, got {step!r}")
    last = self._last
    self._saves += 1
    key = f"{self._key}/save/{self._saves}"
    busy = agree_on_save(self._ctl.peers, key, step, last is not None and not last.durable.done(),
                         what=f"save {self._saves} in {self.directory}")
    if busy and self.options.if_busy == "skip":
      return done_handle(step, None)
    self._settle()  # one save at a time, as DCP's async_save asks
    writer = storage.StorageWriter(os.path.join(self.directory, str(step)),
                                   options=self.options, controller=self._ctl)
    response = dcp.async_save(state_dict, storage_writer=writer, process_group=self._group)
    upload = response if isinstance(response, concurrent.futures.Future) else (
        response.upload_completion)
    handle = self._last = SaveHandle(step, concurrent.futures.Future(),
                                     concurrent.futures.Future())
    handle.staged.set_result(step)
    if not writer.replicas:
      handle.replicated.set_result(step)
    upload.add_done_callback(functools.partial(self._start_end, handle, writer, key))
    return handle

  def _start_end(self, handle: SaveHandle, writer: storage.StorageWriter, key: str,
                 upload: concurrent.futures.Future) -> None:
    """The save's upload ended (DCP's thread): the core's end of a save (``end_save``:
    the step listed, ``durable``, retention, then ``replicated`` with every rank) runs
    on a thread of this Checkpointer's, which ``close`` joins."""
    def replication() -> BaseException | None:  # rank 0 replicated every host's part
      return writer.replicated.exception() if writer.replicated is not None else None

    try:
      error = upload.exception()
    except concurrent.futures.CancelledError as e:
      error = e
    ender = threading.Thread(
        target=end_save, args=(handle, error),
        kwargs={"listed": functools.partial(self._retention.add, handle.step),
                "collect_garbage": self._retention.collect, "replication": replication,
                "peers": self._ctl.peers, "key": key},
        daemon=True, name=f"sidecar-torch-save-{handle.step}")
    self._enders = [t for t in self._enders if t.is_alive()] + [ender]
    ender.start()

  @interrupts.deferring
  def restore(self, step: int | None, state_dict: dict[str, Any]) -> dict[str, Any]:
    """Loads step ``step`` (None: the latest) into ``state_dict`` in place, as ``dcp.load``;
    returns it."""
    self._check_open()
    self._settle()
    step = self.latest_step() if step is None else step
    if step is None:
      raise errors.InvalidArgumentError(f"no committed step in {self.directory} to restore")
    dcp.load(state_dict, storage_reader=storage.StorageReader(
        os.path.join(self.directory, str(step)), controller=self._ctl),
        process_group=self._group)
    return state_dict

  def wait(self) -> None:
    """Waits for the last save to be durable; raises its error, if any, once (its
    ``handle.durable`` keeps it). ``save`` and ``restore`` wait for it to end, and leave
    its error to its handle and here: one failed save fails nothing after it."""
    last = self._last
    if last is not None:
      try:
        interrupts.wait_done(last.durable)
        last.durable.result()
      finally:
        if self._last is last:
          self._last = None

  def _settle(self) -> None:
    """Waits for the save in flight to end, durable or failed."""
    last = self._last
    if last is not None:
      interrupts.wait_done(last.durable)

  def _check_open(self) -> None:
    if self._closed:
      raise errors.ClosedError("this Checkpointer is closed; make a new one")

  def close(self) -> None:
    """Waits for the last save (and its replication's outcome); idempotent."""
    if self._closed:
      return
    try:
      self.wait()
    finally:
      self._closed = True
      for ender in self._enders:
        ender.join()
      self._enders = []

  def __enter__(self) -> Checkpointer:
    return self

  def __exit__(self, *exc: Any) -> None:
    self.close()
