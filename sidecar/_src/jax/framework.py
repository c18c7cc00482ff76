"""The JAX adapter of the controller core (``controller/framework.Framework``).

Devices are ``jax.Device``s and their global ids; a stream's arrays go onto a device
with ``jax/transfer``; a state tree's shards and a restore target's blocks come from
``jax/checkpoint``; the processes of a job exchange values through ``jax.distributed``
(``jax/distributed.JaxPeers``). Nothing here starts JAX's backends before a
Controller needs a device.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from sidecar._src.arena.worker import TrainerProcess
from sidecar._src.ckptfmt.records import ShardRecord
from sidecar._src.controller.framework import DeviceCopy, Framework, RestoreTarget, SaveLeaf
from sidecar._src.controller.peers import Peers
from sidecar._src.jax import checkpoint as jax_checkpoint, distributed, transfer
from sidecar._src.jax.worker import Worker


class JaxFramework(Framework):
  """JAX: ``jax.Array``s, ``jax.Device``s, ``jax.distributed``.

  Args:
    device_copies: whether a save copies each shard on its device and returns before
      the transfers to the host end (``jax/checkpoint.save_leaves``); None: on
      accelerators, not on CPU devices (whose shards are host memory already).
  """

  name = "jax"

  def __init__(self, *, device_copies: bool | None = None):
    self._device_copies = device_copies

  def peers(self) -> Peers:
    return distributed.peers()

  def process(self) -> TrainerProcess | None:
    return distributed.local_process()

  def local_device_ids(self) -> list[int]:
    return [d.id for d in jax.local_devices()]

  def worker(self, address: str | None, *, timeout: float, token: str | None = None) -> Worker:
    return Worker(address, timeout=timeout, token=token)

  def to_device(self, tree: Any, device: Any) -> Any:
    return transfer.to_devices(tree, device)

  def save_leaves(self, tree: Any) -> list[SaveLeaf]:
    return jax_checkpoint.save_leaves(tree, device_copies=self._device_copies)

  def restore_target(self, target: Any) -> RestoreTarget:
    return jax_checkpoint.restore_target(target)

  def restore_on_device(self, target: Any,
                        copies: Sequence[tuple[ShardRecord, DeviceCopy | np.ndarray]]
                        ) -> Any | None:
    return jax_checkpoint.restore_on_device(target, copies)
