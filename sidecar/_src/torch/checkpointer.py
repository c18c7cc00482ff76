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
import itertools
import json
import logging
import os
import threading
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from sidecar._src.controller import controller as core
from sidecar._src.controller.checkpoint.retention import Retention
from sidecar._src.controller.checkpoint.target import SaveHandle, done_handle
from sidecar._src.core import errors
from sidecar._src.torch import controller as torch_controller, storage

log = logging.getLogger(__name__)
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
    replicas: peer sidecars that also keep each shard (see ``StorageWriter``).
    if_busy: what ``save`` does while the previous save is not durable yet: ``"wait"``
      for it (the default), or ``"skip"`` this save (its handle's futures hold None), as
      ``ctl.checkpointer``'s; every rank takes the same decision.
    controller: default this rank's, from :func:`sidecar.torch.connect`.
  """

  def __init__(self, directory: str | os.PathLike, *, max_to_keep: int | None = None,
               replicas: int = 0, if_busy: str = "wait",
               controller: core.Controller | None = None):
    if if_busy not in ("wait", "skip"):
      raise errors.InvalidArgumentError(f"if_busy must be 'wait' or 'skip', got {if_busy!r}")
    if max_to_keep is not None and (not isinstance(max_to_keep, int) or max_to_keep < 1):
      raise errors.InvalidArgumentError(f"max_to_keep must be None or >= 1, got {max_to_keep!r}")
    self.directory = os.path.abspath(os.fspath(directory))
    self.max_to_keep, self.replicas = max_to_keep, replicas
    self._ctl = torch_controller.controller_or_connect(controller)
    self._client = self._ctl._checkpoint_client()
    self._host = self._ctl.local_hosts[0]
    # Saves run on their own thread: their collectives get a group of their own, so they
    # never interleave with the training step's on the default group.
    self._group: Any = (dist.new_group(backend="gloo")
                   if dist.is_initialized() and dist.get_world_size() > 1 else None)
    self._last: SaveHandle | None = None
    self._if_busy, self._key, self._saves = if_busy, f"torch-ckpt/{next(_instances)}", 0
    self._lock = threading.Lock()
    self._closed = False
    lead = self._ctl.peers.index == 0
    steps = self._client.open(self._host, self.directory, ram_steps=1, ram_budget=None,
                              sweep=lead).result()
    # The core's retention, as ``ctl.checkpointer``'s: rank 0 deletes, every rank forgets
    # a deleted step in its sidecar's RAM tier, a failed delete is logged and retried.
    self._retention = Retention(client=self._client, directory=self.directory,
                                local=[self._host], lead=lead, max_to_keep=max_to_keep,
                                keep_period=None, steps=list(steps))

  def all_steps(self) -> list[int]:
    """The committed steps, ascending."""
    return self._retention.all()

  def latest_step(self) -> int | None:
    steps = self.all_steps()
    return steps[-1] if steps else None

  def save(self, step: int, state_dict: dict[str, Any]) -> SaveHandle:
    """Saves ``state_dict`` as step ``step``; returns once it is staged (see the class)."""
    self._check_open()
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
      raise errors.InvalidArgumentError(f"step must be an int >= 0, got {step!r}")
    if self._busy(step) and self._if_busy == "skip":
      return done_handle(step, None)
    self._settle()  # one save at a time, as DCP's async_save asks
    writer = storage.StorageWriter(os.path.join(self.directory, str(step)),
                                   replicas=self.replicas, controller=self._ctl)
    response = dcp.async_save(state_dict, storage_writer=writer, process_group=self._group)
    upload = response if isinstance(response, concurrent.futures.Future) else (
        response.upload_completion)
    handle = self._last = SaveHandle(step, concurrent.futures.Future(),
                                     concurrent.futures.Future())
    handle.staged.set_result(step)

    def done(f: Any) -> None:
      try:
        f.result()
      except BaseException as e:
        handle.durable.set_exception(e)
        handle.replicated.set_exception(e)
        return
      self._retention.add(step)
      try:  # the step is durable whatever retention does: a failed delete is logged
        self._retention.collect()
      except errors.SidecarError as e:
        log.warning("could not delete old steps of %s: %s", self.directory, e)
      handle.durable.set_result(step)
      handle.replicated.set_result(step)  # StorageWriter.finish replicates before it returns
    upload.add_done_callback(done)
    return handle

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
        last.durable.result()
      finally:
        if self._last is last:
          self._last = None

  def _busy(self, step: int) -> bool:
    """Whether any rank's previous save is in flight; every rank must save ``step``."""
    last = self._last
    busy = last is not None and not last.durable.done()
    peers = self._ctl.peers
    if peers.count == 1:
      return busy
    self._saves += 1
    gathered = [json.loads(v) for v in peers.all_gather(
        f"{self._key}/save/{self._saves}", json.dumps({"step": step, "busy": busy}))]
    if len({g["step"] for g in gathered}) > 1:
      raise errors.InvalidArgumentError(
          f"the ranks disagree on the step of save {self._saves} in {self.directory}: "
          + "; ".join(f"rank {r}: step {g['step']}" for r, g in enumerate(gathered))
          + ". Every rank must call save with the same step, in the same order")
    return any(g["busy"] for g in gathered)

  def _settle(self) -> None:
    """Waits for the save in flight to end, durable or failed."""
    last = self._last
    if last is not None:
      concurrent.futures.wait([last.durable])

  def _check_open(self) -> None:
    if self._closed:
      raise errors.ClosedError("this Checkpointer is closed; make a new one")

  def close(self) -> None:
    """Waits for the last save; idempotent."""
    if self._closed:
      return
    try:
      self.wait()
    finally:
      self._closed = True

  def __enter__(self) -> Checkpointer:
    return self

  def __exit__(self, *exc: Any) -> None:
    self.close()
